"""The dispatcher's path for ops with a DTensor argument that carries a halo (see halo_layout.py).

An op that has no handler reaches :func:`dispatch_halo`.  It is planned as it would be without
the halos (the dispatcher's own plan, shared with its cache); then, when the op is one that can
compute on the halo rows and the plan keeps the sharded dims where they are, it runs on the
extended local tensors and its output carries a halo.  Otherwise every halo is dropped first
(replicated: a narrow; partial: the owners' sums) and the op runs as usual.  The decision is a
function of the specs and the op, cached per dispatch key, so every rank takes the same one.
"""

from __future__ import annotations

import torch

from dtshard import collectives as C
from dtshard import dispatch as D
from dtshard import hooks
from dtshard.spec import SpecToken
from dtshard.spatial import halo_layout as L
from dtshard.spatial.halo_layout import Halo, halo_partial, halos, with_halo
from dtshard.propagate import propagate
from dtshard.registry import op_facts
from dtshard.tensor import DTensor

aten = torch.ops.aten

__all__ = ["dispatch_halo", "ADDITIVE", "LINEAR"]

#: sums: every input is a partial (or plain) shard of the same layout
ADDITIVE = {aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor}
#: op -> the arguments the result is linear in: one of them may be a partial halo, the others
#: must carry copies (a replicated halo at least as wide) or broadcast along the sharded dims
LINEAR = {op: (0,) for op in (
    aten.div.Tensor, aten.div_.Tensor, aten.mul.Scalar, aten.mul_.Scalar, aten.div.Scalar, aten.div_.Scalar,
    aten.neg.default, aten.threshold_backward.default, aten.silu_backward.default, aten.sigmoid_backward.default,
    aten.tanh_backward.default, aten.gelu_backward.default, aten.leaky_relu_backward.default,
    aten.hardtanh_backward.default, aten.elu_backward.default, aten.softplus_backward.default,
    aten.hardswish_backward.default, aten.hardsigmoid_backward.default, aten.mish_backward.default,
    aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default,
)}
LINEAR[aten.mul.Tensor] = (0, 1)
LINEAR[aten.mul_.Tensor] = (0, 1)
#: not tagged pointwise, but element for element (copies and views of the whole tensor)
_COPIES = {aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default}

_STRIP = "strip"
_SITE = "_dtshard_halo_site"  # spatial.conv_halo.SITE
_decisions: dict = {}


class _Keep:
    """A cached decision to run on the extended tensors."""

    __slots__ = ("plan", "out_spec", "actions", "inplace")

    def __init__(self, plan, out_spec, actions, inplace):
        self.plan, self.out_spec, self.actions, self.inplace = plan, out_spec, actions, inplace


D.handler_caches.append(_decisions)  # dispatch.clear_cache() clears the decisions too


def dispatch_halo(op, args: tuple, kwargs: dict):
    DT = DTensor
    for a in args:  # a halo that an in-place write left behind is dropped first
        if isinstance(a, DT) and halos(a._spec):
            L.fresh(a)
    try:
        dts, margs, mkwargs, key = D.unwrap_call(op, args, kwargs)
    except D.MixedTensorError:
        return stripped(op, args, kwargs)
    try:
        tkey = tuple(key)
        dec = _decisions.get(tkey)
    except TypeError:
        tkey, dec = None, None
    if dec is None:
        dec = _decide(op, args, kwargs, dts, margs, mkwargs, key)
        if tkey is not None:
            if len(_decisions) > 8192:
                _decisions.clear()
            _decisions[tkey] = dec
    if dec is _STRIP:
        return stripped(op, args, kwargs)
    coord = C.mesh_coordinate(dts[0]._spec.mesh)
    locals_ = []
    for d, (action, halo) in zip(dts, dec.actions):
        t = d._local_tensor
        if action == "narrow":
            t = L.narrow_local(t, d._spec, halo, coord)
        elif action == "pad":
            t = L.pad_local(t if halo_partial(d._spec) or not halos(d._spec) else L.narrow_local(t, d._spec, (), coord),
                            d._spec if halo_partial(d._spec) else d._spec.plain, halo, coord)
        locals_.append(t)
    largs, lkwargs = D.local_args(margs, mkwargs, locals_)
    out = dec.plan.local_op(*largs, **lkwargs)
    if dec.inplace:
        L.written(args[0])
        return args[0]
    want = L.ext_shape(dec.out_spec, coord)
    if tuple(out.shape) != want:  # never return a mislabelled shard
        raise AssertionError(f"{op}: local output {tuple(out.shape)} does not match {dec.out_spec} ({want}) at {coord}")
    res = DT(out, dec.out_spec, requires_grad=False)
    if dec.plan.is_view and dts[0]._copied_view is not None:
        res._copied_view = dts[0]._copied_view
    if not halo_partial(dec.out_spec):  # the widening that fetched these rows (its depth learns)
        for d in dts:
            site = d.__dict__.get(_SITE)
            if site is not None:
                res.__dict__[_SITE] = site
                break
    return res


def _drop(t):
    """``t`` without its halo, differentiable: a view of the whole tensor, which no halo survives
    (the view op is stripped like any op that does not compute on halo rows)."""
    return t.view_as(t)


def stripped(op, args: tuple, kwargs: dict, handler=None):
    """Run ``op`` (through ``handler`` when given, else the dispatcher) without halos: arguments
    it writes and partial halos lose theirs in place (:func:`layout.demote_`), replicated ones are
    passed as their owned shards."""
    DT = DTensor
    facts = op_facts(op)
    written, written_names = facts.written_positions, facts.written

    def plain(a, write):
        if isinstance(a, DT) and halos(a._spec):
            L.fresh(a)
        if isinstance(a, DT) and halos(a._spec):
            if write or halo_partial(a._spec):
                L.demote_(a)
                return a
            return L.strip(a)
        if isinstance(a, (list, tuple)) and any(isinstance(x, DT) for x in a):
            return type(a)(plain(x, write) for x in a)
        return a

    pargs = tuple(plain(a, k in written) for k, a in enumerate(args))
    pkwargs = {k: plain(v, k in written_names) for k, v in kwargs.items()}
    if handler is not None:
        return handler(op, pargs, pkwargs)
    return D.dispatch(op, pargs, pkwargs)


def _plain_plan(op, args, kwargs, dts, margs, mkwargs, key):
    """The plan of the call without its halos: the dispatcher's own, shared with its cache (under
    the key of the same call on the plain specs: each spec's token swapped for its plain spec's;
    a key that kept a halo spec's token would hand the plain plan to the halo tensors)."""
    def plan():
        return propagate(op, args, kwargs, [d._spec.plain for d in dts], margs, mkwargs)

    try:
        plain = {d._spec.token(): d._spec.plain.token() for d in dts}
    except TypeError:  # symbolic sizes while tracing: plan uncached
        return plan()
    pkey = tuple(plain.get(k, k) if type(k) is SpecToken else k for k in key)
    return D.cached_plan(pkey, plan)


def _decide(op, args, kwargs, dts, margs, mkwargs, key):
    """``_STRIP`` or a :class:`_Keep` for this call (pure metadata: the same on every rank)."""
    pointwise = torch.Tag.pointwise in op.tags or op in _COPIES
    if not (pointwise or op in LINEAR or op in ADDITIVE):
        return _STRIP
    try:
        plan = _plain_plan(op, args, kwargs, dts, margs, mkwargs, key)
    except Exception:  # noqa: BLE001 - the stripped call raises the same error with its context
        return _STRIP
    if (plan.mode not in ("functional", "inplace") or plan.redistributes or plan.shape_overrides
            or len(plan.out_specs) != 1 or plan.out_specs[0] is None or plan.inplace_view):
        return _STRIP
    out = plan.out_specs[0]
    # the halo dims: every (dim, mesh dim) some input carries, which the output keeps sharded alike
    dims: dict[int, int] = {}
    for d in dts:
        for h in halos(d._spec):
            if d._spec.ndim != out.ndim or dims.get(h.dim, h.mesh_dim) != h.mesh_dim:
                return _STRIP
            dims[h.dim] = h.mesh_dim
    for dim, i in dims.items():
        p = out.placements[i]
        if type(p).__name__ != "Shard" or p.dim != dim:
            return _STRIP
    # classify every input on every halo dim: its (lo, hi) when sharded there (0, 0: a plain
    # shard), None when it broadcasts along it
    kinds = []
    for d in dts:
        s = d._spec
        per = {}
        for dim, i in dims.items():
            p = s.placements[i] if i < len(s.placements) else None
            aligned = dim - (out.ndim - s.ndim)
            if type(p).__name__ == "Shard" and p.dim == aligned and s.ndim == out.ndim and s.shape[dim] == out.shape[dim]:
                per[dim] = L.halo_widths(s, dim)
            elif type(p).__name__ == "Replicate" and (aligned < 0 or s.shape[aligned] == 1):
                per[dim] = None
            else:
                return _STRIP
        kinds.append(per)
    partial = [k for k, d in enumerate(dts) if halos(d._spec) and halo_partial(d._spec)]
    inplace = plan.mode == "inplace"
    if partial:
        if op in ADDITIVE:
            if any(v is None for per in kinds for v in per.values()):
                return _STRIP  # a broadcast term added to every copy would be summed n times
            if any(isinstance(a, torch.Tensor) and not isinstance(a, type(dts[0])) for a in args):
                return _STRIP
            widths = {dim: (max(per[dim][0] for per in kinds), max(per[dim][1] for per in kinds)) for dim in dims}
            actions_kind = "pad"
        elif op in LINEAR and len(partial) == 1 and _position(op, args, dts[partial[0]]) in LINEAR[op]:
            pk = partial[0]
            widths = {dim: kinds[pk][dim] for dim in dims}
            for k, per in enumerate(kinds):
                if k == pk:
                    continue
                for dim, v in per.items():
                    if v is not None and (not halos(dts[k]._spec) or v[0] < widths[dim][0] or v[1] < widths[dim][1]):
                        return _STRIP  # a plain or narrower factor: the partial rows have no copy to multiply
            actions_kind = "narrow"
        else:
            return _STRIP
    else:
        widths = {dim: (min(per[dim][0] for per in kinds if per[dim] is not None),
                        min(per[dim][1] for per in kinds if per[dim] is not None)) for dim in dims}
        actions_kind = "narrow"
    halo = tuple(Halo(dim, i, *widths[dim]) for dim, i in sorted(dims.items(), key=lambda t: t[1]))
    out_spec = with_halo(out, halo, partial=bool(partial))
    if not halos(out_spec):
        return _STRIP
    if inplace and (halos(dts[0]._spec) != halos(out_spec) or halo_partial(dts[0]._spec) != halo_partial(out_spec)
                    or args[0] is not dts[0]):
        return _STRIP
    actions = []
    for d, per in zip(dts, kinds):
        if all(v is None for v in per.values()):
            actions.append(("as_is", ()))
        elif halos(d._spec) == halos(out_spec) and halo_partial(d._spec) == halo_partial(out_spec):
            actions.append(("as_is", ()))
        elif partial and actions_kind == "narrow" and halo_partial(d._spec):
            actions.append(("as_is", ()))
        else:
            actions.append((actions_kind, halos(out_spec)))
    return _Keep(plan, out_spec, tuple(actions), inplace)


def _position(op, args, dt) -> int:
    for k, a in enumerate(args):
        if a is dt:
            return k
    return -1


# the dispatcher sends ops on DTensors that carry a halo here, and strips halos through here for
# handlers that do not read them (dtshard.hooks.layout_extension)
hooks.layout_extension(L.HaloLayout, dispatch=dispatch_halo, strip=stripped, drop=_drop)
