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
SOURCE_TREES = {"dtshard": "dtshard", "dtshard_kernels": "dtshard_kernels"}


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
