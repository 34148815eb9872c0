"""The package's import graph (every ``import``/``from`` of a dtshard module, at the top of a file
or inside a function): no import circle, no import from a lower layer into a higher one (the layer
table below, also in docs/ARCHITECTURE.md), handlers that use the handler kit and public names
only, and ``dtshard_kernels`` (``kernels/dtshard_kernels/``) never imports dtshard."""
from __future__ import annotations

import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

#: import circles allowed: none (issue #28 took the last one apart: the halo feature plugs into
#: the dispatcher through dtshard.hooks.layout_extension; the tensor class binds itself into it)
KNOWN_CIRCLE: set = set()


def _modules(package_dir: str, name: str) -> dict[str, str]:
    out = {}
    for dirpath, _, files in os.walk(package_dir):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), package_dir)[:-3].replace(os.sep, ".")
                mod = name if rel == "__init__" else f"{name}.{rel.removesuffix('.__init__')}"
                out[mod] = os.path.join(dirpath, f)
    return out


def _imports(path: str, mods: dict[str, str], prefix: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == prefix:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in mods else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == prefix)
    return {m for m in found if m in mods}


def _circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_new_import_circles():
    mods = _modules(os.path.join(ROOT, "dtshard"), "dtshard")
    graph = {m: _imports(p, mods, "dtshard") - {m} for m, p in mods.items()}
    circles = _circles(graph)
    assert all(c <= KNOWN_CIRCLE for c in circles), [sorted(c) for c in circles]
    # the circles taken apart stay apart
    assert "dtshard.propagate" not in graph["dtshard.redistribute"]
    assert not graph["dtshard.fsdp._group"] & {"dtshard.fsdp._api", "dtshard.fsdp._state"}
    assert graph["dtshard._config"] == set()  # dtshard.config sits at the bottom
    assert graph["dtshard.hooks"] == set()  # the extension points too: every layer may use them
    # features plug in through dtshard.hooks: the tensor class does not import them
    assert not graph["dtshard.tensor"] & {"dtshard.grad_buckets", "dtshard.parallel._linear", "dtshard.rules.pointwise"}
    assert not {m for m in graph["dtshard.dispatch"] if m.startswith("dtshard.spatial")}  # halos plug in


def test_kernels_never_import_dtshard():
    kdir = os.path.join(ROOT, "kernels", "dtshard_kernels")
    mods = _modules(kdir, "dtshard_kernels")
    assert "dtshard_kernels.triton.ops" in mods, f"no kernel modules found under {kdir}"
    dmods = _modules(os.path.join(ROOT, "dtshard"), "dtshard")
    for m, p in mods.items():
        assert not _imports(p, dmods, "dtshard"), m


def test_the_check_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [{"a", "b"}]


def _private_uses(path: str, package_dir: str) -> list[str]:
    """Private names of OTHER dtshard modules that the file at ``path`` uses: ``from dtshard.x
    import _name`` (a private submodule such as ``dtshard._config`` is a module, allowed) and
    ``mod._name`` on an imported dtshard module, at the top or inside a function."""
    tree = ast.parse(open(path).read())
    mods, bad = {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "dtshard":
            for alias in node.names:
                sub = os.path.join(package_dir, *f"{node.module}.{alias.name}".split(".")[1:])
                if os.path.exists(sub + ".py") or os.path.isdir(sub):
                    mods[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif alias.name.startswith("_"):
                    bad.append(f"from {node.module} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "dtshard" and alias.asname:
                    mods[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in mods
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            bad.append(f"{node.value.id}.{node.attr} ({mods[node.value.id]})")
    return sorted(set(bad))


def test_handlers_use_the_handler_kit_and_public_names_only():
    """Every module that registers a handler reaches the dispatcher, the tensor class and the other
    features through ``dtshard.handlers`` and public names, never a private name of another
    module (issue #28: the kit is the one place a handler's needs are kept)."""
    pdir = os.path.join(ROOT, "dtshard")
    found = {}
    for m, p in _modules(pdir, "dtshard").items():
        if "@register_handler" in open(p).read() and m not in ("dtshard.registry", "dtshard.handlers"):
            found[m] = _private_uses(p, pdir)
    assert "dtshard.spatial.conv" in found and "dtshard.rules.norm" in found  # the check sees them
    assert {m: v for m, v in found.items() if v} == {}


def test_the_private_name_check_finds_one(tmp_path):
    f = tmp_path / "h.py"
    f.write_text("from dtshard.dispatch import _mixed_error\nfrom dtshard import dispatch as D\n"
                 "def h():\n    from dtshard.spatial import halo_layout as SL\n    return D._DT, SL._depth, D.dispatch\n")
    assert _private_uses(str(f), os.path.join(ROOT, "dtshard")) == [
        "D._DT (dtshard.dispatch)", "SL._depth (dtshard.spatial.halo_layout)", "from dtshard.dispatch import _mixed_error"]


#: the layer of every module under dtshard/ (docs/ARCHITECTURE.md holds the same table): a module
#: imports its own layer or lower ones; ``name.*`` is the package and everything in it
LAYERS = {
    0: ["spec", "_config", "_trace", "hooks", "models", "testing.harness", "testing.sdpa_cuda_on_cpu",
        "testing._fork_server_freeze"],
    1: ["layout", "registry", "rules._common"],
    2: ["collectives"],
    3: ["redistribute.*", "spatial.halo"],
    4: ["propagate"],
    5: ["dispatch", "tensor"],
    6: ["handlers", "distribute", "factories", "composites", "experimental", "debug", "grad_buckets", "parallel._linear"],
    7: ["rules.*", "spatial.*", "parallel.*", "fsdp.*", "checkpoint"],
    8: ["dtshard", "demo.*", "testing", "validate.*"],
}
#: imports that run up the layers: none (the dispatcher reaches the halo feature through
#: dtshard.hooks.layout_extension since issue #28)
KNOWN_UPWARD: set = set()


def _layer(mod: str) -> int | None:
    name = "dtshard" if mod == "dtshard" else mod.removeprefix("dtshard.")
    for layer, names in LAYERS.items():  # exact names first: spatial.halo before spatial.*
        if name in names:
            return layer
    for layer, names in LAYERS.items():
        for n in names:
            if n.endswith(".*") and (name == n[:-2] or name.startswith(n[:-1])):
                return layer
    return None


def test_every_module_has_a_layer_and_no_import_runs_up():
    mods = _modules(os.path.join(ROOT, "dtshard"), "dtshard")
    assert {m for m in mods if _layer(m) is None} == set(), "give the new module a layer in LAYERS and docs/ARCHITECTURE.md"
    graph = {m: _imports(p, mods, "dtshard") - {m} for m, p in mods.items()}
    upward = {(a, b) for a, bs in graph.items() for b in bs if _layer(b) > _layer(a)}
    assert upward == KNOWN_UPWARD, sorted(upward - KNOWN_UPWARD) or f"fixed: remove {sorted(KNOWN_UPWARD - upward)}"


def test_the_layer_check_finds_an_upward_import():
    graph = {"dtshard.spec": {"dtshard.tensor"}, "dtshard.tensor": {"dtshard.spec"}}
    assert {(a, b) for a, bs in graph.items() for b in bs if _layer(b) > _layer(a)} == {("dtshard.spec", "dtshard.tensor")}


def test_the_architecture_page_holds_the_same_layer_table():
    import re

    rows = {}
    for line in open(os.path.join(ROOT, "docs", "ARCHITECTURE.md")):
        m = re.match(r"\|\s*(\d+)\s*\|([^|]*)\|", line)
        if m:
            rows[int(m.group(1))] = re.findall(r"`([^`]+)`", m.group(2))
    assert rows == LAYERS


def _local_imports(path: str) -> list[int]:
    """Line numbers of the imports of dtshard modules that are not at the top of the file."""
    tree = ast.parse(open(path).read())
    top = {id(n) for n in tree.body}
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top
            and any(name.split(".")[0] == "dtshard"
                    for name in ([n.module or ""] if isinstance(n, ast.ImportFrom) else [a.name for a in n.names]))]


def test_dtshard_modules_are_imported_at_the_top():
    """The import graph has no circle, so no dtshard import needs to hide inside a function; a
    function-local import is for an optional dependency only (triton, torch._dynamo, ...)."""
    mods = _modules(os.path.join(ROOT, "dtshard"), "dtshard")
    assert {m: ln for m, p in mods.items() if (ln := _local_imports(p))} == {}


def test_the_local_import_check_finds_one(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import torch\n\ndef f():\n    import torch._dynamo\n    from dtshard.spec import DTensorSpec\n")
    assert _local_imports(str(f)) == [5]
