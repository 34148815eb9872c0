"""The dispatcher: unwrap -> plan (cached) -> redistribute inputs -> local op -> wrap.

The cache key is built from the op, every DTensor's spec and EVERY non-tensor argument, so a rule
author never has to declare which scalars matter.  A hit costs one walk over the arguments, one
dict lookup, the local call and the wrapping of the outputs.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

from dtshard import _trace
from dtshard import hooks
from dtshard import registry
from dtshard.collectives import is_member as _member  # is this rank in the mesh
from dtshard.collectives import sub_mesh_dims
from dtshard.propagate import MeshMismatchError, Plan, _run_meta, _Slot, lookup, propagate
from dtshard.redistribute import redistribute_local
from dtshard.spec import DTensorSpec, contiguous_strides, placements_str, same_mesh

__all__ = ["torch_dispatch", "dispatch", "dispatch_planned", "rules_path", "clear_cache", "cache_info", "mixed_error", "MixedTensorError",
           "unwrap_call", "local_args", "cached_plan", "redistribute_input"]

_cache: dict[tuple, Plan] = {}
#: Plans kept at most. Keys include every scalar argument, so ops whose scalars change every step
#: (an optimizer's bias corrections) would otherwise grow the cache without bound; the oldest
#: tenth is dropped when full (dicts keep insertion order).
CACHE_LIMIT = 20000


def _evict_oldest() -> None:
    for key in list(itertools.islice(_cache, max(1, len(_cache) // 10))):
        del _cache[key]


def _store(key: tuple, plan: Plan) -> None:
    """Cache ``plan`` under ``key``, dropping the oldest tenth first when the cache is full."""
    if len(_cache) >= CACHE_LIMIT:
        _evict_oldest()
    _cache[key] = plan
_stats = {"hits": 0, "misses": 0}


class MixedTensorError(RuntimeError):
    """A plain (non-scalar) torch.Tensor met a DTensor. Not a TypeError: Tensor.__add__ & co.
    turn TypeErrors into NotImplemented, which would hide this message."""

    def __init__(self, message: str, tensor: torch.Tensor | None = None):
        super().__init__(message)
        self.tensor = tensor


def _guarded(handler, keeps_strided: bool, keeps_layout_data: bool, tensor_lists: bool = True):
    """``handler`` behind ONE pass over its arguments (this runs before every handler call):
    on a rank outside the arguments' mesh the op is a no-op (:func:`_non_member`); DTensors that
    hold strided shards reach it as plain ``Shard`` layouts (:func:`_plain_layouts`) unless it
    ``keeps_strided``; DTensors whose layout carries extension data (``spec.extra``) reach it
    without (the data's layout extension strips it), unless it ``keeps_layout_data``; inside
    ``implicit_replication()`` plain tensor arguments reach it as Replicate DTensors, as they join
    the rules' path.  Everything else calls it straight away.  List arguments are searched for DTensors only when
    the op has a tensor-list argument (``tensor_lists``)."""
    plain = handler if keeps_strided else _plain_layouts(handler)

    def guarded(op, args, kwargs):
        DT = _DT
        first, strided, extra, plain_seen = True, False, None, False
        for a in itertools.chain(args, kwargs.values()) if kwargs else args:
            if isinstance(a, DT):
                s = a._spec
                if first:
                    if not _member(s.mesh):
                        return dispatch_planned(op, args, kwargs)
                    first = False
                if s.extra is not None:
                    extra = s.extra
                elif s.has_strided:
                    strided = True
            elif isinstance(a, torch.Tensor):
                plain_seen = True
            elif tensor_lists and (type(a) is list or type(a) is tuple):
                for x in a:
                    if isinstance(x, DT):
                        if first:
                            if not _member(x._spec.mesh):
                                return dispatch_planned(op, args, kwargs)
                            first = False
                        if x._spec.extra is not None:
                            extra = x._spec.extra
                        strided = strided or x._spec.has_strided
        if plain_seen and not first and implicit_replication_on():
            # the caller vouches that plain tensors hold the global value: Replicate, as on the rules' path
            args, kwargs = _promote_plain_args(op, args, kwargs, True)
        if extra is not None and not keeps_layout_data:
            return hooks.extension_of(extra).strip(op, args, kwargs, plain)
        if strided and not keeps_strided:
            return plain(op, args, kwargs)
        return handler(op, args, kwargs)

    guarded.__wrapped__ = handler
    return guarded


def _plain_layouts(handler):
    """``handler`` behind a guard: DTensor arguments that hold strided shards are handed to it
    redistributed to plain ``Shard`` placements (handlers compute with shard offsets and
    neighbours, which a strided shard does not have), and arguments the op writes are written
    back into the caller's strided tensors afterwards.  Plain layouts pass straight through."""

    def guarded(op, args, kwargs):
        DT = _DT
        if not _any_strided(args, kwargs, DT):
            return handler(op, args, kwargs)
        swapped: list = []  # (original, plain copy)

        def plain(a):
            if isinstance(a, DT) and a._spec.has_strided:
                target = tuple(Shard(p.dim) if type(p) is _StridedShard else p for p in a._spec.placements)
                b = DT(redistribute_input(op, a, target), a._spec.with_placements(target), requires_grad=False)
                swapped.append((a, b))
                return b
            if isinstance(a, (list, tuple)) and any(isinstance(x, DT) for x in a):
                return type(a)(plain(x) for x in a)
            return a

        pargs = tuple(plain(a) for a in args)
        pkwargs = {k: plain(v) for k, v in kwargs.items()}
        out = handler(op, pargs, pkwargs)
        facts = registry.op_facts(op)
        written = facts.written
        if written:
            bound = dict(zip(facts.names, pargs))
            bound.update(pkwargs)
            targets = {id(v) for n, v in bound.items() if n in written}
            for orig, copy in swapped:
                if id(copy) in targets:
                    back = redistribute_local(copy._local_tensor, copy._spec, orig._spec.placements)
                    orig._local_tensor.copy_(back)
        back_map = {id(b): a for a, b in swapped}

        def restore(o):
            if isinstance(o, (list, tuple)):
                return type(o)(restore(x) for x in o)
            return back_map.get(id(o), o)

        return restore(out)

    guarded.__wrapped__ = handler
    return guarded


def _non_member(op, margs, mkwargs, specs, args, kwargs):
    """The op on a rank outside the DTensors' mesh (pipeline stages, TP on one sub-group: every
    rank runs the same code): nothing is computed or communicated; tensor outputs are DTensors
    with the op's global shape and an empty local shard (a 0-dim zero for 0-dim outputs), as
    PyTorch's DTensor gives them, with Replicate placements; ``equal`` is True, other non-tensor
    results are zero; in-place and ``out=`` ops return their (empty) targets."""
    from torch.distributed.tensor.placement_types import Replicate

    facts = registry.op_facts(op)
    if facts.mode == "inplace":
        return args[0]
    if facts.mode == "out":
        res = tuple(kwargs[n] for n in facts.out_names)
        return res[0] if len(res) == 1 else res
    if op is torch.ops.aten.equal.default:
        return True
    if op is torch.ops.aten._local_scalar_dense.default:  # .item()
        dtype = specs[0].dtype
        return False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0
    mesh = specs[0].mesh
    meta = _run_meta(op, margs, mkwargs, [s.shape for s in specs], [s.dtype for s in specs], ())

    def wrap(o):
        if isinstance(o, torch.Tensor):
            spec = DTensorSpec(mesh, (Replicate(),) * mesh.ndim, tuple(o.shape), contiguous_strides(o.shape), o.dtype)
            local = torch.zeros((), dtype=o.dtype) if o.dim() == 0 else torch.empty(0, dtype=o.dtype)
            return _DT(local, spec, requires_grad=False)
        if isinstance(o, (list, tuple)):
            return type(o)(wrap(x) for x in o)
        if isinstance(o, bool):
            return True
        if isinstance(o, (int, float)):
            return type(o)(0)
        return o

    return wrap(meta)


def _any_strided(args, kwargs, DT) -> bool:
    """Does any DTensor argument hold a strided shard?  (A plain loop: this runs before every
    handler call.)"""
    for a in args:
        if isinstance(a, DT):
            if a._spec.has_strided:
                return True
        elif type(a) is list or type(a) is tuple:
            for x in a:
                if isinstance(x, DT) and x._spec.has_strided:
                    return True
    for v in kwargs.values():
        if _holds_strided(v, DT):
            return True
    return False


def _holds_strided(a, DT) -> bool:
    if isinstance(a, DT):
        return a._spec.has_strided
    if isinstance(a, (list, tuple)):
        return any(isinstance(x, DT) and x._spec.has_strided for x in a)
    return False


_handlers: dict[int, Any] = {}  # id(op) -> handler, mirrors registry.handlers


#: plan caches that handlers keep (their own cache-hit paths), cleared with the dispatcher's
handler_caches: list = []


def clear_cache(*, plans: bool = True) -> None:
    """Forget every cached plan (the dispatcher's and the handlers' own); ``plans=False`` only
    reloads the handler table instead."""
    if plans:
        _cache.clear()
        for c in handler_caches:
            c.clear()
    else:
        _reload_handlers()


def _handler_entry(op, fn):
    """The dispatcher's table entry for ``op``'s handler ``fn`` (wrapped in its layout guards; a
    handler before a rule unguarded: it declines what it does not take)."""
    if registry.front_handlers.get(op) is fn:
        return fn
    return _guarded(fn, op in registry.strided_handlers or op not in registry._entries,
                    op in registry.layout_data_handlers, registry.op_facts(op).tensor_lists)


def _reload_handlers() -> None:
    _handlers.clear()
    _handlers[id(_DETACH)] = _detach  # its rule's plan without the lookup (a registered handler wins)
    _handlers.update({id(op): _handler_entry(op, fn) for op, fn in registry.handlers.items()})


def _registry_changed(*, plans: bool = True, only=None) -> None:
    """The registry changed: reload the handler table, and forget the plans unless no rule
    changed; ``only``: just these ops' handlers were swapped (``registry.scoped_handlers``)."""
    if only is not None:
        for op in only:
            fn = registry.handlers.get(op)
            if fn is None and op is _DETACH:
                _handlers[id(op)] = _detach
            elif fn is None:
                _handlers.pop(id(op), None)
            else:
                _handlers[id(op)] = _handler_entry(op, fn)
        return
    _scalar_types.clear()  # a rule may have changed: which ops key numbers by type
    _reload_handlers()
    if plans:
        clear_cache()


_NUMBER_TYPES = (int, float, bool, complex)
#: id(op) -> True when the cache key takes the TYPE of each number argument instead of its value
#: (the op's rule says it never reads the values: ``register_rule(scalar_values=False)``)
_scalar_types: dict[int, bool] = {}


def _keys_scalar_types(op) -> bool:
    hit = _scalar_types.get(id(op))
    if hit is None:
        entry, _mode = lookup(op)
        hit = _scalar_types[id(op)] = entry is not None and not entry.scalar_values
    return hit




def cache_info() -> dict:
    return {"size": len(_cache), **_stats}


def mixed_error(op, t: torch.Tensor) -> MixedTensorError:
    """The error for a plain (non-0-d) tensor ``t`` mixed with DTensors in ``op`` (what to do)."""
    return MixedTensorError(
        f"{op} got a plain torch.Tensor of shape {tuple(t.shape)} mixed with dtshard DTensors. "
        "Only Python scalars and tensors of one element broadcast implicitly. Convert the tensor "
        "first: dtshard.distribute_tensor(t, mesh, [Replicate()]) if every rank holds the same full "
        "tensor, or dtshard.DTensor.from_local(t, mesh, placements) if it is this rank's shard.",
        t,
    )


def _unwrap(op, a, dts: list, key: list, DT) -> Any:
    """Replace DTensors by _Slot markers (for propagation) while building the cache key."""
    if isinstance(a, DT):
        s = a._spec
        try:
            key.append(s._token or s.token())
        except TypeError:  # symbolic sizes while tracing: the key cannot hash, the call plans uncached
            key.append(s)
        dts.append(a)
        return _Slot(len(dts) - 1)
    if isinstance(a, torch.Tensor):
        if a.dim() != 0:
            raise mixed_error(op, a)
        key.append(("0d", a.dtype, a.device))
        return a
    if isinstance(a, (list, tuple)):
        if any(isinstance(b, torch.Tensor) for b in a):
            key.append(("tensor list", len(a)))
            return type(a)(_unwrap(op, b, dts, key, DT) for b in a)
        key.append(tuple(a))
        return a
    key.append(type(a) if type(a) in _NUMBER_TYPES and _keys_scalar_types(op) else a)
    return a


def _local(a, locals_: list) -> Any:
    if isinstance(a, _Slot):
        return locals_[a.k]
    if isinstance(a, (list, tuple)) and a and any(isinstance(b, (_Slot, torch.Tensor)) for b in a):
        return type(a)(_local(b, locals_) for b in a)
    return a


# ---- for layout extensions (dtshard.hooks.layout_extension): the dispatcher's steps, public ----


def unwrap_call(op, args: tuple, kwargs: dict) -> tuple[list, list, dict, list]:
    """``(dts, margs, mkwargs, key)``: the call's DTensors in order, its arguments with each
    DTensor replaced by a slot (what the planner reads), and the plan-cache key as a list
    (``op``, every spec's :class:`~dtshard.spec.SpecToken` and every non-tensor argument).
    Raises :class:`MixedTensorError` for a plain tensor that is not 0-d, TypeError for a spec
    that cannot be hashed."""
    DT = _DT
    dts: list = []
    key: list = [id(op)]
    margs = [_unwrap(op, a, dts, key, DT) for a in args]
    mkwargs = {}
    for k, v in kwargs.items():
        key.append(k)
        mkwargs[k] = _unwrap(op, v, dts, key, DT)
    return dts, margs, mkwargs, key


def local_args(margs: list, mkwargs: dict, locals_: list) -> tuple[list, dict]:
    """:func:`unwrap_call`'s slots filled with ``locals_`` (one local tensor per DTensor)."""
    return [_local(a, locals_) for a in margs], {k: _local(v, locals_) for k, v in mkwargs.items()}


def cached_plan(key: tuple, compute):
    """The plan the dispatcher's cache holds under ``key``, else ``compute()``, cached there
    (within ``CACHE_LIMIT``); an unhashable key plans without caching."""
    try:
        plan = _cache.get(key)
    except TypeError:
        return compute()
    if plan is None:
        plan = compute()
        _store(key, plan)
    return plan


_DT: Any = None  # dtshard.tensor.DTensor, bound by tensor.py (avoids an import per call)
_observers = _trace.plan_observers  # the same list object: one global lookup on the hot path


def bind_tensor_class(cls, promote_plain, op_output) -> None:
    """The tensor class, its ``promote_plain`` (a plain tensor as a Replicate DTensor) and its
    ``op_output`` (``cls(local, spec, requires_grad=False)`` for a spec without extension data, faster),
    bound by ``dtshard.tensor`` at its import: the dispatcher does not import the module above it."""
    global _DT, _promote_plain, _op_output
    _DT, _promote_plain, _op_output = cls, promote_plain, op_output


_promote_plain: Any = None  # dtshard.tensor._promote_plain, bound with the class
_op_output: Any = None  # dtshard.tensor._op_output, bound with the class


def torch_dispatch(cls, op, types, args=(), kwargs=None):
    """``DTensor.__torch_dispatch__`` itself (bound as the classmethod, one Python frame fewer):
    run aten ``op`` on DTensor arguments.

    Fast path (a cache hit with flat arguments): one walk over the args builds the cache key
    (each DTensor's spec stands in as its :class:`~dtshard.spec.SpecToken`, hashed and compared
    in C) and the local args together; then the local call and the wrap.  Anything else (misses,
    tensor lists, plain tensors other than 0-d ones after self, tensor kwargs) goes through
    :func:`dispatch_planned`, which builds the same key.  Ops with a handler, and ``detach``, take
    their entry in ``_handlers``.
    """
    oid = id(op)  # ops are process-lifetime singletons, and OpOverload.__hash__ is Python-level
    if cls is not _RULES_ONLY:
        handler = _handlers.get(oid)
        if handler is not None:
            return handler(op, args, kwargs or {})
    DT = _DT
    key: list = [oid]
    largs: list = []
    types_only = _scalar_types.get(oid)
    if types_only is None:
        types_only = _keys_scalar_types(op)
    try:
        for a in args:
            if isinstance(a, DT):
                s = a._spec
                key.append(s._token or s.token())
                largs.append(a._local_tensor)
            elif isinstance(a, torch.Tensor):
                if a.dim() != 0 or a is args[0]:  # a plain tensor beside DTensors: dispatch_planned decides
                    return dispatch_planned(op, args, kwargs or {})
                # a 0-d plain tensor after self (a Python scalar torch wrapped: ``p.mul_(0.9)``) is
                # passed through as it is; dispatch_planned keys it the same way (_unwrap)
                key.append(("0d", a.dtype, a.device))
                largs.append(a)
            elif isinstance(a, (list, tuple)):
                for b in a:
                    if isinstance(b, torch.Tensor):
                        return dispatch_planned(op, args, kwargs or {})
                key.append(tuple(a))
                largs.append(a)
            else:
                key.append(type(a) if types_only and type(a) in _NUMBER_TYPES else a)
                largs.append(a)
        if kwargs:
            for k, v in kwargs.items():
                if isinstance(v, (torch.Tensor, list, tuple)):
                    return dispatch_planned(op, args, kwargs)
                key.append(k)
                key.append(type(v) if types_only and type(v) in _NUMBER_TYPES else v)
        else:
            kwargs = _NO_KWARGS
        plan = _cache.get(tuple(key))
    except TypeError:  # an unhashable argument or spec: the general path plans without caching
        plan = None
    if plan is None or plan.mode == "out":
        return dispatch_planned(op, args, kwargs or {})
    _stats["hits"] += 1
    if _observers:
        _observe(op, plan, [a._spec for a in args if isinstance(a, DT)])
    spec = plan._simple_out
    if spec is not None:  # functional, one tensor out, nothing to move, not a view: call and wrap
        out = plan.local_op(*largs, **kwargs)
        # a functional op's output is a fresh tensor: no lazy conjugate / negative bit to copy
        r = _make_wrapper(DT, spec.shape, spec.stride, None, None, spec.dtype, out.layout, out.device)
        r._local_tensor = out
        r._spec = spec
        return r
    if plan._simple_inplace and args[0]._copied_view is None:  # in place, nothing moves
        plan.local_op(*largs, **kwargs)
        return args[0]
    spec = plan._view_out
    if spec is not None:  # a view that stays a view of its base's shard: no bookkeeping to do
        base = args[0]
        if type(base) is DT and base._copied_view is None and not torch.is_inference_mode_enabled():
            for idx, shape in plan.shape_overrides:
                largs[idx] = shape
            out = plan.local_op(*largs, **kwargs)
            if type(out) is torch.Tensor:
                r = _make_wrapper(DT, spec.shape, spec.stride, None, None, spec.dtype, out.layout, out.device)
                r._local_tensor = out
                r._spec = spec
                if out.is_conj():  # a view keeps its base's lazy conjugate / negative bits
                    torch._C._set_conj(r, True)
                if out.is_neg():
                    torch._C._set_neg(r, True)
                return r
            return _wrap_view(op, plan, base, out)
    return _run_cached(op, plan, args, largs, kwargs)


def dispatch(op, args: tuple, kwargs: dict):
    """Run aten ``op`` on DTensor arguments (what ``DTensor.__torch_dispatch__`` does; handlers
    and layout extensions call it to hand an op back to the dispatcher)."""
    return torch_dispatch(None, op, None, args, kwargs)


_RULES_ONLY = object()  # torch_dispatch's ``cls`` for a call that skips the handler table


def rules_path(op, args: tuple, kwargs: dict):
    """``op`` through the rules (its cached plan, else :func:`dispatch_planned`), every handler
    skipped: what a handler hands back the calls it does not take (``handlers.planned``)."""
    return torch_dispatch(_RULES_ONLY, op, None, args, kwargs)


_NO_KWARGS: dict = {}  # never written: the fast path passes it as ``**kwargs`` for a call without
_make_wrapper = torch.Tensor._make_wrapper_subclass


def _run_cached(op, plan, args, largs, kwargs):
    """A cached plan that is not the simplest kind: move inputs, override shape arguments, write
    in place, or wrap a view or several outputs."""
    DT = _DT
    dts = [a for a in args if isinstance(a, DT)]
    if plan.mode == "inplace" and args[0]._copied_view is not None:
        raise _write_to_copied_view(op, args[0])
    if plan._redistributes:
        pos = [k for k, a in enumerate(args) if isinstance(a, DT)]
        for k, t in enumerate(plan.input_targets):
            if t is not None:
                largs[pos[k]] = redistribute_input(op, dts[k], t)
    for idx, shape in plan.shape_overrides:
        largs[idx] = shape
    out = plan.local_op(*largs, **kwargs)
    if plan.mode == "inplace":
        if plan.inplace_view:
            _set_wrapper_metadata(op, args, kwargs, plan)
        return args[0]
    if plan.is_view:
        if (type(out) is torch.Tensor and not plan.breaks_alias and dts[0]._copied_view is None
                and not torch.is_inference_mode_enabled()):  # a plain view: nothing to note
            return _op_output(out, plan.out_specs[0])
        return _wrap_view(op, plan, dts[0], out)
    if type(out) is torch.Tensor:
        return _op_output(out, plan.out_specs[0])
    return _wrap(out, iter(plan.out_specs), DT)


_DETACH = torch.ops.aten.detach.default


def _detach(op, args, kwargs):
    """``detach`` (every step, for every parameter: AccumulateGrad) of a plain-layout DTensor: the
    same spec over the detached shard (what its plan, the identity rule, gives), without the plan
    lookup.  Anything else (layout extension data, inference mode, where :func:`_wrap_view`
    decides how the wrapper is made, an observer watching plans) takes the general path."""
    a = args[0] if len(args) == 1 and not kwargs else None
    if type(a) is not _DT or a._spec.extra is not None or _observers or torch.is_inference_mode_enabled():
        return dispatch_planned(op, args, kwargs)
    out = _op_output(a._local_tensor.detach(), a._spec)
    if a._copied_view is not None:
        out._copied_view = a._copied_view
    _stats["hits"] += 1
    return out


def _note_view(op, plan, base, res) -> None:
    """A view op whose plan moved ``base`` (a gather, say) returns a view of the moved COPY, not of
    ``base``: writing into it would leave ``base`` unchanged, silently unlike PyTorch.  Such
    outputs (and views of them) are marked, and an in-place op on one raises
    (:func:`_write_to_copied_view`).  Reading them is fine."""
    if plan.breaks_alias:
        note = (f"{op} on {tuple(base.shape)} {placements_str(base._spec.placements)} had to "
                f"redistribute it to {placements_str(plan.input_targets[0])}")
    else:
        note = base._copied_view
        if note is None:
            return
    for t in res if isinstance(res, (list, tuple)) else (res,):
        if isinstance(t, _DT):
            t._copied_view = note


def _write_to_copied_view(op, t) -> RuntimeError:
    return RuntimeError(
        f"dtshard: {op} writes into a DTensor of shape {tuple(t.shape)} "
        f"{placements_str(t._spec.placements)} on mesh {tuple(t._spec.mesh.shape)} that PyTorch "
        f"would treat as a view of another tensor, but {t._copied_view}, so it is a copy and the "
        "write would not reach the original. Redistribute the original first (x = "
        "x.redistribute(mesh, placements)) and take the view of that, or use an out-of-place op.")


def _observe(op, plan, specs) -> None:
    for obs in _trace.plan_observers:
        obs(str(op), plan, specs)


def redistribute_input(op, dt, target):
    """``dt``'s shard redistributed to ``target`` for ``op`` (below autograd; the traffic is
    attributed to ``op``)."""
    with _trace.op_context(op):  # CommCounter attributes the traffic to this op
        return redistribute_local(resolved_local(dt), dt._spec, target)


def resolved_local(dt) -> torch.Tensor:
    """``dt``'s shard with its lazy conjugate / negative bits applied, for the collectives: they
    move raw memory (or fail on a conj view, on the ranks whose chunk is not copied into a
    padded buffer first, while the others enter the collective: a hang), and the bits are not
    part of the data that travels.  Returns the shard itself when it has no bit."""
    t = dt._local_tensor
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def dispatch_planned(op, args: tuple, kwargs: dict):
    """``op`` through the rules: plan (cached), redistribute the inputs, run locally, wrap; the
    path every op without a handler takes, and the one a handler hands calls back to."""
    DT = _DT
    dts: list = []
    key: list = [id(op)]
    try:
        margs = [_unwrap(op, a, dts, key, DT) for a in args]
        mkwargs = {}
        for k, v in kwargs.items():
            key.append(k)
            mkwargs[k] = _unwrap(op, v, dts, key, DT)
    except MixedTensorError as e:
        in_backward = torch._C._current_autograd_node() is not None
        implicit = implicit_replication_on()
        if not in_backward and not implicit and e.tensor.numel() != 1:
            raise
        return dispatch_planned(op, *_promote_plain_args(op, args, kwargs, in_backward or implicit))
    try:
        tkey = tuple(key)
        plan = _cache.get(tkey)
    except TypeError:  # an unhashable argument: plan without caching
        tkey, plan = None, None
    specs = [d._spec for d in dts]
    for s in specs:
        if s.extra is not None:  # a layout with extension data: its extension decides
            return hooks.extension_of(s.extra).dispatch(op, args, kwargs)
    if plan is None and specs and not _member(specs[0].mesh):
        return _non_member(op, margs, mkwargs, specs, args, kwargs)
    if plan is None:
        if _decomposes(op):
            # from now on the dispatcher's first lookup sends this op straight to its decomposition
            # (clear_cache, run on every registration change, forgets this: a rule added later wins)
            _handlers[id(op)] = _decompose
            return _decompose(op, args, kwargs)
        _stats["misses"] += 1
        try:
            plan = propagate(op, args, kwargs, specs, margs, mkwargs)
        except MeshMismatchError:
            # inside implicit_replication(), or in a backward formula re-using what such a forward
            # op saved (a forward op cannot have mixed the meshes without it)
            lifted = _lift_sub_meshes(args, kwargs, specs) if (
                implicit_replication_on() or torch._C._current_autograd_node() is not None) else None
            if lifted is None:
                raise
            return dispatch_planned(op, *lifted)
        if tkey is not None:
            _store(tkey, plan)
    else:
        _stats["hits"] += 1
    if _observers:
        _observe(op, plan, specs)

    if plan.mode != "functional":  # never write into a view that is a copy
        written = [args[0]] if plan.mode == "inplace" else [
            kwargs.get(n) for n in registry.op_facts(op).out_names]
        for t in written:
            if isinstance(t, DT) and t._copied_view is not None:
                raise _write_to_copied_view(op, t)

    # redistribute inputs (below autograd: the op's own backward formula handles gradients)
    locals_ = [
        d._local_tensor if t is None else redistribute_input(op, d, t)
        for d, t in zip(dts, plan.input_targets)
    ]
    largs = [_local(a, locals_) for a in margs]
    for idx, shape in plan.shape_overrides:
        largs[idx] = list(shape)
    lkwargs = {k: _local(v, locals_) for k, v in mkwargs.items()}
    out = plan.local_op(*largs, **lkwargs)

    if plan.mode == "inplace":
        if plan.inplace_view:
            _set_wrapper_metadata(op, args, kwargs, plan)
        return args[0]
    if plan.mode == "out":
        res = tuple(kwargs[n] for n in registry.op_facts(op).out_names)
        return res[0] if len(res) == 1 else res
    if plan.is_view:
        return _wrap_view(op, plan, dts[0], out)
    return _wrap(out, iter(plan.out_specs), DT)


def _wrap_view(op, plan, base, out):
    """Wrap the local result of a view op.  Under ``torch.inference_mode()`` a view of a normal
    tensor is a normal tensor in PyTorch (autograd's view tracking then sets its version counter to
    the base's, which raises for an inference tensor), so the wrapper of a view of a normal
    DTensor is made outside inference mode: ``w.t()`` of a parameter works as on a plain tensor."""
    if torch.is_inference_mode_enabled() and not base.is_inference():
        with torch.inference_mode(False):
            res = _wrap(out, iter(plan.out_specs), _DT)
    else:
        res = _wrap(out, iter(plan.out_specs), _DT)
    _note_view(op, plan, base, res)
    return res


def _decomposes(op) -> bool:
    """Should ``op`` run as its CompositeImplicitAutograd decomposition?  True for an op that has
    no rule of its own but has such a kernel.

    Normally autograd decomposes these ops (``linear``, ``matmul``, ``softmax``, ``reshape``, ...)
    before ``__torch_dispatch__`` sees them.  Under ``torch.inference_mode()`` the Autograd keys
    are skipped, so they arrive here undecomposed; PyTorch's DTensor then decomposes them itself,
    and so do we (a rule registered for one, e.g. ``linear`` in rules/matmul.py, takes precedence:
    one dispatch instead of several)."""
    if lookup(op)[0] is not None:
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
    except Exception:  # noqa: BLE001 - not an aten-registered op
        return False


def _decompose(op, args: tuple, kwargs: dict):
    """Run ``op``'s C++ CompositeImplicitAutograd kernel on the DTensor arguments: each op it
    calls dispatches to dtshard again (exactly the ops PyTorch would run outside inference mode)."""
    return op.decompose(*args, **kwargs)


def _set_wrapper_metadata(op, args: tuple, kwargs: dict, plan: Plan) -> None:
    """After an in-place view op (``squeeze_``, ``t_``, ``as_strided_``, ...) changed the local
    shard's shape, give the wrapper the new GLOBAL shape and stride and the plan's output spec
    (otherwise the DTensor would keep its old shape over a reshaped shard).  The op runs on the
    wrapper itself with its global arguments, below the Python key (metadata only, as
    ``torch.utils._python_dispatch.return_and_correct_aliasing`` does for wrapper subclasses)."""
    from torch.utils._mode_utils import no_dispatch

    self = args[0]
    with no_dispatch():
        meta_in_tls = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            op(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta_in_tls)
    self._spec = plan.out_specs[0]


#: depth of dtshard.experimental.implicit_replication() blocks
_implicit = [0]


def implicit_replication_on() -> bool:
    """Inside ``dtshard.experimental.implicit_replication()`` or PyTorch's own
    ``torch.distributed.tensor.experimental.implicit_replication()`` (dtshard reads its flag, so
    code written for PyTorch's DTensor keeps working): plain tensors join ops as Replicate."""
    if _implicit[0]:
        return True
    get = getattr(torch._C, "_get_dtensor_allow_implicit_replication", None)
    return bool(get()) if get is not None else False


def _lift_sub_meshes(args: tuple, kwargs: dict, specs) -> tuple[tuple, dict] | None:
    """Inside ``implicit_replication()``: DTensors on a sub-mesh of the largest mesh among the
    op's inputs (``mesh["tp"]`` of a ``(dp, cp, tp)`` mesh: tensor-parallel parameters beside
    activations laid out on the whole mesh) as DTensors on that mesh, ``Replicate`` on its other
    dims (the caller vouches that they hold the same values there, as parameters do; the local
    tensor is unchanged).  None when the meshes are not so related."""
    from torch.utils._pytree import tree_flatten, tree_unflatten

    big = max((s.mesh for s in specs), key=lambda m: m.ndim)
    dims_of: dict = {}
    for s in specs:
        if not same_mesh(s.mesh, big) and id(s.mesh) not in dims_of:
            dims = sub_mesh_dims(big, s.mesh)
            if dims is None:
                return None
            dims_of[id(s.mesh)] = dims
    R = Replicate()

    def lift(a):
        if not isinstance(a, _DT) or same_mesh(a._spec.mesh, big):
            return a
        s, dims = a._spec, dims_of[id(a._spec.mesh)]
        placements = [R] * big.ndim
        for p, d in zip(s.placements, dims):
            placements[d] = p
        spec = DTensorSpec(big, tuple(placements), s.shape, s.stride, s.dtype)
        return _op_output(a._local_tensor, spec)

    flat, tree = tree_flatten((args, kwargs))
    return tree_unflatten([lift(a) for a in flat], tree)


def _promote_plain_args(op, args: tuple, kwargs: dict, in_backward: bool) -> tuple[tuple, dict]:
    """Plain tensors (not 0-d) next to DTensors that join the op as Replicate DTensors on the
    mesh of the other arguments:

    - tensors of one element, as PyTorch's DTensor treats them (like scalars, the same value on
      every rank is assumed; decompositions make them, e.g. ``linalg.matrix_rank``'s tolerance);
    - inside a backward formula (the autograd engine is running a node), every plain tensor: it
      was made by autograd itself from metadata (``zeros``, ``_efficientzerotensor``, ... in a
      derivative formula, or a zero-filled gradient), so it holds the global value on every rank;
    - inside ``implicit_replication()``, every plain tensor (the caller vouches that it holds the
      same global value on every rank), as PyTorch does.

    ``in_backward`` (or implicit replication) promotes every plain tensor, else only one-element ones.
    """
    from torch.utils._pytree import tree_flatten, tree_unflatten

    flat, tree = tree_flatten((args, kwargs))
    mesh = next(a._spec.mesh for a in flat if isinstance(a, _DT))

    def promote(a):
        if not isinstance(a, torch.Tensor) or isinstance(a, _DT) or a.dim() == 0:
            return a
        if not in_backward and a.numel() != 1:
            raise mixed_error(op, a)
        return _promote_plain(a, mesh, what="a plain tensor")

    return tree_unflatten([promote(a) for a in flat], tree)


def _wrap(out, specs, DT):
    if isinstance(out, torch.Tensor):
        return _op_output(out, next(specs))
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, specs, DT) for o in out)
    next(specs)  # None or non-tensor output
    return out


registry._on_change.append(_registry_changed)
_registry_changed()

hooks.runtime_entry_points(torch_dispatch, dispatch, dispatch_planned, rules_path)  # every DTensor op re-enters these
