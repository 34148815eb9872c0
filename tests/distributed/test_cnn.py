"""A small UNet trained with images sharded on H (and on H x W) against single-process PyTorch.

Two down levels (conv3x3 + batch_norm + relu, max_pool 2), a bottleneck, two up levels (nearest
upsampling to the skip's size, concat the skip over channels, conv3x3 + batch_norm + relu), a 1x1
head and an MSE loss; 5 SGD steps.  On every rank: the loss of every step, every weight after the
last step and the batch-norm running statistics equal the single-process run to ~1e-5 (relative).

The sizes are picked so that shards are uneven at every level (H = 14 on 3 ranks: 5, 5, 4 -> 3, 3,
1 -> 1, 1, 1; on 4 ranks the bottleneck has an empty shard) and the upsampling runs both through
the aligned x2 path and the general (halo) path.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtshard
from dtshard import Replicate, Shard
from dtshard.models import train_unet, unet, unet_params, unet_stats
from dtshard.testing import run_distributed

from _cases import mesh

_STEPS = 5
_LR = 0.05
# the model lives in the package (the demo trains it too)
_params, _stats = unet_params, unet_stats


def _train(x, y, p, s, up: str):
    return train_unet(x, y, p, s, up, _STEPS, _LR)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _unet_worker(mesh_shape, x_place, h: int, w: int, up: str):
    m = mesh(mesh_shape)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, h, w, generator=g)
    y = torch.randn(2, 2, h, w, generator=g)

    ref_p = {k: v.clone().requires_grad_() for k, v in _params().items()}
    ref_s = _stats()
    ref_losses = [float(v) for v in _train(x, y, ref_p, ref_s, up)]

    rep = [Replicate()] * m.ndim
    placements = [Shard(int(s[1:])) for s in x_place]
    xd = dtshard.distribute_tensor(x, m, placements)
    yd = dtshard.distribute_tensor(y, m, placements)
    dp = {k: dtshard.distribute_tensor(v, m, rep).requires_grad_() for k, v in _params().items()}
    ds = {k: dtshard.distribute_tensor(v, m, rep) for k, v in _stats().items()}
    losses = _train(xd, yd, dp, ds, up)
    got = [float(v.full_tensor()) for v in losses]
    errors = {"loss": max(abs(a - b) / abs(b) for a, b in zip(got, ref_losses))}
    for k in ref_p:
        errors[k] = _rel(dp[k].full_tensor(), ref_p[k].detach())
    for k in ref_s:
        errors[k] = _rel(ds[k].full_tensor(), ref_s[k])
    out_place = str(unet(xd, dp, ds, up).placements)
    return {"errors": errors, "losses": got, "ref": ref_losses, "out": out_place}


_CASES = {
    # name: (world, mesh shape, x placements, H, W, upsampling)
    "2 ranks H": (2, (2,), ["S2"], 12, 8, "x2"),
    "3 ranks H uneven": (3, (3,), ["S2"], 14, 9, "size"),
    "4 ranks H empty shard": (4, (4,), ["S2"], 14, 6, "size"),
    "2x2 H x W": (4, (2, 2), ["S2", "S3"], 14, 13, "size"),
}


@pytest.mark.parametrize("case", list(_CASES))
def test_unet_trains_like_single_process(case):
    world, mesh_shape, x_place, h, w, up = _CASES[case]
    results = run_distributed(_unet_worker, world, mesh_shape, x_place, h, w, up, timeout=300)
    for rank, res in enumerate(results):
        bad = {k: v for k, v in res["errors"].items() if not v <= 1e-5}
        assert not bad, f"rank {rank}: relative errors above 1e-5: {bad}\nlosses {res['losses']}\nref {res['ref']}"
        assert res["losses"][-1] < res["losses"][0]  # it trains
        assert res["out"] == str(tuple(Shard(int(s[1:])) for s in x_place)), res["out"]


# ---------------------------------------------------------------------------------------------
# batch_norm / group_norm on spatial shards (norm.py's handlers), forward and backward
# ---------------------------------------------------------------------------------------------


def _norm_worker(mesh_shape, x_place):
    from dtshard.debug import CommCounter

    m = mesh(mesh_shape)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 4, 7, 5, generator=g) * 3 + 1
    w, b = 1 + torch.randn(4, generator=g) * 0.1, torch.randn(4, generator=g) * 0.1
    gy = torch.randn(2, 4, 7, 5, generator=g)
    rep = [Replicate()] * m.ndim
    placements = [Shard(int(s[1:])) for s in x_place]
    fns = {
        "batch_norm": lambda t, ww, bb, rm, rv: F.batch_norm(t, rm, rv, ww, bb, training=True),
        "group_norm": lambda t, ww, bb, rm, rv: F.group_norm(t, 2, ww, bb),
    }
    out = {}
    for name, fn in fns.items():
        xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
        rmr, rvr = torch.zeros(4), torch.ones(4)
        ref = fn(xr, wr, br, rmr, rvr)
        (ref * gy).sum().backward()
        xd = dtshard.distribute_tensor(x, m, placements).requires_grad_()
        wd, bd = (dtshard.distribute_tensor(t, m, rep).requires_grad_() for t in (w, b))
        rmd, rvd = dtshard.distribute_tensor(torch.zeros(4), m, rep), dtshard.distribute_tensor(torch.ones(4), m, rep)
        with CommCounter() as comm:
            y = fn(xd, wd, bd, rmd, rvd)
        y.backward(dtshard.distribute_tensor(gy, m, y.placements))
        errors = {"out": _rel(y.full_tensor(), ref.detach()), "grad_x": _rel(xd.grad.full_tensor(), xr.grad),
                  "grad_w": _rel(wd.grad.full_tensor(), wr.grad), "grad_b": _rel(bd.grad.full_tensor(), br.grad)}
        if name == "batch_norm":
            errors["running_mean"] = _rel(rmd.full_tensor(), rmr)
            errors["running_var"] = _rel(rvd.full_tensor(), rvr)
        out[name] = {"errors": errors, "placements": str(y.placements), "fwd_bytes": comm.bytes()}
    return out


@pytest.mark.parametrize("mesh_shape,x_place", [((3,), ["S2"]), ((2, 2), ["S2", "S3"])], ids=["H", "HxW"])
def test_norms_on_spatial_shards(mesh_shape, x_place):
    world = 1
    for n in mesh_shape:
        world *= n
    for rank, res in enumerate(run_distributed(_norm_worker, world, mesh_shape, x_place)):
        for name, r in res.items():
            bad = {k: v for k, v in r["errors"].items() if not v <= 1e-5}
            assert not bad, f"rank {rank} {name}: relative errors above 1e-5: {bad}"
        # batch norm keeps the spatial shards (Partial statistics: a few bytes per channel)
        assert res["batch_norm"]["placements"] == str(tuple(Shard(int(s[1:])) for s in x_place))
