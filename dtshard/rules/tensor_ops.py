"""Tensor plumbing: detach/alias/clone/_to_copy/copy, fills, *_like and new_* factories, item.

These keep whatever layout their input has (any Shard, and Partial where the value stays a valid
partial term: clone yes, ones_like no).  Factories that ignore the input's data (new_zeros, ...)
accept the input in ANY placement, so the cheapest plan never moves it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard.handlers import DTensor, planned, wrap
from dtshard.registry import OpCall, register_handler, register_rule
from dtshard.rules._common import R

aten = torch.ops.aten
_PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"))
#: also Partial("product"): for ops that keep every term's value (clone, copy, same-dtype _to_copy)
#: or make it zero (0 is a valid term of every reduction).  Not for dtype conversions: rounding
#: each factor is not rounding the product.
_ALL_PARTIALS = _PARTIALS + (Partial("product"),)


def _same_layout(x, partials=_ALL_PARTIALS, n_in: int = 1):
    strategies = [((Shard(d),), (Shard(d),) * n_in) for d in range(x.ndim)]
    strategies += [((p,), (p,) * n_in) for p in partials]
    return strategies


@register_rule([aten.detach.default, aten.alias.default, aten.clone.default, aten.lift_fresh.default,
                aten.alias_copy.default, aten.detach_copy.default, aten.lift_fresh_copy.default])
def identity_rule(call: OpCall):
    return _same_layout(call.tensors[0])


@register_rule(aten._to_copy.default)
def to_copy_rule(call: OpCall):
    x = call.tensors[0]
    dtype = call.kwargs.get("dtype")
    return _same_layout(x, partials=_conversion_partials(x.dtype, dtype))


def _conversion_partials(src_dtype, dtype) -> tuple:
    """The Partials that survive converting each term from ``src_dtype`` to ``dtype``.

    A dtype conversion commutes with a Partial reduction only sometimes: converting partial sums
    to an integer or bool type truncates each term (int(0.6) + int(0.6) != int(1.2)); max/min
    commute with monotone conversions (float <-> int truncation), not with bool."""
    if dtype is None or dtype == src_dtype:
        return _ALL_PARTIALS
    partials = []
    if dtype.is_floating_point or dtype.is_complex:
        if src_dtype.is_floating_point or src_dtype.is_complex:
            partials = list(_PARTIALS) if not dtype.is_complex or src_dtype.is_complex else [Partial("sum"), Partial("avg")]
            if dtype.itemsize < src_dtype.itemsize:  # narrowing: reduce the terms in the wider type first
                partials = [p for p in partials if p.reduce_op in ("max", "min")]
        else:  # int -> float: exact for the small integers a Partial(sum) of ints holds
            partials = list(_PARTIALS)
    elif dtype != torch.bool and not src_dtype.is_complex:
        partials = [Partial("max"), Partial("min")] if src_dtype.is_floating_point else list(_PARTIALS)
    return tuple(partials)


@register_rule(aten.copy.default)
def copy_rule(call: OpCall):
    # copy(self, src): src's values in self's shape (src broadcasts); in-place copy_ derives from it.
    # A Partial src gives a Partial result of the same op whatever the shapes (each term is
    # broadcast and converted on its own: the conversion must commute with the reduction), so
    # copy_ into a Partial self takes src as that Partial: a replicated src is then kept whole on
    # one rank (zeros, or ones for a product, on the others) or everywhere (avg, max, min).
    dst = call.tensors[0]
    if len(call.tensors) == 1:  # src is a plain 0-d tensor: the same value on every shard
        return [((Shard(d),), (Shard(d),)) for d in range(dst.ndim)]
    src = call.tensors[1]
    strategies = []
    for d in range(dst.ndim):
        sd = d - (dst.ndim - src.ndim)
        sp = Shard(sd) if sd >= 0 and src.shape[sd] == dst.shape[d] else R
        strategies.append(((Shard(d),), (Shard(d), sp)))
    strategies += [((p,), (p, p)) for p in _copy_partials(src.dtype, dst.dtype)]
    return strategies


def _copy_partials(src_dtype, dst_dtype) -> tuple:
    """Partials a (converting) copy keeps: those the conversion commutes with, and between two
    floating (or two complex) types also a narrowing one, which rounds each term instead of the
    reduced value (a rounding-level difference; ``.to()`` reduces first because it can, but an
    in-place copy_ into a Partial has no other plan).  Never a truncation to an integer."""
    partials = _conversion_partials(src_dtype, dst_dtype)
    if (src_dtype.is_floating_point and dst_dtype.is_floating_point) or (src_dtype.is_complex and dst_dtype.is_complex):
        partials = tuple(dict.fromkeys(partials + _PARTIALS))
    return partials


def _any_input_to_replicate(x):
    """(R out, p in) for every placement p: for results that never read the input's values."""
    inputs = [Shard(d) for d in range(x.ndim)] + [Replicate(), *_ALL_PARTIALS]
    return [((R,), (p,)) for p in inputs]


@register_rule([aten.zeros_like.default, aten.zero.default])
def zeros_like_rule(call: OpCall):
    # zeros are a valid partial term of zeros; keep the input's layout, or replicate
    return _same_layout(call.tensors[0]) + _any_input_to_replicate(call.tensors[0])


@register_rule([aten.ones_like.default, aten.empty_like.default, aten.full_like.default])
def filled_like_rule(call: OpCall):
    # one value everywhere: keep a shard layout, or produce Replicate whatever the input is
    # (a Partial(sum) of ones would sum to n)
    return _same_layout(call.tensors[0], partials=()) + _any_input_to_replicate(call.tensors[0])


@register_handler([aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default, aten.full_like.default],
                  before_rule=True)
def like_layout_handler(op, args, kwargs):
    """``*_like(x)`` keeps ``x``'s memory layout in its GLOBAL strides, as PyTorch's
    ``preserve_format`` does: the planner infers output metadata from the op on contiguous
    inputs, so a transposed ``x`` would give a contiguous spec over transposed shards.  It
    matters to what is drawn into the result: ``dropout`` decomposes into ``empty_like(x)``
    and ``bernoulli_``, whose draws follow the memory order (rules/random.py), so one process's
    mask is ``x``'s layout.  The placements are the rules' (the plain planned call)."""
    out = planned(op, args, kwargs)
    x = args[0]
    if (not isinstance(out, DTensor) or not isinstance(x, DTensor)
            or kwargs.get("memory_format") not in (None, torch.preserve_format)):
        return out
    spec = x._spec
    if spec.contiguous_meta.stride == spec.stride:
        return out  # the planner's metadata is PyTorch's already
    stride = _preserved_stride(spec.shape, spec.stride)
    if stride == out._spec.stride:
        return out
    return wrap(out._local_tensor, dataclasses.replace(out._spec, stride=stride))


@functools.lru_cache(maxsize=1024)
def _preserved_stride(shape: tuple, stride: tuple) -> tuple:
    """The strides of ``empty_like`` (``preserve_format``) of a tensor of ``shape`` and ``stride``."""
    return tuple(torch.empty_like(torch.empty_strided(shape, stride, device="meta")).stride())


@register_rule(aten.fill.Scalar)
def fill_rule(call: OpCall):
    # the value on every rank is a valid avg/max/min term of the value; a valid sum or product
    # term only on one rank (fill_ of those goes through fill_inplace_handler)
    return _same_layout(call.tensors[0], partials=(Partial("avg"), Partial("max"), Partial("min")))


def _summing(p) -> bool:
    return isinstance(p, Partial) and p.reduce_op in ("sum", "product")


@register_handler([aten.fill_.Scalar, aten.fill_.Tensor])
def fill_inplace_handler(op, args, kwargs):
    """``x.fill_(v)`` on a Partial(sum) or Partial(product) ``x``: every rank filling ``v`` would
    make the value ``n * v`` (``v ** n``), which is what PyTorch's DTensor gives.  Instead ``v``
    is copied in as a replicated tensor: ``copy_`` keeps it whole on one rank and zeros (ones) on
    the others, so ``x`` stays Partial and holds ``v`` exactly.  Other layouts: the plain plan."""
    self = args[0]
    value = args[1] if len(args) > 1 else kwargs["value"]
    if not any(_summing(p) for p in self._spec.placements):
        return planned(op, args, kwargs)  # the rules' path (handlers skipped)
    if isinstance(value, torch.Tensor) and type(value) is not torch.Tensor:
        return self.copy_(value)  # a DTensor value: copy_ plans it (0-d: it broadcasts)
    if isinstance(value, torch.Tensor):
        value = value.item()  # a plain 0-d tensor: the same number on every rank
    return self.copy_(self.new_full((), value))


@register_rule([aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default, aten.new_full.default,
                aten.new_empty_strided.default], shape_args={1: 0})
def new_factory_rule(call: OpCall):
    # A fresh tensor of the given size. Same size as the input: keep its shard layout (autograd's
    # gradient buffers rely on this); any size: Replicate, whatever the input's placement.
    x = call.tensors[0]
    strategies = _any_input_to_replicate(x)
    if tuple(call.arg(1, "size")) == tuple(x.shape):
        strategies += [((Shard(d),), (Shard(d),)) for d in range(x.ndim)]
        if call.op in (aten.new_empty.default, aten.new_empty_strided.default, aten.new_zeros.default):
            # uninitialised or zero values are valid partial terms
            strategies += [((p,), (p,)) for p in _ALL_PARTIALS]
    return strategies


@register_handler(aten._local_scalar_dense.default)
def item_handler(op, args, kwargs):
    """``tensor.item()``: the global value (reduces a Partial, gathers a shard of one element)."""
    x = args[0]
    return x.full_tensor().item() if hasattr(x, "full_tensor") else op(x)


@register_handler(aten.is_same_size.default)
def is_same_size_handler(op, args, kwargs):
    return tuple(args[0].shape) == tuple(args[1].shape)


def _is_legacy_empty(t) -> bool:
    return t.ndim == 1 and t.shape[0] == 0  # cat skips these


@register_rule(aten.cat.default)
def cat_rule(call: OpCall):
    ts = call.tensors
    ref = next((t for t in ts if not _is_legacy_empty(t)), ts[0])
    dim = call.arg(1, "dim", 0) % max(ref.ndim, 1)
    strategies = []
    for d in range(ref.ndim):
        if d != dim:
            strategies.append(((Shard(d),), tuple(R if _is_legacy_empty(t) else Shard(d) for t in ts)))
    # every input but one empty along the cat dim (a KV cache's first update: cat(empty, k)): the
    # result is that input, so its shards on the cat dim are the result's
    full = [i for i, t in enumerate(ts) if not _is_legacy_empty(t) and t.shape[dim] > 0]
    if len(full) == 1 and ref.ndim:
        strategies.append(((Shard(dim),), tuple(Shard(dim) if i == full[0] else R for i in range(len(ts)))))
    # joining pieces is elementwise: terms of any one reduction stay terms of it
    strategies += [((p,), (p,) * len(ts)) for p in _PARTIALS]
    return strategies


@register_rule(aten.stack.default)
def stack_rule(call: OpCall):
    ts = call.tensors
    ndim = ts[0].ndim
    dim = call.arg(1, "dim", 0) % (ndim + 1)
    strategies = [((Shard(d if d < dim else d + 1),), (Shard(d),) * len(ts)) for d in range(ndim)]
    strategies += [((p,), (p,) * len(ts)) for p in _PARTIALS]
    return strategies
