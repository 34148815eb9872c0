"""Single-process checks: layout math, redistribute plans (expecttest), registry behaviour."""

from __future__ import annotations

import itertools

import expecttest
import pytest
import torch

import dtshard
from dtshard import Partial, Replicate, Shard
from dtshard.redistribute import GroupStep, plan, plan_text, transition_cost
from dtshard.registry import override, register_rule
from dtshard.spec import DTensorSpec, chunk_sizes, local_shape_and_offset, normalize_placements


class FakeMesh:
    """Enough of a DeviceMesh for metadata-only planning (no process group)."""

    device_type = "cpu"

    def __init__(self, *shape):
        self.shape = shape
        self.ndim = len(shape)

    def size(self, i):
        return self.shape[i]


def spec(mesh_shape, placements, shape, dtype=torch.float32):
    stride = torch.empty(shape).stride()
    return DTensorSpec(FakeMesh(*mesh_shape), tuple(placements), tuple(shape), stride, dtype)


@pytest.mark.parametrize("size", [0, 1, 2, 5, 7, 8, 13])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_chunk_layout_matches_torch_chunk(size, n):
    chunks = torch.arange(size).chunk(n)
    want = [len(c) for c in chunks] + [0] * (n - len(chunks))
    assert chunk_sizes(size, n) == want


def test_nested_sharding_offsets_cover_the_tensor_once():
    shape, mesh_shape = (7, 5), (2, 3)
    seen = torch.zeros(shape, dtype=torch.int64)
    for coord in itertools.product(range(2), range(3)):
        (s0, s1), (o0, o1) = local_shape_and_offset(shape, mesh_shape, [Shard(0), Shard(0)], coord)
        seen[o0 : o0 + s0, o1 : o1 + s1] += 1
    assert torch.equal(seen, torch.ones(shape, dtype=torch.int64))


def test_placement_validation_messages():
    with pytest.raises(ValueError, match=r"Shard\(2\) is out of range for a 2-D tensor"):
        normalize_placements([Shard(2)], 2, 1, what="distribute_tensor")
    with pytest.raises(ValueError, match="got 1 placements .* for a 2-D mesh"):
        normalize_placements([Shard(0)], 2, 2, what="distribute_tensor")
    assert normalize_placements([Partial("product")], 2, 1, what="from_local") == (Partial("product"),)
    # every spelling PyTorch's Partial takes is read as its canonical name (issue #54 item 10)
    for spelling in ("prod", "PROD", "PRODUCT", "Product"):
        assert normalize_placements([Partial(spelling)], 2, 1, what="from_local") == (Partial("product"),)
    for spelling in ("SUM", "Avg", "MAX", "min"):
        assert normalize_placements([Partial(spelling)], 2, 1, what="from_local") == (Partial(spelling.lower()),)
    with pytest.raises(ValueError, match="Partial\\('band'\\) is not supported"):
        normalize_placements([Partial("band")], 2, 1, what="from_local")
    with pytest.raises(ValueError, match="mix Partial\\('product'\\) with \\['max'\\]"):
        normalize_placements([Partial("product"), Partial("max")], 2, 2, what="from_local")
    assert normalize_placements([Shard(-1)], 3, 1, what="x") == (Shard(2),)


class TestPlans(expecttest.TestCase):
    def test_1d_plans(self):
        s = spec((4,), [Shard(0)], (8, 16))
        self.assertExpectedInline(plan_text(s, [Shard(1)]), """\
(S(0)) -> (S(1)):
  mesh dim 0: S(0) -> S(1) all_to_all""")
        self.assertExpectedInline(plan_text(s, [Replicate()]), """\
(S(0)) -> (R):
  mesh dim 0: S(0) -> R all_gather""")
        p = spec((4,), [Partial("avg")], (8, 16))
        self.assertExpectedInline(plan_text(p, [Partial("sum")]), """\
(P(avg)) -> (P(sum)):
  mesh dim 0: P(avg) -> R all_reduce
  mesh dim 0: R -> P(sum) zero""")
        self.assertExpectedInline(plan_text(p, [Shard(1)]), """\
(P(avg)) -> (S(1)):
  mesh dim 0: P(avg) -> S(1) reduce_scatter""")

    def test_2x2_swap_avoids_full_gather(self):
        s = spec((2, 2), [Shard(0), Shard(1)], (8, 8))
        self.assertExpectedInline(plan_text(s, [Shard(1), Shard(0)]), """\
(S(0), S(1)) -> (S(1), S(0)):
  mesh dims 0x1 (flattened): (S(0), S(1)) -> (S(1), S(0)) exchange""")

    def test_nested_sharding_unshards_inner_first(self):
        s = spec((2, 2), [Shard(0), Shard(0)], (8, 8))
        self.assertExpectedInline(plan_text(s, [Replicate(), Shard(0)]), """\
(S(0), S(0)) -> (R, S(0)):
  mesh dims 0x1 (flattened): (S(0), S(0)) -> (R, S(0)) exchange""")

    def test_costs_follow_the_architecture_table(self):
        T = 8 * 16 * 4
        s0 = spec((4,), [Shard(0)], (8, 16))
        assert transition_cost(s0, [Replicate()]) == 3 * T / 4
        assert transition_cost(s0, [Shard(1)]) == 3 * T / 16
        assert transition_cost(spec((4,), [Partial()], (8, 16)), [Replicate()]) == 2 * 3 * T / 4


def test_every_plan_reaches_its_target():
    placements = [Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("max")]
    for src in itertools.product(placements, repeat=2):
        for dst in itertools.product(placements, repeat=2):
            s = spec((2, 3), list(src), (5, 7))
            state = list(src)
            for step in plan(s, list(dst)):
                if isinstance(step, GroupStep):  # a whole state over a flattened group
                    assert tuple(state) == step.src
                    state = list(step.dst)
                    continue
                assert state[step.mesh_dim] == step.src
                state[step.mesh_dim] = step.dst
            assert tuple(state) == tuple(dst)


# ---------------------------------------------------------------------------------------------
# registry
# ---------------------------------------------------------------------------------------------


def test_duplicate_registration_raises_and_names_the_first():
    with pytest.raises(ValueError, match=r"already registered at .*matmul.py"):
        register_rule(torch.ops.aten.mm.default)(lambda call: [])


def test_register_rule_rejects_non_overloads():
    with pytest.raises(TypeError, match="aten op overloads"):
        register_rule(torch.ops.aten.mm)(lambda call: [])


def test_in_place_and_out_derive_from_the_functional_rule():
    from dtshard.propagate import lookup

    entry, mode = lookup(torch.ops.aten.add_.Tensor)
    assert mode == "inplace" and entry.op == torch.ops.aten.add.Tensor
    entry, mode = lookup(torch.ops.aten.mul.out)
    assert mode == "out" and entry.op == torch.ops.aten.mul.Tensor
    assert lookup(torch.ops.aten.unfold_copy.default)[0] is None  # an op without a rule


def test_override_restores_the_original():
    from dtshard.registry import get_entry

    original = get_entry(torch.ops.aten.mm.default).fn
    with override(torch.ops.aten.mm.default, lambda call: []):
        assert get_entry(torch.ops.aten.mm.default).fn is not original
    assert get_entry(torch.ops.aten.mm.default).fn is original


def test_public_api_is_drop_in():
    import torch.distributed.tensor as tdt

    assert dtshard.Shard is tdt.Shard and dtshard.Replicate is tdt.Replicate and dtshard.Partial is tdt.Partial
    import inspect

    # ours wraps PyTorch's (mesh-dim groups inherit the default group's timeout), same signature
    assert list(inspect.signature(dtshard.init_device_mesh).parameters) == list(
        inspect.signature(torch.distributed.device_mesh.init_device_mesh).parameters
    )
    for name in ["distribute_tensor", "distribute_module", "DTensor", "register_rule"]:
        assert hasattr(dtshard, name)
    import inspect

    ours = inspect.signature(dtshard.DTensor.from_local).parameters
    theirs = inspect.signature(tdt.DTensor.from_local).parameters
    assert list(ours) == list(theirs)


def test_kernels_import_is_ours_and_collision_free():
    import dtshard_kernels

    assert dtshard_kernels.__file__.replace("\\", "/").endswith("dtshard_kernels/__init__.py")
    import os

    assert os.path.exists(os.path.join(os.path.dirname(dtshard_kernels.__file__), "reference.py"))
    import importlib.util

    spec_ = importlib.util.find_spec("dtshard_kernels")
    assert spec_.origin == dtshard_kernels.__file__


def _fill_the_plan_cache(limit: int, n: int):
    """On one rank: with a cache limit of ``limit``, dispatch ``n`` adds of distinct shapes (one
    plan each); return the cache size after each, and whether the first and last shapes'
    plans were still cached (a miss on replay means evicted)."""
    import torch

    import dtshard
    from dtshard import dispatch

    saved_limit = dispatch.CACHE_LIMIT
    dispatch.CACHE_LIMIT = limit
    dispatch.clear_cache()
    try:
        mesh = dtshard.init_device_mesh("cpu", (1,))
        xs = [dtshard.distribute_tensor(torch.ones(k + 1), mesh, [dtshard.Shard(0)]) for k in range(n)]
        sizes = []
        for x in xs:
            (x + x).full_tensor()
            sizes.append(dispatch.cache_info()["size"])

        def replay_misses(x):
            before = dispatch.cache_info()["misses"]
            _ = x + x
            return dispatch.cache_info()["misses"] - before

        last_missed = replay_misses(xs[-1])
        first_missed = replay_misses(xs[0])
        return sizes, first_missed, last_missed
    finally:
        dispatch.CACHE_LIMIT = saved_limit
        dispatch.clear_cache()


def test_plan_cache_is_bounded():
    """Real dispatches fill the plan cache past its limit: it never grows beyond the limit, the
    newest plans stay, the oldest are evicted (replaying the first op plans it again)."""
    from dtshard.testing import run_distributed

    sizes, first_missed, last_missed = run_distributed(_fill_the_plan_cache, 1, 10, 40)[0]
    assert max(sizes) <= 10 and sizes[-1] >= 5, sizes
    assert last_missed == 0, "the newest plan was evicted"
    assert first_missed >= 1, "the oldest plan was never evicted"


def test_closed_form_1d_costs_equal_the_planned_steps():
    """redistribute.planning._cost_1d (the cache-miss fast path) prices exactly what plan() + _step_cost do."""
    import itertools

    import torch
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    from dtshard.redistribute import planning as RD
    from dtshard.spec import DTensorSpec

    class _Mesh:  # only .shape is read by the cost model
        def __init__(self, n):
            self.shape = (n,)

    pls = [Replicate(), Shard(0), Shard(1), Partial("sum"), Partial("max")]
    for n, shape, (a, b) in itertools.product((2, 3, 4), [(7, 5), (8, 4), (0, 3), (2, 9)], itertools.permutations(pls, 2)):
        spec = DTensorSpec(_Mesh(n), (a,), shape, (shape[1], 1), torch.float32)
        steps = RD.plan(spec, (b,))
        want, state = 0.0, [a]
        for st in steps:
            want += RD._step_cost(shape, (n,), tuple(state), 0, st.dst, 4)
            state[0] = st.dst
        assert RD._cost_1d(shape, n, a, b, 4) == pytest.approx(want), (n, shape, a, b)


def test_transition_lower_bound_never_exceeds_the_planned_cost():
    """propagate prices an op's moving choices in the order of transition_lower_bound and stops at
    the first exact cost below the next bound: a bound above a planned cost would pick a dearer
    plan.  Every transition of a 2x2 mesh (Shard, Replicate, Partial sum/avg/max), sampled ones
    on 2x2 (even, empty), 2x3 and 2x2x2, strided shards.  (The plans are the same as pricing every
    choice: checked on the 8-rank HF Llama CP x FSDP x TP step, all 225 plans equal.)"""
    import random

    from torch.distributed.tensor.placement_types import _StridedShard

    from dtshard.redistribute import transition_lower_bound

    def placements(ndim):
        return [Shard(d) for d in range(ndim)] + [Replicate(), Partial("sum"), Partial("avg"), Partial("max")]

    def well_defined(src):
        ops = {p.reduce_op for p in src if isinstance(p, Partial)}
        return len(ops) <= 1 or ops <= {"sum", "avg"}

    rng = random.Random(0)
    checked = 0
    for mesh_shape, shape, sample in [((2, 2), (3, 5), None), ((2, 2), (4, 6), 300), ((2, 2), (0, 4), 100),
                                      ((2, 3), (6, 7), 300), ((2, 2, 2), (4, 6), 400), ((2, 2, 2), (3, 1), 200)]:
        states = [s for s in itertools.product(placements(len(shape)), repeat=len(mesh_shape))]
        pairs = [(a, b) for a in states for b in states if well_defined(a)]
        if sample is not None:
            pairs = rng.sample(pairs, sample)
        for src, dst in pairs:
            s = spec(mesh_shape, src, shape)
            try:
                cost = transition_cost(s, dst)
            except ValueError:
                continue
            bound = transition_lower_bound(s, dst)
            assert 0 <= bound <= cost * (1 + 1e-9), (mesh_shape, shape, src, dst, bound, cost)
            checked += 1
    # strided shards (FSDP of a TP-sharded weight, a merged view): their plans are group exchanges
    sf = _StridedShard(0, split_factor=2)
    for src, dst in [((sf, Shard(0)), (Shard(0), Shard(0))), ((Shard(0), Shard(0)), (sf, Shard(0))),
                     ((sf, Shard(0)), (Replicate(), Replicate())), ((sf, Replicate()), (Shard(1), Shard(0)))]:
        for shape in [(8, 4), (7, 3)]:
            s = spec((2, 2), src, shape)
            cost = transition_cost(s, dst)
            assert 0 <= transition_lower_bound(s, dst) <= cost * (1 + 1e-9), (src, dst, shape)
            checked += 1
    assert checked > 2000


def test_a_symbolic_shape_gets_a_clear_redistribute_error():
    """torch.compile's dynamic shapes reach the planner as SymInts (a recompilation of FSDP hooks
    with other sizes): a clear error naming the shape, the placements and what to do, not Python's
    'unhashable type'."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    n = ShapeEnv().create_unbacked_symint()
    s = DTensorSpec(FakeMesh(2), (Shard(0),), (n, 4), (4, 1), torch.float32)
    with pytest.raises(NotImplementedError, match=r"symbolic \(dynamic\) global shape .*S\(0\).*R.*dynamic=False"):
        plan(s, (Replicate(),))


def test_one_shard_view_check_agrees_with_the_region_walk():
    # the planner's shortcut for a view's exact element check (1-D mesh, one plain Shard on each
    # side) must give the walk's verdict wherever it answers; pairs of every shape of up to 3 dims
    # of sizes 1..5 with equal numel, every sharded dim, 2-4 ranks (uneven and empty chunks too)
    from dtshard.propagate import _flat_runs, _one_shard_regions_match, _region

    shapes = [s for k in (1, 2, 3) for s in itertools.product(range(1, 6), repeat=k)]
    by_numel: dict = {}
    for s in shapes:
        by_numel.setdefault(torch.Size(s).numel(), []).append(s)
    answered = 0
    for n in (2, 3, 4):
        for group in by_numel.values():
            for a, b in itertools.product(group, repeat=2):
                for da, db in itertools.product(range(len(a)), range(len(b))):
                    sa, sb = spec((n,), [Shard(da)], a), spec((n,), [Shard(db)], b)
                    quick = _one_shard_regions_match(sa, sb, (n,))
                    if quick is None:
                        continue
                    answered += 1
                    walk = all(_flat_runs(a, _region(sa, (n,), (c,))) == _flat_runs(b, _region(sb, (n,), (c,)))
                               for c in range(n))
                    assert quick == walk, (n, a, da, b, db)
    assert answered > 5000


def test_reduce_into_the_ranks_a_sparse_target_keeps():
    """A Partial reduced onto a layout that leaves all but one rank of its group empty is one
    ``reduce`` into that rank (each rank sends its piece once, none receives twice); a target
    a reduced dim would shard outside the source's piece (``(P, S0) -> (S0, S0)``), a dense one,
    or a mesh past the rank-by-rank pricing is not."""
    from dtshard.redistribute.planning import plan_sends

    P, S0, S1 = Partial(), Shard(0), Shard(1)
    s = spec((2, 2), (P, P), (2, 1))
    steps = plan(s, (S1, S1))
    assert [(st.kind, st.mesh_dims) for st in steps] == [("reduce", (0, 1))]
    assert plan_sends(s, steps) == (0, 8, 8, 8)  # float32: the whole [2, 1] from each other rank once
    for mesh_shape, src, dst, shape in [((2, 2), (P, S0), (S0, S0), (2, 1)), ((2, 2), (P, P), (S0, S1), (4, 4)),
                                       ((16, 16), (P, P), (S1, S1), (2, 1))]:
        assert all(st.kind != "reduce" for st in plan(spec(mesh_shape, src, shape), dst)), (src, dst, shape)
