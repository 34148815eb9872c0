"""The OpInfo sweep's own comparison, checked: a result with a few corrupted elements must be
called wrong, whatever the op and whatever the range of its values.

The sweep's verdict "0 silently wrong" is only as strong as ``_values_close``: a tolerance that
grew with the output's largest value once let a ``pow`` sample pass with 149 of its 250 elements
sign-flipped. Here, for the ops of every OpInfo class the sweep covers, the plain reference result
of the sweep's first sample gets a few of its *smallest* elements that the tolerance can see
sign-flipped (the ones a magnitude-scaled tolerance would hide), and the comparison must fail;
the unchanged result must pass.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import _opinfo_sweep as S  # noqa: E402

#: ops per OpInfo class (the first ones of op_db with a float result), plus the two the issue
#: found passing with corrupted values under the old tolerance
PER_CLASS = 4
NAMED = ("pow", "special.erfcx", "linalg.householder_product", "cumprod", "exp")


def _float_result(key):
    """The plain result of the op's first sample (in the sweep's order) with a float output of
    4+ finite elements, or None."""
    op = S._op_db()[key]
    try:
        samples = S._samples(op, key)
    except Exception:  # noqa: BLE001
        return None
    for i in S.pick_samples(samples, len(samples)):
        sample = samples[i]
        try:
            with torch.no_grad():
                out = op.op(sample.input, *sample.args, **sample.kwargs)
        except Exception:  # noqa: BLE001 - samples plain PyTorch cannot run are not compared
            continue
        for t in S._flat(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.dtype in (
                    torch.float32, torch.float64) and int(torch.isfinite(t).sum()) >= 4:
                return t.detach().clone()
    return None


def _corrupt(ref: torch.Tensor, key: str, k: int = 3):
    """``ref`` with the sign of its ``k`` smallest elements flipped among those whose flip the
    dtype's tolerance can see (None when no element is large enough)."""
    rtol, atol = S._tolerance(ref.dtype)
    flat = ref.flatten()
    visible = (torch.isfinite(flat) & (2 * flat.abs() > 4 * (atol + rtol * flat.abs()))).nonzero().flatten()
    if visible.numel() == 0:
        return None
    order = flat[visible].abs().argsort()
    pick = visible[order[:k]]
    bad = flat.clone()
    bad[pick] = -bad[pick]
    return bad.reshape(ref.shape)


def _chosen_ops():
    by_class: dict[str, list[str]] = {}
    for key, op in S._op_db().items():
        by_class.setdefault(type(op).__name__, []).append(key)
    chosen = {}
    for cls, keys in sorted(by_class.items()):
        n = 0
        for key in keys:
            if n >= PER_CLASS:
                break
            ref = _float_result(key)
            if ref is not None and _corrupt(ref, key) is not None:
                chosen[key] = (cls, ref)
                n += 1
    for key in NAMED:
        ref = _float_result(key)
        assert ref is not None and _corrupt(ref, key) is not None, f"{key}: no float sample to corrupt"
        chosen[key] = (type(S._op_db()[key]).__name__, ref)
    return chosen


@pytest.fixture(scope="module")
def chosen():
    return _chosen_ops()


def test_every_class_is_covered(chosen):
    classes = {type(op).__name__ for op in S._op_db().values()}
    missing = classes - {cls for cls, _ in chosen.values()}
    # a class none of whose ops has a float result with 4+ finite elements has nothing to corrupt
    assert missing <= {"ForeachFuncInfo"}, f"OpInfo classes with no op checked: {sorted(missing)}"


def test_corrupted_results_are_wrong(chosen):
    passed = []
    for key, (cls, ref) in chosen.items():
        assert S._values_close(ref.clone(), ref) == "", f"{key}: the unchanged result must pass"
        bad = _corrupt(ref, key)
        if S._values_close(bad, ref) == "":
            passed.append(f"{key} ({cls})")
    assert not passed, "corrupted results the sweep would call right: " + ", ".join(passed)


def test_one_wrong_small_element_among_large_ones_is_wrong():
    """The case the magnitude-scaled tolerance missed: values up to 1e4, one element of 0.5
    sign-flipped."""
    ref = torch.tensor([1e4, -3e3, 0.5, 2.0, 7e2])
    bad = ref.clone()
    bad[2] = -0.5
    assert S._values_close(bad, ref) != ""
    assert S._values_close(ref + 1e-4 * ref.abs() * 0.5, ref) == ""  # rounding-sized: fine


def test_same_is_false_when_the_comparison_cannot_be_made():
    class Odd:
        def __eq__(self, other):
            raise RuntimeError("cannot compare")

    assert S._same(Odd(), Odd()) is False
    assert S._same(torch.ones(2, dtype=torch.complex32), torch.ones(2, dtype=torch.complex32))
    assert not S._same(torch.ones(2, dtype=torch.complex32), torch.zeros(2, dtype=torch.complex32))
    sp = torch.eye(3).to_sparse()
    assert S._same(sp, sp.clone()) and not S._same(sp, (2 * torch.eye(3)).to_sparse())


def test_known_failures_are_clear_errors():
    """Every recorded failure is a clear dtshard error or a documented limit (CLEAR_ERRORS), and
    every recorded skip says why."""
    import json

    with open(os.path.join(os.path.dirname(__file__), "known_failures.json")) as f:
        known = json.load(f)
    for name, entry in known["meshes"].items():
        unclear = S.unclear_failures(entry["failures"])
        assert not unclear, f"mesh {name}: failures that are not clear errors: " + ", ".join(
            f"{k}: {v['reason'][:100]}" for k, v in sorted(unclear.items())[:10])
        for key, why in entry["skips"].items():
            assert why.startswith(("no tensor arguments", "sparse input", "plain PyTorch")), (
                f"mesh {name} {key}: a skip must be one of the accepted kinds, got {why!r}")


def test_rescues_are_reported_and_only_named_ops_may_have_one():
    """A float64 rescue is float32 rounding, which depends on the CPU: one the recorded list does
    not hold is reported (a note naming both verdicts), not a failure; a rescue of an op outside
    ``FLOAT64_RESCUE`` is a failure whatever the list says."""
    rescue = {"float32": ["grad0: wrong value"], "float64": "pass", "why": "test"}
    named = next(iter(S.FLOAT64_RESCUE))
    cases = [(named, 2, "T0|R"), ("add", 0, "R|R")]
    passed = {"fwd": "pass", "fwd_reason": "", "bwd": "pass", "bwd_reason": ""}
    entry = {"failures": {}, "skips": {}, "rescues": {}}
    records = [dict(passed, rescue=rescue), dict(passed)]
    assert S.compare_with_known(cases, records, entry) == []
    notes = S.rescue_notes(cases, records, entry)
    assert len(notes) == 1 and f"{named}|s2|T0|R" in notes[0] and "float64 pass" in notes[0], notes
    # a recorded rescue that passes outright on this CPU: a note, no failure
    entry_with = dict(entry, rescues={f"{named}|s2|T0|R": rescue})
    assert S.compare_with_known(cases, [dict(passed), dict(passed)], entry_with) == []
    assert "passes in float32" in S.rescue_notes(cases, [dict(passed), dict(passed)], entry_with)[0]
    # a rescue of an op FLOAT64_RESCUE does not name fails, even when recorded
    stray = [dict(passed), dict(passed, rescue=rescue)]
    entry_stray = dict(entry, rescues={"add|s0|R|R": rescue})
    lines = S.compare_with_known(cases, stray, entry_stray)
    assert lines and "not in FLOAT64_RESCUE" in lines[0] and "add|s0|R|R" in lines[1], lines
