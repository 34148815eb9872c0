"""FSDP x TP on meshes built every way training code builds them, meta-device init and module casts (issue #27).

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


def _fsdp_meta_and_casts(kind: str):
    """A model built on ``meta``, (tensor-parallelised on ``mesh["tp"]`` of an ``_unflatten``
    mesh and) fully sharded, materialised with ``to_empty``, initialised from a reference, then
    cast four times (``.double()``, ``.bfloat16()``, ``.float()``, ``.to(float64)``) with one SGD
    step after each.  Against one process doing the same steps, and against PyTorch's DTensor +
    FSDP2 for what PyTorch supports (meta init and the first cast: its FSDP2 keeps its
    all_gather buffers in the first dtype, so a second cast fails there)."""
    import torch.distributed.tensor as torch_dt
    import torch.distributed.tensor.parallel as torch_tp
    from torch.distributed.device_mesh import init_device_mesh as torch_init
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import dtshard
    import dtshard.parallel as our_tp
    from dtshard.fsdp import fully_shard

    torch.manual_seed(0)
    ref = _Small()
    casts = (("double", lambda m: m.double()), ("bfloat16", lambda m: m.bfloat16()),
             ("float", lambda m: m.float()), ("to", lambda m: m.to(torch.float64)))

    def batch(step, dtype):
        return torch.randn(8, 8, generator=torch.Generator().manual_seed(step)).to(dtype)

    runs = {}
    for lib, init, tp, fs, distribute in (
            ("ours", dtshard.init_device_mesh, our_tp, fully_shard, dtshard.distribute_tensor),
            ("theirs", torch_init, torch_tp, torch_fully_shard, torch_dt.distribute_tensor)):
        if kind == "fsdp":
            dp = init("cpu", (4,))
        else:
            mesh = init("cpu", (4,), mesh_dim_names=("world",))._unflatten(0, (2, 2), ("dp", "tp"))
            dp = mesh["dp"]
        with torch.device("meta"):
            m = _Small()
        if kind == "fsdp_tp":
            tp.parallelize_module(m, mesh["tp"], {"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()})
        fs(m.up, mesh=dp)
        fs(m, mesh=dp)
        weights = [id(p) for p in m.parameters()]
        m.to_empty(device="cpu")
        with torch.no_grad():
            for p, r in zip(m.parameters(), ref.parameters()):
                p.copy_(distribute(r.detach(), p.device_mesh, p.placements))
        init_ok = all(torch.equal(p.full_tensor(), r.detach()) for p, r in zip(m.parameters(), ref.parameters()))
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        n, me = dp.size(), dp.get_local_rank()
        steps = []
        for step, (name, cast) in enumerate(casts if lib == "ours" else casts[:1]):
            cast(m)
            dtype = next(m.parameters()).dtype
            x = batch(step, dtype)
            rows = x.shape[0] // n
            m(x[rows * me:rows * (me + 1)]).float().pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
            steps.append((name, str(dtype), {str(p.grad) for p in m.parameters()},
                          [p.full_tensor().double() for p in m.parameters()]))
        layout = [(str(tuple(p.placements)), type(p).__name__) for p in m.parameters()]
        runs[lib] = (init_ok, steps, layout, weights == [id(p) for p in m.parameters()])
    # one process, the same casts and steps: FSDP averages the data-parallel ranks' gradients
    single = copy.deepcopy(ref)
    opt = torch.optim.SGD(single.parameters(), lr=0.1)
    single_params = []
    for step, (_, cast) in enumerate(casts):
        cast(single)
        (single(batch(step, next(single.parameters()).dtype)).float().pow(2).sum() / n).backward()
        opt.step()
        opt.zero_grad()
        single_params.append([p.detach().double() for p in single.parameters()])
    ours, theirs = runs["ours"], runs["theirs"]
    rows = []
    for (name, dtype, grads, params), want in zip(ours[1], single_params):
        rows.append((name, dtype, grads, max((a - b).abs().max().item() for a, b in zip(params, want))))
    their_err = max((a - b).abs().max().item() for a, b in zip(ours[1][0][3], theirs[1][0][3]))
    return ours[0], theirs[0], rows, their_err, theirs[1][0][1], ours[2], ours[3]


@pytest.mark.parametrize("kind", ["fsdp", "fsdp_tp"])
def test_fully_shard_meta_init_to_empty_and_casts_match_pytorch(kind):
    for rank, (init_ok, their_init_ok, rows, their_err, their_dtype, layout, same_objects) in enumerate(
            run_distributed(_fsdp_meta_and_casts, 4, kind, timeout=300)):
        assert init_ok and their_init_ok, rank  # to_empty + in-place init writes the shards
        assert same_objects  # optimizers built before a cast keep working
        assert {t for _, t in layout} == {"DTensor"}
        if kind == "fsdp_tp":
            assert layout[0][0].startswith("(_StridedShard(dim=0, sf=2), Shard(dim=0))"), layout
        # meta init and the first cast: PyTorch's FSDP2 gives the same parameters (fp64)
        assert their_dtype == "torch.float64" and their_err <= 1e-12, (rank, kind, their_err)
        for name, dtype, grads, err in rows:
            assert dtype == {"bfloat16": "torch.bfloat16", "float": "torch.float32"}.get(name, "torch.float64"), (name, dtype)
            assert grads == {"None"}, grads  # zero_grad after each step
            # against one process: fp64 rounding; from the bf16 step on, the parameters (|p| < 0.5)
            # may differ by the bf16 rounding of that step: 2 ulps of bf16 at 0.5 is 2 * 2**-9
            tol = 1e-12 if name == "double" else 2 * 2 ** -9
            assert err <= tol, (rank, kind, name, err)


def _hsdp_tp_unflatten_and_from_group():
    """HSDP x TP on a 3-D mesh made by ``_unflatten`` of the world mesh (``mesh["replicate",
    "shard"]`` for FSDP, ``mesh["tp"]`` for TP), and FSDP on a mesh made by
    ``DeviceMesh.from_group``: placements and one fp64 step's gradients against PyTorch's."""
    import torch.distributed as dist
    import torch.distributed.tensor.parallel as torch_tp
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.device_mesh import init_device_mesh as torch_init
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import dtshard
    import dtshard.parallel as our_tp
    from dtshard.fsdp import fully_shard

    torch.manual_seed(0)
    base = _MLP().double()
    x = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    runs = {}
    for lib, init, tp, fs in (("ours", dtshard.init_device_mesh, our_tp, fully_shard),
                              ("theirs", torch_init, torch_tp, torch_fully_shard)):
        mesh = init("cpu", (8,), mesh_dim_names=("world",))._unflatten(0, (2, 2, 2), ("replicate", "shard", "tp"))
        m = copy.deepcopy(base)
        tp.parallelize_module(m, mesh["tp"], {"up": tp.ColwiseParallel(), "down": tp.RowwiseParallel()})
        fs(m, mesh=mesh["replicate", "shard"])
        me = mesh["replicate"].get_local_rank() * 2 + mesh["shard"].get_local_rank()
        m(x[2 * me:2 * me + 2]).pow(2).sum().backward()
        hsdp = ({n: (str(tuple(p.placements)), p.device_mesh.mesh_dim_names) for n, p in m.named_parameters()},
                [p.grad.full_tensor() for p in m.parameters()])
        fm = DeviceMesh.from_group(dist.new_group(list(range(8))), "cpu")
        m = copy.deepcopy(base)
        fs(m, mesh=fm)
        m(x[dist.get_rank():dist.get_rank() + 1]).pow(2).sum().backward()
        runs[lib] = (hsdp, ({n: str(tuple(p.placements)) for n, p in m.named_parameters()},
                            [p.grad.full_tensor() for p in m.parameters()]))
    out = []
    for (lay, g), (tlay, tg) in zip(runs["ours"], runs["theirs"]):
        out.append((lay, tlay, max((a - b).abs().max().item() for a, b in zip(g, tg))))
    return out


def test_hsdp_tp_on_an_unflattened_3d_mesh_and_fsdp_on_from_group():
    for rank, rows in enumerate(run_distributed(_hsdp_tp_unflatten_and_from_group, 8, timeout=300)):
        (lay, tlay, err), (flay, ftlay, ferr) = rows
        assert lay == tlay and lay["up.weight"][0] == "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))", (rank, lay)
        assert err <= 1e-12, (rank, err)
        assert flay == ftlay and ferr <= 1e-12, (rank, flay, ftlay, ferr)
