"""Small models shared by the demo and the tests (plain PyTorch code, nothing dtshard-specific).

``unet``: a UNet-like CNN written functionally over a parameter dict, so the same function runs on
plain tensors and on DTensors: two down levels (conv3x3 + batch_norm + relu, max_pool 2), a
bottleneck, two up levels (nearest upsampling to the skip's size, concat of the skip over
channels, conv3x3 + batch_norm + relu), a 1x1 head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["unet", "unet_params", "unet_stats", "train_unet"]


def unet_params(c_in: int = 3, c_out: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def conv(o, i, k):
        return (torch.randn(o, i, k, k, generator=g) * (2.0 / (i * k * k)) ** 0.5,
                torch.randn(o, generator=g) * 0.1)

    p = {}
    for name, (o, i, k) in {"enc1": (4, c_in, 3), "enc2": (8, 4, 3), "mid": (8, 8, 3), "dec2": (8, 16, 3),
                            "dec1": (4, 12, 3), "head": (c_out, 4, 1)}.items():
        p[f"{name}.w"], p[f"{name}.b"] = conv(o, i, k)
        if name != "head":
            p[f"{name}.gamma"] = 1 + 0.1 * torch.randn(o, generator=g)
            p[f"{name}.beta"] = 0.1 * torch.randn(o, generator=g)
    return p


def unet_stats() -> dict[str, torch.Tensor]:
    """Batch-norm running statistics (updated in place by training-mode batch_norm)."""
    out = {}
    for name, c in (("enc1", 4), ("enc2", 8), ("mid", 8), ("dec2", 8), ("dec1", 4)):
        out[f"{name}.mean"], out[f"{name}.var"] = torch.zeros(c), torch.ones(c)
    return out


def _block(x, p, s, name):
    x = F.conv2d(x, p[f"{name}.w"], p[f"{name}.b"], padding=1)
    x = F.batch_norm(x, s[f"{name}.mean"], s[f"{name}.var"], p[f"{name}.gamma"], p[f"{name}.beta"],
                     training=True, momentum=0.1, eps=1e-5)
    return F.relu(x)


def unet(x, p, s, up: str = "size"):
    """``up="x2"``: upsample by scale_factor 2 (sizes divisible by 4); ``"size"``: to the skip's size."""
    e1 = _block(x, p, s, "enc1")                    # H
    e2 = _block(F.max_pool2d(e1, 2), p, s, "enc2")  # H/2
    m = _block(F.max_pool2d(e2, 2), p, s, "mid")    # H/4
    if up == "x2":
        u2 = F.interpolate(m, scale_factor=2, mode="nearest")
    else:
        u2 = F.interpolate(m, size=tuple(e2.shape[-2:]), mode="nearest")
    d2 = _block(torch.cat([u2, e2], dim=1), p, s, "dec2")
    if up == "x2":
        u1 = F.interpolate(d2, scale_factor=2, mode="nearest")
    else:
        u1 = F.interpolate(d2, size=tuple(e1.shape[-2:]), mode="nearest")
    d1 = _block(torch.cat([u1, e1], dim=1), p, s, "dec1")
    return F.conv2d(d1, p["head.w"], p["head.b"])


def train_unet(x, y, p, s, up: str, steps: int, lr: float = 0.05, on_step=None) -> list[torch.Tensor]:
    """Plain SGD on the parameter dict; returns the detached loss of each step."""
    losses = []
    for step in range(steps):
        loss = F.mse_loss(unet(x, p, s, up), y)
        for t in p.values():
            t.grad = None
        loss.backward()
        with torch.no_grad():
            for t in p.values():
                t.sub_(lr * t.grad)
        losses.append(loss.detach())
        if on_step is not None:
            on_step(step)
    return losses
