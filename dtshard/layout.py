"""Which elements each rank must receive, and from whom, to change a layout: pure metadata, at
a cost that does not grow with the number of ranks.

A rank's shard is a *region* of the global tensor: per tensor dim, the sorted global index
intervals it holds (one interval per dim, a box, for Shard/Replicate; several for a strided
shard; Partial counts as the whole extent, like Replicate), see ``spec.local_region``.  Tensor dim
``d``'s intervals depend only on the rank's coordinates on the mesh dims that shard ``d`` (its
*levels*: ``(mesh dim, split factor)`` in mesh order, each cutting what the ones before it left),
and a mesh dim shards at most one tensor dim.  Everything below works per tensor dim on that
structure, never by visiting every rank of the mesh.

An exchange moves from a source layout to a target layout over a *group* ``G`` of mesh dims (the
ranks that differ only there).  The ranks that send receiver ``q`` an element:

- have ``q``'s coordinates on every mesh dim outside ``G``;
- on the mesh dims of ``G`` that shard the source, the coordinates of the one shard that holds it;
- on the mesh dims of ``G`` that replicate the source, any coordinate: every replica holds the
  element, and the replicas share the sending (below);
- a reducing exchange (``red``: the source's Partial mesh dims inside ``G``) takes one term of the
  element from every coordinate on ``red``, all from ranks that share every other coordinate: one
  complete set of terms of the Partial's contract, whatever the replicas of other mesh dims hold
  (they may hold different terms of the same value).  Where ``q`` holds a term itself, the set is
  its own (it then receives one term fewer).

So each rank receives exactly what its target region lacks (in a reducing exchange, every term of
it but its own): the least any plan of this kind can receive.  Which replica sends: on a group of
up to :data:`BALANCED_GROUP_RANKS` ranks the whole group's demand is shared out exactly evenly,
a receiver's piece split between replicas where that evens the sending
(:func:`_balanced_exchange`); on larger groups each receiver's piece comes from one replica, its
own coordinates shifted by how far the piece's are from its own (:func:`_replica`), so the
replicas serve different receivers rather than the first of them serving all.

Each rank builds only its own sends and receives (:func:`exchange_plan`: per tensor dim, the
peers whose pieces overlap, found by chunk arithmetic), and the planner prices a candidate by the
receiver that receives most (:func:`exchange_costs`): exactly, rank by rank, on meshes of up to
:data:`EXACT_PRICING_RANKS` ranks; above that over the coordinate classes that can differ
(:func:`representative_coords`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from torch.distributed.tensor.placement_types import Placement

from dtshard.spec import (ENUMERATION_LIMIT, Region, _shard_len, _shard_len_starts, _shard_step, chunk_range, is_shard,
                          is_strided, local_region, memo, placement_key, split_factor)

__all__ = ["Region", "rank_box", "box_numel", "group_coords", "group_index",
           "group_member", "ExchangePlan", "exchange_plan", "exchange_costs", "exchange_feasible",
           "representative_coords", "max_lacking", "EXACT_PRICING_RANKS"]

#: meshes of up to this many ranks are priced rank by rank (cheap there, and exact); larger ones
#: over representative coordinates (:func:`representative_coords`)
EXACT_PRICING_RANKS = 64

Levels = tuple[tuple[int, int], ...]  # ((mesh dim, split factor), ...) sharding one tensor dim


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


def _ivs_len(ivs) -> int:
    return sum(hi - lo for lo, hi in ivs)


def _ivs_overlap(a, b) -> list[tuple[int, int]]:
    """The pieces two sorted interval lists share, each inside one interval of both."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if lo < hi:
            out.append((lo, hi))
        if a[i][1] <= b[j][1]:
            i += 1
        else:
            j += 1
    return out


def group_coords(mesh_shape: Sequence[int], dims: Sequence[int], coord: Sequence[int]) -> list[tuple[int, ...]]:
    """The coordinates of the ranks that differ from ``coord`` only in ``dims``, in group order
    (row-major over ``dims`` in mesh order: the order of a flattened process group).  Linear in
    the group's size: for the code that must name every member (a new process group, split sizes)."""
    out = []
    for sub in itertools.product(*(range(mesh_shape[d]) for d in dims)):
        c = list(coord)
        for d, v in zip(dims, sub):
            c[d] = v
        out.append(tuple(c))
    return out


def group_index(mesh_shape: Sequence[int], dims: Sequence[int], coord: Sequence[int]) -> int:
    """The position of ``coord`` in its group over ``dims`` (:func:`group_coords`' order)."""
    g = 0
    for d in dims:
        g = g * mesh_shape[d] + coord[d]
    return g


def group_member(mesh_shape: Sequence[int], dims: Sequence[int], coord: Sequence[int], g: int) -> tuple[int, ...]:
    """The coordinates of member ``g`` of ``coord``'s group over ``dims``."""
    c = list(coord)
    for d in reversed(dims):
        g, c[d] = divmod(g, mesh_shape[d])
    return tuple(c)


# ---------------------------------------------------------------------------------------------
# one tensor dim at a time
# ---------------------------------------------------------------------------------------------


def _levels(placements: Sequence[Placement], ndim: int) -> tuple[Levels, ...]:
    """Per tensor dim, the mesh dims that shard it, outermost first, with their split factors."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(ndim)]
    for i, p in enumerate(placements):
        if is_shard(p):
            out[p.dim].append((i, split_factor(p) if is_strided(p) else 1))
    return tuple(tuple(v) for v in out)


def _cut(cur, n: int, c: int, parts: int):
    """``spec.local_region``'s step for one tensor dim: chunk ``c`` of ``n`` of each of the
    ``parts`` chunks of the current positions ``cur``."""
    if parts == 1 and len(cur) == 1:
        lo, hi = cur[0]
        a, b = chunk_range(hi - lo, n, c)
        return ((lo + a, lo + a + b),) if b else ()
    return _shard_step(cur, n, parts, c)


def _dim_ivs(length: int, levels: Levels, mesh_shape, coord):
    """Tensor dim's intervals at ``coord`` (only the coordinates of ``levels``' mesh dims are read)."""
    cur = ((0, length),) if length else ()
    for i, parts in levels:
        cur = _cut(cur, mesh_shape[i], coord[i], parts)
    return cur


def _overlapping(length: int, levels: Levels, mesh_shape, coord, free, target):
    """Every assignment of coordinates to the mesh dims in ``free`` (the others read from
    ``coord``) under which this tensor dim's intervals overlap ``target``: a list of
    ``(assignment, intervals)``, ``assignment`` a tuple of ``(mesh dim, coordinate)``.  Found by
    walking the levels with chunk arithmetic (a free level visits only the chunks that meet the
    target), so the cost follows the answer's size, not the number of ranks."""
    if not target:
        return []
    out = [((), ((0, length),) if length else ())]
    for i, parts in levels:
        n = mesh_shape[i]
        nxt = []
        for assign, cur in out:
            if i not in free:
                child = _cut(cur, n, coord[i], parts)
                if _ivs_overlap(child, target):
                    nxt.append((assign, child))
                continue
            for c in _meeting_chunks(cur, n, parts, target):
                child = _cut(cur, n, c, parts)
                if _ivs_overlap(child, target):
                    nxt.append((assign + ((i, c),), child))
        out = nxt
        if not out:
            return []
    # a free mesh dim that shards nothing here took no level: the caller adds its coordinates
    return out


def _meeting_chunks(cur, n: int, parts: int, target) -> range | list[int]:
    """Chunk indices ``c`` of ``n`` whose piece of ``cur`` may meet ``target`` (a superset)."""
    if parts != 1 or len(cur) != 1 or not target:
        return range(n)
    lo, hi = cur[0]
    step = -(-(hi - lo) // n) if n else 0
    if step == 0:
        return range(0)
    tlo = max(lo, target[0][0])
    thi = min(hi, target[-1][1])
    if tlo >= thi:
        return range(0)
    return range(min(n, (tlo - lo) // step), min(n, (thi - 1 - lo) // step + 1))


def _length_classes(length: int, levels: Levels, mesh_shape, upto: int) -> set[int]:
    """The lengths this tensor dim can have after its first ``upto`` levels, over every rank
    (each level's length is constant between ``spec._shard_len_starts``)."""
    lens = {length}
    for i, parts in levels[:upto]:
        n = mesh_shape[i]
        lens = {_shard_len(ln, n, parts, c) for ln in lens for c in _shard_len_starts(ln, n, parts)}
    return lens


def _chunk_breaks(length: int, n: int, parts: int) -> set[int]:
    """Coordinates of a mesh dim of ``n`` that represent a level of a parent of ``length`` for
    pricing: where the chunk length changes (``spec._shard_len_starts``) and their neighbours on
    both sides (a piece's position, not only its length, decides what it overlaps), and the last."""
    return {c for s in _shard_len_starts(length, n, parts) for c in (s - 1, s, s + 1) if 0 <= c < n} | {n - 1}


def representative_coords(mesh_shape: Sequence[int], shape: Sequence[int], layouts) -> list[list[int]]:
    """Per mesh dim, the coordinates whose ranks represent every class a cost can tell apart, for
    the given layouts (tuples of placements) of a tensor of ``shape``: every coordinate on a mesh
    dim of up to 8; else the first three, the last three and, for every level the mesh dim has in
    a layout, the coordinates where the chunk length changes (full, short, empty) for every
    length the level's parent can have.  A mesh dim that shards nothing: coordinate 0."""
    reps: list[set[int]] = [set() for _ in mesh_shape]
    used = [False] * len(mesh_shape)
    for placements in layouts:
        for d, levels in enumerate(_levels(placements, len(shape))):
            for k, (i, parts) in enumerate(levels):
                used[i] = True
                n = mesh_shape[i]
                if n <= 8:
                    continue
                for ln in _length_classes(shape[d], levels, mesh_shape, k):
                    reps[i].update(_chunk_breaks(ln, n, parts))
    out = []
    for i, n in enumerate(mesh_shape):
        if not used[i]:
            out.append([0])
        elif n <= 8:
            out.append(list(range(n)))
        else:
            out.append(sorted(reps[i] | {c for c in (0, 1, 2, n - 3, n - 2, n - 1) if 0 <= c < n}))
    return out


# ---------------------------------------------------------------------------------------------
# the exchange
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Transfer:
    """One box moving from a sender's source shard to a receiver's target shard."""

    src_slices: tuple[tuple[int, int], ...]  # (start, length) per dim, in the sender's local tensor
    dst_slices: tuple[tuple[int, int], ...]  # (start, length) per dim, in the receiver's local tensor
    numel: int


@dataclass(frozen=True)
class ExchangePlan:
    """What ONE rank does in an exchange over its group (see the module docstring).

    ``sending`` / ``receiving``: ``(member, transfers)`` for the group members this rank sends
    boxes to / receives boxes from (in group order; the boxes in an order both sides derive
    alike); ``keeps``: boxes copied from its own source shard.  A group may have thousands of
    members, of whom a rank usually talks to a few: nothing here holds a slot per member
    (:attr:`sends` / :attr:`recvs` spell it out, for tests).  ``any_traffic`` is the same for
    every member of the group (so all skip the collective or none).
    """

    group_index: int
    group_size: int
    dst_shape: tuple[int, ...]
    sending: tuple[tuple[int, tuple[Transfer, ...]], ...]
    receiving: tuple[tuple[int, tuple[Transfer, ...]], ...]
    keeps: tuple[Transfer, ...]
    any_traffic: bool
    #: every member sends its WHOLE shard to every other member, and all shards have the same
    #: shape, ``src_shape``: the exchange is an all_gather of the unpacked shards (no packing on
    #: the send side), then the same per-box copies.  The same answer on every member (decided
    #: from metadata the group shares).
    gather: bool = False
    src_shape: tuple[int, ...] | None = None

    def _sizes(self, pairs) -> list[int]:
        out = [0] * self.group_size
        for g, ts in pairs:
            out[g] = sum(t.numel for t in ts)
        return out

    def send_sizes(self) -> list[int]:
        """Elements sent to each member, in group order (a fresh list: a collective's splits)."""
        return self._sizes(self.sending)

    def recv_sizes(self) -> list[int]:
        """Elements received from each member, in group order (a fresh list)."""
        return self._sizes(self.receiving)

    @property
    def sends(self) -> tuple[tuple[Transfer, ...], ...]:
        d = dict(self.sending)
        return tuple(d.get(g, ()) for g in range(self.group_size))

    @property
    def recvs(self) -> tuple[tuple[Transfer, ...], ...]:
        d = dict(self.receiving)
        return tuple(d.get(g, ()) for g in range(self.group_size))


def _local_start(x: int, ivs) -> int:
    """Local position of global index ``x`` in a rank holding intervals ``ivs``."""
    pos = 0
    for lo, hi in ivs:
        if lo <= x < hi:
            return pos + x - lo
        pos += hi - lo
    raise AssertionError(f"index {x} not in {ivs}")


def _transfers(src: Region, dst: Region) -> list[Transfer]:
    """The boxes ``src`` and ``dst`` share, with their local positions on both sides (row-major
    over the pieces of each dim, so sender and receiver list them alike)."""
    per_dim = []
    for a, b in zip(src, dst):
        pieces = _ivs_overlap(a, b)
        if not pieces:
            return []
        per_dim.append([((_local_start(lo, a), hi - lo), (_local_start(lo, b), hi - lo)) for lo, hi in pieces])
    out = []
    for combo in itertools.product(*per_dim):
        out.append(Transfer(tuple(s for s, _ in combo), tuple(t for _, t in combo),
                            math.prod(n for (_, n), _ in combo)))
    return out


def _is_prefix(a: Levels, b: Levels) -> bool:
    return len(a) <= len(b) and b[:len(a)] == a


def exchange_feasible(shape, mesh_shape, src, dst, dims: Sequence[int]) -> bool:
    """Can every rank get its target region from the members of its group over ``dims`` (under
    the rule of the module docstring)?  Per tensor dim: the source pieces the group's members hold
    make up the piece their outer levels outside the group leave, when the group holds all of that
    tensor dim's inner levels; the target must nest inside it (same outer levels).  Otherwise a
    bounded exact check over the coordinates of that dim's levels, and beyond it "no" (a larger
    group is then tried: the group of every non-Partial mesh dim always works)."""
    key = ("feasible", tuple(shape), tuple(mesh_shape), tuple(placement_key(p) for p in src),
           tuple(placement_key(p) for p in dst), tuple(dims))
    return memo(_costs_cache, key, lambda: _feasible(tuple(shape), tuple(mesh_shape), tuple(src), tuple(dst),
                                                     frozenset(dims)))


def _feasible(shape, mesh_shape, src, dst, G) -> bool:
    A, B = _levels(src, len(shape)), _levels(dst, len(shape))
    for d, length in enumerate(shape):
        a, b = A[d], B[d]
        k = len(a)
        while k and a[k - 1][0] in G:
            k -= 1
        if not any(i in G for i, _ in a[:k]) and _is_prefix(a[:k], b):
            continue
        if not _feasible_dim_by_enumeration(length, a, b, mesh_shape, G):
            return False
    return True


def _feasible_dim_by_enumeration(length, a: Levels, b: Levels, mesh_shape, G) -> bool:
    """Exactly, for one tensor dim: does every target piece lie in the union of the source pieces
    of its group (or is it empty)?  Only when the coordinates involved are few (``spec.ENUMERATION_LIMIT``)."""
    outside = sorted({i for i, _ in a if i not in G} | {i for i, _ in b})
    inside = sorted({i for i, _ in a if i in G})
    if math.prod(mesh_shape[i] for i in outside) * math.prod(mesh_shape[i] for i in inside) > ENUMERATION_LIMIT:
        return False
    coord = [0] * len(mesh_shape)
    for sub in itertools.product(*(range(mesh_shape[i]) for i in outside)):
        for i, v in zip(outside, sub):
            coord[i] = v
        want = _dim_ivs(length, b, mesh_shape, coord)
        if not want:
            continue
        have = 0
        for sub2 in itertools.product(*(range(mesh_shape[i]) for i in inside)):
            for i, v in zip(inside, sub2):
                coord[i] = v
            have += sum(hi - lo for lo, hi in _ivs_overlap(want, _dim_ivs(length, a, mesh_shape, coord)))
        if have != _ivs_len(want):
            return False
    return True


def _no_traffic(shape, src, dst, red) -> bool:
    """No member of any group needs anything it does not hold (decided from metadata every rank
    shares): nothing to reduce, and every target piece nests in the same rank's source piece."""
    if 0 in shape:
        return True
    if red:
        return False
    A, B = _levels(src, len(shape)), _levels(dst, len(shape))
    return all(_is_prefix(a, b) for a, b in zip(A, B))


def _gather_shape(shape, mesh_shape, src, dst, dims, coord):
    """The shard shape every member of ``coord``'s group holds when the exchange is an all_gather
    (every member needs every other member's whole shard, and all shards have one non-empty
    shape), else None.  Members share every fact read here."""
    A, B = _levels(src, len(shape)), _levels(dst, len(shape))
    G = set(dims)
    if not G <= {i for a in A for i, _ in a}:
        return None  # a replicated source dim in the group: its members hold the same data
    out = []
    for d, length in enumerate(shape):
        a, b = A[d], B[d]
        if any(i in G for i, _ in b) or not _is_prefix(b, a) or any(i in G for i, _ in a[:len(b)]):
            return None
        ln = length
        for i, parts in a:
            n = mesh_shape[i]
            if i in G:
                lens = [chunk_range(ln, parts, j)[1] for j in range(parts)]
                if any(v % n for v in lens):
                    return None
                ln = sum(lens) // n
            else:
                ln = _ivs_len(_cut(((0, ln),) if ln else (), n, coord[i], parts))
        if ln == 0:
            return None
        out.append(ln)
    return tuple(out)


def exchange_plan(shape, mesh_shape, src, dst, dims: Sequence[int], coord, red: Sequence[int] = ()) -> ExchangePlan | None:
    """This rank's part of the exchange from ``src`` to ``dst`` over the group of ``dims``; None
    when :func:`exchange_feasible` says the group cannot do it alone.  With ``red`` (Partial mesh
    dims of ``src`` inside ``dims``) it is a REDUCING exchange: every receiver gets one term of
    each element of its target per coordinate on ``red`` (its own among them, a keep) and sums
    them.  Costs the peers this rank exchanges with, not the ranks of the mesh."""
    shape, mesh_shape, src, dst = tuple(shape), tuple(mesh_shape), tuple(src), tuple(dst)
    dims, coord, red = tuple(sorted(dims)), tuple(coord), tuple(red)
    if not exchange_feasible(shape, mesh_shape, src, dst, dims):
        return None
    ndim = len(shape)
    A, B = _levels(src, ndim), _levels(dst, ndim)
    G = set(dims)
    src_dims = sorted({i for a in A for i, _ in a if i in G})  # the source-sharding dims of the group
    rep_dims = sorted(G - set(src_dims) - set(red))  # the group's replicated source dims
    mine_s = tuple(_dim_ivs(shape[d], A[d], mesh_shape, coord) for d in range(ndim))
    mine_t = tuple(_dim_ivs(shape[d], B[d], mesh_shape, coord) for d in range(ndim))
    size = math.prod(mesh_shape[i] for i in dims)
    me = group_index(mesh_shape, dims, coord)
    dst_shape = tuple(_ivs_len(iv) for iv in mine_t)
    sends: dict[int, list[Transfer]] = {}  # by group index; most members get nothing
    recvs: dict[int, list[Transfer]] = {}
    # one term of each element per coordinate on ``red``: a receiver hears from every one of them
    # (linear in the reduced group, which the collective spans anyway; never the whole mesh)
    red_coords = list(itertools.product(*(range(mesh_shape[i]) for i in red)))

    in_dst = {i for b in B for i, _ in b}
    if src_dims and rep_dims and size <= BALANCED_GROUP_RANKS:
        # replicated pieces: on a small group, its whole assignment with the sending shared out
        # evenly (:func:`_balanced_exchange`); the shift rule below gives each receiver's piece to
        # one replica, which piles up where few receivers need a piece or the replicas' own
        # targets differ
        outside = tuple(c for i, c in enumerate(coord) if i not in G)
        group = memo(_balanced_cache, (shape, mesh_shape, tuple(placement_key(p) for p in src),
                                       tuple(placement_key(p) for p in dst), dims, red, outside),
                     lambda: _balanced_exchange(shape, mesh_shape, A, B, dims, coord, src_dims, rep_dims, red),
                     limit=64)
        sending, receiving, kept = group[me]
        got = sum(t.numel for _, ts in receiving for t in ts) + sum(t.numel for t in kept)
        if got != math.prod(dst_shape) * len(red_coords):
            raise AssertionError(
                f"dtshard internal error: the balanced exchange {src} -> {dst} over mesh dims {dims} of mesh "
                f"{mesh_shape} (tensor {shape}) gives rank {coord} {got} of the "
                f"{math.prod(dst_shape) * len(red_coords)} terms it needs; please report it")
        return ExchangePlan(me, size, dst_shape, sending, receiving, kept, not _no_traffic(shape, src, dst, red))

    # what I receive: per tensor dim, the source pieces (over the group's source-sharding dims)
    # that meet my target; each from the replica :func:`_replica` names, once per coordinate on
    # ``red``
    per_dim = [_overlapping(shape[d], A[d], mesh_shape, coord, src_dims, mine_t[d]) for d in range(ndim)]
    keeps: list[Transfer] = []
    got = 0
    for combo in itertools.product(*per_dim):
        peer = list(coord)
        for assign, _ in combo:
            for i, c in assign:
                peer[i] = c
        _replica(peer, coord, src_dims, rep_dims, mesh_shape)
        boxes = _transfers(tuple(ivs for _, ivs in combo), mine_t)
        n = sum(t.numel for t in boxes)
        for rc in red_coords:
            for i, c in zip(red, rc):
                peer[i] = c
            got += n
            if tuple(peer) == coord:
                keeps.extend(boxes)
            else:
                recvs.setdefault(group_index(mesh_shape, dims, peer), []).extend(boxes)
    if got != math.prod(dst_shape) * len(red_coords):
        raise AssertionError(
            f"dtshard internal error: the exchange {src} -> {dst} over mesh dims {dims} of mesh {mesh_shape} "
            f"(tensor {shape}) covers {got} of the {math.prod(dst_shape) * len(red_coords)} elements rank "
            f"{coord} needs; please report it")

    # what I send: the receivers whose target pieces meet my source and who take that piece from
    # me (:func:`_replica` run backwards); a group dim that shards nothing in the target sends to
    # every coordinate there (a replicated source dim: to the one coordinate the rule gives)
    # (with no source-sharding dim in the group the shift is 0: a receiver shares my replicated
    # coordinates, which then need no search)
    vary = set(src_dims) | set(red) | (set(rep_dims) if src_dims else set())
    per_dim = [_overlapping(shape[d], B[d], mesh_shape, coord, vary, mine_s[d]) for d in range(ndim)]
    loose = sorted((set(src_dims) | set(red)) - in_dst)
    for combo in itertools.product(*per_dim):
        peer = list(coord)
        for assign, _ in combo:
            for i, c in assign:
                peer[i] = c
        boxes = _transfers(mine_s, tuple(ivs for _, ivs in combo))
        if not boxes:
            continue
        # every coordinate on a loose dim receives this piece (it shards nothing in the target):
        # linear in those dims of the group, the receivers themselves
        for sub in itertools.product(*(range(mesh_shape[i]) for i in loose)):
            for i, c in zip(loose, sub):
                peer[i] = c
            # I serve this receiver only if the rule names me for my piece: its replicated
            # coordinates, shifted by how far its source coordinates are from mine, are mine
            shift = sum(peer[k] - coord[k] for k in src_dims)
            ok = True
            for i in rep_dims:
                want = (coord[i] - shift) % mesh_shape[i]
                if i in in_dst:
                    ok = ok and peer[i] == want
                else:
                    peer[i] = want
            if ok and tuple(peer) != coord:
                sends.setdefault(group_index(mesh_shape, dims, peer), []).extend(boxes)

    traffic = not _no_traffic(shape, src, dst, red)
    gshape = None if red or not traffic else _gather_shape(shape, mesh_shape, src, dst, dims, coord)
    return ExchangePlan(me, size, dst_shape, _sorted(sends), _sorted(recvs), tuple(keeps), traffic,
                        gshape is not None, gshape)


def _sorted(by_member: dict) -> tuple:
    return tuple((g, tuple(by_member[g])) for g in sorted(by_member))


def _replica(peer: list, receiver, src_dims, rep_dims, mesh_shape) -> None:
    """Set ``peer``'s coordinates on the group's replicated source dims: which replica of the
    source piece ``peer`` names (its coordinates on ``src_dims``) sends it to ``receiver``.  The
    receiver's own coordinate there, shifted by how far the piece's coordinates are from the
    receiver's: every replica serves its share of the receivers (the receiver's own coordinate
    alone would make the replicas on the diagonal send everything when the target shards those
    very dims, e.g. ``(S1, R) -> (R, S1)``), and one receiver takes all the terms of an element
    from one replica (the same shift for every term)."""
    shift = sum(receiver[k] - peer[k] for k in src_dims)
    for i in rep_dims:
        peer[i] = (receiver[i] + shift) % mesh_shape[i]


#: an exchange whose group holds replicated pieces is balanced over the whole group
#: (:func:`_balanced_exchange`) when the group has at most this many ranks; larger groups keep
#: the shift rule of :func:`_replica` (docs/known-limits.md)
BALANCED_GROUP_RANKS = EXACT_PRICING_RANKS
_balanced_cache: dict = {}


def _balanced_exchange(shape, mesh_shape, A, B, dims, coord, src_dims, rep_dims, red):
    """Every member's ``(sending, receiving, keeps)`` in an exchange whose group holds replicated
    pieces (``rep_dims``), in group order, with the sending shared as evenly as the plans that
    receive the least allow.

    A *set* is the members that share every coordinate but the reduced ones ``red`` (``(s, rho)``:
    ``s`` on the source-sharding dims, which piece they hold, ``rho`` on the replicated ones; one
    member each when nothing is reduced); one set holds one complete set of terms of its piece.
    A receiver takes all terms of an element from one set.  Where it holds a term itself (its own
    set's piece) it takes them from its own set, the only choice that receives the least; that
    load is fixed (``forced``).  Every other element costs its receiver the same from whichever
    set holds it, so those (the ``free`` demand on piece ``s``) go where they balance the sending:
    the sets ``(s, rho)`` are filled like water over their forced loads (:func:`_water_fill`, the
    least possible maximum for the piece), and the free demand, laid end to end (receivers in
    group order, each one's boxes row-major), is cut into consecutive runs, one per set (so a
    receiver's piece is split only where a run ends).  The shift rule of :func:`_replica` gives
    each receiver's piece to one replica, which piles up where few receivers need a piece
    (``(S0, R) -> (R, S0)`` on 2x2: one rank sends all 12 elements another needs, where its
    replica could send half) or the replicas' own targets differ (``(R, P, S0) -> (S0, R, R)`` of
    ``[4]`` on 2x2x2: 4 elements where 3 suffice).

    Walks the whole group (its size squared in boxes at most), so only small groups
    (:data:`BALANCED_GROUP_RANKS`) take it; built once per group and shared by its members."""
    ndim = len(shape)
    size = math.prod(mesh_shape[i] for i in dims)
    members = [group_member(mesh_shape, dims, coord, g) for g in range(size)]
    piece = {}
    sets: dict[tuple, list[int]] = {}
    for g, m in enumerate(members):
        s = tuple(m[i] for i in src_dims)
        if s not in piece:
            piece[s] = tuple(_dim_ivs(shape[d], A[d], mesh_shape, m) for d in range(ndim))
        sets.setdefault((s, tuple(m[i] for i in rep_dims)), []).append(g)
    target = [tuple(_dim_ivs(shape[d], B[d], mesh_shape, m) for d in range(ndim)) for m in members]
    sends: list[dict[int, list[Transfer]]] = [{} for _ in members]
    recvs: list[dict[int, list[Transfer]]] = [{} for _ in members]
    keeps: list[list[Transfer]] = [[] for _ in members]
    load = [0] * size

    def move(g, q, boxes):
        sends[g].setdefault(q, []).extend(boxes)
        recvs[q].setdefault(g, []).extend(boxes)
        load[g] += sum(t.numel for t in boxes)

    # forced: what a receiver holds a term of comes from its own set
    for q, m in enumerate(members):
        s, rho = tuple(m[i] for i in src_dims), tuple(m[i] for i in rep_dims)
        boxes = _transfers(piece[s], target[q])
        if boxes:
            for g in sets[(s, rho)]:
                if g == q:
                    keeps[q].extend(boxes)
                else:
                    move(g, q, boxes)
    rhos = sorted({rho for _, rho in sets})
    for s in sorted(piece):
        demand = []
        for q, m in enumerate(members):
            if tuple(m[i] for i in src_dims) != s:
                boxes = _transfers(piece[s], target[q])
                if boxes:
                    demand.append((q, boxes, sum(t.numel for t in boxes)))
        if not demand:
            continue
        forced = [max(load[g] for g in sets[(s, rho)]) for rho in rhos]
        share = _water_fill(forced, sum(n for _, _, n in demand))
        runs, start = [], 0
        for rho, x in zip(rhos, share):
            runs.append((start, start + x, sets[(s, rho)]))
            start += x
        pos = 0
        for q, boxes, n in demand:
            for lo, hi, senders in runs:
                a, b = max(lo, pos), min(hi, pos + n)
                if a < b:
                    part = _boxes_span(boxes, a - pos, b - pos)
                    for g in senders:
                        move(g, q, part)
            pos += n
    return [(_sorted(sends[g]), _sorted(recvs[g]), tuple(keeps[g])) for g in range(size)]


def _water_fill(forced: Sequence[int], total: int) -> list[int]:
    """Split ``total`` units among bins already holding ``forced`` so the fullest bin holds the
    least possible: every bin filled up to one level ``t`` (the largest whose fill fits), the
    remainder one unit each to the lowest bins, first bin first."""
    if total <= 0 or not forced:
        return [0] * len(forced)
    lo, hi = min(forced), min(forced) + total
    while lo < hi:  # the largest level whose fill is at most total
        mid = (lo + hi + 1) // 2
        if sum(max(0, mid - f) for f in forced) <= total:
            lo = mid
        else:
            hi = mid - 1
    out = [max(0, lo - f) for f in forced]
    left = total - sum(out)
    for j in sorted(range(len(forced)), key=lambda j: (forced[j] + out[j], j)):
        if not left:
            break
        out[j] += 1
        left -= 1
    return out


def _span(lens: Sequence[int], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements ``a`` .. ``b - 1`` (row-major) of a box of ``lens``, as ``(offsets, lengths)`` boxes:
    a head in the first row, whole rows, a tail in the last (at most ``2 * len(lens) - 1``)."""
    if a >= b:
        return []
    if not lens:
        return [((), ())]
    inner = math.prod(lens[1:])
    rows = tuple(lens[1:])
    if a % inner == 0 and b % inner == 0:
        return [((a // inner,) + (0,) * len(rows), (b // inner - a // inner,) + rows)]
    ra, rb = a // inner, (b - 1) // inner
    if ra == rb:
        return [((ra,) + o, (1,) + n) for o, n in _span(rows, a - ra * inner, b - ra * inner)]
    out = _span(lens, a, (ra + 1) * inner)
    if rb > ra + 1:
        out.append(((ra + 1,) + (0,) * len(rows), (rb - ra - 1,) + rows))
    return out + _span(lens, rb * inner, b)


def _boxes_span(boxes: Sequence[Transfer], a: int, b: int) -> list[Transfer]:
    """Elements ``a`` .. ``b - 1`` of ``boxes`` laid end to end (each row-major), as transfers."""
    out, pos = [], 0
    for t in boxes:
        lo, hi = max(a, pos), min(b, pos + t.numel)
        if lo < hi:
            if lo == pos and hi == pos + t.numel:
                out.append(t)
            else:
                for offs, lens in _span([n for _, n in t.src_slices], lo - pos, hi - pos):
                    out.append(Transfer(tuple((s + o, n) for (s, _), o, n in zip(t.src_slices, offs, lens)),
                                        tuple((s + o, n) for (s, _), o, n in zip(t.dst_slices, offs, lens)),
                                        math.prod(lens)))
        pos += t.numel
    return out


# ---------------------------------------------------------------------------------------------
# pricing
# ---------------------------------------------------------------------------------------------


def exchange_costs(shape, mesh_shape, src, dst, dims: Sequence[int], red: Sequence[int] = ()) -> tuple[int, ...] | None:
    """Elements received in the exchange over ``dims`` (reducing the Partial mesh dims ``red``,
    see :func:`exchange_plan`): on a mesh of up to :data:`EXACT_PRICING_RANKS` ranks, by every
    rank (mesh coordinates in row-major order); above it, a 1-tuple, what the rank that receives
    most receives, over :func:`representative_coords`.  The same answer on every rank; None if
    some group cannot do it alone.  A receiver gets its whole target once per coordinate on
    ``red`` but for what it holds: ``|red| * |target| - |target & source|``."""
    key = (tuple(shape), tuple(mesh_shape), tuple(placement_key(p) for p in src),
           tuple(placement_key(p) for p in dst), tuple(dims), tuple(red))
    return memo(_costs_cache, key, lambda: _exchange_costs(tuple(shape), tuple(mesh_shape), tuple(src), tuple(dst),
                                                          tuple(dims), tuple(red)))


def _exchange_costs(shape, mesh_shape, src, dst, dims, red):
    if not exchange_feasible(shape, mesh_shape, src, dst, dims):
        return None
    k = math.prod(mesh_shape[i] for i in red)
    return per_rank_or_max(shape, mesh_shape, src, dst, lambda t, o: k * t - o)


def max_lacking(shape, mesh_shape, src, dst, reduce: bool) -> int:
    """The most elements of its target region any rank lacks in its source region (all of its
    target when a Partial must be reduced: it holds a term only): the transition's lower bound."""
    got = per_rank_or_max(shape, mesh_shape, src, dst, (lambda t, o: t) if reduce else (lambda t, o: t - o))
    return max(got) if got else 0


def per_rank_or_max(shape, mesh_shape, src, dst, f) -> tuple[int, ...]:
    """``f(|target|, |target & source|)`` for every rank (row-major) on meshes of up to
    :data:`EXACT_PRICING_RANKS` ranks, else ``(max over representative ranks,)``.

    The representative ranks: per group of tensor dims that share mesh dims (a mesh dim may shard
    one tensor dim in the source and another in the target), the coordinates of
    :func:`representative_coords` on those mesh dims, each giving that group's factors of both
    sizes; the maximum runs over their combinations (a few dozen), never over the ranks."""
    shape, mesh_shape = tuple(shape), tuple(mesh_shape)
    ndim = len(shape)
    A, B = _levels(src, ndim), _levels(dst, ndim)
    if math.prod(mesh_shape) <= EXACT_PRICING_RANKS:
        out = []
        for c in itertools.product(*(range(n) for n in mesh_shape)):
            t = o = 1
            for d in range(ndim):
                ti = _dim_ivs(shape[d], B[d], mesh_shape, c)
                t *= _ivs_len(ti)
                if o:
                    o *= sum(hi - lo for lo, hi in _ivs_overlap(ti, _dim_ivs(shape[d], A[d], mesh_shape, c)))
            out.append(f(t, o))
        return tuple(out)
    reps = representative_coords(mesh_shape, shape, (src, dst))
    # union-find of tensor dims through the mesh dims their levels use
    owner: dict[int, int] = {}
    parent = list(range(ndim))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for d in range(ndim):
        for i, _ in A[d] + B[d]:
            if i in owner:
                parent[find(d)] = find(owner[i])
            else:
                owner[i] = d
    comps: dict[int, list[int]] = {}
    for d in range(ndim):
        comps.setdefault(find(d), []).append(d)
    factor_sets = []
    for ds in comps.values():
        mdims = sorted({i for d in ds for i, _ in A[d] + B[d]})
        pairs = set()
        coord = [0] * len(mesh_shape)
        for sub in itertools.product(*(reps[i] for i in mdims)):
            for i, v in zip(mdims, sub):
                coord[i] = v
            t = o = 1
            for d in ds:
                ti = _dim_ivs(shape[d], B[d], mesh_shape, coord)
                t *= _ivs_len(ti)
                if o:
                    o *= sum(hi - lo for lo, hi in _ivs_overlap(ti, _dim_ivs(shape[d], A[d], mesh_shape, coord)))
            pairs.add((t, o))
        # keep the pairs no other pair beats on both counts (larger target, smaller overlap)
        front = [p for p in pairs if not any(q != p and q[0] >= p[0] and q[1] <= p[1] for q in pairs)]
        factor_sets.append(front)
    best = None
    for combo in itertools.product(*factor_sets):
        t = math.prod(p[0] for p in combo)
        o = math.prod(p[1] for p in combo)
        v = f(t, o)
        best = v if best is None or v > best else best
    return (best if best is not None else f(1, 1),)
