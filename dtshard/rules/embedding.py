"""Embedding lookups: ``embedding`` and ``embedding_dense_backward``.

Handlers, because the row-sharded (vocab-parallel) weight needs each rank's row range: with the
weight ``Shard(0)`` on a mesh dim, each rank looks up the ids that fall in its rows and writes zeros
for the others, so the output is ``Partial(sum)`` there (exactly one rank contributes each id).  The
layout is decided per mesh dim from the placements alone (so every rank of a group takes the same
decision), the inputs are redistributed through the planner (counted by ``CommCounter``), and only
the local lookup is done here.

``embedding(weight (V, D), ids)`` on one mesh dim:

==============  =====================  ======================================================
weight          ids                    output
==============  =====================  ======================================================
Shard(0)        Replicate (gathered)   Partial(sum): masked lookup of this rank's rows
Shard(1)        Replicate (gathered)   Shard(ids.ndim): this rank's columns
Replicate       Shard(d) / Replicate   Shard(d) / Replicate
Partial(sum)    Replicate (gathered)   Partial(sum) (a lookup is linear in the weight)
==============  =====================  ======================================================

``embedding_dense_backward(grad (..., D), ids, V, padding_idx, scale_grad_by_freq)`` -> (V, D):

==================  ===========  ===========================================================
grad                ids          weight gradient
==================  ===========  ===========================================================
Replicate           Replicate    Shard(0): each rank accumulates the rows it owns
Shard(d), d batch   Shard(d)     Partial(sum) (ids sliced locally when replicated)
Shard(last)         Replicate    Shard(1)
Partial(sum)        Replicate    Partial(sum) (linear in grad)
==================  ===========  ===========================================================

``scale_grad_by_freq`` divides by each id's count over ALL ids, so it never uses batch shards (the
ids and grad are gathered on those mesh dims instead).  Partial(max/min) inputs are reduced first.

``embedding_renorm_(weight, ids, max_norm, norm_type)`` (``F.embedding(..., max_norm=...)``) is
written with DTensor ops: the ids of the whole batch, the rows' norms, one in-place multiply.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard.collectives import mesh_coordinate
from dtshard.handlers import bind, make_spec, mixed_error, to_local, wrap
from dtshard.registry import register_handler
from dtshard.spec import local_shape_and_offset
from dtshard.distribute import distribute_tensor
from dtshard.tensor import DTensor

aten = torch.ops.aten
_R = Replicate()
_LINEAR = ("sum", "avg")


def _as_dtensor(op, t, mesh):
    """DTensor args stay; a 0-d plain tensor is replicated; anything else is the mixing error."""
    if isinstance(t, DTensor):
        return t
    if isinstance(t, torch.Tensor) and t.dim() == 0:
        return distribute_tensor(t, mesh, [_R] * mesh.ndim, src_data_rank=None)
    raise mixed_error(op, t)


def _mesh_of(*ts):
    for t in ts:
        if isinstance(t, DTensor):
            return t._spec.mesh
    raise TypeError("no DTensor argument")


def _row_range(shape, mesh, placements) -> tuple[int, int]:
    """(first global row, number of rows) of this rank's chunk of dim 0."""
    lshape, offset = local_shape_and_offset(shape, tuple(mesh.shape), placements, mesh_coordinate(mesh))
    return offset[0], lshape[0]


def _masked_rows(ids: torch.Tensor, lo: int, n: int):
    """(ids shifted into [0, n), in-range mask); out-of-range ids map to ``n`` (a dummy row)."""
    shifted = ids - lo
    inside = (shifted >= 0) & (shifted < n)
    return torch.where(inside, shifted, torch.full_like(shifted, n)), inside


@register_handler(aten.embedding.default)
def embedding_handler(op, args, kwargs):
    weight, ids = args[0], args[1]
    rest = list(args[2:])
    padding_idx = rest[0] if len(rest) > 0 else kwargs.get("padding_idx", -1)
    scale_grad_by_freq = rest[1] if len(rest) > 1 else kwargs.get("scale_grad_by_freq", False)
    sparse = rest[2] if len(rest) > 2 else kwargs.get("sparse", False)
    mesh = _mesh_of(weight, ids)
    weight, ids = _as_dtensor(op, weight, mesh), _as_dtensor(op, ids, mesh)
    if weight.dim() != 2:
        raise RuntimeError(f"{op}: 'weight' must be 2-D, got shape {tuple(weight.shape)}")
    if ids.dtype not in (torch.int32, torch.int64):
        raise RuntimeError(f"{op}: Expected tensor for argument #1 'indices' to have one of the following scalar "
                           f"types: Long, Int; but got {ids.dtype} instead")
    w_in, i_in, out = [], [], []
    for pw, pi in zip(weight.placements, ids.placements):
        if isinstance(pw, Partial) and pw.reduce_op not in _LINEAR:
            pw = _R
        if isinstance(pw, Shard):
            w_in.append(pw), i_in.append(_R)
            out.append(Partial("sum") if pw.dim == 0 else Shard(ids.dim()))
        elif isinstance(pw, Partial):
            w_in.append(pw), i_in.append(_R), out.append(pw)
        else:  # replicated weight: the output follows the ids (index tensors are never partial terms)
            pi = _R if isinstance(pi, Partial) else pi
            w_in.append(_R), i_in.append(pi), out.append(pi)
    w_local = to_local(weight, w_in, op)
    i_local = to_local(ids, i_in, op)
    if any(isinstance(p, Shard) and p.dim == 0 for p in w_in):
        lo, n = _row_range(tuple(weight.shape), mesh, w_in)
        mapped, inside = _masked_rows(i_local, lo, n)
        if n == 0:  # an empty chunk of rows: every id is someone else's
            local = w_local.new_zeros(tuple(i_local.shape) + (w_local.shape[1],))
        else:
            local = aten.embedding.default(w_local, torch.where(inside, mapped, 0), -1, False, False)
            local = local.masked_fill(~inside.unsqueeze(-1), 0)
    else:
        local = aten.embedding.default(w_local, i_local, padding_idx, scale_grad_by_freq, sparse)
    shape = tuple(ids.shape) + (weight.shape[1],)
    return wrap(local, make_spec(mesh, out, shape, weight.dtype))


@register_handler(aten.embedding_dense_backward.default)
def embedding_dense_backward_handler(op, args, kwargs):
    names = ("grad_output", "indices", "num_weights", "padding_idx", "scale_grad_by_freq")
    vals = list(args) + [kwargs[n] for n in names[len(args):]]
    grad, ids, num_weights, padding_idx, scale_grad_by_freq = vals
    mesh = _mesh_of(grad, ids)
    grad, ids = _as_dtensor(op, grad, mesh), _as_dtensor(op, ids, mesh)
    nd = ids.dim()  # grad is ids.shape + (D,)
    g_in, i_in, out = [], [], []
    for pg, pi in zip(grad.placements, ids.placements):
        if isinstance(pg, Partial) and pg.reduce_op not in _LINEAR:
            pg = _R
        if isinstance(pg, Partial):
            g_in.append(pg), i_in.append(_R), out.append(pg)
        elif isinstance(pg, Shard) and pg.dim == nd:  # embedding dim sharded
            g_in.append(pg), i_in.append(_R), out.append(Shard(1))
        elif isinstance(pg, Shard) and not scale_grad_by_freq:  # a batch dim of grad
            g_in.append(pg), i_in.append(pg), out.append(Partial("sum"))
        elif isinstance(pi, Shard) and not scale_grad_by_freq:  # grad replicated: slice it like the ids
            g_in.append(pi), i_in.append(pi), out.append(Partial("sum"))
        else:  # everything replicated here: each rank accumulates its own rows
            g_in.append(_R), i_in.append(_R), out.append(Shard(0))
    shape = (num_weights, grad.shape[-1])
    g_local = to_local(grad, g_in, op)
    i_local = to_local(ids, i_in, op)
    if any(isinstance(p, Shard) and p.dim == 0 for p in out):
        lo, n = _row_range(shape, mesh, out)
        mapped, _ = _masked_rows(i_local, lo, n)
        pad = padding_idx - lo if padding_idx is not None and padding_idx >= 0 and lo <= padding_idx < lo + n else -1
        # one dummy row (index n) collects every id of the other ranks; it is dropped. The counts of
        # scale_grad_by_freq are those of all ids (replicated here), so they are the global counts.
        full = aten.embedding_dense_backward.default(g_local, mapped, n + 1, pad, scale_grad_by_freq)
        local = full[:n]
    else:
        local = aten.embedding_dense_backward.default(g_local, i_local, num_weights, padding_idx, scale_grad_by_freq)
    return wrap(local, make_spec(mesh, out, shape, grad.dtype))


@register_handler(aten.embedding_renorm_.default)
def embedding_renorm_handler(op, args, kwargs):
    """``embedding_renorm_(weight, ids, max_norm, norm_type)``, in place: each row that ``ids``
    names whose ``norm_type``-norm exceeds ``max_norm`` is scaled by ``max_norm / (norm + 1e-7)``,
    as aten's kernel does (the scale worked out in float64, applied in the weight's dtype). Every
    rank takes the ids of the whole batch (gathered where the batch is sharded: a replicated
    weight must change the same rows on every rank, as one process does); the norms are DTensor
    ops (over a column-sharded weight the rules reduce them) and the scaling one in-place multiply,
    which keeps the weight's placements."""
    weight, ids, max_norm, norm_type = bind(op, args, kwargs)
    mesh = _mesh_of(weight, ids)
    weight, ids = _as_dtensor(op, weight, mesh), _as_dtensor(op, ids, mesh)
    if weight.dim() != 2:
        raise RuntimeError(f"{op}: 'weight' must be 2-D, got shape {tuple(weight.shape)}")
    every_id = to_local(ids, [_R] * ids.device_mesh.ndim, op).reshape(-1)
    named = torch.zeros(weight.shape[0], dtype=torch.bool, device=every_id.device)
    named[every_id] = True  # the same on every rank: the ids are global
    named = distribute_tensor(named, mesh, [_R] * mesh.ndim, src_data_rank=None)
    norms = aten.linalg_vector_norm.default(weight, norm_type, [1]).to(torch.float64)
    over = aten.logical_and.default(aten.gt.Scalar(norms, max_norm), named)
    scale = aten.where.self(over, max_norm / (norms + 1e-7), torch.ones((), dtype=torch.float64))
    weight.mul_(aten.unsqueeze.default(scale.to(weight.dtype), 1))
    return weight
