"""Package discovery, so that no package is ever listed by hand.

All metadata lives in pyproject.toml. The two import packages, ``dtshard`` and ``dtshard_kernels``
(the packing kernels; never ``kernels``, a name a different PyPI distribution owns and that
``transformers`` imports when it finds it), are *discovered* (every folder with an
``__init__.py``), so a new subpackage cannot be left out of the wheel;
``tests/unit/test_packaging.py`` checks the built wheel against the source tree.
"""

from setuptools import find_packages, setup

setup(packages=find_packages(include=["dtshard", "dtshard.*", "dtshard_kernels", "dtshard_kernels.*"]))
