"""Render pages of the built documentation site to PNG with headless Chromium, to look at them as a
reader would (navigation, code blocks, tables). Not a test: a tool for whoever changes the docs.

    python -m sphinx -W -b html docs docs/_build/html      # build first (docs/index.md)
    python tools/render_docs.py                            # -> docs/_build/png/*.png
    python tools/render_docs.py --pages index api/dtshard.fsdp --width 1280

Needs Debian's ``chromium`` package (``apt-get install -y chromium``) or any Chromium/Chrome on
PATH (``--chromium`` names another binary). Each page is rendered at the given window size,
tall enough for a long page (``--height``), so the PNG shows the page from its top.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_PAGES = ["index", "getting-started", "api/dtshard"]


def chromium_binary(name: str | None) -> str:
    for candidate in ([name] if name else ["chromium", "chromium-browser", "google-chrome", "chrome"]):
        path = shutil.which(candidate)
        if path:
            return path
    raise SystemExit("render_docs: no Chromium found; install Debian's package: apt-get install -y chromium")


def render(binary: str, html: Path, png: Path, width: int, height: int) -> None:
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:  # a throwaway profile: no state between pages
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
               f"--user-data-dir={profile}", f"--window-size={width},{height}",
               f"--screenshot={png}", html.as_uri()]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if proc.returncode != 0 or not png.exists():
        raise SystemExit(f"render_docs: chromium failed on {html}:\n{proc.stderr[-2000:]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--site", default=str(ROOT / "docs" / "_build" / "html"), help="the built site")
    p.add_argument("--out", default=str(ROOT / "docs" / "_build" / "png"), help="where the PNGs go")
    p.add_argument("--pages", nargs="+", default=DEFAULT_PAGES, help="pages, without .html")
    p.add_argument("--width", type=int, default=1280)
    p.add_argument("--height", type=int, default=1600)
    p.add_argument("--chromium", default=None, help="the Chromium binary (default: found on PATH)")
    args = p.parse_args(argv)
    site, out = Path(args.site), Path(args.out)
    if not (site / "index.html").exists():
        raise SystemExit(f"render_docs: no site at {site}; build it: python -m sphinx -W -b html docs {site}")
    binary = chromium_binary(args.chromium)
    for page in args.pages:
        html = site / f"{page}.html"
        if not html.exists():
            raise SystemExit(f"render_docs: {html} does not exist")
        png = out / (page.replace("/", "_") + ".png")
        render(binary, html, png, args.width, args.height)
        print(png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
