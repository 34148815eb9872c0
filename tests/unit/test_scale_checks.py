"""The planner's checks over every rank, at any world size (issue #53): pure metadata.

Every check that once walked each coordinate of the mesh now decides from the distinct local
shapes (``spec.local_shape_classes``), per-tensor-dim structure and bounded walks.  Here each is
compared with the old walk over every coordinate (kept below, in this file only, as the oracle) on
many small random cases, and each is run at 32,768 ranks on FSDP x TP-like layouts, where it must
simply finish (the file runs in a few seconds).
"""

from __future__ import annotations

import itertools
import math
import os
import types

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from dtshard import propagate as P
from dtshard.redistribute.pipelining import choose_pipe
from dtshard.redistribute.planning import Step
from dtshard.spatial.adaptive_pool import blocks_align
from test_spec_and_plans import FakeMesh  # noqa: E402  (tests/unit is on sys.path under pytest)
from dtshard.spec import (DTensorSpec, _strided_is_blocks, dim_patterns, dim_region, dim_steps, local_region,
                          local_shape, local_shape_and_offset, local_shape_classes, local_shapes)

#: examples per property (DTSHARD_SCALE_EXAMPLES=2000 for a longer search; the suite keeps it short)
EXAMPLES = int(os.environ.get("DTSHARD_SCALE_EXAMPLES", "40"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

BIG_MESHES = [(4096, 8), (512, 8, 8)]  # 32,768 ranks each


def spec(mesh_shape, placements, shape, dtype=torch.float32):
    shape = tuple(shape)
    stride = torch.empty(shape).stride() if math.prod(shape) else tuple(range(len(shape)))
    return DTensorSpec(FakeMesh(*mesh_shape), tuple(placements), shape, tuple(stride), dtype)


def coords(mesh_shape):
    return itertools.product(*(range(n) for n in mesh_shape))


# ---- the oracles: the old walks over every coordinate ------------------------------------------


def old_classes(layouts, mesh_shape, pinned=None):
    out = {}
    for c in coords(mesh_shape):
        if pinned and any(c[i] != v for i, v in pinned.items()):
            continue
        key = tuple(None if lay is None else local_shape(lay[0], mesh_shape, lay[1], c) for lay in layouts)
        out.setdefault(key, c)
    return out


def old_is_blocks(shape, mesh_shape, placements):
    return all(len(r) <= 1 for c in coords(mesh_shape) for r in local_region(shape, mesh_shape, placements, c))


def old_same_regions(paired, mesh_shape):
    """_strided_variant's old per-coordinate test: (shape, placements, dim) entries."""
    if len({sh[d] for sh, _, d in paired}) != 1:
        return False
    return all(len({local_region(sh, mesh_shape, pl, c)[d] for sh, pl, d in paired}) == 1
               for c in coords(mesh_shape))


def old_view_match(a, b, mesh_shape):
    for c in coords(mesh_shape):
        x = P._flat_runs(a.shape, P._region(a, mesh_shape, c))
        y = P._flat_runs(b.shape, P._region(b, mesh_shape, c))
        if x is None or y is None or x != y:
            return False
    return True


def old_blocks_align(n_in, n_out, mesh_shape, mesh_dims):
    if n_out <= 0 or n_in % n_out:
        return False
    k = n_in // n_out
    sizes = [mesh_shape[i] for i in mesh_dims]
    shard = [Shard(0)] * len(sizes)
    for c in coords(sizes):
        (li,), (oi,) = local_shape_and_offset((n_in,), sizes, shard, c)
        (lo,), (oo,) = local_shape_and_offset((n_out,), sizes, shard, c)
        if li != k * lo or oi != k * oo:
            return False
    return True


def old_choose_pipe(spec_, state, step, chunk, cap):
    """pipelining.choose_pipe before issue #53 (local shapes at every coordinate)."""
    from dtshard.redistribute.pipelining import _PIPE_OPS, _Pipe
    from dtshard.spec import _itemsize

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
        return None
    after = state[:i] + (dst,) + state[i + 1:]
    cs = list(coords(spec_.mesh_shape))
    before_shapes = [local_shape(spec_.shape, spec_.mesh_shape, state, c) for c in cs]
    after_shapes = [local_shape(spec_.shape, spec_.mesh_shape, after, c) for c in cs]
    shapes = before_shapes + after_shapes
    k = min(max(math.prod(s) for s in shapes) * _itemsize(spec_.dtype) // chunk, cap)
    lead = next((t for t in range(len(spec_.shape)) if any(s[t] >= 2 for s in shapes)), None)
    if k < 2 or lead is None or lead > min(dims):
        return None
    if kind == "all_gather" and lead == dims[0]:
        return None  # (since the in-place gather of a leading dim: not a walk, the same rule)
    if lead not in dims:
        k = min(k, min(s[lead] for s in before_shapes))
        return _Pipe(k, lead, False) if k >= 2 else None
    side = before_shapes if kind == "all_gather" or (kind == "all_to_all" and lead == src.dim) else after_shapes
    k = min(k, min(s[lead] for s, c in zip(side, cs) if c[i] == 0))
    if kind == "all_to_all":
        n = spec_.mesh_shape[i]
        k = max(1, k // (n - 1))
        return _Pipe(k, lead, True) if k * (n - 1) >= 2 else None
    return _Pipe(k, lead, True) if k >= 2 else None


# ---- strategies ---------------------------------------------------------------------------------

meshes = st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple)
shapes = st.lists(st.integers(0, 13), min_size=1, max_size=3).map(tuple)


@st.composite
def placements_for(draw, ndim, mesh_ndim, partial=True):
    out = []
    for _ in range(mesh_ndim):
        kind = draw(st.sampled_from("RPSSTT" if partial else "RSSTT"))
        d = draw(st.integers(0, ndim - 1))
        if draw(st.integers(0, 7)) == 0:
            d -= ndim  # a negative dim, counted from the end as local_region counts it
        out.append(Replicate() if kind == "R" else Partial() if kind == "P" else Shard(d) if kind == "S"
                   else _StridedShard(d, split_factor=draw(st.integers(1, 4))))
    return tuple(out)


@st.composite
def layouts(draw, mesh_shape, count=None):
    n = count or draw(st.integers(1, 3))
    out = []
    for _ in range(n):
        sh = draw(shapes)
        out.append((sh, draw(placements_for(len(sh), len(mesh_shape)))))
    return out


# ---- (a) the fast checks agree with the walks ---------------------------------------------------


@SETTINGS
@given(st.data())
def test_local_shape_classes_are_the_walks_classes_in_its_order(data):
    mesh_shape = data.draw(meshes)
    lays = data.draw(layouts(mesh_shape))
    if data.draw(st.booleans()):
        lays.insert(data.draw(st.integers(0, len(lays))), None)  # an output that is not a tensor
    got = local_shape_classes(lays, mesh_shape)
    want = old_classes(lays, mesh_shape)
    assert list(got.items()) == list(want.items())
    i = data.draw(st.integers(0, len(mesh_shape) - 1))
    assert set(local_shape_classes(lays, mesh_shape, pinned={i: 0})) == set(old_classes(lays, mesh_shape, {i: 0}))
    lay = [x for x in lays if x is not None][0]
    assert local_shapes(lay[0], mesh_shape, lay[1]) == [k[0] for k in old_classes([lay], mesh_shape)]


@SETTINGS
@given(st.data())
def test_strided_is_blocks_and_patterns_match_the_walk(data):
    mesh_shape = data.draw(meshes)
    sh = data.draw(shapes)
    pl = data.draw(placements_for(len(sh), len(mesh_shape)))
    _strided_is_blocks.cache_clear()
    assert _strided_is_blocks(sh, mesh_shape, pl) == old_is_blocks(sh, mesh_shape, pl)
    for d in range(len(sh)):
        steps = dim_steps(pl, d, mesh_shape, len(sh))
        want = {tuple(hi - lo for lo, hi in local_region(sh, mesh_shape, pl, c)[d]) for c in coords(mesh_shape)}
        assert dim_patterns(sh[d], steps) == want
        for c in coords(mesh_shape):
            assert dim_region(sh[d], steps, c) == local_region(sh, mesh_shape, pl, c)[d]


@st.composite
def paired_dims(draw, mesh_shape):
    """Entries of _strided_variant's per-mesh-dim test: the same length (mostly) on each."""
    length = draw(st.integers(0, 13))
    out = []
    base = None
    for _ in range(draw(st.integers(1, 3))):
        nd = draw(st.integers(1, 3))
        d = draw(st.integers(0, nd - 1))
        sh = [draw(st.integers(0, 6)) for _ in range(nd)]
        sh[d] = length if draw(st.integers(0, 9)) else draw(st.integers(0, 13))
        pl = draw(placements_for(nd, len(mesh_shape)))
        if base is not None and draw(st.booleans()):  # the same nesting on dim d: the usual case
            pl = tuple(_StridedShard(d, split_factor=p.split_factor) if type(p) is _StridedShard
                       else Shard(d) if isinstance(p, Shard) else (Replicate() if b is None else p)
                       for p, b in zip(base, [None] * len(base)))
        base = base or pl
        out.append((tuple(sh), pl, d))
    return out


@SETTINGS
@given(st.data())
def test_same_dim_regions_match_the_walk(data):
    mesh_shape = data.draw(meshes)
    paired = data.draw(paired_dims(mesh_shape))
    want = old_same_regions(paired, mesh_shape)
    if len({sh[d] for sh, _, d in paired}) != 1:
        assert not want
        return
    got = P._same_dim_regions(paired[0][0][paired[0][2]], [dim_steps(pl, d, mesh_shape, len(sh)) for sh, pl, d in paired],
                              mesh_shape)
    assert got == want  # small meshes: every undecided case is walked, so the verdict is exact


def old_strided_variant(specs, in_ids, ins, outs, gflat, mesh_shape):
    """propagate._strided_variant before issue #53."""
    from dtshard.spec import is_strided, split_factor

    m = len(mesh_shape)
    ins2 = [list(p) for p in ins]
    outs2 = [list(o) for o in outs]
    changed = []
    for i in range(m):
        sfs = {split_factor(specs[k].placements[i]) for k in in_ids
               if is_strided(specs[k].placements[i]) and type(ins[k][i]) is Shard
               and ins[k][i].dim == specs[k].placements[i].dim}
        if len(sfs) != 1:
            continue
        sf = sfs.pop()
        for row in (*ins2, *outs2):
            if type(row[i]) is Shard:
                row[i] = _StridedShard(row[i].dim, split_factor=sf)
        changed.append(i)
    if not changed:
        return None
    shp = [s.shape for s in specs] + [None if o is None else o.shape for o in gflat]
    rows = ins2 + outs2
    for i in changed:
        paired = [(shp[t], rows[t], rows[t][i].dim) for t in range(len(rows))
                  if shp[t] is not None and is_strided(rows[t][i])]
        if not old_same_regions(paired, mesh_shape):
            return None
    return tuple(tuple(p) for p in ins2), tuple(tuple(o) for o in outs2)


@SETTINGS
@given(st.data())
def test_strided_variant_matches_the_walk(data):
    mesh_shape = data.draw(meshes)
    n_in = data.draw(st.integers(1, 2))
    nd = data.draw(st.integers(1, 3))
    sh = tuple(data.draw(st.integers(0, 12)) for _ in range(nd))
    specs = [types.SimpleNamespace(shape=sh, placements=data.draw(placements_for(nd, len(mesh_shape))))
             for _ in range(n_in)]
    # a strategy that asks Shard(d) where an input holds a strided shard of d, or anything
    ins = tuple(tuple(Shard(p.dim) if type(p) is _StridedShard and data.draw(st.booleans()) else p
                      for p in s.placements) if data.draw(st.booleans())
                else data.draw(placements_for(nd, len(mesh_shape), partial=False)) for s in specs)
    gflat = [types.SimpleNamespace(shape=sh if data.draw(st.booleans()) else tuple(
        data.draw(st.integers(0, 12)) for _ in range(nd)))]
    outs = (data.draw(placements_for(nd, len(mesh_shape))) if data.draw(st.booleans()) else ins[0],)
    want = old_strided_variant(specs, range(n_in), ins, outs, gflat, mesh_shape)
    assert P._strided_variant(specs, range(n_in), ins, outs, gflat, mesh_shape) == want


@st.composite
def view_pairs(draw):
    """Two shapes of one element count (merges and splits of adjacent dims) with placements that
    often correspond (a sharded input dim's counterpart sharded the same way)."""
    mesh_shape = draw(meshes)
    a = list(draw(st.lists(st.integers(1, 8), min_size=1, max_size=4)))
    if draw(st.integers(0, 9)) == 0:
        a[draw(st.integers(0, len(a) - 1))] = 0
    b = list(a)
    for _ in range(draw(st.integers(0, 3))):
        if len(b) > 1 and draw(st.booleans()):
            i = draw(st.integers(0, len(b) - 2))
            b[i:i + 2] = [b[i] * b[i + 1]]
        else:
            i = draw(st.integers(0, len(b) - 1))
            f = [x for x in range(1, b[i] + 1) if b[i] % x == 0] if b[i] else [1]
            x = draw(st.sampled_from(f))
            b[i:i + 1] = [x, b[i] // x]
    pa = draw(placements_for(len(a), len(mesh_shape), partial=False))

    def counterpart(d):  # the out dim whose flat range holds in dim d's start
        start = math.prod(a[:d])
        for e in range(len(b)):
            if math.prod(b[:e]) <= start < math.prod(b[:e + 1]):
                return e
        return min(d, len(b) - 1)

    if draw(st.booleans()):
        pb = tuple(p if not isinstance(p, (Shard, _StridedShard)) else
                   (Shard(counterpart(p.dim % len(a))) if type(p) is Shard
                    else _StridedShard(counterpart(p.dim % len(a)), split_factor=p.split_factor)) for p in pa)
    else:
        pb = draw(placements_for(len(b), len(mesh_shape), partial=False))
    if not any(isinstance(p, (Shard, _StridedShard)) for p in pa):
        pa = (Shard(0),) + pa[1:]
    return mesh_shape, spec(mesh_shape, pa, a), spec(mesh_shape, pb, b)


@settings(max_examples=3 * EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(view_pairs())
def test_view_regions_match_matches_the_walk(case):
    mesh_shape, a, b = case
    want = old_view_match(a, b, mesh_shape)
    fast = P._view_groups_match(a, b, mesh_shape)
    assert fast is None or fast == want, (fast, want)
    assert P._view_regions_match(a, b, mesh_shape) == want


def test_flattened_rows_of_nested_shards_match_the_walk():
    # a dim sharded over several mesh dims whose rows a view merges or splits (the batch of a
    # loss's flatten): decided by chunk lengths alone (_leading_rows_match), uneven and empty too
    for ms in [(2, 3), (4, 4)]:
        for batch, seq in itertools.product(range(1, 13), range(1, 4)):
            for pl in [(Shard(0), Shard(0)), (Shard(0), Replicate())]:
                for a, b in [((batch, seq), (batch * seq,)), ((batch, seq, 2), (batch * seq, 2)),
                             ((batch * seq,), (batch, seq))]:
                    x, y = spec(ms, pl, a), spec(ms, pl, b)
                    assert P._view_groups_match(x, y, ms) == old_view_match(x, y, ms), (ms, pl, a, b)


@SETTINGS
@given(st.data())
def test_choose_pipe_matches_the_walk(data):
    mesh_shape = data.draw(meshes)
    sh = tuple(data.draw(st.integers(1, 40)) for _ in range(data.draw(st.integers(1, 3))))
    state = data.draw(placements_for(len(sh), len(mesh_shape), partial=False))
    i = data.draw(st.integers(0, len(mesh_shape) - 1))
    kind = data.draw(st.sampled_from(["all_gather", "reduce_scatter", "all_to_all"]))
    d, e = data.draw(st.integers(0, len(sh) - 1)), data.draw(st.integers(0, len(sh) - 1))
    if kind == "all_gather":
        src, dst = Shard(d), Replicate()
    elif kind == "reduce_scatter":
        src, dst = Partial(), Shard(d)
    else:
        if mesh_shape[i] < 2 or d == e:
            return  # no such step
        src, dst = Shard(d), Shard(e)
    state = state[:i] + (src,) + state[i + 1:]
    s = spec(mesh_shape, state, sh)
    s._keep("_mesh_shape", mesh_shape)
    chunk, cap = data.draw(st.sampled_from([4, 16, 64])), data.draw(st.integers(2, 16))
    step = Step(i, src, dst, kind)
    assert choose_pipe(s, state, step, chunk, cap) == old_choose_pipe(s, state, step, chunk, cap)


@SETTINGS
@given(meshes, st.integers(0, 40), st.integers(0, 20), st.data())
def test_blocks_align_matches_the_walk(mesh_shape, n_in, n_out, data):
    dims = data.draw(st.lists(st.integers(0, len(mesh_shape) - 1), unique=True, max_size=len(mesh_shape)))
    if data.draw(st.booleans()) and n_out:
        n_in = n_out * data.draw(st.integers(1, 4))
    assert blocks_align(n_in, n_out, mesh_shape, dims) == old_blocks_align(n_in, n_out, mesh_shape, dims)


def test_check_local_sees_every_class():
    # an uneven add whose shards disagree on some ranks only (the first rank is fine): the check
    # must find that class without walking the ranks
    add = torch.ops.aten.add.Tensor
    args = (P._Slot(0), P._Slot(1))
    ok = [spec((3, 4), (Shard(0), Shard(1)), (7, 10)), spec((3, 4), (Shard(0), Shard(1)), (7, 10))]
    bad = [spec((3, 4), (Shard(0), Shard(1)), (7, 10)), spec((3, 4), (Shard(0), Replicate()), (7, 10))]
    out = spec((3, 4), (Shard(0), Shard(1)), (7, 10))
    assert P._check_local(add, args, {}, ok, [out], (3, 4), {})
    assert not P._check_local(add, args, {}, bad, [out], (3, 4), {})


# ---- (b) at 32,768 ranks: every check finishes ---------------------------------------------------


def _fsdp_tp_layouts(mesh_shape):
    tp = len(mesh_shape) - 1
    dp = (Replicate(),) * (tp - 1)
    return [
        ((4099, 333), dp + (_StridedShard(0, split_factor=8), Shard(0))),
        ((4099, 333), dp + (Shard(0), Shard(1))),
        ((1000, 7, 3), dp + (Shard(0), Shard(1))),
        ((8 * 5000 + 3, 17), dp + (_StridedShard(0, split_factor=8), Shard(0))),
        ((50_000, 64), (Shard(0),) * len(mesh_shape)),
    ]


def test_every_check_finishes_at_32768_ranks():
    for mesh_shape in BIG_MESHES:
        assert math.prod(mesh_shape) == 32768
        lays = _fsdp_tp_layouts(mesh_shape)
        classes = local_shape_classes(lays, mesh_shape)
        assert len(classes) <= 200
        for sh, pl in lays:
            _strided_is_blocks.cache_clear()
            _strided_is_blocks(sh, mesh_shape, pl)
            assert len(local_shapes(sh, mesh_shape, pl)) <= 10
        # the local-shape check of an uneven FSDP x TP add (and of a mismatched one)
        add = torch.ops.aten.add.Tensor
        a = spec(mesh_shape, lays[0][1], lays[0][0])
        b = spec(mesh_shape, lays[1][1], lays[1][0])
        assert P._check_local(add, (P._Slot(0), P._Slot(1)), {}, [a, a], [a], mesh_shape, {})
        assert not P._check_local(add, (P._Slot(0), P._Slot(1)), {}, [a, b], [a], mesh_shape, {})
        # the strided variant of an elementwise op on an FSDP x TP parameter (parameter init)
        specs = [types.SimpleNamespace(shape=a.shape, placements=a.placements)]
        ins = (tuple(Shard(0) if type(p) is _StridedShard else p for p in a.placements),)
        v = P._strided_variant(specs, [0], ins, ins, [a], mesh_shape)
        assert v == ((a.placements,), (a.placements,))
        # views of FSDP x TP activations and parameters
        x = spec(mesh_shape, lays[2][1], (1000, 7, 3))
        for y, want in ((spec(mesh_shape, lays[2][1], (1000, 21)), None),
                        (spec(mesh_shape, lays[2][1][:-2] + (Shard(0), Shard(2)), (1000, 7, 3)), False),
                        (spec(mesh_shape, lays[2][1], (1000, 7, 3, 1)), True)):
            got = P._view_regions_match(x, y, mesh_shape)
            assert want is None or got == want
        # a batch sharded over two mesh dims, its (batch, seq) rows flattened (the loss's view)
        nested = lays[4][1][:-2] + (Shard(0), Shard(0))
        for batch, want in ((98304, True), (4099, False)):
            x = spec(mesh_shape, nested, (batch, 512, 4))
            assert P._view_regions_match(x, spec(mesh_shape, nested, (batch * 512, 4)), mesh_shape) == want
        w = spec(mesh_shape, lays[0][1], (4099, 333))
        w2 = spec(mesh_shape, lays[0][1], (4099, 333, 1))
        assert P._view_regions_match(w, w2, mesh_shape)
        # pipelining an all-gather of the FSDP dim
        s = spec(mesh_shape, lays[1][1], lays[1][0])
        s._keep("_mesh_shape", mesh_shape)
        i = len(mesh_shape) - 2
        choose_pipe(s, lays[1][1], Step(i + 1, Shard(1), Replicate(), "all_gather"), 1 << 10, 8)
        assert blocks_align(4096 * 64, 4096 * 8, mesh_shape, range(len(mesh_shape)))
        assert not blocks_align(4096 * 24, 4096 * 3, mesh_shape, range(len(mesh_shape)))


# ---- FSDP's gradient-term placements (fsdp._group._term_placements) -------------------------------


class TableMesh:
    """A mesh of a rank table and this rank's coordinate (what _term_placements reads)."""

    mesh_dim_names = None

    def __init__(self, table: torch.Tensor, coord):
        self.mesh, self.ndim, self.shape, self._coord = table, table.ndim, tuple(table.shape), tuple(coord)

    def size(self, d=None):
        return self.mesh.numel() if d is None else self.shape[d]

    def get_coordinate(self):
        return list(self._coord)


def old_term_placements(mesh, fsdp_mesh, placements):
    """_term_placements before issue #53 (a set of coordinates spanning FSDP's mesh dims)."""
    from dtshard import collectives as C

    def flat(t):
        return set().union(*(flat(x) for x in t)) if isinstance(t, list) else {t}

    def ranks_of(index):
        return flat(C.rank_table(mesh, tuple(index)))

    fsdp_ranks = flat(C.rank_table(fsdp_mesh))
    coord = list(C.mesh_coordinate(mesh))
    target, span = [], {tuple(coord)}
    for d in range(mesh.ndim):
        along = ranks_of([slice(None) if k == d else c for k, c in enumerate(coord)])
        if along <= fsdp_ranks:
            target.append(Partial("sum"))
            span = {tuple(c[:d]) + (r,) + tuple(c[d + 1:]) for c in span for r in range(mesh.size(d))}
        elif len(along & fsdp_ranks) == 1:
            target.append(Replicate())
        else:
            span = None
            break
    if not (span is not None and set().union(*(ranks_of(c) for c in span)) == fsdp_ranks):
        raise RuntimeError("not lined up")
    return tuple(target)


@SETTINGS
@given(st.data())
def test_term_placements_match_the_span_walk(data):
    from dtshard.fsdp._group import _term_placements

    shape = data.draw(meshes)
    table = torch.arange(math.prod(shape)).reshape(shape)
    coord = tuple(data.draw(st.integers(0, n - 1)) for n in shape)
    mesh = TableMesh(table, coord)
    me = int(table[coord])
    if data.draw(st.booleans()):  # FSDP over some whole mesh dims through this rank
        free = data.draw(st.lists(st.integers(0, len(shape) - 1), unique=True))
        sub = table[tuple(slice(None) if d in free else c for d, c in enumerate(coord))]
        fsdp = TableMesh(sub.reshape(-1), (0,))
    else:  # any ranks with this one among them
        others = data.draw(st.lists(st.integers(0, table.numel() - 1), unique=True, max_size=6))
        fsdp = TableMesh(torch.tensor(sorted({me, *others})), (0,))
    try:
        want = old_term_placements(mesh, fsdp, ())
    except RuntimeError:
        want = None
    try:
        got = _term_placements(mesh, fsdp, "m", ())
    except RuntimeError:
        got = None
    assert got == want


def test_term_placements_at_32768_ranks():
    from dtshard.fsdp._group import _term_placements

    table = torch.arange(32768).reshape(4096, 8)
    mesh = TableMesh(table, (17, 3))
    assert _term_placements(mesh, TableMesh(table[:, 3], (17,)), "m", ()) == (Partial("sum"), Replicate())
