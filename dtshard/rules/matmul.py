"""Matrix products: mm, bmm, addmm, baddbmm, dot, mv (linear/matmul decompose into these).

Each is an einsum: shard a kept index, or shard the contracted index for a Partial(sum) output.
The additive ``input`` of addmm/baddbmm follows the output placement through broadcasting (a
Partial output takes the bias as Partial: one rank adds it, which is exact).
"""

from __future__ import annotations

import torch

from dtshard.registry import OpCall, register_rule
from dtshard.rules._common import broadcast_shape, contiguous_strides, einsum_strategies, follow_output
from dtshard.spec import TensorMeta

aten = torch.ops.aten


def _product_meta(call: OpCall, a: TensorMeta, b: TensorMeta, batched: bool, addend=None):
    """Output metadata of mm/bmm (and addmm/baddbmm with ``addend``), with the checks their meta
    kernels make: operand ranks, matching inner (and batch) sizes, a broadcastable
    addend.  The output is contiguous.  Declines (None) for mixed dtypes."""
    nd = 3 if batched else 2
    if a.ndim != nd or b.ndim != nd:
        raise RuntimeError(f"{call.op}: expected {nd}-D operands, got {a.shape} and {b.shape}")
    if a.shape[-1] != b.shape[-2] or (batched and a.shape[0] != b.shape[0]):
        raise RuntimeError(f"{call.op}: shapes {a.shape} and {b.shape} cannot be multiplied")
    out = a.shape[:-1] + b.shape[-1:]
    if len({a.dtype, b.dtype} | ({addend.dtype} if addend is not None else set())) != 1:
        return None  # mixed dtypes: the meta kernels differ (mm accepts them, bmm raises); ask them
    if addend is not None:
        if addend.ndim > nd or broadcast_shape(addend.shape, out) != out or any(
                s not in (1, o) for s, o in zip(reversed(addend.shape), reversed(out))):
            raise RuntimeError(f"{call.op}: the addend of shape {addend.shape} does not broadcast to {out}")
    return [TensorMeta(out, contiguous_strides(out), a.dtype)]


def _mm_meta(call: OpCall):
    return _product_meta(call, call.tensors[0], call.tensors[1], False) if len(call.tensors) == 2 else None


def _bmm_meta(call: OpCall):
    return _product_meta(call, call.tensors[0], call.tensors[1], True) if len(call.tensors) == 2 else None


def _addmm_meta(call: OpCall):
    return _product_meta(call, call.tensors[1], call.tensors[2], False, call.tensors[0]) if len(call.tensors) == 3 else None


def _baddbmm_meta(call: OpCall):
    return _product_meta(call, call.tensors[1], call.tensors[2], True, call.tensors[0]) if len(call.tensors) == 3 else None


@register_rule(aten.mm.default, meta=_mm_meta)
def mm_rule(call: OpCall):
    return einsum_strategies("mk,kn->mn")


@register_rule(aten.bmm.default, meta=_bmm_meta)
def bmm_rule(call: OpCall):
    return einsum_strategies("bmk,bkn->bmn")


@register_rule([aten.dot.default, aten.vdot.default])
def dot_rule(call: OpCall):
    return einsum_strategies("k,k->")


@register_rule(aten.mv.default)
def mv_rule(call: OpCall):
    return einsum_strategies("mk,k->m")


def _with_addend(equation: str, call: OpCall):
    bias = call.tensors[0]
    a, b = call.tensors[1], call.tensors[2]
    lhs, out = equation.split("->")
    la, lb = lhs.split(",")
    sizes = {**dict(zip(la, a.shape)), **dict(zip(lb, b.shape))}
    out_shape = broadcast_shape(bias.shape, tuple(sizes[c] for c in out))
    strategies = []
    for outs, ins in einsum_strategies(equation):
        strategies.append((outs, (follow_output(bias, out_shape, outs[0]),) + ins))
    return strategies


@register_rule(aten.addmm.default, meta=_addmm_meta)
def addmm_rule(call: OpCall):
    return _with_addend("mk,kn->mn", call)


@register_rule(aten.baddbmm.default, meta=_baddbmm_meta)
def baddbmm_rule(call: OpCall):
    return _with_addend("bmk,bkn->bmn", call)


@register_rule(aten.addmv.default)
def addmv_rule(call: OpCall):
    return _with_addend("mk,k->m", call)


@register_rule(aten.addr.default)
def addr_rule(call: OpCall):
    return _with_addend("m,n->mn", call)


@register_rule(aten.addbmm.default)
def addbmm_rule(call: OpCall):
    return _with_addend("bmk,bkn->mn", call)
