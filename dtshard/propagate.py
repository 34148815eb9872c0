"""Sharding propagation: turn a rule's single-mesh-dim strategies into a checked plan.

Runs only on a dispatch-cache miss.  Steps:
  1. run the op on meta tensors of the GLOBAL shapes: output shapes, strides, dtypes, structure;
  2. ask the rule for its strategies (plus all-Replicate, which is always correct);
  3. expand them over the mesh dims (one strategy per mesh dim), price each choice by the bytes its
     input redistributions move, and order the choices by cost;
  4. take the cheapest choice that passes the local check: for every distinct combination of local
     shapes on the mesh, the op's meta kernel on the local input shapes must give exactly the local
     output shapes the output placements claim, and where a rank's local input is EMPTY (an uneven
     shard of fewer rows than ranks) the op that runs on the shards must also accept it in a real,
     zero-element run (meta kernels accept empty inputs that real kernels reject: ``max()``).  A
     rule that would mislabel an uneven layout, or run a local op that raises on one rank while
     the others go on to a collective, is thereby never used: the next cheapest correct choice is
     (all-Replicate at worst).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from dtshard import redistribute as R
from dtshard._config import config  # noqa: F401  (dtshard.config; re-exported here for old imports)
from dtshard.collectives import mesh_coordinate  # coordinate of this rank (cached)
from dtshard.registry import OpCall, RuleEntry, get_entry, op_facts
from dtshard.spec import (ENUMERATION_LIMIT, DTensorSpec, TensorMeta, chunk_classes, chunk_range, contiguous_strides,
                          is_shard, is_strided, dim_patterns, dim_region, dim_steps, local_region, local_shape, local_shape_and_offset,
                          local_shape_classes, mesh_str, placement_key, same_mesh,
                          placements_equal, placements_str, split_factor)

__all__ = ["Plan", "propagate", "NoRuleError", "RuleError", "config", "planner_accepts", "strategy_choices",
           "tensor_slot"]

_REPLICATE = Replicate()
_MAX_CHOICES = 4096
#: the real zero-element runs (_run_zero_elements) allocate inputs (and, on global shapes,
#: outputs) of at most this many elements
_SMALL_RUN = 1 << 16


class NoRuleError(NotImplementedError):
    """dtshard cannot run this op on DTensors: no sharding rule, or nothing to infer its output
    metadata from (see :class:`NoMetaKernelError`). The message names the op, the inputs' global
    shapes and placements, the mesh, and the fix."""


class NoMetaKernelError(NoRuleError):
    """PyTorch's meta kernels cannot give the op's output (none is registered, or the output's
    shape depends on the input's values, as for ``nonzero``), and no rule gives a ``meta``
    function, so its output shapes cannot be inferred without running it."""


class RuleError(RuntimeError):
    """A rule returned something that is not a valid strategy (a bug in the rule)."""


@dataclass
class Plan:
    """What the dispatcher does for one (op, input specs, non-tensor args) key."""

    op: Any
    input_targets: tuple  # per DTensor input: target placements, or None when unchanged
    out_specs: tuple  # per tensor output (flattened): DTensorSpec or None
    shape_overrides: tuple  # ((arg index, local shape), ...) for shape_args
    mode: str  # "functional" | "inplace" | "out"
    cost: float
    considered: tuple = ()  # [(cost, (input placements, output placements), ok)] looked at, for explain()
    fallback: bool = False
    local_op: Any = None  # what runs on the local shards (the op itself unless the rule says)

    @property
    def redistributes(self) -> bool:
        return self._redistributes

    def __post_init__(self) -> None:
        # precomputed for the dispatcher's cached path (plain attributes, no property calls)
        self._redistributes = any(t is not None for t in self.input_targets)
        #: an in-place op that changes self's metadata (squeeze_, transpose_, as_strided_, ...): the
        #: dispatcher must also change the wrapper's shape, stride and spec (set_wrapper_metadata)
        self.inplace_view = self.mode == "inplace" and torch.Tag.inplace_view in getattr(self.op, "tags", ())
        #: the output spec when the plan is the simplest kind: functional, one tensor output,
        #: no input moves, no shape arguments (the local result is wrapped as it is)
        self._simple_out = None
        facts = op_facts(self.op)
        #: a view op (its output aliases self): the dispatcher keeps track of views that are not
        #: views, because the plan had to move self (see dispatch._note_view)
        self.is_view = self.mode == "functional" and facts.returns_view
        self.breaks_alias = self.is_view and bool(self.input_targets) and self.input_targets[0] is not None
        if (self.mode == "functional" and not self.is_view and not self._redistributes and not self.shape_overrides
                and len(self.out_specs) == 1 and self.out_specs[0] is not None and facts.one_tensor_out):
            self._simple_out = self.out_specs[0]
        #: the output spec of a view that stays a view: functional, one tensor out, nothing moves
        #: (the dispatcher then only fills the local shape arguments and wraps)
        #: an in-place op that moves nothing and keeps self's metadata: the dispatcher runs the
        #: local op and returns self
        self._simple_inplace = (self.mode == "inplace" and not self.inplace_view and not self._redistributes
                                and not self.shape_overrides)
        self._view_out = None
        if (self.is_view and not self._redistributes and len(self.out_specs) == 1 and self.out_specs[0] is not None
                and facts.one_tensor_out):
            self._view_out = self.out_specs[0]

    def describe(self, in_specs: Sequence[DTensorSpec]) -> str:
        lines = [f"{self.op}  cost={self.cost:.0f}B" + ("  (fallback to Replicate)" if self.fallback else "")]
        for k, (spec, tgt) in enumerate(zip(in_specs, self.input_targets)):
            if tgt is None:
                lines.append(f"  in{k}: {placements_str(spec.placements)} (kept)")
            else:
                for line in R.plan_text(spec, tgt).splitlines():
                    lines.append(f"  in{k}: {line.strip()}")
        for k, spec in enumerate(self.out_specs):
            if spec is not None:
                lines.append(f"  out{k}: {placements_str(spec.placements)} shape={tuple(spec.shape)}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# rule lookup, with in-place and .out overloads derived from the functional op
# ---------------------------------------------------------------------------------------------

_derived: dict = {}


def _functional_of(op: torch._ops.OpOverload):
    """(functional overload, mode) for in-place and .out overloads; (op, "functional") otherwise."""
    hit = _derived.get(op)
    if hit is not None:
        return hit
    schema = op._schema
    result = (op, "functional")
    name = schema.name.split("::")[-1]
    packet_name = op._overloadpacket.__name__
    aten = torch.ops.aten
    if schema.is_mutable and packet_name.endswith("_") and not packet_name.endswith("__"):
        base = getattr(aten, packet_name[:-1], None)
        ov = getattr(base, op._overloadname, None) if base is not None else None
        if ov is None and base is not None:  # overload names differ (transpose_.default / transpose.int)
            sig = [(a.name, str(a.type)) for a in schema.arguments]
            ov = next((getattr(base, n) for n in base.overloads()
                       if [(a.name, str(a.type)) for a in getattr(base, n)._schema.arguments] == sig), None)
        if ov is not None:
            result = (ov, "inplace")
    elif schema.is_mutable and any(a.is_out for a in schema.arguments):
        in_args = [(a.name, str(a.type)) for a in schema.arguments if not a.is_out]
        for ov_name in op._overloadpacket.overloads():
            ov = getattr(op._overloadpacket, ov_name)
            s = ov._schema
            if ov is op or s.is_mutable:
                continue
            if [(a.name, str(a.type)) for a in s.arguments] == in_args:
                result = (ov, "out")
                break
    del name
    _derived[op] = result
    return result


def lookup(op) -> tuple[RuleEntry | None, str]:
    """The rule that plans ``op`` and the mode (functional / inplace / out).  A handler is not a
    rule: an in-place op with a handler that hands some calls back to the planner (fill_ of a
    non-Partial tensor) is planned from its functional op's rule."""
    entry = get_entry(op)
    if entry is not None and entry.kind == "rule":
        return entry, "functional" if op_facts(op).mode == "functional" else _functional_of(op)[1]
    base, mode = _functional_of(op)
    if base is not op:
        entry = get_entry(base)
        if entry is not None and entry.kind == "rule":
            return entry, mode
    return None, "functional"


def rules_file_hint(op) -> str:
    namespace = getattr(op, "namespace", "aten")
    if namespace in ("c10d", "_c10d_functional", "c10d_functional"):
        # a torch.distributed collective called on a DTensor (dist.all_reduce(x)): not a rule's job
        return ("a DTensor moves between layouts with x.redistribute(mesh, placements) or "
                "x.full_tensor(); a torch.distributed collective takes plain tensors, so call it on "
                "this rank's shard, x.to_local(), or on x.full_tensor()")
    return (
        f"add a rule with @dtshard.register_rule(torch.ops.{namespace}.{op._overloadpacket.__name__}."
        f"{op._overloadname}) in the matching family file under dtshard/rules/ (see CONTRIBUTING.md), "
        "or opt in to the slow path with dtshard.replicate_fallback()"
    )


# ---------------------------------------------------------------------------------------------
# meta execution helpers
# ---------------------------------------------------------------------------------------------


def _meta(shape, dtype):
    return torch.empty(shape, dtype=dtype, device="meta")


def _run_meta(op, args, kwargs, tensor_shapes, dtypes, shape_overrides, scalars_to_meta=True):
    """Run ``op`` on meta tensors; DTensor slots in ``args`` are marked by _Slot(k)."""
    def conv(a):
        if isinstance(a, _Slot):
            return _meta(tensor_shapes[a.k], dtypes[a.k])
        if isinstance(a, torch.Tensor):
            return a.to("meta") if scalars_to_meta else a
        if isinstance(a, (list, tuple)):
            return type(a)(conv(b) for b in a)
        return a

    margs = [conv(a) for a in args]
    for idx, shape in shape_overrides:
        margs[idx] = list(shape)
    # a target device (``_to_copy(x, device="cpu")``, as autograd's backward of a dtype change
    # passes it) would copy the meta tensor out: the metadata is the same on the meta device
    mkwargs = {k: _META if k == "device" and v is not None else conv(v) for k, v in kwargs.items()}
    return op(*margs, **mkwargs)


_META = torch.device("meta")


class _Slot:
    __slots__ = ("k",)

    def __init__(self, k: int) -> None:
        self.k = k

    def __repr__(self) -> str:
        return f"<tensor {self.k}>"


def flatten_outputs(out) -> list:
    if isinstance(out, torch.Tensor) or out is None:
        return [out]
    if isinstance(out, (list, tuple)):
        flat = []
        for o in out:
            flat.extend(flatten_outputs(o))
        return flat
    return [out]


# ---------------------------------------------------------------------------------------------
# propagation
# ---------------------------------------------------------------------------------------------

_warned_fallback: set = set()


def _error_context(op, specs: Sequence[DTensorSpec]) -> str:
    ins = ", ".join(f"{tuple(s.shape)} {placements_str(s.placements)}" for s in specs)
    mesh = specs[0].mesh if specs else None
    return f"{op} on inputs [{ins}] over mesh {tuple(mesh.shape) if mesh is not None else ()}"


def _all_replicate(strategy) -> bool:
    return all(type(p) is Replicate for group in strategy for p in group)


#: ops whose rule may return strided shards: views, for which the planner checks EXACTLY, rank by
#: rank, that the input's elements are the output's (_view_regions_match), whenever the input is
#: sharded (the view rule offers shard pairings that line up only for some shapes and meshes)
_EXACT_VIEWS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                          torch.ops.aten.view_copy.default})


class MeshMismatchError(ValueError):
    """An op's DTensor inputs live on different meshes (the dispatcher may lift a sub-mesh's
    DTensors onto the larger mesh inside ``implicit_replication()``)."""


def _check_strategy(op, strat, n_in, n_out, in_metas, out_metas, source) -> tuple:
    try:
        outs, ins = strat
        outs, ins = tuple(outs), tuple(ins)
    except Exception:
        raise RuleError(f"the rule for {op} ({source}) returned {strat!r}; expected (output_placements, input_placements)")
    if len(outs) == 1 and n_out > 1:
        outs = outs * n_out
    if len(ins) != n_in or len(outs) != n_out:
        raise RuleError(
            f"the rule for {op} ({source}) returned a strategy with {len(ins)} input and {len(outs)} output "
            f"placements; the op has {n_in} DTensor inputs and {n_out} tensor outputs"
        )
    for p, m in zip(ins + outs, in_metas + out_metas):
        t = type(p)  # exact-type tests first: isinstance on placement classes is slow (a metaclass hook)
        if t is Replicate or t is Partial:
            continue
        if t is _StridedShard:
            if op not in _EXACT_VIEWS:
                raise RuleError(
                    f"the rule for {op} ({source}) returned {p!r}: only view rules may return strided "
                    "shards (the planner carries other rules' Shard strategies over to strided inputs)")
        elif t is not Shard:
            if isinstance(p, (Replicate, Partial)):
                continue
            if not isinstance(p, Shard):
                raise RuleError(f"the rule for {op} ({source}) returned {p!r}, not a placement")
        if m is not None and not 0 <= p.dim < len(m):
            raise RuleError(
                f"the rule for {op} ({source}) returned Shard({p.dim}) for a {len(m)}-D tensor"
            )
    return outs, ins


def propagate(op, args, kwargs, specs: Sequence[DTensorSpec], meta_args, meta_kwargs) -> Plan:
    """Build the plan for ``op`` on DTensor inputs with ``specs``.

    ``meta_args``/``meta_kwargs`` are the op's args with DTensor slots replaced by ``_Slot(k)``.
    """
    entry, mode = lookup(op)
    fallback = False
    if entry is None:
        if not config.fallback_to_replicate:
            raise NoRuleError(
                f"dtshard has no sharding rule for {_error_context(op, specs)}. To fix: "
                + rules_file_hint(op)
            )
        fallback = True
        if op not in _warned_fallback:
            _warned_fallback.add(op)
            warnings.warn(
                f"dtshard: no sharding rule for {op}; falling back to Replicate (all inputs gathered). "
                + rules_file_hint(op),
                stacklevel=4,
            )
    mesh = specs[0].mesh
    mesh_shape = specs[0].mesh_shape
    for s in specs[1:]:
        if not same_mesh(s.mesh, mesh):
            raise MeshMismatchError(
                f"{_error_context(op, specs)}: DTensor inputs live on different meshes "
                f"({mesh_str(mesh)} vs {mesh_str(s.mesh)}; meshes are one when they hold the same ranks in "
                "the same layout with the same dim names and device type); "
                "redistribute them onto one mesh first, or, for a sub-mesh's DTensor that holds the same "
                "values on every rank outside its mesh (a tensor-parallel parameter beside activations on "
                "the whole mesh), run the op inside dtshard.experimental.implicit_replication()."
            )
    shapes = [s.shape for s in specs]
    dtypes = [s.dtype for s in specs]
    # 1. global output metadata: the rule's meta function, or the op's meta kernel
    meta_fn = None
    if entry is not None and entry.meta is not None and not fallback:
        if mode == "functional":
            meta_fn = entry.meta
        elif mode == "inplace":
            meta_fn = functools.partial(_inplace_meta, entry.meta, _functional_of(op)[0])
    call = None  # the rule's OpCall, when the meta function can read the same one
    try:
        metas = None
        if meta_fn is not None:
            metas = [s.contiguous_meta for s in specs]
            if mode == "functional" and all(m is s.tensor_meta for m, s in zip(metas, specs)):
                # contiguous inputs: the meta function's call is the rule's (which adds the shards)
                call = _rule_call(op, specs, meta_args, meta_kwargs, range(len(specs)), ())
        gflat = _out_metas(op, meta_args, meta_kwargs, shapes, dtypes, (), meta_fn, strides=True, metas=metas,
                           call=call)
    except RuleError:
        raise
    except NotImplementedError as e:
        if "Meta" not in str(e) and "register_meta" not in str(e):
            raise type(e)(f"{_error_context(op, specs)}: {e}") if _simple_exc(e) else e
        raise NoMetaKernelError(
            f"{_error_context(op, specs)}: PyTorch's meta kernels cannot give the output of {op} "
            "(none is registered, or, as for nonzero, the output's shape depends on the input's "
            "values), so dtshard cannot infer its output shapes and dtypes on the global inputs "
            f"({str(e).splitlines()[0][:120] if str(e) else type(e).__name__}). To fix: "
            f"register a rule with a meta function, @dtshard.register_rule({op}, meta=...) "
            "(CONTRIBUTING.md, 'Adding a rule'), or run it on plain tensors "
            "(x.full_tensor(), or each rank's x.to_local())."
        ) from None
    except Exception as e:  # the op rejects these global inputs: same error a plain tensor gives
        raise type(e)(f"{_error_context(op, specs)}: {e}") if _simple_exc(e) else e
    if config.check_plans and any(0 in tuple(sh) for sh in shapes) and sum(
            math.prod(o.shape) for o in gflat if o is not None) <= _SMALL_RUN:
        # an empty global input: meta kernels accept some that the real kernel rejects (max() of an
        # empty tensor); raise torch's error here, with the context, on every rank alike
        try:
            _run_zero_elements(op, op, meta_args, meta_kwargs, shapes, dtypes, (), mesh, global_shapes=True)
        except Exception as e:
            raise type(e)(f"{_error_context(op, specs)}: {e}") if _simple_exc(e) else e
    shape_args = entry.shape_args if entry is not None else {}
    # .out overloads: the out= DTensors are not inputs of the functional rule; they must already
    # have the placements the chosen strategy gives its outputs.
    out_names = op_facts(op).out_names if mode == "out" else ()
    out_slots = {v.k for name, v in meta_kwargs.items() if name in out_names and isinstance(v, _Slot)}
    in_ids = [k for k in range(len(specs)) if k not in out_slots]
    # 2-3. strategies, expanded over the mesh dims (strided variants included)
    choices = _expand(op, entry, mode, specs, meta_args, meta_kwargs, gflat, in_ids, out_names, fallback,
                      call if len(in_ids) == len(specs) else None)
    src_pl = [s.placements for s in specs]
    inplace_view = mode == "inplace" and torch.Tag.inplace_view in op.tags
    # per (input k, its target placements): bytes, and the bound below them; choices share them
    costs: dict = {}
    bounds: dict = {}
    # the choices that keep every input where it is cost nothing and move nothing: they sort
    # before all others, so the others are priced (a planner search per input and target) only
    # when none of these passes the local shape check
    kept, moved = [], []
    for combo, ins, outs in choices:
        # an in-place op keeps self where it is; one that changes only metadata (squeeze_, t_, ...)
        # may relabel it (S(1) of (1, n) squeezed is S(0)), any other keeps its placements
        if mode == "inplace" and (not placements_equal(ins[0], src_pl[0]) or (
                not inplace_view and not placements_equal(outs[0], src_pl[0]))):
            continue
        if mode == "out" and tuple(outs) != tuple(specs[k].placements for k in sorted(out_slots)):
            continue
        (moved if any(not placements_equal(t, src_pl[k]) for k, t in enumerate(ins)) else kept).append(
            (combo, ins, outs))

    def price(group):
        """``(cost, n_moves, n_rep, ins, outs)`` of each choice in ``group``, cheapest first (ties:
        fewer moved inputs, then fewer replicated outputs, then the rule's order), lazily: on an N-D
        mesh each exact cost is a redistribute search, so choices are priced in the order of a
        bound their cost never goes below (R.transition_lower_bound), and one is yielded once its
        exact cost is below every bound not yet priced: the same order as pricing them all."""
        n_dims = len(mesh_shape)
        items = []
        for j, (combo, ins, outs) in enumerate(group):
            # (input, its target, the target as a plain key: a strided shard never equals a Shard)
            moves = [(k, target, tuple(placement_key(p) for p in target)) for k, target in enumerate(ins)
                     if not placements_equal(target, src_pl[k])]
            bound = 0.0
            if n_dims > 1:
                for k, target, key in moves:
                    b = bounds.get((k, key))
                    if b is None:
                        b = bounds[(k, key)] = R.transition_lower_bound(specs[k], target)
                    bound += b
            n_rep = sum(type(p) is Replicate for o in outs for p in o)
            items.append((bound * (1 - 1e-9), len(moves), n_rep, j, moves, ins, outs))
        items.sort(key=lambda t: t[:4])
        exact: list = []
        for bound, n_moves, n_rep, j, moves, ins, outs in items:
            while exact and exact[0][0] < bound:
                yield heapq.heappop(exact)[4:]
            try:
                cost = 0.0
                for k, target, key in moves:
                    c = costs.get((k, key))
                    if c is None:
                        c = costs[(k, key)] = R.transition_cost(specs[k], target)
                    cost += c
            except ValueError:  # no legal path to this target
                continue
            heapq.heappush(exact, (cost, n_moves, n_rep, j, cost, n_moves, n_rep, ins, outs))
        while exact:
            yield heapq.heappop(exact)[4:]

    what = "in-place op would change the placement of its self argument" if mode == "inplace" else (
        "the out= tensor's placements match no valid strategy" if mode == "out" else "no valid strategy")

    def no_strategy() -> str:  # built only when raised (an error context formats every spec)
        return f"{_error_context(op, specs)}: {what}. Redistribute the tensor first, or use the out-of-place op."
    if not kept and not moved:
        raise RuntimeError(no_strategy())

    # 4. first choice that passes the local shape check
    shapes_fn = meta_fn
    local_op = op
    if entry is not None and entry.local is not None:
        local_op = functools.partial(entry.local, op)
    considered = []
    for cost, _, _, ins, outs in itertools.chain(_kept_order(kept), _lazy(lambda: price(moved))):
        out_specs = tuple(
            None if o is None else specs[0].on_mesh(outs[k], o.shape, o.stride, o.dtype)
            for k, o in enumerate(gflat)
        )
        # (an input that stays where it is keeps its spec, and what the spec has worked out)
        in_specs = [s if s.extra is None and placements_equal(t, s.placements) else s.with_placements(t)
                    for s, t in zip(specs, ins)]
        ok = _check_local(op, meta_args, meta_kwargs, in_specs, out_specs, mesh_shape, shape_args, shapes_fn,
                          local_op, entry.local_ok if entry is not None else None)
        if ok and op in _EXACT_VIEWS and _any_shard(in_specs[0]):
            ok = _view_regions_match(in_specs[0], out_specs[0], mesh_shape)
        considered.append((cost, (ins, outs), ok))  # formatted only when explain() shows it
        if ok:
            coord = mesh_coordinate(mesh)
            overrides = tuple(
                (idx, out_specs[k].local_shape(coord)) for idx, k in sorted(shape_args.items())
                if idx < len(meta_args)
            )
            targets = tuple(None if t == s.placements else t for s, t in zip(specs, ins))
            return Plan(op, targets, out_specs, overrides, mode, cost, tuple(considered), fallback, local_op)
    if not considered:  # every strategy needs a move that has no legal path
        raise RuntimeError(no_strategy())
    raise RuntimeError(
        f"{_error_context(op, specs)}: no strategy passed the local shape check (not even "
        f"all-Replicate); this is a dtshard bug, please report it with this message."
    )


def _rule_call(op, specs, meta_args, meta_kwargs, in_ids, out_names) -> OpCall:
    """What the rule sees (:class:`OpCall`) of ``op`` on inputs with ``specs`` (the ``out=``
    tensors of an .out overload, ``out_names``, left out)."""
    dims = [specs[k].sharded_dims for k in in_ids]
    return OpCall(op=op, args=tuple(_to_meta_info(a, specs) for a in meta_args),
                  kwargs={k: _to_meta_info(v, specs) for k, v in meta_kwargs.items() if k not in out_names},
                  tensors=tuple(specs[k].tensor_meta for k in in_ids),
                  strided=tuple(d[1] for d in dims), sharded=tuple(d[0] for d in dims))


def _expand(op, entry, mode, specs, meta_args, meta_kwargs, gflat, in_ids, out_names, fallback,
            call=None) -> list:
    """Every choice the planner considers, as ``(combo, input placements, output placements)``:
    the rule's single-mesh-dim strategies (plus all-Replicate) combined over the mesh dims, each
    followed, where an input holds a strided shard, by its strided variant (_strided_variant).
    ``call``: the rule's :class:`OpCall`, when the caller made it already."""
    n_out = len(gflat)
    if fallback:
        strategies = []
    else:
        if call is None:
            call = _rule_call(_functional_of(op)[0] if mode != "functional" else op, specs, meta_args,
                              meta_kwargs, in_ids, out_names)
        try:
            raw = list(entry.fn(call))
        except RuleError:
            raise
        except Exception as e:
            raise RuleError(f"the rule for {op} ({entry.source}) raised {type(e).__name__}: {e}") from e
        rule_in_metas = [tuple(specs[k].shape) for k in in_ids]
        out_metas = [None if o is None else o.shape for o in gflat]
        strategies = [_check_strategy(op, s, len(in_ids), n_out, rule_in_metas, out_metas, entry.source) for s in raw]
    all_r = ((_REPLICATE,) * n_out, (_REPLICATE,) * len(in_ids))
    if not any(_all_replicate(st) for st in strategies):
        strategies.append(all_r)
    mesh_shape = specs[0].mesh_shape
    m = len(mesh_shape)
    src_pl = [s.placements for s in specs]
    if len(strategies) ** m > _MAX_CHOICES:
        # keep a huge rule x mesh product bounded: the same strategy on every dim, plus every
        # combination of strategies that each keep the inputs where they are on their dim (the
        # free choices, which a same-on-every-dim list misses on a mesh whose dims differ)
        combos = [tuple([k] * m) for k in range(len(strategies))]
        keeps = [[c for c, st in enumerate(strategies)
                  if all(placements_equal((st[1][j],), (src_pl[k][d],)) for j, k in enumerate(in_ids))]
                 for d in range(m)]
        if all(keeps) and math.prod(len(k) for k in keeps) <= _MAX_CHOICES:
            seen = set(combos)
            combos += [c for c in itertools.product(*keeps) if c not in seen]
    else:
        combos = list(itertools.product(range(len(strategies)), repeat=m))
    carry_strided = any(s.has_strided for s in specs) and op not in _EXACT_VIEWS and not fallback
    choices = []
    every_input = len(in_ids) == len(specs)
    for combo in combos:
        # per input (per output): its placements over the mesh dims, one strategy per mesh dim
        rule_ins = tuple(zip(*[strategies[c][1] for c in combo]))
        outs = tuple(zip(*[strategies[c][0] for c in combo]))
        if every_input:
            ins = rule_ins
        else:  # an .out overload's out= tensors stay where they are
            ins_list = list(src_pl)
            for j, k in enumerate(in_ids):
                ins_list[k] = rule_ins[j]
            ins = tuple(ins_list)
        if carry_strided:
            variant = _strided_variant(specs, in_ids, ins, outs, gflat, mesh_shape)
            if variant is not None:
                choices.append((combo + ("strided",), *variant))
        choices.append((combo, ins, outs))
    return choices


# ---------------------------------------------------------------------------------------------
# the planner's steps, public for the rule validator (dtshard.validate)
# ---------------------------------------------------------------------------------------------


def tensor_slot(k: int) -> _Slot:
    """The marker of the ``k``-th DTensor argument in the ``meta_args`` the functions here take."""
    return _Slot(k)


def strategy_choices(op, specs: Sequence[DTensorSpec], meta_args, meta_kwargs) -> tuple[list, list]:
    """``(global output metadata, [(input placements, output placements), ...])``: every choice
    the planner considers for a functional ``op`` on inputs with ``specs`` (its rule's strategies
    expanded over the mesh exactly as :func:`propagate` expands them), unpriced, unchecked."""
    entry, mode = lookup(op)
    if entry is None or mode != "functional":
        raise NoRuleError(f"dtshard has no sharding rule for {_error_context(op, specs)}")
    meta_fn = entry.meta
    gflat = _out_metas(op, meta_args, meta_kwargs, [s.shape for s in specs], [s.dtype for s in specs], (),
                       meta_fn, strides=True)
    choices = _expand(op, entry, mode, specs, meta_args, meta_kwargs, gflat, list(range(len(specs))), set(), False)
    return gflat, [(ins, outs) for _, ins, outs in choices]


def planner_accepts(op, meta_args, meta_kwargs, in_specs, out_specs) -> bool:
    """Would the planner use this choice: does it pass the local shape check (and, for a view
    with strided shards, the exact element check) that :func:`propagate` applies?"""
    entry, _ = lookup(op)
    shape_args = entry.shape_args if entry is not None else {}
    shapes_fn = entry.meta if entry is not None else None
    local_op = functools.partial(entry.local, op) if entry is not None and entry.local is not None else op
    mesh_shape = in_specs[0].mesh_shape
    ok = _check_local(op, meta_args, meta_kwargs, in_specs, out_specs, mesh_shape, shape_args, shapes_fn, local_op,
                      entry.local_ok if entry is not None else None)
    if ok and op in _EXACT_VIEWS and _any_shard(in_specs[0]):
        ok = _view_regions_match(in_specs[0], out_specs[0], mesh_shape)
    return ok


def _kept_order(kept):
    """The choices that move no input, as ``price`` yields them (cost 0, no moves): fewer
    replicated outputs first, then the rule's order."""
    reps = [sum(type(p) is Replicate for o in outs for p in o) for _, _, outs in kept]
    for j in sorted(range(len(kept)), key=reps.__getitem__):
        yield 0.0, 0, reps[j], kept[j][1], kept[j][2]


def _lazy(make):
    """Iterate what ``make()`` returns, calling it only when the first item is asked for."""
    yield from make()


def placements_text(ins, outs) -> str:
    return " ".join(placements_str(p) for p in ins) + " -> " + " ".join(placements_str(p) for p in outs)


def _simple_exc(e: Exception) -> bool:
    try:
        type(e)("x")
        return type(e) in (RuntimeError, ValueError, TypeError, IndexError)
    except Exception:
        return False


def _to_meta_info(a, specs, metas=None):
    if isinstance(a, _Slot):
        return specs[a.k].tensor_meta if metas is None else metas[a.k]
    if isinstance(a, (list, tuple)):
        return type(a)(_to_meta_info(b, specs, metas) for b in a)
    return a


def _inplace_meta(functional_meta, functional_op, call: OpCall):
    """Metadata of ``op_(self, ...)`` from the functional op's meta function: ``self`` itself,
    when the functional result has self's shape and its dtype casts to self's; otherwise decline
    (the meta kernel raises the op's own error)."""
    self_meta = call.args[0] if call.args else None
    if not isinstance(self_meta, TensorMeta):
        return None
    got = functional_meta(dataclasses.replace(call, op=functional_op))
    if got is None or len(got) != 1 or got[0] is None:
        return None
    if got[0].shape != self_meta.shape or not torch.can_cast(got[0].dtype, self_meta.dtype):
        return None
    return [self_meta]


def _out_metas(op, meta_args, meta_kwargs, in_shapes, dtypes, overrides, meta_fn, strides=False,
               metas=None, call=None) -> list:
    """Flat output metadata (TensorMeta, or None for a non-tensor output) of ``op`` on inputs of
    ``in_shapes``: from the rule's ``meta`` function when it has one (and does not decline with
    None), else from a run of the op's meta kernel.  Raises where the op would.  ``strides=False``:
    only the shapes are compared by the caller.  ``metas``: the inputs' contiguous TensorMetas,
    and ``call``: the meta function's OpCall, when the caller has them."""
    if meta_fn is not None:
        if metas is None:
            metas = [TensorMeta(tuple(sh), contiguous_strides(sh), dt) for sh, dt in zip(in_shapes, dtypes)]
        if overrides:  # shape arguments (view's size) given as this rank's local shapes
            meta_args = list(meta_args)
            for idx, shape in overrides:
                meta_args[idx] = list(shape)
        if call is None or overrides:
            call = OpCall(op=op, args=tuple(_to_meta_info(a, None, metas) for a in meta_args),
                          kwargs={k: _to_meta_info(v, None, metas) for k, v in meta_kwargs.items()},
                          tensors=tuple(metas))
        try:
            got = meta_fn(call)
        except Exception as e:
            if config.verify_meta:  # the kernel must reject these inputs too
                try:
                    _run_meta(op, meta_args, meta_kwargs, in_shapes, dtypes, overrides)
                except Exception:  # noqa: BLE001
                    raise e from None
                raise RuleError(f"the meta function of {op} rejects input shapes {list(in_shapes)} "
                                f"{list(dtypes)}, which its meta kernel accepts: {e!r}") from e
            raise
        if got is not None:
            got = list(got)
            if config.verify_meta:
                _verify_meta(op, meta_args, meta_kwargs, in_shapes, dtypes, overrides, got, strides)
            return got
    lout = flatten_outputs(_run_meta(op, meta_args, meta_kwargs, in_shapes, dtypes, overrides))
    return [TensorMeta(tuple(o.shape), tuple(o.stride()), o.dtype) if isinstance(o, torch.Tensor) else None
            for o in lout]


def _verify_meta(op, meta_args, meta_kwargs, in_shapes, dtypes, overrides, got, strides) -> None:
    try:
        want = _out_metas(op, meta_args, meta_kwargs, in_shapes, dtypes, overrides, None)
    except Exception as e:  # noqa: BLE001 - the meta function accepted what the kernel rejects
        raise RuleError(f"the meta function of {op} accepts input shapes {list(in_shapes)} "
                        f"{list(dtypes)}, which its meta kernel rejects: {e!r}") from e

    def view(ms):
        return [None if m is None else (m.shape, m.stride if strides else None, m.dtype) for m in ms]

    if view(got) != view(want):
        raise RuleError(f"the meta function of {op} disagrees with its meta kernel on input shapes "
                        f"{list(in_shapes)} {list(dtypes)}: {view(got)} vs {view(want)}")


def _check_local(op, meta_args, meta_kwargs, in_specs, out_specs, mesh_shape, shape_args, shapes_fn=None,
                 local_op=None, local_ok=None) -> bool:
    """Does the op, run on every distinct combination of local shapes, give the claimed shapes?

    Where some rank's local input has zero elements, the op that runs on the shards (``local_op``)
    must also accept those shapes in a real run (:func:`_runs_on_empty`): a local op that raises
    on one rank only would leave the other ranks waiting in (or mismatching) the next collective.
    ``local_ok``: the rule's condition on a rank's local shapes (``register_rule(local_ok=...)``).
    """
    if not config.check_plans:
        return True
    if not any(s.sharded_dims[0] for s in in_specs) and not any(
            o is not None and o.sharded_dims[0] for o in out_specs):
        return True  # nothing is sharded: local shapes equal global shapes, checked already
    if any(type(d) is torch.SymInt for s in in_specs for d in s.shape):
        raise NotImplementedError(
            f"dtshard: {op} on sharded DTensors of symbolic (dynamic) global shapes "
            f"{[tuple(s.shape) for s in in_specs]} with placements "
            f"{[placements_str(s.placements) for s in in_specs]} on mesh {tuple(mesh_shape)}: the local-shape "
            "check needs concrete shapes. Compile with torch.compile(..., dynamic=False), or mark the "
            "inputs static (torch._dynamo.mark_static); a recompilation (e.g. a second model of the same "
            "class) otherwise turns the changed sizes dynamic.")
    seen = set()
    seen_call: list = []  # the global OpCall local_ok reads, built once
    dtypes = [s.dtype for s in in_specs]
    n_in = len(in_specs)
    if all(s.is_even() for s in in_specs) and all(o is None or o.is_even() for o in out_specs):
        coord = (0,) * len(mesh_shape)  # every rank's local shapes are these
        classes = [tuple(None if s is None else local_shape(s.shape, mesh_shape, s.placements, coord)
                         for s in (*in_specs, *out_specs))]
    else:
        # every distinct combination of local shapes, in the order of the first rank holding it,
        # without walking the ranks (spec.local_shape_classes)
        classes = list(local_shape_classes(
            [(s.shape, s.placements) for s in in_specs]
            + [None if o is None else (o.shape, o.placements) for o in out_specs], mesh_shape))
    for key in classes:
        in_local, out_local = tuple(key[:n_in]), tuple(key[n_in:])
        key = (in_local, out_local)
        if key in seen:
            continue
        seen.add(key)
        if local_ok is not None:
            if not seen_call:
                seen_call.append(OpCall(op=op, args=tuple(_to_meta_info(a, in_specs) for a in meta_args),
                                        kwargs={k: _to_meta_info(v, in_specs) for k, v in meta_kwargs.items()},
                                        tensors=tuple(sp.tensor_meta for sp in in_specs)))
            if not local_ok(seen_call[0], in_local):
                return False
        overrides = tuple((idx, out_local[k]) for idx, k in sorted(shape_args.items()) if idx < len(meta_args))
        try:
            lout = [None if o is None else o.shape
                    for o in _out_metas(op, meta_args, meta_kwargs, in_local, dtypes, overrides, shapes_fn)]
        except RuleError:
            raise
        except Exception:
            return False
        if len(lout) != len(out_local):
            return False
        for got, want in zip(lout, out_local):
            if got != want:
                return False
        if any(0 in shape for shape in in_local) and not _runs_on_empty(
                op, local_op or op, meta_args, meta_kwargs, in_local, dtypes, overrides, in_specs[0].mesh):
            return False
    return True


def _runs_on_empty(op, local_op, meta_args, meta_kwargs, in_shapes, dtypes, overrides, mesh) -> bool:
    """Does ``local_op`` accept local inputs of ``in_shapes`` (some of them with zero elements)?

    Meta kernels do not check everything the real kernels check: ``max()``, ``max(dim)``,
    ``median(dim)``, ``mode`` ... of an empty tensor have a meta result, while the CPU and CUDA
    kernels raise.  So the real op is run once (:func:`_run_zero_elements`)."""
    try:
        _run_zero_elements(op, local_op, meta_args, meta_kwargs, in_shapes, dtypes, overrides, mesh)
    except Exception:  # noqa: BLE001 - any error: this plan would fail on that rank
        return False
    return True


def _run_zero_elements(op, run, meta_args, meta_kwargs, in_shapes, dtypes, overrides, mesh,
                       global_shapes: bool = False) -> None:
    """Run ``run`` (``op``, or the rule's local function for it) for real, on the mesh's device
    type, on zero-filled inputs of ``in_shapes`` of which some have zero elements; raises what it
    raises.

    Zero-element inputs cost nothing, and small inputs little.  A large non-empty input is, for
    local shapes, a single zero broadcast to its shape (no memory; a kernel that insists on
    contiguous inputs then rejects the plan, which only costs a cheaper plan), while for
    ``global_shapes`` (which may not fit on one device) the run is skipped, as it is for a
    large output.  Plain (0-d) tensors are passed as the local call gets them.  Only aten ops are
    run this way (never a collective)."""
    if getattr(op, "namespace", None) != "aten":
        return
    device = torch.device(mesh.device_type)
    written = op_facts(op).written

    def conv(a, name):
        if isinstance(a, _Slot):
            shape, dtype = tuple(in_shapes[a.k]), dtypes[a.k]
            if math.prod(shape) <= _SMALL_RUN:
                return torch.zeros(shape, dtype=dtype, device=device)
            if global_shapes or name in written:  # a large tensor the run would have to allocate
                raise _SkipRun
            return torch.zeros((), dtype=dtype, device=device).expand(shape)
        if isinstance(a, (list, tuple)):
            return type(a)(conv(b, name) for b in a)
        return a

    names = op_facts(op).positional
    try:
        largs = [conv(a, names[i] if i < len(names) else None) for i, a in enumerate(meta_args)]
        lkwargs = {k: conv(v, k) for k, v in meta_kwargs.items()}
    except _SkipRun:
        return
    for idx, shape in overrides:
        largs[idx] = list(shape)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # e.g. std's "degrees of freedom <= 0" on an empty shard
        run(*largs, **lkwargs)


class _SkipRun(Exception):
    """A tensor too large for a check run."""


# ---------------------------------------------------------------------------------------------
# strided shards (_StridedShard): carrying rules over, checking views exactly
# ---------------------------------------------------------------------------------------------


def _strided_variant(specs, in_ids, ins, outs, gflat, mesh_shape):
    """The strategy ``(ins, outs)`` carried over to strided inputs, or None.

    Rules speak of ``Shard`` only.  Where an input holds ``_StridedShard(d, sf)`` on mesh dim
    ``i`` and the strategy asks ``Shard(d)`` of it there, the variant gives EVERY ``Shard`` of that
    mesh dim (inputs and outputs) the same split factor, so the input stays where it is.  That is
    correct when the op works element by element along the paired dims, which is what a rule
    claims when it keeps a dim sharded from input to output with its size unchanged (or contracts
    it into a Partial): so the variant is kept only if, on every rank, every paired dim has the
    same size and holds exactly the same global indices (_same_dim_regions: decided from each
    dim's nesting of shards, without walking the ranks; where that is too costly to decide it
    answers no, so the op redistributes: correct, only slower).  (Convolutions, pools and the other ops
    whose shards need their neighbours' rows are handlers, which never see a strided shard:
    dispatch converts it first.)"""
    m = len(mesh_shape)
    ins2 = [list(p) for p in ins]
    outs2 = [list(o) for o in outs]
    changed = []
    for i in range(m):
        sfs = {split_factor(specs[k].placements[i]) for k in in_ids
               if is_strided(specs[k].placements[i]) and type(ins[k][i]) is Shard
               and ins[k][i].dim == specs[k].placements[i].dim}
        if len(sfs) != 1:
            continue
        sf = sfs.pop()
        for row in (*ins2, *outs2):
            if type(row[i]) is Shard:
                row[i] = _StridedShard(row[i].dim, split_factor=sf)
        changed.append(i)
    if not changed:
        return None
    shapes = [s.shape for s in specs] + [None if o is None else o.shape for o in gflat]
    rows = ins2 + outs2
    for i in changed:
        paired = [(shapes[t], rows[t], rows[t][i].dim) for t in range(len(rows))
                  if shapes[t] is not None and is_strided(rows[t][i])]
        if len({sh[d] for sh, _, d in paired}) != 1:
            return None
        length = paired[0][0][paired[0][2]]
        if not _same_dim_regions(length, [dim_steps(pl, d, mesh_shape, len(sh)) for sh, pl, d in paired], mesh_shape):
            return None
    return tuple(tuple(p) for p in ins2), tuple(tuple(o) for o in outs2)


def _sub_coords(mesh_dims, mesh_shape):
    """Every coordinate of the mesh dims ``mesh_dims`` (a dict each), or None when there are more
    than ``spec.ENUMERATION_LIMIT`` of them and more than one mesh dim (the check then answers in its
    safe direction; one mesh dim is walked whatever its size: linear in that dim, never in the
    world size)."""
    sizes = [mesh_shape[i] for i in mesh_dims]
    if len(sizes) > 1 and math.prod(sizes) > ENUMERATION_LIMIT:
        return None
    return (dict(zip(mesh_dims, c)) for c in itertools.product(*(range(n) for n in sizes)))


def _same_dim_regions(length: int, steps_list, mesh_shape) -> bool:
    """Do tensor dims of the same global ``length``, sharded by each of ``steps_list``
    (spec.dim_steps), hold the same indices on every rank?

    A dim's region depends only on its length, its steps and their mesh dims' coordinates, so equal
    steps (the usual case: the same nesting of the same shards) decide True at once, as does an
    empty dim; otherwise the coordinates of just the mesh dims involved are walked
    (_sub_coords), and where there are too many of them the answer is False: the safe direction
    (the strided variant is not used and the input redistributes, correct, only slower)."""
    if length == 0 or len(set(steps_list)) == 1:
        return True
    dims = sorted({i for steps in steps_list for i, _, _ in steps})
    subs = _sub_coords(dims, mesh_shape)
    if subs is None:
        return False
    for sub in subs:
        if len({dim_region(length, steps, sub) for steps in set(steps_list)}) != 1:
            return False
    return True


#: a view is checked element by element only up to this many contiguous runs per rank (beyond it
#: the strided plan is not used: the view redistributes, which is correct, only slower)
_MAX_RUNS = 1 << 16


def _flat_runs(shape, region):
    """The global row-major flat indices of ``region`` as merged ``[start, stop)`` runs (None when
    there would be more than _MAX_RUNS)."""
    nd = len(shape)
    t = nd - 1
    while t >= 0 and region[t] == ((0, shape[t]),):
        t -= 1
    if t < 0:
        n = math.prod(shape)
        return [(0, n)] if n else []
    inner = math.prod(shape[t + 1:])
    outer = [[i for lo, hi in region[d] for i in range(lo, hi)] for d in range(t)]
    count = math.prod(len(o) for o in outer) * len(region[t])
    if count > _MAX_RUNS:
        return None
    strides = [math.prod(shape[d + 1:]) for d in range(nd)]
    runs = []
    for idx in itertools.product(*outer):
        base = sum(i * st for i, st in zip(idx, strides))
        for lo, hi in region[t]:
            a, b = base + lo * inner, base + hi * inner
            if runs and runs[-1][1] == a:
                runs[-1] = (runs[-1][0], b)
            elif b > a:
                runs.append((a, b))
    return runs


def _any_shard(spec: DTensorSpec) -> bool:
    return any(is_shard(p) for p in spec.placements)


def _view_regions_match(in_spec: DTensorSpec, out_spec: DTensorSpec, mesh_shape) -> bool:
    """Does every rank's output shard of a view hold exactly its input shard's elements?  (A view
    keeps the row-major order, and a shard lists its elements in global order, so the local view
    is then the right one.)

    Decided without walking the ranks (_one_shard_regions_match, _view_groups_match); where
    neither decides, the ranks are walked on a mesh of at most ENUMERATION_LIMIT ranks, and on a larger
    one the answer is False, the safe direction (the view redistributes: correct, only slower)."""
    quick = _one_shard_regions_match(in_spec, out_spec, mesh_shape)
    if quick is not None:
        return quick
    verdict = _view_groups_match(in_spec, out_spec, mesh_shape)
    if verdict is not None:
        return verdict
    if math.prod(mesh_shape) > ENUMERATION_LIMIT:
        return False  # undecided without walking the ranks: the safe answer (the view redistributes)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        a = _flat_runs(in_spec.shape, _region(in_spec, mesh_shape, coord))
        b = _flat_runs(out_spec.shape, _region(out_spec, mesh_shape, coord))
        if a is None or b is None or a != b:
            return False
    return True


def _view_groups(a_shape, b_shape) -> list[tuple[range, range]]:
    """The dims of two shapes of equal, non-zero element counts in consecutive groups of equal
    products (``(a dims, b dims)`` each): a row-major flat index is then the groups' own flat
    indices in mixed radix."""
    groups, i, j = [], 0, 0
    na, nb = len(a_shape), len(b_shape)
    while i < na or j < nb:
        i0, j0 = i, j
        if i < na:
            pa, pb, i = a_shape[i], 1, i + 1
        else:  # trailing size-1 dims of b
            pa, pb, j = 1, b_shape[j], j + 1
        while pa != pb:  # the smaller side has dims left: the totals are equal
            if pa < pb:
                pa, i = pa * a_shape[i], i + 1
            else:
                pb, j = pb * b_shape[j], j + 1
        groups.append((range(i0, i), range(j0, j)))
    return groups


def _view_groups_match(in_spec: DTensorSpec, out_spec: DTensorSpec, mesh_shape) -> bool | None:
    """:func:`_view_regions_match`'s verdict without walking the ranks, or None where this cannot
    decide it.

    Split both shapes into groups of dims of equal products (_view_groups).  A rank's region is a
    product over dims, so its flat indices are the product, in mixed radix, of its groups' own
    flat index sets: two such products are equal exactly when every group's factors are equal, or
    when both are empty.  A group's factors depend only on the coordinates of the mesh dims that
    shard its dims; a group of one dim on each side with the same shards (spec.dim_steps) has equal
    factors everywhere and drops out; the other groups, joined where they share a mesh dim, are
    walked over those mesh dims' coordinates only (_sub_coords), each coordinate reduced to its
    type: (input factor empty, output factor empty, all factors equal).  Components' coordinates
    are independent, so some rank fails exactly when every component has a type with an empty-free
    input (or output) side and one of them such a type with unequal factors.

    The walk's run bound (_flat_runs: more than _MAX_RUNS runs on some rank makes the verdict
    False) is decided from the distinct local shapes (spec.local_shape_classes): a rank's run count
    is a function of its local shape, except on a dim that a strided shard splits, where it is
    bounded by the dim's most intervals (spec.dim_patterns).  None where that bound or a walk does
    not decide."""
    a_shape, b_shape = tuple(in_spec.shape), tuple(out_spec.shape)
    if math.prod(a_shape) == 0:
        return True  # every rank holds nothing on both sides
    # 1. the run bound, on every rank
    for spec in (in_spec, out_spec):
        bound = _max_runs_bound(spec, mesh_shape)
        if bound is None:
            return None
        if bound is False:
            return False
    # 2. the groups' factors
    steps_a = [dim_steps(in_spec.placements, d, mesh_shape, len(a_shape)) for d in range(len(a_shape))]
    steps_b = [dim_steps(out_spec.placements, d, mesh_shape, len(b_shape)) for d in range(len(b_shape))]
    live = []
    for ga, gb in _view_groups(a_shape, b_shape):
        if not any(steps_a[d] for d in ga) and not any(steps_b[d] for d in gb):
            continue  # whole on every rank, on both sides
        if len(ga) == 1 and len(gb) == 1 and steps_a[ga[0]] == steps_b[gb[0]]:
            continue  # the same shards of the same length: equal factors on every rank
        lead = _leading_rows_match(a_shape, b_shape, ga, gb, steps_a, steps_b)
        if lead is not None:
            if not lead:
                return False
            continue
        dims = {i for d in ga for i, _, _ in steps_a[d]} | {i for d in gb for i, _, _ in steps_b[d]}
        live.append((ga, gb, dims))
    components: list[tuple[list, set]] = []
    for g in live:
        comp = ([g], set(g[2]))
        for other in [c for c in components if c[1] & comp[1]]:
            components.remove(other)
            comp = (other[0] + comp[0], other[1] | comp[1])
        components.append(comp)
    types_of = []
    for groups, dims in components:
        subs = _sub_coords(sorted(dims), mesh_shape)
        if subs is None:
            return None
        types = set()
        for sub in subs:
            ie = oe = False
            eq = True
            for ga, gb, _ in groups:
                fa = _flat_runs([a_shape[d] for d in ga], [dim_region(a_shape[d], steps_a[d], sub) for d in ga])
                fb = _flat_runs([b_shape[d] for d in gb], [dim_region(b_shape[d], steps_b[d], sub) for d in gb])
                if fa is None or fb is None:
                    return None
                ie, oe, eq = ie or not fa, oe or not fb, eq and fa == fb
            types.add((ie, oe, eq))
        types_of.append(types)
    for side in (0, 1):  # some rank with no empty factor on this side and an unequal factor: fails
        if all(any(not t[side] for t in ts) for ts in types_of) and any(
                not t[side] and not t[2] for ts in types_of for t in ts):
            return False
    return True


def _leading_rows_match(a_shape, b_shape, ga, gb, steps_a, steps_b) -> bool | None:
    """For a view group (_view_groups) whose only sharded dims are its first on each side, split
    by plain shards of the same mesh dims in the same order: do both sides hold the same flat
    indices of the group on every rank?  None when the group is not of that kind.

    Each side's factor is then a row interval of its first dim times the rows below it
    (``inner``), so the factors are equal exactly when every chunk, at every mesh dim, holds as
    many elements on both sides: chunks lie in rank order, so equal lengths give equal offsets.
    Where some chunk's lengths differ, some rank below it holds unequal, not both empty factors
    (the lengths below a chunk sum to its own), and that rank's whole shards differ: every other
    group holds something on both sides at coordinate 0 of its mesh dims, which are not this
    group's.  Lengths are constant between the chunk classes' starts, which stand for the rest."""
    if any(steps_a[d] for d in ga[1:]) or any(steps_b[d] for d in gb[1:]) or not ga or not gb:
        return None
    sa, sb = steps_a[ga[0]], steps_b[gb[0]]
    if [(i, n) for i, n, _ in sa] != [(i, n) for i, n, _ in sb] or any(
            parts != 1 for _, _, parts in (*sa, *sb)):
        return None
    ia, ib = math.prod(a_shape[d] for d in ga[1:]), math.prod(b_shape[d] for d in gb[1:])
    states = {(a_shape[ga[0]], b_shape[gb[0]])}
    for _, n, _ in sa:
        nxt = set()
        for la, lb in states:
            for c in {x for x, _, _ in chunk_classes(la, n)} | {x for x, _, _ in chunk_classes(lb, n)}:
                ca, cb = chunk_range(la, n, c)[1], chunk_range(lb, n, c)[1]
                if ca * ia != cb * ib:
                    return False
                nxt.add((ca, cb))
        states = nxt
    return True


def _max_runs_bound(spec: DTensorSpec, mesh_shape):
    """True when no rank's region of ``spec`` has more than _MAX_RUNS runs in _flat_runs' count,
    False when some rank's has, None when this cannot tell (a strided dim's interval count is
    bounded, not known, per rank)."""
    shape = tuple(spec.shape)
    nd = len(shape)
    most = [1] * nd  # the most intervals a dim's region has on any rank
    for d in range(nd):
        steps = dim_steps(spec.placements, d, mesh_shape, nd)
        if any(parts > 1 for _, _, parts in steps):
            most[d] = max(len(p) for p in dim_patterns(shape[d], steps))
    unknown = False
    for (local,) in local_shape_classes(((shape, spec.placements),), mesh_shape):
        t = nd - 1
        while t >= 0 and local[t] == shape[t]:
            t -= 1
        if t < 0:
            continue
        count = math.prod(local[:t]) * (min(most[t], local[t]) if local[t] else 0)
        if count > _MAX_RUNS:
            if most[t] == 1 or math.prod(local[:t]) > _MAX_RUNS:
                return False  # this rank's count is over (it has at least one interval on dim t)
            unknown = True
    return None if unknown else True


def _one_shard_regions_match(in_spec: DTensorSpec, out_spec: DTensorSpec, mesh_shape) -> bool | None:
    """:func:`_view_regions_match` without walking the ranks' regions, for the common case: a 1-D
    mesh, both sides one plain ``Shard`` of a non-empty tensor.  In flat order a tensor is
    ``prod(shape[:d])`` blocks of ``shape[d]`` rows of ``prod(shape[d+1:])`` elements, and a shard
    of dim ``d`` holds the same chunk of rows of every block, so two such shards hold the same
    elements on every rank when their block counts are equal and each rank's chunk has as many
    elements on both sides (chunks are contiguous in rank order: equal lengths on every rank give
    equal offsets).  None when the case does not apply."""
    if len(mesh_shape) != 1:
        return None
    p, q = in_spec.placements[0], out_spec.placements[0]
    if type(p) is not Shard or type(q) is not Shard:
        return None
    a_shape, b_shape = in_spec.shape, out_spec.shape
    if not a_shape or not b_shape or 0 in a_shape or 0 in b_shape:
        return None
    da, db = p.dim % len(a_shape), q.dim % len(b_shape)
    if math.prod(a_shape[:da]) != math.prod(b_shape[:db]):
        return None  # (they may still match when one rank holds everything: the walk decides)
    ia, ib = math.prod(a_shape[da + 1:]), math.prod(b_shape[db + 1:])
    n = mesh_shape[0]
    # chunk lengths are constant between the class starts of both splits (chunk_classes)
    starts = {a for a, _, _ in chunk_classes(a_shape[da], n)} | {a for a, _, _ in chunk_classes(b_shape[db], n)}
    for r in starts:
        if chunk_range(a_shape[da], n, r)[1] * ia != chunk_range(b_shape[db], n, r)[1] * ib:
            return False
    return True


def _region(spec: DTensorSpec, mesh_shape, coord):
    """``spec``'s local region at ``coord``: for plain shards one interval per dim, from the
    shard's shape and offset (cheaper than local_region's interval walk)."""
    if spec.has_strided:
        return local_region(spec.shape, mesh_shape, spec.placements, coord)
    shape, offset = local_shape_and_offset(spec.shape, mesh_shape, spec.placements, coord)
    return tuple(((o, o + n),) for n, o in zip(shape, offset))
