"""Which elements each rank must receive, and from whom, to change a layout: pure metadata.

A rank's shard is a *region* of the global tensor: per tensor dim, the sorted global index
intervals it holds (one interval per dim, a box, for Shard/Replicate; several for a strided
shard; Partial counts as the whole extent, like Replicate), see ``spec.local_region``.  To move from a source layout to
a target layout over a group of ranks (the ranks that differ only in some mesh dims), each rank
needs exactly the part of its target box that its source box lacks.  Cutting every tensor dim at
every interval boundary of both layouts splits the tensor into *atoms*: boxes that are, for every
rank, wholly inside or wholly outside its source and its target region.  Each atom a rank needs and lacks
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

from dtshard.spec import Region, local_region, memo, placement_key

__all__ = ["Box", "Region", "rank_box", "box_numel", "overlap_numel", "group_coords", "ExchangePlan", "exchange_plan",
           "exchange_costs"]

Box = tuple[tuple[int, int], ...]  # (start, stop) per tensor dim: one atom


def rank_box(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
             coord: Sequence[int]) -> Region:
    """The global region whose values (or, under Partial, terms) the rank at ``coord`` holds
    (memoised: the planner asks for the same boxes over and over while it prices plans)."""
    key = (tuple(shape), tuple(mesh_shape), tuple(placement_key(p) for p in placements), tuple(coord))
    return memo(_box_cache, key, lambda: local_region(shape, mesh_shape, list(placements), coord))


_box_cache: dict[tuple, Region] = {}
_costs_cache: dict[tuple, tuple[int, ...] | None] = {}


def box_numel(r: Region) -> int:
    return math.prod(sum(hi - lo for lo, hi in ivs) for ivs in r)


def overlap_numel(a: Region, b: Region) -> int:
    """Elements two regions share (per dim, the overlap of their interval lists)."""
    n = 1
    for ia, ib in zip(a, b):
        m = 0
        for lo, hi in ia:
            for lo2, hi2 in ib:
                m += max(0, min(hi, hi2) - max(lo, lo2))
        if not m:
            return 0
        n *= m
    return n


def _atom_numel(a: Box) -> int:
    return math.prod(hi - lo for lo, hi in a)


def _inside(a: Box, r: Region) -> bool:
    """Is the atom ``a`` part of the region ``r``?  (An atom never straddles an interval edge.)"""
    return all(any(lo <= alo and ahi <= hi for lo, hi in ivs) for (alo, ahi), ivs in zip(a, r))


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
    #: every member sends its WHOLE shard to every other member, and all shards have the same
    #: number of elements: the exchange is an all_gather of the unpacked shards (no packing on
    #: the send side), then the same per-atom copies.  ``src_shapes[g]``: member g's shard shape.
    #: The same answer on every member (decided from every member's layout).
    gather: bool = False
    src_shapes: tuple[tuple[int, ...], ...] = ()

    def send_sizes(self) -> list[int]:
        return [sum(t.numel for t in ts) for ts in self.sends]

    def recv_sizes(self) -> list[int]:
        return [sum(t.numel for t in ts) for ts in self.recvs]


def _cuts(regions: list[Region], ndim: int) -> list[list[int]]:
    cuts = []
    for d in range(ndim):
        pts = sorted({p for r in regions for iv in r[d] for p in iv})
        cuts.append(pts)
    return cuts


def _atoms_of(region: Region, cuts: list[list[int]]) -> list[Box]:
    per_dim = []
    for d, ivs in enumerate(region):
        pieces = []
        for lo, hi in ivs:
            pts = [p for p in cuts[d] if lo <= p <= hi]
            pieces.extend((a, b) for a, b in zip(pts, pts[1:]) if b > a)
        per_dim.append(pieces)
    return [tuple(a) for a in itertools.product(*per_dim)]


def _local_start(x: int, ivs) -> int:
    """Local position of global index ``x`` in a rank holding intervals ``ivs``."""
    pos = 0
    for lo, hi in ivs:
        if lo <= x < hi:
            return pos + x - lo
        pos += hi - lo
    raise AssertionError(f"index {x} not in {ivs}")


def _slices(atom: Box, region: Region) -> tuple[tuple[int, int], ...]:
    return tuple((_local_start(alo, ivs), ahi - alo) for (alo, ahi), ivs in zip(atom, region))


def _group_assignment(shape, mesh_shape, src, dst, dims, coord, red=()):
    """For the group of ``coord``: per member, its (source box, target box), and per receiver the
    list of (atom, sender index); None when some needed atom is held by no member.

    ``red``: Partial mesh dims (inside ``dims``) whose terms the exchange reduces: a receiver then
    needs each atom once from EVERY value of the coordinates on ``red`` (one term each), so the
    members are searched per such value; its own term of an atom it holds is one of them."""
    members = group_coords(mesh_shape, dims, coord)
    sboxes = [rank_box(shape, mesh_shape, src, c) for c in members]
    tboxes = [rank_box(shape, mesh_shape, dst, c) for c in members]
    cuts = _cuts(sboxes + tboxes, len(shape))
    if red:  # the members that hold each term: one class per coordinate on the red dims
        classes: dict = {}
        for p, c in enumerate(members):
            classes.setdefault(tuple(c[d] for d in red), []).append(p)
        terms = list(classes.values())
    else:
        terms = [list(range(len(members)))]
    needs = []
    for q, tb in enumerate(tboxes):
        got = []
        if box_numel(tb):
            for atom in _atoms_of(tb, cuts):
                for holders in terms:
                    if q in holders and _inside(atom, sboxes[q]):
                        got.append((atom, q))
                        continue
                    p = next((p for p in holders if _inside(atom, sboxes[p])), None)
                    if p is None:
                        return None
                    got.append((atom, p))
        needs.append(got)
    return members, sboxes, tboxes, needs


def exchange_plan(shape, mesh_shape, src, dst, dims: Sequence[int], coord, red: Sequence[int] = ()) -> ExchangePlan | None:
    """This rank's part of the exchange from ``src`` to ``dst`` over the group of ``dims``; None
    when the group does not hold everything its members need (use a larger group).  With ``red``
    (Partial mesh dims of ``src`` inside ``dims``) it is a REDUCING exchange: every receiver gets
    one term of each atom of its target per coordinate on ``red`` (its own among them, a keep) and
    sums them; the same atom then appears in several transfers of the plan."""
    got = _group_assignment(tuple(shape), tuple(mesh_shape), tuple(src), tuple(dst), tuple(dims), tuple(coord),
                            tuple(red))
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
            t = Transfer(_slices(atom, sboxes[p]), _slices(atom, tboxes[q]), _atom_numel(atom))
            if p == q == me:
                keeps.append(t)
            elif p == me:
                sends[q].append(t)
            else:
                recvs[p].append(t)
    dst_shape = tuple(sum(hi - lo for lo, hi in ivs) for ivs in tboxes[me])
    src_numel = [box_numel(b) for b in sboxes]
    gather = not red and traffic and len(set(src_numel)) == 1 and src_numel[0] > 0 and all(
        sum(_atom_numel(a) for a, p in needs[q] if p == r) == src_numel[r]
        for q in range(len(members)) for r in range(len(members)) if r != q)
    src_shapes = tuple(tuple(sum(hi - lo for lo, hi in ivs) for ivs in b) for b in sboxes)
    return ExchangePlan(me, dst_shape, tuple(map(tuple, sends)), tuple(map(tuple, recvs)), tuple(keeps), traffic,
                        gather, src_shapes)


def exchange_costs(shape, mesh_shape, src, dst, dims: Sequence[int], red: Sequence[int] = ()) -> tuple[int, ...] | None:
    """Elements each rank (by mesh coordinate, row-major) receives in the exchange over ``dims``
    (reducing the Partial mesh dims ``red``, see :func:`exchange_plan`; the same answer on every
    rank: computed for every group of the mesh); None if some group cannot do it alone."""
    key = (tuple(shape), tuple(mesh_shape), tuple(placement_key(p) for p in src),
           tuple(placement_key(p) for p in dst), tuple(dims), tuple(red))
    return memo(_costs_cache, key, lambda: _exchange_costs(shape, mesh_shape, src, dst, dims, tuple(red)))


def _exchange_costs(shape, mesh_shape, src, dst, dims, red=()):
    got_by_coord = {}
    others = [d for d in range(len(mesh_shape)) if d not in dims]
    for outer in itertools.product(*(range(mesh_shape[d]) for d in others)):
        coord = [0] * len(mesh_shape)
        for d, v in zip(others, outer):
            coord[d] = v
        got = _group_assignment(tuple(shape), tuple(mesh_shape), tuple(src), tuple(dst), tuple(dims), tuple(coord),
                                red)
        if got is None:
            return None
        members, _, _, needs = got
        for q, lst in enumerate(needs):
            got_by_coord[members[q]] = sum(_atom_numel(a) for a, p in lst if p != q)
    return tuple(got_by_coord[c] for c in itertools.product(*(range(n) for n in mesh_shape)))
