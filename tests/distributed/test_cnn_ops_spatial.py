"""Adaptive average pooling and group norm on spatially sharded activations, against one process.

Each config is checked on every rank: the output's ``full_tensor()`` equals plain PyTorch; its
placements are the ones the handler documents (Partial(sum) for a sharded dim pooled to 1, the
spatial shard kept when the bins line up with the shards, the shard moved to the batch dim when
they do not; group norm keeps every batch / spatial / whole-group channel shard); every local
shape matches the placements (and, without Partial, the local values equal that chunk of the
reference); and the gradients of the input (and of group norm's weight and bias) equal PyTorch's.
Sizes make shards uneven (H = 7 on 2 and 3 ranks) and empty (H = 2 on 4 ranks); the 2x2 mesh
shards H on mesh dim 0 and W on mesh dim 1 (and H on both).  Failures come back as strings, so
one call covers many configs.  Plus traffic checks with CommCounter: group norm on an H-sharded
input moves only (N, G) statistics (one all_gather of each rank's (mean, M2) forward, one
all_reduce backward; never the activation), the aligned pool and the pool to 1 move nothing.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtshard
from dtshard import Replicate
from dtshard.debug import CommCounter
from dtshard.spatial.adaptive_pool import blocks_align
from dtshard.spec import local_shape_and_offset
from dtshard.testing import run_distributed

from _cases import Ps, global_tensor, mesh

_POOL = {1: F.adaptive_avg_pool1d, 2: F.adaptive_avg_pool2d, 3: F.adaptive_avg_pool3d}


def _chunk(full: torch.Tensor, m, placements) -> torch.Tensor:
    shape, offset = local_shape_and_offset(full.shape, tuple(m.shape), placements, m.get_coordinate())
    x = full
    for d, (o, s) in enumerate(zip(offset, shape)):
        x = x.narrow(d, o, s)
    return x


def _check_local(name: str, dt, ref: torch.Tensor, m) -> None:
    """Local shape matches the placements; without Partial the local values are that chunk."""
    want = dt._spec.local_shape(m.get_coordinate())
    got = tuple(dt.to_local().shape)
    assert got == want, f"{name}: local shape {got}, placements say {want}"
    if not any(p.is_partial() for p in dt.placements):
        torch.testing.assert_close(dt.to_local(), _chunk(ref, m, dt.placements), msg=lambda s: f"{name} local: {s}")
    torch.testing.assert_close(dt.full_tensor(), ref, msg=lambda s: f"{name} full: {s}")


def _grad_placements(placements) -> list:
    """The gradient of a Partial output is the whole gradient (Replicate on that mesh dim)."""
    return [Replicate() if p.is_partial() else p for p in placements]


def _run(check, configs, mesh_shape) -> list[str]:
    m = mesh(mesh_shape)
    failures = []
    for k, cfg in enumerate(configs):
        try:
            check(cfg, m)
        except Exception as e:
            failures.append(f"config {k} {cfg}: {type(e).__name__}: {str(e)[:800]}")
    return failures


def _assert_no_failures(results) -> None:
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}: {len(failures)} failures\n" + "\n".join(failures[:10])


# ---------------------------------------------------------------------------------------------
# adaptive average pooling
# ---------------------------------------------------------------------------------------------


def _check_pool(cfg, m) -> None:
    nsp, shape, size, x_place, want = cfg["nsp"], cfg["shape"], cfg["size"], cfg["x"], cfg["want"]
    x = global_tensor(shape, cfg.get("seed", 0))
    xr = x.clone().requires_grad_()
    ref = _POOL[nsp](xr, size)
    xd = dtshard.distribute_tensor(x, m, Ps(x_place), src_data_rank=None)
    if cfg.get("partial"):  # a Partial(sum) input: x/2 + x/2 on the mesh dim
        xd = dtshard.DTensor.from_local(xd.to_local() / 2, m, Ps(cfg["partial"]), shape=x.shape)
    xd = xd.detach().requires_grad_()
    out = _POOL[nsp](xd, size)
    assert isinstance(out, dtshard.DTensor) and tuple(out.shape) == tuple(ref.shape)
    assert list(out.placements) == Ps(want), f"placements {out.placements}, want {want}"
    _check_local("out", out, ref.detach(), m)
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(cfg.get("seed", 0) + 1))
    (ref * gy).sum().backward()
    # the gradient of a Partial output given Replicate, or (grad_partial) as Partial(sum) terms
    g_place = list(out.placements) if cfg.get("grad_partial") else _grad_placements(out.placements)
    out.backward(dtshard.distribute_tensor(gy, m, g_place, src_data_rank=None))
    _check_local("grad_input", xd.grad, xr.grad, m)


def _pool_cfgs_1d(world: int) -> list[dict]:
    if world == 2:
        return [
            # (a) a sharded dim pooled to 1: Partial(sum); uneven H = 7 -> 4, 3
            dict(nsp=2, shape=(2, 3, 7, 6), size=(1, 3), x=["S2"], want=["Psum"]),
            dict(nsp=2, shape=(2, 3, 7, 6), size=(1, 3), x=["S2"], want=["Psum"], grad_partial=True),
            dict(nsp=2, shape=(2, 3, 6, 7), size=(2, 1), x=["S3"], want=["Psum"]),  # W sharded
            dict(nsp=1, shape=(2, 3, 7), size=1, x=["S2"], want=["Psum"]),  # -> mean.dim
            dict(nsp=2, shape=(2, 3, 7, 5), size=1, x=["S2"], want=["Psum"]),  # -> mean.dim
            dict(nsp=3, shape=(1, 2, 5, 3, 4), size=(1, 3, 2), x=["S2"], want=["Psum"]),
            dict(nsp=3, shape=(1, 2, 4, 5, 4), size=(2, 1, 2), x=["S3"], want=["Psum"]),
            # (b) bins aligned with the shards: the spatial shard is kept
            dict(nsp=2, shape=(2, 3, 8, 6), size=(4, 3), x=["S2"], want=["S2"]),
            dict(nsp=2, shape=(2, 3, 5, 8), size=(5, 2), x=["S3"], want=["S3"]),
            dict(nsp=2, shape=(2, 3, 7, 6), size=(7, 2), x=["S2"], want=["S2"]),  # k = 1, uneven
            dict(nsp=1, shape=(2, 3, 12), size=6, x=["S2"], want=["S2"]),
            dict(nsp=1, shape=(2, 3, 7), size=7, x=["S2"], want=["S2"]),
            dict(nsp=3, shape=(1, 2, 8, 3, 4), size=(2, 3, 2), x=["S2"], want=["S2"]),
            dict(nsp=3, shape=(2, 1, 3, 4, 6), size=(3, 2, 2), x=["S4"], want=["S4"]),
            dict(nsp=2, shape=(2, 3, 6, 6), size=(2, 3), x=["S2"], want=["S2"]),  # chunks 3, bins of 3
            # not aligned: the shard moves to the larger of batch / channels (one all_to_all), or
            # is gathered when neither has an element per rank
            dict(nsp=2, shape=(4, 3, 6, 6), size=(3, 3), x=["S2"], want=["S0"]),  # chunks 3, bins of 2
            dict(nsp=2, shape=(3, 2, 7, 6), size=(3, 2), x=["S2"], want=["S0"]),  # 7 -> 3: not divisible
            dict(nsp=2, shape=(1, 3, 7, 6), size=(3, 2), x=["S2"], want=["S1"]),  # batch too small: channels
            dict(nsp=2, shape=(1, 1, 7, 6), size=(3, 2), x=["S2"], want=["R"]),  # nowhere to go: gathered
            # batch and channel shards, Partial input: plain local ops
            dict(nsp=2, shape=(3, 3, 7, 6), size=(3, 2), x=["S0"], want=["S0"]),
            dict(nsp=2, shape=(2, 5, 7, 6), size=(3, 4), x=["S1"], want=["S1"]),
            dict(nsp=3, shape=(2, 5, 3, 3, 3), size=(2, 2, 2), x=["S1"], want=["S1"]),
            dict(nsp=2, shape=(2, 3, 7, 6), size=(3, 4), x=["R"], partial=["Psum"], want=["Psum"]),
        ]
    if world == 3:
        return [
            dict(nsp=2, shape=(2, 3, 7, 6), size=(1, 3), x=["S2"], want=["Psum"]),  # 3, 3, 1
            dict(nsp=1, shape=(2, 2, 7), size=1, x=["S2"], want=["Psum"]),
            dict(nsp=3, shape=(1, 2, 7, 2, 3), size=(1, 2, 3), x=["S2"], want=["Psum"]),
            dict(nsp=2, shape=(2, 3, 12, 5), size=(6, 5), x=["S2"], want=["S2"]),  # chunks 4: bins of 2
            dict(nsp=2, shape=(2, 3, 12, 5), size=(3, 2), x=["S2"], want=["S2"]),  # bins of 4
            dict(nsp=2, shape=(2, 3, 7, 6), size=(7, 3), x=["S2"], want=["S2"]),  # 3, 3, 1 (k = 1)
            dict(nsp=1, shape=(2, 2, 7), size=7, x=["S2"], want=["S2"]),
            dict(nsp=2, shape=(2, 3, 6, 9), size=(3, 3), x=["S3"], want=["S3"]),  # W: bins of 3
            dict(nsp=2, shape=(3, 3, 12, 5), size=(4, 5), x=["S2"], want=["S0"]),  # chunks 4, bins 3: moved
            dict(nsp=2, shape=(3, 3, 8, 5), size=(4, 5), x=["S2"], want=["S0"]),  # chunks 3, bins 2: moved
        ]
    assert world == 4
    return [
        # H = 2 on 4 ranks: shards 1, 1, 0, 0 (empty shards contribute nothing)
        dict(nsp=2, shape=(2, 3, 2, 5), size=(1, 3), x=["S2"], want=["Psum"]),
        dict(nsp=2, shape=(2, 3, 2, 5), size=1, x=["S2"], want=["Psum"]),
        dict(nsp=1, shape=(2, 3, 2), size=1, x=["S2"], want=["Psum"]),
        dict(nsp=3, shape=(1, 2, 2, 3, 2), size=(1, 3, 1), x=["S2"], want=["Psum"]),
        dict(nsp=2, shape=(2, 3, 2, 5), size=(2, 5), x=["S2"], want=["S2"]),
        dict(nsp=2, shape=(2, 3, 6, 5), size=(3, 5), x=["S2"], want=["S2"]),  # 2, 2, 2, 0 -> 1, 1, 1, 0
        dict(nsp=2, shape=(2, 3, 5, 2), size=(5, 1), x=["S3"], want=["Psum"]),  # W = 2: empty shards
        dict(nsp=2, shape=(4, 3, 6, 5), size=(2, 5), x=["S2"], want=["S0"]),  # chunks 2, bins 3: moved
    ]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_adaptive_avg_pool_1d_mesh(world):
    _assert_no_failures(run_distributed(_run, world, _check_pool, _pool_cfgs_1d(world), (world,)))


def _pool_cfgs_2x2() -> list[dict]:
    return [
        # H on mesh dim 0, W on mesh dim 1
        dict(nsp=2, shape=(2, 3, 7, 8), size=(1, 4), x=["S2", "S3"], want=["Psum", "S3"]),
        dict(nsp=2, shape=(2, 3, 8, 5), size=(4, 1), x=["S2", "S3"], want=["S2", "Psum"]),
        dict(nsp=2, shape=(2, 3, 8, 12), size=(2, 2), x=["S2", "S3"], want=["S2", "S3"]),
        dict(nsp=2, shape=(2, 3, 7, 5), size=1, x=["S2", "S3"], want=["Psum", "Psum"]),  # -> mean.dim
        dict(nsp=3, shape=(1, 2, 3, 5, 4), size=(3, 1, 1), x=["S3", "S4"], want=["Psum", "Psum"]),
        dict(nsp=3, shape=(1, 2, 5, 7, 4), size=(1, 1, 2), x=["S2", "S3"], want=["Psum", "Psum"], grad_partial=True),
        dict(nsp=1, shape=(2, 3, 8), size=4, x=["S0", "S2"], want=["S0", "S2"]),
        # not aligned on one mesh dim: that shard moves to the batch or channel dim
        dict(nsp=2, shape=(4, 3, 6, 8), size=(3, 4), x=["S2", "S3"], want=["S0", "S3"]),  # H chunks 3, bins 2
        dict(nsp=2, shape=(2, 3, 8, 6), size=(4, 3), x=["S2", "S3"], want=["S2", "S1"]),  # W chunks 3, bins 2
        # H sharded by both mesh dims (mesh dim 0 splits first)
        dict(nsp=2, shape=(2, 3, 7, 4), size=(1, 2), x=["S2", "S2"], want=["Psum", "Psum"]),
        dict(nsp=2, shape=(2, 3, 8, 4), size=(4, 2), x=["S2", "S2"], want=["S2", "S2"]),  # 2, 2, 2, 2: bins of 2
        dict(nsp=2, shape=(2, 3, 8, 4), size=(2, 2), x=["S2", "S2"], want=["S2", "S1"]),  # inner chunk 2 < bin 4
        # batch x H, channels x W
        dict(nsp=2, shape=(3, 2, 7, 6), size=(1, 3), x=["S0", "S2"], want=["S0", "Psum"]),
        dict(nsp=2, shape=(2, 4, 5, 6), size=(5, 2), x=["S1", "S3"], want=["S1", "S3"]),
    ]


def test_adaptive_avg_pool_2x2_mesh():
    _assert_no_failures(run_distributed(_run, 4, _check_pool, _pool_cfgs_2x2(), (2, 2)))


def test_blocks_align_is_the_chunk_condition():
    """With one mesh dim of n ranks the bins line up exactly when the input chunk is a multiple of
    the bin size (then the output's own chunk layout puts those bins on the same rank)."""
    for n_in in range(1, 25):
        for n_out in range(1, n_in + 1):
            for n in range(1, 6):
                aligned = n_in % n_out == 0 and (-(-n_in // n)) % (n_in // n_out) == 0
                assert blocks_align(n_in, n_out, (n,), [0]) == aligned, (n_in, n_out, n)
    assert blocks_align(8, 4, (2, 2), [0, 1]) and not blocks_align(8, 2, (2, 2), [0, 1])
    assert not blocks_align(7, 3, (2,), [0]) and blocks_align(7, 7, (3,), [0])


# ---------------------------------------------------------------------------------------------
# group norm
# ---------------------------------------------------------------------------------------------


def _check_gn(cfg, m) -> None:
    shape, groups, x_place = cfg["shape"], cfg["groups"], cfg["x"]
    g = torch.Generator().manual_seed(cfg.get("seed", 3))
    x = torch.randn(shape, generator=g) * 3 + 1
    c = shape[1]
    affine = cfg.get("affine", True)
    w, b = (1 + torch.randn(c, generator=g) * 0.3, torch.randn(c, generator=g) * 0.3) if affine else (None, None)
    gy = torch.randn(shape, generator=g)
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_() if affine else None
    br = b.clone().requires_grad_() if affine else None
    ref = F.group_norm(xr, groups, wr, br)
    (ref * gy).sum().backward()
    rep = [Replicate()] * m.ndim
    xd = dtshard.distribute_tensor(x, m, Ps(x_place), src_data_rank=None).requires_grad_()
    wd = dtshard.distribute_tensor(w, m, rep, src_data_rank=None).requires_grad_() if affine else None
    bd = dtshard.distribute_tensor(b, m, rep, src_data_rank=None).requires_grad_() if affine else None
    out = F.group_norm(xd, groups, wd, bd)
    assert list(out.placements) == Ps(cfg["want"]), f"placements {out.placements}, want {cfg['want']}"
    _check_local("out", out, ref.detach(), m)
    out.backward(dtshard.distribute_tensor(gy, m, out.placements, src_data_rank=None))
    # a leaf's .grad is laid out like the leaf (README "Gradients"), whatever the output's layout
    assert list(xd.grad.placements) == list(xd.placements), f"grad placements {xd.grad.placements}"
    _check_local("grad_input", xd.grad, xr.grad, m)
    if affine:
        _check_local("grad_weight", wd.grad, wr.grad, m)
        _check_local("grad_bias", bd.grad, br.grad, m)


def _gn_cfgs_1d(world: int) -> list[dict]:
    if world == 2:
        return [
            dict(shape=(2, 4, 7, 5), groups=2, x=["S2"], want=["S2"]),
            dict(shape=(2, 4, 5, 7), groups=4, x=["S3"], want=["S3"]),
            dict(shape=(2, 4, 7), groups=1, x=["S2"], want=["S2"]),  # (N, C, L)
            dict(shape=(2, 4, 3, 4, 3), groups=2, x=["S3"], want=["S3"]),  # (N, C, D, H, W)
            # channels: kept when every chunk holds whole groups (4 over 2: 2 + 2, groups of 2)
            dict(shape=(2, 4, 5, 3), groups=2, x=["S1"], want=["S1"]),
            dict(shape=(2, 4, 5, 3), groups=4, x=["S1"], want=["S1"]),
            dict(shape=(2, 6, 5, 3), groups=3, x=["S1"], want=["R"]),  # chunks 3, groups of 2: replicated
            dict(shape=(3, 4, 5, 3), groups=2, x=["S0"], want=["S0"]),
            dict(shape=(2, 4, 7, 5), groups=2, x=["S2"], want=["S2"], affine=False),
        ]
    if world == 3:
        return [
            dict(shape=(2, 4, 7, 5), groups=1, x=["S2"], want=["S2"]),  # H = 7: 3, 3, 1
            dict(shape=(2, 4, 7, 5), groups=2, x=["S2"], want=["S2"]),
            dict(shape=(2, 4, 7, 5), groups=4, x=["S2"], want=["S2"]),  # groups = C
            dict(shape=(1, 6, 5, 7), groups=3, x=["S3"], want=["S3"], affine=False),
            dict(shape=(2, 6, 4, 3), groups=3, x=["S1"], want=["S1"]),  # chunks 2 = one group each
        ]
    assert world == 4
    return [
        dict(shape=(2, 4, 2, 5), groups=2, x=["S2"], want=["S2"]),  # H = 2: shards 1, 1, 0, 0
        dict(shape=(2, 4, 2, 5), groups=4, x=["S2"], want=["S2"]),
        dict(shape=(2, 4, 5, 3), groups=1, x=["S1"], want=["R"]),  # one group over all channels
    ]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_group_norm_1d_mesh(world):
    _assert_no_failures(run_distributed(_run, world, _check_gn, _gn_cfgs_1d(world), (world,)))


def _gn_cfgs_2x2() -> list[dict]:
    return [
        dict(shape=(2, 4, 7, 5), groups=1, x=["S2", "S3"], want=["S2", "S3"]),
        dict(shape=(2, 4, 7, 5), groups=2, x=["S2", "S3"], want=["S2", "S3"]),
        dict(shape=(2, 4, 7, 5), groups=4, x=["S2", "S3"], want=["S2", "S3"]),
        dict(shape=(2, 4, 3, 2), groups=2, x=["S2", "S3"], want=["S2", "S3"], affine=False),  # W = 2 on 2
        dict(shape=(3, 4, 7, 5), groups=2, x=["S0", "S2"], want=["S0", "S2"]),
        dict(shape=(2, 4, 7, 5), groups=2, x=["S2", "S2"], want=["S2", "S2"]),  # H on both mesh dims
        dict(shape=(2, 4, 7, 5), groups=2, x=["S1", "S2"], want=["S1", "S2"]),  # whole groups x H
        dict(shape=(2, 4, 7, 5), groups=1, x=["S1", "S2"], want=["R", "S2"]),
    ]


def test_group_norm_2x2_mesh():
    _assert_no_failures(run_distributed(_run, 4, _check_gn, _gn_cfgs_2x2(), (2, 2)))


# ---------------------------------------------------------------------------------------------
# traffic and errors
# ---------------------------------------------------------------------------------------------


def _traffic():
    m = mesh((3,))
    out = {}
    x = dtshard.distribute_tensor(torch.randn(2, 4, 7, 5), m, Ps(["S2"])).requires_grad_()
    w = dtshard.distribute_tensor(torch.ones(4), m, [Replicate()]).requires_grad_()
    with CommCounter() as fwd:
        y = F.group_norm(x, 2, w, w)
    with CommCounter() as bwd:
        y.backward(dtshard.DTensor.from_local(torch.ones(y.to_local().shape), m, y.placements, shape=y.shape))
    gn_bwd = [r for r in bwd.records if r.op == "aten.native_group_norm_backward.default"]
    out["gn"] = (fwd.kinds(), [r.nbytes for r in fwd.records], [r.kind for r in gn_bwd],
                 [r.nbytes for r in gn_bwd], str(y.placements))
    for name, h, size in (("to1", 7, (1, 3)), ("aligned", 12, (6, 3))):
        x = dtshard.distribute_tensor(global_tensor((2, 3, h, 6)), m, Ps(["S2"])).requires_grad_()
        with CommCounter() as fwd:
            y = F.adaptive_avg_pool2d(x, size)
        g = dtshard.distribute_tensor(torch.ones(y.shape), m, _grad_placements(y.placements))
        with CommCounter() as bwd:
            y.backward(g)
        out[name] = (fwd.kinds(), bwd.kinds(), str(y.placements))
    return out


def test_traffic():
    for r in run_distributed(_traffic, 3):
        # group norm over H: ONE all_gather of each rank's (mean, M2) per (N, G) = (2, 2)
        # statistic (float64: 64 bytes to each of the 2 others), nothing else (never the
        # activation); backward: one all_reduce of the stacked (2, 2, 2) sums
        kinds, nbytes, bkinds, bbytes, placements = r["gn"]
        assert kinds == ["all_gather"], r["gn"]
        assert nbytes == [2 * (2 * 2 * 2 * 8)], r["gn"]
        assert bkinds == ["all_reduce"] and bbytes[0] <= 2 * 2 * 2 * 4 * 2, r["gn"]
        assert placements == "(Shard(dim=2),)"
        # pooled to 1: a Partial output, no collective; aligned bins: local
        assert r["to1"] == ([], [], "(Partial(sum),)"), r["to1"]
        assert r["aligned"] == ([], [], "(Shard(dim=2),)"), r["aligned"]


def _prelu(world: int):
    """PReLU (one weight per channel, and a single one) on activations sharded on H, D, the batch
    and the channels (uneven: H = 7): output and both gradients against one process in float64,
    and the traffic (issue #31: its backward all-gathered the activation and its gradient)."""
    m = mesh((world,))
    out = []
    torch.manual_seed(0)
    for shape, dim, n_weights in (((2, 4, 7, 6), 2, 4), ((2, 3, 6, 5, 4), 2, 3), ((3, 4, 5, 6), 0, 1),
                                  ((2, 4, 7, 6), 1, 4), ((2, 4, 7, 6), 3, 1)):
        x = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
        w = (torch.rand(n_weights, dtype=torch.float64) * 0.5).requires_grad_()
        g = torch.randn(*shape, dtype=torch.float64)
        ref = F.prelu(x, w)
        rgx, rgw = torch.autograd.grad(ref, (x, w), g)
        dx = dtshard.distribute_tensor(x.detach(), m, Ps([f"S{dim}"])).requires_grad_()
        dw = dtshard.distribute_tensor(w.detach(), m, [Replicate()]).requires_grad_()
        with CommCounter() as fwd:
            y = F.prelu(dx, dw)
        dg = dtshard.distribute_tensor(g, m, y.placements)
        with CommCounter() as bwd:
            gx, gw = torch.autograd.grad(y, (dx, dw), dg)
        name = f"prelu {shape} S({dim}) {n_weights} weight(s)"
        try:
            _check_local(name, y, ref.detach(), m)
            _check_local(name + " grad x", gx, rgx, m)
            torch.testing.assert_close(gw.full_tensor(), rgw, msg=lambda s: f"{name} grad w: {s}")
        except AssertionError as e:
            out.append(str(e))
        # forward: local; backward: local but the weight gradient's sum over the shards (one
        # all_reduce of the weight's size; none for a channel shard) -- never an all_gather
        shards_channels = dim == 1 and n_weights > 1
        if fwd.kinds() or "all_gather" in bwd.kinds() or bwd.count() > (0 if shards_channels else 1) \
                or any(r.nbytes > n_weights * 8 for r in bwd.records):
            out.append(f"{name}: traffic forward {fwd.summary()} backward {bwd.summary()}")
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_prelu_keeps_activations_sharded(world):
    for failures in run_distributed(_prelu, world, world):
        assert failures == [], "\n".join(failures)


def _errors():
    m = mesh((2,))
    x = dtshard.distribute_tensor(torch.randn(2, 3, 7, 6), m, Ps(["S2"]))
    msgs = []
    for fn in (lambda: torch.ops.aten._adaptive_avg_pool2d(x, [-1, 2]),
               lambda: torch.ops.aten.native_group_norm(x, None, None, 2, 3, 42, 2, 1e-5)):
        try:
            fn()
            msgs.append("no error")
        except Exception as e:
            msgs.append(str(e))
    return msgs


def test_errors_name_op_shapes_placements_and_mesh():
    for msgs in run_distributed(_errors, 2):
        pool, gn = msgs
        assert "aten._adaptive_avg_pool2d.default" in pool and "(2, 3, 7, 6) (S(2))" in pool, pool
        assert "over mesh (2,)" in pool, pool
        assert "aten.native_group_norm.default" in gn and "(2, 3, 7, 6) (S(2))" in gn and "over mesh (2,)" in gn, gn
