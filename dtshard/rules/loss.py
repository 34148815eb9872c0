"""Losses: mse_loss and its backward.

Handlers, because ``reduction='mean'`` divides by the GLOBAL element count: a local mean on each
shard would be wrong (uneven shards) or off by the number of ranks (its backward).  Each is written
as a few DTensor ops whose rules are all exact (sub, mul, sum -> Partial, div by a scalar).
"""

from __future__ import annotations

import torch

from dtshard.registry import register_handler

aten = torch.ops.aten
_NONE, _MEAN, _SUM = 0, 1, 2


def _reduction(args, kwargs, index: int) -> int:
    return args[index] if len(args) > index else kwargs.get("reduction", _MEAN)


@register_handler(aten.mse_loss.default)
def mse_loss_handler(op, args, kwargs):
    x, y = args[0], args[1]
    reduction = _reduction(args, kwargs, 2)
    diff = aten.sub.Tensor(x, y)
    sq = aten.mul.Tensor(diff, diff)
    if reduction == _NONE:
        return sq
    total = aten.sum.default(sq)
    return total if reduction == _SUM else aten.div.Scalar(total, max(sq.numel(), 0) or float("nan"))


@register_handler(aten.mse_loss_backward.default)
def mse_loss_backward_handler(op, args, kwargs):
    grad, x, y = args[0], args[1], args[2]
    reduction = _reduction(args, kwargs, 3)
    scale = 2.0 / x.numel() if reduction == _MEAN and x.numel() else 2.0
    diff = aten.sub.Tensor(x, y)
    return aten.mul.Tensor(diff, aten.mul.Scalar(grad, scale))
