"""Suite-wide pytest configuration.

Four things: ``TRITON_INTERPRET=1`` before anything imports triton, inductor's scalar CPU
kernels (``TORCHINDUCTOR_VEC_ISA_OK=0``, see below), the modules the fork
server of the distributed worker pools imports once for every worker (torch.compile's), and the
shutdown of those pools (:mod:`dtshard.testing.harness`) at the end of the session (they are also
shut down at interpreter exit, but doing it here keeps the teardown inside pytest's timing and
output).
"""

import os
import sys

# Triton's interpreter must be chosen before anything imports triton: the kernel tests run the
# Triton kernels on CPU (tests/kernels/test_triton_interpret.py); dtshard's own CPU paths use the
# PyTorch reference kernels whatever this says.
os.environ.setdefault("TRITON_INTERPRET", "1")

# Inductor's CPU kernels without explicit SIMD (inductor's own switch, read when its config is
# first imported): the two inductor tests (tests/fsdp/test_fsdp_compile.py, mixed precision;
# tests/compile/test_compile_models.py, the UNet) are about what dtshard hands inductor (the
# graphs, functional collectives, the halo custom ops, bf16 policy) and lower, fuse and compare
# the same way with scalar C++ kernels; their vectorized form builds each kernel against
# ATen's vector headers and first compiles inductor's ISA probes. Cold cache, each test alone on
# this 2-core machine: 54 -> 36 s and 40 -> 25 s. TORCHINDUCTOR_VEC_ISA_OK=1 runs them vectorized.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")

import pytest  # noqa: E402

from dtshard.testing import preload_in_workers  # noqa: E402

# A worker's first torch.compile imports Dynamo, AOTAutograd and (for inductor) inductor's
# lowering: ~1.5-4 s of CPU a process, paid by every worker of every pool that compiles (2-, 4- and
# 8-rank pools, restarted ones too). The fork server imports them once instead, before any worker
# forks (measured on this 2-core machine: a worker's first aot_eager compile 2.9 -> 1.2 s of CPU,
# its first inductor compile 4.8 -> 0.8 s). Imports only: no compile runs, no thread or
# subprocess starts in the fork server.
preload_in_workers("torch._dynamo", "torch._functorch.aot_autograd", "torch._inductor.compile_fx")


@pytest.fixture(scope="session", autouse=True)
def _dtshard_worker_pools():
    """Shut down the cached worker pools after the last test."""
    yield
    harness = sys.modules.get("dtshard.testing.harness")  # not imported: nothing to stop
    if harness is not None:
        harness.shutdown_pools()
