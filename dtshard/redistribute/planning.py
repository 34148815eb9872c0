"""Planning a redistribute: pure metadata, no tensors, no process group.

  A transition from placements ``src`` to ``dst`` on an N-D mesh is a
sequence of steps, each changing the placement of ONE mesh dim with one collective over that mesh
dim's process group (or a local slice / zeroing).  Steps are chosen by a shortest-path search over
placement states, priced in bytes each rank receives (ARCHITECTURE.md's table), so e.g. a 2x2
``(S0, S1) -> (S1, S0)`` goes through all_gather + all_to_all + slice and never gathers the full
tensor.

Which single-mesh-dim steps are legal follows from the nesting convention (mesh dims shard a tensor
dim in mesh-dim order, outermost first, see spec.py):
  - un-sharding tensor dim ``d`` on mesh dim ``i`` (all_gather, all_to_all source) is legal only if
    ``i`` is the innermost mesh dim sharding ``d`` (the group then holds one contiguous range);
  - sharding ``d`` on mesh dim ``i`` (slice, reduce_scatter, all_to_all target) is legal only if no
    mesh dim after ``i`` already shards ``d``;
  - reducing a Partial (all_reduce) and R -> P are always legal; P(a) -> P(b) and S -> P go via R.
"""

from __future__ import annotations

import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dtshard import layout as L
from dtshard.layout import exchange_costs
from dtshard.redistribute.packing import pads_reduce_scatter, parent_length
from dtshard.spec import (DTensorSpec, _itemsize, chunk_range, chunk_sizes, is_strided, local_shape,
                          local_shape_and_offset, memo, placement_equal, placement_key, placement_str,
                          placements_str)
from dtshard.spec import placement_kind as _kind

__all__ = ["Step", "GroupStep", "all_coords", "clear_plan_cache", "plan", "plan_text", "transition_cost",
           "transition_lower_bound"]

_R = Replicate()


@dataclass(frozen=True)
class Step:
    """One single-mesh-dim transition and the collective (or local op) that performs it."""

    mesh_dim: int
    src: Placement
    dst: Placement
    kind: str  # all_gather | all_reduce | reduce_scatter | all_to_all | slice | zero

    def __str__(self) -> str:
        return f"mesh dim {self.mesh_dim}: {placement_str(self.src)} -> {placement_str(self.dst)} {self.kind}"


@dataclass(frozen=True)
class GroupStep:
    """One collective over the flattened group of several mesh dims (``collectives.flat_group``)
    that changes the placements of all of them at once: ``src`` and ``dst`` are whole states.

    ``all_reduce``: Partial on every dim of ``mesh_dims`` -> Replicate (one reduction, one latency);
    ``reduce_scatter``: Partial on them -> Shard(d) on all of them (nested in mesh order);
    ``exchange``: any Shard/Replicate layout -> any other, as one ``all_to_all`` with per-rank split
    sizes in which each rank receives exactly what its new shard lacks (``dtshard.layout``);
    ``reduce_exchange``: Partial (sums and averages, or one max, or one min) on some of them -> any
    Shard/Replicate layout, as one such ``all_to_all`` in which each rank receives every other term
    of its new shard and reduces them (where no reduce_scatter can land, e.g. ``(P, S0) -> (S0, S0)``);
    ``all_gather``: Shard(d) on the innermost mesh dims sharding d -> Replicate on them, as one
    all_gather (one latency instead of one per mesh dim);
    ``reduce``: Partial on them -> a layout whose shards are empty but on one or two members of
    each group, as one ``reduce`` into each of those (a chain: no rank receives a piece twice).
    ``cost``: bytes received by the rank that receives most (the same number on every rank).
    Which rank sends what in an exchange, and why every Partial term it sums belongs to one
    complete set of terms, is ``dtshard.layout``'s rule.
    """

    mesh_dims: tuple[int, ...]
    src: tuple[Placement, ...]
    dst: tuple[Placement, ...]
    kind: str
    #: bytes each rank receives, by mesh coordinate (row-major), on meshes of up to
    #: ``layout.EXACT_PRICING_RANKS`` ranks; above that a 1-tuple: what the rank that receives
    #: most receives (``layout.exchange_costs``), so no step carries a number per rank
    costs: tuple[float, ...]

    @property
    def cost(self) -> float:
        return max(self.costs)

    @property
    def mesh_dim(self):
        return self.mesh_dims

    def __str__(self) -> str:
        dims = "x".join(str(d) for d in self.mesh_dims)
        return (f"mesh dims {dims} (flattened): {placements_str(self.src)} -> {placements_str(self.dst)} "
                f"{self.kind}")


def _step_kind_of_kinds(ks: str, kd: str) -> str | None:
    """The collective (or local step) that changes one mesh dim from a placement of kind ``ks``
    to one of kind ``kd`` (:func:`dtshard.spec.placement_kind`); None where there is no direct
    step (S -> P and P(a) -> P(b) go through R)."""
    if ks == "S":
        return {"R": "all_gather", "S": "all_to_all"}.get(kd)
    if ks == "R":
        return "slice" if kd == "S" else "zero"
    return {"R": "all_reduce", "S": "reduce_scatter"}.get(kd)  # src is Partial


#: _step_kind by (source kind, destination kind): the search's inner loop reads it directly
_KIND_OF_STEP = {(a, b): _step_kind_of_kinds(a, b) for a in "SRPT?" for b in "SRPT?"}


def _step_kind(src: Placement, dst: Placement) -> str | None:
    return _KIND_OF_STEP[_kind(src), _kind(dst)]


def _local_numel(shape: Sequence[int], mesh_shape: Sequence[int], state: Sequence[Placement]) -> int:
    """Elements of the largest local shard (coordinate 0 holds the largest chunks)."""
    s = list(shape)
    for i, p in enumerate(state):
        if _kind(p) == "S":
            s[p.dim] = chunk_range(s[p.dim], mesh_shape[i], 0)[1]
    n = 1
    for v in s:
        n *= v
    return n


def _local_len(shape, mesh_shape, state, d) -> int:
    """Length of tensor dim ``d`` in the largest local shard (coordinate 0 holds the largest)."""
    n = shape[d]
    for i, p in enumerate(state):
        if _kind(p) == "S" and p.dim == d:
            n = chunk_range(n, mesh_shape[i], 0)[1]
    return n


def _step_cost(shape, mesh_shape, state, i, dst, itemsize) -> float:
    """Bytes this rank receives for the step (plus a small charge for local-only work)."""
    kind = _step_kind(state[i], dst)
    split = _local_len(shape, mesh_shape, state, dst.dim) if kind in _SPLITS else 0
    return _kind_cost(kind, _local_numel(shape, mesh_shape, state) * itemsize, mesh_shape[i], split)


_SPLITS = ("reduce_scatter", "all_to_all")


def _kind_cost(kind: str, local: float, n: int, split_len: int) -> float:
    """Bytes a rank whose shard holds ``local`` bytes receives in a step of ``kind`` over a mesh
    dim of ``n`` ranks; ``split_len``: the length, in that shard, of the tensor dim a
    reduce_scatter / all_to_all splits."""
    if kind == "all_gather":
        return (n - 1) * local
    if kind == "all_reduce":
        return 2 * (n - 1) * local / n
    if kind in _SPLITS:
        # a rank receives n-1 pieces the size of the one it keeps: the largest, ceil(len / n)
        # of the tensor dim being split (which is not n-way even when the dim is uneven)
        return _split_cost(local, split_len, n)
    # local-only steps: charge a little so that plans without them win ties
    return 0.01 * local + 1.0


def _candidates(src: Sequence[Placement], dst: Sequence[Placement]) -> list[Placement]:
    cands: list[Placement] = [_R]
    for p in (*src, *dst):
        if p not in cands:
            cands.append(p)
    return cands


_plan_cache: dict[tuple, tuple[Step, ...]] = {}


def clear_plan_cache() -> None:
    """Forget every planned transition (benchmarks time a cold planner with it)."""
    _plan_cache.clear()
    _dijkstra_cache.clear()
    _bound_cache.clear()


def plan(spec: DTensorSpec, dst: Sequence[Placement]) -> tuple[Step, ...]:
    """The cheapest legal sequence of steps from ``spec.placements`` to ``dst``: single-mesh-dim
    steps (:class:`Step`) and, on N-D meshes, steps over flattened groups (:class:`GroupStep`)."""
    src = tuple(spec.placements)
    dst = tuple(dst)
    key = (src, dst, spec.shape, spec.mesh_shape, spec.dtype)
    try:
        hit = _plan_cache.get(key)
    except TypeError:  # a symbolic size (torch.compile's dynamic shapes) is not hashable
        if not any(type(d) is torch.SymInt for d in spec.shape):
            raise
        raise NotImplementedError(
            f"dtshard: redistribute of a DTensor of symbolic (dynamic) global shape {tuple(spec.shape)} "
            f"from {placements_str(src)} to {placements_str(dst)} on mesh {tuple(spec.mesh_shape)}: plans "
            "need concrete shapes. Compile with torch.compile(..., dynamic=False), or mark the inputs "
            "static (torch._dynamo.mark_static); a recompilation of the same code with other sizes (a "
            "second model, another FSDP group's hooks) otherwise turns the changed sizes dynamic.") from None
    if hit is not None:
        return hit
    if src == dst:
        _plan_cache[key] = ()
        return ()
    if len(src) == 1 and not _any_strided(src, dst):  # one mesh dim: a direct step, or two through Replicate (S->P, P(a)->P(b))
        kind = _step_kind(src[0], dst[0])
        if kind is not None:
            steps = (Step(0, src[0], dst[0], kind),)
        else:
            steps = (Step(0, src[0], _R, _step_kind(src[0], _R)), Step(0, _R, dst[0], _step_kind(_R, dst[0])))
        _plan_cache[key] = steps
        return steps
    steps = _best_plan(spec, src, dst)
    _plan_cache[key] = steps
    return steps


_dijkstra_cache: dict[tuple, tuple[Step, ...]] = {}  # sub-plans of the group search repeat across transitions


def _dijkstra(spec: DTensorSpec, src: tuple, dst: tuple) -> tuple[Step, ...]:
    """The cheapest sequence of single-mesh-dim steps (ValueError when there is none)."""
    shape, mesh_shape, itemsize = spec.shape, spec.mesh_shape, _itemsize(spec.dtype)
    key = (tuple(placement_key(p) for p in src), tuple(placement_key(p) for p in dst), tuple(shape),
           tuple(mesh_shape), itemsize)  # placements by exact type: a strided shard never equals a Shard
    return memo(_dijkstra_cache, key, lambda: _dijkstra_search(shape, mesh_shape, itemsize, src, dst))


def _dijkstra_search(shape, mesh_shape, itemsize, src: tuple, dst: tuple) -> tuple[Step, ...]:
    """Dijkstra over placement states; an edge changes one mesh dim's placement by one step
    (:func:`_step_kind`), legal when that mesh dim is the innermost one sharding its source's
    tensor dim and no later mesh dim shards the target's, priced by :func:`_step_cost`.  A state is a tuple of
    indices into the candidate placements (ints hash and compare in C; placements do not), and
    the per-state facts the edges need (each placement's kind, the tensor dims sharded by later
    mesh dims, the largest local shard) are computed once per state: the same plans and costs,
    in the same order, as evaluating those functions per edge on placements."""
    cands = _candidates(src, dst)
    index = lambda p: next(k for k, c in enumerate(cands) if c == p)  # noqa: E731
    kinds = [_kind(q) for q in cands]
    sdim = [q.dim if k == "S" else None for q, k in zip(cands, kinds)]
    start, goal = tuple(index(p) for p in src), tuple(index(p) for p in dst)
    best: dict[tuple, float] = {start: 0.0}
    heap: list = [(0.0, 0, start, ())]
    tie = 1
    ndim = len(src)
    mesh_shape = tuple(mesh_shape)
    latency = STEP_MEMBER_BYTES if math.prod(mesh_shape) > L.EXACT_PRICING_RANKS else 0
    while heap:
        cost, _, state, steps = heapq.heappop(heap)
        if state == goal:
            return tuple(Step(i, cands[a], cands[b], kind) for i, a, b, kind in steps)
        if cost > best.get(state, float("inf")):
            continue
        # the largest local shard of this state (coordinate 0 holds the largest chunks)
        lens = list(shape)
        for i, a in enumerate(state):
            if sdim[a] is not None:
                lens[sdim[a]] = chunk_range(lens[sdim[a]], mesh_shape[i], 0)[1]
        local = math.prod(lens) * itemsize
        for i in range(ndim):
            a = state[i]
            ka = kinds[a]
            later = {sdim[b] for b in state[i + 1:] if sdim[b] is not None}  # tensor dims later mesh dims shard
            if ka == "S" and sdim[a] in later:
                continue  # not the innermost mesh dim sharding that dim: no step off it is legal
            n = mesh_shape[i]
            for b in range(len(cands)):
                if b == a:
                    continue
                kind = _KIND_OF_STEP.get((ka, kinds[b]))
                if kind is None or (kinds[b] == "S" and sdim[b] in later):
                    continue
                split = 0
                if kind in _SPLITS:  # the dim being split, in the largest local shard of this state
                    split = shape[sdim[b]]
                    for j, c in enumerate(state):
                        if sdim[c] == sdim[b]:
                            split = chunk_range(split, mesh_shape[j], 0)[1]
                new_cost = (cost + _kind_cost(kind, local, n, split) + latency * (n - 1) * (kind not in _LOCAL)
                            + COPY_WEIGHT * _copy_bytes(kind, lens, sdim[a], sdim[b], n, local))
                new_state = state[:i] + (b,) + state[i + 1:]
                if new_cost < best.get(new_state, float("inf")):
                    best[new_state] = new_cost
                    heapq.heappush(heap, (new_cost, tie, new_state, steps + ((i, a, b, kind),)))
                    tie += 1
    raise ValueError(
        f"redistribute: no legal path from {placements_str(src)} to {placements_str(dst)} "
        f"for a tensor of shape {tuple(shape)} on a mesh of shape {tuple(mesh_shape)}"
    )




#: A local copy of a byte costs this fraction of receiving one (memory bandwidth is tens of times
#: a link's): the single-mesh-dim search adds it for the packing and unpacking a step needs, so of
#: two orders that receive the same bytes the one that joins pieces along an inner tensor dim while
#: they are small wins: (S0, S1) -> (R, R) on 128 x 256 ranks gathers dim 1 first (32 KiB copied)
#: rather than last (4 MiB joined from 256 pieces; 5x PyTorch's cached call).
COPY_WEIGHT = 1 / 32


def _copy_bytes(kind: str, lens, a_dim, b_dim, n: int, local: float) -> float:
    """Bytes a single-mesh-dim step copies locally around its collective (running.py): a gather
    or an all_to_all joins pieces along a tensor dim with a copy unless every dim before it is
    trivial in the shard; a reduce_scatter / all_to_all packs its pieces unless the dim it splits
    is.  ``lens``: the largest local shard; ``a_dim`` / ``b_dim``: the tensor dims the source /
    target placement shards (None for R, P)."""
    def outer(d):
        return all(v == 1 for v in lens[:d])
    if kind == "all_gather":
        return 0.0 if outer(a_dim) else n * local
    if kind == "reduce_scatter":
        return 0.0 if outer(b_dim) else local
    if kind == "all_to_all":
        return (0.0 if outer(b_dim) else local) + (0.0 if outer(a_dim) else local)
    return 0.0


def _plan_copy_bytes(spec: DTensorSpec, steps) -> float:
    """The local work a plan's group steps add beyond the single-mesh-dim steps' (whose copies
    the single-dim search has already weighed, :func:`_copy_bytes`): a reducing exchange unpacks
    every term it receives into a stack and sums the stack (about three times the bytes it
    receives, where a reduce_scatter leaves the sum to the backend), a flattened reduce_scatter
    packs its input unless it splits the outermost non-trivial dim.  A plain exchange is charged
    nothing: it copies about what an all_to_all would, and single-dim steps win exact ties."""
    itemsize = _itemsize(spec.dtype)
    shape, mesh_shape = spec.shape, spec.mesh_shape
    state = list(spec.placements)
    total = 0.0
    for s in steps:
        if isinstance(s, GroupStep):
            if s.kind == "reduce_exchange":
                total += 3 * max(s.costs)
            elif s.kind == "reduce_scatter":  # packs as a single-dim reduce_scatter does
                lens = [_local_len(shape, mesh_shape, state, e) for e in range(len(shape))]
                total += _copy_bytes("reduce_scatter", lens, None, s.dst[s.mesh_dims[0]].dim, 0,
                                     math.prod(lens) * itemsize)
            state = list(s.dst)
        else:
            state[s.mesh_dim] = s.dst
    return total


def _steps_cost(spec: DTensorSpec, steps) -> float:
    """Bytes received by the rank that receives most over the whole plan.  Group steps price each
    rank on small meshes (``costs`` by mesh coordinate; the plan's group steps then add up rank by
    rank) and the rank that receives most on large ones (a 1-tuple; the plan then adds up those
    maxima, a bound that never undercounts); a single-mesh-dim step is priced by its largest
    shard, for every rank."""
    flat = 0.0
    per_rank = None
    state = list(spec.placements)
    itemsize = _itemsize(spec.dtype)
    for s in steps:
        if isinstance(s, GroupStep):
            flat += _member_charge(spec.mesh_shape, s)
            if len(s.costs) == 1 or (per_rank is not None and len(per_rank) != len(s.costs)):
                flat += max(s.costs)
            else:
                per_rank = list(s.costs) if per_rank is None else [a + b for a, b in zip(per_rank, s.costs)]
            state = list(s.dst)
        else:
            flat += _step_cost(spec.shape, spec.mesh_shape, tuple(state), s.mesh_dim, s.dst, itemsize)
            if s.kind not in _LOCAL and math.prod(spec.mesh_shape) > L.EXACT_PRICING_RANKS:
                flat += STEP_MEMBER_BYTES * (spec.mesh_shape[s.mesh_dim] - 1)
            state[s.mesh_dim] = s.dst
    return flat + (max(per_rank) if per_rank else 0.0)


#: on meshes of up to this many ranks, the planner also works out what each rank SENDS in the
#: plans that receive within 1.25x of the least (:func:`plan_sends`, rank by rank): where the plan
#: it would pick makes some rank send more than 1.25x another of them does, it takes the other
#: (:func:`_sends_shared`)
SEND_PRICING_RANKS = 16


def plan_sends(spec: DTensorSpec, steps) -> tuple[int, ...]:
    """Bytes each rank (mesh coordinates in row-major order) sends in ``steps``, as the
    collectives count them (``CommCounter.bytes``: a ring all_gather sends ``n - 1`` copies of its
    padded shard, a ring all_reduce ``2 (n - 1) / n`` of it, a reduce_scatter ``(n - 1) / n`` of its
    padded input or, of exact pieces, every piece but its own, an all_to_all every split but its
    own, an exchange its plan's send sizes).  Walks every rank, so meshes of up to
    :data:`SEND_PRICING_RANKS` ranks only (tests hold it to the counts measured on real ranks)."""
    itemsize = _itemsize(spec.dtype)
    shape, mesh_shape = tuple(spec.shape), tuple(spec.mesh_shape)
    if math.prod(mesh_shape) > SEND_PRICING_RANKS:
        raise ValueError(f"plan_sends walks every rank: meshes of up to {SEND_PRICING_RANKS} ranks, not "
                         f"{tuple(mesh_shape)}")
    out = []
    for c in all_coords(mesh_shape):
        state = tuple(spec.placements)
        sent = 0
        for s in steps:
            x = local_shape(shape, mesh_shape, state, c)
            nbytes = math.prod(x) * itemsize
            if isinstance(s, GroupStep):
                dims, k = s.mesh_dims, math.prod(mesh_shape[i] for i in s.mesh_dims)
                if s.kind in ("exchange", "reduce_exchange"):
                    red = tuple(i for i in dims if isinstance(s.src[i], Partial)) if s.kind == "reduce_exchange" else ()
                    ep = L.exchange_plan(shape, mesh_shape, s.src, s.dst, dims, c, red)
                    if ep.any_traffic:
                        sent += (k - 1) * nbytes if ep.gather else sum(ep.send_sizes()) * itemsize
                elif s.kind == "all_reduce":
                    sent += 2 * (k - 1) * nbytes // k
                elif s.kind == "reduce":  # every member sends each piece but its own
                    me = L.group_index(mesh_shape, dims, c)
                    sent += sum(math.prod(local_shape(shape, mesh_shape, s.dst, m))
                                for g, m in enumerate(L.group_coords(mesh_shape, dims, c)) if g != me) * itemsize
                elif s.kind in ("reduce_scatter", "all_gather"):
                    placements = s.dst if s.kind == "reduce_scatter" else s.src
                    d = placements[dims[0]].dim
                    sizes = [local_shape(shape, mesh_shape, placements, m)[d]
                             for m in L.group_coords(mesh_shape, dims, c)]
                    me = L.group_index(mesh_shape, dims, c)
                    sent += _collective_sends(s.kind, x, d, sizes, me, itemsize, padded=False)
                state = tuple(s.dst)
                continue
            n = mesh_shape[s.mesh_dim]
            if n > 1 and s.kind not in _LOCAL:
                if s.kind == "all_reduce":
                    sent += 2 * (n - 1) * nbytes // n
                elif s.kind == "all_gather":
                    d = s.src.dim
                    sizes = chunk_sizes(parent_length(spec, state, s.mesh_dim, c, d), n)
                    sent += _collective_sends("all_gather", x, d, sizes, c[s.mesh_dim], itemsize)
                elif s.kind == "reduce_scatter":
                    sizes = chunk_sizes(x[s.dst.dim], n)
                    sent += _collective_sends("reduce_scatter", x, s.dst.dim, sizes, c[s.mesh_dim], itemsize,
                                              padded=pads_reduce_scatter(s.src.reduce_op, sizes))
                elif s.kind == "all_to_all":
                    d, e = s.src.dim, s.dst.dim
                    if math.prod(v for j, v in enumerate(x) if j not in (d, e)) and \
                            parent_length(spec, state, s.mesh_dim, c, d) and x[e]:
                        sizes_e = chunk_sizes(x[e], n)
                        sent += (x[e] - sizes_e[c[s.mesh_dim]]) * (math.prod(x) // x[e]) * itemsize
            state = state[:s.mesh_dim] + (s.dst,) + state[s.mesh_dim + 1:]
        out.append(sent)
    return tuple(out)


def _collective_sends(kind: str, x, d: int, sizes, me: int, itemsize: int, padded: bool = True) -> int:
    """Bytes a rank holding a shard of shape ``x`` sends in an all_gather along / reduce_scatter
    onto tensor dim ``d`` over a group whose members' lengths there are ``sizes`` (running.py's
    paths: nothing when the data is empty, the padded buffer, or for an unpadded uneven
    reduce_scatter the exact pieces by all_to_all)."""
    n, block = len(sizes), max(sizes)
    per = math.prod(v for j, v in enumerate(x) if j != d)
    if kind == "all_gather":
        if block == 0 or per == 0:
            return 0
        return (n - 1) * block * per * itemsize
    if math.prod(x) == 0:
        return 0
    if not padded and any(v != block for v in sizes):
        return (sum(sizes) - sizes[me]) * per * itemsize
    return (n - 1) * (n * block * per * itemsize) // n


def all_coords(mesh_shape) -> list[tuple[int, ...]]:
    """Every coordinate of the mesh: for tests and small meshes only (never on a path whose cost
    must not grow with the ranks)."""
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _exact_pricing(mesh_shape) -> bool:
    """Group steps price every rank on meshes this small (see ``layout.EXACT_PRICING_RANKS``)."""
    return math.prod(mesh_shape) <= L.EXACT_PRICING_RANKS


def _any_strided(*states) -> bool:
    return any(is_strided(p) for st in states for p in st)


def _best_plan(spec: DTensorSpec, src: tuple, dst: tuple) -> tuple:
    """The cheaper of the single-mesh-dim plan and the plans with steps over flattened groups
    (a reduction over all Partial dims at once, then an exchange); single-dim steps win ties (the
    plain collectives need no per-atom packing).  Strided shards move by group steps only (the
    single-dim steps assume each shard is one contiguous chunk of its parent)."""
    cands = []
    if not _any_strided(src, dst):
        try:
            cands.append(_dijkstra(spec, src, dst))
        except ValueError:
            pass
    cands.extend(_group_plans(spec, src, dst))
    if not cands:
        raise ValueError(
            f"redistribute: no legal path from {placements_str(src)} to {placements_str(dst)} "
            f"for a tensor of shape {tuple(spec.shape)} on a mesh of shape {tuple(spec.mesh_shape)}")
    # bytes received, plus COPY_WEIGHT per byte the plan copies locally around its collectives:
    # of two plans receiving about the same, the one that packs, unpacks and sums less wins
    received = [_steps_cost(spec, c) for c in cands]
    costs = [r + COPY_WEIGHT * _plan_copy_bytes(spec, c) for r, c in zip(received, cands)]
    least = min(costs)
    # among the plans that receive the least bytes: no flattened group of several mesh dims (each
    # is a communicator of its own, costly at thousands of ranks: one is created only where a step
    # over it receives strictly less), then the fewest collectives (latencies), then the fewest
    # exchanges (their per-box packing costs more CPU than a plain collective's), then the first
    # found (single-mesh-dim steps first)
    tied = [k for k, c in enumerate(costs) if c <= least * (1 + 1e-6) + 1.0]

    def order(k):
        return (_flattens(cands[k]), _n_collectives(cands[k]),
                sum(s.kind in ("exchange", "reduce_exchange") for s in cands[k]), k)

    k = min(tied, key=order)
    if math.prod(spec.mesh_shape) <= SEND_PRICING_RANKS and len(cands) > 1:
        k = _sends_shared(spec, cands, received, costs, k, order)
    return cands[k]


def _sends_shared(spec: DTensorSpec, cands, received, costs, k: int, order) -> int:
    """``k``, unless it makes the busiest sender send over 1.25x what another plan receiving at
    most 1.25x the least does: then, of the plans within 1.25x of the least sending among those,
    the one that receives least.  Both of a rank's links then carry at most 1.25x their least:
    plans that receive about alike can differ in sending (an all_reduce then an exchange sends
    every term of a small result twice where a reduce_scatter then the exchange, or one reducing
    exchange, sends each once).  ``received`` / ``costs``: each plan's bytes received, and with
    the copy charge."""
    least = min(received)
    pool = [j for j, r in enumerate(received) if r <= 1.25 * least + 1.0]
    if pool == [k]:
        return k
    sends = {j: max(plan_sends(spec, cands[j]), default=0) for j in set(pool) | {k}}
    best = min(sends[j] for j in pool)
    if sends[k] <= 1.25 * best:
        return k
    return min((j for j in pool if sends[j] <= 1.25 * best), key=lambda j: (received[j], costs[j], order(j)))


#: On meshes of more than ``layout.EXACT_PRICING_RANKS`` ranks every collective step pays, in
#: bytes of bandwidth, this much per member of its group beyond the first: a ring collective takes
#: a step per member and an all_to_all a message per peer, each a network latency (~1 us, ~16 KiB
#: at 16 GB/s).  So a flattened group of ``k`` ranks costs ``k - 1`` latencies where per-mesh-dim
#: steps over the same dims cost ``sum(n_i - 1)``, and a plan of six collectives that saves a few
#: per cent of padding loses to three plain all_gathers.  Small meshes are priced by bytes alone
#: (their plans are the ones the bound tests hold to 1.25x the minimum).  At 4,096 ranks an
#: exchange that received 2% less than two all_gathers cost 30 ms of CPU per cached call against
#: their 2 ms (fake process group), and its 4,095 messages would be real latency on a network.
STEP_MEMBER_BYTES = 16384
#: an exchange also packs and unpacks a piece per peer in Python (a plain collective does not):
#: this much more per member of its group, on large meshes
EXCHANGE_MEMBER_BYTES = 2048
_LOCAL = ("slice", "zero")


def _member_charge(mesh_shape, step) -> float:
    if math.prod(mesh_shape) <= L.EXACT_PRICING_RANKS or step.kind in _LOCAL:
        return 0.0
    k = math.prod(mesh_shape[i] for i in step.mesh_dims)
    per = STEP_MEMBER_BYTES + (EXCHANGE_MEMBER_BYTES if step.kind in ("exchange", "reduce_exchange") else 0)
    return per * (k - 1)


def _flattens(steps) -> bool:
    """Does the plan run a collective over a flattened group of several mesh dims?"""
    return any(isinstance(s, GroupStep) and len(s.mesh_dims) > 1 and s.kind not in ("slice", "zero") for s in steps)


def _n_collectives(steps) -> int:
    return sum(1 for s in steps if s.kind not in ("slice", "zero"))


def _partials_to_reduce(src: tuple, dst: tuple) -> list[int]:
    """Mesh dims whose Partial the transition must reduce (not kept as the same Partial)."""
    return [i for i, p in enumerate(src) if isinstance(p, Partial) and not placement_equal(p, dst[i])]


def _group_plans(spec: DTensorSpec, src: tuple, dst: tuple) -> list[tuple]:
    """Candidate plans built from GroupSteps (none on a 1-D mesh: single steps are optimal)."""
    strided = _any_strided(src, dst)
    if len(src) < 2 and not strided:
        return []
    red = _partials_to_reduce(src, dst)
    out = []
    if not red:
        ex = _exchange_steps(spec, src, dst)
        if ex is not None:
            out.append(ex)
        if not strided:
            out.extend(_gather_plans(spec, src, dst))
        return out
    ops = {src[i].reduce_op for i in red}
    if len(ops) != 1 and not ops <= {"sum", "avg"}:
        return out  # max/min mixed with other reductions do not commute: one mesh dim at a time
    if ops <= {"sum", "avg"} or ops in ({"max"}, {"min"}):
        for steps in (_reduce_exchange_steps(spec, src, dst, tuple(red)), _reduce_to_steps(spec, src, dst, tuple(red))):
            if steps is not None:
                out.append(steps)
    for mid, step in _reductions(spec, src, tuple(red)):
        if mid == dst:
            out.append((step,))
            continue
        rest = _exchange_steps(spec, mid, dst)
        if rest is not None:
            out.append((step, *rest))
        if not _any_strided(mid, dst):
            try:
                out.append((step, *_dijkstra(spec, mid, dst)))
            except ValueError:
                pass
    return out


def _gather_plans(spec: DTensorSpec, src: tuple, dst: tuple) -> list[tuple]:
    """Plans that start with ONE all_gather over the flattened group of the innermost mesh dims
    sharding a tensor dim (``(S0, S0) -> (R, R)`` in one collective and one latency, instead of
    two all_gathers), then go on with single-dim steps."""
    out = []
    for d in range(len(spec.shape)):
        dims = [i for i, p in enumerate(src) if isinstance(p, Shard) and p.dim == d]
        for k in range(len(dims) - 1):
            group = tuple(dims[k:])  # a suffix: nothing after it shards d, so it is innermost
            if not all(type(dst[i]) is not Shard or dst[i].dim != d for i in group):
                continue  # keep the gather for dims whose target still shards d
            mid = tuple(_R if i in group else p for i, p in enumerate(src))
            step = GroupStep(group, src, mid, "all_gather", _flat_gather_costs(spec, src, group))
            if mid == dst:
                out.append((step,))
                continue
            try:
                out.append((step, *_dijkstra(spec, mid, dst)))
            except ValueError:
                pass
    return out


def _flat_gather_costs(spec: DTensorSpec, src: tuple, group: tuple) -> tuple[float, ...]:
    """Bytes each rank receives in a flattened all_gather: the k-1 other pieces, each padded to
    the group's largest (the same padding the collective moves).  The largest piece of any group
    is the mesh's largest shard, at coordinate 0 (chunk 0 is the largest at every level), so on
    large meshes that is the price, with no walk over the ranks."""
    itemsize = _itemsize(spec.dtype)
    shape, mesh_shape = spec.shape, spec.mesh_shape
    k = math.prod(mesh_shape[i] for i in group)
    if not _exact_pricing(mesh_shape):
        return ((k - 1) * L.box_numel(L.rank_box(shape, mesh_shape, src, (0,) * len(mesh_shape))) * itemsize,)
    costs = []
    for c in all_coords(mesh_shape):
        largest = max(L.box_numel(L.rank_box(shape, mesh_shape, src, m)) for m in L.group_coords(mesh_shape, group, c))
        costs.append((k - 1) * largest * itemsize)
    return tuple(costs)


def _reductions(spec: DTensorSpec, src: tuple, red: tuple):
    """(state after, GroupStep) for one reduction of the Partial dims ``red`` (flattened): an
    all_reduce to Replicate, or a reduce_scatter onto each tensor dim it may legally shard.  Sums
    and averages mix (a sum over the group, scaled by 1/size of the averaged dims).  Priced rank
    by rank on small meshes, by the largest shard (coordinate 0) on large ones."""
    itemsize = _itemsize(spec.dtype)
    shape, mesh_shape = spec.shape, spec.mesh_shape
    coords = all_coords(mesh_shape) if _exact_pricing(mesh_shape) else [(0,) * len(mesh_shape)]
    k = 1
    for i in red:
        k *= mesh_shape[i]
    mid = tuple(_R if i in red else p for i, p in enumerate(src))
    ring = tuple(2 * (k - 1) / k * L.box_numel(L.rank_box(shape, mesh_shape, src, c)) * itemsize for c in coords)
    yield mid, GroupStep(red, src, mid, "all_reduce", ring)
    for d in range(len(spec.shape)):
        # the new shards nest after every mesh dim already sharding d (spec.py's convention)
        if any(isinstance(p, Shard) and p.dim == d and i > red[0] for i, p in enumerate(src)):
            continue
        if any(is_strided(p) and p.dim == d for p in src):
            continue  # the pieces of a strided dim are not nested chunks: reduce, then exchange
        mid = tuple(Shard(d) if i in red else p for i, p in enumerate(src))
        # each rank receives the k-1 other terms of the piece it keeps (pieces may differ)
        pieces = tuple((k - 1) * L.box_numel(L.rank_box(shape, mesh_shape, mid, c)) * itemsize for c in coords)
        yield mid, GroupStep(red, src, mid, "reduce_scatter", pieces)


def _exchange_steps(spec: DTensorSpec, src: tuple, dst: tuple):
    """``(GroupStep,)`` for an exchange from ``src`` to ``dst`` (Shard/Replicate changes; Partial
    dims must be equal in both and stay outside the group), over the smallest group of mesh
    dims that holds everything its members need; None when impossible or a no-op."""
    if src == dst:
        return None
    pdims = [i for i, p in enumerate(src) if isinstance(p, Partial)]
    if any(not placement_equal(src[i], dst[i]) for i in pdims):
        return None
    # new Partial dims: exchange to Replicate there, then zero locally (R -> P costs nothing)
    zero = [i for i, p in enumerate(dst) if isinstance(p, Partial) and i not in pdims]
    if zero:
        target = tuple(_R if i in zero else p for i, p in enumerate(dst))
        head = _exchange_steps(spec, src, target) if target != src else ()
        if head is None:
            return None
        return (*head, *(Step(i, _R, dst[i], "zero") for i in zero))
    free = [i for i in range(len(src)) if i not in pdims]
    changed = [i for i in free if not placement_equal(src[i], dst[i])]
    mesh_shape = spec.mesh_shape
    for extra in range(len(free) - len(changed) + 1):
        for more in itertools.combinations([i for i in free if i not in changed], extra):
            dims = tuple(sorted(changed + list(more)))
            costs = exchange_costs(spec.shape, mesh_shape, src, dst, dims)
            if costs is not None:
                itemsize = _itemsize(spec.dtype)
                return (GroupStep(dims, src, dst, "exchange", tuple(c * itemsize for c in costs)),)
    return None


def _reduce_exchange_steps(spec: DTensorSpec, src: tuple, dst: tuple, red: tuple):
    """``(GroupStep,)`` that reduces the Partial dims ``red`` (sums and averages, or all max, or
    all min) AND moves to
    ``dst`` in ONE all_to_all whose receivers sum the terms: each rank receives one term of each
    element of its target shard from every coordinate on ``red`` but its own, the least any plan
    can receive (a reduce_scatter onto a tensor dim that a later mesh dim already shards, e.g.
    ``(P, S0) -> (S0, S0)``, is impossible, and going through one costs a second collective).
    None when ``dst`` keeps or adds a Partial the step cannot make, or no group holds the terms."""
    kept = [i for i, p in enumerate(src) if isinstance(p, Partial) and i not in red]
    if any(isinstance(p, Partial) and (i not in kept or not placement_equal(p, src[i])) for i, p in enumerate(dst)):
        return None
    if any(isinstance(p, Partial) for i, p in enumerate(src) if i in red and isinstance(dst[i], Partial)):
        return None
    free = [i for i in range(len(src)) if i not in kept]
    changed = sorted(set(red) | {i for i in free if not placement_equal(src[i], dst[i])})
    itemsize = _itemsize(spec.dtype)
    for extra in range(len(free) - len(changed) + 1):
        for more in itertools.combinations([i for i in free if i not in changed], extra):
            dims = tuple(sorted(changed + list(more)))
            costs = exchange_costs(spec.shape, spec.mesh_shape, src, dst, dims, red)
            if costs is not None:
                return (GroupStep(dims, src, dst, "reduce_exchange", tuple(c * itemsize for c in costs)),)
    return None


#: a reduction whose result lands on at most this many members of each group (the target leaves
#: the others empty) may run as one ``reduce`` per such member (:func:`_reduce_to_steps`)
REDUCE_TO_MAX_TARGETS = 2


def _reduce_to_steps(spec: DTensorSpec, src: tuple, dst: tuple, red: tuple):
    """``(GroupStep,)`` that reduces the Partial dims ``red`` straight into the few members of each
    group whose target shard is not empty, one ``reduce`` collective each (``collectives.reduce``:
    a chain into that member, so a rank sends its piece once and receives at most one), where only
    ``red`` changes and the target leaves the other members of the group empty: ``(P, P) -> (S1,
    S1)`` of a ``[2, 1]`` tensor on 2x2 (one rank gets the whole sum) receives 2 elements and sends
    2, where an all_reduce sends 3 and collecting the terms receives 6.  On meshes priced rank by
    rank only (it names every member's target)."""
    mesh_shape, shape = spec.mesh_shape, spec.shape
    if not _exact_pricing(mesh_shape) or _any_strided(src, dst):
        return None
    if any(isinstance(dst[i], Partial) for i in red) or \
            any(not placement_equal(src[i], dst[i]) for i in range(len(src)) if i not in red):
        return None
    itemsize = _itemsize(spec.dtype)
    costs = []
    for c in all_coords(mesh_shape):
        # every target inside the shard its group holds terms of (not where a reduced dim would
        # shard a tensor dim outside a later mesh dim's piece: (P, S0) -> (S0, S0))
        (have, start), (want, at) = (local_shape_and_offset(shape, mesh_shape, p, c) for p in (src, dst))
        if math.prod(want) and any(a < s or a + w > s + h for a, w, s, h in zip(at, want, start, have)):
            return None
        sizes = [math.prod(local_shape(shape, mesh_shape, dst, m)) for m in L.group_coords(mesh_shape, red, c)]
        filled = [v for v in sizes if v]
        if len(filled) > REDUCE_TO_MAX_TARGETS or len(filled) == len(sizes):
            return None  # not sparse: a reduce_scatter or an exchange does it in one collective
        costs.append(sum(filled) * itemsize)  # a chain member receives each piece at most once
    if not any(costs):
        return None
    return (GroupStep(red, src, dst, "reduce", tuple(costs)),)


def _cost_1d(shape, n: int, src: Placement, dst: Placement, itemsize: int) -> float:
    """transition_cost on a 1-D mesh without building Steps: what _step_cost charges for the direct
    step, or for the two steps through Replicate (S -> P, P(a) -> P(b))."""
    numel = 1
    for v in shape:
        numel *= v
    ts, td = type(src), type(dst)
    if ts is Shard or (ts is not Replicate and ts is not Partial and isinstance(src, Shard)):
        size = shape[src.dim]
        local = (-(-size // n) * (numel // size) if size else 0) * itemsize  # the largest chunk
        if td is Replicate or (td is not Partial and td is not Shard and isinstance(dst, Replicate)):
            return (n - 1) * local
        if td is Shard or (td is not Partial and isinstance(dst, Shard)):
            return _split_cost(local, shape[dst.dim], n)
        return (n - 1) * local + 0.01 * numel * itemsize + 1.0  # all_gather, then zero (-> Partial)
    full = numel * itemsize
    if ts is Replicate or (ts is not Partial and isinstance(src, Replicate)):
        return 0.01 * full + 1.0  # a local slice or zeroing
    # Partial source
    if td is Replicate or (td is not Shard and isinstance(dst, Replicate)):
        return 2 * (n - 1) * full / n
    if td is Shard or (td is not Partial and isinstance(dst, Shard)):
        return _split_cost(full, shape[dst.dim], n)
    return 2 * (n - 1) * full / n + 0.01 * full + 1.0  # all_reduce, then zero (P(a) -> P(b))


def _split_cost(local: float, length: int, n: int) -> float:
    """Bytes received when a shard of ``local`` bytes is split n ways along a dim of ``length``
    (reduce_scatter, all_to_all): n-1 pieces the size of the largest, as _step_cost prices it."""
    if not length:
        return 0.01 * local + 1.0
    return (n - 1) * local * (-(-length // n)) / length


def transition_cost(spec: DTensorSpec, dst: Sequence[Placement]) -> float:
    """Bytes received per rank by the planned transition (what the dispatcher minimises)."""
    dst = tuple(dst)
    src = spec.placements
    if dst == src:
        return 0.0
    if 0 in spec.shape and not any(type(p) is Partial for p in src + dst):
        return 0.0  # nothing to move (an empty KV cache joining a cat): no search
    if len(dst) == 1 and not _any_strided(src, dst):  # one mesh dim (the common case): priced inline
        return _cost_1d(spec.shape, spec.mesh_shape[0], src[0], dst[0], _itemsize(spec.dtype))
    return _steps_cost(spec, plan(spec, dst))


def transition_lower_bound(spec: DTensorSpec, dst: Sequence[Placement]) -> float:
    """A cheap bound that :func:`transition_cost` never goes below: the bytes of the target shard
    that the rank needing most does not already hold (its whole target shard when a Partial must be
    reduced: it holds one term of each element).  Every plan the planner prices receives at
    least that much on that rank (a step priced by the largest shard charges every rank as much;
    a new Partial is made by zeroing a complete shard), so the dispatcher may price choices in the
    order of this bound and stop at the first exact cost below the next bound (propagate.py).
    Memoised: the planner asks for the same (layout, target) pairs across ops."""
    dst = tuple(dst)
    src = tuple(spec.placements)
    if dst == src:
        return 0.0
    key = (tuple(placement_key(p) for p in src), tuple(placement_key(p) for p in dst), tuple(spec.shape),
           tuple(spec.mesh_shape), _itemsize(spec.dtype))
    return memo(_bound_cache, key, lambda: _lower_bound(spec.shape, spec.mesh_shape, src, dst) * key[-1])


_bound_cache: dict[tuple, float] = {}


def _lower_bound(shape, mesh_shape, src: tuple, dst: tuple) -> int:
    # a Partial source dim not kept (the same reduction) in the target: the rank holds only a term
    reduce = any(_kind(p) == "P" and not placement_equal(p, dst[i]) for i, p in enumerate(src))
    return L.max_lacking(shape, mesh_shape, src, dst, reduce)


def plan_text(spec: DTensorSpec, dst: Sequence[Placement]) -> str:
    """Human-readable plan, one step per line (used by debug.explain and expecttest tests)."""
    steps = plan(spec, dst)
    head = f"{placements_str(spec.placements)} -> {placements_str(tuple(dst))}"
    if not steps:
        return head + ": no-op"
    return "\n".join([head + ":"] + [f"  {s}" for s in steps])
