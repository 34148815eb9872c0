"""Third-party CNN architectures trained on spatially sharded inputs (issue #31): the collectives
of one training step, and its values against one process.

- ``dtshard.models.ResNet18`` (torchvision's layout, 20 BatchNorm2d; width 8 here, which changes
  no collective count), images (2, 3, 64, 64) sharded on H over 2 ranks, float64: the output,
  every parameter gradient and every running statistic equal one process to 1e-10 relative on
  every rank; one step issues at most 45 all_reduces (20 batch-norm backward reductions, the
  gradient bucket, the pooled features at the head: 23) and no all_gather but the 20 batch
  norms' statistics (2 numbers per channel per rank), never an activation; the halo exchanges are the convolutions' and the max pool's.
- ``dtshard.models.MonaiUNet3d`` (MONAI's UNet structure: residual units of strided conv ->
  InstanceNorm -> PReLU, transposed convolutions, skip concatenation), volumes (2, 1, 16, 8, 8)
  sharded on D over 2 ranks, float64: output and gradients equal one process to 1e-12 (gradients
  relative to the largest); each of
  the 14 InstanceNorms gathers its statistics once forward and reduces once backward; PReLU and
  the transposed convolutions move nothing but halos and Partial weight gradients; no all_gather
  of an activation.
"""

from __future__ import annotations

import copy
from collections import Counter

import torch
import torch.nn.functional as F

from dtshard.testing import run_distributed

#: the all_to_all of a step are halo exchanges, of these ops only
_HALOS = ["aten.convolution.default", "aten.convolution_backward.default"]
_NORM_FWD = ("aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
             "aten._native_batch_norm_legit.no_stats", "aten._batch_norm_with_update.default")


def _step(kind: str):
    import dtshard
    from dtshard import Shard
    from dtshard.debug import CommCounter
    from dtshard.models import MonaiUNet3d, ResNet18

    mesh = dtshard.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if kind == "resnet18":
        ref = ResNet18(num_classes=10, width=8).double()
        x = torch.randn(2, 3, 64, 64, generator=g, dtype=torch.float64)
        y = torch.randn(2, 10, generator=g, dtype=torch.float64)
        placements = [Shard(2)]  # H
    else:
        ref = MonaiUNet3d().double()
        x = torch.randn(2, 1, 16, 8, 8, generator=g, dtype=torch.float64)
        y = torch.randn(2, 2, 16, 8, 8, generator=g, dtype=torch.float64)
        placements = [Shard(2)]  # D
    model = copy.deepcopy(ref)
    dtshard.distribute_module(model, mesh)
    xd = dtshard.distribute_tensor(x, mesh, placements)
    yd = dtshard.distribute_tensor(y, mesh, [Shard(2)] if kind != "resnet18" else [dtshard.Replicate()])
    with CommCounter() as comm:
        out = model(xd)
        F.mse_loss(out, yd).backward()
    rout = ref(x)
    F.mse_loss(rout, y).backward()

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))

    errors = {"out": rel(out.detach().full_tensor(), rout.detach())}
    # gradients relative to the largest one: a convolution's bias before an instance norm has a
    # zero gradient in exact arithmetic (rounding noise of ~1e-17 in both runs)
    scale = max(float(q.grad.abs().max()) for q in ref.parameters())
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        errors[f"grad {name}"] = float((p.grad.full_tensor() - q.grad).abs().max()) / scale
    for (name, b), rb in zip(model.named_buffers(), ref.buffers()):
        if b.dtype.is_floating_point:
            errors[f"buffer {name}"] = rel(b.full_tensor(), rb)
    channels = {m.num_features for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)}
    return {"errors": errors, "kinds": dict(Counter(r.kind for r in comm.records)),
            "gathers": [(r.op, r.nbytes) for r in comm.records if r.kind == "all_gather"],
            "reduces": dict(Counter(r.op for r in comm.records if r.kind == "all_reduce")),
            "a2a": sorted({r.op for r in comm.records if r.kind == "all_to_all"}),
            "other": [(r.kind, r.op, r.nbytes) for r in comm.records
                      if r.kind not in ("all_to_all", "all_gather", "all_reduce")],
            "max_channels": max(channels), "norms": len([m for m in model.modules()
                                                        if isinstance(m, torch.nn.modules.batchnorm._NormBase)])}


def _check_gathers(res, n_stats_per_norm):
    """Every all_gather is one norm's statistics: (mean, M2) in float64 per statistic, to the
    other rank."""
    for op, nbytes in res["gathers"]:
        assert op in _NORM_FWD, (op, nbytes)
        assert nbytes <= 2 * n_stats_per_norm * 8, (op, nbytes)


def test_resnet18_h_sharded_step_collectives_and_values():
    for rank, res in enumerate(run_distributed(_step, 2, "resnet18", timeout=300)):
        bad = {k: v for k, v in res["errors"].items() if not v <= 1e-10}
        assert not bad, f"rank {rank}: {bad}"
        kinds = res["kinds"]
        assert kinds.get("all_reduce", 0) <= 45, kinds
        assert res["norms"] == 20
        # 20 batch norms: one all_reduce each backward; the replicated weights' gradients in one
        # bucket; the pooled features (Partial: H pooled to 1) reduced at the head, forward and back
        assert res["reduces"] == {"aten.native_batch_norm_backward.default": 20, "<grad bucket>": 1,
                                  "aten.mm.default": 1, "aten.mul.Tensor": 1}, res["reduces"]
        assert len(res["gathers"]) == 20, res["gathers"]
        _check_gathers(res, res["max_channels"])
        # known (benchmarks/README.md, the audit): the global average pool's backward yields a
        # Partial gradient of the last stage's activation (sum's backward expands the Partial
        # (N, C, 1, 1) gradient), reduce-scattered onto the H shards at the last ReLU's backward
        assert res["other"] == [("reduce_scatter", "aten.threshold_backward.default", 2 * 8 * 8 * 2 * 2 * 8 // 2)], \
            res["other"]
        assert res["a2a"] == _HALOS + ["aten.max_pool2d_with_indices.default",
                                       "aten.max_pool2d_with_indices_backward.default"], res["a2a"]


def test_monai_style_unet3d_d_sharded_step_moves_no_activation():
    for rank, res in enumerate(run_distributed(_step, 2, "monai_unet3d", timeout=300)):
        bad = {k: v for k, v in res["errors"].items() if not v <= 1e-12}
        assert not bad, f"rank {rank}: {bad}"
        # instance norm: batch norm over (1, N*C, D, H, W), N*C statistics
        assert len(res["gathers"]) == res["norms"] == 14, res["gathers"]
        _check_gathers(res, 2 * res["max_channels"])
        assert res["reduces"] == {"aten.native_batch_norm_backward.default": 14, "<grad bucket>": 1}, res["reduces"]
        assert set(res["kinds"]) == {"all_reduce", "all_gather", "all_to_all"}, res["kinds"]
        assert res["a2a"] == _HALOS, res["a2a"]  # transposed convolutions need no halo on stride = kernel
