"""The handler kit: what an op handler needs, in one public module.

A *rule* (``@register_rule``) maps input placements to output placements and the dispatcher does
the rest.  A *handler* (``@register_handler``) runs the whole op itself, for ops whose sharded
form needs more than a placement choice (convolution's halo exchange, group norm's statistics
reduced over shards).  A handler receives ``(op, args, kwargs)`` with DTensors in them and must
return what the op returns, DTensors where the op returns tensors.  Everything it needs to do
that is here; a handler imports this module and public modules only, never a private name of
another module (``tests/unit/test_import_graph.py`` checks it).

The usual shape of a handler (CONTRIBUTING.md, "How to add a handler", walks through one)::

    from dtshard import handlers as H

    @register_handler(aten.my_op.default)
    def my_op_handler(op, args, kwargs):
        x, dim = H.bind(op, args, kwargs)          # every argument in schema order, defaults filled
        H.check_dtensors(op, [x])                  # a plain tensor mixed in: the clear error
        out_meta = H.meta_run(op, x, dim)          # global output shape/dtype, and PyTorch's errors
        with H.op_context(op):                     # collectives attributed to the op (CommCounter)
            xl = H.to_local(x, [Replicate()])      # x's shard, moved to the layout the math needs
            yl = op(xl, dim)                       # the local computation
        return H.wrap(yl, H.make_spec(x.device_mesh, [Replicate()], out_meta.shape, out_meta.dtype))

``planned(op, args, kwargs)`` hands a call back to the rule-based path (the handler skipped), for
the cases a handler does not specialise.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor.placement_types import Placement

from dtshard._trace import op_context
from dtshard.dispatch import MixedTensorError, mixed_error, redistribute_input, resolved_local
# ``planned(op, args, kwargs)``: the rules' path for the call (its cached plan first), every
# handler skipped
from dtshard.dispatch import rules_path as planned
from dtshard.redistribute import redistribute_local
from dtshard.spec import DTensorSpec, contiguous_strides
from dtshard.tensor import DTensor, op_output

__all__ = ["DTensor", "MixedTensorError", "bind", "check_dtensors", "make_spec", "meta_run",
           "mixed_error", "op_context", "op_output", "planned", "to_local", "wrap"]


def bind(op, args: Sequence, kwargs: dict) -> list:
    """All arguments of ``op`` in schema order (defaults filled in)."""
    out = []
    for k, a in enumerate(op._schema.arguments):
        if k < len(args):
            out.append(args[k])
        elif a.name in kwargs:
            out.append(kwargs[a.name])
        elif a.has_default_value():
            out.append(a.default_value)
        else:
            raise TypeError(f"{op}: missing argument {a.name!r}")
    return out


def make_spec(mesh, placements, shape, dtype) -> DTensorSpec:
    """The spec of a contiguous DTensor of global ``shape`` and ``dtype`` on ``mesh``."""
    shape = tuple(int(s) for s in shape)
    return DTensorSpec(mesh, tuple(placements), shape, contiguous_strides(shape), dtype)


def check_dtensors(op, tensors: Sequence) -> None:
    """Raise :func:`mixed_error` for the first plain tensor among ``tensors``."""
    for t in tensors:
        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor):
            raise mixed_error(op, t)


def to_local(dt, target: Sequence[Placement], op=None) -> torch.Tensor:
    """``dt``'s local tensor redistributed to ``target`` (below autograd: no graph); the shard
    itself when ``target`` is its placements.  With ``op``, the traffic is attributed to it
    (otherwise to the enclosing :class:`op_context`)."""
    target = tuple(target)
    if target == dt._spec.placements:
        return dt._local_tensor
    if op is None:
        return redistribute_local(resolved_local(dt), dt._spec, target)
    return redistribute_input(op, dt, target)


def wrap(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor of this rank's ``local`` shard laid out as ``spec`` (the handler's output)."""
    if spec.extra is None:
        return op_output(local, spec)  # the constructor without its leaf and layout-data branches
    return DTensor(local, spec, requires_grad=False)


_meta_cache: dict = {}


def _meta_key(a):
    if isinstance(a, torch.Tensor):
        return ("T", tuple(a.shape), a.dtype)
    if isinstance(a, (list, tuple)):
        return tuple(_meta_key(b) for b in a)
    return a


def meta_run(op, *args, **kwargs):
    """Run ``op`` on meta tensors (DTensors replaced by meta tensors of their global shape): the
    global output metadata, and the error plain PyTorch would raise.  Cached per (op, shapes,
    dtypes, non-tensor args), so a handler's hot path skips it."""
    key = (op, _meta_key(args), _meta_key(tuple(sorted(kwargs.items()))))
    hit = _meta_cache.get(key)
    if hit is not None:
        return hit

    def conv(a):
        if isinstance(a, DTensor):
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        if isinstance(a, torch.Tensor):
            return a.to("meta")
        if isinstance(a, (list, tuple)):
            return type(a)(conv(b) for b in a)
        return a

    out = op(*[conv(a) for a in args], **{k: conv(v) for k, v in kwargs.items()})
    if len(_meta_cache) > 4096:
        _meta_cache.clear()
    _meta_cache[key] = out
    return out
