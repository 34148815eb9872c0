"""Package discovery, so that no package is ever listed by hand.

All metadata lives in pyproject.toml. The two import packages are *discovered* (every folder with an
``__init__.py``), so a new subpackage cannot be left out of the wheel;
``tests/unit/test_packaging.py`` checks the built wheel against the source tree:

- ``dtshard``, from ``dtshard/``;
- ``dtshard_kernels`` (the packing kernels), from ``kernels/dtshard_kernels/``. The top-level folder
  is ``kernels/`` but it is NOT a package (no ``kernels/__init__.py``): ``kernels`` is the import
  name of a different PyPI distribution, which ``transformers`` imports when it finds it, and a
  package of that name in the repository root would shadow it for any Python started there.
  ``kernels/`` is to ``dtshard_kernels`` what a ``src/`` folder is to a src-layout package.
"""

from setuptools import find_packages, setup

KERNELS_ROOT = "kernels"  # holds the package dtshard_kernels; not a package itself

setup(
    packages=(find_packages(include=["dtshard", "dtshard.*"])
              + find_packages(KERNELS_ROOT, include=["dtshard_kernels", "dtshard_kernels.*"])),
    package_dir={"dtshard_kernels": f"{KERNELS_ROOT}/dtshard_kernels"},
)
