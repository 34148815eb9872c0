"""Every public entry point that takes a mesh works on any sub-mesh of an N-D mesh, as PyTorch's does.

On a ``(2, 2)`` mesh named ``("dp", "tp")`` (ranks ``[[0, 1], [2, 3]]``), ``mesh["tp"]`` is ``[0, 1]``
on ranks 0 and 1 and ``[2, 3]`` on ranks 2 and 3; ``mesh["dp"]`` is ``[0, 2]`` or ``[1, 3]``.  PyTorch
reads ``src_data_rank`` as the rank WITHIN each mesh dim's group, so every sub-mesh group takes its own
source (``src_data_rank=0``: the group's first rank), and on an N-D mesh the data comes from mesh
coordinate ``(src, src, ...)``.

Each check runs the same calls on ``torch.distributed.tensor`` and compares values, placements and
which rank's data wins (every rank starts from different data, so a wrong source shows), and compares
forward/backward of a small tensor-parallel model with a single-process model.  Checks are batched
into a few ``run_distributed`` calls to keep the file fast.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor as TorchDTensor
from torch.distributed.tensor import distribute_module as torch_distribute_module
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor
from torch.distributed.tensor import parallel as tp_torch

import dtshard
import dtshard.parallel as tp_ours
from dtshard import collectives as C
from dtshard.spec import _mesh_ids as mesh_ids_cache
from dtshard import Partial, Replicate, Shard
from dtshard.testing import run_distributed

LIBS = {
    "dtshard": (dtshard.DTensor, dtshard.distribute_tensor, dtshard.distribute_module, tp_ours),
    "torch": (TorchDTensor, torch_distribute_tensor, torch_distribute_module, tp_torch),
}


def _mesh_2x2():
    return dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _rank_data(rank: int, shape=(5, 4)) -> torch.Tensor:
    """Different data on every rank: which rank's data a result holds shows in its values."""
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape) + 100 * rank


def _group(sub) -> list[int]:
    """The global ranks of this rank's group of a 1-D sub-mesh."""
    return [int(r) for r in sub.mesh.flatten().tolist()]


def _same_layout(ours, theirs, what: str) -> None:
    """The same placements, global shape and stride, and local shard as PyTorch's DTensor (plain
    tensors: the same values).  A Partial's local values are not compared (PyTorch splits a
    replicated value as v/n on every rank, dtshard as v on coordinate 0 and zeros elsewhere: both
    sum to v), only its reduced value."""
    if not isinstance(theirs, TorchDTensor):
        assert not isinstance(ours, dtshard.DTensor), what
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=what)
        return
    assert isinstance(ours, dtshard.DTensor), what
    assert tuple(ours.placements) == tuple(theirs.placements), (what, ours.placements, theirs.placements)
    assert tuple(ours.shape) == tuple(theirs.shape) and ours.stride() == theirs.stride(), what
    if any(isinstance(p, Partial) for p in ours.placements):
        torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor(), msg=what)
    else:
        torch.testing.assert_close(ours.to_local(), theirs.to_local(), rtol=0, atol=0, msg=what)


# ----------------------------------------------------------------------------------------------
# distribute_tensor
# ----------------------------------------------------------------------------------------------


def _distribute_tensor_checks():
    rank = dist.get_rank()
    mesh = _mesh_2x2()
    x = _rank_data(rank)
    cases = {
        "dp": (mesh["dp"], [[Shard(0)], [Shard(1)], [Replicate()], [Partial()]]),
        "tp": (mesh["tp"], [[Shard(0)], [Shard(1)], [Replicate()], [Partial()]]),
        # on the whole 2-D mesh src_data_rank=1 is coordinate (1, 1), i.e. rank 3, not rank 1
        "2x2": (mesh, [[Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(0), Shard(0)]]),
    }
    for name, (m, placement_lists) in cases.items():
        for placements in placement_lists:
            for src in (0, 1, None):
                what = f"distribute_tensor on mesh {name} {placements} src_data_rank={src} (rank {rank})"
                partial = any(isinstance(p, Partial) for p in placements)
                if partial and src is None:
                    continue  # None promises equal data on every rank, and a Partial's value needs it
                ours = dtshard.distribute_tensor(x, m, placements, src_data_rank=src)
                # a clone: PyTorch broadcasts a Replicate source into the caller's tensor in place
                theirs = torch_distribute_tensor(x.clone(), m, placements, src_data_rank=src)
                _same_layout(ours, theirs, what)
                if src is not None and not partial:
                    # the source: the rank at coordinate (src, src, ...) of this rank's sub-mesh
                    src_rank = int(m.mesh[(src,) * m.ndim])
                    torch.testing.assert_close(ours.full_tensor(), _rank_data(src_rank), rtol=0, atol=0, msg=what)

    # a src_data_rank that is not a rank of every mesh dim's group: the same error on every rank
    # (PyTorch fails inside gloo's scatter), before any collective, and the group stays usable
    errors = []
    for m, src in ((mesh["tp"], 2), (mesh, 2), (mesh["dp"], -1)):
        try:
            dtshard.distribute_tensor(x, m, [Shard(0)] * m.ndim, src_data_rank=src)
            errors.append("no error")
        except ValueError as e:
            errors.append(str(e))

    # slicing makes a new mesh object every time: fresh sub-meshes, alternately dp and tp, freed
    # after use.  A freed mesh's id may go to the next one (the per-mesh caches of collectives.py
    # must not give it the old groups), and its cache entries must go (a training loop that
    # slices every step must not grow the caches)
    cache_sizes = []
    for i in range(8):
        sub = mesh["tp"] if i % 2 else mesh["dp"]
        got = (dtshard.distribute_tensor(x, sub, [Shard(0)]) * 2).redistribute(sub, [Replicate()]).to_local()
        torch.testing.assert_close(got, 2 * _rank_data(_group(sub)[0]), rtol=0, atol=0)
        del sub, got
        gc.collect()  # DeviceMesh objects sit in reference cycles
        cache_sizes.append((len(C._group_names), len(C._pgs), len(C._coordinates), len(mesh_ids_cache)))
    assert cache_sizes[-1] <= cache_sizes[1], cache_sizes
    # the process group still works after the errors
    total = dtshard.DTensor.from_local(torch.full((1,), float(rank)), mesh, [Shard(0), Shard(0)])
    return errors, total.full_tensor().tolist()


def test_distribute_tensor_on_submeshes_matches_torch():
    for rank, (errors, total) in enumerate(run_distributed(_distribute_tensor_checks, 4)):
        for msg, src in zip(errors, (2, 2, -1)):
            assert f"src_data_rank={src}" in msg and "WITHIN each mesh dim's process group" in msg, (rank, msg)
            assert "mesh (" in msg and "src_data_rank=None" in msg, (rank, msg)
        assert total == [0.0, 1.0, 2.0, 3.0], (rank, total)


# ----------------------------------------------------------------------------------------------
# distribute_module, parallelize_module and the parallel styles; forward + backward
# ----------------------------------------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.norm = nn.LayerNorm(8)
        self.w1 = nn.Linear(8, 12)
        self.w2 = nn.Linear(12, 8)
        with torch.no_grad():  # the same on every rank: SequenceParallel keeps each rank's own copy
            self.norm.weight.copy_(torch.linspace(0.5, 1.5, 8))
            self.norm.bias.copy_(torch.linspace(-0.2, 0.2, 8))

    def forward(self, x):
        return self.w2(F.relu(self.w1(self.norm(x))))


def _tp_plans(styles):
    return {
        # tensor parallel: a replicated input, Colwise then Rowwise
        "tp": (None, {"w1": styles.ColwiseParallel(), "w2": styles.RowwiseParallel()}),
        # sequence parallel: a replicated input moved to Shard(1) by PrepareModuleInput, the norm
        # on sequence shards, and a sequence-sharded DTensor output
        "sp": (
            styles.PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),)),
            {
                "norm": styles.SequenceParallel(),
                "w1": styles.ColwiseParallel(input_layouts=Shard(1)),
                "w2": styles.RowwiseParallel(output_layouts=Shard(1), use_local_output=False),
            },
        ),
    }


def _run_model(model, x, dtensor_cls):
    out = model(x)
    full = out.full_tensor() if isinstance(out, dtensor_cls) else out
    full.square().sum().backward()
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, dtensor_cls) else p.grad) for n, p in model.named_parameters()}
    return full.detach(), grads


def _module_checks():
    rank = dist.get_rank()
    mesh = _mesh_2x2()
    for name in ("dp", "tp"):
        sub = mesh[name]
        group = _group(sub)
        # every rank builds its model from its own seed: the parameters must come from the group's
        # source rank (src_data_rank=0: the group's first rank), as in PyTorch
        ref = _MLP(1000 + group[0])
        x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(7 + group[0]))  # same in a group
        want_out, want_grads = _run_model(ref, x, TorchDTensor)

        # distribute_module: a partition_fn shards w1's weight; everything else is replicated
        dm = {}
        for lib, (dt_cls, dist_tensor, dist_module, _) in LIBS.items():
            def partition(mod_name, mod, m, dist_tensor=dist_tensor):
                if mod_name == "w1":
                    mod.weight = nn.Parameter(dist_tensor(mod.weight.detach(), m, [Shard(0)]))
            dm[lib] = dist_module(_MLP(1000 + rank), sub, partition)
        for (pn, p), (_, q) in zip(dm["dtshard"].named_parameters(), dm["torch"].named_parameters()):
            _same_layout(p, q, f"distribute_module on mesh {name}: {pn} (rank {rank})")
            torch.testing.assert_close(p.full_tensor(), dict(ref.named_parameters())[pn], rtol=0, atol=0)

        for plan_name in ("tp", "sp"):
            results = {}
            for lib, (dt_cls, _, _, styles) in LIBS.items():
                prepare, plan = _tp_plans(styles)[plan_name]
                model = _MLP(1000 + rank)
                if prepare is not None:
                    styles.parallelize_module(model, sub, prepare)
                styles.parallelize_module(model, sub, plan)
                results[lib] = (model, *_run_model(model, x, dt_cls))
            what = f"parallelize_module on mesh {name}, plan {plan_name} (rank {rank})"
            (ours, out, grads), (theirs, t_out, t_grads) = results["dtshard"], results["torch"]
            for (pn, p), (_, q) in zip(ours.named_parameters(), theirs.named_parameters()):
                _same_layout(p, q, f"{what}: parameter {pn}")
            torch.testing.assert_close(out, t_out, msg=what)
            torch.testing.assert_close(out, want_out, msg=what)
            for pn, g in grads.items():
                torch.testing.assert_close(g, t_grads[pn], msg=f"{what}: grad of {pn} vs torch")
                torch.testing.assert_close(g, want_grads[pn], msg=f"{what}: grad of {pn} vs single process")
            for p in ref.parameters():
                p.grad = None
    return True


def test_distribute_module_and_parallelize_module_on_submeshes():
    assert run_distributed(_module_checks, 4) == [True] * 4


# ----------------------------------------------------------------------------------------------
# DTensor.from_local(run_check=True)
# ----------------------------------------------------------------------------------------------


def _from_local_checks(name: str):
    rank = dist.get_rank()
    mesh = _mesh_2x2()
    sub = mesh[name]
    group = _group(sub)
    local = _rank_data(rank, (2, 3))
    for placements, loc in (([Shard(0)], local), ([Shard(1)], local), ([Replicate()], _rank_data(group[0], (2, 3)))):
        ours = dtshard.DTensor.from_local(loc, sub, placements, run_check=True)
        theirs = TorchDTensor.from_local(loc.clone(), sub, placements, run_check=True)
        _same_layout(ours, theirs, f"from_local on mesh {name} {placements} (rank {rank})")
        torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor(), rtol=0, atol=0)
    # only rank 3 passes a wrong shard: its group raises on both ranks, the other group is fine
    bad = _rank_data(rank, (3, 3) if rank == 3 else (2, 3))
    results = []
    for shape in ((4, 3), None):  # without shape= each rank infers the global shape from its own shard
        try:
            dtshard.DTensor.from_local(bad, sub, [Shard(0)], run_check=True, shape=shape)
            results.append("ok")
        except ValueError as e:
            results.append(str(e))
    # the process group stays usable: a collective over the whole mesh
    total = dtshard.DTensor.from_local(torch.full((1,), float(rank)), mesh, [Shard(0), Shard(0)], run_check=True)
    return results, total.full_tensor().tolist()


def test_from_local_run_check_on_submeshes():
    for name, failing in (("tp", {2, 3}), ("dp", {1, 3})):
        for rank, ((with_shape, inferred), total) in enumerate(run_distributed(_from_local_checks, 4, name)):
            assert total == [0.0, 1.0, 2.0, 3.0], (name, rank, total)
            if rank not in failing:
                assert with_shape == inferred == "ok", (name, rank, with_shape, inferred)
                continue
            other = min(failing)
            for part in ("DTensor.from_local(run_check=True)", "shape (4, 3)", "rank 3", "has (3, 3)",
                         "needs (2, 3)", f"rank {other}", "placements (S(0))", "mesh (2,)"):
                assert part in with_shape, (name, rank, part, with_shape)
            for part in ("DTensor.from_local(run_check=True)", "rank 3", "(3, 3)", f"rank {other}", "needs"):
                assert part in inferred, (name, rank, part, inferred)


# ----------------------------------------------------------------------------------------------
# torch.distributed.checkpoint (DCP)
# ----------------------------------------------------------------------------------------------


def _dcp_checks(path: str):
    """As with PyTorch's DTensor: (1) the whole world saves a model that is tp-sharded and replicated
    over dp (DCP keeps one copy of the chunks replicated over dp), and (2) each dp group saves its
    own checkpoint with the tp group as ``process_group``.  Loading goes into another sharding."""
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    mesh = _mesh_2x2()
    tp_mesh, dp_mesh = mesh["tp"], mesh["dp"]
    dp = mesh.get_coordinate()[0]
    w = _rank_data(rank, (4, 6))
    got = {}
    for lib, (_, dist_tensor, _, _) in LIBS.items():
        rep = dist_tensor(_rank_data(0, (4, 6)), mesh, [Replicate(), Replicate()])  # same on every rank
        state = {"w": dist_tensor(rep.to_local(), tp_mesh, [Shard(0)]), "b": dist_tensor(w[0].clone(), tp_mesh, [Replicate()])}
        dcp.save(state, checkpoint_id=f"{path}/{lib}_world")
        dcp.save(state, checkpoint_id=f"{path}/{lib}_dp{dp}", process_group=tp_mesh.get_group())
    for lib, (_, dist_tensor, _, _) in LIBS.items():
        for src in ("dtshard", "torch"):  # each library loads both libraries' checkpoints
            target = {"w": dist_tensor(torch.zeros(4, 6), dp_mesh, [Shard(1)]),
                      "b": dist_tensor(torch.zeros(6), tp_mesh, [Shard(0)])}
            dcp.load(target, checkpoint_id=f"{path}/{src}_world")
            got[(lib, src, "world")] = [t.full_tensor() for t in target.values()]
            target = {"w": dist_tensor(torch.zeros(4, 6), tp_mesh, [Shard(1)]),
                      "b": dist_tensor(torch.zeros(6), tp_mesh, [Shard(0)])}
            dcp.load(target, checkpoint_id=f"{path}/{src}_dp{dp}", process_group=tp_mesh.get_group())
            got[(lib, src, "group")] = [t.full_tensor() for t in target.values()]
            assert isinstance(target["w"], LIBS[lib][0]) and target["w"].placements == (Shard(1),)
    for key, (gw, gb) in got.items():
        want_w = _rank_data(0, (4, 6))
        # the world checkpoint holds one of the dp copies of b; each group's holds its own source's
        want_b = _rank_data(_group(tp_mesh)[0], (4, 6))[0]
        torch.testing.assert_close(gw, want_w, rtol=0, atol=0, msg=str(key))
        if key[2] == "group":
            torch.testing.assert_close(gb, want_b, rtol=0, atol=0, msg=str(key))
        torch.testing.assert_close(gb, got[("torch", key[1], key[2])][1], rtol=0, atol=0, msg=str(key))
    return True


def test_dcp_on_submeshes(tmp_path):
    assert run_distributed(_dcp_checks, 4, str(tmp_path)) == [True] * 4


# ----------------------------------------------------------------------------------------------
# a 2x2 sub-mesh of a 2x2x2 mesh
# ----------------------------------------------------------------------------------------------


def _three_d_checks():
    rank = dist.get_rank()
    mesh = dtshard.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    sub = mesh["dp", "tp"]  # [[0, 1], [2, 3]] on ranks 0-3, [[4, 5], [6, 7]] on ranks 4-7
    x = _rank_data(rank, (4, 6))
    for placements in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Partial(), Shard(1)]):
        for src in (0, 1, None):
            if src is None and isinstance(placements[0], Partial):
                continue  # None promises equal data on every rank, and a Partial's value needs it
            what = f"distribute_tensor on mesh['dp', 'tp'] {placements} src_data_rank={src} (rank {rank})"
            ours = dtshard.distribute_tensor(x, sub, placements, src_data_rank=src)
            _same_layout(ours, torch_distribute_tensor(x.clone(), sub, placements, src_data_rank=src), what)
            if src is not None:
                torch.testing.assert_close(ours.full_tensor(), _rank_data(int(sub.mesh[src, src]), (4, 6)), msg=what)
    tp_mesh = mesh["tp"]
    group = _group(tp_mesh)
    ref = _MLP(1000 + group[0])
    x = torch.randn(2, 4, 8, generator=torch.Generator().manual_seed(7 + group[0]))
    want_out, want_grads = _run_model(ref, x, TorchDTensor)
    model = _MLP(1000 + rank)
    tp_ours.parallelize_module(model, tp_mesh, _tp_plans(tp_ours)["tp"][1])
    out, grads = _run_model(model, x, dtshard.DTensor)
    torch.testing.assert_close(out, want_out)
    for pn, g in grads.items():
        torch.testing.assert_close(g, want_grads[pn], msg=f"grad of {pn} (rank {rank})")
    return True


def test_2x2_submesh_of_a_2x2x2_mesh():
    assert run_distributed(_three_d_checks, 8) == [True] * 8
