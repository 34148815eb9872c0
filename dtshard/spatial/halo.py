"""Halo exchange for spatially sharded windowed ops (convolution, pooling, padding).

The arithmetic follows ``docs/HALO.md``.  It treats ONE sharded tensor dim at a time; an op with
several sharded spatial dims (H on one mesh dim, W on another) applies the exchange per dim in
mesh-dim order, each exchange moving the window already extended by the previous ones (so
corners arrive without a separate diagonal message).

One dim, one rank
-----------------
Input length ``N``, output length ``M``, stride ``s``, effective kernel ``K = d(k-1)+1``, left
padding ``p_l``.  Output ``o`` reads inputs ``o*s - p_l + j*d`` for ``j in [0, k)``.  On a mesh dim
of ``n`` ranks, rank ``r`` owns output ``[a, b)`` = chunk ``r`` of ``M`` and input ``[c, e)`` =
chunk ``r`` of ``N`` (``torch.chunk`` layout, see :mod:`dtshard.spec`).  It needs the window::

    lo = a*s - p_l
    hi = (b-1)*s - p_l + K                (empty when a == b)

of which ``[max(lo,0), min(hi,N))`` is real data and the rest is padding at the GLOBAL edges
(``pad_left = max(0, -lo)``, ``pad_right = max(0, hi - N)``).  Every rank computes, from metadata
alone, the intersection of every rank's needed range with every rank's owned range; so it knows
exactly what to send to whom and what it receives from whom.  One ``all_to_all_single`` with
uneven splits per sharded dim moves the data: a rank sends nothing to a rank that needs nothing
from it (no traffic across the ring's wrap-around, none to ranks whose window does not reach it),
and data wider than a neighbour's shard comes from several ranks (multi-hop) in the same
collective.  When no rank of the group sends anything, the collective is skipped (all ranks agree
on that because it is metadata).  The local op then runs on the window with padding 0 on this dim
and yields exactly ``b - a`` outputs.

Backward (HALO.md scheme (A), the adjoint): the gradient of the window is split into the parts
that came from each rank, those parts are sent back to their owners (the transposed all_to_all)
and ADDED into the owner's gradient; the padding parts are dropped.

Both directions are registered custom ops (``torch.ops.dtshard.halo_exchange`` and
``torch.ops.dtshard.halo_accumulate``) with fake implementations, so ``torch.compile`` traces them as
opaque calls with known output shapes.  Custom ops cannot take a ``DeviceMesh``: the mesh is kept in
a small process-local registry (:func:`mesh_id`) and the ops receive its integer id plus the mesh
dim; every collective still goes through :mod:`dtshard.collectives` (so ``CommCounter`` sees it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import dtshard_kernels as K
import torch

from dtshard import collectives as C
from dtshard._trace import copy_observers, note_copy
from dtshard.spec import chunk_range

__all__ = [
    "WindowPlan",
    "window_plan",
    "range_plan",
    "conv_output_length",
    "pool_output_length",
    "mesh_id",
    "exchange",
    "accumulate",
]


# ---------------------------------------------------------------------------------------------
# arithmetic (pure metadata)
# ---------------------------------------------------------------------------------------------


def conv_output_length(n: int, k: int, s: int, d: int, p_l: int, p_r: int) -> int:
    """``floor((N + p_l + p_r - K) / s) + 1`` with ``K = d(k-1)+1``."""
    return (n + p_l + p_r - (d * (k - 1) + 1)) // s + 1


def pool_output_length(n: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """PyTorch's pooling output length (ceil mode: the last window must start inside the input or
    the left padding)."""
    eff = d * (k - 1) + 1
    num = n + 2 * p - eff
    m = (-(-num // s) if ceil_mode else num // s) + 1
    if ceil_mode and (m - 1) * s >= n + p:
        m -= 1
    return m


@dataclass(frozen=True)
class WindowPlan:
    """What one rank does for one sharded dim (see the module docstring for the symbols).

    ``send_offsets[r], send_lengths[r]``: the slice of MY owned range (local offsets) rank ``r``
    needs (``send_lengths[me] == 0``).  ``recv_lengths[q]``: how many elements of my window come
    from rank ``q``; ``recv_lengths[me] == keep_length``, the part of my own shard I use, starting
    at local offset ``keep_offset``.  The window is ``pad_left`` fill values, then the pieces from
    ranks ``0..n-1`` in rank order, then ``pad_right`` fill values.  ``any_traffic``: whether ANY
    rank of the group sends anything (else the collective is skipped on every rank).
    """

    n: int
    me: int
    in_length: int  # N (global)
    out_length: int  # M (global)
    a: int
    b: int
    c: int
    e: int
    lo: int
    hi: int
    pad_left: int
    pad_right: int
    send_offsets: tuple[int, ...]
    send_lengths: tuple[int, ...]
    recv_lengths: tuple[int, ...]
    keep_offset: int
    keep_length: int
    any_traffic: bool

    @property
    def window_length(self) -> int:
        return self.pad_left + sum(self.recv_lengths) + self.pad_right

    @property
    def owned_length(self) -> int:
        return self.e - self.c

    @property
    def recv_left(self) -> int:
        return sum(self.recv_lengths[: self.me])

    @property
    def recv_right(self) -> int:
        return sum(self.recv_lengths[self.me + 1 :])

    @property
    def drop_left(self) -> int:
        """Leading owned elements no window of this rank reads (HALO.md ``max(0, lo - c)``)."""
        return min(self.owned_length, max(0, self.lo - self.c))

    @property
    def drop_right(self) -> int:
        """Trailing owned elements not read (HALO.md ``max(0, e - hi)``)."""
        return min(self.owned_length - self.drop_left, max(0, self.e - self.hi))

    def halo_elements(self) -> int:
        """Elements (along this dim) this rank receives from other ranks."""
        return self.recv_left + self.recv_right

    def send_elements(self) -> int:
        return sum(self.send_lengths)


def _needed(m: int, n_in: int, n: int, r: int, s: int, k_eff: int, p_l: int) -> tuple[int, int, int, int]:
    """``(a, b, lo, hi)`` of rank ``r``: its output range and its (unclipped) input window."""
    a, length = chunk_range(m, n, r)
    b = a + length
    if length == 0:
        # no outputs: needs nothing. Park the empty window inside [0, N] so clipping is trivial.
        lo = hi = min(max(a * s - p_l, 0), n_in)
        return a, b, lo, hi
    return a, b, a * s - p_l, (b - 1) * s - p_l + k_eff


@functools.lru_cache(maxsize=4096)
def window_plan(n_in: int, m: int, n: int, me: int, s: int, k_eff: int, p_l: int) -> WindowPlan:
    """The :class:`WindowPlan` of rank ``me`` of ``n`` for input length ``n_in``, output length
    ``m``, stride ``s``, effective kernel ``k_eff`` and left padding ``p_l`` (negative padding
    crops; ``k_eff = 1, s = 1`` is a pure shift, used for ``constant_pad_nd``)."""
    needs = tuple(_needed(m, n_in, n, r, s, k_eff, p_l) for r in range(n))
    return _plan_from_needs(n_in, m, n, me, needs)


@functools.lru_cache(maxsize=4096)
def range_plan(n_in: int, m: int, n: int, me: int, windows: tuple[tuple[int, int], ...]) -> WindowPlan:
    """The :class:`WindowPlan` of rank ``me`` of ``n`` when rank ``r``'s output chunk (chunk ``r``
    of ``m``) reads the input range ``windows[r] = (lo, hi)`` (``0 <= lo <= hi <= n_in``; empty
    when ``lo == hi``).  For ops whose input window is not a convolution window: interpolation
    (nearest / linear index maps), reflection / replication padding, transposed convolution.
    The window has no fill padding: every element comes from some rank's shard."""
    if len(windows) != n:
        raise ValueError(f"range_plan: {len(windows)} windows for {n} ranks")
    needs = []
    for r, (lo, hi) in enumerate(windows):
        if not 0 <= lo <= hi <= n_in:
            raise ValueError(f"range_plan: window {(lo, hi)} of rank {r} is outside [0, {n_in}]")
        a, length = chunk_range(m, n, r)
        needs.append((a, a + length, lo, hi))  # inside [0, n_in]: never any fill padding
    return _plan_from_needs(n_in, m, n, me, tuple(needs))


def _plan_from_needs(n_in: int, m: int, n: int, me: int, needs) -> WindowPlan:
    """``needs[r] = (a, b, lo, hi)``: rank r's output range and unclipped input window."""
    owned = [chunk_range(n_in, n, q) for q in range(n)]
    need = [(max(lo, 0), min(hi, n_in)) for _, _, lo, hi in needs]

    def overlap(r: int, q: int) -> tuple[int, int]:
        """(start, length) of rank q's owned range that rank r needs (global coordinates)."""
        lo, hi = need[r]
        c, ln = owned[q]
        start, stop = max(lo, c), min(hi, c + ln)
        return (start, stop - start) if stop > start else (c, 0)

    # some rank needs what another owns: its non-empty window is not inside its own chunk (the
    # chunks partition [0, n_in), so whatever lies outside is another rank's); linear in the
    # group, where asking every pair was quadratic
    any_traffic = any(lo < hi and not (owned[r][0] <= lo and hi <= owned[r][0] + owned[r][1])
                      for r, (lo, hi) in enumerate(need))
    a, b, lo, hi = needs[me]
    c, own_len = owned[me]
    send_offsets, send_lengths = [], []
    for r in range(n):
        start, ln = overlap(r, me) if r != me else (c, 0)
        send_offsets.append(start - c if ln else 0)
        send_lengths.append(ln)
    recv_lengths = [overlap(me, q)[1] for q in range(n)]
    keep_start, keep_len = overlap(me, me)
    return WindowPlan(
        n=n, me=me, in_length=n_in, out_length=m, a=a, b=b, c=c, e=c + own_len, lo=lo, hi=hi,
        # HALO.md's max(0, -lo) and max(0, hi - N), for windows that may lie wholly in the padding
        pad_left=max(0, min(hi, 0) - lo) if b > a else 0,
        pad_right=max(0, hi - max(lo, n_in)) if b > a else 0,
        send_offsets=tuple(send_offsets), send_lengths=tuple(send_lengths),
        recv_lengths=tuple(recv_lengths),
        keep_offset=keep_start - c if keep_len else 0, keep_length=keep_len,
        any_traffic=any_traffic,
    )


# ---------------------------------------------------------------------------------------------
# meshes for custom ops
# ---------------------------------------------------------------------------------------------

_mesh_by_id: list = []
_id_by_mesh: dict[int, int] = {}


def mesh_id(mesh) -> int:
    """A small int naming ``mesh`` in this process (custom ops cannot take a DeviceMesh). Meshes
    registered here are kept alive for the life of the process (they are few and long-lived)."""
    key = id(mesh)
    i = _id_by_mesh.get(key)
    if i is None or _mesh_by_id[i] is not mesh:
        i = _id_by_mesh[key] = len(_mesh_by_id)
        _mesh_by_id.append(mesh)
    return i


# ---------------------------------------------------------------------------------------------
# local helpers
# ---------------------------------------------------------------------------------------------


def _per(shape: Sequence[int], dim: int) -> int:
    n = 1
    for k, v in enumerate(shape):
        if k != dim:
            n *= v
    return n


def _with(shape, dim: int, v: int) -> list[int]:
    s = list(shape)
    s[dim] = v
    return s


def _pack_ranges(x: torch.Tensor, dim: int, ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """1-D buffer: the flattened (contiguous) slices ``x.narrow(dim, start, length)`` in order.
    Unlike ``dtshard_kernels.a2a_pack`` the slices may overlap (one element may go to two ranks)
    and need not cover ``x``.  One copy pass over the sent elements."""
    per = _per(x.shape, dim)
    total = sum(ln for _, ln in ranges)
    out = x.new_empty([per * total])
    off = 0
    for start, ln in ranges:
        if ln and per:
            out.narrow(0, per * off, per * ln).view(_with(x.shape, dim, ln)).copy_(x.narrow(dim, start, ln))
        off += ln
    if copy_observers:
        note_copy("halo_pack", out.numel() * out.element_size())
    return out


def _pieces(flat: torch.Tensor, shape, dim: int, lengths: Sequence[int]) -> list[torch.Tensor]:
    """Views of the pieces of a received all_to_all buffer (piece q has ``shape[dim] = lengths[q]``)."""
    per = _per(shape, dim)
    out, off = [], 0
    for ln in lengths:
        out.append(flat.narrow(0, per * off, per * ln).view(_with(shape, dim, ln)))
        off += ln
    return out


# ---------------------------------------------------------------------------------------------
# the custom ops
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("dtshard::halo_exchange", mutates_args=())
def halo_exchange(
    x: torch.Tensor,
    dim: int,
    mesh_ref: int,
    mesh_dim: int,
    me: int,
    send_offsets: list[int],
    send_lengths: list[int],
    recv_lengths: list[int],
    keep_offset: int,
    pad_left: int,
    pad_right: int,
    any_traffic: int,
    fill: float,
) -> torch.Tensor:
    """The window of this rank along ``dim``: ``pad_left`` fill values, the pieces received from
    ranks ``0..n-1`` in rank order (this rank's own piece is ``x.narrow(dim, keep_offset,
    recv_lengths[me])``), ``pad_right`` fill values.  One all_to_all over ``mesh_dim``."""
    recv = _exchange_send(x, dim, mesh_ref, mesh_dim, me, send_offsets, send_lengths, recv_lengths, any_traffic)
    return _exchange_window(x, recv, dim, me, recv_lengths, keep_offset, pad_left, pad_right, fill)


def _exchange_send(x, dim, mesh_ref, mesh_dim, me, send_offsets, send_lengths, recv_lengths, any_traffic):
    """Pack and issue the exchange's all_to_all; its received buffer (None without traffic)."""
    per = _per(x.shape, dim)
    n = len(recv_lengths)
    if not (any_traffic and per):
        return None
    out_lengths = [0 if q == me else recv_lengths[q] for q in range(n)]
    ranges = [(send_offsets[r], send_lengths[r]) for r in range(n)]
    flat = _pack_ranges(x, dim, ranges)
    in_splits = [per * ln for ln in send_lengths]
    out_splits = [per * ln for ln in out_lengths]
    return C.all_to_all(flat, out_splits, in_splits, _mesh_by_id[mesh_ref], mesh_dim)


def _exchange_window(x, recv, dim, me, recv_lengths, keep_offset, pad_left, pad_right, fill):
    """Assemble the window from the received buffer (waits for it when still in flight)."""
    n = len(recv_lengths)
    out_lengths = [0 if q == me else recv_lengths[q] for q in range(n)]
    if recv is not None:
        pieces = _pieces(recv, x.shape, dim, out_lengths)
    else:
        # nothing crosses ranks, or every piece has zero elements (another dim is empty on the
        # whole group): the pieces keep their lengths along dim so the window has its full shape
        pieces = [x.new_empty(_with(x.shape, dim, ln)) for ln in out_lengths]
    parts = [p for q, p in enumerate(pieces) if q != me and recv_lengths[q]]
    left = sum(1 for q in range(me) if recv_lengths[q])
    parts.insert(left, x.narrow(dim, keep_offset, recv_lengths[me]))
    out = K.halo_cat(parts, dim, pad_left, pad_right)
    if fill != 0.0:
        if pad_left:
            out.narrow(dim, 0, pad_left).fill_(fill)
        if pad_right:
            out.narrow(dim, out.shape[dim] - pad_right, pad_right).fill_(fill)
    return out


@halo_exchange.register_fake
def _halo_exchange_fake(x, dim, mesh_ref, mesh_dim, me, send_offsets, send_lengths, recv_lengths,
                        keep_offset, pad_left, pad_right, any_traffic, fill):
    return x.new_empty(_with(x.shape, dim, pad_left + sum(recv_lengths) + pad_right))


@torch.library.custom_op("dtshard::halo_accumulate", mutates_args=())
def halo_accumulate(
    g: torch.Tensor,
    dim: int,
    mesh_ref: int,
    mesh_dim: int,
    me: int,
    send_offsets: list[int],
    send_lengths: list[int],
    recv_lengths: list[int],
    keep_offset: int,
    pad_left: int,
    pad_right: int,
    any_traffic: int,
    owned_length: int,
) -> torch.Tensor:
    """Adjoint of :func:`halo_exchange`: ``g`` is the gradient of the window; returns the gradient
    of this rank's owned shard (length ``owned_length`` on ``dim``): its own piece plus the pieces
    the other ranks send back (added), zeros where no window reads."""
    n = len(recv_lengths)
    per = _per(g.shape, dim)
    keep = recv_lengths[me]
    left = sum(recv_lengths[:me])
    own = g.narrow(dim, pad_left + left, keep)
    out = K.halo_cat([own], dim, keep_offset if keep else 0, owned_length - (keep_offset + keep if keep else 0))
    if any_traffic and per:
        mesh = _mesh_by_id[mesh_ref]
        ranges, off = [], pad_left
        for q in range(n):
            ranges.append((off, 0 if q == me else recv_lengths[q]))
            off += recv_lengths[q]
        flat = _pack_ranges(g, dim, ranges)
        in_splits = [per * ln for _, ln in ranges]
        out_splits = [per * ln for ln in send_lengths]
        recv = C.all_to_all(flat, out_splits, in_splits, mesh, mesh_dim)
        for r, piece in enumerate(_pieces(recv, g.shape, dim, send_lengths)):
            if send_lengths[r]:
                out.narrow(dim, send_offsets[r], send_lengths[r]).add_(piece)
    return out


@halo_accumulate.register_fake
def _halo_accumulate_fake(g, dim, mesh_ref, mesh_dim, me, send_offsets, send_lengths, recv_lengths,
                          keep_offset, pad_left, pad_right, any_traffic, owned_length):
    return g.new_empty(_with(g.shape, dim, owned_length))


def _exchange_backward(ctx, grad):
    a = ctx.args
    return (halo_accumulate(grad, *a, ctx.owned_length),) + (None,) * 12


def _exchange_setup(ctx, inputs, output):
    x, *rest = inputs
    ctx.args = tuple(rest[:-1])  # everything but fill
    ctx.owned_length = x.shape[rest[0]]


halo_exchange.register_autograd(_exchange_backward, setup_context=_exchange_setup)


def _accumulate_backward(ctx, grad):
    return (halo_exchange(grad, *ctx.args, 0.0),) + (None,) * 12


def _accumulate_setup(ctx, inputs, output):
    ctx.args = tuple(inputs[1:-1])


halo_accumulate.register_autograd(_accumulate_backward, setup_context=_accumulate_setup)


# ---------------------------------------------------------------------------------------------
# entry points used by the rules
# ---------------------------------------------------------------------------------------------


def _op_args(plan: WindowPlan, dim: int, mesh, mesh_dim: int) -> tuple:
    return (
        dim, mesh_id(mesh), mesh_dim, plan.me, list(plan.send_offsets), list(plan.send_lengths),
        list(plan.recv_lengths), plan.keep_offset, plan.pad_left, plan.pad_right, int(plan.any_traffic),
    )


def _identity(plan: WindowPlan) -> bool:
    """No rank of the group sends anything and this rank's window is exactly its shard."""
    return (not plan.any_traffic and plan.pad_left == 0 and plan.pad_right == 0
            and plan.keep_offset == 0 and plan.keep_length == plan.owned_length)


def exchange(x: torch.Tensor, plan: WindowPlan, dim: int, mesh, mesh_dim: int, fill: float = 0.0) -> torch.Tensor:
    """This rank's input window along ``dim`` (``plan.window_length`` long) from its owned shard
    ``x`` (``plan.owned_length`` long); ``fill`` goes in the global-edge padding.  Returns ``x``
    itself when the window is the shard and the whole group exchanges nothing (e.g. 1x1 convs)."""
    if _identity(plan):
        return x
    return torch.ops.dtshard.halo_exchange(x, *_op_args(plan, dim, mesh, mesh_dim), float(fill))


class PendingWindow:
    """A halo exchange in flight (:func:`exchange_async`): ``wait()`` gives the window."""

    def __init__(self, x, recv, plan: WindowPlan, dim: int, in_graph: bool = False):
        self.x, self.recv, self.plan, self.dim, self.in_graph = x, recv, plan, dim, in_graph

    def wait(self) -> torch.Tensor:
        if isinstance(self.recv, torch.Tensor) and self.in_graph:
            self.recv = C.wait_in_graph(self.recv)  # the functional all_to_all's wait, here in the graph
        elif isinstance(self.recv, torch.Tensor) and hasattr(self.recv, "wait"):
            self.recv = self.recv.wait()  # an AsyncCollectiveTensor
        return window_from(self.x, self.recv, self.plan, self.dim)


def _send(x: torch.Tensor, plan: WindowPlan, dim: int, mesh, mesh_dim: int):
    """Issue the exchange's all_to_all for ``plan`` (the received buffer, or None)."""
    a = _op_args(plan, dim, mesh, mesh_dim)
    return _exchange_send(x, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[10])


def exchange_async(x: torch.Tensor, plan: WindowPlan, dim: int, mesh, mesh_dim: int) -> PendingWindow:
    """:func:`exchange` with the all_to_all left in flight (below autograd): the caller computes
    what needs no halo, then ``wait()``s for the window.  Eagerly the all_to_all's work handle is
    waited then; under torch.compile its functional collective is in the graph and its wait is
    placed where ``wait()`` is called."""
    with C.in_flight(graph=True):
        recv = _send(x, plan, dim, mesh, mesh_dim)
    return PendingWindow(x, recv, plan, dim, in_graph=torch.compiler.is_compiling())


def exchange_keep(x: torch.Tensor, plan: WindowPlan, dim: int, mesh, mesh_dim: int) -> tuple:
    """Eager :func:`exchange` that also returns what it received (small: the halo rows), so the
    same window can be rebuilt later without traffic (:func:`window_from`): a convolution's
    backward reads the very window its forward exchanged."""
    if _identity(plan):
        return x, None
    recv = _send(x, plan, dim, mesh, mesh_dim)
    return window_from(x, recv, plan, dim), recv


def window_from(x: torch.Tensor, recv, plan: WindowPlan, dim: int) -> torch.Tensor:
    """The window of :func:`exchange_keep` again, from the shard ``x`` and what was received."""
    if _identity(plan):
        return x
    return _exchange_window(x, recv, dim, plan.me, list(plan.recv_lengths), plan.keep_offset, plan.pad_left,
                            plan.pad_right, 0.0)


def accumulate(g: torch.Tensor, plan: WindowPlan, dim: int, mesh, mesh_dim: int) -> torch.Tensor:
    """Gradient of the owned shard from the gradient ``g`` of the window (adjoint of
    :func:`exchange`)."""
    if _identity(plan):
        return g
    return torch.ops.dtshard.halo_accumulate(g, *_op_args(plan, dim, mesh, mesh_dim), plan.owned_length)
