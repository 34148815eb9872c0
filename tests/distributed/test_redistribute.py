"""Redistribute on 1-D and 2x2 meshes: values on every rank, minimum traffic, backward."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import dtshard
from dtshard.debug import CommCounter, CopyCounter
from dtshard.testing import run_distributed

from _cases import Ps, global_tensor, make_dtensor, expected_local, mesh

# ---------------------------------------------------------------------------------------------
# worker functions (module level: pickled by reference)
# ---------------------------------------------------------------------------------------------


def _check_transitions(cases):
    """For each (mesh_shape, shape, src, dst, seed): every rank's local equals the expected slice
    (or partial term, checked through full_tensor), and full_tensor reconstructs the global."""
    for mesh_shape, shape, src, dst, seed in cases:
        m = mesh(mesh_shape)
        full = global_tensor(shape, seed)
        x = make_dtensor(full, m, Ps(src))
        y = x.redistribute(m, Ps(dst))
        ctx = f"{src} -> {dst} shape={shape} mesh={mesh_shape}"
        assert tuple(y.placements) == tuple(Ps(dst)), ctx
        assert tuple(y.shape) == tuple(shape), ctx
        want_shape = y._spec.local_shape(m.get_coordinate())
        assert tuple(y.to_local().shape) == want_shape, ctx
        if not any(p.startswith("P") for p in dst):
            torch.testing.assert_close(y.to_local(), expected_local(full, m, Ps(dst)), rtol=0, atol=0, msg=ctx)
        torch.testing.assert_close(y.full_tensor(), full, rtol=1e-6, atol=1e-5, msg=lambda s: ctx + "\n" + s)
    return len(cases)


def _traffic(mesh_shape, shape, src, dst):
    m = mesh(mesh_shape)
    full = global_tensor(shape)
    x = make_dtensor(full, m, Ps(src))
    with CommCounter() as comm, CopyCounter() as copies:
        y = x.redistribute(m, Ps(dst))
    torch.testing.assert_close(y.full_tensor(), full)
    return [(r.kind, r.mesh_dim, r.nbytes) for r in comm.records], copies.count()


def _backward(mesh_shape, shape, src, dst):
    m = mesh(mesh_shape)
    full = global_tensor(shape)
    x = make_dtensor(full, m, Ps(src)).detach().requires_grad_()
    w = global_tensor(shape, seed=7)
    y = x.redistribute(m, Ps(dst))
    (y.full_tensor() * w).sum().backward()
    grad = x.grad
    want = tuple(dtshard.Replicate() if p.startswith("P") else q for p, q in zip(src, Ps(src)))
    assert tuple(grad.placements) == want, (grad.placements, want)
    torch.testing.assert_close(grad.full_tensor(), w)
    return True


def _peak_local_numel(mesh_shape, shape, src, dst):
    """Largest local shard any intermediate state of the plan holds (rank 0 holds the largest)."""
    from dtshard.redistribute.planning import _local_numel, plan

    m = mesh(mesh_shape)
    spec = make_dtensor(global_tensor(shape), m, Ps(src))._spec
    state = list(spec.placements)
    peak = _local_numel(shape, mesh_shape, state)
    for step in plan(spec, Ps(dst)):
        if isinstance(step.mesh_dim, tuple):  # a GroupStep changes the whole state
            state = list(step.dst)
        else:
            state[step.mesh_dim] = step.dst
        peak = max(peak, _local_numel(shape, mesh_shape, state))
    return peak


# ---------------------------------------------------------------------------------------------
# property tests
# ---------------------------------------------------------------------------------------------

_PARTIALS = ["Psum", "Pavg", "Pmax", "Pmin"]


@st.composite
def _case(draw, mesh_shape):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 7]), min_size=ndim, max_size=ndim)))
    choices = ["R", *[f"S{d}" for d in range(ndim)], *_PARTIALS]
    src = tuple(draw(st.sampled_from(choices)) for _ in mesh_shape)
    dst = tuple(draw(st.sampled_from(choices)) for _ in mesh_shape)
    seed = draw(st.integers(0, 1000))
    return (mesh_shape, shape, src, dst, seed)


# Deterministic (CI reruns see the same cases) and no shrinking: a failing case is named in the
# assertion message, and shrinking through worker-pool restarts would take minutes.
_SETTINGS = settings(
    max_examples=12,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=list(HealthCheck),
)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@_SETTINGS
@given(data=st.data())
def test_redistribute_1d_property(world, data):
    cases = data.draw(st.lists(_case((world,)), min_size=8, max_size=8))
    assert run_distributed(_check_transitions, world, cases) == [len(cases)] * world


@_SETTINGS
@given(data=st.data())
def test_redistribute_2x2_property(data):
    cases = data.draw(st.lists(_case((2, 2)), min_size=8, max_size=8))
    assert run_distributed(_check_transitions, 4, cases) == [len(cases)] * 4


def test_every_transition_exhaustive_3_ranks_uneven():
    """All pairs of R, S0, S1, Psum, Pavg, Pmax, Pmin on 3 ranks, uneven shape (7, 5)."""
    ps = ["R", "S0", "S1", "Psum", "Pavg", "Pmax", "Pmin"]
    cases = [((3,), (7, 5), (a,), (b,), 3) for a in ps for b in ps]
    assert run_distributed(_check_transitions, 3, cases) == [len(cases)] * 3


def test_every_transition_exhaustive_2x2_nested():
    """Nested sharding of one dim on both mesh dims, and swaps, on a 2x2 mesh (uneven)."""
    ps = ["R", "S0", "S1", "Psum"]
    cases = [((2, 2), (5, 3), (a, b), (c, d), 1) for a in ps for b in ps for c in ps for d in ps]
    assert run_distributed(_check_transitions, 4, cases) == [len(cases)] * 4


# ---------------------------------------------------------------------------------------------
# minimum traffic (ARCHITECTURE.md): bytes this rank sends, T = global bytes
# ---------------------------------------------------------------------------------------------

T = 8 * 16 * 4  # (8, 16) float32


@pytest.mark.parametrize(
    "src,dst,kinds,nbytes",
    [
        ("S0", "R", ["all_gather"], 3 * T // 4),  # (n-1)/n T
        ("S1", "R", ["all_gather"], 3 * T // 4),
        ("Psum", "R", ["all_reduce"], 2 * 3 * T // 4),  # 2(n-1)/n T
        ("Psum", "S0", ["reduce_scatter"], 3 * T // 4),  # (n-1)/n T
        ("Psum", "S1", ["reduce_scatter"], 3 * T // 4),
        ("S0", "S1", ["all_to_all"], 3 * T // 16),  # (n-1)/n^2 T
        ("S1", "S0", ["all_to_all"], 3 * T // 16),
        ("R", "S1", [], 0),
        ("R", "Psum", [], 0),
    ],
)
def test_minimum_traffic_4_ranks(src, dst, kinds, nbytes):
    results = run_distributed(_traffic, 4, (4,), (8, 16), (src,), (dst,))
    for records, _ in results:
        assert [k for k, _, _ in records] == kinds
        assert sum(b for _, _, b in records) == nbytes


def test_copy_passes_per_collective():
    """S(1) -> R: one all_gather and one unpack pass; S0 -> R even: no copy at all."""
    (rec, copies), *_ = run_distributed(_traffic, 2, (2,), (8, 16), ("S1",), ("R",))
    assert copies == 1
    (rec, copies), *_ = run_distributed(_traffic, 2, (2,), (8, 16), ("S0",), ("R",))
    assert copies == 0
    # uneven S0 -> R on 2 ranks (4 + 3 rows): only the short rank pads (one pass); the gathered
    # buffer is narrowed, never copied (padding sits after the data in the chunk layout)
    copies = [c for _, c in run_distributed(_traffic, 2, (2,), (7, 16), ("S0",), ("R",))]
    assert copies == [0, 1]
    # uneven S1 -> R: the short rank pads, every rank unpacks once
    copies = [c for _, c in run_distributed(_traffic, 2, (2,), (16, 7), ("S1",), ("R",))]
    assert copies == [1, 2]


def test_2x2_swap_never_materialises_full_tensor():
    shape = (8, 8)
    peaks = run_distributed(_peak_local_numel, 4, (2, 2), shape, ("S0", "S1"), ("S1", "S0"))
    assert max(peaks) <= 64 // 2  # half the tensor at most; the full tensor is 64
    results = run_distributed(_traffic, 4, (2, 2), shape, ("S0", "S1"), ("S1", "S0"))
    for records, _ in results:
        assert "all_to_all" in [k for k, _, _ in records]
        assert sum(b for _, _, b in records) < 64 * 4  # less than one full tensor moved


# ---------------------------------------------------------------------------------------------
# backward: the dual transition
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("src", ["R", "S0", "S1", "Psum", "Pavg"])
@pytest.mark.parametrize("dst", ["R", "S0", "S1", "Psum"])
def test_redistribute_backward(src, dst):
    assert all(run_distributed(_backward, 3, (3,), (5, 4), (src,), (dst,)))


def test_redistribute_backward_2x2():
    assert all(run_distributed(_backward, 4, (2, 2), (5, 6), ("S0", "S1"), ("S1", "R")))
    assert all(run_distributed(_backward, 4, (2, 2), (5, 6), ("Psum", "S0"), ("S0", "S1")))


def _mesh_group_timeouts():
    m = dtshard.init_device_mesh("cpu", (2, 2))
    return [str(m.get_group(i)._get_backend(torch.device("cpu")).options._timeout) for i in range(2)]


def test_mesh_dim_groups_inherit_the_short_timeout():
    """PyTorch would give 2-D mesh sub-groups 30 minutes; a failing rank must not block that long."""
    import os

    want = str(__import__("datetime").timedelta(seconds=float(os.environ.get("DTSHARD_TEST_PG_TIMEOUT", 30))))
    for timeouts in run_distributed(_mesh_group_timeouts, 4):
        assert timeouts == [want, want]
