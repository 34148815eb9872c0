"""Adaptive average pooling (2-D and 3-D, with their backward) over DTensors, spatial shards included.

What reaches dispatch: ``F.adaptive_avg_pool1d`` is ``unsqueeze(-2)`` + ``_adaptive_avg_pool2d`` +
``squeeze`` (an output size of 1 becomes ``mean.dim``); ``F.adaptive_avg_pool2d/3d`` with an output
of all ones become ``mean.dim`` (reduction.py's handler: a Partial(sum) result, exact for uneven
shards); every other output size reaches ``aten._adaptive_avg_pool2d/3d`` and, in backward,
``aten._adaptive_avg_pool2d/3d_backward``.  Those four are handlers here, because pooling a shard
to 1 needs a per-rank scale that no placement choice can express.

Output bin ``i`` of a dim of input length ``I`` and output length ``O`` averages the inputs
``[floor(i*I/O), ceil((i+1)*I/O))``; the dims pool independently (a bin is a box).  Per mesh dim of
the input ``x``:

=====================================  ==============  ==============  =================  ==============
x placement on this mesh dim           x runs as       output          grad_out runs as   grad_input
=====================================  ==============  ==============  =================  ==============
``Shard(d)``, d batch / channel        ``Shard(d)``    ``Shard(d)``    ``Shard(d)``       ``Shard(d)``
``Shard(d)`` spatial, ``O == 1``  (a)  ``Shard(d)``    ``P(sum)``      ``Replicate``      ``Shard(d)``
``Shard(d)`` spatial, aligned     (b)  ``Shard(d)``    ``Shard(d)``*   ``Shard(d)``*      ``Shard(d)``
``Shard(d)`` spatial, not aligned      ``Shard(j)`` /  ``Shard(j)`` /  ``Shard(j)`` /     ``Shard(j)`` /
                                       ``Replicate``   ``Replicate``   ``Replicate``      ``Replicate``
``Partial(sum / avg)``                 kept            same Partial    ``Replicate``      ``Replicate``
``Replicate`` (grad_out Partial)       ``Replicate``   ``Replicate``   kept Partial       same Partial
anything else                          ``Replicate``   ``Replicate``   ``Replicate``      ``Replicate``
=====================================  ==============  ==============  =================  ==============

(``*``: the torch.chunk layout of the OUTPUT length.)

(a) **Pooled to 1 along a sharded dim.**  The local pool of a shard of length ``L_r`` averages over
    ``L_r`` elements; the global bin averages over ``I``, so the global value is
    ``sum_r (L_r / I) * local_r``: each rank scales its local result by ``L_r / I`` and the output is
    ``Partial("sum")``.  An empty shard contributes 0 (the local kernel is not run on it).  Backward:
    the gradient of a bin spreads ``g / I`` over its inputs; with ``grad_out`` replicated on that
    mesh dim, the local backward of the shard gives ``g / L_r``, scaled by ``L_r / I`` again, which
    is exactly the rank's shard of ``grad_input``.
(b) **Aligned bins.**  When ``O`` divides ``I`` (bins of ``k = I / O``) and, in the chunk layout of
    both lengths over the mesh dims sharding ``d`` (all of them, in mesh-dim order), every rank's
    input chunk is exactly ``k`` times its output chunk (offset and length: :func:`blocks_align`),
    each rank's shard holds whole bins, and the bins of its shard are exactly its output chunk: the
    local op is the global op.  (With one mesh dim of ``n`` ranks this is ``ceil(I/n) % k == 0``.)
    Inner mesh dims are dropped (their shard moved elsewhere) until the rest aligns.
Not aligned: the shard of that mesh dim moves (one all_to_all) to a batch or channel dim that no
other mesh dim shards and that has at least as many elements as the mesh dim has ranks (the larger
one), so the pool is local on whole spatial dims; with no such dim it is gathered (Replicate).

All decisions depend only on global shapes and placements, so every rank of a group agrees.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dtshard import collectives as C
from dtshard.registry import register_handler
from dtshard.handlers import bind, check_dtensors, make_spec, meta_run, op_context, to_local, wrap
from dtshard.spec import DTensorSpec, chunk_classes, chunk_range, placements_str

aten = torch.ops.aten

__all__ = ["adaptive_avg_pool_handler", "adaptive_avg_pool_backward_handler", "blocks_align"]

R = Replicate()
PSUM = Partial("sum")
_FWD = {aten._adaptive_avg_pool2d.default: 2, aten._adaptive_avg_pool3d.default: 3}
_BWD = {aten._adaptive_avg_pool2d_backward.default: 2, aten._adaptive_avg_pool3d_backward.default: 3}


def blocks_align(n_in: int, n_out: int, mesh_shape: Sequence[int], mesh_dims: Sequence[int]) -> bool:
    """True when ``n_in == k * n_out`` and, with both lengths split over ``mesh_dims`` (in that
    order, torch.chunk layout), every rank's input chunk is exactly ``k`` times its output chunk:
    offset and length.  Then each rank's input chunk is made of whole blocks of ``k`` and those
    blocks are exactly its output chunk.  Pure metadata."""
    if n_out <= 0 or n_in % n_out:
        return False
    k = n_in // n_out
    # Never walks the ranks.  Mesh dim by mesh dim, each distinct output length L a rank may hold
    # there (input k*L): the split aligns when every chunk's input length is k times its output
    # length, since chunks lie in rank order (equal lengths give equal offsets, and offsets add up
    # over the mesh dims).  Where a chunk's lengths differ, the chunks below it differ somewhere too
    # (their lengths sum to the chunk's), so the first failing mesh dim decides.  Lengths are
    # constant on the ranges of chunk_classes, which stand for their coordinates.
    lengths = {n_out}
    for i in mesh_dims:
        n = mesh_shape[i]
        nxt = set()
        for ln in lengths:
            starts = {a for a, _, _ in chunk_classes(ln, n)} | {a for a, _, _ in chunk_classes(k * ln, n)}
            for c in starts:
                lo, li = chunk_range(ln, n, c)[1], chunk_range(k * ln, n, c)[1]
                if li != k * lo:
                    return False
                nxt.add(lo)
        lengths = nxt
    return True


def _context(op, tensors) -> str:
    specs = [t._spec for t in tensors]
    ins = ", ".join(f"{tuple(s.shape)} {placements_str(s.placements)}" for s in specs)
    return f"{op} on inputs [{ins}] over mesh {tuple(specs[0].mesh.shape)}"


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _layout(spec: DTensorSpec, out_shape: Sequence[int], nsp: int):
    """``(x targets, output placements, {mesh dim: tensor dim} of the mode-(a) shards)``."""
    first = spec.ndim - nsp
    mesh_shape = spec.mesh_shape
    targets: list[Placement] = []
    outs: list[Placement] = []
    scaled: dict[int, int] = {}
    for i, p in enumerate(spec.placements):
        if isinstance(p, Shard) and p.dim < first:
            targets.append(p), outs.append(p)
        elif isinstance(p, Shard) and out_shape[p.dim] == 1:  # (a)
            targets.append(p), outs.append(PSUM)
            scaled[i] = p.dim
        elif isinstance(p, Shard):  # (b), checked below
            targets.append(p), outs.append(p)
        elif isinstance(p, Partial) and p.reduce_op in ("sum", "avg"):
            targets.append(p), outs.append(p)  # the pool is linear
        else:
            targets.append(R), outs.append(R)
    moved: list[int] = []
    for d in range(first, spec.ndim):
        if out_shape[d] == 1:
            continue
        dims = [i for i, p in enumerate(targets) if isinstance(p, Shard) and p.dim == d]
        while dims and not blocks_align(spec.shape[d], out_shape[d], mesh_shape, dims):
            moved.append(dims.pop())  # drop the innermost mesh dim and try again
    for i in sorted(moved):
        taken = {p.dim for p in targets if isinstance(p, Shard)}
        free = [j for j in range(first) if j not in taken and spec.shape[j] >= mesh_shape[i]]
        if free:
            j = max(free, key=lambda j: (spec.shape[j], -j))
            targets[i] = outs[i] = Shard(j)
        else:
            targets[i] = outs[i] = R
    return tuple(targets), tuple(outs), scaled


def _scale(local_shape, global_shape, scaled: dict[int, int]) -> float | None:
    """Product of ``L_r / I`` over the mode-(a) dims (None when there are none)."""
    if not scaled:
        return None
    s = 1.0
    for d in set(scaled.values()):  # a dim sharded by two mesh dims: its final local length once
        s *= local_shape[d] / global_shape[d]
    return s


@register_handler(list(_FWD))
def adaptive_avg_pool_handler(op, args, kwargs):
    x, output_size = bind(op, args, kwargs)
    check_dtensors(op, [x])
    nsp = _FWD[op]
    try:
        gout = meta_run(op, x, list(output_size))
    except Exception as e:  # what plain PyTorch raises for these global shapes, with the context
        raise type(e)(f"{_context(op, [x])}: {e}") from e
    mesh = x._spec.mesh
    coord = C.mesh_coordinate(mesh)
    targets, outs, scaled = _layout(x._spec, gout.shape, nsp)
    out_spec = make_spec(mesh, outs, gout.shape, gout.dtype)
    out_shape = out_spec.local_shape(coord)
    with op_context(op):
        xl = to_local(x, targets)
        if xl.numel() == 0 or _numel(out_shape) == 0:  # an empty shard: its term is 0
            out = C.consumed(xl.new_zeros(out_shape, dtype=gout.dtype), xl)
        else:
            try:
                out = op(xl, list(out_shape[x.dim() - nsp:]))
            except Exception as e:
                raise type(e)(f"{_context(op, [x])}, local shard {tuple(xl.shape)} "
                              f"as {placements_str(targets)}: {e}") from e
            s = _scale(xl.shape, x.shape, scaled)
            if s is not None:
                out = out * s
    if tuple(out.shape) != out_shape:
        raise AssertionError(f"{_context(op, [x])}: local result {tuple(out.shape)} does not match "
                             f"{placements_str(outs)} at {coord} (expected {out_shape})")
    return wrap(out, out_spec)


@register_handler(list(_BWD))
def adaptive_avg_pool_backward_handler(op, args, kwargs):
    g, x = bind(op, args, kwargs)
    check_dtensors(op, [g, x])
    nsp = _BWD[op]
    try:
        meta_run(op, g, x)
    except Exception as e:
        raise type(e)(f"{_context(op, [g, x])}: {e}") from e
    mesh = x._spec.mesh
    coord = C.mesh_coordinate(mesh)
    targets, outs, scaled = _layout(x._spec, g.shape, nsp)
    g_targets, gin = [], []
    for i, (t, gp) in enumerate(zip(targets, g._spec.placements)):
        if i in scaled:  # (a): every rank of the group needs the whole bin gradient
            g_targets.append(R), gin.append(t)
        elif isinstance(t, Shard):
            g_targets.append(t), gin.append(t)
        elif isinstance(t, Partial):  # x was a partial term: its gradient is the whole gradient
            g_targets.append(R), gin.append(R)
        elif isinstance(gp, Partial) and gp.reduce_op in ("sum", "avg"):  # linear in grad_out
            g_targets.append(gp), gin.append(gp)
        else:
            g_targets.append(R), gin.append(R)
    gin_spec = make_spec(mesh, gin, x.shape, g.dtype)
    x_local_shape = gin_spec.local_shape(coord)
    with op_context(op):
        gl = to_local(g, g_targets)
        if gl.numel() == 0 or _numel(x_local_shape) == 0:
            gi = C.consumed(gl.new_zeros(x_local_shape), gl)
        else:
            # the kernel reads only the input's shape: x's own shard when it is in place
            xl = x._local_tensor if x._spec.placements == targets else gl.new_empty(x_local_shape)
            try:
                gi = op(gl, xl)
            except Exception as e:
                raise type(e)(f"{_context(op, [g, x])}, local shards {tuple(gl.shape)}, {tuple(xl.shape)} "
                              f"as {placements_str(g_targets)}, {placements_str(targets)}: {e}") from e
            s = _scale(x_local_shape, x.shape, scaled)
            if s is not None:
                gi = gi * s
    if tuple(gi.shape) != x_local_shape:
        raise AssertionError(f"{_context(op, [g, x])}: local result {tuple(gi.shape)} does not match "
                             f"{placements_str(gin)} at {coord} (expected {x_local_shape})")
    return wrap(gi, gin_spec)
