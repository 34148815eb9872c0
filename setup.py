# Thin shim so `pip install -e .` works with older tooling; all metadata lives in pyproject.toml.
from setuptools import setup

setup()
