"""Running a planned redistribute on this rank's local tensor (:func:`redistribute_local`): one
function per step kind, packing and unpacking through ``dtshard_kernels``, large transfers through
:mod:`~dtshard.redistribute.pipelining`."""

from __future__ import annotations

import math
from typing import Sequence

import dtshard_kernels as K
import torch
from torch.distributed.tensor.placement_types import Partial, Placement
from torch.utils._python_dispatch import _get_current_dispatch_mode

from dtshard import collectives as C
from dtshard import layout as L
from dtshard.redistribute.packing import copied, note_padding, numel_except, pads_reduce_scatter, parent_length, reduce_terms, region, with_length
from dtshard.redistribute.pipelining import (all_gather_pipelined, all_to_all_pipelined, pipe_for,
                                             reduce_scatter_pipelined)
from dtshard.redistribute.planning import GroupStep, Step, plan
from dtshard.spec import DTensorSpec, chunk_range, chunk_sizes, local_shape, local_shape_and_offset

__all__ = ["redistribute_local"]


def _all_gather(x, spec, state, i, coord, d, pipe=None):
    sizes = chunk_sizes(parent_length(spec, state, i, coord, d), spec.mesh_shape[i])
    if d and pipe is None and all(v == 1 for v in x.shape[:d]):
        # every dim before d is trivial: joining along d is joining the flattened rows, which
        # the collective does in place (no unpack; the planner prices it so: planning._copy_bytes)
        lead = x.shape[:d]
        out = _gather_sizes(x.reshape(x.shape[d:]), spec, i, 0, sizes, None, tensor_dim=d)
        return out.view(*lead, *out.shape)
    return _gather_sizes(x, spec, i, d, sizes, pipe)


def _gather_sizes(x, spec, i, d, sizes, pipe, tensor_dim=None):
    """All_gather ``x`` along its dim ``d`` over mesh dim ``i`` (``sizes``: every member's length);
    ``tensor_dim``: the global tensor dim it is, where ``x`` is a view with fewer dims."""
    block = sizes[0]
    if block == 0 or numel_except(x.shape, d) == 0:
        return x.new_zeros(with_length(x.shape, d, sum(sizes)))
    even = all(s == block for s in sizes)
    if even and d == 0:
        return C.all_gather(x, spec.mesh, i)  # lands in place: no copy at all
    if pipe is not None:
        return all_gather_pipelined(x, spec, i, d, sizes, pipe)
    if x.shape[d] == block:
        buf = x.unsqueeze(0)  # a full chunk needs no padding
    else:
        note_padding(spec, d if tensor_dim is None else tensor_dim, sizes)
        buf = copied("pack", K.pack(x, d, [x.shape[d]], block))  # pad the short chunk
    gathered = C.all_gather(buf, spec.mesh, i)  # (n, *block shape)
    if d == 0:
        # torch.chunk layout: full chunks first, then one short chunk, then empty ones, so all
        # padding sits after the data: a narrow of the gathered buffer is the result
        return gathered.view(-1, *gathered.shape[2:]).narrow(0, 0, sum(sizes))
    return copied("unpack", K.unpack(gathered, d, sizes))


def _reduce_scatter(x, spec, i, me, op, d):
    # one mesh dim: the planner prices the step by its largest piece for every rank (planning.
    # _step_cost), what the padded reduce_scatter receives; the backend does the reduction
    sizes = chunk_sizes(x.shape[d], spec.mesh_shape[i])
    return _reduce_scatter_sizes(x, spec, i, me, op, d, sizes, padded=pads_reduce_scatter(op, sizes))


def _reduce_scatter_sizes(x, spec, group, me, op, d, sizes, padded=False):
    """Reduce ``x`` over ``group`` (a mesh dim, or a tuple of them flattened); member ``g`` keeps
    the ``sizes[g]`` rows of dim ``d`` that follow the previous members' (shards nest in order).
    Uneven pieces: ``padded`` pads them to the largest for one reduce_scatter (every rank receives
    k-1 of the largest); otherwise an all_to_all of the exact pieces and a local reduction (each
    rank receives the k-1 other terms of its own piece: group steps are priced so, rank by rank)."""
    block, mine = max(sizes), sizes[me]
    if x.numel() == 0:
        return x.new_zeros(with_length(x.shape, d, mine))
    if d == 0 and all(s == block for s in sizes):
        return C.reduce_scatter(x, op, spec.mesh, group)
    if not padded and any(s != block for s in sizes):
        # uneven pieces: padded to the largest, every rank would receive (k-1) x the largest
        # piece; an all_to_all of the exact pieces, then a local reduction, receives only the
        # k-1 other terms of the piece this rank keeps
        return _reduce_by_all_to_all(x, spec, group, op, d, sizes, me)
    # the packed rows are passed without keeping a name for them here: the collective drops
    # its reference once the backend has the data, so the buffer does not outlive the wait
    out = C.reduce_scatter(_packed_rows(x, d, sizes, block), op, spec.mesh, group)
    out = out.view(with_length(x.shape, d, block))
    if mine != block:
        out = copied("slice", K.slice_copy(out, d, 0, mine))
    return out


def _reduce_by_all_to_all(x, spec, group, op, d, sizes, me):
    n = len(sizes)
    per = numel_except(x.shape, d)
    flat = x.reshape(-1) if (x.is_contiguous() and all(v == 1 for v in x.shape[:d])) else \
        copied("pack", K.a2a_pack(x, d, sizes))
    recv = C.all_to_all(flat, [sizes[me] * per] * n, [v * per for v in sizes], spec.mesh, group)
    del flat
    return reduce_terms(recv.view(n, *with_length(x.shape, d, sizes[me])), op)


def _packed_rows(x, d, sizes, block):
    """``x`` split along ``d`` into ``sizes`` chunks, each padded to ``block``, stacked along dim 0
    and flattened into rows: ``(n * block, ...)`` for a dim-0 collective."""
    buf = copied("pack", K.pack(x, d, sizes, block))  # (n, *block shape)
    return buf.view(buf.shape[0] * buf.shape[1], *buf.shape[2:])


def _all_to_all(x, spec, state, i, coord, d, e, pipe=None):
    n = spec.mesh_shape[i]
    me = coord[i]
    sizes_d = chunk_sizes(parent_length(spec, state, i, coord, d), n)
    sizes_e = chunk_sizes(x.shape[e], n)
    piece = with_length(x.shape, e, sizes_e[me])  # what each peer sends me, but for its dim-d length
    out_shape = with_length(piece, d, sum(sizes_d))
    # skip the collective only on conditions every rank of the group agrees on
    if numel_except(x.shape, d, e) == 0 or sum(sizes_d) == 0 or x.shape[e] == 0:
        return x.new_zeros(out_shape)
    if pipe is not None:
        return all_to_all_pipelined(x, spec, i, me, d, e, sizes_d, sizes_e, piece, out_shape, pipe)
    if x.is_contiguous() and all(s == 1 for s in x.shape[:e]):
        flat = x.reshape(-1)  # split along the outermost non-trivial dim: already in send order
    else:
        flat = copied("pack", K.a2a_pack(x, e, sizes_e))
    per_e = numel_except(x.shape, e)
    per_d = numel_except(piece, d)
    recv = C.all_to_all(flat, [s * per_d for s in sizes_d], [s * per_e for s in sizes_e], spec.mesh, i)
    del flat  # the send buffer is dead: free it before the unpack allocates the output
    if all(s == 1 for s in piece[:d]):
        return recv.view(out_shape)  # joined along the outermost non-trivial dim: already in order
    return copied("unpack", K.a2a_unpack(recv, list(piece), d, sizes_d))


def _slice(x, spec, i, me, d):
    start, length = chunk_range(x.shape[d], spec.mesh_shape[i], me)
    if length == x.shape[d]:
        return x
    if x.is_contiguous() and all(s == 1 for s in x.shape[:d]):
        return x.narrow(d, start, length)  # a contiguous view: no copy needed
    return copied("slice", K.slice_copy(x, d, start, length))


def _run_step(x: torch.Tensor, spec: DTensorSpec, state: list, step: Step, coord) -> torch.Tensor:
    i, src, dst, kind = step.mesh_dim, step.src, step.dst, step.kind
    if spec.mesh_shape[i] == 1:
        return x  # one rank on this mesh dim: every transition is the identity
    if kind == "all_gather":
        return _all_gather(x, spec, state, i, coord, src.dim, pipe_for(x, spec, state, step))
    if kind == "all_reduce":
        return C.all_reduce(x, src.reduce_op, spec.mesh, i)
    if kind == "reduce_scatter":
        pipe = pipe_for(x, spec, state, step)
        out = None if pipe is None else reduce_scatter_pipelined(x, spec, i, coord[i], src.reduce_op, dst.dim, pipe)
        return out if out is not None else _reduce_scatter(x, spec, i, coord[i], src.reduce_op, dst.dim)
    if kind == "all_to_all":
        return _all_to_all(x, spec, state, i, coord, src.dim, dst.dim, pipe_for(x, spec, state, step))
    if kind == "slice":
        return _slice(x, spec, i, coord[i], dst.dim)
    if kind == "zero":
        # R -> P: reduce(locals) must equal the value. For sum only one rank keeps it (exact,
        # also for integers), the others hold zeros; for product likewise, the others hold ones;
        # avg, max and min keep it everywhere.
        if dst.reduce_op == "sum" and coord[i] != 0:
            return torch.zeros_like(x)
        if dst.reduce_op == "product" and coord[i] != 0:
            return torch.ones_like(x)
        return x
    raise AssertionError(f"unknown step kind {kind}")


def _run_group_step(x: torch.Tensor, spec: DTensorSpec, step: GroupStep, coord) -> torch.Tensor:
    dims = step.mesh_dims
    if step.kind in ("all_reduce", "reduce_scatter"):
        ops = {step.src[i].reduce_op for i in dims}
        op = ops.pop() if len(ops) == 1 else "sum"  # sums mixed with averages: sum, then scale
        if step.kind == "all_reduce":
            out = C.all_reduce(x, op, spec.mesh, dims)
        else:
            d = step.dst[dims[0]].dim
            sizes = _group_lengths(spec, step.dst, dims, coord, d)
            out = _reduce_scatter_sizes(x, spec, dims, C.group_rank(spec.mesh, dims), op, d, sizes)
        if len(ops) > 0:  # mixed: divide by the size of the averaged dims
            out = _divide_averaged(out, spec, step.src, dims)
        return out
    if step.kind == "exchange":
        return _exchange(x, spec, step, coord)
    if step.kind == "reduce_exchange":
        return _reduce_exchange(x, spec, step, coord)
    if step.kind == "all_gather":
        return _flat_all_gather(x, spec, step, coord)
    if step.kind == "reduce":
        return _reduce_to(x, spec, step, coord)
    raise AssertionError(f"unknown group step kind {step.kind}")


_reduce_pieces: dict = {}  # (layout, step, coordinate) -> the pieces of a reduce step


def _reduce_to(x: torch.Tensor, spec: DTensorSpec, step: GroupStep, coord) -> torch.Tensor:
    """``planning._reduce_to_steps``: one ``reduce`` of each non-empty target piece into the member
    that keeps it (every member holds a term of it: the reduced dims shard nothing in the source),
    in group order on every member; averages divide by the size of their mesh dims."""
    dims = step.mesh_dims
    key = (spec.shape, spec.mesh_shape, step.src, step.dst, dims, coord)
    pieces = _reduce_pieces.get(key)
    if pieces is None:  # (member, its target's slices of this rank's shard), for the non-empty ones
        _bound(_reduce_pieces)
        _, base = local_shape_and_offset(spec.shape, spec.mesh_shape, step.src, coord)
        pieces = _reduce_pieces[key] = [
            (g, tuple((o - b, n) for o, b, n in zip(offset, base, shape)))
            for g, (shape, offset) in enumerate(local_shape_and_offset(spec.shape, spec.mesh_shape, step.dst, m)
                                                for m in L.group_coords(spec.mesh_shape, dims, coord))
            if math.prod(shape)]
    me = L.group_index(spec.mesh_shape, dims, coord)
    out = None
    op = _terms_op(step.src, dims)
    for g, slices in pieces:
        got = C.reduce(region(x, slices), op, spec.mesh, dims, g)
        if g == me:
            out = got
    if out is None:  # this member's target is empty
        return x.new_empty(local_shape(spec.shape, spec.mesh_shape, step.dst, coord))
    return _divide_averaged(out, spec, step.src, dims)


def _terms_op(src, dims) -> str:
    """The reduction that combines the terms of the Partial dims ``dims`` of ``src``: max or min
    where that is every dim's, else a sum (averages are then divided by :func:`_divide_averaged`)."""
    ops = {src[i].reduce_op for i in dims}
    return ops.pop() if ops in ({"max"}, {"min"}) else "sum"


def _divide_averaged(out: torch.Tensor, spec: DTensorSpec, src, dims) -> torch.Tensor:
    """``out`` (a sum over the Partial dims ``dims``) divided by the size of those that average."""
    n_avg = math.prod(spec.mesh_shape[i] for i in dims if src[i].reduce_op == "avg")
    if n_avg > 1:
        out = out / n_avg if out.is_floating_point() or out.is_complex() else out // n_avg
    return out


_lengths: dict = {}


def _group_lengths(spec: DTensorSpec, placements, dims, coord, d) -> list[int]:
    """Tensor dim ``d``'s local length on each member of ``coord``'s group over ``dims`` (the
    split sizes of a flattened collective), computed once per layout: a group may have
    thousands of members, and a cached call must not walk them again."""
    key = (spec.shape, spec.mesh_shape, tuple(placements), dims, coord, d)
    hit = _lengths.get(key)
    if hit is None:
        if len(_lengths) >= 4096:
            _lengths.clear()
        hit = _lengths[key] = [local_shape(spec.shape, spec.mesh_shape, placements, c)[d]
                               for c in L.group_coords(spec.mesh_shape, dims, coord)]
    return hit


def _flat_all_gather(x: torch.Tensor, spec: DTensorSpec, step: GroupStep, coord) -> torch.Tensor:
    """All-gather tensor dim ``d`` over the flattened group of the mesh dims that shard it last:
    group rank order is the nesting order of their chunks, so the pieces, padded to the largest,
    concatenate (unpadded) into the parent chunk."""
    dims = step.mesh_dims
    d = step.src[dims[0]].dim
    sizes = _group_lengths(spec, step.src, dims, coord, d)
    block = max(sizes)
    if block == 0 or numel_except(x.shape, d) == 0:
        return x.new_zeros(with_length(x.shape, d, sum(sizes)))
    if d == 0 and all(v == block for v in sizes):
        return C.all_gather(x, spec.mesh, dims)  # lands in place
    if x.shape[d] == block:
        buf = x.unsqueeze(0)
    else:
        note_padding(spec, d, sizes)
        buf = copied("pack", K.pack(x, d, [x.shape[d]], block))
    gathered = C.all_gather(buf, spec.mesh, dims)  # (k, *block shape)
    if d == 0:
        # pieces nest in order with any short ones last in each parent: drop each piece's padding
        if all(v == block for v in sizes[:-1]) or sum(sizes) == block * len(sizes):
            return gathered.view(-1, *gathered.shape[2:]).narrow(0, 0, sum(sizes))
    return copied("unpack", K.unpack(gathered, d, sizes))


_exchange_plans: dict = {}  # (layout, step, coordinate) -> this rank's ExchangePlan


def _bound(cache: dict, limit: int = 512) -> None:
    """Empty a full cache before the next entry (an ExchangePlan holds a slot per group member)."""
    if len(cache) >= limit:
        cache.clear()


def _exchange(x: torch.Tensor, spec: DTensorSpec, step: GroupStep, coord) -> torch.Tensor:
    """One all_to_all over the flattened group: each rank sends each peer exactly the atoms the
    peer lacks and it holds (dtshard.layout), and copies what it keeps."""
    key = (spec.shape, spec.mesh_shape, step.src, step.dst, step.mesh_dims, coord)
    ep = _exchange_plans.get(key)
    if ep is None:
        _bound(_exchange_plans)
        ep = _exchange_plans[key] = L.exchange_plan(spec.shape, spec.mesh_shape, step.src, step.dst,
                                                    step.mesh_dims, coord)
    out = x.new_empty(ep.dst_shape)
    for t in ep.keeps:
        region(out, t.dst_slices).copy_(region(x, t.src_slices))
    if not ep.any_traffic:  # the same answer on every member of the group
        return out
    if ep.gather:
        # every member needs every other member's whole shard (a strided gather): one all_gather
        # of the shards as they are, then each member's atoms copied out of its shard
        gathered = C.all_gather(x.contiguous().reshape(-1), spec.mesh, step.mesh_dims).view(ep.group_size, -1)
        for g, ts in ep.receiving:
            shard = gathered[g].view(ep.src_shape)
            for t in ts:
                region(out, t.dst_slices).copy_(region(shard, t.src_slices))
        return out
    idx = _indexed(key, ep, x, None)
    if idx is not None:  # many small boxes: one gather and one scatter (see _indexed)
        recv = C.all_to_all(x.reshape(-1).index_select(0, idx[0]), ep.recv_sizes(), ep.send_sizes(), spec.mesh,
                            step.mesh_dims)
        out.view(-1).index_copy_(0, idx[1], recv)
        return out if idx[1].numel() else C.consumed(out, recv)
    pieces = [region(x, t.src_slices).reshape(-1) for _, ts in ep.sending for t in ts]
    send = torch.cat(pieces) if pieces else x.new_empty(0)
    recv = C.all_to_all(send, ep.recv_sizes(), ep.send_sizes(), spec.mesh, step.mesh_dims)
    off = 0
    for _, ts in ep.receiving:
        for t in ts:
            region(out, t.dst_slices).copy_(recv[off:off + t.numel].view([n for _, n in t.dst_slices]))
            off += t.numel
    return out if off else C.consumed(out, recv)  # receiving nothing, this rank still takes part


#: an exchange with at least this many boxes of at most _INDEXED_BOX elements on average (and
#: _INDEXED_MAX in all) packs and unpacks with one index_select / index_copy_ over cached flat
#: indices instead of a copy per box: a copy call costs ~5-10 us of Python, an indexed element
#: ~25 ns (measured on this CPU), so small boxes gain and large ones keep their block copies
_INDEXED_MIN_BOXES = 16
_INDEXED_BOX = 256
_INDEXED_MAX = 1 << 20
_indices: dict = {}


def _indexed(key, ep, x, slot_of):
    """``(send positions in x, receive positions in the output)`` as flat index tensors, cached
    per plan, or None where per-box copies are the better way.  A rank that exchanges a few
    elements with hundreds of peers (a reducing exchange at scale) would otherwise spend a Python
    copy per box; indices cost 8 bytes an element, so large transfers keep the block copies.
    ``slot_of(g)``: the row of the terms stack that member g's boxes land in (reducing exchanges)."""
    if type(x) is not torch.Tensor or torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        return None  # traced (fake tensors must not be cached): the per-box copies, same collective
    key = (key, x.device)
    hit = _indices.get(key, _NO_INDEX)
    if hit is not _NO_INDEX:
        return hit
    boxes = sum(len(ts) for _, ts in ep.sending) + sum(len(ts) for _, ts in ep.receiving)
    moved = sum(ep.send_sizes()) + sum(ep.recv_sizes())
    idx = None
    if boxes >= _INDEXED_MIN_BOXES and moved <= min(_INDEXED_MAX, _INDEXED_BOX * boxes):
        src = torch.arange(x.numel(), device=x.device).view(x.shape)
        send = [region(src, t.src_slices).reshape(-1) for _, ts in ep.sending for t in ts]
        n_dst = math.prod(ep.dst_shape)
        dst = torch.arange(n_dst, device=x.device).view(ep.dst_shape)
        recv = [region(dst, t.dst_slices).reshape(-1) + (slot_of(g) * n_dst if slot_of else 0)
                for g, ts in ep.receiving for t in ts]
        empty = torch.empty(0, dtype=torch.long, device=x.device)
        idx = (torch.cat(send) if send else empty, torch.cat(recv) if recv else empty)
    _bound(_indices)
    _indices[key] = idx
    return idx


_NO_INDEX = object()


def _reduce_exchange(x: torch.Tensor, spec: DTensorSpec, step: GroupStep, coord) -> torch.Tensor:
    """One all_to_all over the flattened group that reduces its Partial mesh dims on the way
    (``planning._reduce_exchange_steps``): each rank receives, for every coordinate on those dims
    but its own, the term of each element of its target shard, stacks them by coordinate (its own
    term in its place) and reduces the stack (a sum, or a max or min when that is the one
    reduction), so every rank adds the terms of an element in the same order (replicas stay
    bit-identical).  Averages divide by the size of their mesh dims."""
    dims = step.mesh_dims
    red = tuple(i for i in dims if isinstance(step.src[i], Partial))
    key = (spec.shape, spec.mesh_shape, step.src, step.dst, dims, coord, red)
    ep = _exchange_plans.get(key)
    if ep is None:
        _bound(_exchange_plans)
        ep = _exchange_plans[key] = L.exchange_plan(spec.shape, spec.mesh_shape, step.src, step.dst, dims, coord, red)
    red_shape = [spec.mesh_shape[i] for i in red]

    def term(c) -> int:  # row-major index of a member's coordinates on the reduced dims
        k = 0
        for i, n in zip(red, red_shape):
            k = k * n + c[i]
        return k

    # every slot is written whole: the keeps and the receives cover each term of the target once
    # (exchange_plan checks the count), so no zero fill
    terms = x.new_empty((math.prod(red_shape), *ep.dst_shape))
    mine = terms[term(coord)]
    for t in ep.keeps:
        region(mine, t.dst_slices).copy_(region(x, t.src_slices))
    unread = None
    idx = _indexed(key, ep, x, lambda g: term(L.group_member(spec.mesh_shape, dims, coord, g))) \
        if ep.any_traffic else None
    if idx is not None:  # many small boxes: one gather and one scatter (see _indexed)
        recv = C.all_to_all(x.reshape(-1).index_select(0, idx[0]), ep.recv_sizes(), ep.send_sizes(), spec.mesh,
                            dims)
        terms.view(-1).index_copy_(0, idx[1], recv)
        unread = None if idx[1].numel() else recv
    elif ep.any_traffic:
        pieces = [region(x, t.src_slices).reshape(-1) for _, ts in ep.sending for t in ts]
        send = torch.cat(pieces) if pieces else x.new_empty(0)
        recv = C.all_to_all(send, ep.recv_sizes(), ep.send_sizes(), spec.mesh, dims)
        off = 0
        for g, ts in ep.receiving:
            slot = terms[term(L.group_member(spec.mesh_shape, dims, coord, g))]
            for t in ts:
                region(slot, t.dst_slices).copy_(recv[off:off + t.numel].view([n for _, n in t.dst_slices]))
                off += t.numel
        unread = None if off else recv
    out = reduce_terms(terms, _terms_op(step.src, red))
    if unread is not None:  # receiving nothing, this rank still takes part (see C.consumed)
        out = C.consumed(out, unread)
    return _divide_averaged(out, spec, step.src, red)


def redistribute_local(x: torch.Tensor, spec: DTensorSpec, dst: Sequence[Placement],
                       async_op: bool = False) -> torch.Tensor:
    """Run the planned transition on this rank's local tensor ``x`` (no autograd).  With
    ``async_op`` the LAST step's collective may still be in flight when this returns (its result
    an ``AsyncCollectiveTensor``, waited on first use); earlier steps need their data anyway."""
    steps = plan(spec, dst)
    if not steps:
        return x
    coord = C.mesh_coordinate(spec.mesh)
    state = list(spec.placements)
    for k, step in enumerate(steps):
        last = async_op and k == len(steps) - 1
        with C.in_flight() if last else _NO_CONTEXT:
            if isinstance(step, GroupStep):
                x = _run_group_step(x, spec, step, coord)
                state = list(step.dst)
                continue
            x = _run_step(x, spec, state, step, coord)
        state[step.mesh_dim] = step.dst
    return x


class _NoContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_NO_CONTEXT = _NoContext()
