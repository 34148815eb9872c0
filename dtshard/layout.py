"""Which elements each rank must receive, and from whom, to change a layout: pure metadata.

A rank's shard under Shard/Replicate placements is a box of the global tensor (one interval per
tensor dim; Partial counts as the whole extent, like Replicate).  To move from a source layout to
a target layout over a group of ranks (the ranks that differ only in some mesh dims), each rank
needs exactly the part of its target box that its source box lacks.  Cutting every tensor dim at
every box boundary of both layouts splits the tensor into *atoms*: boxes that are, for every rank,
wholly inside or wholly outside its source and its target box.  Each atom a rank needs and lacks
is sent to it by one rank of the group that holds it (the first in group order), so every rank
receives the theoretical minimum; the sends of one (sender, receiver) pair travel as one segment
of an ``all_to_all_single`` with per-rank split sizes (pairs with nothing to send send nothing).

Everything here is computed for every rank of the mesh from shared metadata, so every rank
derives the same plan and the collective's sizes agree (see ``ExchangePlan``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from torch.distributed.tensor.placement_types import Placement

from dtshard.spec import local_shape_and_offset

__all__ = ["Box", "rank_box", "box_numel", "group_coords", "ExchangePlan", "exchange_plan", "exchange_costs"]

Box = tuple[tuple[int, int], ...]  # (start, stop) per tensor dim


def rank_box(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
             coord: Sequence[int]) -> Box:
    """The global region whose values (or, under Partial, terms) the rank at ``coord`` holds."""
    lshape, offset = local_shape_and_offset(shape, mesh_shape, list(placements), coord)
    return tuple((o, o + n) for o, n in zip(offset, lshape))


def box_numel(b: Box) -> int:
    return math.prod(hi - lo for lo, hi in b)


def _inside(a: Box, b: Box) -> bool:
    return all(blo <= alo and ahi <= bhi for (alo, ahi), (blo, bhi) in zip(a, b))


def group_coords(mesh_shape: Sequence[int], dims: Sequence[int], coord: Sequence[int]) -> list[tuple[int, ...]]:
    """The coordinates of the ranks that differ from ``coord`` only in ``dims``, in group order
    (row-major over ``dims`` in mesh order: the order of a flattened process group)."""
    out = []
    for sub in itertools.product(*(range(mesh_shape[d]) for d in dims)):
        c = list(coord)
        for d, v in zip(dims, sub):
            c[d] = v
        out.append(tuple(c))
    return out


@dataclass(frozen=True)
class Transfer:
    """One atom moving from a sender's source shard to a receiver's target shard."""

    src_slices: tuple[tuple[int, int], ...]  # (start, length) per dim, in the sender's local tensor
    dst_slices: tuple[tuple[int, int], ...]  # (start, length) per dim, in the receiver's local tensor
    numel: int


@dataclass(frozen=True)
class ExchangePlan:
    """What ONE rank does in an exchange over its group (see the module docstring).

    ``sends[g]`` / ``recvs[g]``: the atoms this rank sends to / receives from group member ``g``
    (in a canonical order both sides share); ``keeps``: atoms copied from its own source shard.
    ``any_traffic`` is the same for every member of the group (so all skip the collective or none).
    """

    group_index: int
    dst_shape: tuple[int, ...]
    sends: tuple[tuple[Transfer, ...], ...]
    recvs: tuple[tuple[Transfer, ...], ...]
    keeps: tuple[Transfer, ...]
    any_traffic: bool

    def send_sizes(self) -> list[int]:
        return [sum(t.numel for t in ts) for ts in self.sends]

    def recv_sizes(self) -> list[int]:
        return [sum(t.numel for t in ts) for ts in self.recvs]


def _cuts(boxes: list[Box], ndim: int) -> list[list[int]]:
    cuts = []
    for d in range(ndim):
        pts = sorted({p for b in boxes for p in b[d]})
        cuts.append(pts)
    return cuts


def _atoms_of(box: Box, cuts: list[list[int]]) -> list[Box]:
    per_dim = []
    for d, (lo, hi) in enumerate(box):
        pts = [p for p in cuts[d] if lo <= p <= hi]
        per_dim.append([(a, b) for a, b in zip(pts, pts[1:]) if b > a])
    return [tuple(a) for a in itertools.product(*per_dim)]


def _slices(atom: Box, box: Box) -> tuple[tuple[int, int], ...]:
    return tuple((alo - blo, ahi - alo) for (alo, ahi), (blo, _) in zip(atom, box))


def _group_assignment(shape, mesh_shape, src, dst, dims, coord):
    """For the group of ``coord``: per member, its (source box, target box), and per receiver the
    list of (atom, sender index); None when some needed atom is held by no member."""
    members = group_coords(mesh_shape, dims, coord)
    sboxes = [rank_box(shape, mesh_shape, src, c) for c in members]
    tboxes = [rank_box(shape, mesh_shape, dst, c) for c in members]
    cuts = _cuts(sboxes + tboxes, len(shape))
    needs = []
    for q, tb in enumerate(tboxes):
        got = []
        if box_numel(tb):
            for atom in _atoms_of(tb, cuts):
                if _inside(atom, sboxes[q]):
                    got.append((atom, q))
                    continue
                p = next((p for p, sb in enumerate(sboxes) if _inside(atom, sb)), None)
                if p is None:
                    return None
                got.append((atom, p))
        needs.append(got)
    return members, sboxes, tboxes, needs


def exchange_plan(shape, mesh_shape, src, dst, dims: Sequence[int], coord) -> ExchangePlan | None:
    """This rank's part of the exchange from ``src`` to ``dst`` over the group of ``dims``; None
    when the group does not hold everything its members need (use a larger group)."""
    got = _group_assignment(tuple(shape), tuple(mesh_shape), tuple(src), tuple(dst), tuple(dims), tuple(coord))
    if got is None:
        return None
    members, sboxes, tboxes, needs = got
    me = members.index(tuple(coord))
    sends = [[] for _ in members]
    recvs = [[] for _ in members]
    keeps = []
    traffic = False
    for q, lst in enumerate(needs):
        for atom, p in lst:
            if p != q:
                traffic = True
            if p != me and q != me:
                continue
            t = Transfer(_slices(atom, sboxes[p]), _slices(atom, tboxes[q]), box_numel(atom))
            if p == q == me:
                keeps.append(t)
            elif p == me:
                sends[q].append(t)
            else:
                recvs[p].append(t)
    dst_shape = tuple(hi - lo for lo, hi in tboxes[me])
    return ExchangePlan(me, dst_shape, tuple(map(tuple, sends)), tuple(map(tuple, recvs)), tuple(keeps), traffic)


def exchange_costs(shape, mesh_shape, src, dst, dims: Sequence[int]) -> tuple[int, ...] | None:
    """Elements each rank (by mesh coordinate, row-major) receives in the exchange over ``dims``
    (the same answer on every rank: computed for every group of the mesh); None if some group
    cannot do it alone."""
    got_by_coord = {}
    others = [d for d in range(len(mesh_shape)) if d not in dims]
    for outer in itertools.product(*(range(mesh_shape[d]) for d in others)):
        coord = [0] * len(mesh_shape)
        for d, v in zip(others, outer):
            coord[d] = v
        got = _group_assignment(tuple(shape), tuple(mesh_shape), tuple(src), tuple(dst), tuple(dims), tuple(coord))
        if got is None:
            return None
        members, _, _, needs = got
        for q, lst in enumerate(needs):
            got_by_coord[members[q]] = sum(box_numel(a) for a, p in lst if p != q)
    return tuple(got_by_coord[c] for c in itertools.product(*(range(n) for n in mesh_shape)))
