"""Reductions: sum and mean (whole tensor and per dim, keepdim), amax/amin, max/min.

Reducing a sharded dim gives a Partial output (sum -> Partial(sum), amax -> Partial(max)); other
dims keep their shard, renumbered when the reduced dims are dropped.  ``mean`` is a handler: it
runs ``sum`` and divides by the GLOBAL count, which stays exact for uneven shards (a local mean of
unequal chunks averaged over ranks would be wrong).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from dtshard.registry import OpCall, register_handler, register_rule
from dtshard.rules._common import LINEAR_REDUCE_OPS, norm_dims

aten = torch.ops.aten


def reduction_strategies(x, dims, keepdim: bool, partial_op: str | None, linear: bool):
    """Strategies of a reduction of ``x`` over ``dims`` (already normalised)."""
    strategies = []
    for d in range(x.ndim):
        if d in dims:
            if partial_op is not None:
                strategies.append(((Partial(partial_op),), (Shard(d),)))
        else:
            out_d = d if keepdim else d - sum(1 for r in dims if r < d)
            strategies.append(((Shard(out_d),), (Shard(d),)))
    if linear:
        for op in LINEAR_REDUCE_OPS:
            strategies.append(((Partial(op),), (Partial(op),)))
    elif partial_op is not None:
        strategies.append(((Partial(partial_op),), (Partial(partial_op),)))
    return strategies


@register_rule(aten.sum.default)
def sum_rule(call: OpCall):
    x = call.tensors[0]
    return reduction_strategies(x, list(range(x.ndim)), False, "sum", linear=True)


@register_rule(aten.sum.dim_IntList)
def sum_dim_rule(call: OpCall):
    x = call.tensors[0]
    dims = norm_dims(call.arg(1, "dim"), x.ndim)
    return reduction_strategies(x, dims, bool(call.arg(2, "keepdim", False)), "sum", linear=True)


@register_rule([aten.amax.default, aten.amin.default])
def amax_rule(call: OpCall):
    x = call.tensors[0]
    dims = norm_dims(call.arg(1, "dim", []), x.ndim)
    op = "max" if call.op is aten.amax.default else "min"
    return reduction_strategies(x, dims, bool(call.arg(2, "keepdim", False)), op, linear=False)


@register_rule([aten.max.default, aten.min.default])
def max_all_rule(call: OpCall):
    x = call.tensors[0]
    op = "max" if call.op is aten.max.default else "min"
    return reduction_strategies(x, list(range(x.ndim)), False, op, linear=False)


@register_rule([aten.max.dim, aten.min.dim])
def max_dim_rule(call: OpCall):
    # (values, indices): only dims that are not reduced may stay sharded (indices are global).
    x = call.tensors[0]
    dims = norm_dims(call.arg(1, "dim"), x.ndim)
    keepdim = bool(call.arg(2, "keepdim", False))
    strategies = []
    for d in range(x.ndim):
        if d not in dims:
            out_d = d if keepdim else d - sum(1 for r in dims if r < d)
            strategies.append(((Shard(out_d), Shard(out_d)), (Shard(d),)))
    return strategies


def _count(shape, dims) -> int:
    n = 1
    for d in dims:
        n *= shape[d]
    return n


@register_handler([aten.mean.default, aten.mean.dim])
def mean_handler(op, args, kwargs):
    """mean = sum / (global count of reduced elements): exact for uneven shards too."""
    x = args[0]
    dtype = kwargs.get("dtype")
    if op is aten.mean.default:
        dims, keepdim = None, False
        if len(args) > 1:
            dtype = args[1]
    else:
        dims = args[1] if len(args) > 1 else kwargs.get("dim")
        keepdim = args[2] if len(args) > 2 else kwargs.get("keepdim", False)
        if len(args) > 3:
            dtype = args[3]
    result_dtype = dtype if dtype is not None else x.dtype
    if not (result_dtype.is_floating_point or result_dtype.is_complex):
        raise RuntimeError(
            f"mean(): could not infer output dtype. Input dtype must be either a floating point or "
            f"complex dtype. Got: {str(result_dtype).replace('torch.', '').capitalize()}"
        )
    ndims = norm_dims(dims, x.dim())
    if dims is None:
        s = aten.sum.default(x, dtype=dtype)
    else:
        s = aten.sum.dim_IntList(x, dims, keepdim, dtype=dtype)
    return aten.div.Scalar(s, _count(x.shape, ndims))
