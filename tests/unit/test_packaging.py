"""What a user installs: the wheel holds every module of the source tree, and one version.

The package list is discovered (setup.py), never written by hand; this test is the net under that:
it builds the wheel exactly as ``pip wheel`` does for a user and compares its ``.py`` files with
the source tree's, so a subpackage left out (a folder without ``__init__.py``, a discovery rule that
misses it) fails here, not in a user's ``import``. ``.ci/check_wheel`` goes further (installs that
wheel in a fresh venv and imports every module from outside the checkout).
"""

import email.parser
import importlib.metadata
import os
import shutil
import subprocess
import sys
import zipfile

import dtshard

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# source folder -> the import name it installs as
SOURCE_TREES = {"dtshard": "dtshard", "kernels/dtshard_kernels": "dtshard_kernels"}


def _source_modules() -> set[str]:
    found = set()
    for folder, package in SOURCE_TREES.items():
        top = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            rel = os.path.relpath(dirpath, top)
            prefix = package if rel == "." else package + "/" + rel.replace(os.sep, "/")
            found.update(f"{prefix}/{name}" for name in filenames if name.endswith(".py"))
    return found


# build outputs a previous build left in the checkout: setuptools would reuse build/lib and ship a
# module the discovery no longer finds, so the wheel is built from a copy without them
_BUILD_LEFTOVERS = shutil.ignore_patterns(
    ".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")


def _build_wheel(tmp_path) -> str:
    src, out_dir = tmp_path / "src", tmp_path / "dist"
    shutil.copytree(ROOT, src, ignore=_BUILD_LEFTOVERS)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(src), "-w", str(out_dir)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip wheel failed:\n{proc.stdout}\n{proc.stderr}"
    (wheel,) = [f for f in os.listdir(out_dir) if f.endswith(".whl")]
    return os.path.join(out_dir, wheel)


def test_wheel_holds_every_source_module_and_one_version(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.parser.Parser().parsestr(z.read(metadata_name).decode())
    in_wheel = {n for n in names if n.endswith(".py")}
    in_source = _source_modules()
    assert in_source, "found no source modules: the layout of the checkout changed"
    missing, extra = sorted(in_source - in_wheel), sorted(in_wheel - in_source)
    assert not missing, f"the wheel leaves out {len(missing)} source modules (a user's import fails): {missing}"
    assert not extra, f"the wheel carries modules the source tree does not have: {extra}"
    # every folder with modules is a package (a namespace folder would import differently installed)
    for module in in_source:
        package_init = module.rsplit("/", 1)[0] + "/__init__.py"
        assert package_init in in_source, f"{module}: its folder has no __init__.py"

    # one version, in one place (dtshard/__init__.py), and the metadata a user sees is complete
    assert metadata["Version"] == dtshard.__version__
    assert os.path.basename(wheel).startswith(f"dtshard-{dtshard.__version__}-")
    for field in ("Summary", "License-Expression", "Requires-Python", "Description-Content-Type"):
        assert metadata[field], f"wheel METADATA has no {field}"
    requires = metadata.get_all("Requires-Dist")
    assert any(r.startswith("torch>=") for r in requires), requires
    assert "LICENSE" in " ".join(names), "the wheel carries no license file"
    assert metadata.get_payload().lstrip().startswith("```sh"), "the long description is not the README"


def test_version_is_the_installed_distributions():
    assert dtshard.__version__ == importlib.metadata.version("dtshard")


# -- the layout: kernels/ at the top level, never an importable `kernels` ---------------------------
#
# The repository's top level has a folder kernels/ (holding the package dtshard_kernels), and
# `kernels` is also the import name of a PyPI distribution that transformers imports when it finds
# it. Any Python started in the repository root has that root first on sys.path, so kernels/ must
# never be a package (kernels/__init__.py, or a module kernels.py): it would shadow PyPI's.

_PROBE = r"""
import importlib.util, json, os, sys
root = os.path.realpath(os.getcwd())
def ours(path):
    return path is not None and os.path.realpath(path).startswith(root + os.sep)
out = {}
spec = importlib.util.find_spec("kernels")
out["regular_kernels_is_ours"] = spec is not None and ours(spec.origin)
import kernels
out["kernels_mark"] = getattr(kernels, "MARK", None)
out["kernels_file_is_ours"] = ours(getattr(kernels, "__file__", None))
try:
    import kernels.dtshard_kernels
    out["second_copy"] = kernels.dtshard_kernels.__file__
except ImportError as e:
    out["second_copy"] = None
    out["second_copy_error"] = str(e)
import dtshard_kernels, dtshard_kernels.reference
out["dtshard_kernels"] = dtshard_kernels.__name__
print(json.dumps(out))
"""

_TRANSFORMERS_PROBE = r"""
import importlib.metadata, json, os, sys
root = os.path.realpath(os.getcwd())
import transformers
from transformers import LlamaConfig
from transformers.utils import import_utils
LlamaConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16)
available = import_utils.is_kernels_available()   # transformers' own probe of the optional `kernels`
try:
    importlib.metadata.version("kernels")
    installed = True
except importlib.metadata.PackageNotFoundError:
    installed = False
loaded = sys.modules.get("kernels")
loaded_file = getattr(loaded, "__file__", None)
print(json.dumps({"available": available, "installed": installed,
                  "loaded_is_ours": loaded_file is not None and os.path.realpath(loaded_file).startswith(root + os.sep)}))
"""


def _probe(code: str, extra_path: str | None = None, lines: int = 1):
    import json

    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if extra_path:
        env["PYTHONPATH"] = extra_path
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"probe from the repository root failed:\n{proc.stdout}\n{proc.stderr}"
    got = [json.loads(line) for line in proc.stdout.strip().splitlines()[-lines:]]
    return got[0] if lines == 1 else got


def test_kernels_folder_never_shadows_pypi_kernels(tmp_path):
    assert os.path.isdir(os.path.join(ROOT, "kernels", "dtshard_kernels")), "the kernels live in kernels/dtshard_kernels/"
    for shadow in ("kernels/__init__.py", "kernels.py", "dtshard_kernels"):
        assert not os.path.exists(os.path.join(ROOT, shadow)), f"{shadow} in the repository root"
    assert not [f for f in os.listdir(os.path.join(ROOT, "kernels")) if f.endswith(".py")], \
        "a module in kernels/ is importable as kernels.<name> from the repository root"

    # a stand-in for PyPI's `kernels` (a regular package, later on sys.path than the root): it must win
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('MARK = "pypi"\n')
    got = _probe(_PROBE, str(tmp_path / "site"))
    assert got["kernels_mark"] == "pypi" and not got["kernels_file_is_ours"], got
    assert not got["regular_kernels_is_ours"], got
    assert got["second_copy"] is None, got
    assert got["dtshard_kernels"] == "dtshard_kernels"


def test_transformers_imports_from_the_repository_root():
    got, kernels = _probe(_TRANSFORMERS_PROBE + _PROBE, lines=2)
    assert not got["loaded_is_ours"], got
    # transformers sees the `kernels` distribution exactly when one is installed, never our folder
    assert got["available"] <= got["installed"], got
    # with whatever this venv has (PyPI's kernels or none: then an empty namespace), `kernels` is
    # never a package of ours, and our code through the folder (`kernels.dtshard_kernels`, a second
    # copy) is refused
    assert not kernels["regular_kernels_is_ours"] and not kernels["kernels_file_is_ours"], kernels
    assert kernels["second_copy"] is None, kernels
