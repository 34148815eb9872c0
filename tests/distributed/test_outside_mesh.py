"""Issue #17 item 3: ranks outside a DTensor's mesh run the same program as no-ops.

A 2-rank mesh (``DeviceMesh("cpu", [0, 1])``) inside a 4-rank world, as a pipeline stage or a TP
group on part of the job would have: on ranks 2 and 3 every call is a no-op with PyTorch's
default results (empty local shards of the right global shape, ``equal`` True), and no
collective is issued there (none is pending afterwards: a barrier on the whole world passes).
The same code runs on ``torch.distributed.tensor`` and the results are compared rank by rank.
A tensor-parallel training step (parallelize_module with DTensor outputs, forward, backward, SGD;
a LOCAL output on a rank outside the mesh is an empty plain tensor the next layer cannot use, in
either library) runs on dtshard only:
PyTorch's DTensor raises in it on the ranks outside the mesh (its view rule rejects the empty
shard); on ranks 0 and 1 it is compared with the same model trained in one process.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

import dtshard
import dtshard.parallel as tp_ours
from dtshard import Replicate, Shard
from dtshard.testing import run_distributed

LIBS = {"torch": (tdt, __import__("torch.distributed.tensor.parallel", fromlist=["x"])), "dtshard": (dtshard, tp_ours)}


def _describe(v):
    if isinstance(v, (tdt.DTensor, dtshard.DTensor)):
        return ("DTensor", tuple(v.shape), tuple(v.to_local().shape), str(v.dtype))
    if isinstance(v, torch.Tensor):
        return ("Tensor", tuple(v.shape))
    return v


def _program(lib_name):
    lib, tp = LIBS[lib_name]
    mesh = DeviceMesh("cpu", [0, 1])
    torch.manual_seed(0)
    full = torch.randn(4, 6)
    x = lib.distribute_tensor(full, mesh, [Shard(0)])
    out = {
        "distribute": x, "add": x + 1, "sum": x.sum(), "equal": torch.equal(x, x),
        "redistribute": x.redistribute(mesh, [Replicate()]), "full_tensor": x.full_tensor(),
        "mm": x @ x.t(), "softmax": torch.softmax(x, -1), "zeros": lib.zeros(4, 6, device_mesh=mesh),
    }
    if lib_name == "dtshard":
        # a tensor-parallel step: forward, backward, optimizer (ranks 2 and 3: no-ops)
        torch.manual_seed(1)
        ref = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))
        model = tp.parallelize_module(copy.deepcopy(ref), mesh,
                                      {"0": tp.ColwiseParallel(use_local_output=False),
                                       "2": tp.RowwiseParallel(use_local_output=False)})
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
        inp = torch.randn(5, 6)
        loss = model(dtshard.distribute_tensor(inp, mesh, [Replicate()])).pow(2).mean()
        loss.backward()
        opt.step()
        rloss = ref(inp).pow(2).mean()
        rloss.backward()
        ropt.step()
        w = model[0].weight.full_tensor()
        out["step"] = (dist.get_rank() >= 2 and tuple(w.shape) == (0,)) or (
            torch.allclose(w, ref[0].weight) and torch.allclose(loss.full_tensor(), rloss))
    dist.barrier()  # nothing left pending on any rank
    result = {}
    for k, v in out.items():
        if isinstance(v, (tdt.DTensor, dtshard.DTensor)):
            result[k] = _describe(v)
            result[k + ".local"] = v.to_local().detach().clone()  # the values, on every rank
        elif isinstance(v, torch.Tensor) and dist.get_rank() < 2:
            result[k] = v.detach().clone()
        else:
            result[k] = _describe(v)
    return result


def test_ranks_outside_the_mesh_are_no_ops():
    from dtshard.testing.harness import shutdown_pools

    try:
        theirs = run_distributed(_program, 4, "torch")
        ours = run_distributed(_program, 4, "dtshard")
    finally:
        # PyTorch's DeviceMesh over a subset of the world creates its process group on the
        # member ranks only, so the ranks' group counters (and the names of groups created
        # later) no longer agree: later tests get fresh 4-rank worker processes
        shutdown_pools(4)
    for rank in range(4):
        assert ours[rank]["step"] is True, rank
        for key, want in theirs[rank].items():
            got = ours[rank][key]
            if isinstance(want, torch.Tensor):
                assert isinstance(got, torch.Tensor) and got.shape == want.shape, (rank, key, got, want)
                assert torch.allclose(got, want, atol=1e-6), (rank, key, got, want)
            else:
                assert got == want, (rank, key, got, want)
