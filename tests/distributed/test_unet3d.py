"""A 3-D UNet (``dtshard.models.UNet3d``: conv3d, GroupNorm, SiLU, strided-conv downsampling,
transposed-conv or trilinear upsampling, skip concatenation) on spatially sharded volumes.

- float64, every rank: the output (still sharded) and every weight gradient equal the same model
  in one process, volumes sharded on D x H over a 2x2 mesh and on D over 2 ranks, with uneven
  shards at the coarse levels (sides 12 and 20: 3 + 3 / 3 + 2 at D/4, H/4);
- the demo's worker (``python -m dtshard.demo --model unet3d``), 5 SGD steps on 4 ranks (D x H)
  and 2 (D): losses and weights match one process, the halo exchanges per step are exactly one
  all_to_all per sharded dim for each 3x3x3 convolution forward and one in backward (the
  gradient's halo back to its owners; the weight gradient's input window is rebuilt from the halo
  the forward received; the first convolution's input needs no gradient), and each rank's peak
  activation memory is about
  1/(number of ranks) of one process's.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from dtshard import demo
from dtshard.testing import run_distributed


def _exact(mesh_shape, dims, up, size):
    import dtshard
    from dtshard import Shard
    from dtshard.models import UNet3d

    torch.manual_seed(0)
    ref = UNet3d(up=up).double()
    model = copy.deepcopy(ref)
    mesh = dtshard.init_device_mesh("cpu", mesh_shape)
    dtshard.distribute_module(model, mesh)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 1, *size, generator=g, dtype=torch.float64)
    y = torch.randn(2, 2, *size, generator=g, dtype=torch.float64)
    placements = [Shard(d) for d in dims]
    out = model(dtshard.distribute_tensor(x, mesh, placements))
    F.mse_loss(out, dtshard.distribute_tensor(y, mesh, placements)).backward()
    rout = ref(x)
    F.mse_loss(rout, y).backward()
    grads_ok = all(type(p.grad) is dtshard.DTensor and p.grad.placements == p.placements for p in model.parameters())
    return (out.placements == tuple(placements), (out.full_tensor() - rout).abs().max().item(),
            max((p.grad.full_tensor() - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())),
            grads_ok)


@pytest.mark.parametrize("mesh_shape,dims", [((2, 2), (2, 3)), ((2,), (2,))], ids=["DxH-2x2", "D-2"])
@pytest.mark.parametrize("up", ["tconv", "trilinear"])
def test_unet3d_exact_on_sharded_volumes(mesh_shape, dims, up):
    for placed, out_err, grad_err, grads_ok in run_distributed(_exact, math.prod(mesh_shape), mesh_shape, dims, up,
                                                               (12, 20, 8), timeout=300):
        assert placed, "the output left the input's spatial layout"
        assert out_err < 1e-12 and grad_err < 1e-12, (out_err, grad_err)
        assert grads_ok


@pytest.mark.parametrize("world", [4, 2], ids=["DxH-2x2", "D-2"])
def test_unet3d_demo_matches_one_process(world):
    ranks = run_distributed(demo.train_unet3d_worker, world, 5, timeout=300)
    n_dims = len(ranks[0]["dims"])
    for r in ranks:
        for row in r["rows"]:
            assert abs(row["loss"] - row["ref"]) <= 1e-6 + 1e-5 * abs(row["ref"]), row
            assert row["dev_w"] <= 1e-5, row
            # per sharded dim: 5 blocks of two 3x3x3 convolutions; with depth 1 each exchanges
            # once per pass (10 + 9: the first one's input needs no gradient).  Under the
            # default depth policy the two full-resolution blocks (shards of 8 rows) widen their
            # input once for both convolutions (forward 1, backward 1 or, for the first block,
            # 0): 4 fewer.  The coarser levels' shards (4 and 2 rows) are too thin for a deeper
            # halo within the model's extra-compute bound.
            assert row["halo"] == 15 * n_dims, row
            # per GroupNorm (10): one all_gather of the per-rank statistics forward, one
            # all_reduce backward; + 1 gradient bucket
            assert row["other"] == {"all_gather": 10, "all_reduce": 11}, row
        ratio = r["peak"] / r["peak_ref"]
        assert ratio < {4: 0.35, 2: 0.6}[world], ratio  # about 1/4 and 1/2 of one process


def _compiled(steps: int = 2):
    import torch._dynamo
    from torch._dynamo.utils import counters

    import dtshard
    from dtshard import Shard
    from dtshard.models import UNet3d

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    ref = UNet3d().double()
    model = copy.deepcopy(ref)
    mesh = dtshard.init_device_mesh("cpu", (2, 2))
    dtshard.distribute_module(model, mesh)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=False)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 1, 12, 20, 8, generator=g, dtype=torch.float64)
    y = torch.randn(2, 2, 12, 20, 8, generator=g, dtype=torch.float64)
    placements = [Shard(2), Shard(3)]
    dx, dy = dtshard.distribute_tensor(x, mesh, placements), dtshard.distribute_tensor(y, mesh, placements)
    errs = []
    for _ in range(steps):
        model.zero_grad()
        ref.zero_grad()
        out = compiled(dx)
        F.mse_loss(out, dy).backward()
        rout = ref(x)
        F.mse_loss(rout, y).backward()
        errs.append(((out.full_tensor() - rout).abs().max().item(),
                     max((p.grad.full_tensor() - q.grad).abs().max().item()
                         for p, q in zip(model.parameters(), ref.parameters()))))
    return errs, sum(counters["graph_break"].values()), out.placements == tuple(placements)


def test_unet3d_compiles_fullgraph_on_a_2x2_spatial_mesh():
    """torch.compile(fullgraph=True) of the D x H sharded 3-D UNet: no graph break (the halo
    exchanges are custom ops in the graph), outputs and gradients equal one process in float64,
    and the second step reuses the graph."""
    for errs, breaks, placed in run_distributed(_compiled, 4, timeout=600):
        assert breaks == 0, breaks
        assert placed
        for out_err, grad_err in errs:
            assert out_err < 1e-12 and grad_err < 1e-12, errs
