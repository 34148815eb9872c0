"""Every code example of the documentation runs (issue #56): the pages under ``docs/``, the README
and CONTRIBUTING.md.

The Python blocks of a page run in order in one namespace (a fresh one per page), as a reader would
run them. A marker right above a block (an HTML comment, invisible on the rendered page) says how
else to run it:

- ``<!-- docs-test: skip: REASON -->``: a fragment (it needs a model, a loader, 8 ranks or a GPU);
  the reason is required and shown here when the block is listed;
- ``<!-- docs-test: ranks=N -->``: the block runs on each of N ranks of the test harness's worker
  pools (gloo, a process group per rank, no torchrun), in a namespace of its own;
  ``ranks=N main`` runs the block's ``main()`` on the ranks, then the block itself in this
  process as ``__main__`` with ``dtshard.testing.launch`` returning those results, so its printed
  output can be compared with the page's;
- ``<!-- docs-test: file=NAME.py -->``: the block is (a part of) a file; every file of the page is
  written to a temporary folder on ``sys.path`` before the page's blocks run, and the tests of a
  ``test_*.py`` file are run after them;
- ``<!-- docs-test: run -->`` above a ``sh`` block: its ``python -m dtshard.validate ...`` lines run
  in this process (``status=N`` for the expected exit status, default 0);
- ``<!-- docs-test: expect-output -->`` above a ``text`` block: every line of it, whitespace
  collapsed, appears in what the block before printed.

A marked block that cannot be run as marked fails the test, so a marker cannot hide a block.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from unittest import mock

import pytest

import dtshard.testing
from dtshard.testing import run_distributed

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(```+)\s*([\w+-]*)\s*$")


@dataclass
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    marker: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks_of(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown page, each with the marker right above it (if any)."""
    lines = path.read_text().splitlines()
    out, i, marker = [], 0, ""
    while i < len(lines):
        m = MARKER.match(lines[i])
        if m:
            marker = m.group(1)
            i += 1
            continue
        f = FENCE.match(lines[i])
        if f:
            indent, ticks, lang = f.groups()
            j = i + 1
            while j < len(lines) and not re.match(rf"^\s*{ticks}\s*$", lines[j]):
                j += 1
            body = "\n".join(ln[len(indent):] if ln.startswith(indent) else ln for ln in lines[i + 1:j])
            out.append(Block(path.relative_to(ROOT).as_posix(), i + 1, lang, textwrap.dedent(body) + "\n", marker))
            i, marker = j + 1, ""
            continue
        if lines[i].strip():
            marker = ""  # a marker belongs to the block right below it
        i += 1
    return out


def _options(marker: str) -> dict:
    """``ranks=2 main`` -> {"ranks": "2", "main": True}."""
    if marker.startswith("skip:"):
        return {"skip": marker[len("skip:"):].strip()}
    opts = {}
    for word in marker.split():
        key, eq, value = word.partition("=")
        opts[key] = value if eq else True
    return opts


def _exec_on_rank(code: str, where: str, call_main: bool, files_dir: str | None):
    """Worker side of a ``ranks=N`` block: run it in a namespace of its own on this rank."""
    if files_dir and files_dir not in sys.path:
        sys.path.insert(0, files_dir)
    ns = {"__name__": "__docs_example__"}
    exec(compile(code, where, "exec"), ns)
    return ns["main"]() if call_main else None


def _normalize(text: str) -> str:
    return " ".join(text.split())


def _run_validate_lines(block: Block, status: int) -> str:
    from dtshard.validate.__main__ import main as validate

    out = io.StringIO()
    for line in block.code.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        prefix = "python -m dtshard.validate "
        assert line.startswith(prefix), f"{block.where}: a `run` sh block may hold only `{prefix.strip()}` lines: {line}"
        with contextlib.redirect_stdout(out):
            got = validate(shlex.split(line[len(prefix):]))
        assert got == status, f"{block.where}: `{line}` exited {got}, the page says {status}\n{out.getvalue()}"
    return out.getvalue()


def _check_output(block: Block, printed: str | None) -> None:
    assert printed is not None, f"{block.where}: expect-output below a block that printed nothing it ran"
    have = _normalize(printed)
    for line in block.code.splitlines():
        if line.strip():
            assert _normalize(line) in have, (
                f"{block.where}: the page shows\n  {line.strip()}\nwhich the block above did not print:\n{printed}")


def run_page(path: Path, tmp_path: Path) -> list[str]:
    """Run every runnable block of ``path``; return the skipped blocks with their reasons."""
    blocks = blocks_of(path)
    files: dict[str, list[str]] = {}
    for b in blocks:
        opts = _options(b.marker)
        if "file" in opts:
            files.setdefault(opts["file"], []).append(b.code)
    files_dir = None
    if files:
        files_dir = str(tmp_path / re.sub(r"\W", "_", path.stem))
        os.makedirs(files_dir, exist_ok=True)
        for name, parts in files.items():
            Path(files_dir, name).write_text("\n".join(parts))
        sys.path.insert(0, files_dir)
    skipped, printed = [], None
    ns = {"__name__": f"__docs_{path.stem}__"}
    try:
        for b in blocks:
            opts = _options(b.marker)
            if b.lang == "text" and "expect-output" in opts:
                _check_output(b, printed)
                continue
            if "skip" in opts:
                assert len(opts["skip"]) >= 10, f"{b.where}: a skipped block needs its reason"
                skipped.append(f"{b.where}: {opts['skip']}")
                continue
            if b.lang in ("sh", "bash", "console"):
                if "run" in opts:
                    printed = _run_validate_lines(b, int(opts.get("status", 0)))
                else:
                    assert not opts, f"{b.where}: marker {b.marker!r} on a shell block"
                continue
            if b.lang != "python" or "file" in opts:
                continue
            out = io.StringIO()
            if "ranks" in opts:
                n, call_main = int(opts["ranks"]), "main" in opts
                results = run_distributed(_exec_on_rank, n, b.code, b.where, call_main, files_dir, timeout=120)
                if call_main:
                    fake_launch = lambda fn, world_size, *a, **k: results  # noqa: E731
                    with mock.patch.object(dtshard.testing, "launch", fake_launch), contextlib.redirect_stdout(out):
                        exec(compile(b.code, b.where, "exec"), {"__name__": "__main__"})
            else:
                assert not set(opts) - {"run"}, f"{b.where}: unknown marker {b.marker!r}"
                with contextlib.redirect_stdout(out):
                    exec(compile(b.code, b.where, "exec"), ns)
            printed = out.getvalue()
        for name in files:
            if name.startswith("test_") and name.endswith(".py"):
                module = importlib.import_module(name[:-3])
                tests = [getattr(module, t) for t in dir(module) if t.startswith("test_")]
                assert tests, f"{path.name}: {name} has no tests"
                for t in tests:
                    t()
    finally:
        if files_dir:
            sys.path.remove(files_dir)
    return skipped


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_page_examples_run(page, tmp_path):
    skipped = run_page(page, tmp_path)
    for s in skipped:
        print("skipped fragment:", s)


def test_every_python_block_is_run_or_marked():
    """A Python block is either run (as it stands, on ranks, or as a file) or marked a fragment
    with a reason; no other marker exists, so a typo cannot turn a block off."""
    known = {"ranks", "main", "file", "run", "status", "expect-output", "skip"}
    n_python = 0
    for page in PAGES:
        for b in blocks_of(page):
            opts = _options(b.marker)
            assert set(opts) <= known, f"{b.where}: unknown docs-test marker {b.marker!r}"
            n_python += b.lang == "python"
    assert n_python > 20


def test_the_checks_can_fail(tmp_path):
    """The runner is not a rubber stamp: a wrong shown output, a failing block and a skip without
    a reason each fail it."""
    ROOT_TMP = tmp_path / "docs"
    ROOT_TMP.mkdir()
    cases = {
        "wrong_output": '```python\nprint("rank 0: 3 rows")\n```\n\n<!-- docs-test: expect-output -->\n```text\nrank 0: 2 rows\n```\n',
        "failing_block": "```python\nassert 1 + 1 == 3\n```\n",
        "skip_without_reason": "<!-- docs-test: skip: -->\n```python\nx = 1\n```\n",
    }
    for name, text in cases.items():
        page = ROOT_TMP / f"{name}.md"
        page.write_text(text)
        with mock.patch(f"{__name__}.ROOT", tmp_path), pytest.raises(AssertionError):
            run_page(page, tmp_path)


def test_every_setting_is_documented():
    """docs/api/config.rst shows every setting of ``dtshard.config`` with its default and the
    ``#:`` comment above it (what autodoc reads): a setting without one would show a bare value."""
    import dtshard

    lines = (ROOT / "dtshard" / "_config.py").read_text().splitlines()
    settings = [n for n in vars(dtshard.config) if not n.startswith("_")]
    assert len(settings) > 10
    for name in settings:
        (i,) = [k for k, ln in enumerate(lines) if re.match(rf"^    {name}\s*[:=]", ln)]
        assert lines[i - 1].strip().startswith("#:"), f"dtshard.config.{name} has no #: comment above it"


#: names of a module's ``__all__`` its API page leaves out on purpose, and why
API_LEFT_OUT = {
    "dtshard": {"config": "its own page, docs/api/config.rst", "debug": "a module: its own page",
                "experimental": "a module: its own page"},
    "dtshard.handlers": {"DTensor": "re-exported for handlers; documented under dtshard"},
}


def test_the_api_reference_lists_every_public_name():
    """Each module's page under docs/api/ lists every name of the module's ``__all__`` (the
    autosummary entries the reference is generated from), so a new public name gets a page."""
    for page in sorted((ROOT / "docs" / "api").glob("dtshard*.rst")):
        module = page.stem
        text = page.read_text()
        entries = set(re.findall(r"^   (\w+)$", text, flags=re.M))
        names = set(importlib.import_module(module).__all__) - set(API_LEFT_OUT.get(module, {}))
        assert names <= entries, f"docs/api/{page.name} misses {sorted(names - entries)}"
    pages = {p.stem for p in (ROOT / "docs" / "api").glob("dtshard*.rst")}
    for module in ("dtshard", "dtshard.parallel", "dtshard.fsdp", "dtshard.debug", "dtshard.experimental",
                   "dtshard.checkpoint", "dtshard.spatial", "dtshard.registry", "dtshard.handlers"):
        assert module in pages, f"no API page for {module}"


def test_readme_and_contributing_links_resolve():
    """The README and CONTRIBUTING.md are read on the repository's page, outside the Sphinx build
    (which checks the docs' own links): their relative links must name files that exist."""
    for name in ("README.md", "CONTRIBUTING.md"):
        text = (ROOT / name).read_text()
        links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
        assert links, name
        for link in links:
            if "://" in link:
                continue
            assert (ROOT / link).exists(), f"{name}: the link ({link}) names no file"
