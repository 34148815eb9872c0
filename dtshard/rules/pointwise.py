"""Pointwise ops: every functional aten overload tagged ``torch.Tag.pointwise``.

Any output dim may be sharded; each input follows through broadcasting (a size-1 or missing dim is
replicated).  Ops that are linear in some inputs also pass Partial through (add/sub of Partials,
mul/div of a Partial by a replicated factor, the ``*_backward`` ops linear in the gradient).
In-place and ``.out`` overloads derive from these rules in the dispatcher.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Shard
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode

from dtshard import hooks
from dtshard.registry import OpCall, register_rule
from dtshard.spec import TensorMeta
from dtshard.rules._common import LINEAR_REDUCE_OPS, R, broadcast_shape, contiguous_strides, follow_output
from dtshard.registry import get_entry

aten = torch.ops.aten

# Ops linear in ALL tensor inputs jointly (f(a1+a2, b1+b2) = f(a1,b1) + f(a2,b2)); only when every
# tensor operand is a DTensor: add(P, 2.0) is NOT a partial term of x + 2 (each rank would add 2).
_LINEAR_JOINT = {aten.add.Tensor, aten.sub.Tensor, aten.neg.default, aten.positive.default}
# Ops linear in ONE operand when the others are fixed: op -> schema positions of such operands.
# The strategy makes the DTensor at that position Partial and every other DTensor Replicate; plain
# scalars / 0-d tensors elsewhere are fixed factors (mul(P, 2.0) is fine; div(2.0, P) is not, and
# is never offered because position 0 is then not a DTensor).
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
    aten.elu_backward.default: (0,),
    aten.log_sigmoid_backward.default: (0,),
    aten.softplus_backward.default: (0,),
    aten.hardsigmoid_backward.default: (0,),
    aten.hardswish_backward.default: (0,),
    aten.mish_backward.default: (0,),
    aten.softshrink_backward.default: (0,),
    aten.hardshrink_backward.default: (0,),
}
_LINEAR_JOINT.add(aten.rsub.Tensor)
# complex(re, im) is linear in (re, im) jointly: the complex numbers of the partial terms add up
_LINEAR_JOINT.add(aten.complex.default)


def _dtensor_positions(call: OpCall) -> dict[int, int]:
    """schema position of each DTensor operand -> its index in call.tensors (flat tensors only)."""
    out, k = {}, 0
    for pos, a in enumerate(call.args):
        if isinstance(a, TensorMeta):
            out[pos] = k
            k += 1
        elif isinstance(a, (list, tuple)):
            k += sum(1 for b in a if isinstance(b, TensorMeta))
    return out


def _tensor_operands(call: OpCall) -> int:
    """How many operands of the call are tensors or numbers standing in for tensors (schema
    arguments of type Tensor), DTensor or not."""
    n = 0
    for pos, a in enumerate(call.op._schema.arguments):
        if str(a.type) == "Tensor" and pos < len(call.args):
            n += 1
    return n


def pointwise_rule(call: OpCall):
    tensors = call.tensors
    out_shape = broadcast_shape(*(t.shape for t in tensors))
    strategies = []
    for d in range(len(out_shape)):
        out = Shard(d)
        strategies.append(((out,), tuple(follow_output(t, out_shape, out) for t in tensors)))
    op = call.op
    n = len(tensors)
    positions = _dtensor_positions(call)
    all_dtensor = len(positions) == n and _tensor_operands(call) == n
    if op in _LINEAR_JOINT and all_dtensor and all(t.shape == out_shape for t in tensors):
        for red in LINEAR_REDUCE_OPS:
            strategies.append(((Partial(red),), (Partial(red),) * n))
    if op is aten.where.self and n == 3 and all_dtensor and tensors[1].shape == tensors[2].shape == out_shape:
        # where(cond, P, P) -> P: each partial term picks from its own a_i / b_i
        for red in LINEAR_REDUCE_OPS:
            strategies.append(((Partial(red),), (R, Partial(red), Partial(red))))
    elif op is aten.masked_fill.Scalar and positions.get(0) == 0:
        # a constant on every rank: a valid max/min term; zero is a valid sum/avg term too
        value = call.arg(2, "value")
        reds = ("max", "min") + (("sum", "avg") if value == 0 and not isinstance(value, bool) else ())
        if tensors[0].shape == out_shape:
            for red in reds:
                strategies.append(((Partial(red),), (Partial(red),) + (R,) * (n - 1)))
    elif op in _LINEAR_IN:
        for pos in _LINEAR_IN[op]:
            k = positions.get(pos)
            if k is not None and tensors[k].shape == out_shape:
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
        if torch.Tag.nondeterministic_seeded in op.tags:
            continue  # random (rrelu, ...): dtshard/rules/random.py draws them consistently
        if not op._schema.returns or any(str(r.type) != "Tensor" for r in op._schema.returns):
            continue  # e.g. equal -> bool: a per-shard answer is not the global one (misc.py)
        ops.append(op)
    return ops


# Ops that are not tagged pointwise but shard like it (elementwise, broadcasting).
_EXTRA = [
    aten.where.self,
    aten.floor_divide.default,
    aten.rsub.Tensor,
    aten.elu_backward.default,
    aten.log_sigmoid_forward.default,
    aten.log_sigmoid_backward.default,
    aten.softplus_backward.default,
    aten.hardsigmoid_backward.default,
    aten.hardswish_backward.default,
    aten.mish_backward.default,
    aten.softshrink_backward.default,
    aten.hardshrink_backward.default,
    aten.masked_fill.Tensor,
    aten.threshold_backward.default,
    aten.gelu_backward.default,
    aten.hardtanh_backward.default,
    aten.leaky_relu_backward.default,
    aten.complex.default,  # complex(re, im) and polar(abs, angle): elementwise, broadcasting
    aten.polar.default,
]

# Tagged pointwise but owned by another family (which also passes Partial through).
_ELSEWHERE = {aten.clone.default, aten._to_copy.default, aten.copy.default, aten.fill.Scalar, aten.zero.default}

def _tiny(a):
    """A 1-element CPU tensor standing in for a tensor argument (dtype promotion only looks at
    dtypes and at whether a tensor is 0-d)."""
    if isinstance(a, TensorMeta):
        return torch.ones((1,) * a.ndim, dtype=a.dtype)
    if isinstance(a, torch.Tensor):
        if a.device.type != "cpu":
            raise _Decline
        return torch.ones(a.shape, dtype=a.dtype)
    if isinstance(a, (list, tuple)) and any(isinstance(b, (TensorMeta, torch.Tensor)) for b in a):
        return type(a)(_tiny(b) for b in a)
    return a


class _Decline(Exception):
    pass


def pointwise_meta(call: OpCall):
    """Output metadata of a pointwise op without a meta-kernel run: every output has the broadcast
    shape of the tensor operands (plain 0-d tensors broadcast to anything) and contiguous strides
    (what the kernel gives for contiguous inputs); the dtypes come from running the op on
    1-element CPU tensors of the operands' dtypes (type promotion is the same on every device).
    Declines (None: use the meta kernel) where that run fails, e.g. an op that rejects a dtype."""
    shape = broadcast_shape(*(t.shape for t in call.tensors), strict_for=call.op)
    try:
        if _current_mode() is None:
            out = call.op(*(_tiny(a) for a in call.args), **{k: _tiny(v) for k, v in call.kwargs.items()})
        else:  # outside the caller's dispatch modes (fake/proxy under compile, user modes): not traced
            with _disable_current_modes():
                out = call.op(*(_tiny(a) for a in call.args), **{k: _tiny(v) for k, v in call.kwargs.items()})
    except Exception:  # noqa: BLE001 - the meta kernel gives the real error
        return None
    outs = out if isinstance(out, (list, tuple)) else (out,)
    stride = contiguous_strides(shape)
    return [TensorMeta(shape, stride, o.dtype) for o in outs]


_POINTWISE = sorted({*_pointwise_ops(), *_EXTRA} - _ELSEWHERE, key=str)
# the rule reads no number's value (masked_fill.Scalar's fill value aside: zero keeps Partial(sum))
# and pointwise_meta's dtypes follow the numbers' types: plans are keyed on the types
_VALUE_READ = {aten.masked_fill.Scalar}
register_rule([op for op in _POINTWISE if op not in _VALUE_READ], meta=pointwise_meta,
              scalar_values=False)(pointwise_rule)
register_rule([op for op in _POINTWISE if op in _VALUE_READ], meta=pointwise_meta)(pointwise_rule)


@hooks.on_dynamo_import
def register_compile_prims() -> None:
    """Rules for the pointwise prims that only exist once ``torch._inductor.inductor_prims`` is
    imported, which Dynamo uses to rewrite ops (``prims.fma``: ``a * b + c``, from ``lerp`` and
    ``add(alpha=)`` in compiled optimizers).  Run when ``torch._dynamo`` is imported (``dtshard.hooks``)."""
    import torch._inductor.inductor_prims  # noqa: F401  (defines torch.ops.prims.fma)

    fma = torch.ops.prims.fma.default
    if get_entry(fma) is None:
        register_rule(fma, meta=pointwise_meta)(pointwise_rule)


def _prelu_weight_placement(x, w, d: int):
    """The weight's placement when ``x`` is sharded on dim ``d``: the same shard where the
    weight (right-aligned, as broadcasting aligns it) spans that dim, else Replicate (it
    broadcasts along it)."""
    wd = d - (x.ndim - w.ndim)
    return Shard(wd) if wd >= 0 and w.shape[wd] == x.shape[d] and x.shape[d] > 1 else R


@register_rule(aten._prelu_kernel.default)
def prelu_rule(call: OpCall):
    # prelu(x, weight): elementwise, the weight broadcast into x ((1, C, 1, ...) from F.prelu)
    x, w = call.tensors[0], call.tensors[1]
    return [((Shard(d),), (Shard(d), _prelu_weight_placement(x, w, d))) for d in range(x.ndim)]


@register_rule(aten._prelu_kernel_backward.default)
def prelu_backward_rule(call: OpCall):
    # (grad_input, grad_weight) of prelu(x, weight), BOTH of x's (broadcast) shape: the kernel is
    # elementwise and autograd sums grad_weight to the weight's shape in a separate op. So every
    # dim of x shards both outputs, with nothing moved; both are linear in the output gradient,
    # so a Partial gradient gives Partial results.
    g, x, w = call.tensors
    strategies = [((Shard(d), Shard(d)), (Shard(d), Shard(d), _prelu_weight_placement(x, w, d)))
                  for d in range(x.ndim)]
    strategies.append(((Partial("sum"), Partial("sum")), (Partial("sum"), R, R)))
    return strategies
