"""Patterns from PyTorch's own DTensor tests that must behave the same on dtshard (issue #27): a
mesh built directly from a rank list that leaves ranks out, ``Partial("max")`` / ``Partial("min")``
to ``Shard`` on gloo, and ``histc``.  Each runs on both libraries on 4 ranks and against one
process.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard.testing import run_distributed, shutdown_pools


def _worker():
    import torch.distributed.tensor as torch_dt
    from torch.distributed.device_mesh import DeviceMesh

    import dtshard

    rank = dist.get_rank()
    out = {}
    for name, lib in (("torch", torch_dt), ("dtshard", dtshard)):
        res = {}
        # ranks 1 and 3 are outside this mesh: they hold empty shards and issue no collective
        sub = DeviceMesh("cpu", [0, 2])
        d = lib.DTensor.from_local(torch.full((3, 4), float(rank)), sub, [Shard(0)])
        e = d + 2
        r = d.redistribute(sub, [Replicate()])
        res["outside"] = (tuple(d.shape), tuple(d.to_local().shape), tuple(e.to_local().shape),
                          tuple(r.to_local().shape), r.to_local().clone())
        mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
        # Partial max / min (one term per rank) to Shard on gloo
        base = torch.arange(6 * 4, dtype=torch.float64).reshape(6, 4)
        red = {}
        for op, sign in (("max", 1.0), ("min", -1.0)):
            x = lib.DTensor.from_local(sign * base * (rank + 1), mesh, [Partial(op)])
            red[op] = [x.redistribute(mesh, [Shard(k)]).full_tensor() for k in (0, 1)]
        res["partial"] = red
        # histc: a given range counts per shard (a Partial sum); the default range is the data's
        h = lib.distribute_tensor(torch.linspace(-1, 11, 23), mesh, [Shard(0)])
        res["histc"] = (torch.histc(h, bins=5, min=0, max=10).full_tensor(), torch.histc(h, bins=4).full_tensor())
        out[name] = res
    return out


def test_pytorch_dtensor_test_patterns():
    base = torch.arange(6 * 4, dtype=torch.float64).reshape(6, 4)
    x = torch.linspace(-1, 11, 23)
    want_h = (torch.histc(x, bins=5, min=0, max=10), torch.histc(x, bins=4))
    try:
        results = run_distributed(_worker, 4, timeout=180)
    finally:
        # after this test the next test's new process groups waited on different store keys on
        # different ranks (seen; most likely DeviceMesh("cpu", [0, 2]) made groups on some ranks
        # only): later tests get fresh workers
        shutdown_pools(4)
    for rank, res in enumerate(results):
        ours, theirs = res["dtshard"], res["torch"]
        shape, local, plus, rep, rep_val = ours["outside"]
        assert (shape, local, plus, rep) == theirs["outside"][:4], (rank, ours["outside"][:4], theirs["outside"][:4])
        if rank in (1, 3):
            assert local == plus == rep == (0,)
        else:
            assert rep == (6, 4) and torch.equal(rep_val[:3], torch.zeros(3, 4)) and torch.equal(rep_val[3:], torch.full((3, 4), 2.0))
        for op, sign in (("max", 1.0), ("min", -1.0)):
            for got in ours["partial"][op]:
                assert torch.equal(got, sign * base * 4), (rank, op)
        for got, want in zip(ours["histc"], want_h):
            assert torch.equal(got, want), (rank, got, want)
