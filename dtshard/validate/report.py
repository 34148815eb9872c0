"""The validator's report: one line per op, the findings, the totals, and reproductions.

A report line (``OpReport.line``)::

    aten.add.Tensor   claimed   120  correct    98  incorrect   0  rejected   22  skipped    0  missing   1  samples 2    0.41s

- ``claimed``: strategy choices the planner considers (the rule's strategies expanded over each
  mesh, strided variants included), all-Replicate aside, summed over samples and meshes;
- ``correct`` / ``incorrect``: run on simulated ranks, right / wrong values (or a rank raises),
  float32 misses confirmed in float64;
- ``rejected``: discarded by the planner's own local-shape check, so never run;
- ``skipped``: not runnable here (uneven layouts under ``--no-uneven``, Partial terms of a dtype
  that has none);
- ``missing``: valid on the sampled inputs on a 1-D mesh, and on the samples drawn to break them
  (``check.CHALLENGES``: signs mixed, zeros, near max/min terms, uneven shards), but not claimed
  (hints, not errors).

A handler-served op under ``--ranks`` (``dtshard.validate.ranks``) has the same line: ``claimed``
counts the input layouts run on real ranks, ``skipped`` those the handler refused with an error.
"""

from __future__ import annotations

import torch

from dtshard.spec import placement_str
from dtshard.validate.check import Finding, OpReport

__all__ = ["repro", "summary"]

#: a reproduction spells out tensors up to this many elements; larger ones are drawn from a seed
LITERAL_NUMEL = 512


def _placement_code(p) -> str:
    text = placement_str(p)
    if text == "R":
        return "Replicate()"
    if text.startswith("P("):
        return f"Partial({p.reduce_op!r})"
    if text.startswith("_S("):
        return f"_StridedShard({p.dim}, split_factor={p.split_factor})"
    return f"Shard({p.dim})"


def _value_code(a) -> str:
    if isinstance(a, torch.Tensor):
        if a.numel() <= LITERAL_NUMEL:
            return f"torch.tensor({a.tolist()!r}, dtype={a.dtype})"
        return (f"torch.randn({tuple(a.shape)}, generator=torch.Generator().manual_seed(0)).to({a.dtype})"
                "  # not the sample's values")
    if isinstance(a, (list, tuple)):
        inner = ", ".join(_value_code(b) for b in a)
        return f"[{inner}]" if isinstance(a, list) else f"({inner}{',' if len(a) == 1 else ''})"
    if isinstance(a, torch.dtype):
        return str(a)
    return repr(a)


def repro(f: Finding) -> str:
    """A self-contained script that shows the finding (simulated ranks: no process group)."""
    op = f"torch.ops.{f.op._schema.name.replace('::', '.')}.{f.op._overloadname}"
    ins = ", ".join("(" + ", ".join(_placement_code(p) for p in pl) + ",)" for pl in f.ins)
    outs = ", ".join("(" + ", ".join(_placement_code(p) for p in pl) + ",)" for pl in f.outs)
    kwargs = "{" + ", ".join(f"{k!r}: {_value_code(v)}" for k, v in f.sample.kwargs.items()) + "}"
    return "\n".join([
        f"# {f.text()}",
        "import torch",
        "from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard",
        "",
        "import dtshard  # noqa: F401  (registers the rules)",
        "from dtshard.validate import simulate_op",
        "",
        f"op = {op}",
        f"args = {_value_code(tuple(f.sample.args))}",
        f"kwargs = {kwargs}",
        "want = op(*args, **kwargs)",
        "want = [want] if isinstance(want, torch.Tensor) else [t for t in want if isinstance(t, torch.Tensor)]",
        f"got = simulate_op(op, args, kwargs, mesh_shape={f.mesh_shape}, inputs=[{ins}], outputs=[{outs}])",
        "for g, w in zip(got, want):",
        "    torch.testing.assert_close(g, w, equal_nan=True)  # fails: the claimed strategy is wrong",
    ])


def summary(reports: list[OpReport], seconds: float, cpu_seconds: float) -> str:
    """The totals: ops, strategies checked, correct, incorrect, rejected, skipped, missing."""
    validated = [r for r in reports if not r.note and r.served == "rule"]
    on_ranks = [r for r in reports if not r.note and r.served == "handler"]
    no_sample = [r for r in reports if r.note.startswith("no sample")]
    handlers = [r for r in reports if r.served == "handler" and r.note]
    errors = [r for r in reports if r.note.startswith("VALIDATOR ERROR")]
    unplannable = [r for r in reports if r.note.startswith("not plannable")]
    total = sum(r.claimed for r in validated)
    return "\n".join([
        f"ops validated: {len(validated)} (rule-served; {len(no_sample)} without a sample, "
        f"{len(unplannable)} not plannable, {len(handlers)} handler-served not validated here)",
        f"strategies checked: {total}  correct: {sum(r.correct for r in validated)}  "
        f"incorrect: {sum(len(r.incorrect) for r in validated)}  rejected by the planner: "
        f"{sum(r.rejected for r in validated)}  skipped: {sum(r.skipped for r in validated)}  "
        f"missing: {sum(len(r.missing) for r in validated)}",
        f"validator errors: {len(errors)}" + "".join(f"\n  {r.line()}" for r in errors),
        *([f"handler-served ops on real ranks: {len(on_ranks)}  layouts checked: "
           f"{sum(r.claimed for r in on_ranks)}  correct: {sum(r.correct for r in on_ranks)}  incorrect: "
           f"{sum(len(r.incorrect) for r in on_ranks)}  raised a clear error: {sum(r.skipped for r in on_ranks)}"]
          if on_ranks else []),
        f"time: {seconds:.1f}s wall, {cpu_seconds:.1f}s CPU (this process; --ranks workers apart)",
    ])
