"""Redistribute: move a DTensor's data between placements with minimum traffic.

Planning is pure metadata.  A transition from placements ``src`` to ``dst`` on an N-D mesh is a
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

Execution runs the plan on the local tensor.  Packing and unpacking around collectives (dims other
than 0, uneven shards) go through ``dtshard_kernels`` so each collective costs at most one packing
and one unpacking pass.  The differentiable entry point lives in tensor.py; its backward
redistributes the gradient back to the source placements (the dual collective).
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass
from typing import Sequence

import dtshard_kernels as K
import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dtshard import collectives as C
from dtshard._trace import copy_observers, note_copy
from dtshard.spec import DTensorSpec, _itemsize, chunk_range, chunk_sizes, placement_str, placements_str

__all__ = ["Step", "plan", "plan_text", "redistribute_local", "transition_cost"]

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


def _step_kind(src: Placement, dst: Placement) -> str | None:
    if isinstance(src, Shard):
        if isinstance(dst, Replicate):
            return "all_gather"
        if isinstance(dst, Shard):
            return "all_to_all"
        return None  # S -> P goes via R
    if isinstance(src, Replicate):
        return "slice" if isinstance(dst, Shard) else "zero"
    # src is Partial
    if isinstance(dst, Replicate):
        return "all_reduce"
    if isinstance(dst, Shard):
        return "reduce_scatter"
    return None  # P(a) -> P(b) goes via R


def _legal(state: Sequence[Placement], i: int, dst: Placement) -> bool:
    src = state[i]
    later = state[i + 1 :]
    if isinstance(src, Shard) and any(isinstance(p, Shard) and p.dim == src.dim for p in later):
        return False  # not the innermost mesh dim sharding src.dim
    if isinstance(dst, Shard) and any(isinstance(p, Shard) and p.dim == dst.dim for p in later):
        return False  # a later mesh dim already shards dst.dim
    return True


def _local_numel(shape: Sequence[int], mesh_shape: Sequence[int], state: Sequence[Placement]) -> int:
    """Elements of the largest local shard (coordinate 0 holds the largest chunks)."""
    s = list(shape)
    for i, p in enumerate(state):
        if isinstance(p, Shard):
            s[p.dim] = chunk_range(s[p.dim], mesh_shape[i], 0)[1]
    n = 1
    for v in s:
        n *= v
    return n


def _step_cost(shape, mesh_shape, state, i, dst, itemsize) -> float:
    """Bytes this rank receives for the step (plus a small charge for local-only work)."""
    local = _local_numel(shape, mesh_shape, state) * itemsize
    n = mesh_shape[i]
    kind = _step_kind(state[i], dst)
    if kind == "all_gather":
        return (n - 1) * local
    if kind == "all_reduce":
        return 2 * (n - 1) * local / n
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) * local / n
    # local-only steps: charge a little so that plans without them win ties
    return 0.01 * local + 1.0


def _candidates(src: Sequence[Placement], dst: Sequence[Placement]) -> list[Placement]:
    cands: list[Placement] = [_R]
    for p in (*src, *dst):
        if p not in cands:
            cands.append(p)
    return cands


_plan_cache: dict[tuple, tuple[Step, ...]] = {}


def plan(spec: DTensorSpec, dst: Sequence[Placement]) -> tuple[Step, ...]:
    """The cheapest legal sequence of single-mesh-dim steps from ``spec.placements`` to ``dst``."""
    src = tuple(spec.placements)
    dst = tuple(dst)
    key = (src, dst, spec.shape, spec.mesh_shape, spec.dtype)
    hit = _plan_cache.get(key)
    if hit is not None:
        return hit
    if src == dst:
        _plan_cache[key] = ()
        return ()
    if len(src) == 1:  # one mesh dim: a direct step, or two through Replicate (S->P, P(a)->P(b))
        kind = _step_kind(src[0], dst[0])
        if kind is not None:
            steps = (Step(0, src[0], dst[0], kind),)
        else:
            steps = (Step(0, src[0], _R, _step_kind(src[0], _R)), Step(0, _R, dst[0], _step_kind(_R, dst[0])))
        _plan_cache[key] = steps
        return steps
    shape, mesh_shape, itemsize = spec.shape, spec.mesh_shape, _itemsize(spec.dtype)
    cands = _candidates(src, dst)
    # Dijkstra over placement states (tuples of placements)
    best: dict[tuple, float] = {src: 0.0}
    heap: list = [(0.0, 0, src, ())]
    tie = 1
    while heap:
        cost, _, state, steps = heapq.heappop(heap)
        if state == dst:
            _plan_cache[key] = steps
            return steps
        if cost > best.get(state, float("inf")):
            continue
        for i in range(len(state)):
            for q in cands:
                if q == state[i]:
                    continue
                kind = _step_kind(state[i], q)
                if kind is None or not _legal(state, i, q):
                    continue
                new_state = state[:i] + (q,) + state[i + 1 :]
                new_cost = cost + _step_cost(shape, mesh_shape, state, i, q, itemsize)
                if new_cost < best.get(new_state, float("inf")):
                    best[new_state] = new_cost
                    heapq.heappush(heap, (new_cost, tie, new_state, steps + (Step(i, state[i], q, kind),)))
                    tie += 1
    raise ValueError(
        f"redistribute: no legal path from {placements_str(src)} to {placements_str(dst)} "
        f"for a tensor of shape {tuple(shape)} on a mesh of shape {tuple(mesh_shape)}"
    )


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
            return (n - 1) * local / n
        return (n - 1) * local + 0.01 * numel * itemsize + 1.0  # all_gather, then zero (-> Partial)
    full = numel * itemsize
    if ts is Replicate or (ts is not Partial and isinstance(src, Replicate)):
        return 0.01 * full + 1.0  # a local slice or zeroing
    # Partial source
    if td is Replicate or (td is not Shard and isinstance(dst, Replicate)):
        return 2 * (n - 1) * full / n
    if td is Shard or (td is not Partial and isinstance(dst, Shard)):
        return (n - 1) * full / n
    return 2 * (n - 1) * full / n + 0.01 * full + 1.0  # all_reduce, then zero (P(a) -> P(b))


def transition_cost(spec: DTensorSpec, dst: Sequence[Placement]) -> float:
    """Bytes received per rank by the planned transition (what the dispatcher minimises)."""
    dst = tuple(dst)
    src = spec.placements
    if dst == src:
        return 0.0
    if len(dst) == 1:  # one mesh dim (the common case on a cache miss): plan()'s steps, priced inline
        return _cost_1d(spec.shape, spec.mesh_shape[0], src[0], dst[0], _itemsize(spec.dtype))
    steps = plan(spec, dst)
    total = 0.0
    if steps:
        state = list(spec.placements)
        itemsize = _itemsize(spec.dtype)
        for s in steps:
            total += _step_cost(spec.shape, spec.mesh_shape, tuple(state), s.mesh_dim, s.dst, itemsize)
            state[s.mesh_dim] = s.dst
    return total


def plan_text(spec: DTensorSpec, dst: Sequence[Placement]) -> str:
    """Human-readable plan, one step per line (used by debug.explain and expecttest tests)."""
    steps = plan(spec, dst)
    head = f"{placements_str(spec.placements)} -> {placements_str(tuple(dst))}"
    if not steps:
        return head + ": no-op"
    return "\n".join([head + ":"] + [f"  {s}" for s in steps])


# ---------------------------------------------------------------------------------------------
# execution
# ---------------------------------------------------------------------------------------------


def _parent_length(spec: DTensorSpec, state, i: int, coord, dim: int) -> int:
    """Length of tensor dim ``dim`` on this rank if mesh dim ``i`` did not shard it."""
    size = spec.shape[dim]
    mesh_shape = spec.mesh_shape
    for j, p in enumerate(state):
        if j != i and isinstance(p, Shard) and p.dim == dim:
            size = chunk_range(size, mesh_shape[j], coord[j])[1]
    return size


def _copied(kind: str, t: torch.Tensor) -> torch.Tensor:
    if copy_observers:
        note_copy(kind, t.numel() * t.element_size())
    return t


def _with(shape, dim, value) -> tuple[int, ...]:
    s = list(shape)
    s[dim] = value
    return tuple(s)


def _numel_except(shape, *dims) -> int:
    n = 1
    for k, v in enumerate(shape):
        if k not in dims:
            n *= v
    return n


def _all_gather(x, spec, state, i, coord, d):
    n = spec.mesh_shape[i]
    sizes = chunk_sizes(_parent_length(spec, state, i, coord, d), n)
    block = sizes[0]
    if block == 0 or _numel_except(x.shape, d) == 0:
        return x.new_zeros(_with(x.shape, d, sum(sizes)))
    even = all(s == block for s in sizes)
    if even and d == 0:
        return C.all_gather(x, spec.mesh, i)  # lands in place: no copy at all
    if x.shape[d] == block:
        buf = x.unsqueeze(0)  # a full chunk needs no padding
    else:
        _note_padding(spec, d, sizes)
        buf = _copied("pack", K.pack(x, d, [x.shape[d]], block))  # pad the short chunk
    gathered = C.all_gather(buf, spec.mesh, i)  # (n, *block shape)
    if d == 0:
        # torch.chunk layout: full chunks first, then one short chunk, then empty ones, so all
        # padding sits after the data: a narrow of the gathered buffer is the result
        return gathered.view(-1, *gathered.shape[2:]).narrow(0, 0, sum(sizes))
    return _copied("unpack", K.unpack(gathered, d, sizes))


_logger = logging.getLogger("dtshard")
_padding_noted: set = set()


def _note_padding(spec: DTensorSpec, dim: int, sizes) -> None:
    """Log once per (shape, placements, dim) that an uneven layout pads for a collective."""
    key = (spec.shape, spec.placements, dim)
    if key not in _padding_noted:
        _padding_noted.add(key)
        _logger.info(
            "dtshard: uneven shards %s of dim %d of a %s %s tensor are padded to %d for an all_gather "
            "(logged once per layout)", sizes, dim, tuple(spec.shape), placements_str(spec.placements), max(sizes)
        )


def _reduce_scatter(x, spec, i, me, op, d):
    n = spec.mesh_shape[i]
    sizes = chunk_sizes(x.shape[d], n)
    block, mine = sizes[0], sizes[me]
    if x.numel() == 0:
        return x.new_zeros(_with(x.shape, d, mine))
    if d == 0 and all(s == block for s in sizes):
        return C.reduce_scatter(x, op, spec.mesh, i)
    # the packed rows are passed without keeping a name for them here: the collective drops
    # its reference once the backend has the data, so the buffer does not outlive the wait
    out = C.reduce_scatter(_packed_rows(x, d, sizes, block), op, spec.mesh, i)
    out = out.view(_with(x.shape, d, block))
    if mine != block:
        out = _copied("slice", K.slice_copy(out, d, 0, mine))
    return out


def _packed_rows(x, d, sizes, block):
    """``x`` split along ``d`` into ``sizes`` chunks, each padded to ``block``, stacked along dim 0
    and flattened into rows: ``(n * block, ...)`` for a dim-0 collective."""
    buf = _copied("pack", K.pack(x, d, sizes, block))  # (n, *block shape)
    return buf.view(buf.shape[0] * buf.shape[1], *buf.shape[2:])


def _all_to_all(x, spec, state, i, coord, d, e):
    n = spec.mesh_shape[i]
    me = coord[i]
    sizes_d = chunk_sizes(_parent_length(spec, state, i, coord, d), n)
    sizes_e = chunk_sizes(x.shape[e], n)
    piece = _with(x.shape, e, sizes_e[me])  # what each peer sends me, but for its dim-d length
    out_shape = _with(piece, d, sum(sizes_d))
    # skip the collective only on conditions every rank of the group agrees on
    if _numel_except(x.shape, d, e) == 0 or sum(sizes_d) == 0 or x.shape[e] == 0:
        return x.new_zeros(out_shape)
    if x.is_contiguous() and all(s == 1 for s in x.shape[:e]):
        flat = x.reshape(-1)  # split along the outermost non-trivial dim: already in send order
    else:
        flat = _copied("pack", K.a2a_pack(x, e, sizes_e))
    per_e = _numel_except(x.shape, e)
    per_d = _numel_except(piece, d)
    recv = C.all_to_all(flat, [s * per_d for s in sizes_d], [s * per_e for s in sizes_e], spec.mesh, i)
    del flat  # the send buffer is dead: free it before the unpack allocates the output
    if all(s == 1 for s in piece[:d]):
        return recv.view(out_shape)  # joined along the outermost non-trivial dim: already in order
    return _copied("unpack", K.a2a_unpack(recv, list(piece), d, sizes_d))


def _slice(x, spec, i, me, d):
    start, length = chunk_range(x.shape[d], spec.mesh_shape[i], me)
    if length == x.shape[d]:
        return x
    if x.is_contiguous() and all(s == 1 for s in x.shape[:d]):
        return x.narrow(d, start, length)  # a contiguous view: no copy needed
    return _copied("slice", K.slice_copy(x, d, start, length))


def _run_step(x: torch.Tensor, spec: DTensorSpec, state: list, step: Step, coord) -> torch.Tensor:
    i, src, dst, kind = step.mesh_dim, step.src, step.dst, step.kind
    if spec.mesh_shape[i] == 1:
        return x  # one rank on this mesh dim: every transition is the identity
    if kind == "all_gather":
        return _all_gather(x, spec, state, i, coord, src.dim)
    if kind == "all_reduce":
        return C.all_reduce(x, src.reduce_op, spec.mesh, i)
    if kind == "reduce_scatter":
        return _reduce_scatter(x, spec, i, coord[i], src.reduce_op, dst.dim)
    if kind == "all_to_all":
        return _all_to_all(x, spec, state, i, coord, src.dim, dst.dim)
    if kind == "slice":
        return _slice(x, spec, i, coord[i], dst.dim)
    if kind == "zero":
        # R -> P: reduce(locals) must equal the value. For sum only one rank keeps it (exact,
        # also for integers); avg, max and min keep it everywhere.
        if dst.reduce_op == "sum" and coord[i] != 0:
            return torch.zeros_like(x)
        return x
    raise AssertionError(f"unknown step kind {kind}")


def redistribute_local(x: torch.Tensor, spec: DTensorSpec, dst: Sequence[Placement]) -> torch.Tensor:
    """Run the planned transition on this rank's local tensor ``x`` (no autograd)."""
    steps = plan(spec, dst)
    if not steps:
        return x
    coord = C.mesh_coordinate(spec.mesh)
    state = list(spec.placements)
    for step in steps:
        x = _run_step(x, spec, state, step, coord)
        state[step.mesh_dim] = step.dst
    return x
