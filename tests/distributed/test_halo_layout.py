"""Halos kept across layers (dtshard.spatial): exchange counts and exactness against one process.

A chain of stride-1 "same" 3x3 convolutions with GroupNorm and SiLU between them, sharded on H
(and on W, or on the batch, on a 2x2 mesh), in float64: every rank's output, input gradient and
parameter gradients equal the unsharded model's; CommCounter counts the halo all_to_alls of each
pass.  Uneven, empty and thinner-than-the-halo (multi-hop) shards, every padding mode, residual
branches that sum two partial halos, in-place activations, and ops that do not know halos.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtshard
from dtshard import Replicate, Shard
from dtshard.debug import CommCounter
from dtshard.spatial.halo_layout import Halo, halos, with_halo
from dtshard.spatial import halo_layout as L
from dtshard.testing import run_distributed

from _cases import mesh

def _chain(c=4, layers=4, seed=0, padding_mode="zeros", inplace=False, norm="group"):
    torch.manual_seed(seed)
    mods = []
    for _ in range(layers):
        mods.append(nn.Conv2d(c, c, 3, padding=1, padding_mode=padding_mode))
        mods.append(nn.GroupNorm(2, c) if norm == "group" else nn.BatchNorm2d(c))
        mods.append(nn.SiLU(inplace=inplace))
    return nn.Sequential(*mods).double()


def _distribute(model, m):
    dtshard.distribute_module(model, m)
    return model


def _run(m, model, ref, x, placements, depth, loss_fn=None):
    """(max error over output, input grad, parameter grads; forward / backward halo all_to_alls;
    local output rows of each conv)."""
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    (loss_fn or (lambda y: (y * y).sum()))(yr).backward()
    xd = dtshard.distribute_tensor(x, m, placements).requires_grad_()
    rows = []
    hooks = [mod.register_forward_hook(lambda mod, a, out: rows.append(tuple(out._local_tensor.shape)))
             for mod in model.modules() if isinstance(mod, nn.Conv2d)]
    with dtshard.spatial.halo_depth(depth):
        with CommCounter() as fwd:
            y = model(xd)
        with CommCounter() as bwd:
            (loss_fn or (lambda y: (y * y).sum()))(y).backward()
    for h in hooks:
        h.remove()
    errs = [(y.full_tensor() - yr).abs().max().item(), (xd.grad.full_tensor() - xr.grad).abs().max().item()]
    assert not halos(xd.grad._spec)  # a leaf's gradient: the owners' sums
    for p, q in zip(model.parameters(), ref.parameters()):
        errs.append((p.grad.full_tensor() - q.grad).abs().max().item())
    a2a = [sum(1 for r in c.records if r.kind == "all_to_all") for c in (fwd, bwd)]
    return max(errs), a2a, rows, (y.placements, xd.grad.placements) == (xd.placements, xd.placements)


def _chain_case(mesh_shape, placements, shape, depth, kw):
    import copy

    m = mesh(mesh_shape)
    ref = _chain(**kw)
    model = _distribute(copy.deepcopy(ref), m)
    torch.manual_seed(1)
    x = torch.randn(*shape, dtype=torch.float64)
    return _run(m, model, ref, x, [Shard(int(p[1:])) if p != "R" else Replicate() for p in placements], depth)


@pytest.mark.parametrize("world", [2, 4])
def test_chain_of_four_convs_exchanges_once_per_pass(world):
    """Issue #15's measure: 4 stride-1 3x3 convs with GroupNorm + SiLU, H-sharded, local width 64:
    1 halo all_to_all in forward (both sides at once; depth 1 needs 4) and 1 in backward, extra
    compute r(L-1)/w = 3/64 of the local work, fp64 equal to the unsharded model."""
    shape = (2, 4, 64 * world, 6)
    for err, (f, b), rows, kept in run_distributed(_chain_case, world, (world,), ["S2"], shape, 4, {}, timeout=300):
        assert err < 1e-11 and kept, (err, kept)
        assert (f, b) == (1, 1), (f, b)
        extra = sum(r[2] for r in rows) / (4 * 64) - 1
        assert 0 < extra <= 3 / 64 + 1e-12, (rows, extra)
    for err, (f, b), _, _ in run_distributed(_chain_case, world, (world,), ["S2"], shape, 1, {}, timeout=300):
        assert err < 1e-11 and (f, b) == (4, 4), (err, f, b)


@pytest.mark.parametrize("world,h,depth", [
    (4, 13, 4),   # uneven chunks 4, 4, 4, 1
    (4, 5, 8),    # 2, 2, 1, 0: an empty shard, halos wider than the shards (multi-hop)
    (3, 10, 3),   # the halo runs out after 3 layers: a second exchange
    (4, 6, 2),
    (2, 9, 4),
])
def test_chain_uneven_empty_and_multi_hop_shards(world, h, depth):
    expect = {4: 1, 8: 1, 3: 2, 2: 2}[depth]
    for err, (f, b), _, _ in run_distributed(_chain_case, world, (world,), ["S2"], (2, 4, h, 5), depth, {},
                                             timeout=300):
        assert err < 1e-11, err
        assert f == expect and b <= expect, (f, b)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
def test_chain_padding_modes_exact(mode):
    """Non-zero padding modes pad with ``F.pad`` before a padding-0 convolution: the pad does
    not keep a halo (it drops it), so these chains exchange per layer, and stay exact.  (A
    circular pad of a sharded dim replicates, as before.)"""
    for err, _, _, _ in run_distributed(_chain_case, 4, (4,), ["S2"], (1, 4, 14, 5), 4, {"padding_mode": mode},
                                        timeout=300):
        assert err < 1e-11, err


@pytest.mark.parametrize("placements,expect", [(["S2", "S3"], (2, 2)), (["S0", "S2"], (1, 1))],
                         ids=["HxW", "batchxH"])
def test_chain_on_a_2x2_mesh(placements, expect):
    """H and W both carry halos (the corners arrive through the second dim's exchange of the
    first dim's rows): one exchange per sharded dim and pass.  Or data x spatial."""
    for err, a2a, _, kept in run_distributed(_chain_case, 4, (2, 2), placements, (2, 4, 12, 10), 4, {}, timeout=300):
        assert err < 1e-11 and kept, (err, kept)
        assert tuple(a2a) == expect, a2a


def test_chain_in_place_activations_and_batch_norm():
    for err, (f, _), _, _ in run_distributed(_chain_case, 2, (2,), ["S2"], (2, 4, 12, 5), 4, {"inplace": True},
                                             timeout=300):
        assert err < 1e-11 and f == 1, (err, f)
    for err, _, _, _ in run_distributed(_chain_case, 2, (2,), ["S2"], (2, 4, 12, 5), 4, {"norm": "batch"},
                                        timeout=300):
        assert err < 1e-11, err


class _Branches(nn.Module):
    """One activation read by two convolutions (autograd sums two partial halos), a residual
    add of a plain shard and a halo, a max pool (no halo support: drops it)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.c0 = nn.Conv2d(3, 4, 3, padding=1)
        self.a = nn.Conv2d(4, 4, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 1)
        self.c = nn.Conv2d(4, 4, 5, padding=2)

    def forward(self, x):
        h = F.silu(self.c0(x))
        y = self.a(h) + self.b(h) * 0.5 - h
        z = self.c(torch.tanh(y))
        return F.max_pool2d(z + y, 2)


def _branches(world, depth):
    import copy

    m = mesh((world,))
    ref = _Branches().double()
    model = _distribute(copy.deepcopy(ref), m)
    torch.manual_seed(4)
    x = torch.randn(2, 3, 16, 6, dtype=torch.float64)
    err, a2a, _, _ = _run(m, model, ref, x, [Shard(2)], depth, loss_fn=lambda y: (y.sin() * y).sum())
    return err, a2a


@pytest.mark.parametrize("world", [2, 4])
def test_branches_partial_sums_and_halo_free_ops(world):
    for err, _ in run_distributed(_branches, world, world, 3, timeout=300):
        assert err < 1e-11, err


def _auto_learns(_=None):
    """Under "auto" the model asks for 8 layers of halo on this latency-bound chain of 4 (local
    width 64); the first step's widening learns that its chain used 4, and later steps fetch 4."""
    import copy

    m = mesh((2,))
    ref = _chain()
    torch.manual_seed(1)
    x = torch.randn(2, 4, 64, 6, dtype=torch.float64)
    out = []
    model = _distribute(copy.deepcopy(ref), m)
    for step in range(3):
        for p in model.parameters():
            p.grad = None
        for q in ref.parameters():
            q.grad = None
        out.append(_run(m, model, ref, x, [Shard(2)], "auto")[:3])
    d4 = _run(m, _distribute(copy.deepcopy(ref), m), ref, x, [Shard(2)], 4)[2]
    return out, d4


def test_auto_depth_learns_the_chain_length():
    for steps, rows4 in run_distributed(_auto_learns, 2, timeout=300):
        (e0, a0, rows0), (e1, a1, rows1), (e2, a2, rows2) = steps
        assert max(e0, e1, e2) < 1e-11
        assert tuple(a0) == tuple(a1) == tuple(a2) == (1, 1)
        assert sum(r[2] for r in rows0) > sum(r[2] for r in rows4)  # 8 layers' rows the first time
        assert rows1 == rows2 == rows4  # then the 4 the chain needs


def _api(_=None):
    m = mesh((2,))
    x = dtshard.distribute_tensor(torch.arange(2.0 * 10 * 3, dtype=torch.float64).reshape(1, 2, 10, 3), m, [Shard(2)])
    w = dtshard.distribute_tensor(torch.ones(2, 2, 3, 3, dtype=torch.float64), m, [Replicate()])
    with dtshard.spatial.halo_depth(3):
        y = F.conv2d(x, w, padding=1)
    ref = F.conv2d(x.full_tensor(), w.full_tensor(), padding=1)
    r = torch.distributed.get_rank()
    out = {
        "halo": dtshard.spatial.halo_of(y),
        "local": tuple(y._local_tensor.shape),
        "to_local": tuple(y.to_local().shape),
        "to_local_ok": bool(torch.equal(y.to_local(), ref[:, :, 5 * r:5 * r + 5])),
        "full_ok": bool(torch.equal(y.full_tensor(), ref)),
        "redist_ok": bool(torch.equal(y.redistribute(m, [Shard(3)]).full_tensor(), ref)),
        "sum_ok": abs(y.sum().full_tensor().item() - ref.sum().item()) < 1e-9,
        "dropped": dtshard.spatial.halo_of(dtshard.spatial.drop_halo(y)),
        "relu_halo": dtshard.spatial.halo_of(torch.relu(y)),
        "view_halo": dtshard.spatial.halo_of(y.view(2, 10, 3)),
        "repr": "halo=" in repr(y),
        # the halo is part of the spec's identity (cache keys); other placements drop it
        "spec": (y._spec != y._spec.plain, hash(y._spec) != hash(y._spec.plain),
                 not halos(y._spec.with_placements([Replicate()])), with_halo(y._spec.plain, halos(y._spec)) == y._spec,
                 with_halo(y._spec.plain, [Halo(2, 0, 0, 0)]) == y._spec.plain),
    }
    return out


def _stale(_=None):
    """An in-place write into a tensor with a halo, or into an alias of it, leaves the
    neighbours' copies stale: the next op that reads halo rows drops them first."""
    m = mesh((2,))
    g = torch.Generator().manual_seed(0)
    x = dtshard.distribute_tensor(torch.randn(1, 2, 12, 3, generator=g, dtype=torch.float64), m, [Shard(2)])
    w = dtshard.distribute_tensor(torch.randn(2, 2, 3, 3, generator=g, dtype=torch.float64), m, [Replicate()])
    errs = []
    for write in ("aware", "other"):
        with dtshard.spatial.halo_depth(3):
            y = F.conv2d(x, w, padding=1)
            alias = y.detach()
            if write == "aware":
                y.mul_(2.0)  # computes on the halo rows too
            else:
                y.copy_(x * 3.0)  # from a plain shard: y drops its halo, writes its owned rows
            full = y.full_tensor()
            for t in (y, alias):
                z = F.conv2d(t, w, padding=1)
                errs.append((z.full_tensor() - F.conv2d(full, w.full_tensor(), padding=1)).abs().max().item())
    return errs


def test_in_place_writes_never_leave_stale_halo_rows():
    for errs in run_distributed(_stale, 2):
        assert max(errs) < 1e-12, errs


def test_halo_api_and_ops_that_drop_it():
    r0, r1 = run_distributed(_api, 2)
    for r in (r0, r1):
        assert r["halo"] == {2: (2, 2)}
        assert r["to_local"] == (1, 2, 5, 3)
        assert r["to_local_ok"] and r["full_ok"] and r["redist_ok"] and r["sum_ok"] and r["repr"]
        assert r["dropped"] == {} and r["view_halo"] == {}
        assert r["relu_halo"] == {2: (2, 2)}
        assert all(r["spec"]), r["spec"]
    # the ranks at the global edges hold no rows beyond them: 5 owned + 2 inside
    assert r0["local"] == (1, 2, 7, 3) and r1["local"] == (1, 2, 7, 3)


def _compiled_chain(depth):
    import copy

    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    m = mesh((2,))
    ref = _chain(layers=3)
    model = _distribute(copy.deepcopy(ref), m)
    torch.manual_seed(1)
    x = torch.randn(2, 4, 16, 5, dtype=torch.float64)
    xr = x.clone().requires_grad_()
    (ref(xr) ** 2).sum().backward()
    f = torch.compile(model, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    xd = dtshard.distribute_tensor(x, m, [Shard(2)]).requires_grad_()
    with dtshard.spatial.halo_depth(depth):
        y = f(xd)
        (y ** 2).sum().backward()
    err = max((xd.grad.full_tensor() - xr.grad).abs().max().item(),
              *((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    # an exchange is the custom op or, when its rows are kept for backward, a functional all_to_all
    counts = [(code.count("dtshard.halo_exchange") + code.count("_c10d_functional.all_to_all_single.default("),
               code.count("dtshard.halo_accumulate")) for code in graphs]
    return err, counts


def test_compiled_chain_one_exchange_each_way():
    for err, counts in run_distributed(_compiled_chain, 2, 3, timeout=600):
        assert err < 1e-11, err
        assert counts == [(1, 0), (0, 1)], counts  # forward graph, backward graph


# ---- metadata only (no process group) ---------------------------------------------------------


def test_ext_range_and_grow_plan_arithmetic():
    # N = 10 over 4 ranks: chunks [0,3) [3,6) [6,9) [9,10); halo (2, 1)
    assert [L.ext_range(10, 4, q, 2, 1) for q in range(4)] == [(0, 4), (1, 7), (4, 10), (7, 10)]
    # N = 5 over 4: chunks 2, 2, 1, 0 (the empty one at [5, 5)); a halo wider than the shards
    assert [L.ext_range(5, 4, q, 3, 3) for q in range(4)] == [(0, 5), (0, 5), (1, 5), (2, 5)]
    p = L.grow_plan(5, 4, 3, 3, 3)
    assert p.window_length == 3 and p.recv_lengths == (0, 2, 1, 0)


def test_auto_depth_model():
    assert L.auto_depth(row_flops=0.0, radius=1, width=64) == 1
    small = L.auto_depth(row_flops=1e3, radius=1, width=64)
    big = L.auto_depth(row_flops=1e9, radius=1, width=64)
    assert small == L.model.max_depth and big == 1
    # the first layer's extra rows 2 r (n - 1) within a quarter of the shard
    assert L.auto_depth(row_flops=1e3, radius=1, width=8) == 2
    assert L.auto_depth(row_flops=1e3, radius=1, width=16) == 3
    assert L.auto_depth(row_flops=1e3, radius=2, width=8) == 1


def test_halo_depth_policy():
    with pytest.raises(ValueError):
        dtshard.spatial.halo_depth(0)
    with dtshard.spatial.halo_depth(3):
        assert dtshard.spatial.get_halo_depth() == 3
        with dtshard.spatial.halo_depth("auto"):
            assert dtshard.spatial.get_halo_depth() == "auto"
        assert dtshard.spatial.get_halo_depth() == 3
    assert dtshard.spatial.get_halo_depth() == "auto"


# ---- a seeded sweep of random chains ----------------------------------------------------------


class _Random(nn.Module):
    """A random sequence of layers that keep, consume, widen or drop halos (convolutions of
    radius 0-2, grouped and dilated, norms, activations in place, residual adds, a pool)."""

    def __init__(self, seed: int, c: int = 4):
        super().__init__()
        import random

        rng = random.Random(seed)
        torch.manual_seed(seed)
        self.kinds = []
        layers = []
        for _ in range(rng.randint(3, 7)):
            kind = rng.choice(["conv3", "conv3", "conv5", "conv3d2", "conv1", "gn", "bn", "silu", "relu_", "res",
                               "scale", "pool"])
            if kind.startswith("conv"):
                k, d = {"conv3": (3, 1), "conv5": (5, 1), "conv3d2": (3, 2), "conv1": (1, 1)}[kind]
                layers.append(nn.Conv2d(c, c, k, padding=d * (k - 1) // 2, dilation=d, groups=rng.choice([1, 2])))
            elif kind == "gn":
                layers.append(nn.GroupNorm(2, c))
            elif kind == "bn":
                layers.append(nn.BatchNorm2d(c))
            else:
                layers.append(nn.Identity())
            self.kinds.append(kind)
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        skip = x
        for kind, layer in zip(self.kinds, self.layers):
            if kind == "silu":
                x = F.silu(x)
            elif kind == "relu_":
                x = F.relu(x.clone(), inplace=True)
            elif kind == "res":
                x, skip = x + skip, x
            elif kind == "scale":
                x = x * 0.5 + 1.0
            elif kind == "pool":
                x = F.avg_pool2d(x, 3, stride=1, padding=1)
            else:
                x = layer(x)
        return x


def _random_case(mesh_shape, placements, seeds):
    import copy

    m = mesh(mesh_shape)
    out = []
    for seed in seeds:
        depth = (2, 3, "auto")[seed % 3]
        ref = _Random(seed).double()
        model = _distribute(copy.deepcopy(ref), m)
        torch.manual_seed(seed + 1)
        h = 5 + seed % 13
        x = torch.randn(2, 4, h, 3 + seed % 4, dtype=torch.float64)
        err = _run(m, model, ref, x, [Shard(int(p[1:])) for p in placements], depth,
                   loss_fn=lambda y: (y * y.detach().sin()).sum())[0]
        out.append((seed, ref.kinds, err))
    return out


@pytest.mark.parametrize("mesh_shape,placements", [((2,), ["S2"]), ((3,), ["S2"]), ((4,), ["S2"]),
                                                   ((2, 2), ["S2", "S3"])], ids=["2", "3", "4", "2x2"])
def test_random_chains_exact(mesh_shape, placements):
    import math

    seeds = list(range(8 * math.prod(mesh_shape), 8 * math.prod(mesh_shape) + 8))
    for res in run_distributed(_random_case, math.prod(mesh_shape), mesh_shape, placements, seeds, timeout=300):
        bad = [r for r in res if not r[2] < 1e-10]
        assert not bad, bad
