"""Helpers shared by the rule families: einsum-shaped strategies and broadcasting."""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dtshard.spec import TensorMeta, contiguous_strides  # noqa: F401  (re-exported for rules)

R = Replicate()
LINEAR_REDUCE_OPS = ("sum", "avg")


def aten_ops(names) -> list:
    """The aten overloads named ``"packet.overload"`` (``"packet"`` for ``.default``), skipping
    names this torch build does not have."""
    aten = torch.ops.aten
    out = []
    for n in names:
        packet, _, overload = n.partition(".")
        op = getattr(getattr(aten, packet, None), overload or "default", None)
        if op is not None:
            out.append(op)
    return out


def einsum_strategies(equation: str, *, linear: bool = True) -> list:
    """Strategies of an einsum-shaped op, e.g. ``"mk,kn->mn"`` for mm.

    - a letter kept in the output: shard it in every input that has it (others replicated) and in
      the output;
    - a contracted letter: shard it in the inputs that have it; the output is Partial(sum);
    - ``linear``: the op is linear in each input separately, so one Partial input with the others
      replicated gives a Partial output.
    """
    lhs, out = equation.replace(" ", "").split("->")
    inputs = lhs.split(",")
    strategies = []
    for letter in dict.fromkeys(lhs.replace(",", "")):
        ins = tuple(Shard(s.index(letter)) if letter in s else R for s in inputs)
        if letter in out:
            strategies.append(((Shard(out.index(letter)),), ins))
        else:
            strategies.append(((Partial("sum"),), ins))
    if linear:
        for k in range(len(inputs)):
            for op in LINEAR_REDUCE_OPS:
                ins = tuple(Partial(op) if j == k else R for j in range(len(inputs)))
                strategies.append(((Partial(op),), ins))
    return strategies


def broadcast_shape(*shapes, strict_for=None) -> tuple[int, ...]:
    """The broadcast shape of ``shapes``.  With ``strict_for=op``, sizes that differ and are not 1
    raise (naming the op), as the op itself would; otherwise the later size wins."""
    ndim = max((len(s) for s in shapes), default=0)
    out = [1] * ndim
    for s in shapes:
        for i, v in enumerate(s):
            j = ndim - len(s) + i
            if v != 1:
                if strict_for is not None and out[j] != 1 and out[j] != v:
                    raise RuntimeError(f"{strict_for}: the shapes {[tuple(x) for x in shapes]} do not broadcast")
                out[j] = v
    return tuple(out)


def follow_output(t: TensorMeta, out_shape, p: Placement) -> Placement:
    """The placement an input that broadcasts to ``out_shape`` needs when the output has ``p``."""
    if isinstance(p, Shard):
        d = p.dim - (len(out_shape) - t.ndim)
        if d < 0 or (t.shape[d] == 1 and out_shape[p.dim] != 1):
            return R
        return Shard(d)
    return p


def norm_dim(d: int, ndim: int) -> int:
    return d % ndim if ndim else 0


def norm_dims(dims, ndim: int) -> list[int]:
    if dims is None:
        return list(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    if len(dims) == 0:  # aten convention: an empty dim list reduces everything
        return list(range(ndim))
    return sorted({norm_dim(d, ndim) for d in dims})
