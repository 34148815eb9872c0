"""Pointwise ops: every functional aten overload tagged ``torch.Tag.pointwise``.

Any output dim may be sharded; each input follows through broadcasting (a size-1 or missing dim is
replicated).  Ops that are linear in some inputs also pass Partial through (add/sub of Partials,
mul/div of a Partial by a replicated factor, the ``*_backward`` ops linear in the gradient).
In-place and ``.out`` overloads derive from these rules in the dispatcher.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from dtshard.registry import OpCall, register_rule
from dtshard.rules._common import LINEAR_REDUCE_OPS, R, broadcast_shape, follow_output

aten = torch.ops.aten

# Ops linear in ALL tensor inputs jointly (f(a1+a2, b1+b2) = f(a1,b1) + f(a2,b2)).
_LINEAR_JOINT = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.positive.default}
# Ops linear in ONE input when the others are fixed: op -> index of that input among tensor args.
_LINEAR_IN = {
    aten.mul.Tensor: (0, 1),
    aten.div.Tensor: (0,),
    aten.mul.Scalar: (0,),
    aten.div.Scalar: (0,),
    aten.threshold_backward.default: (0,),
    aten.gelu_backward.default: (0,),
    aten.silu_backward.default: (0,),
    aten.tanh_backward.default: (0,),
    aten.sigmoid_backward.default: (0,),
    aten.hardtanh_backward.default: (0,),
    aten.leaky_relu_backward.default: (0,),
    aten.where.self: (1, 2),  # where(cond, a, b) is linear in (a, b) jointly, see below
    aten.masked_fill.Scalar: (),
}


def pointwise_rule(call: OpCall):
    tensors = call.tensors
    out_shape = broadcast_shape(*(t.shape for t in tensors))
    strategies = []
    for d in range(len(out_shape)):
        out = Shard(d)
        strategies.append(((out,), tuple(follow_output(t, out_shape, out) for t in tensors)))
    op = call.op
    n = len(tensors)
    if op in _LINEAR_JOINT and all(t.shape == out_shape for t in tensors):
        for red in LINEAR_REDUCE_OPS:
            strategies.append(((Partial(red),), (Partial(red),) * n))
    if op is aten.where.self and n == 3:
        # where(cond, P, P) -> P: each partial term picks from its own a_i / b_i
        for red in LINEAR_REDUCE_OPS:
            strategies.append(((Partial(red),), (R, Partial(red), Partial(red))))
    elif op in _LINEAR_IN:
        for k in _LINEAR_IN[op]:
            if k < n and tensors[k].shape == out_shape:
                for red in LINEAR_REDUCE_OPS:
                    ins = tuple(Partial(red) if j == k else R for j in range(n))
                    strategies.append(((Partial(red),), ins))
    return strategies


def _pointwise_ops() -> list:
    ops = []
    seen = set()
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::"):
            continue
        name, overload = schema.name[6:], schema.overload_name or "default"
        if (name, overload) in seen:
            continue
        seen.add((name, overload))
        packet = getattr(aten, name, None)
        op = getattr(packet, overload, None) if packet is not None else None
        if op is None or torch.Tag.pointwise not in op.tags or op._schema.is_mutable:
            continue
        ops.append(op)
    return ops


# Ops that are not tagged pointwise but shard like it (elementwise, broadcasting).
_EXTRA = [
    aten.where.self,
    aten.masked_fill.Tensor,
    aten.threshold_backward.default,
    aten.gelu_backward.default,
    aten.hardtanh_backward.default,
    aten.leaky_relu_backward.default,
]

# Tagged pointwise but owned by another family (which also passes Partial through).
_ELSEWHERE = {aten.clone.default, aten._to_copy.default, aten.copy.default, aten.fill.Scalar, aten.zero.default}

_POINTWISE = sorted({*_pointwise_ops(), *_EXTRA} - _ELSEWHERE, key=str)
register_rule(_POINTWISE)(pointwise_rule)
