"""Package discovery for the one layout setuptools' automatic discovery cannot express alone.

All metadata lives in pyproject.toml. The only thing computed here is the package list, because
our top-level ``kernels/`` folder installs under another name, ``dtshard_kernels`` (a different PyPI
distribution owns the import name ``kernels``). Both trees are *discovered* (every folder with an
``__init__.py``), never listed by hand, so a new subpackage cannot be left out of the wheel;
``tests/unit/test_packaging.py`` checks the built wheel against the source tree.
"""

from setuptools import find_packages, setup

_KERNELS_SOURCE, _KERNELS_PACKAGE = "kernels", "dtshard_kernels"

packages = find_packages(include=["dtshard", "dtshard.*"]) + [
    _KERNELS_PACKAGE + name[len(_KERNELS_SOURCE):]
    for name in find_packages(include=[_KERNELS_SOURCE, _KERNELS_SOURCE + ".*"])
]

setup(packages=packages, package_dir={_KERNELS_PACKAGE: _KERNELS_SOURCE})
