"""Suite-wide pytest configuration.

Two things: ``TRITON_INTERPRET=1`` before anything imports triton, and the
shutdown of the distributed worker pools of :mod:`dtshard.testing.harness` at
the end of the session (they are also shut down at interpreter exit, but doing
it here keeps the teardown inside pytest's timing and output).
"""

import os
import sys

# Triton's interpreter must be chosen before anything imports triton: the kernel tests run the
# Triton kernels on CPU (tests/kernels/test_triton_interpret.py); dtshard's own CPU paths use the
# PyTorch reference kernels whatever this says.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _dtshard_worker_pools():
    """Shut down the cached worker pools after the last test."""
    yield
    harness = sys.modules.get("dtshard.testing.harness")  # not imported: nothing to stop
    if harness is not None:
        harness.shutdown_pools()
