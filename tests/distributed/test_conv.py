"""Spatially sharded convolution (halo exchange) and pooling against single-process PyTorch.

One seeded randomized sweep per mesh (2, 3, 4 ranks; 2x2 with H x W, batch x H, channels x H),
each config checked on every rank: the local output equals the chunk of the reference output that
the output placements claim (so values, shape and placements at once), and grad_input,
grad_weight, grad_bias equal PyTorch's.  Failures come back as strings so one call covers many
configs.  Plus traffic checks with CommCounter against docs/HALO.md's halo sizes.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import dtshard
from dtshard import Replicate, Shard
from dtshard.debug import CommCounter
from dtshard.spatial.halo import conv_output_length, pool_output_length, window_plan
from dtshard.spec import chunk_range, local_shape_and_offset
from dtshard.testing import run_distributed

from _cases import Ps, global_tensor, mesh

_CONV = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}


# ---------------------------------------------------------------------------------------------
# config generation (parent process, seeded)
# ---------------------------------------------------------------------------------------------


def _conv_config(rng: random.Random, mesh_shape, layout: str) -> dict:
    """A random valid conv config whose input placements follow ``layout``:
    'sp' (one spatial dim per mesh dim), 'batch_sp' (S0 then a spatial dim), 'ch_sp' (S1 then a
    spatial dim, weight S1), 'out_sp' (R then a spatial dim, weight S0), 'hw' (two spatial dims on
    a 2-D mesh)."""
    nsp = rng.choice([1, 2, 2, 3]) if layout != "hw" else rng.choice([2, 3])
    n_sharded = 2 if layout == "hw" else 1
    sharded = sorted(rng.sample(range(nsp), n_sharded))
    c_in = rng.choice([1, 2, 4])
    groups = rng.choice([1, 1, 2, c_in]) if layout not in ("ch_sp", "out_sp") else 1
    if c_in % groups:
        groups = 1
    c_out = groups * rng.choice([1, 2])
    same = rng.random() < 0.15
    ks, ss, ds, ps, ns = [], [], [], [], []
    for j in range(nsp):
        big = j in sharded
        k = rng.randint(1, 7) if big else rng.randint(1, 3)
        d = rng.choice([1, 1, 2, 3]) if k > 1 else 1
        s = 1 if same else rng.choice([1, 1, 2, 3])
        p = rng.randint(0, 3)
        eff = d * (k - 1) + 1
        lo = max(1, eff - 2 * p)  # the output must have at least one element
        hi = 12 if (big and nsp <= 2) else (7 if big else 4)
        n = rng.randint(lo, max(lo, hi)) if rng.random() < 0.7 else rng.randint(lo, lo + 3)  # small: empty shards
        ks.append(k), ss.append(s), ds.append(d), ps.append(p), ns.append(n)
    batch = rng.choice([1, 2, 3])
    h = f"S{2 + sharded[0]}"
    place = {"sp": [h], "batch_sp": ["S0", h], "ch_sp": ["S1", h], "out_sp": ["R", h],
             "hw": [h, f"S{2 + sharded[-1]}"]}[layout]
    w_place = ["R"] * len(mesh_shape)
    if layout == "ch_sp":
        w_place[0] = "S1"
    if layout == "out_sp":
        w_place[0] = "S0"
    return dict(nsp=nsp, batch=batch, c_in=c_in, c_out=c_out, groups=groups, k=ks, stride=ss, dilation=ds,
                padding="same" if same else ps, n=ns, bias=rng.random() < 0.7, x_place=place, w_place=w_place,
                seed=rng.randint(0, 10**6))


def _fixed_configs(world: int) -> list[dict]:
    """HALO.md's worked cases (scaled down), multi-hop, empty and size-1 shards."""
    base = dict(nsp=1, batch=1, c_in=2, c_out=2, groups=1, dilation=[1], bias=True, x_place=["S2"], w_place=["R"],
                seed=7)
    cases = [
        dict(k=[3], stride=[1], padding=[1], n=[16]),
        dict(k=[3], stride=[2], padding=[1], n=[16]),
        dict(k=[3], stride=[1], padding=[2], n=[16], dilation=[2]),
        dict(k=[7], stride=[2], padding=[3], n=[22]),
        dict(k=[5], stride=[1], padding=[1], n=[16]),
        dict(k=[7], stride=[1], padding=[3], n=[8]),  # halo 3 > shard 2: multi-hop
        dict(k=[7], stride=[1], padding=[3], n=[5]),  # empty and size-1 shards
        dict(k=[3], stride=[1], padding=[3], n=[2], dilation=[3]),
        dict(k=[4], stride=[1], padding="same", n=[9], dilation=[1]),  # even kernel 'same': asymmetric pad
        dict(k=[2], stride=[3], padding=[0], n=[world]),
    ]
    return [{**base, **c} for c in cases]


def _sweep(seed: int, count: int, mesh_shape, layouts) -> list[dict]:
    rng = random.Random(seed)
    return [_conv_config(rng, mesh_shape, layouts[i % len(layouts)]) for i in range(count)]


# ---------------------------------------------------------------------------------------------
# the per-rank checker
# ---------------------------------------------------------------------------------------------


def _expected_local(full: torch.Tensor, m, placements) -> torch.Tensor:
    shape, offset = local_shape_and_offset(full.shape, tuple(m.shape), placements, m.get_coordinate())
    x = full
    for d, (o, s) in enumerate(zip(offset, shape)):
        x = x.narrow(d, o, s)
    return x


def _check_conv(cfg: dict, mesh_shape) -> None:
    m = mesh(mesh_shape)
    nsp = cfg["nsp"]
    conv = _CONV[nsp]
    x = global_tensor((cfg["batch"], cfg["c_in"], *cfg["n"]), cfg["seed"]) / 4
    w = global_tensor((cfg["c_out"], cfg["c_in"] // cfg["groups"], *cfg["k"]), cfg["seed"] + 1) / 4
    b = global_tensor((cfg["c_out"],), cfg["seed"] + 2) / 4 if cfg["bias"] else None
    kw = dict(stride=cfg["stride"], padding=cfg["padding"], dilation=cfg["dilation"], groups=cfg["groups"])
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    br = b.clone().requires_grad_() if b is not None else None
    ref = conv(xr, wr, br, **kw)
    xd = dtshard.distribute_tensor(x, m, Ps(cfg["x_place"]), src_data_rank=None).requires_grad_()
    wd = dtshard.distribute_tensor(w, m, Ps(cfg["w_place"]), src_data_rank=None).requires_grad_()
    rep = [Replicate()] * m.ndim
    bd = dtshard.distribute_tensor(b, m, rep, src_data_rank=None).requires_grad_() if b is not None else None
    out = conv(xd, wd, bd, **kw)
    assert isinstance(out, dtshard.DTensor)
    assert tuple(out.shape) == tuple(ref.shape), f"global shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    # every spatially sharded mesh dim keeps Shard(d) on the output
    for i, p in enumerate(Ps(cfg["x_place"])):
        if isinstance(p, Shard) and p.dim >= 2:
            assert out.placements[i] == p, f"output placements {out.placements}"
    if not any(p.is_partial() for p in out.placements):
        torch.testing.assert_close(out.to_local(), _expected_local(ref.detach(), m, out.placements))
    full = out.full_tensor()
    torch.testing.assert_close(full, ref)
    gw = torch.randn(ref.shape, generator=torch.Generator().manual_seed(cfg["seed"] + 3))
    (ref * gw).sum().backward()
    (full * gw).sum().backward()  # through full_tensor's backward (a local slice) into the conv
    torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, msg=lambda s: f"grad_input: {s}")
    torch.testing.assert_close(wd.grad.full_tensor(), wr.grad, msg=lambda s: f"grad_weight: {s}")
    if b is not None:
        torch.testing.assert_close(bd.grad.full_tensor(), br.grad, msg=lambda s: f"grad_bias: {s}")
    for i, p in enumerate(Ps(cfg["x_place"])):
        if isinstance(p, Shard) and p.dim >= 2:
            assert xd.grad.placements[i] == p, f"grad_input placements {xd.grad.placements}"


def _run_conv_configs(configs, mesh_shape) -> list[str]:
    failures = []
    for k, cfg in enumerate(configs):
        try:
            _check_conv(cfg, mesh_shape)
        except Exception as e:  # collect: one call covers many configs
            failures.append(f"config {k} {cfg}: {type(e).__name__}: {str(e)[:600]}")
    return failures


def _assert_no_failures(results) -> None:
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: {len(failures)} failures\n" + "\n".join(failures[:10])


# ---------------------------------------------------------------------------------------------
# the sweep
# ---------------------------------------------------------------------------------------------

_SWEEP = {  # world -> (mesh shape, random count, layouts)
    2: ((2,), 45, ["sp"]),
    3: ((3,), 45, ["sp"]),
    4: ((4,), 35, ["sp"]),
}


@pytest.mark.parametrize("world", sorted(_SWEEP))
def test_conv_sweep_1d_mesh(world):
    mesh_shape, count, layouts = _SWEEP[world]
    configs = _fixed_configs(world) + _sweep(1000 + world, count, mesh_shape, layouts)
    _assert_no_failures(run_distributed(_run_conv_configs, world, configs, mesh_shape, timeout=600))


def test_conv_sweep_2x2_mesh():
    """H x W on a 2x2 mesh (exchanges per dim in turn: corners arrive through the second), batch
    x H, in-channels x H (Partial output, halo on partial sums), out-channels x H."""
    configs = _sweep(2024, 40, (2, 2), ["hw", "batch_sp", "ch_sp", "out_sp"])
    _assert_no_failures(run_distributed(_run_conv_configs, 4, configs, (2, 2), timeout=600))


def test_sweep_size():
    n = sum(len(_fixed_configs(w)) + c for w, (_, c, _) in _SWEEP.items()) + 40
    assert n >= 150


# ---------------------------------------------------------------------------------------------
# non-spatial layouts go through the same handler
# ---------------------------------------------------------------------------------------------


def _non_spatial(mesh_shape):
    cases = [
        (["S0"], ["R"], ["R"]),  # batch
        (["R"], ["S0"], ["S0"]),  # out channels
        (["S1"], ["S1"], ["R"]),  # in channels: Partial output
        (["S1"], ["R"], ["S0"]),  # in channels, weight sliced locally
        (["Psum"], ["R"], ["R"]),
        (["R"], ["Psum"], ["R"]),
        (["R"], ["R"], ["R"]),
        (["S3"], ["S0"], ["R"]),  # spatial wins, weight gathered
    ]
    failures = []
    m = mesh(mesh_shape)
    for xp, wp, bp in cases:
        for groups in (1, 2):
            try:
                x = global_tensor((3, 4, 5, 6), 1) / 4
                w = global_tensor((4, 4 // groups, 3, 2), 2) / 4
                b = global_tensor((4,), 3) / 4
                from _cases import make_dtensor

                xd = make_dtensor(x, m, Ps(xp)).detach().requires_grad_()
                wd = make_dtensor(w, m, Ps(wp)).detach().requires_grad_()
                bd = make_dtensor(b, m, Ps(bp)).detach().requires_grad_()
                xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
                ref = F.conv2d(xr, wr, br, padding=1, groups=groups)
                out = F.conv2d(xd, wd, bd, padding=1, groups=groups)
                torch.testing.assert_close(out.full_tensor(), ref)
                g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(0))
                (ref * g).sum().backward()
                (out * dtshard.distribute_tensor(g, m, [Replicate()], src_data_rank=None)).sum().backward()
                for name, d, r in (("x", xd, xr), ("w", wd, wr), ("b", bd, br)):
                    torch.testing.assert_close(d.grad.full_tensor(), r.grad, msg=lambda s: f"grad {name}: {s}")
            except Exception as e:
                failures.append(f"{xp} {wp} {bp} groups={groups}: {type(e).__name__}: {str(e)[:400]}")
    return failures


def _transposed(mesh_shape):
    """Transposed convolution under every input layout (a spatial shard goes through the halo path;
    test_conv_extra.py sweeps it)."""
    m = mesh(mesh_shape)
    failures = []
    for xp in (["S2"], ["S0"], ["Psum"], ["S1"]):
        try:
            from _cases import make_dtensor

            x = global_tensor((2, 4, 5, 3), 1) / 4
            w = global_tensor((4, 3, 3, 2), 2) / 4
            xd = make_dtensor(x, m, Ps(xp)).detach().requires_grad_()
            wd = dtshard.distribute_tensor(w, m, [Replicate()]).requires_grad_()
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            ref = F.conv_transpose2d(xr, wr, stride=2, padding=1, output_padding=1)
            out = F.conv_transpose2d(xd, wd, stride=2, padding=1, output_padding=1)
            full = out.full_tensor()
            torch.testing.assert_close(full, ref)
            (ref * ref.detach()).sum().backward()
            (full * ref.detach()).sum().backward()
            torch.testing.assert_close(xd.grad.full_tensor(), xr.grad)
            torch.testing.assert_close(wd.grad.full_tensor(), wr.grad)
        except Exception as e:
            failures.append(f"transposed {xp}: {type(e).__name__}: {str(e)[:400]}")
    return failures


def _output_mask(mesh_shape):
    """Only some inputs require grad: convolution_backward gets a partial output_mask."""
    m = mesh(mesh_shape)
    x = global_tensor((2, 2, 9, 4), 1) / 4
    w = global_tensor((3, 2, 3, 3), 2) / 4
    b = global_tensor((3,), 3) / 4
    failures = []
    for need in ((True, False, False), (False, True, False), (False, False, True), (True, False, True)):
        try:
            xr, wr, br = (t.clone().requires_grad_(q) for t, q in zip((x, w, b), need))
            xd = dtshard.distribute_tensor(x, m, [Shard(2)]).requires_grad_(need[0])
            wd = dtshard.distribute_tensor(w, m, [Replicate()]).requires_grad_(need[1])
            bd = dtshard.distribute_tensor(b, m, [Replicate()]).requires_grad_(need[2])
            ref = F.conv2d(xr, wr, br, padding=2, dilation=2)
            with CommCounter() as comm:
                full = F.conv2d(xd, wd, bd, padding=2, dilation=2).full_tensor()
                (full * ref.detach()).sum().backward()
            (ref * ref.detach()).sum().backward()
            for d, r in zip((xd, wd, bd), (xr, wr, br)):
                if r.requires_grad:
                    torch.testing.assert_close(d.grad.full_tensor(), r.grad)
                else:
                    assert d.grad is None
            if not need[1]:  # no grad_weight: the input window is not rebuilt in backward
                kinds = [r.kind for r in comm.records if r.op == "aten.convolution_backward.default"]
                assert kinds == (["all_to_all"] if need[0] else []), kinds
        except Exception as e:
            failures.append(f"{need}: {type(e).__name__}: {str(e)[:400]}")
    return failures


def test_conv_backward_output_mask():
    _assert_no_failures(run_distributed(_output_mask, 2, (2,)))


def test_conv_transpose_layouts():
    _assert_no_failures(run_distributed(_transposed, 2, (2,)))


def test_conv_non_spatial_layouts():
    _assert_no_failures(run_distributed(_non_spatial, 2, (2,)))


def _conv_placements():
    m = mesh((2,))
    x = global_tensor((2, 4, 6, 6), 1)
    out = {}
    for name, xp, wp in (("batch", "S0", "R"), ("outch", "R", "S0"), ("inch", "S1", "S1"), ("spatial", "S2", "R")):
        xd = dtshard.distribute_tensor(x, m, Ps([xp]))
        wd = dtshard.distribute_tensor(global_tensor((4, 4, 3, 3), 2), m, Ps([wp]))
        out[name] = str(F.conv2d(xd, wd, padding=1).placements)
    return out


def test_conv_output_placements_follow_the_layout():
    out = run_distributed(_conv_placements, 2)[0]
    assert out == {"batch": "(Shard(dim=0),)", "outch": "(Shard(dim=1),)", "inch": "(Partial(sum),)",
                   "spatial": "(Shard(dim=2),)"}


# ---------------------------------------------------------------------------------------------
# traffic: exactly HALO.md's halos, nothing across the wrap-around
# ---------------------------------------------------------------------------------------------


def _halo_traffic(n_in, k, s, d, p):
    m = mesh((4,))
    width, chans = 5, 2
    x = dtshard.distribute_tensor(global_tensor((1, chans, n_in, width), 1), m, [Shard(2)]).requires_grad_()
    w = dtshard.distribute_tensor(global_tensor((3, chans, k, 3), 2), m, [Replicate()]).requires_grad_()
    with CommCounter() as fwd, dtshard.spatial.halo_depth(1):  # one layer's halo: HALO.md's sizes
        out = F.conv2d(x, w, stride=(s, 1), padding=(p, 1), dilation=(d, 1))
    g = dtshard.DTensor.from_local(torch.ones(out.to_local().shape), m, out.placements, shape=out.shape)
    with CommCounter() as bwd:
        out.backward(g)
    conv_f = [r for r in fwd.records if r.op == "aten.convolution.default"]
    conv_b = [r for r in bwd.records if r.op == "aten.convolution_backward.default"]
    return ([r.kind for r in conv_f], sum(r.nbytes for r in conv_f), [r.kind for r in conv_b],
            sum(r.nbytes for r in conv_b), str(out.placements))


# (N, k, s, d, p) -> per rank (recv_left, recv_right): docs/HALO.md's worked cases
_HALO_CASES = [
    ((16, 3, 1, 1, 1), [(0, 1), (1, 1), (1, 1), (1, 0)]),
    ((16, 3, 2, 1, 1), [(0, 0), (1, 0), (1, 0), (1, 0)]),
    ((16, 3, 1, 2, 2), [(0, 2), (2, 2), (2, 2), (2, 0)]),
    ((16, 5, 1, 1, 1), [(0, 3), (1, 3), (1, 3), (1, 0)]),
    ((8, 7, 1, 1, 3), [(0, 3), (2, 3), (3, 2), (3, 0)]),  # multi-hop
]


@pytest.mark.parametrize("case,recv", _HALO_CASES, ids=[str(c) for c, _ in _HALO_CASES])
def test_halo_traffic_matches_halo_md(case, recv):
    n_in, k, s, d, p = case
    # what each rank sends = what its neighbours receive from it (plan arithmetic cross-check)
    plans = [window_plan(n_in, conv_output_length(n_in, k, s, d, p, p), 4, r, s, d * (k - 1) + 1, p) for r in range(4)]
    assert [(pl.recv_left, pl.recv_right) for pl in plans] == recv
    row = 1 * 2 * 5 * 4  # batch x channels x width x float32 bytes
    results = run_distributed(_halo_traffic, 4, *case)
    total_recv = sum(l + r for l, r in recv)
    assert sum(res[1] for res in results) == total_recv * row  # every halo element moves exactly once
    for rank, (kinds_f, bytes_f, kinds_b, bytes_b, placements) in enumerate(results):
        assert kinds_f == ["all_to_all"], kinds_f  # one exchange, no gather
        assert bytes_f == plans[rank].send_elements() * row
        # backward: only the halo gradients sent back; the input window (for grad_weight) is
        # rebuilt from the halo rows the forward received (spatial/conv.py _kept_window)
        assert kinds_b == ["all_to_all"], kinds_b
        assert bytes_b == sum(recv[rank]) * row
        assert placements == "(Shard(dim=2),)"
    # edge ranks never send across the wrap-around: rank 0 only to its right, rank 3 only left
    assert plans[0].send_lengths[3] == 0 and plans[3].send_lengths[0] == 0
    if case == (16, 3, 1, 1, 1):
        assert results[0][1] == row and results[3][1] == row  # one row each, to the inner side only


def test_output_length_formulas_match_pytorch():
    rng = random.Random(1)
    for _ in range(300):
        n, k, s, d = rng.randint(1, 12), rng.randint(1, 5), rng.randint(1, 3), rng.randint(1, 2)
        p = rng.randint(0, k // 2)
        x = torch.zeros(1, 1, n)
        if conv_output_length(n, k, s, d, p, p) >= 1:
            got = F.conv1d(x, torch.zeros(1, 1, k), stride=s, padding=p, dilation=d).shape[-1]
            assert conv_output_length(n, k, s, d, p, p) == got
        for ceil in (False, True):
            try:
                got = F.max_pool1d(x, k, s, p, d, ceil_mode=ceil).shape[-1]
            except RuntimeError:
                continue
            assert pool_output_length(n, k, s, p, d, ceil) == got, (n, k, s, p, d, ceil)


def test_window_plan_arithmetic():
    """HALO.md's formulas, every rank, many shapes: windows tile the needed range exactly."""
    rng = random.Random(0)
    for _ in range(500):
        n = rng.randint(1, 5)
        n_in = rng.randint(1, 20)
        k, s, d = rng.randint(1, 7), rng.randint(1, 3), rng.randint(1, 3)
        p = rng.randint(0, 3)
        m = conv_output_length(n_in, k, s, d, p, p)
        if m < 1:
            continue
        keff = d * (k - 1) + 1
        got = [0] * n_in
        for r in range(n):
            pl = window_plan(n_in, m, n, r, s, keff, p)
            a, ln = chunk_range(m, n, r)
            assert (pl.a, pl.b) == (a, a + ln)
            if ln:
                assert pl.window_length == (ln - 1) * s + keff  # the local conv yields b - a outputs
                lo = max(pl.lo, 0)
                if pl.hi > 0 and pl.lo < n_in:  # HALO.md's formulas (window overlapping the data)
                    assert pl.pad_left == max(0, -pl.lo) and pl.pad_right == max(0, pl.hi - n_in)
                assert pl.recv_left == max(0, min(pl.hi, pl.c) - lo)
                assert pl.recv_right == max(0, min(pl.hi, n_in) - max(lo, pl.e))
                if pl.c < pl.e and lo <= pl.e and pl.hi >= pl.c:  # HALO.md's formulas
                    assert pl.recv_left == max(0, pl.c - lo) and pl.recv_right == max(0, min(pl.hi, n_in) - pl.e)
                    assert pl.drop_left == max(0, pl.lo - pl.c) and pl.drop_right == max(0, pl.e - pl.hi)
                    assert pl.drop_left + pl.keep_length + pl.drop_right == pl.owned_length
            else:
                assert pl.window_length == 0
            assert pl.send_lengths[r] == 0
            # count how many ranks read each input element via the plans of its owner
            for q in range(n):
                if pl.send_lengths[q]:
                    for j in range(pl.send_lengths[q]):
                        got[pl.c + pl.send_offsets[q] + j] += 1
        for q in range(n):  # what q receives equals what others send to q
            pq = window_plan(n_in, m, n, q, s, keff, p)
            sent = [window_plan(n_in, m, n, r, s, keff, p).send_lengths[q] for r in range(n)]
            assert [pq.recv_lengths[r] if r != q else 0 for r in range(n)] == sent


# ---------------------------------------------------------------------------------------------
# padding='same' with an even kernel: constant_pad_nd on a sharded dim
# ---------------------------------------------------------------------------------------------


def _pad_cases(world):
    m = mesh((world,))
    failures = []
    x = global_tensor((2, 3, 7, 5), 1)
    for pad, value in (([0, 1, 0, 1], 0.0), ([2, 0, 3, 1], 1.5), ([0, 0, -2, 1], 0.0), ([1, 1], 0.0),
                       ([0, 0, 6, -3], -1.0)):
        for place in (["S2"], ["S3"], ["S0"], ["Psum"]):
            try:
                from _cases import make_dtensor

                xd = make_dtensor(x, m, Ps(place)).detach().requires_grad_()
                xr = x.clone().requires_grad_()
                ref = F.pad(xr, pad, value=value)
                out = F.pad(xd, pad, value=value)
                torch.testing.assert_close(out.full_tensor(), ref)
                if place[0] in ("S2", "S3"):
                    assert out.placements == tuple(Ps(place)), out.placements
                g = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1))
                (ref * g).sum().backward()
                (out * dtshard.distribute_tensor(g, m, [Replicate()], src_data_rank=None)).sum().backward()
                torch.testing.assert_close(xd.grad.full_tensor(), xr.grad)
            except Exception as e:
                failures.append(f"pad {pad} {value} {place}: {type(e).__name__}: {str(e)[:400]}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_constant_pad_on_sharded_dims(world):
    _assert_no_failures(run_distributed(_pad_cases, world, world))


# ---------------------------------------------------------------------------------------------
# pooling
# ---------------------------------------------------------------------------------------------


def _pool_config(rng: random.Random, mesh_shape, layout: str) -> dict:
    """A random pooling config that plain PyTorch accepts."""
    while True:
        cfg = _pool_config_raw(rng, mesh_shape, layout)
        try:
            _pool_fn(cfg)[0](torch.zeros((1, 1, *cfg["n"])), **_pool_fn(cfg)[1])
            return cfg
        except RuntimeError:  # e.g. avg_pool3d: input smaller than the kernel
            continue


def _pool_fn(cfg: dict):
    nsp = cfg["nsp"]
    if cfg["kind"] == "max":
        fn = {1: F.max_pool1d, 2: F.max_pool2d, 3: F.max_pool3d}[nsp]
        kw = dict(kernel_size=cfg["k"], stride=cfg["stride"], padding=cfg["padding"], dilation=cfg["dilation"],
                  ceil_mode=cfg["ceil_mode"], return_indices=True)
    else:
        fn = {1: F.avg_pool1d, 2: F.avg_pool2d, 3: F.avg_pool3d}[nsp]
        kw = dict(kernel_size=cfg["k"], stride=cfg["stride"], padding=cfg["padding"], ceil_mode=cfg["ceil_mode"],
                  count_include_pad=cfg["count_include_pad"])
        if nsp > 1:
            kw["divisor_override"] = cfg["divisor_override"]
    return fn, kw


def _pool_config_raw(rng: random.Random, mesh_shape, layout: str) -> dict:
    kind = rng.choice(["max", "avg"])
    nsp = rng.choice([1, 2, 2, 3])
    sharded = sorted(rng.sample(range(nsp), 2 if layout == "hw" and nsp >= 2 else 1))
    ks, ss, ps, ds, ns = [], [], [], [], []
    for j in range(nsp):
        k = rng.randint(1, 5)
        d = rng.choice([1, 1, 2]) if kind == "max" else 1
        s = rng.choice([1, 1, 2, 3])  # mostly overlapping windows: halos
        p = rng.randint(0, k // 2)
        eff = d * (k - 1) + 1
        lo = max(1, eff - 2 * p)
        hi = 12 if (j in sharded and nsp <= 2) else 6
        ks.append(k), ss.append(s), ps.append(p), ds.append(d), ns.append(rng.randint(lo, max(lo, hi)))
    h = f"S{2 + sharded[0]}"
    place = {"sp": [h], "batch_sp": ["S0", h], "ch_sp": ["S1", h], "hw": [h, f"S{2 + sharded[-1]}"]}[layout]
    return dict(kind=kind, nsp=nsp, batch=rng.choice([1, 2]), c=rng.choice([1, 3]), k=ks, stride=ss, padding=ps,
                dilation=ds, n=ns, ceil_mode=rng.random() < 0.4, count_include_pad=rng.random() < 0.5,
                divisor_override=rng.choice([None, None, None, 2]), x_place=place, seed=rng.randint(0, 10**6),
                neg_inf=rng.random() < 0.1)


def _check_pool(cfg: dict, mesh_shape) -> None:
    m = mesh(mesh_shape)
    x = torch.randn((cfg["batch"], cfg["c"], *cfg["n"]), generator=torch.Generator().manual_seed(cfg["seed"]))
    if cfg["neg_inf"]:  # whole windows of -inf at the left edge: PyTorch's index is the first real one
        x.narrow(2, 0, min(2, x.shape[2])).fill_(float("-inf"))
    fn, kw = _pool_fn(cfg)
    xr = x.clone().requires_grad_()
    ref = fn(xr, **kw)
    xd = dtshard.distribute_tensor(x, m, Ps(cfg["x_place"]), src_data_rank=None).requires_grad_()
    out = fn(xd, **kw)
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = out if isinstance(out, tuple) else (out,)
    # a spatial dim sharded by two mesh dims keeps the outer one (the inner is replicated)
    want = [p if p not in Ps(cfg["x_place"])[:i] else Replicate() for i, p in enumerate(Ps(cfg["x_place"]))]
    for o, r in zip(outs, refs):
        assert tuple(o.shape) == tuple(r.shape)
        assert list(o.placements) == want, f"placements {o.placements}"
        torch.testing.assert_close(o.to_local(), _expected_local(r.detach(), m, o.placements), equal_nan=True)
    full = outs[0].full_tensor()
    torch.testing.assert_close(full, refs[0].detach(), equal_nan=True)
    if len(outs) > 1:
        torch.testing.assert_close(outs[1].full_tensor(), refs[1])  # GLOBAL indices, as PyTorch's
    if cfg["neg_inf"]:
        return  # -inf outputs have nan-free but degenerate gradients; values and indices checked
    gw = torch.randn(refs[0].shape, generator=torch.Generator().manual_seed(cfg["seed"] + 1))
    (refs[0] * gw).sum().backward()
    (full * gw).sum().backward()
    torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, msg=lambda s: f"grad_input: {s}")


def _run_pool_configs(configs, mesh_shape) -> list[str]:
    failures = []
    for k, cfg in enumerate(configs):
        try:
            _check_pool(cfg, mesh_shape)
        except Exception as e:
            failures.append(f"pool config {k} {cfg}: {type(e).__name__}: {str(e)[:600]}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_pool_sweep_1d_mesh(world):
    rng = random.Random(77 + world)
    configs = [_pool_config(rng, (world,), "sp") for _ in range(30)]
    _assert_no_failures(run_distributed(_run_pool_configs, world, configs, (world,), timeout=600))


def _pool_non_spatial(mesh_shape):
    """Batch / channel shards are followed, Partial is kept by avg (linear) and replicated by max."""
    from _cases import make_dtensor

    m = mesh(mesh_shape)
    x = global_tensor((3, 3, 6, 5), 1) / 4 + torch.arange(270.0).view(3, 3, 6, 5) / 1000  # no ties
    out = {}
    for xp in ("S0", "S1", "Psum", "R", "S3"):
        for name, fn in (("max", lambda t: F.max_pool2d(t, 3, 2, 1)), ("avg", lambda t: F.avg_pool2d(t, 3, 1, 1))):
            xd = make_dtensor(x, m, Ps([xp])).detach().requires_grad_()
            xr = x.clone().requires_grad_()
            o, r = fn(xd), fn(xr)
            full = o.full_tensor()
            torch.testing.assert_close(full, r)
            (full * r.detach()).sum().backward()
            (r * r.detach()).sum().backward()
            torch.testing.assert_close(xd.grad.full_tensor(), xr.grad)
            out[f"{name} {xp}"] = str(o.placements)
    x1 = x[:, :1].contiguous()  # one channel on two ranks: an empty channel chunk
    for fn in (lambda t: F.max_pool2d(t, 3, 2, 1), lambda t: F.avg_pool2d(t, 3, 1, 1)):
        xd = make_dtensor(x1, m, Ps(["S1"])).detach().requires_grad_()
        xr = x1.clone().requires_grad_()
        o, r = fn(xd), fn(xr)
        full = o.full_tensor()
        torch.testing.assert_close(full, r)
        (full * r.detach()).sum().backward()
        (r * r.detach()).sum().backward()
        torch.testing.assert_close(xd.grad.full_tensor(), xr.grad)
    return out


def test_pool_non_spatial_layouts():
    got = run_distributed(_pool_non_spatial, 2, (2,))[0]
    assert got == {
        "max S0": "(Shard(dim=0),)", "avg S0": "(Shard(dim=0),)", "max S1": "(Shard(dim=1),)",
        "avg S1": "(Shard(dim=1),)", "max Psum": "(Replicate(),)", "avg Psum": "(Partial(sum),)",
        "max R": "(Replicate(),)", "avg R": "(Replicate(),)", "max S3": "(Shard(dim=3),)",
        "avg S3": "(Shard(dim=3),)",
    }, got


def _max_pool_first_dim_cases(world):
    """Max pooling sharded on its FIRST spatial dim (the index conversion is one add there, plus
    a fix on the output rows that can read left padding): every kernel / stride / padding /
    dilation / ceil_mode combination below, with and without whole -inf rows at the top (the
    index then points at the first real row, as PyTorch's does), indices and values exact against
    PyTorch, and the input gradient where it is defined."""
    import itertools

    m = mesh((world,))
    failures = []
    n = 0
    for nsp, k, s, p, d, h, ninf, ceil in itertools.product(
            (2, 3), (2, 3, 5), (1, 2, 3), (0, 1, 2), (1, 2), (13 if world == 2 else 7,), (0, 2), (False, True)):
        # (uneven shards either way: 7 + 6 rows, or 3 + 3 + 1; -inf rows matter where there is
        # padding to step over; 3-D: one kernel)
        if p > k // 2 or d * (k - 1) + 1 > h + 2 * p or (ninf and not p) or (nsp == 3 and (k, p) != (3, 1)):
            continue
        shape = (2, 3, h, 5) if nsp == 2 else (1, 2, h, 4, 3)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(n))  # no ties
        if ninf:
            x.narrow(2, 0, ninf).fill_(float("-inf"))
        fn = F.max_pool2d if nsp == 2 else F.max_pool3d
        try:
            ref, ref_idx = fn(x, k, s, p, d, ceil_mode=ceil, return_indices=True)
        except RuntimeError:
            continue
        n += 1
        try:
            xd = dtshard.distribute_tensor(x, m, [Shard(2)]).requires_grad_()
            out, idx = fn(xd, k, s, p, d, ceil_mode=ceil, return_indices=True)
            assert torch.equal(idx.full_tensor(), ref_idx), "indices"
            torch.testing.assert_close(out.full_tensor(), ref, equal_nan=True)
            if not ninf:
                xr = x.clone().requires_grad_()
                g = global_tensor(tuple(ref.shape), n + 1)
                (fn(xr, k, s, p, d, ceil_mode=ceil) * g).sum().backward()
                (out.full_tensor() * g).sum().backward()
                torch.testing.assert_close(xd.grad.full_tensor(), xr.grad)
        except Exception as e:  # noqa: BLE001 - collected, reported by the test
            failures.append(f"nsp={nsp} k={k} s={s} p={p} d={d} h={h} -inf rows={ninf} ceil={ceil}: "
                            f"{type(e).__name__}: {str(e)[:300]}")
    assert n > 50, n
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_max_pool_indices_when_sharded_on_the_first_spatial_dim(world):
    _assert_no_failures(run_distributed(_max_pool_first_dim_cases, world, world, timeout=600))


def test_pool_sweep_2x2_mesh():
    rng = random.Random(99)
    configs = [_pool_config(rng, (2, 2), ["hw", "batch_sp", "ch_sp"][i % 3]) for i in range(24)]
    _assert_no_failures(run_distributed(_run_pool_configs, 4, configs, (2, 2), timeout=600))


# ---------------------------------------------------------------------------------------------
# the custom ops: fake (meta) implementation, autograd, torch.compile
# ---------------------------------------------------------------------------------------------


def test_halo_exchange_fake_impl_gives_the_window_shape():
    """Under FakeTensorMode the ops run their fake implementations: shapes only, no collective."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    plan = window_plan(8, 8, 4, 1, 1, 7, 3)  # multi-hop: receives from 3 ranks
    args = (2, 0, 0, plan.me, list(plan.send_offsets), list(plan.send_lengths), list(plan.recv_lengths),
            plan.keep_offset, plan.pad_left, plan.pad_right, 1)
    with FakeTensorMode():
        x = torch.empty(3, 2, plan.owned_length, 5)
        win = torch.ops.dtshard.halo_exchange(x, *args, 0.0)
        back = torch.ops.dtshard.halo_accumulate(win, *args, plan.owned_length)
    assert tuple(win.shape) == (3, 2, plan.window_length, 5) == (3, 2, 8, 5)
    assert tuple(back.shape) == tuple(x.shape)


def _custom_op_autograd():
    from dtshard.spatial import halo

    m = mesh((3,))
    r = torch.distributed.get_rank()
    n_in, k_eff, s, p = 7, 5, 1, 2
    plan = halo.window_plan(n_in, conv_output_length(n_in, k_eff, s, 1, p, p), 3, r, s, k_eff, p)
    x = (torch.arange(2.0 * plan.owned_length).view(2, plan.owned_length) + 100 * r).requires_grad_()
    win = halo.exchange(x, plan, 1, m, 0, fill=-1.0)
    g = torch.randn(win.shape, generator=torch.Generator().manual_seed(r))
    (win * g).sum().backward()
    direct = halo.accumulate(g, plan, 1, m, 0)
    torch.testing.assert_close(x.grad, direct)
    return win.tolist()


def test_halo_ops_autograd_and_values():
    """exchange's autograd is accumulate; the windows are the right slices of the global row."""
    wins = run_distributed(_custom_op_autograd, 3)
    full = torch.cat([torch.arange(2.0 * ln).view(2, ln) + 100 * r for r, ln in enumerate([3, 3, 1])], 1)
    padded = torch.cat([torch.full((2, 2), -1.0), full, torch.full((2, 2), -1.0)], 1)
    for r, w in enumerate(wins):
        a, ln = chunk_range(7, 3, r)
        torch.testing.assert_close(torch.tensor(w), padded[:, a : a + ln + 4])


def _compiled_conv():
    m = mesh((2,))
    xg = global_tensor((2, 2, 9, 5), 1) / 4
    wg = global_tensor((3, 2, 3, 3), 2) / 4
    xd = dtshard.distribute_tensor(xg, m, [Shard(2)]).requires_grad_()
    wd = dtshard.distribute_tensor(wg, m, [Replicate()]).requires_grad_()

    def f(a, b):
        return F.conv2d(a, b, padding=(2, 1), stride=(2, 1), dilation=(2, 1)) * 2

    out = torch.compile(f, fullgraph=True, backend="aot_eager")(xd, wd)
    xr, wr = xg.clone().requires_grad_(), wg.clone().requires_grad_()
    ref = f(xr, wr)
    torch.testing.assert_close(out.full_tensor(), ref)
    out.full_tensor().sum().backward()
    ref.sum().backward()
    torch.testing.assert_close(xd.grad.full_tensor(), xr.grad)
    torch.testing.assert_close(wd.grad.full_tensor(), wr.grad)
    return str(out.placements)


def test_spatial_conv_under_torch_compile_fullgraph():
    assert run_distributed(_compiled_conv, 2, timeout=300) == ["(Shard(dim=2),)"] * 2
