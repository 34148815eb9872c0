"""Validate one op's rule: every strategy it claims, against the op on the global inputs.

For each sample and mesh, :func:`validate_op` asks the planner for every choice it would consider
(``propagate.strategy_choices``: the rule's strategies expanded over the mesh dims exactly as the
planner expands them; with ``strided``, also the strided variants the planner carries them over
to) and sorts each one, the all-Replicate choice aside, into

- **rejected**: the planner's own local check (``propagate.planner_accepts``) discards it, so it is
  never run (a strategy that only fits even shards lands here on uneven ones);
- **correct**: on simulated ranks (:mod:`dtshard.validate.simulate`) the local outputs form, under
  the claimed output placements, the op's result on the global inputs;
- **incorrect**: they do not, or some rank raises, also when re-run in float64 (a float32
  difference that vanishes in float64 is rounding, and counts as correct);
- **skipped**: uneven layouts with ``uneven=False``; Partial terms that cannot be built (a
  Partial(sum) of booleans).

**Missing** strategies are searched apart, on the first 1-D mesh, for samples of at most three
inputs, all non-empty floating tensors (see :func:`_searchable`): every input combination of Replicate,
non-trivial Shard and Partial(sum / max / min) whose local results form the global result under
some output placement the rule does not claim.  One sample proves little (``x * x`` maps
Partial(max) terms to Partial(min) ones whenever every term is negative), so a combination valid
on the sample is reported only when it also holds on every one of :func:`_challenges`: the sample
with its signs mixed, negated (each input alone too), made positive, with zeros, with Partial
max/min terms that tie with or sit just past the value, and on a 1-D mesh of one rank more
(uneven shards; left out where that mesh would leave a rank an empty shard, on which many kernels
raise and which the planner rejects anyway).  What survives is still a hint (checked on samples, not proved), never counted
as incorrect.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from dtshard.propagate import flatten_outputs, lookup, planner_accepts, strategy_choices, tensor_slot
from dtshard.spec import DTensorSpec, contiguous_strides, local_shape, placements_str
from dtshard.validate.samples import Sample, SampleSource
from dtshard.validate.simulate import SimMesh, Unbuildable, assemble, run_ranks

__all__ = ["Finding", "OpReport", "TOLERANCE", "compare", "float64_sample", "sample_tensors", "simulate_op",
           "validate_op"]

#: (rtol, atol) per dtype for a claimed strategy's result against the op's; a float32 miss is
#: re-run in float64, where the float64 tolerance decides
TOLERANCE = {torch.float16: (1e-2, 1e-2), torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-4, 1e-4),
             torch.float64: (1e-7, 1e-7)}
#: the missing-strategy search looks at most at this many input combinations per sample
MISSING_CAP = 64
_R = Replicate()


@dataclass
class Finding:
    """One claimed strategy that is incorrect, or one valid combination that is not claimed."""

    op: object
    mesh_shape: tuple
    ins: tuple
    outs: tuple
    why: str
    sample: Sample

    def text(self) -> str:
        """One line: the op, the mesh, the global shapes, the strategy (inputs -> outputs) and why it failed or is missing."""
        shapes = [tuple(t.shape) for t in sample_tensors(self.sample)]
        return (f"{self.op} on mesh {self.mesh_shape}, global shapes {shapes}: "
                f"{' '.join(placements_str(p) for p in self.ins)} -> "
                f"{' '.join(placements_str(p) for p in self.outs)}: {self.why} [{self.sample.source}]")


@dataclass
class OpReport:
    """What the validator found for one op (one report line, see :func:`line`)."""

    op: object
    served: str  # "rule" | "handler" | "none"
    claimed: int = 0
    correct: int = 0
    rejected: int = 0
    skipped: int = 0
    incorrect: list = field(default_factory=list)
    missing: list = field(default_factory=list)
    samples: int = 0
    seconds: float = 0.0
    note: str = ""
    unplannable: str = ""  # why the planner cannot plan the op on a sample (the op's own limit)

    def line(self) -> str:
        """The op's line of the report: choices claimed, correct, incorrect, rejected, skipped, missing, samples, seconds."""
        if self.note:
            return f"{str(self.op):48s} {self.note}"
        return (f"{str(self.op):48s} claimed {self.claimed:5d}  correct {self.correct:5d}  "
                f"incorrect {len(self.incorrect):3d}  rejected {self.rejected:4d}  skipped {self.skipped:4d}  "
                f"missing {len(self.missing):3d}  samples {self.samples}  {self.seconds:6.2f}s")


def sample_tensors(sample: Sample) -> list:
    """The sample's tensors, flattened in argument order (the planner's order)."""
    out = []

    def walk(a):
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                walk(b)

    walk(list(sample.args))
    walk(list(sample.kwargs.values()))
    return out


def _slots(sample: Sample):
    """The sample's arguments with the k-th tensor replaced by the planner's slot marker k."""
    counter = itertools.count()

    def conv(a):
        if isinstance(a, torch.Tensor):
            return tensor_slot(next(counter))
        if isinstance(a, (list, tuple)):
            return type(a)(conv(b) for b in a)
        return a

    return [conv(a) for a in sample.args], {k: conv(v) for k, v in sample.kwargs.items()}


def _spec(mesh, placements, t) -> DTensorSpec:
    shape = tuple(t.shape)
    return DTensorSpec(mesh, tuple(placements), shape, contiguous_strides(shape), t.dtype)


def _same(dtype):
    real = {torch.complex64: torch.float32, torch.complex128: torch.float64, torch.complex32: torch.float16}
    rtol, atol = TOLERANCE.get(real.get(dtype, dtype), (0.0, 0.0))

    def same(got: torch.Tensor, want: torch.Tensor) -> str:
        if got.dtype != want.dtype:
            return f"dtype {got.dtype}, expected {want.dtype}"
        if tuple(got.shape) != tuple(want.shape):
            return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
        if torch.equal(got, want):
            return ""
        if got.is_floating_point() or got.is_complex():
            a, b = (got.double(), want.double()) if got.is_floating_point() else (got.cdouble(), want.cdouble())
            close = torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
            if bool(close.all()):
                return ""
            err = (a - b).abs().nan_to_num(nan=math.inf)[~close].max().item()
            return f"{int((~close).sum())} of {close.numel()} values differ (max abs error {err:.3g})"
        return f"{int((got != want).sum())} of {got.numel()} values differ"

    return same


def compare(got: torch.Tensor, want: torch.Tensor) -> str:
    """"" when ``got`` matches ``want`` within :data:`TOLERANCE`, else how they differ."""
    return _same(want.dtype)(got, want)


def float64_sample(sample: Sample) -> Sample | None:
    """The sample in float64 (None when it has no lower-precision float tensor)."""
    return _as_float64(sample) if any(t.dtype in _WIDER for t in sample_tensors(sample)) else None


_WIDER = {torch.float32: torch.float64, torch.float16: torch.float64, torch.bfloat16: torch.float64,
          torch.complex64: torch.complex128}


def _as_float64(sample: Sample) -> Sample:
    def conv(a):
        if isinstance(a, torch.Tensor) and a.dtype in _WIDER:
            return a.to(_WIDER[a.dtype])
        if isinstance(a, torch.dtype) and a in _WIDER:
            return _WIDER[a]
        if isinstance(a, (list, tuple)):
            return type(a)(conv(b) for b in a)
        return a

    return Sample(tuple(conv(a) for a in sample.args), {k: conv(v) for k, v in sample.kwargs.items()},
                  sample.source)


def _deterministic(op) -> bool:
    """Can the op's values be compared?  (Random ops and uninitialised memory cannot.)"""
    name = op._overloadpacket.__name__
    return torch.Tag.nondeterministic_seeded not in op.tags and "empty" not in name


class _Case:
    """One sample of one op: its global result and the runs on simulated ranks."""

    def __init__(self, op, sample: Sample) -> None:
        entry, _ = lookup(op)
        self.op, self.sample = op, sample
        self.fn = op if entry is None or entry.local is None else (lambda *a, **k: entry.local(op, *a, **k))
        self.shape_args = entry.shape_args if entry is not None else {}
        with torch.no_grad():
            self.ref = flatten_outputs(op(*sample.args, **sample.kwargs))
        self.values = _deterministic(op)
        self.locals: dict = {}  # the ranks' local inputs, per layout (run_ranks' cache)
        self._wide: list = []
        self.salt, self.near = 0, False  # which valid Partial terms the ranks get (simulate._term)
        self._challenges: list | None = None  # the missing-strategy search's, built on first use

    def wide(self) -> "_Case | None":
        """The same case in float64 (None when it has no lower-precision float input)."""
        if not self._wide:
            wide = float64_sample(self.sample)
            self._wide.append(None if wide is None else _Case(self.op, wide))
        return self._wide[0]

    def run(self, mesh_shape, ins, outs) -> dict | str:
        """``{coord: local outputs}`` on simulated ranks, or why a rank failed (as text)."""
        out_shapes = [tuple(r.shape) if isinstance(r, torch.Tensor) else None for r in self.ref]
        try:
            with torch.no_grad():
                return run_ranks(self.fn, self.sample.args, self.sample.kwargs, ins, mesh_shape,
                                 self.shape_args, out_shapes, outs, self.locals, self.salt, self.near)
        except Unbuildable:
            raise
        except Exception as e:  # noqa: BLE001 - a rank that raises is a wrong strategy
            return f"a rank raises {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"

    def judge(self, ranks: dict, mesh_shape, k: int, placements) -> str:
        """"" when the ranks' output ``k`` forms the global result under ``placements``."""
        ref = self.ref[k]
        if not isinstance(ref, torch.Tensor):
            return ""
        flat = {c: flatten_outputs(r) for c, r in ranks.items()}
        for c, outs in flat.items():
            if len(outs) != len(self.ref):
                return f"rank {c} returns {len(outs)} outputs, the op on the global inputs {len(self.ref)}"
        per_rank = {c: outs[k] for c, outs in flat.items()}
        same = _same(ref.dtype) if self.values else (lambda a, b: "")
        got, why = assemble(per_rank, ref.shape, placements, mesh_shape, same)
        if got is None:
            return why
        if got.dtype != ref.dtype:
            return f"dtype {got.dtype}, expected {ref.dtype}"
        return same(got, ref) if self.values else ""

    def check(self, mesh_shape, ins, outs) -> str:
        """"" when the local results on simulated ranks form the global result, else why not."""
        ranks = self.run(mesh_shape, ins, outs)
        if isinstance(ranks, str):
            return ranks
        for k in range(len(self.ref)):
            why = self.judge(ranks, mesh_shape, k, outs[k])
            if why:
                return f"output {k}: {why}"
        return ""


def _strided_sources(mesh, tensors) -> list[list[tuple]]:
    """Input layouts holding strided shards (split factor 2): the first tensor and every tensor of
    its shape, on its first and last dim, on one mesh dim at a time."""
    first = next((t for t in tensors if t.ndim > 0), None)
    if first is None:
        return []
    out = []
    for i in range(mesh.ndim):
        for d in sorted({0, first.ndim - 1}):
            layout = []
            for t in tensors:
                pl = [_R] * mesh.ndim
                if t.shape == first.shape:
                    pl[i] = _StridedShard(d, split_factor=2)
                layout.append(tuple(pl))
            out.append(layout)
    return out


def _choices(op, mesh, sample: Sample, strided: bool):
    """``(gflat, [(ins, outs)])``: the planner's choices from replicated inputs, and with
    ``strided`` those it makes from strided inputs (only the ones that keep a strided shard)."""
    tensors = sample_tensors(sample)
    margs, mkwargs = _slots(sample)
    plain = [_spec(mesh, [_R] * mesh.ndim, t) for t in tensors]
    gflat, choices = strategy_choices(op, plain, margs, mkwargs)
    seen = {(tuple(map(tuple, i)), tuple(map(tuple, o))) for i, o in choices}
    if strided:
        for layout in _strided_sources(mesh, tensors):
            specs = [_spec(mesh, pl, t) for pl, t in zip(layout, tensors)]
            for ins, outs in strategy_choices(op, specs, margs, mkwargs)[1]:
                key = (tuple(map(tuple, ins)), tuple(map(tuple, outs)))
                if key not in seen and any(type(p) is _StridedShard for p in itertools.chain(*ins, *outs)):
                    seen.add(key)
                    choices.append((ins, outs))
    return gflat, choices


def _all_replicate(ins, outs) -> bool:
    return all(type(p) is Replicate for p in itertools.chain(*ins, *outs))


def _classify(case: _Case, mesh: SimMesh, gflat, ins, outs, uneven: bool) -> str:
    """``"rejected"``, ``"skipped"``, ``"correct"``, or why the choice is incorrect."""
    tensors = sample_tensors(case.sample)
    in_specs = [_spec(mesh, p, t) for p, t in zip(ins, tensors)]
    out_specs = tuple(None if g is None else DTensorSpec(mesh, tuple(o), g.shape, g.stride, g.dtype)
                      for g, o in zip(gflat, outs))
    if not uneven and not all(s.is_even() for s in (*in_specs, *(o for o in out_specs if o is not None))):
        return "skipped"
    margs, mkwargs = _slots(case.sample)
    if not planner_accepts(case.op, margs, mkwargs, in_specs, out_specs):
        return "rejected"
    try:
        why = case.check(mesh.shape, ins, outs)
        if why and case.wide() is not None:  # a float32 miss counts only when float64 misses too
            why64 = case.wide().check(mesh.shape, ins, outs)
            why = f"{why}; in float64: {why64}" if why64 else ""
    except Unbuildable:
        return "skipped"
    return why or "correct"


def _spread(choices: list, limit: int | None) -> list:
    """At most ``limit`` of ``choices``: those holding a strided shard first, then evenly spaced."""
    if limit is None or len(choices) <= limit:
        return choices
    strided = [c for c in choices if any(type(p) is _StridedShard for p in itertools.chain(*c[0], *c[1]))]
    plain = [c for c in choices if c not in strided]
    keep = strided[:limit // 2]
    rest = limit - len(keep)
    return keep + [plain[int(k * len(plain) / rest)] for k in range(min(rest, len(plain)))]


def _validate_sample(report: OpReport, case: _Case, meshes, uneven: bool, strided: bool, missing: bool,
                     max_choices: int | None = None) -> None:
    first_1d = next((tuple(m) for m in meshes if len(m) == 1), None)  # where missing ones are searched
    claimed_1d = set()
    for mesh_shape in meshes:
        mesh = SimMesh(mesh_shape)
        try:
            gflat, choices = _choices(case.op, mesh, case.sample, strided)
        except NotImplementedError as e:  # no meta kernel: dispatch raises NoMetaKernelError too
            report.unplannable = str(e).splitlines()[0][:160]
            return
        for ins, outs in _spread([c for c in choices if not _all_replicate(*c)], max_choices):
            if tuple(mesh_shape) == first_1d:
                claimed_1d.add((tuple(ins), tuple(outs)))
            report.claimed += 1
            verdict = _classify(case, mesh, gflat, ins, outs, uneven)
            if verdict == "correct":
                report.correct += 1
            elif verdict == "rejected":
                report.rejected += 1
            elif verdict == "skipped":
                report.skipped += 1
            else:
                report.incorrect.append(Finding(case.op, tuple(mesh_shape), tuple(ins), tuple(outs), verdict,
                                                case.sample))
    if missing and first_1d is not None and _searchable(case):
        report.missing += _missing(case, first_1d, claimed_1d)


def _partials(t: torch.Tensor) -> list:
    if t.is_floating_point():
        return [Partial("sum"), Partial("max"), Partial("min")]
    return [Partial("sum")] if t.is_complex() else []


def _candidates(t: torch.Tensor, n: int) -> list:
    """The placements the missing-strategy search tries: Replicate, every shard of a dim with at
    least ``n`` entries, the Partials of its dtype."""
    return [_R] + [Shard(d) for d in range(t.ndim) if t.shape[d] >= n] + _partials(t)


#: the missing-strategy search runs on ops of at most this many tensor inputs
MISSING_MAX_INPUTS = 3


def _searchable(case: _Case) -> bool:
    """May the missing-strategy search cut this sample's inputs any way it likes?  Some kernels
    do not check that their inputs fit together, and inputs cut apart no longer do: ``lu_unpack``
    with a sharded LU and replicated pivots, or the flash-attention backward with its logsumexp
    cut apart from its query, corrupt the heap and crash the process.  So the search leaves out
    ops with an index input (an integer or boolean tensor), ops of more than
    :data:`MISSING_MAX_INPUTS` tensor inputs, and empty inputs (on which everything fits)."""
    tensors = sample_tensors(case.sample)
    return (case.values and not case.shape_args and len(tensors) <= MISSING_MAX_INPUTS
            and all((t.is_floating_point() or t.is_complex()) and t.numel() for t in tensors))


def _board_sign(t: torch.Tensor, salt: int) -> torch.Tensor:
    """+1 / -1 on a checkerboard over ``t`` (every dim alternates)."""
    idx = sum(torch.arange(n).view([-1 if d == k else 1 for d in range(t.ndim)]) for k, n in enumerate(t.shape))
    return torch.where((torch.as_tensor(idx) + salt) % 2 == 0, 1, -1).to(t.dtype)


def _mixed(t, k):
    return t * _board_sign(t, k)


def _positive(t, k):
    return (t.abs() + 0.5).to(t.dtype)


def _zeros(t, k):
    return torch.where(_board_sign(t, k + 1) > 0, torch.zeros_like(t), _mixed(t, k))


#: the samples a combination found valid on one sample must also pass before it is reported
#: missing: ``(what, per-tensor transform or None, near Partial terms, extra ranks)``; each runs in
#: float64 (no rounding can refute a valid one), with Partial terms of another salt
CHALLENGES = (
    ("signs mixed", _mixed, False, 0),
    ("signs mixed, near max/min terms", _mixed, True, 0),
    ("negated, near max/min terms", lambda t, k: -t, True, 0),
    ("positive, near max/min terms", _positive, True, 0),
    ("zeros, near max/min terms", _zeros, True, 0),
    ("uneven shards, near max/min terms", None, True, 1),
    ("signs mixed, uneven shards", _mixed, False, 1),
)


def _transformed(sample: Sample, fn, only: int | None = None) -> Sample:
    """The sample with ``fn(tensor, k)`` applied to its k-th tensor (to tensor ``only`` alone)."""
    counter = itertools.count()

    def conv(a):
        if isinstance(a, torch.Tensor):
            k = next(counter)
            return fn(a, k) if only is None or k == only else a
        if isinstance(a, (list, tuple)):
            return type(a)(conv(b) for b in a)
        return a

    return Sample(tuple(conv(a) for a in sample.args), {k: conv(v) for k, v in sample.kwargs.items()},
                  sample.source)


def _challenges(case: _Case) -> list:
    """``[(what, case, extra ranks)]``: the cases a missing-strategy hint must also hold on (see
    :data:`CHALLENGES`; with several tensor inputs also each one negated alone).  A transform the
    op rejects on the global inputs (a domain error) gives no challenge."""
    if case._challenges is None:
        specs = [(what, (fn, None), near, extra) for what, fn, near, extra in CHALLENGES]
        n_in = len(sample_tensors(case.sample))
        if n_in > 1:
            specs += [(f"input {k} negated", (lambda t, k: -t, k), False, 0) for k in range(n_in)]
        built = []
        for salt, (what, (fn, only), near, extra) in enumerate(specs, 1):
            sample = case.sample if fn is None else _transformed(case.sample, fn, only)
            try:
                with torch.no_grad():
                    challenge = _Case(case.op, float64_sample(sample) or sample)
            except Exception:  # noqa: BLE001 - the op rejects these inputs: nothing to learn
                continue
            challenge.salt, challenge.near = salt, near
            built.append((what, challenge, extra))
        case._challenges = built
    return case._challenges


def _no_empty_shard(tensors, placements, n: int) -> bool:
    """Does every rank of a 1-D mesh of ``n`` hold a non-empty piece of each sharded tensor?
    (The shard layout's chunks can leave the last ranks empty: 4 rows on 3 ranks are 2, 2, 0.)"""
    return all(not isinstance(t, torch.Tensor) or type(p) is not Shard
               or all(local_shape(tuple(t.shape), (n,), (p,), (c,))[p.dim] for c in range(n))
               for t, (p,) in zip(tensors, placements))


def _refuted(case: _Case, mesh_shape, ins, outs_list: list) -> dict:
    """``{outs: why}`` for each output choice of ``outs_list`` that some challenge refutes (the
    combination ``ins`` run on its inputs does not form the op's result under ``outs``)."""
    refuted = {}
    for what, challenge, extra in _challenges(case):
        mesh = (mesh_shape[0] + extra,)
        if extra and not _no_empty_shard(sample_tensors(challenge.sample), ins, mesh[0]):
            continue  # an empty shard: many kernels raise on one, and the planner rejects that layout
        try:
            ranks = challenge.run(mesh, ins, [(_R,)] * len(challenge.ref))
        except Unbuildable:
            continue
        for outs in outs_list:
            if outs in refuted or (extra and not _no_empty_shard(challenge.ref, outs, mesh[0])):
                continue
            why = ranks if isinstance(ranks, str) else next(
                (w for k, o in enumerate(outs) if (w := challenge.judge(ranks, mesh, k, o))), "")
            if why:
                refuted[outs] = f"{what}, mesh {mesh}: {why}"
    return refuted


def _missing(case: _Case, mesh_shape, claimed: set) -> list:
    """Combinations valid on this sample (1-D mesh) and on every challenge (:func:`_challenges`)
    that the rule does not claim."""
    n = mesh_shape[0]
    per_input = [_candidates(t, n) for t in sample_tensors(case.sample)]
    combos = [c for c in itertools.product(*per_input) if any(type(p) is not Replicate for p in c)]
    if len(combos) > MISSING_CAP:
        step = len(combos) / MISSING_CAP
        combos = [combos[int(k * step)] for k in range(MISSING_CAP)]
    found = []
    for combo in combos:
        ins = tuple((p,) for p in combo)
        try:
            ranks = case.run(mesh_shape, ins, [(_R,)] * len(case.ref))
        except Unbuildable:
            continue
        if isinstance(ranks, str):
            continue
        valid = []
        for k, ref in enumerate(case.ref):
            if not isinstance(ref, torch.Tensor):
                valid.append([(_R,)])
                continue
            ok = [(p,) for p in _candidates(ref, n) if not case.judge(ranks, mesh_shape, k, (p,))]
            if (_R,) in ok:  # every rank holds the result: a Partial max/min of it says nothing new
                ok = [o for o in ok if not (isinstance(o[0], Partial) and o[0].reduce_op != "sum")]
            valid.append(ok)
        candidates = [tuple(outs) for outs in itertools.product(*valid)
                      if (ins, tuple(outs)) not in claimed and not all(type(o[0]) is Replicate for o in outs)]
        if not candidates:
            continue
        refuted = _refuted(case, mesh_shape, ins, candidates)
        checked = len(_challenges(case))
        for outs in candidates:
            if outs not in refuted:
                found.append(Finding(case.op, tuple(mesh_shape), ins, outs,
                                     f"valid on this sample and {checked} drawn to break it (signs mixed, "
                                     "zeros, near max/min terms, uneven shards), not claimed", case.sample))
    return found


def validate_op(op, source: SampleSource, meshes, *, uneven: bool = True, strided: bool = False,
                missing: bool = True, max_choices: int | None = None) -> OpReport:
    """Validate every strategy ``op``'s rule claims on ``source``'s samples, on every mesh.
    ``max_choices``: check at most this many choices per sample and mesh, evenly spread over
    the planner's list (deterministic; for the test suite's time budget), strided ones first."""
    entry, _ = lookup(op)
    report = OpReport(op, "none" if entry is None else entry.kind)
    if entry is None:
        report.note = "no rule"
        return report
    start = time.perf_counter()
    if not any("Tensor" in str(a.type) for a in op._schema.arguments):
        report.note = "no tensor argument (a factory: its output placements are the caller's choice)"
        return report
    for sample in source.samples(op):
        try:
            case = _Case(op, sample)
        except Exception:  # noqa: BLE001 - the op rejects the sample itself: nothing to validate
            continue
        report.samples += 1
        _validate_sample(report, case, meshes, uneven, strided, missing, max_choices)
    report.seconds = time.perf_counter() - start
    if not report.samples:
        report.note = "no sample (give it one in dtshard/validate/samples.py OWN_SAMPLES)"
    elif report.unplannable and not report.claimed:
        report.note = f"not plannable on DTensors (dispatch raises the same): {report.unplannable}"
    return report


def simulate_op(op, args, kwargs, mesh_shape, inputs, outputs) -> list:
    """The op's global outputs as the ranks of a mesh of ``mesh_shape`` form them, simulated in
    one process: the inputs laid out as ``inputs`` (placements per tensor argument), the local
    outputs read as ``outputs`` (placements per output).  A reproduction calls this; raises
    ValueError naming what does not fit."""
    case = _Case(op, Sample(tuple(args), dict(kwargs), "repro"))
    ranks = case.run(tuple(mesh_shape), inputs, outputs)
    if isinstance(ranks, str):
        raise ValueError(f"{op} on mesh {tuple(mesh_shape)}: {ranks}")
    got = []
    for k, ref in enumerate(case.ref):
        if isinstance(ref, torch.Tensor):
            val, why = assemble({c: flatten_outputs(r)[k] for c, r in ranks.items()}, ref.shape, outputs[k],
                                tuple(mesh_shape), lambda a, b: "" if torch.equal(a, b) else "values differ")
            if val is None:
                raise ValueError(f"{op} on mesh {tuple(mesh_shape)}: output {k}: {why}")
            got.append(val)
    return got
