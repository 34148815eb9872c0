"""What the demos' reports share: the tolerance against one process, deviations, the step tables."""

from __future__ import annotations

import torch
import torch.nn as nn

from dtshard.spec import placements_str


# Tolerance of the comparison with the single-process model (float32): |a - b| <= ATOL + RTOL * |b|
RTOL = 1e-5
ATOL = 1e-6


# column order and short names of the collective kinds in the step table
_KINDS = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A",
          "broadcast": "BC"}


def _deviation(rs: list) -> tuple:
    """One step's ``(|d loss|, max |d W|, within tolerance)`` over every rank's row (the spatial
    demos' check against one process)."""
    dl = max(abs(r["loss"] - r["ref"]) for r in rs)
    dw = max(r["dev_w"] for r in rs)
    return dl, dw, dl <= 1e-6 + 1e-5 * abs(rs[0]["ref"]) and dw <= 1e-5


def _max_dev(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, max |got - want| / (ATOL + RTOL |want|)): the second is <= 1 when ok."""
    diff = (got.detach().double() - want.detach().double()).abs()
    if diff.numel() == 0:
        return 0.0, 0.0
    ratio = diff / (ATOL + RTOL * want.detach().double().abs())
    return diff.max().item(), ratio.max().item()


def _params_summary(ref: nn.Module, model: nn.Module) -> list[tuple]:
    rows = []
    for (name, p), (_, dp) in zip(ref.named_parameters(), model.named_parameters()):
        rows.append((name, tuple(p.shape), dtshard_placements(dp), tuple(dp.to_local().shape)))
    return rows


def dtshard_placements(t) -> str:
    return placements_str(t.placements)


def _table(headers: list[str], rows: list[list[str]], align: str) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        out = []
        for cell, w, a in zip(cells, widths, align):
            out.append(cell.rjust(w) if a == "r" else cell.ljust(w))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":" if a == "r" else "-" * (w + 2)) for w, a in zip(widths, align)) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def _kinds_text(counts: dict) -> str:
    """``{kind: n}`` as ``AR x2, A2A x1`` (kinds sorted, short names)."""
    return ", ".join(f"{_KINDS.get(kind, kind)} x{n}" for kind, n in sorted(counts.items()))


def _report_disagreement(ranks: list[dict], k: int) -> None:
    """Print a failure line when the ranks' step-``k`` losses differ (each rank reports the
    global loss, so they must be equal)."""
    if len({r["rows"][k]["loss"] for r in ranks}) != 1:
        print(f"FAIL: step {k + 1}: the ranks disagree on the loss: "
              + ", ".join(f"rank {r['rank']}: {r['rows'][k]['loss']!r}" for r in ranks))
