"""The dispatcher: unwrap -> plan (cached) -> redistribute inputs -> local op -> wrap.

The cache key is built from the op, every DTensor's spec and EVERY non-tensor argument, so a rule
author never has to declare which scalars matter.  A hit costs one walk over the arguments, one
dict lookup, the local call and the wrapping of the outputs.
"""

from __future__ import annotations

from typing import Any

import torch

from dtshard import _trace
from dtshard import registry
from dtshard.propagate import Plan, _Slot, propagate
from dtshard.redistribute import redistribute_local

__all__ = ["dispatch", "clear_cache", "cache_info", "MixedTensorError"]

_cache: dict[tuple, Plan] = {}
_stats = {"hits": 0, "misses": 0}


class MixedTensorError(RuntimeError):
    """A plain (non-scalar) torch.Tensor met a DTensor. Not a TypeError: Tensor.__add__ & co.
    turn TypeErrors into NotImplemented, which would hide this message."""

    pass


def clear_cache() -> None:
    """Forget every cached plan (the next call of each op re-runs propagation)."""
    _cache.clear()


registry._on_change.append(clear_cache)


def cache_info() -> dict:
    return {"size": len(_cache), **_stats}


def _mixed_error(op, t: torch.Tensor) -> MixedTensorError:
    return MixedTensorError(
        f"{op} got a plain torch.Tensor of shape {tuple(t.shape)} mixed with dtshard DTensors. "
        "Only Python scalars and 0-d tensors broadcast implicitly. Convert the tensor first: "
        "dtshard.distribute_tensor(t, mesh, [Replicate()]) if every rank holds the same full tensor, "
        "or dtshard.DTensor.from_local(t, mesh, placements) if it is this rank's shard."
    )


def _unwrap(op, a, dts: list, key: list, DT) -> Any:
    """Replace DTensors by _Slot markers (for propagation) while building the cache key."""
    if isinstance(a, DT):
        key.append(a._spec)
        dts.append(a)
        return _Slot(len(dts) - 1)
    if isinstance(a, torch.Tensor):
        if a.dim() != 0:
            raise _mixed_error(op, a)
        key.append(("0d", a.dtype, a.device))
        return a
    if isinstance(a, (list, tuple)):
        if any(isinstance(b, torch.Tensor) for b in a):
            key.append(len(a))
            return type(a)(_unwrap(op, b, dts, key, DT) for b in a)
        key.append(tuple(a))
        return a
    key.append(a)
    return a


def _local(a, locals_: list) -> Any:
    if isinstance(a, _Slot):
        return locals_[a.k]
    if isinstance(a, (list, tuple)) and a and any(isinstance(b, (_Slot, torch.Tensor)) for b in a):
        return type(a)(_local(b, locals_) for b in a)
    return a


def dispatch(op, args: tuple, kwargs: dict):
    """Run aten ``op`` on DTensor arguments (called from DTensor.__torch_dispatch__)."""
    from dtshard.tensor import DTensor

    entry = registry.get_entry(op)
    if entry is not None and entry.kind == "handler":
        return entry.fn(op, args, kwargs)

    dts: list = []
    key: list = [op]
    margs = [_unwrap(op, a, dts, key, DTensor) for a in args]
    mkwargs = {}
    for k, v in kwargs.items():
        key.append(k)
        mkwargs[k] = _unwrap(op, v, dts, key, DTensor)
    try:
        tkey = tuple(key)
        plan = _cache.get(tkey)
    except TypeError:  # an unhashable argument: plan without caching
        tkey, plan = None, None
    specs = [d._spec for d in dts]
    if plan is None:
        _stats["misses"] += 1
        plan = propagate(op, args, kwargs, specs, margs, mkwargs)
        if tkey is not None:
            _cache[tkey] = plan
    else:
        _stats["hits"] += 1
    if _trace.plan_observers:
        for obs in _trace.plan_observers:
            obs(str(op), plan, specs)

    # redistribute inputs (below autograd: the op's own backward formula handles gradients)
    prev_op = _trace.current_op[0]
    _trace.current_op[0] = str(op)
    try:
        locals_ = [
            d._local_tensor if t is None else redistribute_local(d._local_tensor, d._spec, t)
            for d, t in zip(dts, plan.input_targets)
        ]
    finally:
        _trace.current_op[0] = prev_op
    largs = [_local(a, locals_) for a in margs]
    for idx, shape in plan.shape_overrides:
        largs[idx] = list(shape)
    lkwargs = {k: _local(v, locals_) for k, v in mkwargs.items()}
    out = plan.local_op(*largs, **lkwargs)

    if plan.mode == "inplace":
        return args[0]
    if plan.mode == "out":
        out_names = [a.name for a in op._schema.arguments if a.is_out]
        res = tuple(kwargs[n] for n in out_names)
        return res[0] if len(res) == 1 else res
    return _wrap(out, iter(plan.out_specs), DTensor)


def _wrap(out, specs, DT):
    if isinstance(out, torch.Tensor):
        return DT(out, next(specs), requires_grad=False)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, specs, DT) for o in out)
    next(specs)  # None or non-tensor output
    return out
