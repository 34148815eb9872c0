"""Losses: mse, smooth_l1, huber, binary_cross_entropy_with_logits, nll_loss (cross_entropy's
second half; the first is ``_log_softmax`` in norm.py), with their backward ops.

Handlers, because ``reduction='mean'`` divides by the GLOBAL element count: a local mean on each
shard would be wrong (uneven shards) or off by the number of ranks (its backward).  Each is written
as a few DTensor ops whose rules are all exact (sub, mul, sum -> Partial, div by a scalar), so
every placement works (uneven shards included) and the planner moves what has to move.
(``l1_loss`` decomposes into sub/abs/mean before it reaches dtshard; the backward of
``binary_cross_entropy_with_logits`` is a composite of pointwise ops.)

``nll_loss`` picks ``input[i, target[i]]`` without gathering a class-sharded input: a one-hot mask
``target[:, None] == classes`` is built against the class ids laid out like the input's class dim,
so each rank keeps only the entries of its own classes and the sum over the class dim is a
Partial(sum) with exactly one nonzero term per row.

``loss_parallel_log_softmax`` and ``loss_parallel_log_softmax_backward`` are NOT registered here:
``dtshard.parallel.loss_parallel()`` swaps them in for ``_log_softmax`` and its backward (normally
planned by norm.py's rule, which would move the logits to shard another dim): over a sharded class
dim they all-reduce only the row maxima and the row sums of exponentials.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard.handlers import make_spec, mixed_error, to_local, wrap
from dtshard.registry import register_handler
from dtshard.rules._common import norm_dim
from dtshard.distribute import distribute_tensor
from dtshard.tensor import DTensor

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


# ---------------------------------------------------------------------------------------------
# smooth_l1 / huber: elementwise formulas of the CPU kernels, then the reduction
# ---------------------------------------------------------------------------------------------


def _reduce(loss, reduction: int):
    if reduction == _NONE:
        return loss
    total = aten.sum.default(loss)
    return total if reduction == _SUM else aten.div.Scalar(total, loss.numel() or float("nan"))


def _arg(args, kwargs, index: int, name: str, default):
    return args[index] if len(args) > index else kwargs.get(name, default)


@register_handler(aten.smooth_l1_loss.default)
def smooth_l1_loss_handler(op, args, kwargs):
    x, y = args[0], args[1]
    reduction = _reduction(args, kwargs, 2)
    beta = _arg(args, kwargs, 3, "beta", 1.0)
    z = aten.abs.default(aten.sub.Tensor(x, y))
    if beta == 0:  # aten: plain l1
        return _reduce(z, reduction)
    quad = aten.div.Scalar(aten.mul.Tensor(aten.mul.Scalar(z, 0.5), z), beta)
    lin = aten.sub.Scalar(z, 0.5 * beta)
    return _reduce(aten.where.self(aten.lt.Scalar(z, beta), quad, lin), reduction)


@register_handler(aten.smooth_l1_loss_backward.default)
def smooth_l1_loss_backward_handler(op, args, kwargs):
    grad, x, y = args[0], args[1], args[2]
    reduction = _reduction(args, kwargs, 3)
    beta = _arg(args, kwargs, 4, "beta", 1.0)
    norm = 1.0 / x.numel() if reduction == _MEAN and x.numel() else 1.0
    d = aten.sub.Tensor(x, y)
    g = aten.mul.Scalar(grad, norm)
    inner = aten.div.Scalar(aten.mul.Tensor(aten.mul.Scalar(d, norm), grad), beta) if beta else aten.mul.Scalar(d, 0.0)
    out = aten.where.self(aten.ge.Scalar(d, beta), g, inner)  # g broadcasts ('mean'/'sum': 0-d)
    return aten.where.self(aten.le.Scalar(d, -beta), aten.neg.default(g), out)


@register_handler(aten.huber_loss.default)
def huber_loss_handler(op, args, kwargs):
    x, y = args[0], args[1]
    reduction = _reduction(args, kwargs, 2)
    delta = _arg(args, kwargs, 3, "delta", 1.0)
    z = aten.abs.default(aten.sub.Tensor(x, y))
    quad = aten.mul.Tensor(aten.mul.Scalar(z, 0.5), z)
    lin = aten.mul.Scalar(aten.sub.Scalar(z, 0.5 * delta), delta)
    return _reduce(aten.where.self(aten.lt.Scalar(z, delta), quad, lin), reduction)


@register_handler(aten.huber_loss_backward.default)
def huber_loss_backward_handler(op, args, kwargs):
    grad, x, y = args[0], args[1], args[2]
    reduction = _reduction(args, kwargs, 3)
    delta = _arg(args, kwargs, 4, "delta", 1.0)
    norm = 1.0 / x.numel() if reduction == _MEAN and x.numel() else 1.0
    d = aten.sub.Tensor(x, y)
    g = aten.mul.Scalar(aten.mul.Scalar(grad, norm), delta)
    inner = aten.mul.Tensor(aten.mul.Scalar(d, norm), grad)
    out = aten.where.self(aten.ge.Scalar(d, delta), g, inner)  # g broadcasts ('mean'/'sum': 0-d)
    return aten.where.self(aten.le.Scalar(d, -delta), aten.neg.default(g), out)


# ---------------------------------------------------------------------------------------------
# binary_cross_entropy_with_logits (its backward is a composite of pointwise ops)
# ---------------------------------------------------------------------------------------------


@register_handler(aten.binary_cross_entropy_with_logits.default)
def bce_with_logits_handler(op, args, kwargs):
    x, y = args[0], args[1]
    weight = _arg(args, kwargs, 2, "weight", None)
    pos_weight = _arg(args, kwargs, 3, "pos_weight", None)
    reduction = _arg(args, kwargs, 4, "reduction", _MEAN)
    # log_sigmoid(x) = min(x, 0) - log1p(exp(-|x|)), as aten's kernel computes it
    log_sig = aten.sub.Tensor(aten.clamp_max.default(x, 0),
                              aten.log1p.default(aten.exp.default(aten.neg.default(aten.abs.default(x)))))
    if pos_weight is not None:
        log_weight = aten.add.Scalar(aten.mul.Tensor(aten.sub.Scalar(pos_weight, 1), y), 1)
        log_sig = aten.mul.Tensor(log_sig, log_weight)
    loss = aten.sub.Tensor(aten.mul.Tensor(aten.rsub.Scalar(y, 1), x), log_sig)
    if weight is not None:
        loss = aten.mul.Tensor(loss, weight)
    return _reduce(loss, reduction)


# ---------------------------------------------------------------------------------------------
# nll_loss / nll_loss2d: masked pick over a possibly class-sharded input
# ---------------------------------------------------------------------------------------------

#: > 0 inside dtshard.parallel.loss_parallel(): plain target/weight tensors are then accepted and
#: laid out as PyTorch's loss_parallel does (outside it, mixing raises as for any other op)
_loss_parallel_depth = [0]


def _dtensor_cls():
    return DTensor


def _target_placements(x, cdim: int):
    """PyTorch loss_parallel's layout of a plain target: x's placements with the class dim's
    shards replicated and higher shard dims shifted down."""
    out = []
    for p in x.placements:
        if isinstance(p, Shard):
            out.append(Replicate() if p.dim == cdim else Shard(p.dim - 1) if p.dim > cdim else p)
        else:  # Replicate, or Partial (the terms of a Partial input share the whole target)
            out.append(Replicate())
    return tuple(out)


def _as_input(op, t, x, placements, what: str):
    DTensor = _dtensor_cls()
    if t is None or isinstance(t, DTensor):
        return t
    if isinstance(t, torch.Tensor) and t.dim() == 0:
        return distribute_tensor(t, x.device_mesh, [Replicate()] * x.device_mesh.ndim, src_data_rank=None)
    if isinstance(t, torch.Tensor) and _loss_parallel_depth[0] > 0:
        if any(isinstance(p, Shard) for p in placements):
            raise ValueError(
                f"loss_parallel(): {op} needs the {what} as a DTensor (not a plain torch.Tensor) when "
                f"the input {tuple(x.shape)} {x.placements} is also sharded on a non-class dim: wrap "
                f"it with DTensor.from_local or distribute_tensor to make its layout explicit.")

        # every rank holds the same full tensor (as PyTorch's loss_parallel assumes): no communication
        return distribute_tensor(t.detach(), x.device_mesh, placements, src_data_rank=None)
    raise mixed_error(op, t)


def _class_ids(x, cdim: int):
    """arange(C) as a DTensor laid out like x's class dim (Shard(0) where x shards it, else R)."""
    C = x.shape[cdim]
    placements = [Shard(0) if isinstance(p, Shard) and p.dim == cdim else Replicate() for p in x.placements]
    return distribute_tensor(torch.arange(C, dtype=torch.int64), x.device_mesh, placements, src_data_rank=None)


def _nll_parts(op, x, target, weight, ignore_index: int, check: bool):
    """(one-hot mask of the non-ignored targets, valid-target mask, class weights viewed to
    broadcast over the class dim (or None), the class dim, the target as a DTensor)."""
    cdim = 1 if x.dim() >= 2 else 0
    C = x.shape[cdim]
    target = _as_input(op, target, x, _target_placements(x, cdim), "target")
    weight = _as_input(op, weight, x, (Replicate(),) * x.device_mesh.ndim, "weight")
    if target.dtype not in (torch.int64, torch.int32, torch.uint8, torch.int16, torch.int8):
        raise RuntimeError(f"{op}: expected target of an integer dtype (class indices), got {target.dtype}")
    valid = aten.ne.Scalar(target, ignore_index)
    # the bounds check reads values (.item()): not while torch.compile traces, where they are unknown
    if check and target.numel() and not torch.compiler.is_compiling():
        safe = aten.where.self(valid, target, torch.zeros((), dtype=target.dtype))
        lo = aten._local_scalar_dense.default(aten.amin.default(safe))
        hi = aten._local_scalar_dense.default(aten.amax.default(safe))
        if lo < 0 or hi >= C:
            raise IndexError(f"{op}: Target {lo if lo < 0 else hi} is out of bounds (classes 0..{C - 1}).")
    tail = (1,) * (x.dim() - cdim - 1)
    cls = _class_ids(x, cdim)
    if tail:
        cls = aten.view.default(cls, [C, *tail])
    t = aten.unsqueeze.default(target, cdim) if x.dim() >= 2 else target
    v = aten.unsqueeze.default(valid, cdim) if x.dim() >= 2 else valid
    onehot = aten.logical_and.default(aten.eq.Tensor(t, cls), v)
    w = None
    if weight is not None:
        w = aten.view.default(weight, [C, *tail]) if tail else weight
    return onehot, valid, w, cdim, target


def _zero(dtype):
    return torch.zeros((), dtype=dtype)


@register_handler([aten.nll_loss_forward.default, aten.nll_loss2d_forward.default])
def nll_loss_forward_handler(op, args, kwargs):
    names = ("self", "target", "weight", "reduction", "ignore_index")
    x, target, weight, reduction, ignore_index = list(args) + [kwargs[n] for n in names[len(args):]]
    if not isinstance(x, _dtensor_cls()):  # a DTensor target/weight with a plain input
        raise mixed_error(op, x)
    onehot, valid, w, cdim, target = _nll_parts(op, x, target, weight, ignore_index, check=True)
    xw = aten.mul.Tensor(x, w) if w is not None else x
    picked = aten.sum.dim_IntList(aten.where.self(onehot, xw, _zero(x.dtype)), [cdim])
    loss = aten.neg.default(picked)
    if w is not None:
        wt = aten.sum.dim_IntList(aten.where.self(onehot, w, _zero(x.dtype)), [cdim])
        total = aten.sum.default(wt)
    else:
        total = aten.sum.default(valid, dtype=x.dtype)
    if reduction == _NONE:
        if x.dim() >= 2:
            total = aten.mul.Scalar(total, 0)  # aten returns 0 for 'none' (kept as a DTensor)
        return loss, total
    out = aten.sum.default(loss)
    if reduction == _MEAN:
        out = aten.div.Tensor(out, total)
    return out, total


@register_handler([aten.nll_loss_backward.default, aten.nll_loss2d_backward.default])
def nll_loss_backward_handler(op, args, kwargs):
    names = ("grad_output", "self", "target", "weight", "reduction", "ignore_index", "total_weight")
    grad, x, target, weight, reduction, ignore_index, total = list(args) + [kwargs[n] for n in names[len(args):]]
    onehot, _, w, cdim, _ = _nll_parts(op, x, target, weight, ignore_index, check=False)
    g = grad
    if reduction == _MEAN:
        g = aten.div.Tensor(g, total)
    elif reduction == _NONE and x.dim() >= 2:
        g = aten.unsqueeze.default(g, cdim)
    coef = aten.neg.default(g)
    if w is not None:
        coef = aten.mul.Tensor(coef, w)
    # coef broadcasts (a scalar, or (N, 1, ...) for 'none'): it follows the one-hot mask's layout
    return aten.where.self(onehot, coef, _zero(x.dtype))


# ---------------------------------------------------------------------------------------------
# loss_parallel: _log_softmax over a sharded class dim (swapped in by dtshard.parallel)
# ---------------------------------------------------------------------------------------------


def _dim_is_sharded(x, dim: int) -> bool:
    return any(isinstance(p, Shard) and p.dim == dim for p in x.placements)


def loss_parallel_log_softmax(op, args, kwargs):
    """``_log_softmax(x, dim, half_to_float)``: x - max - log(sum(exp(x - max))) as DTensor ops:
    over a sharded ``dim`` the max and the sum of exponentials are Partial and all-reduced (one
    value per row each); the logits themselves never move."""
    x = args[0]
    dim = norm_dim(_arg(args, kwargs, 1, "dim", -1), x.dim())
    half_to_float = _arg(args, kwargs, 2, "half_to_float", False)
    if not _dim_is_sharded(x, dim):  # nothing to gain: the fused kernel on each shard
        ins = tuple(Replicate() if isinstance(p, Partial) else p for p in x.placements)
        local = aten._log_softmax.default(to_local(x, ins, op), dim, half_to_float)
        return wrap(local, make_spec(x.device_mesh, ins, x.shape, local.dtype))
    out_dtype = torch.float32 if half_to_float else x.dtype
    if x.dtype in _LOW_PRECISION:  # computed in float32, as aten's kernel accumulates
        x = aten._to_copy.default(x, dtype=torch.float32)
    xmax = _reduced(aten.amax.default(x, [dim], True))  # one all_reduce(max) of a value per row
    shifted = aten.sub.Tensor(x, xmax)
    sumexp = _reduced(aten.sum.dim_IntList(aten.exp.default(shifted), [dim], True))  # all_reduce(sum)
    out = aten.sub.Tensor(shifted, aten.log.default(sumexp))
    return out if out.dtype == out_dtype else aten._to_copy.default(out, dtype=out_dtype)


_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _reduced(t):
    """``t`` with its Partial mesh dims reduced to Replicate (an all_reduce each), shards kept."""
    if not any(isinstance(p, Partial) for p in t.placements):
        return t
    return t.redistribute(t.device_mesh, [Replicate() if isinstance(p, Partial) else p for p in t.placements])


def loss_parallel_log_softmax_backward(op, args, kwargs):
    """``_log_softmax_backward_data(grad, out, dim, input_dtype)`` = grad - exp(out) * sum(grad, dim):
    over a sharded ``dim`` only the row sums are all-reduced."""
    names = ("grad_output", "output", "dim", "input_dtype")
    grad, out, dim, input_dtype = list(args) + [kwargs[n] for n in names[len(args):]]
    dim = norm_dim(dim, out.dim())
    if not _dim_is_sharded(out, dim) and not _dim_is_sharded(grad, dim):  # the fused kernel per shard
        ins = tuple(p if isinstance(p, Shard) else Replicate() for p in out.placements)
        local = aten._log_softmax_backward_data.default(to_local(grad, ins, op), to_local(out, ins, op),
                                                        dim, input_dtype)
        return wrap(local, make_spec(out.device_mesh, ins, out.shape, local.dtype))
    if grad.dtype in _LOW_PRECISION or out.dtype in _LOW_PRECISION:
        grad = aten._to_copy.default(grad, dtype=torch.float32)
        out = aten._to_copy.default(out, dtype=torch.float32)
    s = _reduced(aten.sum.dim_IntList(grad, [dim], True))
    res = aten.sub.Tensor(grad, aten.mul.Tensor(aten.exp.default(out), s))
    return aten._to_copy.default(res, dtype=input_dtype) if res.dtype != input_dtype else res
