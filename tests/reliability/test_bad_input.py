"""Bad input: the same clear error on every rank, and the process group stays usable.

Each case runs on 2 ranks, returns the error message it got on each rank, then proves the process
group still works with one more collective (an all_reduce must return the world size).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

import dtshard
from dtshard import Partial, Replicate, Shard
from dtshard.testing import DistributedTestError, launch, run_distributed


_MESH = {}


def _mesh():
    """One mesh per process (a second init_device_mesh call makes a different mesh)."""
    if "m" not in _MESH:
        _MESH["m"] = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    return _MESH["m"]


def _dt(shape=(4, 3), placements=(Shard(0),)):
    return dtshard.distribute_tensor(torch.arange(float(torch.Size(shape).numel())).view(shape), _mesh(), list(placements))


# each case: a function that must raise; the expected exception type; phrases the message must hold


def _shard_dim_out_of_range():
    dtshard.distribute_tensor(torch.ones(4, 3), _mesh(), [Shard(2)])


def _wrong_number_of_placements():
    dtshard.distribute_tensor(torch.ones(4, 3), _mesh(), [Shard(0), Replicate()])


def _mesh_mismatch():
    a = _dt()
    # another mesh: other dim names (a second init_device_mesh with the same layout and names is
    # the same mesh, as in PyTorch: issue #54 item 1)
    other = dtshard.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("other",))
    b = dtshard.distribute_tensor(torch.ones(4, 3), other, [Shard(0)])
    a + b


def _global_shape_mismatch():
    # every rank holds 2 rows, but shape= claims 7 rows (4 + 3 on 2 ranks): each rank's own
    # check fails (without run_check the check is local: see README, from_local contract)
    dtshard.DTensor.from_local(torch.ones(2, 3), _mesh(), [Shard(0)], shape=(7, 3))


def _from_local_ranks_disagree():
    rows = 2 if dist.get_rank() == 0 else 3
    dtshard.DTensor.from_local(torch.ones(rows, 3), _mesh(), [Shard(0)], shape=(4, 3), run_check=True)


def _from_local_dtype_disagrees():
    dtype = torch.float32 if dist.get_rank() == 0 else torch.float64
    dtshard.DTensor.from_local(torch.ones(2, 3, dtype=dtype), _mesh(), [Shard(0)], run_check=True)


def _redistribute_illegal_placement():
    _dt().redistribute(_mesh(), [Partial("band")])  # a bitwise partial: dtshard does not reduce those


def _redistribute_dim_out_of_range():
    _dt().redistribute(_dt().device_mesh, [Shard(5)])


def _redistribute_to_other_mesh():
    a = _dt()
    # another mesh: the same ranks under another dim name (an equal mesh, same ranks, layout and
    # names, is the same mesh, as in PyTorch: issue #54 item 1)
    a.redistribute(dtshard.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("other",)), [Replicate()])


def _op_without_rule():
    torch.ops.aten.unfold_copy(_dt(), 1, 2, 1)


def _raw_collective_on_a_dtensor():
    dist.all_reduce(_dt())


def _rule_returns_wrong_arity():
    with dtshard.override(torch.ops.aten.mm.default, lambda call: [((Shard(0),), (Shard(0),))]):
        _dt() @ _dt((3, 2), (Replicate(),))


def _rule_returns_bad_dim():
    with dtshard.override(torch.ops.aten.mm.default, lambda call: [((Shard(2),), (Shard(0), Replicate()))]):
        _dt() @ _dt((3, 2), (Replicate(),))


def _rule_returns_non_placement():
    with dtshard.override(torch.ops.aten.mm.default, lambda call: [(("S0",), (Shard(0), Replicate()))]):
        _dt() @ _dt((3, 2), (Replicate(),))


def _rule_raises():
    def broken(call):
        raise KeyError("oops")

    with dtshard.override(torch.ops.aten.mm.default, broken):
        _dt() @ _dt((3, 2), (Replicate(),))


def _mixing_plain_tensor():
    _dt() * torch.ones(4, 3)


def _inplace_changes_placement():
    p = dtshard.DTensor.from_local(torch.ones(2, 3), _mesh(), [Partial()])
    p.exp_()


def _incompatible_global_shapes():
    _dt((4, 3)) + _dt((5, 3))


def _distribute_a_dtensor():
    dtshard.distribute_tensor(_dt(), _mesh(), [Replicate()])


def _from_local_of_a_dtensor():
    # silently built a DTensor nested in a DTensor, of global shape (8, 3)
    dtshard.DTensor.from_local(_dt(), _mesh(), [Shard(0)])


def _torch_dtensor():
    import torch.distributed.tensor as tdt

    return tdt.distribute_tensor(torch.ones(4, 3), _mesh(), [Shard(0)])


def _from_local_of_a_torch_dtensor():
    dtshard.DTensor.from_local(_torch_dtensor(), _mesh(), [Shard(0)])


def _distribute_a_torch_dtensor():
    dtshard.distribute_tensor(_torch_dtensor(), _mesh(), [Replicate()])


def _src_rank_not_in_mesh():
    dtshard.distribute_tensor(torch.ones(4), _mesh(), [Shard(0)], src_data_rank=17)


def _unsupported_partial_in_from_local():
    dtshard.DTensor.from_local(torch.ones(2), _mesh(), [Partial("bxor")])


CASES = {
    "shard dim out of range": (_shard_dim_out_of_range, ValueError, ["Shard(2)", "2-D tensor"]),
    "wrong number of placements": (_wrong_number_of_placements, ValueError, ["2 placements", "1-D mesh"]),
    "mesh mismatch": (_mesh_mismatch, ValueError, ["aten.add.Tensor", "different meshes", "(4, 3)"]),
    "global shape vs local": (_global_shape_mismatch, ValueError, ["(2, 3)", "(7, 3)", "S(0)", "shape="]),
    "ranks disagree (run_check)": (_from_local_ranks_disagree, ValueError, ["rank 0", "rank 1", "(4, 3)"]),
    "dtype disagrees (run_check)": (_from_local_dtype_disagrees, ValueError, ["torch.float64", "rank 0", "rank 1"]),
    "illegal target placement": (_redistribute_illegal_placement, ValueError, ["'band'", "not supported", "'product'"]),
    "target dim out of range": (_redistribute_dim_out_of_range, ValueError, ["Shard(5)", "2-D tensor"]),
    "redistribute to another mesh": (_redistribute_to_other_mesh, ValueError, ["another mesh"]),
    "op without a rule": (_op_without_rule, NotImplementedError, ["aten.unfold_copy.default", "(4, 3) (S(0))", "dtshard/rules/"]),
    "raw collective on a DTensor": (_raw_collective_on_a_dtensor, NotImplementedError,
                                    ["c10d.allreduce_.default", "(4, 3) (S(0))", "x.to_local()", "redistribute"]),
    "rule: wrong arity": (_rule_returns_wrong_arity, dtshard.RuleError, ["aten.mm.default", "1 input", "2 DTensor inputs"]),
    "rule: bad shard dim": (_rule_returns_bad_dim, dtshard.RuleError, ["Shard(2)", "2-D tensor"]),
    "rule: not a placement": (_rule_returns_non_placement, dtshard.RuleError, ["'S0'", "not a placement"]),
    "rule raises": (_rule_raises, dtshard.RuleError, ["aten.mm.default", "KeyError", "oops"]),
    "mixing plain tensor": (_mixing_plain_tensor, RuntimeError, ["plain torch.Tensor of shape (4, 3)", "distribute_tensor"]),
    "in-place would change placement": (_inplace_changes_placement, RuntimeError, ["aten.exp_.default", "in-place"]),
    "incompatible global shapes": (_incompatible_global_shapes, RuntimeError, ["aten.add.Tensor", "(4, 3)", "(5, 3)"]),
    "distribute a DTensor": (_distribute_a_dtensor, ValueError, ["already a DTensor", "redistribute"]),
    "from_local of a DTensor": (_from_local_of_a_dtensor, ValueError,
                                ["DTensor.from_local", "already a DTensor", "(4, 3)", "S(0)", "to_local()", "redistribute"]),
    "from_local of a torch DTensor": (_from_local_of_a_torch_dtensor, ValueError,
                                      ["torch.distributed.tensor.DTensor", "DTensor.from_torch", "to_local()"]),
    "distribute a torch DTensor": (_distribute_a_torch_dtensor, ValueError,
                                   ["distribute_tensor", "torch.distributed.tensor.DTensor", "(4, 3)", "DTensor.from_torch"]),
    "src_data_rank not in mesh": (_src_rank_not_in_mesh, ValueError, ["src_data_rank=17"]),
    "unsupported Partial op": (_unsupported_partial_in_from_local, ValueError, ["bxor", "Partial('sum')"]),
}


def _run_case(name):
    fn, exc_type, _ = CASES[name]
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the type is checked by the test
        got = (type(e).__name__, isinstance(e, exc_type), str(e))
    else:
        got = ("no error", False, "")
    t = torch.ones(1)
    dist.all_reduce(t)  # the process group still works after the error
    return got, t.item()


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gives_the_same_clear_error_on_every_rank(name):
    _, exc_type, phrases = CASES[name]
    results = run_distributed(_run_case, 2, name)
    messages = [got for got, _ in results]
    for (type_name, is_expected, msg), after in results:
        assert is_expected, f"{name}: expected {exc_type.__name__}, got {type_name}: {msg}"
        for phrase in phrases:
            assert phrase in msg, f"{name}: {phrase!r} not in {msg!r}"
        assert after == 2.0
    if name != "global shape vs local":  # a local check: each rank reports its own shard
        assert messages[0][2] == messages[1][2], f"{name}: ranks got different messages"


# ---------------------------------------------------------------------------------------------
# valid but unusual input works
# ---------------------------------------------------------------------------------------------


def _noncontiguous_and_empty_locals():
    mesh = _mesh()
    r = dist.get_rank()
    full = torch.arange(24.0).view(4, 6)
    local_t = full[2 * r : 2 * r + 2].t().contiguous().t()  # a non-contiguous local shard
    assert not local_t.is_contiguous()
    d = dtshard.DTensor.from_local(local_t, mesh, [Shard(0)])
    ok1 = torch.equal(d.full_tensor(), full) and torch.equal((d * 2).full_tensor(), full * 2)
    # 1 row on 2 ranks: rank 1's shard is empty
    e = dtshard.distribute_tensor(torch.arange(3.0).view(1, 3), mesh, [Shard(0)])
    ok2 = tuple(e.to_local().shape) == ((1, 3) if r == 0 else (0, 3))
    ok3 = torch.equal((e + 1).sum(0).full_tensor(), torch.tensor([1.0, 2, 3]))
    return ok1 and ok2 and ok3


def test_noncontiguous_and_zero_size_locals_work():
    assert all(run_distributed(_noncontiguous_and_empty_locals, 2))


# ---------------------------------------------------------------------------------------------
# no hangs: a rank that fails mid-step ends the others by the process-group timeout
# ---------------------------------------------------------------------------------------------


def _fail_mid_step():
    mesh = _mesh()
    a = dtshard.distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
    if dist.get_rank() == 1:
        raise RuntimeError("data-dependent failure on rank 1 only")
    return a.full_tensor()  # rank 0 waits in an all_gather rank 1 never joins


def test_rank_failing_mid_step_ends_the_others_within_the_timeout(monkeypatch):
    # a long grace so the harness does not kill rank 0 first: rank 0 must end by itself
    monkeypatch.setenv("DTSHARD_TEST_FAILURE_GRACE", "30")
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        launch(_fail_mid_step, 2, timeout=60, pg_timeout=5)
    elapsed = time.monotonic() - start
    msg = str(info.value)
    assert "data-dependent failure on rank 1 only" in msg
    assert "rank 0" in msg and ("Timed out" in msg or "timed out" in msg or "closed" in msg.lower()), msg
    assert elapsed < 45, f"took {elapsed:.0f} s"
