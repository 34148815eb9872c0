"""The sharding-rule registry: the one way to teach dtshard an op.

A **rule** describes ONE mesh dim.  It receives an :class:`OpCall` (the op's args with every
DTensor replaced by its :class:`~dtshard.spec.TensorMeta`) and returns the valid strategies as
``(output_placements, input_placements)`` pairs:

- ``input_placements``: one placement per DTensor argument, in argument order (lists of tensors
  flattened in place);
- ``output_placements``: one per tensor output (a 1-tuple applies to every output).

Rules are pure functions of metadata: no collectives, no mesh lookups, no tensor data.  The
framework adds the all-Replicate strategy, expands the per-dim strategies over the mesh dims,
prices each choice by the bytes its input redistributions move, checks it against the op's meta
kernel on every distinct local shape (so an uneven layout can never be mislabelled), and caches
the plan.  In-place (``op_``) and ``.out`` overloads derive from the functional op's rule.

``shape_args`` names args that carry a GLOBAL output shape (``view``'s ``size``): the dispatcher
replaces them by the local shape of the given output on each rank.

A **handler** (``register_handler``) replaces the whole dispatch for ops whose math needs more than
a placement choice (e.g. ``mean`` over an uneven shard, ``item``); it receives the DTensor args.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch
from torch.distributed.tensor.placement_types import Placement

from dtshard.spec import TensorMeta

__all__ = [
    "OpCall",
    "OpFacts",
    "op_facts",
    "RuleEntry",
    "Strategy",
    "register_rule",
    "register_handler",
    "override",
    "scoped_handlers",
    "get_entry",
    "registered_ops",
]

Strategy = tuple[tuple[Placement, ...], tuple[Placement, ...]]
RuleFn = Callable[["OpCall"], Sequence[Strategy]]


@dataclass(frozen=True)
class OpCall:
    """What a rule sees: the op, its args (DTensors as TensorMeta) and the flat tensor inputs."""

    op: torch._ops.OpOverload
    args: tuple
    kwargs: dict
    tensors: tuple[TensorMeta, ...]  # the DTensor args, flattened in argument order
    #: per DTensor arg (as ``tensors``): the ``(dim, split_factor)`` of each strided shard it
    #: holds now (``_StridedShard``); empty for plain layouts.  Only rules that can keep a strided
    #: shard in a new form (view's merges and splits) need it: every other rule's ``Shard``
    #: strategies are carried over to strided inputs by the planner (see propagate.py).
    strided: tuple[tuple[tuple[int, int], ...], ...] = ()
    #: per DTensor arg (as ``tensors``): the tensor dim each of its sharding mesh dims shards, in
    #: mesh order (``(Shard(0), Replicate(), Shard(1))`` -> ``(0, 1)``); None where unknown.  A
    #: rule may offer fewer strategies when at most one mesh dim shards what it looks at (view:
    #: the block counts of a dim cut by two mesh dims).
    sharded: tuple[tuple[int, ...], ...] | None = None

    def arg(self, index: int, name: str, default: Any = None) -> Any:
        """Positional-or-keyword argument lookup (aten schemas allow both)."""
        if index < len(self.args):
            return self.args[index]
        return self.kwargs.get(name, default)


class OpFacts(NamedTuple):
    """What an op's schema says, computed once per op (:func:`op_facts`)."""

    #: every argument's name, in schema order
    names: tuple[str, ...]
    #: the names of the arguments that may be passed by position
    positional: tuple[str, ...]
    #: the names of the arguments the op writes (self of an in-place op, ``out=`` tensors)
    written: frozenset
    #: the positions (in :attr:`names`) of those arguments
    written_positions: tuple[int, ...]
    #: the ``out=`` arguments' names, in schema order
    out_names: tuple[str, ...]
    #: "functional", "inplace" (writes an argument, no ``out=``) or "out"
    mode: str
    #: the first output aliases an input without writing it (``view``, ``t``, ``expand``, ...)
    returns_view: bool
    #: the op returns exactly one Tensor
    one_tensor_out: bool
    #: some argument is a list of tensors (``cat``'s, ``_foreach_*``'s): only then can a list
    #: argument hold a DTensor
    tensor_lists: bool


_facts: dict = {}


def op_facts(op: torch._ops.OpOverload) -> OpFacts:
    """The schema facts of ``op`` (memoised: read once per op, not per call)."""
    hit = _facts.get(op)
    if hit is None:
        schema = op._schema
        args, returns = schema.arguments, schema.returns
        written = [k for k, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
        out_names = tuple(a.name for a in args if a.is_out)
        mode = "functional" if not schema.is_mutable else "out" if out_names else "inplace"
        alias = returns[0].alias_info if returns else None
        hit = _facts[op] = OpFacts(
            names=tuple(a.name for a in args),
            positional=tuple(a.name for a in args if not a.kwarg_only),
            written=frozenset(args[k].name for k in written),
            written_positions=tuple(written),
            out_names=out_names,
            mode=mode,
            returns_view=alias is not None and not alias.is_write,
            one_tensor_out=len(returns) == 1 and str(returns[0].type) == "Tensor",
            tensor_lists=any(str(a.type).startswith(("Tensor[]", "List[Tensor]", "Tensor?[]", "List[Optional[Tensor]]"))
                             for a in args),
        )
    return hit


@dataclass
class RuleEntry:
    op: torch._ops.OpOverload
    fn: Callable
    kind: str  # "rule" | "handler"
    shape_args: dict[int, int] = field(default_factory=dict)
    source: str = ""
    local: Callable | None = None  # runs on the local shards instead of the op itself
    #: ``meta(call) -> [TensorMeta | None, ...]``: the op's flat outputs' metadata from its inputs'
    #: (the call's TensorMetas), exactly as its meta kernel would give them, raising where it
    #: would raise.  Lets propagation skip the meta-kernel runs (the cost of a cache miss).
    meta: Callable | None = None
    #: a handler that takes strided shards (``_StridedShard``) as they are: it works only through
    #: DTensor ops or in a layout-free way.  Any other handler gets its DTensor arguments with
    #: strided shards converted to plain ``Shard`` first (dispatch._plain_layouts).
    keeps_strided: bool = False
    #: a handler that takes DTensors carrying layout-extension data (``spec.extra``, e.g. what
    #: :mod:`dtshard.spatial` attaches) as they are; any other handler gets them without (the
    #: dispatcher has the data's extension strip it first)
    keeps_layout_data: bool = False
    #: False: the rule and its ``meta`` read only the TYPES of the op's number arguments (int,
    #: float, bool, complex), never their values, so the dispatcher keys its plan cache on the
    #: types (see :func:`register_rule`)
    scalar_values: bool = True
    #: ``local_ok(call, local_shapes) -> bool``: a condition on one rank's local input shapes that
    #: the op's meta kernel cannot see (see :func:`register_rule`)
    local_ok: Callable | None = None


_entries: dict[torch._ops.OpOverload, RuleEntry] = {}
#: handlers registered with ``before_rule=True``: they run first for an op that keeps its rule in
#: ``_entries`` (the planner's), and hand the calls they do not take to it with ``planned``
_fronts: dict[torch._ops.OpOverload, RuleEntry] = {}
#: op -> handler function, for the dispatcher's first lookup (kept in sync with _entries)
handlers: dict[torch._ops.OpOverload, Callable] = {}
#: the handlers registered with ``keeps_strided=True``
strided_handlers: set = set()
#: the handlers registered with ``keeps_layout_data=True``
layout_data_handlers: set = set()
#: op -> its handler registered with ``before_rule=True`` (the dispatcher calls it unguarded)
front_handlers: dict = {}
# Called after every registration change (the dispatcher clears its plan cache).
_on_change: list[Callable[[], None]] = []


#: handler tables installed by scoped_handlers(), innermost last; they take precedence over _entries
_scoped: list[dict] = []


def _changed(*, plans: bool = True, only=None) -> None:
    """Rebuild the handler table; ``plans=False``: no rule changed, cached plans stay valid;
    ``only``: just these ops' handlers changed (a scoped swap), rebuild their entries alone."""
    if only is not None:
        for op in only:
            e = _fronts.get(op) or _entries.get(op)
            fn = e.fn if e is not None and e.kind == "handler" else None
            for scope in _scoped:
                fn = scope.get(op, fn)
            if fn is None:
                handlers.pop(op, None)
            else:
                handlers[op] = fn
        for fn in _on_change:
            fn(plans=False, only=only)
        return
    fronted = [*((op, e) for op, e in _entries.items() if e.kind == "handler"), *_fronts.items()]
    handlers.clear()
    handlers.update({op: e.fn for op, e in fronted})
    strided_handlers.clear()
    strided_handlers.update(op for op, e in fronted if e.keeps_strided)
    layout_data_handlers.clear()
    layout_data_handlers.update(op for op, e in fronted if e.keeps_layout_data)
    front_handlers.clear()
    front_handlers.update({op: e.fn for op, e in _fronts.items()})
    for scope in _scoped:
        handlers.update(scope)
    for fn in _on_change:
        fn(plans=plans)


def _where(fn: Callable) -> str:
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else repr(fn)


def _register(ops, fn, kind, shape_args=None, local=None, meta=None, keeps_strided=False, keeps_layout_data=False,
              scalar_values=True, before_rule=False, local_ok=None) -> None:
    if isinstance(ops, torch._ops.OpOverload):
        ops = [ops]
    for op in ops:
        if not isinstance(op, torch._ops.OpOverload):
            raise TypeError(
                f"register_{kind} needs aten op overloads such as torch.ops.aten.mm.default, got {op!r}"
            )
        table = _fronts if before_rule else _entries
        old = table.get(op)
        if old is not None:
            raise ValueError(
                f"a {'handler before the rule' if before_rule else old.kind} for {op} is already registered at "
                f"{old.source}; one op has one rule (and at most one handler before it). "
                f"Edit that one, or use dtshard.registry.override() in tests."
            )
        table[op] = RuleEntry(op, fn, kind, dict(shape_args or {}), _where(fn), local, meta, keeps_strided,
                                 keeps_layout_data, scalar_values, local_ok)
    _changed()


def register_rule(
    ops,
    *,
    shape_args: dict[int, int] | None = None,
    local: Callable | None = None,
    meta: Callable | None = None,
    scalar_values: bool = True,
    local_ok: Callable | None = None,
) -> Callable[[RuleFn], RuleFn]:
    """Decorator: register ``fn(call: OpCall) -> [(output_placements, input_placements), ...]``
    as the single-mesh-dim sharding rule of one op overload (or a list of them).

    ``shape_args={arg index: output index}``: that arg is a global shape; each rank gets the local
    shape of that output.  ``local(op, *args, **kwargs)``: run this on the local shards instead of
    ``op`` (same math, e.g. a view that copies when a rank's local strides do not allow a view).
    ``meta(call) -> [TensorMeta | None per flat output]``: optional, the op's exact output metadata
    (shape, stride, dtype) from ``call.tensors`` (raise where the op would raise); propagation
    then uses it instead of running the op's meta kernel on the global shapes and on every
    distinct local shape, which is most of the cost of a cache miss.  Give it only where the math
    is simple and certain (pointwise broadcasting, matmul): the OpInfo sweep compares it with the
    meta kernel on every sample (``propagate.config.verify_meta``).
    ``scalar_values=False``: the rule (and ``meta``) never read the VALUES of the op's number
    arguments, only their types, so calls that differ only in a number (a learning rate that an
    optimizer or a scheduler changes every step, Adam's bias corrections) share one cached plan
    instead of planning again.  The default keys every argument by value: a rule that reads a
    number (``masked_fill``'s fill value decides which Partial it keeps) must keep it.
    ``local_ok(call, local_shapes) -> bool``: optional, for a strategy whose validity depends on
    how the mesh cuts the inputs in a way the meta kernel cannot see (the kernel accepts the local
    shapes but would compute something else from them).  ``call`` is the global call the rule
    saw, ``local_shapes`` one rank's shape of each of ``call.tensors``; the planner's local-shape
    check asks it for every distinct local shape of a choice and rejects the choice where it says
    False (on every rank alike: it sees only metadata).  Grouped-query attention with sharded
    heads is the example (``rules/attention.py``): each rank's query heads must be exactly the
    groups of its own key/value heads, which holds on some mesh sizes and not others.
    Registering a second rule for the same op raises: use :func:`override` to swap one in tests.
    """

    def deco(fn: RuleFn) -> RuleFn:
        _register(ops, fn, "rule", shape_args, local, meta, scalar_values=scalar_values, local_ok=local_ok)
        return fn

    return deco


def register_handler(ops, *, keeps_strided: bool = False, keeps_layout_data: bool = False,
                     before_rule: bool = False) -> Callable:
    """Decorator: ``fn(op, args, kwargs)`` runs the op on DTensor args itself (for ops whose math
    needs more than a placement choice). It may call other ops on DTensors and redistribute.

    A handler sees plain layouts only: DTensor arguments holding strided shards are converted to
    ``Shard`` before it runs (and written arguments converted back after), unless
    ``keeps_strided=True`` says it handles them (it uses only DTensor ops, or never looks at
    shard positions).  Likewise DTensors whose layout carries extension data (``spec.extra``,
    e.g. the neighbours' rows of :mod:`dtshard.spatial`) reach it without, unless
    ``keeps_layout_data=True`` (it reads the data itself).

    ``before_rule=True``: the op keeps its rule (``register_rule``), which the planner uses; this
    handler runs first and takes the layouts it specialises (context parallelism's attention
    strategies on a sharded sequence), handing every other call to the rule with
    ``dtshard.handlers.planned``.  At most one such handler per op.  It sees the arguments as
    they are (no strided-shard conversion, no layout data stripped, on ranks outside the mesh
    too), so that a call it declines costs only its own test: it takes only the layouts it
    knows, on member ranks."""

    def deco(fn):
        _register(ops, fn, "handler", keeps_strided=keeps_strided, keeps_layout_data=keeps_layout_data,
                  before_rule=before_rule)
        return fn

    return deco


@contextlib.contextmanager
def override(op: torch._ops.OpOverload, fn: Callable, *, kind: str = "rule", shape_args=None) -> Iterator[None]:
    """Temporarily replace (or add) the rule of ``op``; for tests."""
    old = _entries.get(op)
    _entries[op] = RuleEntry(op, fn, kind, dict(shape_args or {}), _where(fn))
    _changed()
    try:
        yield
    finally:
        if old is None:
            _entries.pop(op, None)
        else:
            _entries[op] = old
        _changed()


@contextlib.contextmanager
def scoped_handlers(mapping: dict) -> Iterator[None]:
    """Route each op of ``mapping`` to its handler inside the block; cached plans stay valid
    (handlers are consulted before the plan cache), so nothing is re-planned on entry or exit."""
    scope = dict(mapping)
    _scoped.append(scope)
    _changed(plans=False, only=scope)
    try:
        yield
    finally:
        for k in range(len(_scoped) - 1, -1, -1):
            if _scoped[k] is scope:
                del _scoped[k]
                break
        _changed(plans=False, only=scope)


def get_entry(op: torch._ops.OpOverload) -> RuleEntry | None:
    """The registered rule or handler of ``op`` (a :class:`RuleEntry`), or None when it has neither."""
    return _entries.get(op)


def registered_ops() -> list[torch._ops.OpOverload]:
    """Every op overload with a rule or a handler, in registration order."""
    return list(_entries)
