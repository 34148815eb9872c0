"""Matrix products: mm, bmm, addmm, baddbmm, dot, mv (linear/matmul decompose into these), and
linear/matmul themselves for inference mode, where they arrive undecomposed.

Each is an einsum: shard a kept index, or shard the contracted index for a Partial(sum) output.
The additive ``input`` of addmm/baddbmm follows the output placement through broadcasting (a
Partial output takes the bias as Partial: one rank adds it, which is exact).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from dtshard.registry import OpCall, register_rule
from dtshard.rules._common import (LINEAR_REDUCE_OPS, R, broadcast_shape, contiguous_strides, einsum_strategies,
                                   follow_output)
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


# ---------------------------------------------------------------------------------------------
# linear and matmul: CompositeImplicitAutograd ops, which reach dtshard undecomposed only under
# torch.inference_mode() (autograd decomposes them otherwise).  Without these rules the dispatcher
# would run their decompositions (dispatch._decompose: t + addmm, or views + mm + _unsafe_view),
# which is correct too; one rule is one dispatch instead of several.
# ---------------------------------------------------------------------------------------------

_LETTERS = "abcdefghijlopqrstuvwxyz"  # batch dims; m, k, n are the matrix dims


def _indexed_strategies(inputs, out: str) -> list:
    """The strategies of an einsum-like product whose inputs carry ``None`` for a dim that
    broadcasts (size 1 against a larger output size): such a dim is never sharded, and an input
    without a kept letter is replicated.  Otherwise as :func:`einsum_strategies`: a kept letter
    sharded wherever it appears, a contracted letter (``k``) sharded in both for Partial(sum),
    and, the product being linear in each input, one Partial input with the others replicated."""
    letters = dict.fromkeys(c for s in inputs for c in s if c is not None)
    strategies = []
    for c in letters:
        ins = tuple(Shard(s.index(c)) if c in s else R for s in inputs)
        if c in out:
            strategies.append(((Shard(out.index(c)),), ins))
        elif all(c in s for s in inputs):
            strategies.append(((Partial("sum"),), ins))
    for j in range(len(inputs)):
        for op in LINEAR_REDUCE_OPS:
            strategies.append(((Partial(op),), tuple(Partial(op) if i == j else R for i in range(len(inputs)))))
    return strategies


def _batch_letters(shape, out_batch) -> list:
    """Letters of ``shape``'s batch dims aligned from the right with the output's batch dims
    ``out_batch`` (a list of (letter, size)); a broadcasting size-1 dim gets ``None``."""
    off = len(out_batch) - len(shape)
    return [None if s == 1 and out_batch[off + i][1] != 1 else out_batch[off + i][0] for i, s in enumerate(shape)]


@register_rule(aten.matmul.default)
def matmul_rule(call: OpCall):
    a, b = call.tensors
    if a.ndim == 0 or b.ndim == 0:
        return []  # matmul rejects 0-d operands (its meta kernel raises first)
    # the matrix dims: a 1-D operand is a vector (its dim is the contracted k)
    ma = "k" if a.ndim == 1 else "mk"
    mb = "k" if b.ndim == 1 else "kn"
    out_mat = ma.replace("k", "") + mb.replace("k", "")
    ba, bb = a.shape[:a.ndim - len(ma)], b.shape[:b.ndim - len(mb)]
    batch = broadcast_shape(ba, bb)
    out_batch = list(zip(_LETTERS, batch))
    la = _batch_letters(ba, out_batch) + list(ma)
    lb = _batch_letters(bb, out_batch) + list(mb)
    return _indexed_strategies([la, lb], "".join(c for c, _ in out_batch) + out_mat)


@register_rule(aten.linear.default)
def linear_rule(call: OpCall):
    x, w = call.tensors[0], call.tensors[1]
    if x.ndim == 0 or w.ndim not in (1, 2):
        return []
    lx = list(_LETTERS[:x.ndim - 1]) + ["k"]
    lw = ["n", "k"] if w.ndim == 2 else ["k"]  # a 1-D weight contracts the input's last dim away
    out = "".join(lx[:-1]) + ("n" if w.ndim == 2 else "")
    strategies = _indexed_strategies([lx, lw], out)
    if len(call.tensors) == 2:
        return strategies
    bias = call.tensors[2]
    out_shape = broadcast_shape(bias.shape, tuple(x.shape[:-1]) + tuple(w.shape[:1] if w.ndim == 2 else ()))
    # the bias follows the output (a Partial output takes it as Partial: exact, see addmm)
    return [(outs, ins + (follow_output(bias, out_shape, outs[0]),)) for outs, ins in strategies]
