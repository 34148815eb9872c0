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


class _Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _meta_and_casts(cast: str):
    """A tensor-parallel model built on ``meta``, materialised with ``to_empty``, initialised from
    a reference and cast (``cast``), against the same model built on CPU and parallelised: two
    SGD steps, every parameter's full value, dtype and placements."""
    import dtshard
    import dtshard.parallel as tp

    mesh = dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    ref = _Small()
    plan = {"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()}
    runs = {}
    for meta in (False, True):
        if meta:
            with torch.device("meta"):
                m = _Small()
        else:
            m = copy.deepcopy(ref)
        tp.parallelize_module(m, mesh["tp"], plan)
        weights = {n: id(p) for n, p in m.named_parameters()}
        if meta:
            m.to_empty(device="cpu")
            with torch.no_grad():
                for p, r in zip(m.parameters(), ref.parameters()):
                    p.copy_(dtshard.distribute_tensor(r.detach(), p.device_mesh, p.placements))
        getattr(m, cast)() if cast != "to" else m.to(torch.float64)
        dtype = next(m.parameters()).dtype
        same_objects = weights == {n: id(p) for n, p in m.named_parameters()}
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1)).to(dtype)
        for _ in range(2):
            m(x).float().pow(2).sum().backward()
            assert all(isinstance(p.grad, dtshard.DTensor) for p in m.parameters())
            opt.step()
            opt.zero_grad()
        runs[meta] = ({n: p.full_tensor() for n, p in m.named_parameters()},
                      {n: (str(p.placements), p.dtype, type(p).__name__) for n, p in m.named_parameters()},
                      same_objects)
    # the same model on one process
    m = copy.deepcopy(ref)
    getattr(m, cast)() if cast != "to" else m.to(torch.float64)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1)).to(next(m.parameters()).dtype)
    for _ in range(2):
        m(x).float().pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    single = dict(m.named_parameters())
    meta_err = max((runs[True][0][n] - runs[False][0][n]).abs().max().item() for n in single)
    single_err = max((runs[True][0][n].float() - single[n].detach().float()).abs().max().item() for n in single)
    return runs[True][1], runs[False][1], runs[True][2], meta_err, single_err, str(single["up.weight"].dtype)


@pytest.mark.parametrize("cast", ["to", "half", "double", "float", "bfloat16"])
def test_meta_init_and_casts_of_a_tensor_parallel_model(cast):
    for rank, (meta_layout, layout, same_objects, meta_err, single_err, dtype) in enumerate(
            run_distributed(_meta_and_casts, 4, cast, timeout=300)):
        assert meta_layout == layout, (rank, meta_layout, layout)
        assert {d for _, d, _ in layout.values()} == {getattr(torch, dtype.split(".")[1])}, layout
        assert {t for _, _, t in layout.values()} == {"DTensor"}
        assert layout["up.weight"][0] == "(Shard(dim=0),)" and layout["down.weight"][0] == "(Shard(dim=1),)"
        assert same_objects  # the module keeps its Parameter objects (swapped in place)
        assert meta_err == 0.0, (rank, cast, meta_err)
        # against one process: the same kernels in fp64 / fp32; half precision rounds differently
        tol = {"double": 1e-12, "to": 1e-12, "float": 1e-6}.get(cast, 2e-2)
        assert single_err <= tol, (rank, cast, single_err)


def _fsdp_casts():
    import dtshard
    from dtshard.fsdp import fully_shard

    mesh = dtshard.init_device_mesh("cpu", (4,))
    torch.manual_seed(0)
    m = _Small()
    fully_shard(m, mesh=mesh)
    before = [p.full_tensor() for p in m.parameters()]
    m.float()  # no change: runs
    m.to("cpu")
    try:
        m.half()
        error = None
    except NotImplementedError as e:
        error = str(e)
    unchanged = all(torch.equal(a, p.full_tensor()) and p.dtype == torch.float32 for a, p in zip(before, m.parameters()))
    x = torch.randn(2, 8)
    m(x).sum().backward()  # the module still trains
    return error, unchanged


def test_fully_shard_module_casts_raise_clearly_and_change_nothing():
    for error, unchanged in run_distributed(_fsdp_casts, 4, timeout=300):
        assert error is not None and "float32" in error and "float16" in error and "before fully_shard" in error, error
        assert unchanged
