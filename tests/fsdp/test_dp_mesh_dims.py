"""``fully_shard(..., dp_mesh_dims=DataParallelMeshDims(...))``: FSDP over DTensors of one SPMD mesh
(PyTorch 2.13's form), checked against PyTorch's own FSDP2 doing the same thing side by side.

- FSDP x TP on a 2x2 ``("dp", "tp")`` mesh: the parameters are DTensors on the whole mesh,
  ``Replicate`` on dp and column / row / replicated on tp; each dp rank feeds its own batch as a
  ``Shard(0)`` DTensor, so the weight gradients arrive ``Partial`` on dp and FSDP's reduce_scatter
  reduces them (no extra all_reduce);
- HSDP on a 2x2 ``("rep", "shard")`` mesh with all-``Replicate`` parameters;
- FSDP over the flattened group of a 2x2 ``("dp", "cp")`` mesh (``shard=("dp", "cp")``);
- DDP x TP (``replicate="dp"`` only): nothing sharded, ONE all_reduce per group.

Both libraries train the same model on the same data for 3 AdamW steps: the sharded parameters'
placements, the losses and the final parameters match PyTorch's; forward and backward issue one
all_gather and one reduce_scatter per group over the shard dim.  Bad input raises on every rank.
Compiled (``fullgraph=True``) it trains like eager, with the same collectives in its graphs.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from dtshard.testing import run_distributed, shutdown_pools

_TP = {"0.weight": ("R", "S0"), "0.bias": ("R", "S0"), "2.weight": ("R", "S1"), "2.bias": ("R", "R")}


def _place(lib, mesh, model, layout):
    if lib == "torch":
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    else:
        from dtshard import Replicate, Shard, distribute_tensor
    pl = {"R": Replicate(), "S0": Shard(0), "S1": Shard(1)}
    for name, p in list(model.named_parameters()):
        owner, attr = model.get_submodule(name.rsplit(".", 1)[0]), name.rsplit(".", 1)[1]
        want = layout[name] if layout else ("R",) * mesh.ndim
        setattr(owner, attr, nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [pl[k] for k in want])))


def _kind(kind: str) -> tuple:
    """(mesh dim names of the 2x2 mesh, the DataParallelMeshDims) of one test kind."""
    from torch.distributed.fsdp import DataParallelMeshDims

    names = {"fsdp_tp": ("dp", "tp"), "hsdp": ("rep", "shard"), "flat": ("dp", "cp"), "ddp_tp": ("dp", "tp")}[kind]
    dims = {"fsdp_tp": DataParallelMeshDims(shard="dp"), "hsdp": DataParallelMeshDims(shard="shard", replicate="rep"),
            "flat": DataParallelMeshDims(shard=("dp", "cp")), "ddp_tp": DataParallelMeshDims(replicate="dp")}[kind]
    return names, dims


def _run(kind: str, steps: int = 3):
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor as TorchDTensor

    import dtshard
    from dtshard.debug import CommCounter
    from dtshard.fsdp import fully_shard

    names, dims = _kind(kind)
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
    out = {}
    for lib in ("torch", "dtshard"):
        mesh = (torch_mesh if lib == "torch" else dtshard.init_device_mesh)("cpu", (2, 2), mesh_dim_names=names)
        model = copy.deepcopy(base)
        _place(lib, mesh, model, _TP if kind in ("fsdp_tp", "ddp_tp") else None)
        (torch_fully_shard if lib == "torch" else fully_shard)(model, mesh=mesh, dp_mesh_dims=dims)
        layout = {n: str(p.placements) for n, p in model.named_parameters()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        coord = mesh.get_coordinate()
        dp_index = coord[0] if kind in ("fsdp_tp", "ddp_tp") else coord[0] * 2 + coord[1]
        Shard, Replicate = (torch.distributed.tensor.Shard, torch.distributed.tensor.Replicate) if lib == "torch" \
            else (dtshard.Shard, dtshard.Replicate)
        from_local = TorchDTensor.from_local if lib == "torch" else dtshard.DTensor.from_local
        batch_pl = [Shard(0), Replicate()] if kind in ("fsdp_tp", "ddp_tp") else [Shard(0), Shard(0)]
        losses, counts = [], []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            x = torch.randn(16, 8, generator=g)[4 * dp_index:4 * dp_index + 4]
            with CommCounter() as comm:
                y = model(from_local(x, mesh, batch_pl))
                loss = (y.full_tensor() ** 2).mean() if hasattr(y, "full_tensor") else (y ** 2).mean()
                loss.backward()
            counts.append(sorted((r.kind, r.op) for r in comm.records if r.op == "<fsdp>"))
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[lib] = {"layout": layout, "losses": losses, "params": [p.full_tensor() for p in model.parameters()],
                    "counts": counts}
    return out


@pytest.mark.parametrize("kind", ["fsdp_tp", "hsdp", "flat", "ddp_tp"])
def test_dp_mesh_dims_matches_pytorch(kind):
    # fresh workers: PyTorch's dispatch caches (its specs compare meshes by layout) can hand a
    # new DTensor an equal mesh OBJECT that an earlier test in the same process made, and its
    # SPMD fully_shard rejects a parameter whose mesh is not the very object passed to it
    shutdown_pools(4)
    for r in run_distributed(_run, 4, kind, timeout=300):
        t, d = r["torch"], r["dtshard"]
        assert d["layout"] == t["layout"], (d["layout"], t["layout"])
        torch.testing.assert_close(d["losses"], t["losses"], rtol=1e-5, atol=1e-6)
        for a, b in zip(d["params"], t["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        want = [("all_reduce", "<fsdp>")] if kind == "ddp_tp" else \
            [("all_gather", "<fsdp>"), ("reduce_scatter", "<fsdp>")] + ([("all_reduce", "<fsdp>")] if kind == "hsdp" else [])
        assert all(c == sorted(want) for c in d["counts"]), d["counts"]


def _bad_inputs():
    from torch.distributed.fsdp import DataParallelMeshDims

    import dtshard
    from dtshard.fsdp import fully_shard

    mesh = dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    errors = {}
    cases = {
        "plain": (nn.Linear(4, 4), DataParallelMeshDims(shard="dp")),
        "ddp_flat": (nn.Linear(4, 4), DataParallelMeshDims(replicate=("dp", "tp"))),
        "unknown": (nn.Linear(4, 4), DataParallelMeshDims(shard="x")),
        "flat_order": (nn.Linear(4, 4), DataParallelMeshDims(shard=("tp", "dp"))),
    }
    sharded_dp = nn.Linear(4, 4)
    sharded_dp.weight = nn.Parameter(dtshard.distribute_tensor(sharded_dp.weight.detach(), mesh,
                                                               [dtshard.Shard(0), dtshard.Replicate()]))
    sharded_dp.bias = nn.Parameter(dtshard.distribute_tensor(sharded_dp.bias.detach(), mesh,
                                                             [dtshard.Replicate(), dtshard.Replicate()]))
    cases["sharded_on_dp"] = (sharded_dp, DataParallelMeshDims(shard="dp"))
    for name, (m, dims) in cases.items():
        try:
            fully_shard(m, mesh=mesh, dp_mesh_dims=dims)
            errors[name] = None
        except (ValueError, NotImplementedError) as e:
            errors[name] = (type(e).__name__, str(e))
    t = dtshard.distribute_tensor(torch.arange(4.0), mesh, [dtshard.Shard(0), dtshard.Replicate()])
    errors["after"] = t.full_tensor().tolist()
    return errors


def test_dp_mesh_dims_bad_inputs_raise_on_every_rank():
    for e in run_distributed(_bad_inputs, 4, timeout=120):
        assert e["plain"][0] == "ValueError" and "must be a dtshard DTensor" in e["plain"][1]
        assert e["ddp_flat"][0] == "NotImplementedError" and "DDP" in e["ddp_flat"][1]
        assert e["unknown"][0] == "ValueError" and "'x'" in e["unknown"][1]
        assert e["flat_order"][0] == "NotImplementedError" and "mesh's order" in e["flat_order"][1]
        assert e["sharded_on_dp"][0] == "ValueError" and "Replicate() on the data-parallel dims" in e["sharded_on_dp"][1]
        assert e["after"] == [0.0, 1.0, 2.0, 3.0]


def _compiled_matches_eager(kind: str, steps: int = 2):
    """The same dp_mesh_dims model trained eagerly and compiled (``fullgraph=True``, AOTAutograd
    with the min-cut partitioner, the graphs recorded): losses, gradient placements and final
    parameters, and the collectives in the graphs."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    import dtshard
    from dtshard.fsdp import fully_shard

    torch._dynamo.reset()
    graphs: list = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record, partition_fn=min_cut_rematerialization_partition)
    names, dims = _kind(kind)
    mesh = dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    coord = mesh.get_coordinate()
    dp_index = coord[0] if kind in ("fsdp_tp", "ddp_tp") else coord[0] * 2 + coord[1]
    batch_pl = [dtshard.Shard(0), dtshard.Replicate()] if kind in ("fsdp_tp", "ddp_tp") else \
        [dtshard.Shard(0), dtshard.Shard(0)]
    out = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4))
        _place("dtshard", mesh, model, _TP if kind in ("fsdp_tp", "ddp_tp") else None)
        fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
        run = torch.compile(model, backend=backend, fullgraph=True) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        losses, grad_layouts = [], []
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            x = torch.randn(16, 8, generator=g)[4 * dp_index:4 * dp_index + 4]
            loss = (run(dtshard.DTensor.from_local(x, mesh, batch_pl)).full_tensor() ** 2).mean()
            loss.backward()
            grad_layouts.append([(type(p.grad).__name__, p.grad.placements == p.placements) for p in model.parameters()])
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        out[compiled] = (losses, grad_layouts, [p.full_tensor() for p in model.parameters()])
    counts = [tuple(code.count(f"torch.ops._c10d_functional.{op}.default(")
                    for op in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")) for code in graphs]
    return out, counts


@pytest.mark.parametrize("kind", ["fsdp_tp", "hsdp", "flat", "ddp_tp"])
def test_dp_mesh_dims_compiled_matches_eager(kind):
    """``torch.compile(model, fullgraph=True)`` of a dp_mesh_dims model: one graph each way (no
    recompile), ONE all_gather (forward) and ONE reduce_scatter (backward) over the shard dim for
    the group (HSDP: plus one all_reduce over the replicate dim), values equal to eager."""
    for out, counts in run_distributed(_compiled_matches_eager, 4, kind, timeout=300):
        (le, ge, pe), (lc, gc, pc) = out[False], out[True]
        torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
        assert gc == ge and all(ok for step in gc for _, ok in step), gc
        for a, b in zip(pc, pe):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert len(counts) == 2, counts  # one forward graph, one backward graph
        fwd, bwd = counts
        if kind == "ddp_tp":  # nothing to gather; the group's gradients: ONE all_reduce
            assert fwd[:2] == (0, 0) and bwd == (0, 0, 1), counts
        else:
            assert fwd[0] == 1 and fwd[1] == 0, counts
            assert bwd[1] == 1 and bwd[2] == (1 if kind == "hsdp" else 0), counts
