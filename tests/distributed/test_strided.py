"""Strided shards (torch's ``_StridedShard``) on real process groups.

- Views that merge a sharded non-first dim (``(b, h, s, d)`` with ``h`` sharded, as ``(b*h, s, d)``)
  keep the shard as a strided shard, and the ops of attention run on it, with ZERO collectives in
  forward and backward; values and gradients equal single-process PyTorch on every rank.
- Every rank's local shard is exactly the one torch's placement code cuts for the placement the
  result claims (``torch_local``), so no view is ever mislabelled (PyTorch's issue 179502:
  ``dt[12, 8] S(1).view(16, 6)`` labelled ``S(0)``); neighbours of that case on 2 and 3 ranks.
- Redistribute from and to strided shards on 1-D and 2x2 meshes: values, torch's local shards,
  and bytes received at most 1.25x the minimum (computed here from torch's own shards).
- Interop with ``torch.distributed.tensor`` (``from_torch`` / ``to_torch``), handlers (which see
  plain layouts, and write back into strided tensors), DCP of strided shards.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from torch.distributed.tensor.placement_types import _StridedShard

import dtshard
from dtshard import Partial, Replicate, Shard
from dtshard.testing import run_distributed

from _cases import plans_made_once, use_plans  # noqa: E402


def SS(d, sf):
    return _StridedShard(d, split_factor=sf)


def torch_local(full, mesh_shape, placements, coord):
    """The shard torch cuts for ``coord`` (its placements' own split code)."""
    t = full
    for i, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            t = p._split_tensor(t, mesh_shape[i], with_padding=False)[0][coord[i]]
    return t


def _check_shard(dt, full, mesh_shape, coord) -> str:
    """'' when ``dt``'s local shard is torch's shard of ``full`` for dt's placements."""
    want = torch_local(full, mesh_shape, list(dt.placements), coord)
    got = dt.to_local()
    if tuple(got.shape) != tuple(want.shape) or not torch.allclose(got, want, atol=1e-5, rtol=1e-5):
        return f"{tuple(dt.shape)} {dt.placements}: local {tuple(got.shape)} vs torch's {tuple(want.shape)}"
    return ""


# ---------------------------------------------------------------------------------------------
# views keep head shards: zero collectives
# ---------------------------------------------------------------------------------------------


def _attention_views(b, h, s, d):
    mesh = dtshard.init_device_mesh("cpu", (2,))
    coord = tuple(mesh.get_coordinate())
    torch.manual_seed(0)
    x = torch.randn(b, h, s, d, requires_grad=True)
    xd = dtshard.distribute_tensor(x.detach(), mesh, [Shard(1)]).requires_grad_()
    with dtshard.debug.CommCounter() as fwd:
        y = xd.view(b * h, s, d)
        z = torch.softmax(torch.bmm(y, y.transpose(1, 2)) / 3.0, -1)
        w = torch.bmm(z, y) * 2 + 1
        out = w.view(b, h, s, d)
    placements = (str(y.placements), str(out.placements))
    loss = (out * out).sum()
    with dtshard.debug.CommCounter() as bwd:
        loss.backward()
    y_ref = x.view(b * h, s, d)
    ref = (torch.bmm(torch.softmax(torch.bmm(y_ref, y_ref.transpose(1, 2)) / 3.0, -1), y_ref) * 2 + 1).view(b, h, s, d)
    (ref * ref).sum().backward()
    problems = [p for p in (_check_shard(y, x.detach().view(b * h, s, d), (2,), coord),
                            _check_shard(out, ref.detach(), (2,), coord)) if p]
    if not torch.allclose(out.full_tensor(), ref, atol=1e-5):
        problems.append("forward values")
    if not isinstance(xd.grad, dtshard.DTensor) or not torch.allclose(xd.grad.full_tensor(), x.grad, atol=1e-4):
        problems.append("gradient")
    # flatten / unflatten / reshape spell the same views
    f = xd.flatten(0, 1)
    u = f.unflatten(0, (b, h))
    r = xd.reshape(b * h, s * d)
    for t, full in ((f, x.detach().flatten(0, 1)), (u, x.detach()), (r, x.detach().reshape(b * h, s * d))):
        p = _check_shard(t, full, (2,), coord)
        if p:
            problems.append(p)
    return (placements, fwd.get_total_counts(), bwd.get_total_counts() - 1,  # the loss's own all_reduce
            str(f.placements), str(u.placements), str(r.placements), str(xd.grad.placements), problems)


@pytest.mark.parametrize("b", [4, 3], ids=["even", "uneven-batch"])
def test_head_sharded_views_move_nothing(b):
    for placements, n_fwd, n_bwd, f, u, r, g, problems in run_distributed(_attention_views, 2, b, 4, 5, 6):
        assert not problems, problems
        assert placements == (f"(_StridedShard(dim=0, sf={b}),)", "(Shard(dim=1),)")
        assert n_fwd == 0 and n_bwd <= 0, (n_fwd, n_bwd)
        assert f == r == f"(_StridedShard(dim=0, sf={b}),)" and u == "(Shard(dim=1),)"
        assert g == "(Shard(dim=1),)"


# ---------------------------------------------------------------------------------------------
# no view is mislabelled (torch issue 179502 and its neighbours)
# ---------------------------------------------------------------------------------------------

_VIEW_CASES = [
    ((12, 8), (16, 6)), ((12, 8), (8, 12)), ((12, 8), (96,)), ((12, 8), (24, 4)), ((12, 8), (2, 6, 8)),
    ((12, 8), (12, 2, 4)), ((12, 8), (3, 4, 8)), ((5, 4), (20,)), ((5, 4), (10, 2)), ((6, 5), (3, 10)),
    ((2, 3, 4), (6, 4)), ((2, 3, 4), (2, 12)), ((2, 3, 4), (24,)),
]


def _views(world):
    mesh = dtshard.init_device_mesh("cpu", (world,))
    coord = tuple(mesh.get_coordinate())
    out = []
    for src_shape, dst_shape in _VIEW_CASES:
        full = torch.arange(float(math.prod(src_shape))).reshape(src_shape)
        for p in [Shard(d) for d in range(len(src_shape))]:
            x = dtshard.distribute_tensor(full, mesh, [p])
            v = x.view(dst_shape)
            back = v.view(src_shape)
            problem = _check_shard(v, full.view(dst_shape), (world,), coord) or \
                _check_shard(back, full, (world,), coord)
            if not torch.equal(v.full_tensor(), full.view(dst_shape)):
                problem += " values"
            out.append((src_shape, str(p), dst_shape, str(v.placements), problem))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_views_are_never_mislabelled(world):
    per_rank = run_distributed(_views, world, world)
    bad = [r for rank in per_rank for r in rank if r[4]]
    assert not bad, bad[:10]
    labels = {(a, b, c): d for a, b, c, d, _ in per_rank[0]}
    # the case: on 2 ranks, S(1) of (12, 8) holds 4 columns: as (16, 6) rows that is no shard
    # of any kind, so the view moves data first; it must never claim S(0) of the local data
    if world == 2:
        assert labels[((12, 8), "S(1)", (16, 6))] == "(Shard(dim=0),)"  # moved to S(0) first
        assert labels[((12, 8), "S(1)", (2, 6, 8))] == "(Shard(dim=2),)"  # kept: no data moves
        assert labels[((12, 8), "S(1)", (96,))] == "(_StridedShard(dim=0, sf=12),)"  # kept, strided
        assert labels[((2, 3, 4), "S(1)", (6, 4))] == "(_StridedShard(dim=0, sf=2),)"


# ---------------------------------------------------------------------------------------------
# redistribute from and to strided shards, at the minimum
# ---------------------------------------------------------------------------------------------


def _min_received(shape, mesh_shape, src, dst):
    """Elements the rank receiving most must receive: what its target shard has and its source
    shard lacks (from torch's shards of an index tensor)."""
    idx = torch.arange(math.prod(shape)).reshape(shape)
    most = 0
    for c in itertools.product(*map(range, mesh_shape)):
        have = set(torch_local(idx, mesh_shape, src, c).reshape(-1).tolist())
        need = set(torch_local(idx, mesh_shape, dst, c).reshape(-1).tolist())
        most = max(most, len(need - have))
    return most


def _redistributes(mesh_shape, shape, transitions, plans):
    """Each transition on every rank: its bytes received, and a problem unless this rank's local
    shard is exactly torch's own shard of the global tensor for ``dst`` (with no Partial among
    the placements, the ranks' shards together ARE the global value, so every rank passing is
    the value check; a ``full_tensor()`` per transition would add a collective as costly as the
    redistribute under test, and its own path is tested by the transitions to Replicate).
    The plans were made once, in the parent (``plans_made_once``)."""
    use_plans(plans)
    mesh = dtshard.init_device_mesh("cpu", mesh_shape)
    coord = tuple(mesh.get_coordinate())
    x = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 0.5 - 3.0
    out = []
    for src, dst in transitions:
        d = dtshard.DTensor.from_local(torch_local(x, mesh_shape, src, coord).clone(), mesh, src, shape=shape)
        with dtshard.debug.CommCounter() as comm:
            y = d.redistribute(mesh, dst)
        problem = _check_shard(y, x, mesh_shape, coord)
        if tuple(y.placements) != tuple(dst):
            problem += f" placements {y.placements}"
        want = torch_local(x, mesh_shape, list(dst), coord)
        if tuple(y.to_local().shape) != tuple(want.shape) or not torch.equal(y.to_local(), want):
            problem += " values"
        out.append((comm.received(), problem))
    return out


def _check_redistributes(mesh_shape, shape, placements):
    trans = [(a, b) for a in itertools.product(placements, repeat=len(mesh_shape))
             for b in itertools.product(placements, repeat=len(mesh_shape))
             if any(isinstance(p, _StridedShard) for p in a + b)]
    world = math.prod(mesh_shape)
    plans = plans_made_once(mesh_shape, shape, torch.float64, trans)
    per_rank = run_distributed(_redistributes, world, mesh_shape, shape, trans, plans, timeout=600)
    bad = []
    for k, (src, dst) in enumerate(trans):
        probs = [per_rank[r][k][1] for r in range(world) if per_rank[r][k][1]]
        got = max(per_rank[r][k][0] for r in range(world))
        want = _min_received(shape, mesh_shape, src, dst) * 8
        if probs:
            bad.append(f"{src} -> {dst}: {probs[0]}")
        elif got > 1.25 * want:
            bad.append(f"{src} -> {dst}: received {got} B, minimum {want} B")
    assert not bad, f"{len(bad)} of {len(trans)}:\n" + "\n".join(bad[:30])


_PLACEMENTS = [Shard(0), Shard(1), Replicate(), SS(0, 2), SS(1, 3), SS(0, 3)]


@pytest.mark.parametrize("shape", [(8, 6), (5, 7)], ids=["even", "uneven"])
def test_strided_redistribute_on_2x2(shape):
    _check_redistributes((2, 2), shape, _PLACEMENTS)


@pytest.mark.parametrize("world,shape", [(4, (8, 6)), (3, (7, 5))])
def test_strided_redistribute_on_1d(world, shape):
    _check_redistributes((world,), shape, _PLACEMENTS)


def _partial_to_strided():
    mesh = dtshard.init_device_mesh("cpu", (2, 2))
    x = torch.arange(48.0).reshape(8, 6)
    coord = tuple(mesh.get_coordinate())
    out = []
    for dst in [(SS(0, 2), Shard(0)), (Replicate(), SS(1, 3)), (SS(0, 2), Replicate())]:
        # a sum over the first mesh dim: one half of the value on each of its ranks
        p = dtshard.DTensor.from_local(torch_local(x, (2, 2), (Replicate(), Replicate()), coord) / 2, mesh,
                                       (Partial(), Replicate()))
        y = p.redistribute(mesh, dst)
        out.append(_check_shard(y, x, (2, 2), coord) + ("" if torch.equal(y.full_tensor(), x) else " values"))
    return out


def test_partial_to_strided():
    for problems in run_distributed(_partial_to_strided, 4):
        assert not any(problems), problems


# ---------------------------------------------------------------------------------------------
# FSDP x TP layout, interop, handlers, DCP
# ---------------------------------------------------------------------------------------------


def _fsdp_tp_layout():
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    mesh = dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    coord = tuple(mesh.get_coordinate())
    pls = (SS(0, 2), Shard(0))  # tp splits rows first, then dp splits each tp chunk
    problems = []
    # torch's distribute_tensor takes even strided shards only
    even = torch.arange(32.0).reshape(8, 4)
    if not torch.equal(dtshard.distribute_tensor(even, mesh, pls).to_local(),
                       torch_distribute(even, mesh, pls).to_local()):
        problems.append("distribute_tensor differs from torch's")
    w = torch.arange(40.0).reshape(10, 4)  # uneven: 10 rows over 2 x 2
    ours = dtshard.distribute_tensor(w, mesh, pls)
    theirs = TorchDTensor.from_local(torch_local(w, (2, 2), pls, coord), mesh, pls, shape=w.shape,
                                     stride=w.stride())
    back = dtshard.DTensor.from_torch(theirs)
    if back.placements != pls or not torch.equal(back.full_tensor(), w):
        problems.append("from_torch")
    t = ours.to_torch()
    if not isinstance(t, TorchDTensor) or not torch.equal(t.full_tensor(), w):
        problems.append("to_torch")
    # the tp-local view: rows [5 * tp, 5 * tp + 5), cut by dp
    if not torch.equal(ours.to_local(), torch_local(w, (2, 2), pls, coord)):
        problems.append("local shard")
    # elementwise math keeps the layout, with no collective
    with dtshard.debug.CommCounter() as comm:
        z = (ours * 2 + 1).relu()
    if z.placements != pls or comm.get_total_counts():
        problems.append(f"elementwise: {z.placements}, {comm.get_total_counts()} collectives")
    # a handler (mean) sees a plain layout; an in-place handler writes back into the strided tensor
    if abs(ours.mean().full_tensor().item() - w.mean().item()) > 1e-6:
        problems.append("mean")
    torch.manual_seed(3)
    r = dtshard.distribute_tensor(torch.zeros(10, 4), mesh, pls)
    r.normal_()
    torch.manual_seed(3)
    want = torch.zeros(10, 4).normal_()
    if r.placements != pls or not torch.equal(r.full_tensor(), want):
        problems.append("normal_ in place")
    return problems


def test_fsdp_times_tp_layout_and_interop():
    for problems in run_distributed(_fsdp_tp_layout, 4):
        assert not problems, problems


def _dcp_strided(path):
    import torch.distributed.checkpoint as dcp

    mesh = dtshard.init_device_mesh("cpu", (2,))
    full = torch.arange(60.0).reshape(3, 4, 5)
    x = dtshard.distribute_tensor(full, mesh, [Shard(1)]).view(12, 5)  # strided: not one block
    w = dtshard.distribute_tensor(full.reshape(12, 5), mesh, [SS(0, 2)])
    dcp.save({"x": x, "w": w}, checkpoint_id=path)
    # load into other layouts: a plain shard, and a strided one
    y = dtshard.distribute_tensor(torch.zeros(12, 5), mesh, [Shard(0)])
    z = dtshard.distribute_tensor(torch.zeros(12, 5), mesh, [SS(0, 3)])
    state = {"x": y, "w": z}
    dcp.load(state, checkpoint_id=path)
    return (str(x.placements), torch.equal(state["x"].full_tensor(), full.reshape(12, 5)),
            torch.equal(state["w"].full_tensor(), full.reshape(12, 5)))


def test_dcp_saves_and_loads_strided_shards(tmp_path):
    for placements, ok_x, ok_w in run_distributed(_dcp_strided, 2, str(tmp_path / "ckpt")):
        assert placements == "(_StridedShard(dim=0, sf=3),)"
        assert ok_x and ok_w
