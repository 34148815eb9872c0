"""Simulated ranks: one op on every rank of a mesh, in one process, without a process group.

Three steps, each pure tensor arithmetic on the layout functions of :mod:`dtshard.spec`:

- :func:`local_input`: a rank's local tensor of a global input with given placements.  A
  ``Shard`` / strided shard keeps the rank's ``local_region``; a ``Partial`` holds a TERM of the
  value, built so that coincidences cannot pass: ``sum`` terms are uneven shares plus offsets whose
  sign alternates element by element (so ``abs`` of the terms is not a term of ``abs``), ``avg``
  the same scaled, ``product`` factors of alternating sign and size, ``max`` / ``min`` the true
  value on one rank (a checkerboard picks which) and the others offset past the value range (so
  an index-returning op sees different winners on different ranks); with ``near=True`` (the
  missing-strategy search's challenges) max / min terms sit just below / above the value or tie
  with it instead, the other valid way to split it.  Several Partial mesh dims split
  hierarchically: mesh dim 0 splits the value, mesh dim 1 each of its terms, and so on.
- :func:`run_ranks`: the op (or the rule's ``local`` function) on every rank's local arguments,
  with the rule's ``shape_args`` replaced by the rank's local output shape, as the dispatcher does.
- :func:`assemble`: the global value the output placements say the local outputs form, or the
  reason they form none: a local shape that contradicts the placements, replicas that differ.
  Mesh dims combine innermost first, the inverse of the hierarchical Partial split.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable, Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from dtshard.spec import is_shard, local_region, local_shape, take_region

__all__ = ["SimMesh", "Unbuildable", "assemble", "coords", "local_input", "run_ranks"]


class SimMesh:
    """What the planner reads of a mesh (its shape and device type), with no process group."""

    def __init__(self, shape: Sequence[int]) -> None:
        self.shape = tuple(shape)
        self.ndim = len(self.shape)
        self.device_type = "cpu"

    def size(self, dim: int | None = None) -> int:
        return self.shape[dim] if dim is not None else int(torch.Size(self.shape).numel())

    def __repr__(self) -> str:
        return f"SimMesh{self.shape}"


class Unbuildable(ValueError):
    """No Partial terms of this dtype can be built (a Partial(sum) of booleans)."""


def coords(mesh_shape: Sequence[int]) -> list[tuple[int, ...]]:
    """Every rank's coordinate, row-major."""
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _checker(shape, salt: int) -> torch.Tensor:
    """A boolean checkerboard over ``shape`` (sum of coordinates, shifted by ``salt``): it
    alternates along EVERY dim, where a flat-index pattern can be constant along one."""
    return _board(tuple(shape), salt % 2)


@functools.lru_cache(maxsize=256)
def _board(shape: tuple, parity: int) -> torch.Tensor:
    total = torch.full(shape, parity, dtype=torch.long)
    for d, n in enumerate(shape):
        view = [1] * len(shape)
        view[d] = n
        total = total + torch.arange(n).view(view)
    return total % 2 == 0


def _term(x: torch.Tensor, op: str, n: int, c: int, salt: int, near: bool = False) -> torch.Tensor:
    """Rank ``c`` of ``n``'s term of ``x`` for ``Partial(op)``; the ``n`` terms reduce to ``x``.
    ``near``: max / min terms of the non-owners tie with the value (on a checkerboard) or sit just
    past it (a quarter of its magnitude plus a quarter), instead of past the whole value range."""
    if n == 1:
        return x
    if x.dtype == torch.bool:
        if op in ("max", "min"):  # or / and: the owner holds x, the others the neutral value
            owner = (_checker(x.shape, salt).long() + salt) % n == c
            return torch.where(owner, x, torch.full_like(x, op == "min"))
        raise Unbuildable(f"no Partial({op}) terms of a bool tensor")
    flt = x.is_floating_point() or x.is_complex()
    sign = torch.where(_checker(x.shape, salt), 1, -1).to(x.dtype)
    if op in ("sum", "avg"):
        spread = 2 * c - (n - 1)  # the offsets' multipliers: distinct, summing to zero
        mag = x.abs() + 1
        if flt:
            weights = [k + 1 + salt % 3 for k in range(n)]
            share = x * (weights[c] / sum(weights))
            term = share + mag * sign * (spread / 2)
        else:
            term = (x if c == salt % n else torch.zeros_like(x)) + mag * sign * spread
        return term * n if op == "avg" else term
    if op == "product":
        if flt:
            factor = torch.where(_checker(x.shape, salt + c), -2.0, -0.5).to(x.dtype)
            if c:
                return factor
            rest = torch.ones_like(x)
            for k in range(1, n):
                rest = rest * torch.where(_checker(x.shape, salt + k), -2.0, -0.5).to(x.dtype)
            return x / rest
        return x * (-1) ** (n - 1) if c == 0 else -torch.ones_like(x)
    if op in ("max", "min"):
        if x.is_complex():
            raise Unbuildable(f"no Partial({op}) terms of a complex tensor")
        if near:
            gap = (x.abs() + 1) / 4 if flt else torch.ones_like(x)
            # ties on a checkerboard; never on a 0-d tensor (its board is one square: a tie there
            # would make every term the value itself, which any claim passes)
            tie = _checker(x.shape, salt + 1 + c) if x.ndim else torch.zeros((), dtype=torch.bool)
            offset = torch.where(tie, torch.zeros_like(gap), gap).to(x.dtype)
        else:
            finite = x[torch.isfinite(x)] if flt else x
            span = (finite.max() - finite.min()).item() if finite.numel() else 0
            offset = 2 * span + 1
        owner = (_checker(x.shape, salt).long() + salt) % n == c
        away = x - offset if op == "max" else x + offset
        return torch.where(owner, x, away)
    raise Unbuildable(f"no terms for Partial({op})")


def local_input(full: torch.Tensor, placements: Sequence[Placement], mesh_shape: Sequence[int],
                coord: Sequence[int], salt: int = 0, near: bool = False) -> torch.Tensor:
    """Rank ``coord``'s local tensor of ``full`` laid out with ``placements`` (a copy); ``salt``
    and ``near`` choose among valid Partial terms (see :func:`_term`)."""
    x = full.detach()
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            x = _term(x, p.reduce_op, mesh_shape[i], coord[i], salt + 7 * i, near)
    x = take_region(x, local_region(tuple(full.shape), mesh_shape, placements, coord))
    return x.clone()


def run_ranks(fn: Callable, args, kwargs, placements: Sequence[Sequence[Placement]], mesh_shape,
              shape_args: dict | None = None, out_shapes=(), out_placements=(), cache: dict | None = None,
              salt: int = 0, near: bool = False) -> dict:
    """``{coord: fn(local args)}`` for every rank.  ``args``/``kwargs`` hold the global tensors;
    the k-th tensor met (flattened in argument order) gets ``placements[k]``.  ``shape_args``
    ({arg index: output index}): that argument becomes the rank's local shape of that output.
    ``cache``: local inputs kept across calls with the same ``args`` (the op gets copies).
    ``salt`` / ``near``: which valid Partial terms the inputs get (:func:`local_input`)."""
    results = {}
    cache = {} if cache is None else cache
    for coord in coords(mesh_shape):
        counter = itertools.count()

        def conv(a):
            if isinstance(a, torch.Tensor):
                k = next(counter)
                key = (k, tuple(placements[k]), tuple(mesh_shape), coord, salt, near)
                if key not in cache:
                    cache[key] = local_input(a, placements[k], mesh_shape, coord, salt=k + salt, near=near)
                return cache[key].clone()
            if isinstance(a, (list, tuple)):
                return type(a)(conv(b) for b in a)
            return a

        largs = [conv(a) for a in args]
        lkwargs = {k: conv(v) for k, v in kwargs.items()}
        for idx, k in (shape_args or {}).items():
            if idx < len(largs):
                largs[idx] = list(local_shape(out_shapes[k], mesh_shape, out_placements[k], coord))
        results[coord] = fn(*largs, **lkwargs)
    return results


def _scatter(local: torch.Tensor, region, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """The full-size tensor holding ``local`` at ``region`` (zeros elsewhere), and its mask."""
    if not shape:  # a 0-d tensor: nothing to place
        return local.clone(), torch.ones((), dtype=torch.bool)
    val = torch.zeros(shape, dtype=local.dtype)
    mask = torch.zeros(shape, dtype=torch.bool)
    if local.numel() == 0:
        return val, mask
    if all(len(ivs) == 1 for ivs in region):  # a box: one slice per dim
        box = tuple(slice(ivs[0][0], ivs[0][1]) for ivs in region)
        val[box] = local
        mask[box] = True
        return val, mask
    index = []
    for d, ivs in enumerate(region):
        idx = torch.cat([torch.arange(lo, hi) for lo, hi in ivs])
        view = [1] * len(shape)
        view[d] = -1
        index.append(idx.view(view))
    val.index_put_(tuple(index), local)
    mask.index_put_(tuple(index), torch.ones((), dtype=torch.bool))
    return val, mask


def _reduce(vals: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack(vals)
    if op == "sum":
        return stack.sum(0).to(stack.dtype)
    if op == "avg":
        total = stack.sum(0)
        return total / len(vals) if stack.is_floating_point() or stack.is_complex() else total // len(vals)
    if op == "product":
        return stack.prod(0).to(stack.dtype)
    if op in ("max", "min") and stack.is_complex():
        raise ValueError(f"Partial({op}) of complex values")
    if op == "max":
        return stack.amax(0)
    if op == "min":
        return stack.amin(0)
    raise ValueError(f"unknown reduce op {op!r}")


def assemble(locals_: dict, global_shape, placements: Sequence[Placement], mesh_shape,
             same: Callable[[torch.Tensor, torch.Tensor], str]) -> tuple[torch.Tensor | None, str]:
    """``(global tensor, "")`` that the ranks' ``locals_`` form under ``placements``, or
    ``(None, why not)``.  ``same(a, b)`` compares two replicas ("" when equal)."""
    shape = tuple(global_shape)
    parts = {}
    for coord, t in locals_.items():
        region = local_region(shape, mesh_shape, placements, coord)
        want = tuple(sum(hi - lo for lo, hi in r) for r in region)
        if tuple(t.shape) != want:
            return None, f"rank {coord} holds a local shape {tuple(t.shape)}, the placements say {want}"
        parts[coord] = _scatter(t, region, shape)
    for i in reversed(range(len(mesh_shape))):
        p = placements[i]
        merged = {}
        for coord in sorted(parts):
            if coord[i]:
                continue
            group = [parts[coord[:i] + (c,) + coord[i + 1:]] for c in range(mesh_shape[i])]
            if is_shard(p):
                val = group[0][0].clone()
                mask = group[0][1].clone()
                for v, m in group[1:]:
                    val[m] = v[m]
                    mask |= m
            elif isinstance(p, Replicate):
                for c, (v, _) in enumerate(group[1:], 1):
                    why = same(v, group[0][0])
                    if why:
                        return None, f"Replicate on mesh dim {i}, but rank {coord[:i] + (c,) + coord[i + 1:]} differs from rank {coord}: {why}"
                val, mask = group[0]
            else:
                try:
                    val, mask = _reduce([v for v, _ in group], p.reduce_op), group[0][1]
                except (ValueError, RuntimeError) as e:
                    return None, f"{p} on mesh dim {i} cannot be reduced: {e}"
            merged[coord] = (val, mask)
        parts = merged
    (val, _), = parts.values()
    return val, ""
