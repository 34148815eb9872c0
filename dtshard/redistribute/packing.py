"""Local-tensor helpers around redistribute's collectives: shapes, copy accounting, the
padding note, reductions of stacked terms, regions."""

from __future__ import annotations

import logging

import torch
from torch.distributed.tensor.placement_types import Shard

from dtshard._trace import copy_observers, note_copy
from dtshard.spec import DTensorSpec, chunk_range, placements_str

__all__ = ["copied", "note_padding", "numel_except", "parent_length", "reduce_terms", "region", "with_length"]


def parent_length(spec: DTensorSpec, state, i: int, coord, dim: int) -> int:
    """Length of tensor dim ``dim`` on this rank if mesh dim ``i`` did not shard it."""
    size = spec.shape[dim]
    mesh_shape = spec.mesh_shape
    for j, p in enumerate(state):
        if j != i and isinstance(p, Shard) and p.dim == dim:
            size = chunk_range(size, mesh_shape[j], coord[j])[1]
    return size


def copied(kind: str, t: torch.Tensor) -> torch.Tensor:
    if copy_observers:
        note_copy(kind, t.numel() * t.element_size())
    return t


def with_length(shape, dim, value) -> tuple[int, ...]:
    s = list(shape)
    s[dim] = value
    return tuple(s)


def numel_except(shape, *dims) -> int:
    n = 1
    for k, v in enumerate(shape):
        if k not in dims:
            n *= v
    return n


_logger = logging.getLogger("dtshard")
_padding_noted: set = set()


#: reductions whose uneven reduce_scatter over one mesh dim pads every piece to the largest and
#: leaves the reduction to the backend (what the planner prices: k-1 of the largest piece for
#: every rank, also what the exact-piece all_to_all costs the rank keeping the largest piece).
#: max / min keep the all_to_all of the exact pieces and a local reduction: gloo has no MAX/MIN
#: reduce_scatter.
PADDED_REDUCE_OPS = ("sum", "avg")


def pads_reduce_scatter(op: str, sizes) -> bool:
    """Whether an uneven reduce_scatter of pieces ``sizes`` pads them to the largest (one
    collective, the sum left to the backend) rather than exchanging the exact pieces: for the
    reductions of :data:`PADDED_REDUCE_OPS`, where padding makes no rank send more than 1.25x what
    it sends with the exact pieces (``k - 1`` largest padded, against all pieces but its own, the
    least for the rank keeping the largest).  Nearly even pieces pad (``[8] * 125 + [0] * 3``);
    a short or empty last piece among few does not (``[2, 2, 1, 0]``: every rank would send 6
    rows, the exact pieces send 3 to 5)."""
    if op not in PADDED_REDUCE_OPS:
        return False
    return 4 * (len(sizes) - 1) * max(sizes) <= 5 * (sum(sizes) - max(sizes))


def note_padding(spec: DTensorSpec, dim: int, sizes) -> None:
    """Log once per (shape, placements, dim) that an uneven layout pads for a collective."""
    key = (spec.shape, spec.placements, dim)
    if key not in _padding_noted:
        _padding_noted.add(key)
        _logger.info(
            "dtshard: uneven shards %s of dim %d of a %s %s tensor are padded to %d for an all_gather "
            "(logged once per layout)", sizes, dim, tuple(spec.shape), placements_str(spec.placements), max(sizes)
        )


def reduce_terms(terms: torch.Tensor, op: str, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reduce the ``n`` terms stacked along dim 0 (into ``out`` when given)."""
    if op in ("sum", "avg"):
        # in the terms' dtype (torch.sum would widen integers to int64: the local tensor must keep
        # the DTensor's dtype, as the even path's reduce_scatter does)
        r = torch.sum(terms, 0, dtype=terms.dtype, out=out)
        return r / terms.shape[0] if op == "avg" else r
    if op == "product":
        return torch.prod(terms, 0, dtype=terms.dtype, out=out)
    return torch.amax(terms, 0, out=out) if op == "max" else torch.amin(terms, 0, out=out)


def region(t: torch.Tensor, slices) -> torch.Tensor:
    for d, (start, length) in enumerate(slices):
        if start != 0 or length != t.shape[d]:
            t = t.narrow(d, start, length)
    return t
