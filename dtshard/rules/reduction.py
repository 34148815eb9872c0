"""Reductions: sum and mean (whole tensor and per dim, keepdim), amax/amin, max/min.

Reducing a sharded dim gives a Partial output (sum -> Partial(sum), amax -> Partial(max)); other
dims keep their shard, renumbered when the reduced dims are dropped.  ``mean`` is a handler: it
runs ``sum`` and divides by the GLOBAL count, which stays exact for uneven shards (a local mean of
unequal chunks averaged over ranks would be wrong).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard.registry import OpCall, register_handler, register_rule
from dtshard.rules._common import LINEAR_REDUCE_OPS, contiguous_strides, norm_dim, norm_dims
from dtshard.spec import TensorMeta
from dtshard.tensor import DTensor

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


def _sum_dtype(x: TensorMeta, dtype):
    if dtype is not None:
        return dtype
    return torch.int64 if (x.dtype == torch.bool or not (x.dtype.is_floating_point or x.dtype.is_complex)) else x.dtype


def _sum_meta(call: OpCall):
    """sum / sum.dim_IntList without a meta-kernel run: the reduced shape (dims dropped or kept as
    1), contiguous, int64 for bool/integer inputs unless ``dtype`` says otherwise.  Declines 0-d
    inputs (their dim rules are special) and plain-tensor arguments."""
    x = call.arg(0, "self")
    if not isinstance(x, TensorMeta) or x.ndim == 0:
        return None
    if call.op is aten.sum.default:
        dims, keepdim, dtype = None, False, call.arg(1, "dtype")
    else:
        dims, keepdim, dtype = call.arg(1, "dim"), bool(call.arg(2, "keepdim", False)), call.arg(3, "dtype")
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        reduced = set(range(x.ndim))
    else:
        reduced = set()
        for d in (dims if isinstance(dims, (list, tuple)) else [dims]):
            if type(d) is not int or not -x.ndim <= d < x.ndim:
                raise IndexError(f"{call.op}: dim {d!r} out of range for a {x.ndim}-D tensor")
            if d % x.ndim in reduced:
                raise RuntimeError(f"{call.op}: dim {d % x.ndim} appears multiple times in the list of dims")
            reduced.add(d % x.ndim)
    shape = tuple((1 if keepdim else None) if k in reduced else n for k, n in enumerate(x.shape))
    shape = tuple(n for n in shape if n is not None)
    return [TensorMeta(shape, contiguous_strides(shape), _sum_dtype(x, dtype))]


@register_rule(aten.sum.default, meta=_sum_meta)
def sum_rule(call: OpCall):
    x = call.tensors[0]
    return reduction_strategies(x, list(range(x.ndim)), False, "sum", linear=True)


@register_rule(aten.sum.dim_IntList, meta=_sum_meta)
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


@register_rule(aten.histc.default)
def histc_rule(call: OpCall):
    """Counts in ``bins`` equal bins over ``[min, max]``.  With a given range (min != max) each
    shard counts its own elements in the same bins, so the counts are a Partial sum.  With
    ``min == max`` (the default) the range is the data's own min and max, which no shard knows:
    replicated only."""
    x = call.tensors[0]
    if call.arg(2, "min", 0) == call.arg(3, "max", 0):
        return []
    return [((Partial("sum"),), (Shard(d),)) for d in range(x.ndim)]


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
        if d < len(shape):  # a 0-d tensor "reduces" over dim 0 / -1: one element
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


# ---------------------------------------------------------------------------------------------
# more reductions: prod, arg/indexed reductions, any/all, count_nonzero, nansum, aminmax, scans
# ---------------------------------------------------------------------------------------------


def _dims_arg(call: OpCall, x, index: int = 1, name: str = "dim"):
    return norm_dims(call.arg(index, name), x.ndim)


def _keep_only(x, dims, keepdim: bool, n_out: int = 1):
    """Strategies that shard only dims NOT reduced (the reduced ones must be whole on a rank)."""
    strategies = []
    for d in range(x.ndim):
        if d not in dims:
            out_d = d if keepdim else d - sum(1 for r in dims if r < d)
            strategies.append(((Shard(out_d),) * n_out, (Shard(d),)))
    return strategies


# A product over a sharded dim is the product of the ranks' partial products: Partial("product")
# (an empty shard's product is 1, the neutral term).  The product of a Partial("product") input
# is one too (the terms' products multiply up).  Only "product": a product of partial sums, maxima
# or averages is not a partial term of anything.
_PRODUCT = Partial("product")


@register_rule(aten.prod.default)
def prod_rule(call: OpCall):
    x = call.tensors[0]
    return [((_PRODUCT,), (Shard(d),)) for d in range(x.ndim)] + [((_PRODUCT,), (_PRODUCT,))]


@register_rule(aten.prod.dim_int)
def prod_dim_rule(call: OpCall):
    x = call.tensors[0]
    dims = _dims_arg(call, x)
    strategies = _keep_only(x, dims, bool(call.arg(2, "keepdim", False)))
    strategies += [((_PRODUCT,), (Shard(d),)) for d in dims if d < x.ndim]
    return strategies + [((_PRODUCT,), (_PRODUCT,))]


@register_rule([aten.argmax.default, aten.argmin.default])
def argmax_rule(call: OpCall):
    # indices are global: the reduced dim must be whole; dim=None reduces the flattened tensor
    x = call.tensors[0]
    dim = call.arg(1, "dim")
    if dim is None:
        return []
    return _keep_only(x, [norm_dim(dim, x.ndim)], bool(call.arg(2, "keepdim", False)))


@register_rule([aten.any.default, aten.all.default])
def any_all_rule(call: OpCall):
    return []


@register_rule([aten.any.dim, aten.all.dim, aten.any.dims, aten.all.dims])
def any_all_dim_rule(call: OpCall):
    x = call.tensors[0]
    dim = call.arg(1, "dim")
    if dim is None:
        return []
    return _keep_only(x, norm_dims(dim, x.ndim), bool(call.arg(2, "keepdim", False)))


def _no_partial_input(strategies):
    return [s for s in strategies if not any(isinstance(p, Partial) for p in s[1])]


@register_rule([aten.count_nonzero.default, aten.count_nonzero.dim_IntList])
def count_nonzero_rule(call: OpCall):
    # a count over a sharded dim is the sum of the local counts (not linear in Partial terms)
    x = call.tensors[0]
    dims = norm_dims(call.arg(1, "dim"), x.ndim)
    return _no_partial_input(reduction_strategies(x, dims, False, "sum", linear=False))


@register_rule(aten.nansum.default)
def nansum_rule(call: OpCall):
    # nansum over shards adds up; NOT linear in Partial terms (a NaN term would be dropped)
    x = call.tensors[0]
    dims = norm_dims(call.arg(1, "dim"), x.ndim)
    keepdim = bool(call.arg(2, "keepdim", False))
    return _no_partial_input(reduction_strategies(x, dims, keepdim, "sum", linear=False))


@register_rule(aten.aminmax.default)
def aminmax_rule(call: OpCall):
    x = call.tensors[0]
    dim = call.arg(1, "dim")
    keepdim = bool(call.arg(2, "keepdim", False))
    dims = list(range(x.ndim)) if dim is None else [norm_dim(dim, x.ndim)]
    if dim is None:
        keepdim = False
    strategies = []
    for d in range(x.ndim):
        if d in dims:
            strategies.append(((Partial("min"), Partial("max")), (Shard(d),)))
        else:
            out_d = d if keepdim else d - sum(1 for r in dims if r < d)
            strategies.append(((Shard(out_d), Shard(out_d)), (Shard(d),)))
    return strategies


def _dim_indexed_rule(dim_index: int, keepdim_index: int | None, n_out: int, default_dim=-1):
    """(values, indices)-style ops along one dim (sort, topk, kthvalue, mode, median.dim, cummax):
    every other dim may stay sharded."""

    def rule(call: OpCall):
        x = call.tensors[0]
        if x.ndim == 0:
            return []
        dim = norm_dim(call.arg(dim_index, "dim", default_dim), x.ndim)
        keepdim = True if keepdim_index is None else bool(call.arg(keepdim_index, "keepdim", False))
        return _keep_only(x, [dim], keepdim, n_out)

    return rule


register_rule(aten.sort.default)(_dim_indexed_rule(1, None, 2))
register_rule(aten.topk.default)(_dim_indexed_rule(2, None, 2))
register_rule(aten.kthvalue.default)(_dim_indexed_rule(2, 3, 2))
register_rule(aten.mode.default)(_dim_indexed_rule(1, 2, 2))
register_rule([aten.median.dim, aten.nanmedian.dim])(_dim_indexed_rule(1, 2, 2))
register_rule([aten.cummax.default, aten.cummin.default])(_dim_indexed_rule(1, None, 2))
register_rule([aten._logcumsumexp.default, aten.logcumsumexp.default])(_dim_indexed_rule(1, None, 1))
register_rule(aten.cumprod.default)(_dim_indexed_rule(1, None, 1))


@register_rule(aten.sort.stable)
def sort_stable_rule(call: OpCall):
    x = call.tensors[0]
    if x.ndim == 0:
        return []
    return _keep_only(x, [norm_dim(call.kwargs.get("dim", -1), x.ndim)], True, 2)


@register_rule([aten.median.default, aten.nanmedian.default])
def median_all_rule(call: OpCall):
    return []


@register_rule(aten.cumsum.default)
def cumsum_rule(call: OpCall):
    x = call.tensors[0]
    if x.ndim == 0:
        return [((Partial(op),), (Partial(op),)) for op in LINEAR_REDUCE_OPS]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    # any dim but the scanned one may stay sharded
    strategies = [((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]
    # cumsum is linear: the cumsum of partial terms is a partial term of the cumsum
    if call.arg(2, "dtype") is None or call.arg(2, "dtype") == x.dtype:
        strategies += [((Partial(op),), (Partial(op),)) for op in LINEAR_REDUCE_OPS]
    return strategies


# ---------------------------------------------------------------------------------------------
# handlers whose math needs the global reduction: var/std (+_mean), vector norms, logsumexp
# ---------------------------------------------------------------------------------------------


def _needs_global(x, dims) -> bool:
    """Does reducing ``dims`` of DTensor ``x`` need communication (a reduced dim is sharded, or the
    value is Partial)?"""
    for p in x.placements:
        if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim in dims):
            return True
    return False


def _local_reduction(op, x, dims, keepdim, args, kwargs):
    """Run a reduction whose reduced dims are whole on every rank on the local shard; the other
    dims keep their shards (renumbered when the reduced dims are dropped)."""
    mesh = x.device_mesh
    gout = op(torch.empty(tuple(x.shape), dtype=x.dtype, device="meta"), *args[1:], **kwargs)
    lout = op(x.to_local(), *args[1:], **kwargs)
    placements = []
    for p in x.placements:
        if isinstance(p, Shard):
            placements.append(Shard(p.dim if keepdim else p.dim - sum(1 for r in dims if r < p.dim)))
        else:
            placements.append(p)

    def wrap(lo, go):
        return DTensor.from_local(lo, mesh, placements, shape=tuple(go.shape), stride=tuple(go.stride()))

    if isinstance(lout, (tuple, list)):
        return type(lout)(wrap(lo, go) for lo, go in zip(lout, gout))
    return wrap(lout, gout)


def _var_parts(x, dims, correction, keepdim):
    """(var, mean) with the global two-pass formula: mean = sum / N; var = sum((x - mean)^2) /
    max(0, N - correction).  Exact for uneven shards (every sum is a global sum)."""
    n = _count(x.shape, dims)
    mean_k = aten.div.Scalar(aten.sum.dim_IntList(x, dims, True), n if n else float("nan"))
    centered = aten.sub.Tensor(x, mean_k)
    ss = aten.sum.dim_IntList(aten.mul.Tensor(centered, centered), dims, keepdim)
    var = aten.div.Scalar(ss, max(0, n - correction))
    mean = mean_k if keepdim else aten.squeeze.dims(mean_k, dims)
    return var, mean


def _var_args(op, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    correction = kwargs.get("correction", args[2] if len(args) > 2 else None)
    keepdim = kwargs.get("keepdim", args[3] if len(args) > 3 else False)
    if correction is None:
        correction = 1
    return x, dim, correction, bool(keepdim)


def _local_if_possible(op, x, dims, keepdim, args, kwargs):
    """(result, x): the reduction done shard-locally when no reduced dim is sharded (result is
    then not None); a 0-d Partial input is made whole first."""
    if x.ndim == 0 and _needs_global(x, dims):  # a 0-d Partial: make it whole first
        x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
        args = (x,) + tuple(args[1:])
    if not _needs_global(x, dims):
        return _local_reduction(op, x, dims, keepdim, args, kwargs), x
    return None, x


@register_handler([aten.var.correction, aten.std.correction, aten.var_mean.correction, aten.std_mean.correction])
def var_std_handler(op, args, kwargs):
    x, dim, correction, keepdim = _var_args(op, args, kwargs)
    dims = norm_dims(dim, x.ndim)
    done, x = _local_if_possible(op, x, dims, keepdim, args, kwargs)
    if done is not None:
        return done
    with torch.no_grad():
        var, mean = _var_parts(x, dims, correction, keepdim)
        packet = op._overloadpacket
        if packet in (aten.std, aten.std_mean):
            var = aten.sqrt.default(var)
        if packet in (aten.var_mean, aten.std_mean):
            return var, mean
        return var


@register_handler(aten.linalg_vector_norm.default)
def vector_norm_handler(op, args, kwargs):
    x = args[0]
    ord_ = args[1] if len(args) > 1 else kwargs.get("ord", 2)
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = bool(args[3] if len(args) > 3 else kwargs.get("keepdim", False))
    dtype = kwargs.get("dtype")
    dims = norm_dims(dim, x.ndim)
    done, x = _local_if_possible(op, x, dims, keepdim, args, kwargs)
    if done is not None:
        return done
    with torch.no_grad():
        if dtype is not None and dtype != x.dtype:
            x = aten._to_copy.default(x, dtype=dtype)
        a = aten.abs.default(x)
        ord_ = float(ord_)
        if ord_ == math.inf:
            return aten.amax.default(a, dims, keepdim)
        if ord_ == -math.inf:
            return aten.amin.default(a, dims, keepdim)
        if ord_ == 0:
            return aten.sum.dim_IntList(aten._to_copy.default(aten.ne.Scalar(a, 0), dtype=a.dtype), dims, keepdim)
        if ord_ == 1:
            return aten.sum.dim_IntList(a, dims, keepdim)
        if ord_ == 2:
            return aten.sqrt.default(aten.sum.dim_IntList(aten.mul.Tensor(a, a), dims, keepdim))
        s = aten.sum.dim_IntList(aten.pow.Tensor_Scalar(a, ord_), dims, keepdim)
        return aten.pow.Tensor_Scalar(s, 1.0 / ord_)


@register_handler(aten.logsumexp.default)
def logsumexp_handler(op, args, kwargs):
    x = args[0]
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    keepdim = bool(args[2] if len(args) > 2 else kwargs.get("keepdim", False))
    dims = norm_dims(dim, x.ndim)
    if x.ndim == 0 or not _needs_global(x, dims) or not x.dtype.is_floating_point:
        if _needs_global(x, dims):
            x = x.redistribute(x.device_mesh, [Replicate()] * x.device_mesh.ndim)
        return _local_reduction(op, x, dims, keepdim, (x,) + tuple(args[1:]), kwargs)
    with torch.no_grad():
        m = aten.amax.default(x, dims, True)
        m = aten.where.self(aten.isinf.default(m), aten.zeros_like.default(m), m)
        s = aten.sum.dim_IntList(aten.exp.default(aten.sub.Tensor(x, m)), dims, True)
        out = aten.add.Tensor(aten.log.default(s), m)
        return out if keepdim else aten.squeeze.dims(out, dims)


@register_handler([aten.norm.ScalarOpt_dim, aten.norm.Scalar, aten.norm.ScalarOpt_dim_dtype, aten.norm.ScalarOpt_dtype])
def norm_handler(op, args, kwargs):
    """``torch.norm(x, p, dim, keepdim)``: the vector norm (same math as linalg_vector_norm)."""
    x = args[0]
    p = args[1] if len(args) > 1 else kwargs.get("p", 2)
    p = 2 if p is None else p
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    keepdim = bool(args[3] if len(args) > 3 else kwargs.get("keepdim", False))
    dtype = args[4] if len(args) > 4 else kwargs.get("dtype")
    if op is aten.norm.ScalarOpt_dtype:
        dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
        dim, keepdim = None, False
    kw = {"dtype": dtype} if dtype is not None else {}
    return vector_norm_handler(aten.linalg_vector_norm.default, (x, p, dim, keepdim), kw)


@register_handler(aten.dist.default)
def dist_handler(op, args, kwargs):
    """``torch.dist(a, b, p)`` = the p-norm of a - b (broadcast)."""
    a, b = args[0], args[1]
    p = args[2] if len(args) > 2 else kwargs.get("p", 2)
    return vector_norm_handler(aten.linalg_vector_norm.default, (aten.sub.Tensor(a, b), p, None, False), {})
