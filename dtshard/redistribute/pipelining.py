"""Pipelined packing.

A large single-mesh-dim transfer whose collective needs a packing or an unpacking copy (all_gather
S(d)->R and reduce_scatter P->S(d) with d != 0, all_to_all S(d)->S(e)) can be cut into pieces
(config.pipeline_chunk_bytes): piece j+1 is packed while piece j is on the wire, and piece j is
unpacked while piece j+1 is.  The pieces are cut along the LEADING dim of the local tensors (the
outermost dim longer than 1 on some rank; every dim before it has length 1 everywhere), because a
piece of the leading dim is a contiguous block of the input and of the output: a piece goes on
the wire without a copy where the whole tensor would, and lands (or is unpacked) straight into
its place in the result, so every element is still copied at most once each way, exactly where
the one-collective path copies it.
  - "lead" pieces, when the leading dim is not a dim of the collective (S1->R or P->S1 of a
    (rows, cols) tensor, S0->S2 of a 3-D one): each piece is the same collective on a slab of it.
  - "sub" pieces, when the leading dim is the collective's own dim (the all_to_all of S0->S1 or
    S1->S0 of a 2-D tensor, the reduce_scatter of P->S1 of a (1, T, H) tensor): each member's
    block of that dim is cut into pieces (an all_gather there needs no copy at all: its result
    lands in place, running._all_gather).  A reduce_scatter moves piece j of every block in
    one collective; an all_to_all moves its pieces pairwise (member m sends to m+t and receives
    from m-t, t = 1..n-1, as an all_to_all with one nonzero split each way), so that each piece
    it receives lands in one contiguous range of the result (gloo's list all_to_all, which would
    do that in one call, was measured 5x slower than its all_to_all_single).
The number of pieces is a function of metadata every rank shares (global shape, placements, mesh
shape, dtype, the config), never of the local shard: a rank issuing one collective more than
its peers would deadlock.  The plan does not change, and the transfer is reported to the
observers (CommCounter) as the one collective it replaces, with that collective's bytes.
Eager only (collectives.can_pipeline): under torch.compile or a dispatch mode, and for the last
step of an async redistribute, the one-collective path runs.


"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import dtshard_kernels as K
import torch

from dtshard import collectives as C
from dtshard._config import config
from dtshard._trace import copy_observers, note_copy
from dtshard.redistribute.packing import copied, note_padding, numel_except, pads_reduce_scatter, reduce_terms, with_length
from dtshard.redistribute.planning import Step
from dtshard.spec import DTensorSpec, _itemsize, chunk_sizes, local_shape_classes, local_shapes

__all__ = ["all_gather_pipelined", "all_to_all_pipelined", "choose_pipe", "pipe_for", "reduce_scatter_pipelined"]


@dataclass(frozen=True)
class _Pipe:
    pieces: int  # lead: pieces of `dim`; sub: pieces of each member's block of `dim`
    dim: int  # the leading dim
    sub: bool  # `dim` is a dim of the collective


#: reductions a pipelined reduce_scatter can do (the ProcessGroup's own; avg runs un-pipelined)
_PIPE_OPS = ("sum", "max", "min", "product")
_pipes: dict = {}


def pipe_for(x: torch.Tensor, spec: DTensorSpec, state, step: Step) -> _Pipe | None:
    """How to cut ``step``'s transfer into pieces, or None for one collective."""
    cfg = config
    chunk = cfg.pipeline_chunk_bytes
    # the global tensor bounds every local buffer: most transfers stop here (the dtype, hence the
    # element size, is the same on every rank)
    if not chunk or math.prod(spec.shape) * x.element_size() < 2 * chunk \
            or spec.mesh.device_type not in cfg.pipeline_device_types or not C.can_pipeline(x):
        return None
    key = (spec.shape, spec.mesh_shape, tuple(state), step, spec.dtype, chunk, cfg.pipeline_max_chunks)
    hit = _pipes.get(key, False)
    if hit is False:
        hit = _pipes[key] = choose_pipe(spec, tuple(state), step, chunk, cfg.pipeline_max_chunks)
    return hit


def choose_pipe(spec: DTensorSpec, state: tuple, step: Step, chunk: int, cap: int) -> _Pipe | None:
    """The pieces of ``step``'s transfer, from metadata all ranks share: ``bytes // chunk`` of them
    (at most ``cap``), where ``bytes`` is the largest local tensor on either side of the step on any
    rank; None when that is under 2, or when the collective needs no copy (dim 0)."""
    i, src, dst, kind = step.mesh_dim, step.src, step.dst, step.kind
    if kind == "all_gather":
        dims = (src.dim,)
    elif kind == "reduce_scatter":
        dims = (dst.dim,)
        if src.reduce_op not in _PIPE_OPS:
            return None
    elif kind == "all_to_all":
        dims = (src.dim, dst.dim)
    else:
        return None
    if kind != "all_to_all" and dims[0] == 0:
        return None  # lands in place: nothing to pack or unpack
    after = state[:i] + (dst,) + state[i + 1:]
    # the distinct local shapes on either side over every rank, never walking the ranks
    # (spec.local_shapes): only their max, min and any are read below
    ms = spec.mesh_shape
    before_shapes = local_shapes(spec.shape, ms, state)
    after_shapes = local_shapes(spec.shape, ms, after)
    shapes = before_shapes + after_shapes
    k = min(max(math.prod(s) for s in shapes) * _itemsize(spec.dtype) // chunk, cap)
    lead = next((t for t in range(len(spec.shape)) if any(s[t] >= 2 for s in shapes)), None)
    if k < 2 or lead is None or lead > min(dims):
        return None
    if kind == "all_gather" and lead == dims[0]:
        return None  # every dim before the gathered one is trivial: lands in place (running)
    if lead not in dims:  # the same length before and after the step on every rank
        k = min(k, min(s[lead] for s in before_shapes))
        return _Pipe(k, lead, False) if k >= 2 else None
    # the leading dim is the collective's: pieces of each member's block (the group's largest
    # block, at mesh coordinate 0 of mesh dim i, bounds them)
    side = state if kind == "all_gather" or (kind == "all_to_all" and lead == src.dim) else after
    k = min(k, min(key[0][lead] for key in local_shape_classes(((spec.shape, side),), ms, pinned={i: 0})))
    if kind == "all_to_all":
        n = spec.mesh_shape[i]
        k = max(1, k // (n - 1))  # each piece is exchanged in n - 1 pairwise collectives
        return _Pipe(k, lead, True) if k * (n - 1) >= 2 else None
    return _Pipe(k, lead, True) if k >= 2 else None


def _split(length: int, k: int) -> list[tuple[int, int]]:
    """``(start, length)`` of ``k`` consecutive near-equal pieces of ``length`` (some empty when
    ``length < k``)."""
    return [(length * j // k, length * (j + 1) // k - length * j // k) for j in range(k)]


def _offsets(sizes) -> list[int]:
    return list(itertools.accumulate(sizes, initial=0))[:-1]


def _run_pieces(k: int, start, finish) -> None:
    """``start(j)`` packs piece ``j`` and issues its collective, returning ``(work, ctx)``;
    ``finish(ctx)`` unpacks it after its wait.  Piece j is issued before piece j-1 is waited on,
    so piece j's transfer runs under piece j-1's unpack and piece j+1's pack."""
    prev = None
    for j in range(k):
        cur = start(j)
        if prev is not None:
            prev[0].wait()
            finish(prev[1])
        prev = cur
    prev[0].wait()
    finish(prev[1])


def _no_finish(ctx) -> None:
    return None


def _note(kind: str, t: torch.Tensor) -> None:
    if copy_observers:
        note_copy(kind, t.numel() * t.element_size())


def _unpack_into(dst: torch.Tensor, buf: torch.Tensor, d: int, sizes) -> None:
    """``K.unpack(buf, d, sizes)`` written into ``dst`` (one copy per element)."""
    off = 0
    for r, s in enumerate(sizes):
        if s:
            dst.narrow(d, off, s).copy_(buf[r].narrow(d, 0, s))
        off += s
    _note("unpack", dst)


def _a2a_unpack_into(dst: torch.Tensor, flat: torch.Tensor, shape, d: int, sizes) -> None:
    """``K.a2a_unpack(flat, shape, d, sizes)`` written into ``dst`` (one copy per element)."""
    per = numel_except(shape, d)
    off = 0
    for s in sizes:
        if s and per:
            dst.narrow(d, off, s).copy_(flat.narrow(0, per * off, per * s).view(with_length(shape, d, s)))
        off += s
    _note("unpack", dst)


def all_gather_pipelined(x, spec, i, d, sizes, pipe: _Pipe):
    """``_all_gather`` in pieces (same result, same padding, same bytes)."""
    n, block, mine, mesh = len(sizes), sizes[0], x.shape[d], spec.mesh
    C.report_transfer("all_gather", i, (n - 1) * block * numel_except(x.shape, d) * x.element_size(), n)
    if mine != block:
        note_padding(spec, d, sizes)
    out = x.new_empty(with_length(x.shape, d, sum(sizes)))
    m = pipe.dim  # a leading dim before d ("lead" pieces: choose_pipe never cuts d itself)
    parts = _split(x.shape[m], pipe.pieces)

    def start(j):
        a, l = parts[j]
        xc = x.narrow(m, a, l)
        buf = xc if mine == block else copied("pack", K.pack(xc, d, [mine], block))
        recv = x.new_empty((n, *with_length(xc.shape, d, block)))
        return C.start_all_gather(recv, buf, mesh, i), (recv, a, l)

    def finish(ctx):
        recv, a, l = ctx
        _unpack_into(out.narrow(m, a, l), recv, d, sizes)

    _run_pieces(len(parts), start, finish)
    return out


def reduce_scatter_pipelined(x, spec, i, me, op, d, pipe: _Pipe):
    """The reduce_scatter of ``running`` in pieces (None: a case it leaves to the one-collective
    path): even blocks as pieces of one reduce_scatter (each lands in
    place), uneven ones as pieces of the exact-piece all_to_all plus local reduction (lead pieces
    only).  The same result bit for bit, the same bytes."""
    n, mesh = spec.mesh_shape[i], spec.mesh
    sizes = chunk_sizes(x.shape[d], n)
    block, mine = sizes[0], sizes[me]
    even = all(s == block for s in sizes)
    if x.numel() == 0 or (not even and pipe.sub):
        return None  # the caller runs the one-collective path
    out = x.new_empty(with_length(x.shape, d, mine))
    m = pipe.dim
    if even or pads_reduce_scatter(op, sizes):
        # uneven blocks padded to the largest, as running's one-collective path does
        full = out if mine == block else x.new_empty(with_length(x.shape, d, block))
        C.report_transfer("reduce_scatter", i, (n - 1) * numel_except(x.shape, d) * block * x.element_size(), n)
        if not pipe.sub:
            parts = _split(x.shape[m], pipe.pieces)

            def start(j):
                a, l = parts[j]
                buf = copied("pack", K.pack(x.narrow(m, a, l), d, sizes, block))
                return C.start_reduce_scatter(full.narrow(m, a, l), buf, op, mesh, i), None
        else:  # m == d: piece j of every member's block, stacked member-major (one copy)
            parts = _split(block, pipe.pieces)
            blocks = x.unflatten(d, (n, block))

            def start(j):
                a, l = parts[j]
                buf = copied("pack", K.slice_copy(blocks, d + 1, a, l))
                return C.start_reduce_scatter(out.narrow(d, a, l), buf, op, mesh, i), None
        _run_pieces(len(parts), start, _no_finish)
        if full is not out:
            out.copy_(full.narrow(d, 0, mine))
        return out
    per_all = numel_except(x.shape, d)
    C.report_transfer("all_to_all", i, (x.numel() - mine * per_all) * x.element_size(), n,
                      (n - 1) * mine * per_all * x.element_size())
    parts = _split(x.shape[m], pipe.pieces)

    def start(j):
        a, l = parts[j]
        xc = x.narrow(m, a, l)
        per = numel_except(xc.shape, d)
        flat = copied("pack", K.a2a_pack(xc, d, sizes))
        recv = x.new_empty(n * mine * per)
        return C.start_all_to_all(recv, flat, [mine * per] * n, [v * per for v in sizes], mesh, i), (recv, a, l)

    def finish(ctx):
        recv, a, l = ctx
        dst = out.narrow(m, a, l)
        reduce_terms(recv.view(n, *dst.shape), op, dst)

    _run_pieces(len(parts), start, finish)
    return out


def all_to_all_pipelined(x, spec, i, me, d, e, sizes_d, sizes_e, piece, out_shape, pipe: _Pipe):
    """The all_to_all of ``running`` in pieces (same result, same bytes)."""
    n, mesh, itemsize = len(sizes_d), spec.mesh, x.element_size()
    per_e, per_d = numel_except(x.shape, e), numel_except(piece, d)
    C.report_transfer("all_to_all", i, (x.shape[e] - sizes_e[me]) * per_e * itemsize, n,
                      (sum(sizes_d) - sizes_d[me]) * per_d * itemsize)
    out = x.new_empty(out_shape)
    m = pipe.dim
    if not pipe.sub:
        parts = _split(x.shape[m], pipe.pieces)

        def start(j):
            a, l = parts[j]
            xc = x.narrow(m, a, l)
            flat = copied("pack", K.a2a_pack(xc, e, sizes_e))
            pc = with_length(piece, m, l)
            pe, pd = numel_except(xc.shape, e), numel_except(pc, d)
            recv = x.new_empty(sum(sizes_d) * pd)
            work = C.start_all_to_all(recv, flat, [s * pd for s in sizes_d], [s * pe for s in sizes_e], mesh, i)
            return work, (recv, a, l, pc)

        def finish(ctx):
            recv, a, l, pc = ctx
            _a2a_unpack_into(out.narrow(m, a, l), recv, pc, d, sizes_d)

        _run_pieces(len(parts), start, finish)
        return out
    # pairwise pieces: phase (s, t) sends piece s to member me+t and receives piece s from me-t
    sub = pipe.pieces
    offs_d, offs_e = _offsets(sizes_d), _offsets(sizes_e)
    phases = [(s, t) for s in range(sub) for t in range(1, n)]

    def splits(to, n_send, frm, n_recv):
        ins, outs = [0] * n, [0] * n
        ins[to], outs[frm] = n_send, n_recv
        return outs, ins

    if m == d:  # pieces of the dim-d blocks: what a member receives lands in place
        cuts = [_split(v, sub) for v in sizes_d]

        def start(j):
            s, t = phases[j]
            to, frm = (me + t) % n, (me - t) % n
            a, l = cuts[me][s]
            mine = x.narrow(d, a, l)
            buf = mine.narrow(e, offs_e[to], sizes_e[to])
            if not buf.is_contiguous():  # (it is when this member holds one row: so is the whole)
                buf = copied("pack", K.slice_copy(mine, e, offs_e[to], sizes_e[to]))
            fa, fl = cuts[frm][s]
            dst = out.narrow(d, offs_d[frm] + fa, fl)
            outs, ins = splits(to, buf.numel(), frm, dst.numel())
            work = C.start_all_to_all(dst.view(-1), buf.view(-1), outs, ins, mesh, i)
            if t == 1:  # this member's own piece, while the first exchange runs: one copy (the
                # one collective copies it twice, packed and then out of the send buffer)
                own = out.narrow(d, offs_d[me] + a, l)
                own.copy_(mine.narrow(e, offs_e[me], sizes_e[me]))
                _note("local", own)
            return work, None

        _run_pieces(len(phases), start, _no_finish)
        return out
    # m == e: pieces of the dim-e blocks: what a member sends goes without a copy
    cuts = [_split(v, sub) for v in sizes_e]

    def start(j):
        s, t = phases[j]
        to, frm = (me + t) % n, (me - t) % n
        a, l = cuts[to][s]
        buf = x.narrow(e, offs_e[to] + a, l)
        if not buf.is_contiguous():
            buf = copied("pack", K.slice_copy(x, e, offs_e[to] + a, l))
        ma, ml = cuts[me][s]
        shape = with_length(with_length(x.shape, e, ml), d, sizes_d[frm])
        recv = x.new_empty(shape)
        outs, ins = splits(to, buf.numel(), frm, recv.numel())
        work = C.start_all_to_all(recv.view(-1), buf.view(-1), outs, ins, mesh, i)
        if t == 1:  # this member's own piece: one copy (the one collective copies it twice)
            own = out.narrow(e, ma, ml).narrow(d, offs_d[me], sizes_d[me])
            own.copy_(x.narrow(e, offs_e[me] + ma, ml))
            _note("local", own)
        return work, (recv, ma, ml, frm)

    def finish(ctx):
        recv, ma, ml, frm = ctx
        dst = out.narrow(e, ma, ml).narrow(d, offs_d[frm], sizes_d[frm])
        dst.copy_(recv)
        _note("unpack", dst)

    _run_pieces(len(phases), start, finish)
    return out
