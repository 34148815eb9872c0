"""Spatially sharded interpolation, reflection / replication padding and transposed convolution
against single-process PyTorch.

Seeded randomized sweeps (2 and 3 ranks on one sharded spatial dim; a 2x2 mesh with H x W and
batch x H), each config checked on every rank: the local output equals the chunk of the reference
that the output placements claim (values, shape and placements at once), the spatial shard is kept
(chunk layout of the OUTPUT length), and the input gradient (and for transposed convolution the
weight and bias gradients) equal PyTorch's.  Failures come back as strings, so one call covers many
configs.  Plus traffic checks with CommCounter (no collective when the chunks line up, one
all_to_all with the halo otherwise).
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import dtshard
from dtshard import Replicate, Shard
from dtshard.debug import CommCounter
from dtshard.spatial.halo import range_plan
from dtshard.spec import chunk_range, local_shape_and_offset
from dtshard.testing import run_distributed

from _cases import Ps, global_tensor, make_dtensor, mesh


def _expected_local(full: torch.Tensor, m, placements) -> torch.Tensor:
    shape, offset = local_shape_and_offset(full.shape, tuple(m.shape), placements, m.get_coordinate())
    x = full
    for d, (o, s) in enumerate(zip(offset, shape)):
        x = x.narrow(d, o, s)
    return x


def _assert_no_failures(results) -> None:
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: {len(failures)} failures\n" + "\n".join(failures[:10])


def _want_placements(x_place) -> list:
    """A spatial dim sharded by two mesh dims keeps the outer one (the inner is replicated)."""
    ps = Ps(x_place)
    return [p if p not in ps[:i] else Replicate() for i, p in enumerate(ps)]


def _check_generic(fn, x: torch.Tensor, x_place, m, seed: int, dtype=torch.float32, exact: bool = False) -> None:
    """fn on a DTensor vs fn on the plain tensor: local chunks, placements, full value, grad.
    ``exact``: the forward must be bitwise equal (gathers: nearest, reflection, replication)."""
    x = x.to(dtype)
    xr = x.clone().requires_grad_()
    ref = fn(xr)
    xd = dtshard.distribute_tensor(x, m, Ps(x_place), src_data_rank=None).requires_grad_()
    out = fn(xd)
    assert isinstance(out, dtshard.DTensor)
    assert tuple(out.shape) == tuple(ref.shape), f"global shape {tuple(out.shape)} vs {tuple(ref.shape)}"
    want = _want_placements(x_place)
    assert list(out.placements) == want, f"placements {out.placements}, want {want}"
    torch.testing.assert_close(out.to_local(), _expected_local(ref.detach(), m, out.placements))
    if exact:
        assert torch.equal(out.to_local(), _expected_local(ref.detach(), m, out.placements)), "not bitwise equal"
    full = out.full_tensor()
    torch.testing.assert_close(full, ref.detach())
    gw = torch.randn(ref.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=dtype)
    (ref * gw).sum().backward()
    out.backward(dtshard.distribute_tensor(gw, m, out.placements, src_data_rank=None))
    # a leaf's .grad is laid out like the leaf (README "Gradients"), whatever the output's layout
    assert list(xd.grad.placements) == list(xd.placements), f"grad placements {xd.grad.placements}"
    torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, msg=lambda s: f"grad_input: {s}")


# ---------------------------------------------------------------------------------------------
# interpolation
# ---------------------------------------------------------------------------------------------

_MODES = {1: ["nearest", "nearest-exact", "linear"], 2: ["nearest", "nearest-exact", "bilinear"],
          3: ["nearest", "nearest-exact", "trilinear"]}


def _interp_config(rng: random.Random, layout: str) -> dict:
    while True:
        nsp = rng.choice([2, 2, 3]) if layout == "hw" else rng.choice([1, 2, 2, 2, 3])
        mode = rng.choice(_MODES[nsp] + [_MODES[nsp][0]])  # nearest twice as often
        sharded = sorted(rng.sample(range(nsp), 2 if layout == "hw" else 1))
        ns = [rng.randint(1, 11) if j in sharded and nsp <= 2 else rng.randint(1, 5) for j in range(nsp)]
        how = rng.choice(["int", "int", "float", "down", "size"])
        kw = {"mode": mode}
        if mode in ("linear", "bilinear", "trilinear"):
            kw["align_corners"] = rng.random() < 0.5
        if how == "size":
            kw["size"] = [rng.randint(1, 2 * n + 3) for n in ns]
        else:
            sf = {"int": rng.choice([2, 2, 3, 4]), "float": rng.choice([1.5, 1.7, 2.5, 0.75]),
                  "down": rng.choice([0.5, 0.34, 0.25])}[how]
            kw["scale_factor"] = sf
            if rng.random() < 0.25:
                kw["recompute_scale_factor"] = True
        cfg = dict(nsp=nsp, n=ns, kw=kw, batch=rng.choice([1, 2]), c=rng.choice([1, 3]), seed=rng.randint(0, 10**6),
                   x_place=_layout_places(layout, sharded), dtype=rng.choice(["float32", "float32", "float64"]))
        try:
            F.interpolate(torch.zeros(1, 1, *ns), **kw)
            return cfg
        except (RuntimeError, ValueError):
            continue


def _layout_places(layout: str, sharded) -> list[str]:
    h = f"S{2 + sharded[0]}"
    return {"sp": [h], "batch_sp": ["S0", h], "hw": [h, f"S{2 + sharded[-1]}"], "hh": [h, h]}[layout]


def _run_interp(configs, mesh_shape) -> list[str]:
    m = mesh(mesh_shape)
    failures = []
    for k, cfg in enumerate(configs):
        try:
            x = torch.randn((cfg["batch"], cfg["c"], *cfg["n"]), generator=torch.Generator().manual_seed(cfg["seed"]))
            _check_generic(lambda t: F.interpolate(t, **cfg["kw"]), x, cfg["x_place"], m, cfg["seed"],
                           getattr(torch, cfg["dtype"]), exact=cfg["kw"]["mode"].startswith("nearest"))
        except Exception as e:
            failures.append(f"interp config {k} {cfg}: {type(e).__name__}: {str(e)[:600]}")
    return failures


def _fixed_interp(world) -> list[dict]:
    base = dict(nsp=2, batch=2, c=2, seed=5, x_place=["S2"], dtype="float32")
    cases = [
        dict(n=[4 * world, 5], kw=dict(scale_factor=2, mode="nearest")),  # aligned: local op only
        dict(n=[4 * world + 1, 5], kw=dict(scale_factor=2, mode="nearest")),  # uneven: halo
        dict(n=[12, 5], kw=dict(scale_factor=3, mode="nearest")),
        dict(n=[7, 5], kw=dict(size=(20, 3), mode="nearest")),
        dict(n=[13, 6], kw=dict(scale_factor=0.5, mode="nearest")),  # downsampling: multi-hop
        dict(n=[8, 6], kw=dict(scale_factor=2, mode="bilinear", align_corners=False)),
        dict(n=[8, 6], kw=dict(scale_factor=2, mode="bilinear", align_corners=True)),
        dict(n=[9, 4], kw=dict(size=(23, 4), mode="bilinear", align_corners=True)),
        dict(n=[2, 3], kw=dict(scale_factor=2, mode="bilinear")),  # tiny: empty input shards
        dict(n=[1, 3], kw=dict(scale_factor=3, mode="nearest")),
        dict(n=[6, 5], kw=dict(scale_factor=1.5, mode="nearest-exact")),
    ]
    return [{**base, **c} for c in cases]


@pytest.mark.parametrize("world", [2, 3])
def test_interpolate_sweep_1d_mesh(world):
    rng = random.Random(300 + world)
    configs = _fixed_interp(world) + [_interp_config(rng, "sp") for _ in range(40)]
    _assert_no_failures(run_distributed(_run_interp, world, configs, (world,), timeout=600))


def test_interpolate_sweep_2x2_mesh():
    rng = random.Random(404)
    configs = [_interp_config(rng, ["hw", "batch_sp", "hh"][i % 3]) for i in range(30)]
    _assert_no_failures(run_distributed(_run_interp, 4, configs, (2, 2), timeout=600))


def _interp_traffic():
    """Nearest x2 with chunk boundaries that line up: no collective, the op on the local shard;
    uneven: one all_to_all moving exactly the 1-row halo; bilinear: a 1-row halo per side."""
    m = mesh((2,))
    out = {}
    for name, h, kw in (("aligned", 8, dict(scale_factor=2, mode="nearest")),
                        ("uneven", 7, dict(scale_factor=2, mode="nearest")),
                        ("bilinear", 8, dict(scale_factor=2, mode="bilinear")),
                        ("bilinear_ac", 8, dict(scale_factor=2, mode="bilinear", align_corners=True))):
        x = dtshard.distribute_tensor(global_tensor((1, 2, h, 4), 1), m, [Shard(2)]).requires_grad_()
        with CommCounter() as fwd:
            y = F.interpolate(x, **kw)
        g = dtshard.DTensor.from_local(torch.ones(y.to_local().shape), m, y.placements, shape=y.shape)
        with CommCounter() as bwd:
            y.backward(g)
        out[name] = ([r.kind for r in fwd.records], fwd.bytes(), [r.kind for r in bwd.records], bwd.bytes(),
                     str(y.placements))
    return out


def test_interpolate_traffic():
    res = run_distributed(_interp_traffic, 2)
    row = 2 * 4 * 4  # channels x width x float32
    for r in res:
        assert r["aligned"] == ([], 0, [], 0, "(Shard(dim=2),)"), r["aligned"]
        # H=7 on 2 ranks: chunks 4, 3; outputs 14 -> 7, 7: rank 1's output rows 7..13 read 3..6,
        # one row from rank 0 (and the gradient of that row goes back)
        assert r["uneven"][0] == ["all_to_all"] and r["uneven"][2] == ["all_to_all"], r["uneven"]
    assert sum(r["uneven"][1] for r in res) == row and sum(r["uneven"][3] for r in res) == row
    # bilinear x2, align_corners=False: each side reads one row of its neighbour
    assert sum(r["bilinear"][1] for r in res) == 2 * row
    assert all(r["bilinear"][4] == "(Shard(dim=2),)" for r in res)


def _interp_non_spatial():
    m = mesh((2,))
    x = global_tensor((3, 3, 5, 4), 1)
    out = {}
    for xp in ("S0", "S1", "Psum", "Pmax", "R"):
        for mode in ("nearest", "bilinear"):
            xd = make_dtensor(x, m, Ps([xp])).detach().requires_grad_()
            xr = x.clone().requires_grad_()
            o, r = F.interpolate(xd, scale_factor=2, mode=mode), F.interpolate(xr, scale_factor=2, mode=mode)
            full = o.full_tensor()
            torch.testing.assert_close(full, r)
            if xp != "Pmax":
                (full * r.detach()).sum().backward()
                (r * r.detach()).sum().backward()
                torch.testing.assert_close(xd.grad.full_tensor(), xr.grad)
            out[f"{mode} {xp}"] = str(o.placements)
    return out


def test_interpolate_non_spatial_layouts():
    got = run_distributed(_interp_non_spatial, 2)[0]
    assert got == {
        "nearest S0": "(Shard(dim=0),)", "bilinear S0": "(Shard(dim=0),)",
        "nearest S1": "(Shard(dim=1),)", "bilinear S1": "(Shard(dim=1),)",
        "nearest Psum": "(Partial(sum),)", "bilinear Psum": "(Partial(sum),)",
        "nearest Pmax": "(Partial(max),)", "bilinear Pmax": "(Replicate(),)",
        "nearest R": "(Replicate(),)", "bilinear R": "(Replicate(),)",
    }, got


# ---------------------------------------------------------------------------------------------
# reflection / replication padding
# ---------------------------------------------------------------------------------------------


def _pad_config(rng: random.Random, layout: str) -> dict:
    while True:
        nsp = rng.choice([2, 2, 3]) if layout == "hw" else rng.choice([1, 2, 2, 3])
        mode = rng.choice(["reflect", "replicate"])
        sharded = sorted(rng.sample(range(nsp), 2 if layout == "hw" else 1))
        ns = [rng.randint(1, 10) if j in sharded else rng.randint(1, 5) for j in range(nsp)]
        pad = []
        for j in reversed(range(nsp)):  # F.pad lists the last dim first
            hi = max(0, ns[j] - 1) if mode == "reflect" else 4
            pad += [rng.randint(0, hi), rng.randint(0, hi)]
        cfg = dict(nsp=nsp, n=ns, mode=mode, pad=pad, batch=rng.choice([1, 2]), c=rng.choice([1, 2]),
                   seed=rng.randint(0, 10**6), x_place=_layout_places(layout, sharded), dtype="float32")
        try:
            F.pad(torch.zeros(1, 1, *ns), pad, mode=mode)
            return cfg
        except (RuntimeError, ValueError, NotImplementedError):
            continue


def _run_pad(configs, mesh_shape) -> list[str]:
    m = mesh(mesh_shape)
    failures = []
    for k, cfg in enumerate(configs):
        try:
            x = torch.randn((cfg["batch"], cfg["c"], *cfg["n"]), generator=torch.Generator().manual_seed(cfg["seed"]))
            _check_generic(lambda t: F.pad(t, cfg["pad"], mode=cfg["mode"]), x, cfg["x_place"], m, cfg["seed"],
                           exact=True)
        except Exception as e:
            failures.append(f"pad config {k} {cfg}: {type(e).__name__}: {str(e)[:600]}")
    return failures


def _fixed_pad(world) -> list[dict]:
    base = dict(nsp=2, batch=1, c=2, seed=9, x_place=["S2"], dtype="float32")
    cases = [
        dict(n=[12, 5], mode="reflect", pad=[1, 1, 1, 1]),
        dict(n=[12, 5], mode="replicate", pad=[2, 1, 3, 2]),
        dict(n=[world + 1, 4], mode="reflect", pad=[0, 0, world, world]),  # pad+1 spans several shards
        dict(n=[2, 4], mode="reflect", pad=[1, 0, 1, 1]),  # empty shards
        dict(n=[1, 4], mode="replicate", pad=[0, 0, 4, 3]),
        dict(n=[9, 7], mode="reflect", pad=[3, 2, 8, 0]),
    ]
    return [{**base, **c} for c in cases]


@pytest.mark.parametrize("world", [2, 3])
def test_reflect_replicate_pad_sweep_1d_mesh(world):
    rng = random.Random(500 + world)
    configs = _fixed_pad(world) + [_pad_config(rng, "sp") for _ in range(30)]
    _assert_no_failures(run_distributed(_run_pad, world, configs, (world,), timeout=600))


def test_reflect_replicate_pad_sweep_2x2_mesh():
    rng = random.Random(606)
    configs = [_pad_config(rng, ["hw", "batch_sp", "hh"][i % 3]) for i in range(24)]
    _assert_no_failures(run_distributed(_run_pad, 4, configs, (2, 2), timeout=600))


def _pad_traffic():
    """Reflect pad 1 on H=16 over 4 ranks (input chunks of 4, output chunks 5, 5, 5, 3)."""
    m = mesh((4,))
    x = dtshard.distribute_tensor(global_tensor((1, 2, 16, 4), 1), m, [Shard(2)]).requires_grad_()
    with CommCounter() as fwd:
        y = F.pad(x, [0, 0, 1, 1], mode="reflect")
    return [r.kind for r in fwd.records], fwd.bytes(), str(y.placements)


def test_reflect_pad_traffic():
    res = run_distributed(_pad_traffic, 4)
    row = 2 * 4 * 4
    # output rows [0,5) [5,10) [10,15) [15,18) read input rows (reflected at the edges)
    # [0,4) [4,9) [9,14) [14,16): the edge ranks reflect their own rows; rank 1 gets row 8 from
    # rank 2, rank 2 gets rows 12-13 from rank 3; nothing else moves (bytes are the sender's)
    wins = ((0, 4), (4, 9), (9, 14), (14, 16))
    plans = [range_plan(16, 18, 4, q, wins) for q in range(4)]
    assert [p.halo_elements() for p in plans] == [0, 1, 2, 0]
    assert [r[1] for r in res] == [0, 0, row, 2 * row]
    for kinds, _, placements in res:
        assert kinds == ["all_to_all"] and placements == "(Shard(dim=2),)"


def test_range_plan_matches_windows():
    rng = random.Random(3)
    for _ in range(300):
        n, n_in, m = rng.randint(1, 5), rng.randint(0, 15), rng.randint(0, 15)
        wins = []
        for r in range(n):
            lo = rng.randint(0, n_in)
            wins.append((lo, rng.randint(lo, n_in)))
        wins = tuple(wins)
        plans = [range_plan(n_in, m, n, r, wins) for r in range(n)]
        for r, p in enumerate(plans):
            assert p.window_length == wins[r][1] - wins[r][0]
            assert p.pad_left == p.pad_right == 0
            assert (p.a, p.b - p.a) == chunk_range(m, n, r)
            for q in range(n):
                if q != r:
                    assert p.recv_lengths[q] == plans[q].send_lengths[r]


# ---------------------------------------------------------------------------------------------
# transposed convolution
# ---------------------------------------------------------------------------------------------

_TCONV = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


def _tconv_config(rng: random.Random, layout: str) -> dict:
    while True:
        nsp = rng.choice([2, 3]) if layout == "hw" else rng.choice([1, 2, 2, 3])
        sharded = sorted(rng.sample(range(nsp), 2 if layout == "hw" else 1))
        c_in = rng.choice([1, 2, 4])
        groups = rng.choice([1, 1, 2]) if c_in % 2 == 0 else 1
        c_out = groups * rng.choice([1, 2])
        ks, ss, ds, ps, ops, ns = [], [], [], [], [], []
        for j in range(nsp):
            big = j in sharded
            k = rng.randint(1, 5) if big else rng.randint(1, 3)
            s = rng.choice([1, 2, 2, 3])
            d = rng.choice([1, 1, 2]) if k > 1 else 1
            p = rng.randint(0, d * (k - 1))
            op = rng.randint(0, max(s, d) - 1)
            n = rng.randint(1, 9) if big and nsp <= 2 else rng.randint(1, 4)
            ks.append(k), ss.append(s), ds.append(d), ps.append(p), ops.append(op), ns.append(n)
        cfg = dict(nsp=nsp, batch=rng.choice([1, 2]), c_in=c_in, c_out=c_out, groups=groups, k=ks, stride=ss,
                   dilation=ds, padding=ps, output_padding=ops, n=ns, bias=rng.random() < 0.7,
                   x_place=_layout_places(layout, sharded), seed=rng.randint(0, 10**6))
        try:
            _TCONV[nsp](torch.zeros(1, c_in, *ns), torch.zeros(c_in, c_out // groups, *ks), **_tconv_kw(cfg))
            return cfg
        except RuntimeError:
            continue


def _tconv_kw(cfg) -> dict:
    return dict(stride=cfg["stride"], padding=cfg["padding"], output_padding=cfg["output_padding"],
                groups=cfg["groups"], dilation=cfg["dilation"])


def _check_tconv(cfg, m) -> None:
    nsp = cfg["nsp"]
    conv = _TCONV[nsp]
    x = global_tensor((cfg["batch"], cfg["c_in"], *cfg["n"]), cfg["seed"]) / 4
    w = global_tensor((cfg["c_in"], cfg["c_out"] // cfg["groups"], *cfg["k"]), cfg["seed"] + 1) / 4
    b = global_tensor((cfg["c_out"],), cfg["seed"] + 2) / 4 if cfg["bias"] else None
    kw = _tconv_kw(cfg)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    br = b.clone().requires_grad_() if b is not None else None
    ref = conv(xr, wr, br, **kw)
    rep = [Replicate()] * m.ndim
    xd = dtshard.distribute_tensor(x, m, Ps(cfg["x_place"]), src_data_rank=None).requires_grad_()
    wd = dtshard.distribute_tensor(w, m, rep, src_data_rank=None).requires_grad_()
    bd = dtshard.distribute_tensor(b, m, rep, src_data_rank=None).requires_grad_() if b is not None else None
    out = conv(xd, wd, bd, **kw)
    assert tuple(out.shape) == tuple(ref.shape)
    want = _want_placements(cfg["x_place"])
    assert list(out.placements) == want, f"placements {out.placements}"
    torch.testing.assert_close(out.to_local(), _expected_local(ref.detach(), m, out.placements))
    gw = torch.randn(ref.shape, generator=torch.Generator().manual_seed(cfg["seed"] + 3))
    (ref * gw).sum().backward()
    out.backward(dtshard.distribute_tensor(gw, m, out.placements, src_data_rank=None))
    assert list(xd.grad.placements) == want, f"grad_input placements {xd.grad.placements}"
    torch.testing.assert_close(xd.grad.full_tensor(), xr.grad, msg=lambda s: f"grad_input: {s}")
    torch.testing.assert_close(wd.grad.full_tensor(), wr.grad, msg=lambda s: f"grad_weight: {s}")
    if b is not None:
        torch.testing.assert_close(bd.grad.full_tensor(), br.grad, msg=lambda s: f"grad_bias: {s}")


def _run_tconv(configs, mesh_shape) -> list[str]:
    m = mesh(mesh_shape)
    failures = []
    for k, cfg in enumerate(configs):
        try:
            _check_tconv(cfg, m)
        except Exception as e:
            failures.append(f"tconv config {k} {cfg}: {type(e).__name__}: {str(e)[:600]}")
    return failures


def _fixed_tconv(world) -> list[dict]:
    base = dict(nsp=2, batch=2, c_in=2, c_out=3, groups=1, dilation=[1, 1], bias=True, x_place=["S2"], seed=11)
    cases = [
        dict(k=[2, 2], stride=[2, 2], padding=[0, 0], output_padding=[0, 0], n=[4 * world, 3]),  # UNet up x2
        dict(k=[3, 3], stride=[2, 2], padding=[1, 1], output_padding=[1, 0], n=[7, 3]),
        dict(k=[4, 1], stride=[2, 1], padding=[1, 0], output_padding=[0, 0], n=[5, 2]),
        dict(k=[3, 3], stride=[1, 1], padding=[1, 1], output_padding=[0, 0], n=[9, 4]),
        dict(k=[2, 2], stride=[3, 1], padding=[0, 0], output_padding=[2, 0], n=[4, 2]),  # outputs no input reaches
        dict(k=[5, 1], stride=[1, 1], padding=[0, 0], output_padding=[0, 0], n=[2, 2], dilation=[2, 1]),  # multi-hop
        dict(k=[3, 2], stride=[2, 2], padding=[1, 0], output_padding=[0, 1], n=[1, 2]),  # empty shards
    ]
    return [{**base, **c} for c in cases]


@pytest.mark.parametrize("world", [2, 3])
def test_conv_transpose_sweep_1d_mesh(world):
    rng = random.Random(700 + world)
    configs = _fixed_tconv(world) + [_tconv_config(rng, "sp") for _ in range(30)]
    _assert_no_failures(run_distributed(_run_tconv, world, configs, (world,), timeout=600))


def test_conv_transpose_sweep_2x2_mesh():
    rng = random.Random(808)
    configs = [_tconv_config(rng, ["hw", "batch_sp"][i % 2]) for i in range(20)]
    _assert_no_failures(run_distributed(_run_tconv, 4, configs, (2, 2), timeout=600))


def _tconv_traffic():
    """UNet's up-convolution (k2 s2) on H: every output chunk reads exactly its own input shard,
    so the forward moves nothing; a k3 s2 p1 one moves a 1-row halo to the left neighbour."""
    m = mesh((2,))
    out = {}
    for name, k, s, p, op in (("k2s2", 2, 2, 0, 0), ("k3s2p1", 3, 2, 1, 1)):
        x = dtshard.distribute_tensor(global_tensor((1, 2, 8, 4), 1), m, [Shard(2)]).requires_grad_()
        w = dtshard.distribute_tensor(global_tensor((2, 3, k, k), 2), m, [Replicate()]).requires_grad_()
        with CommCounter() as fwd:
            y = F.conv_transpose2d(x, w, stride=s, padding=p, output_padding=op)
        g = dtshard.DTensor.from_local(torch.ones(y.to_local().shape), m, y.placements, shape=y.shape)
        with CommCounter() as bwd:
            y.backward(g)
        conv_b = [r for r in bwd.records if r.op == "aten.convolution_backward.default"]
        out[name] = ([r.kind for r in fwd.records], fwd.bytes(), [r.kind for r in conv_b], str(y.placements))
    return out


def test_conv_transpose_traffic():
    res = run_distributed(_tconv_traffic, 2)
    for r in res:
        assert r["k2s2"] == ([], 0, [], "(Shard(dim=2),)"), r["k2s2"]
        assert r["k3s2p1"][0] == ["all_to_all"] and r["k3s2p1"][3] == "(Shard(dim=2),)", r["k3s2p1"]
    row = 2 * 4 * 4
    # output 16 rows in chunks of 8: rank 0's rows 0..7 read inputs 0..4 (row 4 from rank 1);
    # rank 1's rows 8..15 read inputs 4..7 (its own)
    assert [r["k3s2p1"][1] for r in res] == [0, row]
