"""Matrix products: mm, bmm, addmm, baddbmm, dot, mv (linear/matmul decompose into these).

Each is an einsum: shard a kept index, or shard the contracted index for a Partial(sum) output.
The additive ``input`` of addmm/baddbmm follows the output placement through broadcasting (a
Partial output takes the bias as Partial: one rank adds it, which is exact).
"""

from __future__ import annotations

import torch

from dtshard.registry import OpCall, register_rule
from dtshard.rules._common import broadcast_shape, einsum_strategies, follow_output

aten = torch.ops.aten


@register_rule(aten.mm.default)
def mm_rule(call: OpCall):
    return einsum_strategies("mk,kn->mn")


@register_rule(aten.bmm.default)
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


@register_rule(aten.addmm.default)
def addmm_rule(call: OpCall):
    return _with_addend("mk,kn->mn", call)


@register_rule(aten.baddbmm.default)
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
