"""Debugging views: what moved (CommCounter), which plan each op took (explain), copy passes.

    with dtshard.debug.CommCounter() as comm:
        y = model(x)
    print(comm.summary())                 # per op: collective kind, mesh dim, bytes
    comm.count("all_gather")              # number of all_gathers
    comm.bytes(kind="all_to_all")         # bytes this rank put on the wire
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

from dtshard import _trace
from dtshard.spec import placements_str

__all__ = ["CommCounter", "CommRecord", "CopyCounter", "explain", "plan_log"]


@dataclass(frozen=True)
class CommRecord:
    op: str  # the aten op being dispatched, or "<redistribute>" for explicit redistribute calls
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | broadcast
    mesh_dim: int
    nbytes: int  # bytes this rank sends (ARCHITECTURE.md accounting)
    group_size: int


class CommCounter:
    """Context manager recording every collective issued by dtshard on this rank."""

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def _observe(self, kind: str, mesh_dim: int, nbytes: int, group_size: int) -> None:
        self.records.append(CommRecord(_trace.current_op[0], kind, mesh_dim, nbytes, group_size))

    def __enter__(self) -> "CommCounter":
        _trace.comm_observers.append(self._observe)
        return self

    def __exit__(self, *exc) -> bool:
        _trace.comm_observers.remove(self._observe)
        return False

    def count(self, kind: str | None = None) -> int:
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def bytes(self, kind: str | None = None, mesh_dim: int | None = None) -> int:
        return sum(
            r.nbytes for r in self.records
            if (kind is None or r.kind == kind) and (mesh_dim is None or r.mesh_dim == mesh_dim)
        )

    def kinds(self) -> list[str]:
        return [r.kind for r in self.records]

    def by_op(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for r in self.records:
            out[r.op][r.kind] += 1
        return {k: dict(v) for k, v in out.items()}

    def summary(self) -> str:
        """One line per (op, kind, mesh dim): count and bytes."""
        agg: dict = defaultdict(lambda: [0, 0])
        for r in self.records:
            a = agg[(r.op, r.kind, r.mesh_dim)]
            a[0] += 1
            a[1] += r.nbytes
        if not agg:
            return "no collectives"
        return "\n".join(
            f"{op}: {kind} x{n} on mesh dim {md}, {b} bytes" for (op, kind, md), (n, b) in agg.items()
        )


class CopyCounter:
    """Context manager counting the local copy passes (pack/unpack/slice) made by redistribute."""

    def __init__(self) -> None:
        self.passes: list[tuple[str, int]] = []

    def _observe(self, kind: str, nbytes: int) -> None:
        self.passes.append((kind, nbytes))

    def __enter__(self) -> "CopyCounter":
        _trace.copy_observers.append(self._observe)
        return self

    def __exit__(self, *exc) -> bool:
        _trace.copy_observers.remove(self._observe)
        return False

    def count(self, kind: str | None = None) -> int:
        return sum(1 for k, _ in self.passes if kind is None or k == kind)


@contextlib.contextmanager
def plan_log() -> Iterator[list[str]]:
    """Collect the plan text of every dispatched op (cache hits included)."""
    lines: list[str] = []

    def observe(op_name, plan, specs):
        lines.append(plan.describe(specs))

    _trace.plan_observers.append(observe)
    try:
        yield lines
    finally:
        _trace.plan_observers.remove(observe)


def explain(fn, *args, **kwargs) -> str:
    """Run ``fn(*args, **kwargs)`` and return, per dispatched op, the chosen plan, its cost in
    bytes, and the alternatives considered (cheapest first)."""
    seen: list[str] = []

    def observe(op_name, plan, specs):
        text = plan.describe(specs)
        alts = [f"    {'ok ' if ok else 'bad'} {cost:.0f}B  {desc}" for cost, desc, ok in plan.considered]
        seen.append(text + ("\n  considered:\n" + "\n".join(alts) if alts else ""))

    _trace.plan_observers.append(observe)
    try:
        fn(*args, **kwargs)
    finally:
        _trace.plan_observers.remove(observe)
    return "\n".join(seen)


def describe_spec(spec) -> str:
    return f"{tuple(spec.shape)} {placements_str(spec.placements)} on mesh {tuple(spec.mesh.shape)}"
