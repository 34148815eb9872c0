"""Indexing: index_select, gather, scatter/scatter_add/scatter_reduce, index_add/copy/fill/reduce,
advanced indexing (``x[idx]``: index.Tensor) and index_put, take/put.

The local shape check cannot see VALUES, and index ops are where a plausible layout can read the
wrong rows: a dim may stay sharded only when the index and the data line up chunk for chunk.  So:

- the indexed dim itself is never sharded in the data (local positions would be offset);
- another dim ``d`` may be sharded in data, index and source alike only where they have the SAME
  size on ``d`` (same chunks); gather/scatter allow smaller index tensors, those replicate;
- the index may be sharded along the dims of the result it alone produces (``index_select``'s index,
  ``gather``'s index along ``dim``, ``x[idx]`` with a single index tensor) with the data replicated;
- Partial data passes through when the op is linear in it (a selection or a copy: every Partial;
  an accumulation: sum/avg; a fill with a constant: max/min).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from dtshard.registry import OpCall, register_rule
from dtshard.rules._common import R, broadcast_shape, follow_output, norm_dim
from dtshard.spec import TensorMeta

aten = torch.ops.aten
_ALL_P = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"))
_SUM_P = (Partial("sum"), Partial("avg"))
_MAXMIN_P = (Partial("max"), Partial("min"))


def _dim(call: OpCall, x, index=1):
    return norm_dim(call.arg(index, "dim"), max(x.ndim, 1))


def _n(call: OpCall) -> int:
    return len(call.tensors)


@register_rule(aten.index_select.default)
def index_select_rule(call: OpCall):
    x, idx = call.tensors[0], call.tensors[1] if _n(call) > 1 else None
    dim = _dim(call, x)
    rest = (R,) * (_n(call) - 1)
    strategies = [((Shard(d),), (Shard(d),) + rest) for d in range(x.ndim) if d != dim]
    if idx is not None and idx.ndim == 1 and x.ndim:
        strategies.append(((Shard(dim),), (R, Shard(0))))
    strategies += [((p,), (p,) + rest) for p in _ALL_P]
    return strategies


@register_rule(aten.gather.default)
def gather_rule(call: OpCall):
    x = call.tensors[0]
    idx = call.tensors[1] if _n(call) > 1 else None
    dim = _dim(call, x)
    strategies = []
    if idx is not None and idx.ndim == x.ndim and x.ndim:
        for d in range(x.ndim):
            if d != dim and x.shape[d] == idx.shape[d]:
                strategies.append(((Shard(d),), (Shard(d), Shard(d))))
        # the index alone along `dim`: out[i] = x[index[i]] reads the full (replicated) x
        strategies.append(((Shard(dim),), (R, Shard(dim))))
    rest = (R,) * (_n(call) - 1)
    strategies += [((p,), (p,) + rest) for p in _ALL_P]
    return strategies


def _scatter_like(call: OpCall, partials, src_index=3):
    """self, dim, index, src-like: dims other than `dim` where self, index and src have one size."""
    x = call.tensors[0]
    dim = _dim(call, x)
    strategies = []
    others = call.tensors[1:]
    for d in range(x.ndim):
        if d != dim and all(t.ndim == x.ndim and t.shape[d] == x.shape[d] for t in others):
            strategies.append(((Shard(d),), (Shard(d),) * len(call.tensors)))
    src_is_dt = isinstance(call.arg(src_index, "src"), TensorMeta)
    for p in partials:
        ins = [p] + [R] * len(others)
        if src_is_dt and others:
            ins[-1] = p  # linear in (self, src) jointly
        elif src_is_dt is False and p.reduce_op in ("sum", "avg") and call.op is not aten.index_fill.int_Scalar:
            continue
        strategies.append(((p,), tuple(ins)))
    return strategies


@register_rule(aten.scatter.src)
def scatter_src_rule(call: OpCall):
    return _scatter_like(call, _ALL_P)  # a copy: every Partial of (self, src) jointly


@register_rule(aten.scatter.value)
def scatter_value_rule(call: OpCall):
    return _scatter_like(call, _MAXMIN_P, src_index=99)  # a constant on every rank: max/min only


@register_rule(aten.scatter_add.default)
def scatter_add_rule(call: OpCall):
    return _scatter_like(call, _SUM_P)


@register_rule(aten.scatter_reduce.two)
def scatter_reduce_rule(call: OpCall):
    reduce = call.arg(4, "reduce")
    partials = {"sum": _SUM_P, "amax": (Partial("max"),), "amin": (Partial("min"),)}.get(reduce, ())
    return _scatter_like(call, partials)


@register_rule(aten.index_add.default)
def index_add_rule(call: OpCall):
    return _index_source_like(call, _SUM_P)


@register_rule(aten.index_copy.default)
def index_copy_rule(call: OpCall):
    return _index_source_like(call, _ALL_P)


@register_rule(aten.index_reduce.default)
def index_reduce_rule(call: OpCall):
    return _index_source_like(call, ())


def _index_source_like(call: OpCall, partials):
    """self, dim, index (1-D, replicated), source with self's size on every dim but `dim`."""
    x = call.tensors[0]
    dim = _dim(call, x)
    n = _n(call)
    has_index = n >= 2 and isinstance(call.arg(2, "index"), TensorMeta)
    src_dt = isinstance(call.arg(3, "source"), TensorMeta)
    strategies = []
    for d in range(x.ndim):
        if d == dim:
            continue
        ins = [Shard(d)]
        if has_index:
            ins.append(R)
        if src_dt:
            ins.append(Shard(d))
        strategies.append(((Shard(d),), tuple(ins)))
    if src_dt:
        for p in partials:
            ins = [p] + ([R] if has_index else []) + [p]
            strategies.append(((p,), tuple(ins)))
    return strategies


@register_rule([aten.index_fill.int_Scalar, aten.index_fill.int_Tensor])
def index_fill_rule(call: OpCall):
    x = call.tensors[0]
    dim = _dim(call, x)
    rest = (R,) * (_n(call) - 1)
    strategies = [((Shard(d),), (Shard(d),) + rest) for d in range(x.ndim) if d != dim]
    strategies += [((p,), (p,) + rest) for p in _MAXMIN_P]  # the fill value is on every rank
    return strategies


def _index_layout(x, indices):
    """For ``x[indices]`` (integer index tensors, None = ':'): the result position of each
    non-indexed dim of x, where the broadcast index dims start, and the broadcast index shape."""
    pos = [k for k, t in enumerate(indices) if t is not None]
    shapes = [t.shape for t in indices if t is not None]
    bshape = broadcast_shape(*shapes) if shapes else ()
    b = len(bshape)
    contiguous = pos == list(range(pos[0], pos[-1] + 1)) if pos else True
    mapping = {}
    if contiguous:
        start = pos[0] if pos else 0
        for d in range(x.ndim):
            if d in pos:
                continue
            mapping[d] = d if d < start else d - len(pos) + b
    else:
        start = 0
        rank = 0
        for d in range(x.ndim):
            if d in pos:
                continue
            mapping[d] = b + rank
            rank += 1
    return mapping, start, bshape, pos


def _int_indices(indices) -> bool:
    return all(t is None or (isinstance(t, TensorMeta) and t.dtype not in (torch.bool, torch.uint8)) for t in indices)


@register_rule([aten.index.Tensor, aten._unsafe_index.Tensor])
def index_rule(call: OpCall):
    x = call.tensors[0]
    indices = list(call.arg(1, "indices"))
    n_idx = _n(call) - 1
    rest = (R,) * n_idx
    strategies = [((p,), (p,) + rest) for p in _ALL_P]
    if not _int_indices(indices) or any(t is not None and not isinstance(t, TensorMeta) for t in indices):
        return strategies
    mapping, start, bshape, pos = _index_layout(x, indices)
    for d, o in mapping.items():
        strategies.append(((Shard(o),), (Shard(d),) + rest))
    dts = [t for t in indices if t is not None]
    if len(dts) == 1 and dts[0].ndim >= 1:
        for j in range(dts[0].ndim):
            strategies.append(((Shard(start + j),), (R, Shard(j))))
    return strategies


@register_rule(aten.index_put.default)
def index_put_rule(call: OpCall):
    x = call.tensors[0]
    indices = list(call.arg(1, "indices"))
    values = call.arg(2, "values")
    accumulate = bool(call.arg(3, "accumulate", False))
    n_idx = sum(1 for t in indices if isinstance(t, TensorMeta))
    values_dt = isinstance(values, TensorMeta)
    strategies = []
    if values_dt:
        for p in (_SUM_P if accumulate else _ALL_P):
            strategies.append(((p,), (p,) + (R,) * n_idx + (p,)))
    if not _int_indices(indices):
        return strategies
    mapping, start, bshape, pos = _index_layout(x, indices)
    # the shape x[indices] has, which `values` broadcasts to
    res = [None] * (x.ndim - len(pos) + len(bshape))
    for d, o in mapping.items():
        res[o] = x.shape[d]
    off = start
    for j, s in enumerate(bshape):
        res[off + j] = s
    for d, o in mapping.items():
        ins = (Shard(d),) + (R,) * n_idx
        if values_dt:
            ins += (follow_output(values, tuple(res), Shard(o)),)
        strategies.append(((Shard(d),), ins))
    return strategies


@register_rule([aten.take.default, aten.put.default])
def flat_index_rule(call: OpCall):
    return []  # indices into the flattened tensor: replicate
