"""Redistribute moves at most 1.25x the theoretical minimum, for EVERY transition on N-D meshes.

For each transition between placements drawn from ``Shard(d)`` (every d), ``Replicate`` and
``Partial(sum|avg|max|min)``, on every rank: the values (every rank's local result against the
global tensor, checked in the parent by this file's own shard arithmetic: a Partial target's terms
reduced over their group in every order of its Partial mesh dims), the placements and the local
shape, and the bytes each rank received (``CommCounter.received``, counted
by the collectives themselves).  The bound: the most any rank receives is at most 1.25x the
minimum of :func:`minimum_received`, written here from first principles (its own shard
arithmetic, not dtshard's planner or layout code):

- a rank must receive every element of its target shard that its source shard lacks;
- with a Partial source, the Partial mesh dims (all of them, flattened into one group of ``k``
  ranks) must also be reduced once: as a reduce_scatter onto a tensor dim (the rank receives the
  k-1 other terms of the piece it keeps; the pieces nest after the mesh dims that already shard
  that tensor dim, so they are a standard layout), or as an all_reduce (2(k-1)/k of its shard,
  after which it holds the whole reduced shard); the cheapest of these, plus what the rank then
  still lacks.

The other direction: the most any rank SENDS (``CommCounter.bytes``, the collectives' own count)
is at most 1.25x the floor of :func:`minimum_sent`, wherever the shards alone give one: the
holders of replicated data share the sending.  And what the planner says each rank sends
(``planning.plan_sends``, by which it chooses between plans) is exactly what was counted.

Partial sources hold terms that differ between the replicas of the other mesh dims (``_terms``'
``key``): a plan that sums one replica's terms with another's is caught.

Exhaustive on a 2x2 mesh (2-D tensors: 7 placements per mesh dim, 2401 transitions) for three
shapes (even, uneven, with empty shards); sampled on 2x3, 2x4 and 2x2x2.  Partial sources that
mix a linear reduction (sum/avg) with max or min are left out: reducing them in a different order
gives a different value, so they have no single meaning.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import dtshard
from dtshard import Partial, Replicate, Shard
from dtshard.redistribute import planning
from dtshard.spec import DTensorSpec, contiguous_strides
from dtshard.testing import run_distributed
from dtshard.validate.simulate import SimMesh

from _cases import plans_made_once, use_plans  # noqa: E402

OPS = ("sum", "avg", "max", "min")


# ---------------------------------------------------------------------------------------------
# the independent minimum
# ---------------------------------------------------------------------------------------------


def _chunk(size, n, i):
    """(start, length) of chunk i of n, torch.chunk's layout."""
    step = -(-size // n) if n else 0
    start = min(i * step, size)
    return start, min(start + step, size) - start


def _box(shape, mesh_shape, placements, coord):
    """The region a rank holds: mesh dims shard a tensor dim one after another, in mesh order."""
    lo, ln = [0] * len(shape), list(shape)
    for m, p in enumerate(placements):
        if isinstance(p, Shard):
            s, n = _chunk(ln[p.dim], mesh_shape[m], coord[m])
            lo[p.dim] += s
            ln[p.dim] = n
    return [(a, a + n) for a, n in zip(lo, ln)]


def _numel(box):
    return math.prod(b - a for a, b in box)


def _overlap(a, b):
    return math.prod(max(0, min(a1, b1) - max(a0, b0)) for (a0, a1), (b0, b1) in zip(a, b))


def _lacking(shape, mesh_shape, src, dst, coord):
    t = _box(shape, mesh_shape, dst, coord)
    return _numel(t) - _overlap(t, _box(shape, mesh_shape, src, coord))


def minimum_received(shape, mesh_shape, src, dst) -> float:
    """Elements the rank that receives most must receive, at least (see the module docstring)."""
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    red = [m for m, p in enumerate(src) if isinstance(p, Partial) and p != dst[m]]
    if not red:
        return max(_lacking(shape, mesh_shape, src, dst, c) for c in coords)
    k = math.prod(mesh_shape[m] for m in red)
    best = math.inf
    # all_reduce: every rank receives 2(k-1)/k of its shard (ring) and then holds it reduced
    reduced = tuple(Replicate() if m in red else p for m, p in enumerate(src))
    best = min(best, max(2 * (k - 1) / k * _numel(_box(shape, mesh_shape, src, c))
                         + _lacking(shape, mesh_shape, reduced, dst, c) for c in coords))
    # reduce_scatter onto tensor dim d: a rank receives the k-1 other terms of the piece it keeps
    # (pieces are the nested chunks of its shard, so they need not be equal); the pieces can only
    # nest after the mesh dims that already shard d
    for d in range(len(shape)):
        if any(isinstance(p, Shard) and p.dim == d and m > red[0] for m, p in enumerate(src)):
            continue
        reduced = tuple(Shard(d) if m in red else p for m, p in enumerate(src))
        best = min(best, max((k - 1) * _numel(_box(shape, mesh_shape, reduced, c))
                             + _lacking(shape, mesh_shape, reduced, dst, c) for c in coords))
    # one exchange whose receivers sum (sums and averages into a layout without Partial): a rank
    # receives, for every element of its target, the k terms but the one it holds itself
    if all(src[m].reduce_op in ("sum", "avg") for m in red) and not any(isinstance(p, Partial) for p in dst):
        best = min(best, max(k * _numel(_box(shape, mesh_shape, dst, c))
                             - _overlap(_box(shape, mesh_shape, dst, c), _box(shape, mesh_shape, src, c))
                             for c in coords))
    return best


def minimum_sent(shape, mesh_shape, src, dst) -> float | None:
    """A floor under the most any rank must send, where one follows from the shards alone (None
    elsewhere: a Partial target, or Partial terms that replicas share); each element sent once
    from a holder to each rank that lacks it (no relays: a ring collective can send less, so the
    check errs on the side of passing, never fails a plan that meets a true floor).

    - No Partial source: ranks holding the same box are the replicas of it (boxes are equal or
      disjoint); they share the demand for it, so one of them sends at least its share:
      ``ceil(sum over ranks of what they lack of the box / number of replicas)``.
    - Partial sources, the other mesh dims all Shard: every term of an element sits on one rank
      only, and each rank that needs the element needs that term: a rank sends its term of each
      element to every other rank whose target holds it."""
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    if any(isinstance(p, Partial) for p in dst):
        return None
    boxes = {c: _box(shape, mesh_shape, src, c) for c in coords}
    targets = {c: _box(shape, mesh_shape, dst, c) for c in coords}
    if any(isinstance(p, Partial) for p in src):
        if any(isinstance(p, Replicate) for p in src):
            return None
        return max(sum(_overlap(targets[q], boxes[c]) for q in coords if q != c) for c in coords)
    replicas: dict = {}
    for c in coords:
        replicas.setdefault(tuple(boxes[c]), []).append(c)
    best = 0
    for box, holders in replicas.items():
        held = set(holders)
        demand = sum(_overlap(targets[q], list(box)) for q in coords if q not in held)
        best = max(best, -(-demand // len(holders)))
    return best


# ---------------------------------------------------------------------------------------------
# building a source DTensor whose partial terms are nontrivial
# ---------------------------------------------------------------------------------------------


def _terms(v, op, n, c, key=0.0):
    """Rank c's term of value v for Partial(op) over n ranks (exact in float64).  ``key`` (>= 0)
    comes from the rank's coordinates on the mesh dims that are not Partial: the replicas of
    another mesh dim hold DIFFERENT terms of the same value, as the placement allows (and as
    ``from_local`` of per-rank values, or any rank-dependent computation, produces)."""
    u = torch.ones_like(v) * (3.0 + key)
    if op == "sum":
        return v - (n - 1) * u if c == 0 else u
    if op == "avg":
        return v + (n - 1) * u if c == 0 else v - u
    if op == "max":
        return v if c == 0 else v - 1.0 - c - key
    return v if c == 0 else v + 1.0 + c + key  # min


def _local_source(x, mesh_shape, src, coord, per_replica=True):
    box = _box(tuple(x.shape), mesh_shape, src, coord)
    v = x
    for d, (a, b) in enumerate(box):
        v = v.narrow(d, a, b - a)
    v = v.clone()
    key = sum(0.75 * (m + 1) * coord[m] for m, p in enumerate(src) if not isinstance(p, Partial)) if per_replica else 0.0
    for m, p in enumerate(src):
        if isinstance(p, Partial):
            v = _terms(v, p.reduce_op, mesh_shape[m], coord[m], key)
    return v


def _placements(ndim):
    return [Shard(d) for d in range(ndim)] + [Replicate()] + [Partial(op) for op in OPS]


def _well_defined(src) -> bool:
    ops = {p.reduce_op for p in src if isinstance(p, Partial)}
    return len(ops) <= 1 or ops <= {"sum", "avg"}


def all_transitions(mesh_ndim, tensor_ndim):
    states = [s for s in itertools.product(_placements(tensor_ndim), repeat=mesh_ndim)]
    return [(a, b) for a in states for b in states if _well_defined(a)]


def partial_to_shard_transitions(mesh_ndim, tensor_ndim):
    """Every pattern of Partial(sum) on some mesh dims -> Shard on more dims: sources with a
    Partial(sum) on at least one mesh dim (Shard or Replicate on the others), targets of Shard
    and Replicate with at least one Shard."""
    plain = [Shard(d) for d in range(tensor_ndim)] + [Replicate()]
    srcs = [s for s in itertools.product(plain + [Partial("sum")], repeat=mesh_ndim)
            if any(isinstance(p, Partial) for p in s)]
    dsts = [s for s in itertools.product(plain, repeat=mesh_ndim) if any(isinstance(p, Shard) for p in s)]
    return [(a, b) for a in srcs for b in dsts]


# ---------------------------------------------------------------------------------------------
# the worker: run each transition, check it, count what this rank received
# ---------------------------------------------------------------------------------------------


def _run(mesh_shape, shape, transitions, plans, min_boxes=None):
    """On each rank: every transition's bytes received, a layout problem (or ""), and the local
    result, whose values the parent checks against the global tensor (no collective here beyond
    the redistribute itself: gathering every result on the workers would double the suite's time).
    The plans were made once, in the parent (``plans_made_once``)."""
    use_plans(plans)
    from dtshard.redistribute import running

    saved = running._INDEXED_MIN_BOXES, running._INDEXED_BOX
    if min_boxes is not None:  # exchanges pack by flat indices from this many boxes on
        running._INDEXED_MIN_BOXES, running._INDEXED_BOX = min_boxes, 1 << 30
        running._indices.clear()
    try:
        return _run_all(mesh_shape, shape, transitions)
    finally:
        running._INDEXED_MIN_BOXES, running._INDEXED_BOX = saved
        running._indices.clear()


def _run_all(mesh_shape, shape, transitions):
    mesh = dtshard.init_device_mesh("cpu", mesh_shape)
    coord = tuple(mesh.get_coordinate())
    x = _global(shape)
    out = []
    for src, dst in transitions:
        # a target that mixes a sum or average with a max or min has one meaning only when the
        # replicas hold the same terms (reduced in another order, different terms give another
        # value): those keep equal terms; every other transition gets per-replica terms
        d = dtshard.DTensor.from_local(_local_source(x, mesh_shape, src, coord, _well_defined(dst)), mesh, src,
                                       shape=shape)
        with dtshard.debug.CommCounter() as comm:
            y = d.redistribute(mesh, dst)
        problem = ""
        if tuple(y.placements) != tuple(dst):
            problem = f"placements {y.placements}"
        elif tuple(y._local_tensor.shape) != tuple(b - a for a, b in _box(shape, mesh_shape, dst, coord)):
            problem = f"local shape {tuple(y._local_tensor.shape)}"
        out.append((comm.received(), problem, y.to_local().clone(), comm.bytes()))
    return coord, out


def _global(shape):
    return torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape) * 0.5 - 3.0


_REDUCE = {"sum": lambda ts: sum(ts), "avg": lambda ts: sum(ts) / len(ts),
           "max": lambda ts: torch.stack(ts).amax(0), "min": lambda ts: torch.stack(ts).amin(0)}


def _value_problem(x, mesh_shape, dst, locals_by_coord) -> str:
    """Whether the ranks' local results of ``dst`` hold ``x``, by this file's own arithmetic:
    each rank's shard box of ``x`` where ``dst`` has no Partial; where it has, the terms of each
    group of ranks that differ only in Partial mesh dims, reduced with each dim's op (in every
    order of those dims: the terms must mean ``x`` however they are reduced), equal that box."""
    partial = [m for m, p in enumerate(dst) if isinstance(p, Partial)]
    for order in itertools.permutations(partial) if partial else [()]:
        terms = dict(locals_by_coord)
        for m in order:  # reduce mesh dim m: group the coordinates that differ only there
            groups: dict = {}
            for c, v in terms.items():
                groups.setdefault(c[:m] + (0,) + c[m + 1:], []).append(v)
            terms = {c: _REDUCE[dst[m].reduce_op](vs) for c, vs in groups.items()}
        for c, v in terms.items():
            want = x
            for d, (a, b) in enumerate(_box(tuple(x.shape), mesh_shape, dst, c)):
                want = want.narrow(d, a, b - a)
            if not torch.allclose(v, want):
                return "wrong values" + (f" (reducing mesh dims in order {order})" if len(order) > 1 else "")
    return ""


def _check(mesh_shape, shape, transitions, min_boxes=None):
    world = math.prod(mesh_shape)
    plans = plans_made_once(mesh_shape, shape, torch.float64, transitions)
    answers = run_distributed(_run, world, tuple(mesh_shape), tuple(shape), transitions, plans, min_boxes,
                              timeout=600)
    coords = [coord for coord, _ in answers]
    per_rank = [out for _, out in answers]
    x = _global(shape)
    bad = []
    sim = SimMesh(mesh_shape)
    order = list(itertools.product(*(range(n) for n in mesh_shape)))
    for k, (src, dst) in enumerate(transitions):
        probs = [per_rank[r][k][1] for r in range(world) if per_rank[r][k][1]]
        # the planner's own account of what each rank sends (it chooses between plans by it)
        # is what the collectives counted
        spec = DTensorSpec(sim, tuple(src), tuple(shape), contiguous_strides(shape), torch.float64)
        model = planning.plan_sends(spec, planning.plan(spec, tuple(dst)))
        measured = tuple(per_rank[coords.index(c)][k][3] for c in order)
        if model != measured:
            probs.append(f"the planner's sends {model} != counted {measured}")
        if not probs:
            value = _value_problem(x, mesh_shape, dst, {coords[r]: per_rank[r][k][2] for r in range(world)})
            probs = [value] if value else []
        got = max(per_rank[r][k][0] for r in range(world))
        want = minimum_received(shape, mesh_shape, src, dst) * 8  # float64 bytes
        sent = max(per_rank[r][k][3] for r in range(world))
        floor = minimum_sent(shape, mesh_shape, src, dst)
        if probs:
            bad.append(f"{src} -> {dst}: {probs[0]}")
        elif got > 1.25 * want + 1e-9:
            bad.append(f"{src} -> {dst}: received {got} B, minimum {want:.0f} B ({got / max(want, 1):.2f}x)")
        elif floor is not None and sent > 1.25 * floor * 8 + 1e-9:
            bad.append(f"{src} -> {dst}: a rank sent {sent} B, the floor is {floor * 8} B")
    assert not bad, f"mesh {mesh_shape}, shape {shape}: {len(bad)} of {len(transitions)} transitions:\n" + "\n".join(bad[:40])


@pytest.mark.parametrize("shape", [(4, 6), (3, 5), (2, 1)], ids=["even", "uneven", "empty-shards"])
def test_every_transition_on_2x2(shape):
    _check((2, 2), shape, all_transitions(2, 2))


@pytest.mark.parametrize("mesh_shape,shape", [((2, 3), (6, 5)), ((2, 4), (5, 8)), ((2, 2, 2), (4, 3))])
def test_sampled_transitions_on_larger_meshes(mesh_shape, shape):
    """400 sampled transitions, plus every Partial -> Shard pattern (issue #31 item 5: a Partial
    on some mesh dims -> Shard on more dims in one reducing exchange at the minimum)."""
    rng = random.Random(f"{mesh_shape}{shape}")
    trans = all_transitions(len(mesh_shape), len(shape))
    sample = rng.sample(trans, min(400, len(trans)))
    sample += [t for t in partial_to_shard_transitions(len(mesh_shape), len(shape)) if t not in set(sample)]
    _check(mesh_shape, shape, sample)


def test_minimum_examples():
    """The minimum itself, on the transitions the issue names (T = 16 elements, 2x2 mesh)."""
    S0, S1, R, P = Shard(0), Shard(1), Replicate(), Partial()
    assert minimum_received((4, 4), (2, 2), (S0, S1), (S1, S0)) == 4  # T/4: a swap
    assert minimum_received((4, 4), (2, 2), (P, P), (R, R)) == 24  # 1.5T: one all_reduce over 4
    assert minimum_received((4, 4), (2, 2), (R, S0), (S0, S0)) == 4  # the quarter a rank lacks
    assert minimum_received((4, 4), (2, 2), (S0, S0), (R, R)) == 12
    assert minimum_received((4, 4), (2, 2), (R, R), (S0, S1)) == 0
    # rank (1, 0) keeps row 2 but holds rows 0-1 of its term: both terms of its 4 elements arrive
    assert minimum_received((4, 4), (2, 2), (P, S0), (S0, S0)) == 8


def _flattened_gathers():
    mesh = dtshard.init_device_mesh("cpu", (2, 2))
    out = []
    for shape in [(8, 6), (3, 4), (7, 5), (4, 3)]:
        x = torch.arange(float(math.prod(shape))).reshape(shape)
        d = dtshard.distribute_tensor(x, mesh, [Shard(0), Shard(0)])
        with dtshard.debug.CommCounter() as comm:
            y = d.redistribute(mesh, [Replicate(), Replicate()])
        p = dtshard.DTensor.from_local(x * (mesh.get_coordinate()[0] + 1) / 3, mesh, [Partial(), Partial()])
        with dtshard.debug.CommCounter() as comm2:
            z = p.redistribute(mesh, [Replicate(), Replicate()])
        out.append((shape, torch.equal(y.full_tensor(), x) and torch.equal(y.to_local(), x),
                    [(r.kind, r.mesh_dim) for r in comm.records],
                    torch.allclose(z.to_local(), x * 2), [(r.kind, r.mesh_dim) for r in comm2.records]))
    return out


def test_flattened_groups_only_where_they_receive_less():
    """A flattened group of several mesh dims is a communicator of its own (costly at thousands of
    ranks): dtshard runs a step over one only where it receives strictly less than per-mesh-dim
    steps (issue #53).  ``(S0, S0) -> (R, R)``: two all_gathers receive what one flattened one
    does, so one per mesh dim (inner first); ``(P, P) -> (R, R)``: one all_reduce over the
    flattened group receives 1.5x the shard, two of them 2x, so the flattened one."""
    for rank in run_distributed(_flattened_gathers, 4):
        for shape, ok, records, ok2, records2 in rank:
            assert ok and ok2, shape
            assert records == [("all_gather", 1), ("all_gather", 0)], (shape, records)
            assert records2 == [("all_reduce", (0, 1))], (shape, records2)


def test_value_check_catches_wrong_terms():
    """The parent's value check itself: right terms pass, one wrong element or a term held by the
    wrong rank fails (single process: the check is plain arithmetic)."""
    mesh_shape, shape = (2, 2), (4, 6)
    x = _global(shape)
    coords = list(itertools.product(range(2), range(2)))
    for dst in [(Shard(0), Shard(1)), (Partial("sum"), Shard(0)), (Partial("avg"), Partial("sum")),
                (Replicate(), Partial("max")), (Partial("min"), Replicate())]:
        good = {c: _local_source(x, mesh_shape, dst, c) for c in coords}
        assert _value_problem(x, mesh_shape, dst, good) == "", dst
        bad = {c: v.clone() for c, v in good.items()}
        bad[(0, 0)].view(-1)[0] += 1.0  # the term a max or min takes its value from, too
        assert _value_problem(x, mesh_shape, dst, bad).startswith("wrong values"), dst
    # Partial(sum) terms swapped within their group are still the sum; moved to another shard's
    # group they are not
    dst = (Partial("sum"), Shard(0))
    good = {c: _local_source(x, mesh_shape, dst, c) for c in coords}
    swapped = dict(good)
    swapped[(0, 0)], swapped[(1, 0)] = good[(1, 0)], good[(0, 0)]
    assert _value_problem(x, mesh_shape, dst, swapped) == ""
    moved = dict(good)
    moved[(0, 0)], moved[(0, 1)] = good[(0, 1)], good[(0, 0)]
    assert _value_problem(x, mesh_shape, dst, moved) == "wrong values"


@pytest.mark.parametrize("mesh_shape,shape,transitions", [
    ((2, 3), (9,), [((Replicate(), Partial("sum")), (Shard(0), Shard(0))),
                    ((Replicate(), Partial("avg")), (Shard(0), Shard(0)))]),
    ((2, 2), (4, 6), [((Replicate(), Partial("sum")), (Shard(1), Shard(0))),
                      ((Replicate(), Partial("avg")), (Shard(1), Shard(0)))]),
    ((2, 2), (3,), [((Partial("avg"), Shard(0)), (Shard(0), Shard(0)))]),
    ((2, 4), (9, 6), [((Partial("sum"), Shard(0)), (Shard(0), Shard(0)))]),
    ((2, 2, 2), (9, 10), [((Replicate(), Shard(1), Partial("sum")), (Shard(1), Shard(0), Replicate())),
                          ((Replicate(), Replicate(), Partial("sum")), (Shard(0), Shard(1), Shard(0)))]),
    ((2, 2, 2), (4, 6, 5), [((Partial("avg"),) * 3, (Replicate(), Shard(1), Replicate()))]),
], ids=["2x3-R-P", "2x2-R-P", "2x2-avg-uneven", "2x4-uneven", "2x2x2-R-S-P", "2x2x2-avg"])
def test_issue_53_cases(mesh_shape, shape, transitions):
    """Issue #53's reproductions on real ranks: a reducing exchange summed one replica's terms with
    another's (the replicas here hold different terms), and uneven Partial -> Shard moved up to 2x
    the minimum; exact and within the bound now.  Run twice: with per-box copies, and with every
    exchange packed through flat indices (the path a rank with many small boxes takes at scale)."""
    _check(mesh_shape, shape, transitions)
    _check(mesh_shape, shape, transitions, min_boxes=1)
