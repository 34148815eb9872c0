"""Check that moving text between the README, CONTRIBUTING.md and the docs pages lost nothing
(issue #56): every line of the files as they were at a git revision must appear, whitespace
collapsed, somewhere in the files as they are now. Prints the lines that do not, so a reader can
judge each (a line rewritten on purpose, say a link to a section that became a page, is listed
too); a heading counts as found at any level. Exit status 1 when any is missing.

    python tools/check_docs_moved.py 33ef50d              # README.md and CONTRIBUTING.md at 33ef50d
    python tools/check_docs_moved.py 33ef50d --files README.md
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _norm(text: str) -> str:
    return " ".join(text.split())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rev", help="the git revision the text is checked from")
    p.add_argument("--files", nargs="+", default=["README.md", "CONTRIBUTING.md"])
    args = p.parse_args(argv)
    now = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
    have = "\n".join(_norm(f.read_text()) for f in now if "_build" not in f.parts)
    missing = 0
    for name in args.files:
        old = subprocess.run(["git", "show", f"{args.rev}:{name}"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
        for n, line in enumerate(old.splitlines(), 1):
            text = _norm(line.lstrip("#")) if line.startswith("#") else _norm(line)  # a heading may change level
            if text and text not in have:
                print(f"{name}:{n}: {line.strip()}")
                missing += 1
    print(f"{missing} line(s) not found", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
