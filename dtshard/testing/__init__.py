"""Testing utilities for dtshard: a multi-process harness with reusable worker pools.

See :mod:`dtshard.testing.harness` for details.  Typical use in a test module::

    import torch, torch.distributed as dist
    from dtshard.testing import run_distributed

    def _allreduce_rank():          # module level: pickled by reference
        t = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(t)
        return t.item()

    def test_allreduce():
        assert run_distributed(_allreduce_rank, 4) == [6.0] * 4
"""

from dtshard.testing.harness import (
    DistributedTestError,
    RankFailure,
    check_pool,
    get_rank,
    get_world_size,
    launch,
    pool_pids,
    preload_in_workers,
    run_distributed,
    shutdown_pools,
    warm_up,
)

__all__ = [
    "DistributedTestError",
    "RankFailure",
    "check_pool",
    "get_rank",
    "get_world_size",
    "launch",
    "pool_pids",
    "preload_in_workers",
    "run_distributed",
    "shutdown_pools",
    "warm_up",
]
