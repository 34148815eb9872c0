"""The rule validator (``python -m dtshard.validate``) on deliberately wrong rules, and its parts.

Two custom ops (``torch.library``) get rules that are wrong in the two ways the planner's
local-shape check cannot see: ``square`` claims ``Partial(sum) -> Partial(sum)`` (x*x is not
linear), ``every_other`` (``x[::2]``) claims ``Shard(0) -> Shard(0)``, which is right for even
shards of an even count of rows and wrong for uneven ones, with local shapes that fit either way
(PyTorch's validator skips uneven layouts, so it cannot see this one).  The validator must report
both, with reproductions that fail when run, and pass the right strategies of the same rules.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

import dtshard
from dtshard.registry import override
from dtshard.validate import Sample, SampleSource, repro, simulate_op, validate_op
from dtshard.validate.__main__ import main
from dtshard.validate.simulate import assemble, local_input

NS = "dtshard_validate_test"


@torch.library.custom_op(f"{NS}::square", mutates_args=())
def square(x: torch.Tensor) -> torch.Tensor:
    return x * x


@square.register_fake
def _square_fake(x):
    return torch.empty_like(x)


@torch.library.custom_op(f"{NS}::every_other", mutates_args=())
def every_other(x: torch.Tensor) -> torch.Tensor:
    return x[::2].clone()


@every_other.register_fake
def _every_other_fake(x):
    return x.new_empty(((x.shape[0] + 1) // 2, *x.shape[1:]))


SQUARE = torch.ops.dtshard_validate_test.square.default
EVERY_OTHER = torch.ops.dtshard_validate_test.every_other.default


def square_rule(call):
    """Shard(d) -> Shard(d) is right; Partial(sum) -> Partial(sum) is WRONG (not linear)."""
    ndim = call.tensors[0].ndim
    return [((Shard(d),), (Shard(d),)) for d in range(ndim)] + [((Partial("sum"),), (Partial("sum"),))]


def every_other_rule(call):
    """WRONG on uneven shards: each rank keeps every other row of ITS chunk."""
    return [((Shard(0),), (Shard(0),))]


class Samples:
    """A sample source of given tensors (``validate_op`` asks it for ``samples(op)``)."""

    def __init__(self, *shapes):
        gen = torch.Generator().manual_seed(0)
        self.list = [Sample((torch.randn(s, generator=gen),), {}, f"test {s}") for s in shapes]

    def with_sample(self, args):
        self.list.append(Sample(tuple(args), {}, "test given"))
        return self

    def samples(self, op):
        return self.list


def test_a_wrong_partial_claim_is_reported_with_a_failing_reproduction():
    with override(SQUARE, square_rule):
        report = validate_op(SQUARE, Samples((6, 4)), [(2,), (2, 2)], strided=True)
    wrong = {(f.mesh_shape, f.ins, f.outs) for f in report.incorrect}
    assert ((2,), ((Partial("sum"),),), ((Partial("sum"),),)) in wrong
    # every incorrect one holds a Partial input; the Shard strategies (strided ones too) are right
    assert all(any(isinstance(p, Partial) for p in f.ins[0]) for f in report.incorrect)
    assert report.correct > 0 and report.claimed == report.correct + len(report.incorrect) + report.rejected
    script = repro(report.incorrect[0])
    assert "simulate_op" in script and "Partial('sum')" in script
    with pytest.raises(AssertionError):
        exec(compile(script, "<repro>", "exec"), {})


def test_an_uneven_shard_mislabel_is_reported_and_even_shards_pass():
    with override(EVERY_OTHER, every_other_rule):
        even = validate_op(EVERY_OTHER, Samples((8, 3)), [(2,), (2, 2)])
        uneven = validate_op(EVERY_OTHER, Samples((5, 3)), [(2,)])
    assert even.incorrect == [] and even.correct > 0   # what an even-shards-only validator sees
    (f,) = uneven.incorrect
    assert f.ins == ((Shard(0),),) and f.outs == ((Shard(0),),) and f.mesh_shape == (2,)
    assert "(5, 3)" in f.text() and "S(0)" in f.text() and "values differ" in f.why
    with pytest.raises(AssertionError):
        exec(compile(repro(f), "<repro>", "exec"), {})


def test_the_command_exits_1_and_prints_the_reproduction():
    out = io.StringIO()
    with override(EVERY_OTHER, every_other_rule), override(SQUARE, square_rule), contextlib.redirect_stdout(out):
        status = main(["--op", f"{NS}.every_other.default,{NS}.square.default", "--mesh", "2,3",
                       "--repro", "1", "--no-missing"])
    text = out.getvalue()
    assert status == 1
    assert "INCORRECT dtshard_validate_test.every_other.default on mesh (2,)" in text
    assert "INCORRECT dtshard_validate_test.square.default on mesh (2,)" in text
    assert text.count("--- reproduction ---") == 2
    assert "incorrect: " in text and "strategies checked: " in text


def square_rule_fixed(call):
    """The right rule: shards only (Partial inputs are reduced first)."""
    return [((Shard(d),), (Shard(d),)) for d in range(call.tensors[0].ndim)]


def test_a_correct_rule_passes_the_command():
    out = io.StringIO()
    with override(SQUARE, square_rule_fixed), contextlib.redirect_stdout(out):
        status = main(["--op", f"{NS}.square.default", "--mesh", "2,3,2x2", "--strided"])
    assert status == 0, out.getvalue()
    assert "incorrect   0" in out.getvalue() and "INCORRECT" not in out.getvalue()


# ---------------------------------------------------------------------------------------------
# "missing" hints: only what holds beyond the one sample
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{NS}::scaled", mutates_args=())
def scaled(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * w


@scaled.register_fake
def _scaled_fake(x, w):
    return torch.empty_like(x)


SCALED = torch.ops.dtshard_validate_test.scaled.default


def shard0_only_rule(call):
    """Right but incomplete: Shard(0) only, for every tensor argument."""
    return [((Shard(0),), tuple(Shard(0) for _ in call.tensors))]  # (outputs, inputs)


def _hints(report) -> set:
    from dtshard.spec import placement_str  # 1-D meshes: one placement per tensor

    return {(" ".join(placement_str(p) for (p,) in f.ins), " ".join(placement_str(p) for (p,) in f.outs))
            for f in report.missing}


def test_missing_hints_hold_beyond_the_one_sample():
    """x * x on an all-negative sample maps Partial(max) terms to Partial(min) ones (the squares of
    terms below a negative value are larger); x * w with w > 0 keeps Partial(max). Neither holds in
    general, and neither may be suggested; the real hints (another shard dim, x * w linear in
    each argument) still are."""
    gen = torch.Generator().manual_seed(3)
    neg = -(torch.rand(6, 4, generator=gen) + 0.5)
    # the coincidence: on this sample alone, P(max) -> P(min) forms x * x
    got = simulate_op(SQUARE, (neg,), {}, (2,), [(Partial("max"),)], [(Partial("min"),)])[0]
    torch.testing.assert_close(got, neg * neg)
    with override(SQUARE, shard0_only_rule):
        square_report = validate_op(SQUARE, Samples((5, 3)).with_sample((neg,)), [(2,)])
    assert _hints(square_report) == {("S(1)", "S(1)")}, square_report.missing
    assert "drawn to break it" in square_report.missing[0].why

    x, w = torch.randn(6, 4, generator=gen), torch.rand(6, 4, generator=gen) + 0.5
    assert torch.equal(simulate_op(SCALED, (x, w), {}, (2,), [(Partial("max"),), (_R := Replicate(),)],
                                   [(Partial("max"),)])[0], x * w)  # the coincidence of w > 0
    with override(SCALED, shard0_only_rule):
        scaled_report = validate_op(SCALED, Samples().with_sample((x, w)), [(2,)])
    hints = _hints(scaled_report)
    assert {("P(sum) R", "P(sum)"), ("R P(sum)", "P(sum)"), ("S(1) S(1)", "S(1)")} <= hints, hints
    assert not [h for h in hints if "P(max)" in h[0] or "P(min)" in h[0]], hints
    assert scaled_report.incorrect == []

    # a 0-d input (one square of every checkerboard): on v = 0.7 the sample's terms (v - 1 for max,
    # v + 1 for min) make abs look monotone, P(max) -> P(max) and P(min) -> P(min); a negative v with
    # terms just past it shows it is not
    v = torch.tensor(0.7)
    assert torch.equal(simulate_op(torch.ops.aten.abs.default, (v,), {}, (2,), [(Partial("min"),)],
                                   [(Partial("min"),)])[0], v.abs())
    abs_report = validate_op(torch.ops.aten.abs.default, Samples().with_sample((v,)), [(2,)])
    assert _hints(abs_report) == set() and abs_report.incorrect == [], abs_report.missing


def test_ops_are_named_as_torch_library_names_them(tmp_path, monkeypatch):
    """``--op ns::name`` and ``ns::name.overload`` (torch.library's names) next to ``ns.name``;
    ``--import`` loads the module that defines a custom op; an unknown op says what to do."""
    from dtshard.validate.__main__ import _ops

    for name in (f"{NS}::square", f"{NS}::square.default", f"{NS}.square.default", f"torch.ops.{NS}.square"):
        assert _ops(name) == [SQUARE], name
    assert _ops("aten::add.Tensor") == _ops("aten.add.Tensor") == _ops("add.Tensor") == [torch.ops.aten.add.Tensor]
    out = io.StringIO()
    with override(SQUARE, square_rule_fixed), contextlib.redirect_stdout(out):
        assert main(["--op", f"{NS}::square", "--mesh", "2", "--no-missing"]) == 0
    assert "dtshard_validate_test.square.default" in out.getvalue() and "correct" in out.getvalue()

    (tmp_path / "dtshard_validate_test_mylib.py").write_text(
        "import torch\n"
        "@torch.library.custom_op('dtshard_validate_test_mylib::my_op', mutates_args=())\n"
        "def my_op(x: torch.Tensor) -> torch.Tensor:\n"
        "    return x + 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit, match=r"no op 'dtshard_validate_test_mylib::my_op'.*--import MODULE"):
        main(["--op", "dtshard_validate_test_mylib::my_op", "--mesh", "2"])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["--import", "dtshard_validate_test_mylib", "--op", "dtshard_validate_test_mylib::my_op",
                       "--mesh", "2"])
    assert status == 0 and "dtshard_validate_test_mylib.my_op.default" in out.getvalue() and "no rule" in out.getvalue()
    with pytest.raises(SystemExit, match=r"has no overload 'nope'"):
        main(["--op", f"{NS}::square.nope", "--mesh", "2"])


@pytest.mark.parametrize("placements", [
    (Shard(0), Partial("sum")), (Partial("max"), Shard(1)), (Partial("min"), Partial("min")),
    (_StridedShard(0, split_factor=2), Replicate()), (Partial("avg"), Partial("product")),
])
def test_local_inputs_reassemble_to_the_global_tensor(placements):
    """Cutting a tensor into the ranks' local inputs and assembling them is the identity, for
    uneven, strided and Partial layouts (the ground the validator stands on)."""
    mesh = (2, 3)
    if any(isinstance(p, Partial) and p.reduce_op == "product" for p in placements):
        placements = (Partial("product"), Partial("product"))  # product does not mix with others
    x = torch.randn(5, 7, generator=torch.Generator().manual_seed(1))
    locals_ = {(a, b): local_input(x, placements, mesh, (a, b)) for a in range(2) for b in range(3)}
    got, why = assemble(locals_, x.shape, placements, mesh, lambda a, b: "")
    assert why == ""
    torch.testing.assert_close(got, x)


def test_partial_terms_are_not_the_value_itself():
    """Each Partial(sum) term differs from its share of the value in sign somewhere, so that
    abs(P) -> P cannot pass."""
    x = torch.rand(4, 5) + 1  # all positive
    terms = [local_input(x, (Partial("sum"),), (2,), (c,)) for c in range(2)]
    torch.testing.assert_close(terms[0] + terms[1], x)
    assert (terms[0] < 0).any() and (terms[1] < 0).any()
    got = simulate_op(torch.ops.aten.abs.default, (x,), {}, (2,), [(Partial("sum"),)], [(Partial("sum"),)])[0]
    assert not torch.allclose(got, x.abs())


# ---------------------------------------------------------------------------------------------
# every registered rule, on the suite's sampled configuration
# ---------------------------------------------------------------------------------------------

#: a 2-D mesh (OpInfo's sizes of 5 and 10 make uneven shards on it), strided shards, the ops the
#: samples' backward runs; one sample per op and at most SUITE_CHOICES of its planner choices (the
#: strided ones first, the rest evenly spread): ``python -m dtshard.validate --all`` checks them all
SUITE_MESHES = [(2, 2)]
SUITE_CHOICES = 6
GROUPS = 4
RULES = sorted((op for op in dtshard.registry.registered_ops() if dtshard.registry.get_entry(op).kind == "rule"),
               key=str)


@pytest.fixture(scope="module")
def opinfo_samples():
    source = SampleSource(per_op=1, backward=True)
    source.capture()
    return source


@pytest.mark.parametrize("group", range(GROUPS))
def test_every_registered_rule_claims_only_correct_strategies(opinfo_samples, group):
    reports = [validate_op(op, opinfo_samples, SUITE_MESHES, uneven=True, strided=True, missing=False,
                           max_choices=SUITE_CHOICES) for op in RULES[group::GROUPS]]
    assert [f.text() for r in reports for f in r.incorrect] == []
    assert [r.line() for r in reports if r.note.startswith("VALIDATOR ERROR")] == []
    checked = sum(r.correct for r in reports)
    assert checked > 5 * len(reports) // 2, "too few strategies ran: is the sample source broken?"
