"""Suite-wide pytest configuration.

The only thing here is the shutdown of the distributed worker pools of
:mod:`dtshard.testing.harness` at the end of the session (they are also shut
down at interpreter exit, but doing it here keeps the teardown inside pytest's
timing and output).
"""

import sys

import pytest


@pytest.fixture(scope="session", autouse=True)
def _dtshard_worker_pools():
    """Shut down the cached worker pools after the last test."""
    yield
    harness = sys.modules.get("dtshard.testing.harness")  # not imported: nothing to stop
    if harness is not None:
        harness.shutdown_pools()
