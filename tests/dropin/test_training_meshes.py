"""FSDP x TP on meshes built every way training code builds them (issue #27).

torchtitan's ``ParallelDims`` makes every mesh with ``world._unflatten(0, sizes, names)`` from a
1-D world mesh; the sub-meshes' root is then that world mesh, which names none of the dims. The
same small model, tensor-parallel on ``mesh["tp"]`` and fully sharded on ``mesh["dp"]``, is run
on dtshard and on PyTorch's DTensor + FSDP2 with each mesh path: the parameters' placements and
mesh dim names, their full values, and two SGD steps (fp64) must be the same on every rank.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from dtshard.testing import run_distributed


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16, bias=True)
        self.down = nn.Linear(16, 8, bias=False)
        self.norm = nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.down(torch.relu(self.up(x))))


def _meshes(init_device_mesh, how: str):
    """(the mesh whose "dp" and "tp" dims the model uses) for one way of building it."""
    if how == "init_device_mesh":
        return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    return world._unflatten(0, (2, 2), ("dp", "tp"))


def _run(how: str):
    import torch.distributed.tensor.parallel as torch_tp
    from torch.distributed.device_mesh import init_device_mesh as torch_init
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import dtshard
    import dtshard.parallel as our_tp
    from dtshard.fsdp import fully_shard

    torch.manual_seed(0)
    base = _MLP().double()
    plan = lambda tp: {"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()}  # noqa: E731
    runs = []
    for init, tp, fs in ((dtshard.init_device_mesh, our_tp, fully_shard),
                         (torch_init, torch_tp, torch_fully_shard)):
        mesh = _meshes(init, how)
        m = copy.deepcopy(base)
        tp.parallelize_module(m, mesh["tp"], plan(tp))
        fs(m, mesh=mesh["dp"])
        layout = {n: (str(tuple(p.placements)), tuple(p.device_mesh.mesh_dim_names)) for n, p in m.named_parameters()}
        full0 = {n: p.full_tensor() for n, p in m.named_parameters()}
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(3)
        me = mesh["dp"].get_local_rank()
        losses = []
        for _ in range(2):
            x = torch.randn(4, 8, dtype=torch.float64, generator=g)[2 * me:2 * me + 2]
            loss = m(x).pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((layout, full0, losses, {n: p.full_tensor() for n, p in m.named_parameters()}))
    (ours, theirs) = runs
    init_ok = all(torch.equal(ours[1][n], p.detach()) for n, p in base.named_parameters())
    param_err = max((ours[3][n] - theirs[3][n]).abs().max().item() for n in ours[3])
    return ours[0], theirs[0], init_ok, ours[2], theirs[2], param_err


@pytest.mark.parametrize("how", ["init_device_mesh", "unflatten"])
def test_fsdp_times_tp_on_every_mesh_path(how):
    for rank, (ours, theirs, init_ok, our_losses, their_losses, param_err) in enumerate(
            run_distributed(_run, 4, how, timeout=300)):
        assert ours == theirs, (rank, how, ours, theirs)
        assert ours["up.weight"][0].startswith("(_StridedShard(dim=0, sf=2), Shard(dim=0))"), ours
        assert init_ok, (rank, how)  # full_tensor() of the sharded parameters is the model's init
        assert our_losses == pytest.approx(their_losses, rel=1e-12, abs=1e-12), (rank, our_losses, their_losses)
        assert param_err <= 1e-12, (rank, how, param_err)
