"""What the benchmark scripts share.

- :func:`import_this_checkout`: import THIS checkout's dtshard and dtshard_kernels (works from a
  fresh clone, installed or not): the repository root (``dtshard/``) and its ``kernels/`` folder
  (``kernels/dtshard_kernels/``) go first on ``sys.path``, even when another checkout is
  pip-installed (editable);
- :func:`free_port`: a free TCP port on 127.0.0.1 for a benchmark's process-group store;
- :func:`own_cores` / :func:`bind_threads`: each rank on cores of its own, as a launcher binding
  ranks with ``taskset`` / ``numactl`` would (an unbound gloo rank can wait milliseconds for the
  scheduler after compute: benchmarks/README.md, "Step time and memory against one process").
"""

from __future__ import annotations

import os
import socket
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: the folders that hold this checkout's import packages: dtshard/ and kernels/dtshard_kernels/
CHECKOUT_PATHS = (ROOT, os.path.join(ROOT, "kernels"))


def import_this_checkout():
    for path in reversed(CHECKOUT_PATHS):
        if path not in sys.path:
            sys.path.insert(0, path)
    import dtshard

    return dtshard


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ALL_CPUS = frozenset(range(os.cpu_count() or 1))


def own_cores(rank: int, world: int):
    """The cores of ``rank`` when the machine's cores are split evenly among ``world`` ranks (at
    least one each; Linux only), else None."""
    n = os.cpu_count() or 1
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task") or n < world:
        return None
    per = n // world
    return frozenset(range(rank * per, (rank + 1) * per))


def bind_threads(cpus) -> None:
    """Bind every thread of this process (the main thread, gloo's, the intra-op pool's) to
    ``cpus``; threads started later inherit the main thread's binding."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass
