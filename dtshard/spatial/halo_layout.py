"""Halos as part of a spatial shard's layout: the arithmetic, the depth policy, stripping.

A spatially sharded DTensor (``Shard(d)`` of a spatial dim ``d`` on mesh dim ``i``) may carry a
halo ``(lo, hi)`` on ``d`` (:class:`Halo`; all of a tensor's are a :class:`HaloLayout`, the
spec's ``extra``, which this feature owns as a ``dtshard.hooks`` layout extension registered in
``halo_ops.py``): its local tensor is then
its owned chunk ``[c, e)`` (``torch.chunk`` layout of the global length ``N``) widened to the
EXTENDED range::

    [max(0, c - lo), min(N, e + hi))                                        (ext_range)

so a rank at a global edge holds no rows beyond it, and an empty or short shard holds rows of
ranks farther away (multi-hop) as the range says.  Everything follows from metadata every rank
shares: the widths are nominal, the per-rank extents are this formula.

Two kinds (``HaloLayout.partial``):

* replicated (activations): every row of the extended range holds the global tensor's value
  there; the owned shard is a narrow of it, so dropping the halo is free;
* partial (gradients of activations that carried a halo): the rows hold this rank's
  CONTRIBUTION; the value at a global row is the sum of every rank's contribution to it.  Dropping
  the halo sends the halo rows back to their owners, who add them (``halo.accumulate``, the
  adjoint of the exchange that widened the forward tensor).

Which ops keep a halo (see ``dispatch_halo`` and the handlers that take ``keeps_layout_data=True``):

* pointwise ops and copies (``detach``, ``clone``, ``_to_copy``) compute on the extended rows;
  the output's halo is the narrowest of its sharded inputs' (a plain shard: none);
* ops linear in one argument (``mul``, ``threshold_backward``, ``silu_backward``, ...) and sums
  (``add``, ``sub``) also keep a partial halo;
* a stride-1 convolution with "same" padding ``p`` consumes ``p`` rows per side; one whose input
  halo is too narrow exchanges ONCE for ``depth`` layers (:func:`halo_depth`): it fetches
  ``depth * p`` rows and returns ``(depth - 1) * p``; its backward sends the gradient's halo back
  once (``spatial/conv.py``);
* group norm takes its statistics over the OWNED rows only and normalises the extended ones.

Any other op sees the tensor without its halo (the dispatcher strips it first), so a halo can
never change a result: it only saves exchanges.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Sequence

import torch

from dtshard import collectives as C
from dtshard import hooks
from dtshard.spatial import halo as H
from dtshard.spec import DTensorSpec, chunk_range
from dtshard.tensor import DTensor

__all__ = [
    "Halo",
    "HaloLayout",
    "halos",
    "halo_partial",
    "with_halo",
    "halo_depth",
    "get_halo_depth",
    "auto_depth",
    "ext_range",
    "grow_plan",
    "ext_shape",
    "halo_widths",
    "narrow_local",
    "pad_local",
    "plain_local",
    "strip",
    "demote_",
    "fresh",
    "model",
]


# ---------------------------------------------------------------------------------------------
# the halo in a spec
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Halo:
    """Rows of its neighbours that a spatial shard carries on one tensor dim: ``lo`` rows before
    its owned chunk and ``hi`` after, as far as the global tensor reaches (a rank at a global
    edge holds fewer: ``max(0, c - lo)`` to ``min(N, e + hi)`` for an owned chunk ``[c, e)``).
    ``dim`` is sharded by ``Shard(dim)`` on ``mesh_dim`` and by no other mesh dim."""

    dim: int
    mesh_dim: int
    lo: int
    hi: int


@dataclass(frozen=True)
class HaloLayout:
    """The halo a spatial shard carries, as its spec's ``extra``: ``halos`` (in mesh-dim order,
    no zero widths) and ``partial``: the rows (owned ones too) hold this rank's CONTRIBUTION to a
    sum over ranks (a gradient of a tensor that carried a halo), not copies."""

    halos: tuple[Halo, ...]
    partial: bool = False

    def __str__(self) -> str:
        return "halo=" + ",".join(f"dim{h.dim}({h.lo},{h.hi})" for h in self.halos) + \
            (" partial" if self.partial else "")


def halos(spec: DTensorSpec) -> tuple[Halo, ...]:
    """The halos ``spec`` carries (empty for a plain layout)."""
    e = spec.extra
    return e.halos if type(e) is HaloLayout else ()


def halo_partial(spec: DTensorSpec) -> bool:
    """Does ``spec`` carry a partial halo (a gradient's contributions)?"""
    e = spec.extra
    return type(e) is HaloLayout and e.partial


def with_halo(spec: DTensorSpec, halo: Sequence[Halo], partial: bool = False) -> DTensorSpec:
    """``spec`` carrying ``halo`` (widths of 0 dropped; none left: the plain spec)."""
    halo = tuple(h for h in halo if h.lo or h.hi)
    return spec.with_extra(HaloLayout(halo, partial) if halo else None)


# ---------------------------------------------------------------------------------------------
# the depth policy
# ---------------------------------------------------------------------------------------------

_depth: list = ["auto"]


class halo_depth:
    """How many stride-1 layers one halo exchange serves.

    ``halo_depth(n)`` sets it (``n = 1``: every windowed op exchanges its own halo, as before;
    ``"auto"``, the default: :func:`auto_depth`'s latency/compute model per convolution); used as
    a context manager, the previous value comes back on exit::

        with dtshard.spatial.halo_depth(4):
            y = model(x)          # a chain of 4 "same" 3x3 convs exchanges once per side

    The value is read when a forward op plans (it is part of the plan cache key); backward ops
    follow the layout their forward produced, whatever the policy is by then.
    """

    def __init__(self, n) -> None:
        if n != "auto" and not (isinstance(n, int) and n >= 1):
            raise ValueError(f"halo_depth: expected an int >= 1 or 'auto', got {n!r}")
        self.prev = _depth[0]
        _depth[0] = n

    def __enter__(self) -> "halo_depth":
        return self

    def __exit__(self, *exc) -> None:
        _depth[0] = self.prev


def get_halo_depth():
    """The current policy: an int >= 1 or ``"auto"``."""
    return _depth[0]


class model:
    """Constants of the ``"auto"`` depth model, measured with ``python
    benchmarks/bench_halo_chain.py --model`` (2-core CPU, gloo; see benchmarks/README.md):

    ``latency_s``: one halo exchange's fixed cost (an all_to_all of a row each way, plus its
    packing and the window's assembly: 0.49 ms on 2 ranks, 2.3 ms on 4 ranks sharing 2 cores);
    ``flops_per_s``: a 3x3 convolution's local throughput in training (5.2-9.0e10 FLOP/s on one
    core).  Set them for
    another machine (a GPU with NCCL has a far higher throughput, so its depths come out deeper).
    """

    latency_s: float = 5e-4
    flops_per_s: float = 5e10
    max_depth: int = 8
    #: the most extra rows (both sides) the first layer of a chain may compute, as a fraction of
    #: the shard's width: the bound on the extra compute and activation memory
    max_extra: float = 0.25


def auto_depth(row_flops: float, radius: int, width: int) -> int:
    """The depth that minimises a layer's cost under the latency/compute model.

    One exchange per ``n`` layers costs ``latency / n`` per layer; growing the halo for ``n``
    layers of radius ``r`` computes ``r (n - 1)`` extra rows per layer on average (both sides),
    each ``row_flops / flops_per_s`` seconds.  The minimum of ``latency / n + r (n - 1) t_row`` is
    at ``n = sqrt(latency / (r t_row))``; clamped to ``[1, max_depth]`` and so that the widest
    layer's extra rows ``2 r (n - 1)`` stay within ``max_extra`` of the shard's ``width`` (extra
    compute and activation memory).  A convolution then learns how many layers its chain really
    has (``spatial.conv_halo.learn``) and fetches no more.  Inputs are global metadata (the same on
    every rank)."""
    if radius <= 0 or row_flops <= 0:
        return 1
    t_row = row_flops / model.flops_per_s
    n = int(round(math.sqrt(model.latency_s / (radius * t_row))))
    n = min(n, model.max_depth, 1 + int(model.max_extra * width) // (2 * radius))
    return max(1, n)


# ---------------------------------------------------------------------------------------------
# arithmetic (pure metadata)
# ---------------------------------------------------------------------------------------------


def ext_range(n_len: int, n: int, q: int, lo: int, hi: int) -> tuple[int, int]:
    """Global ``[start, stop)`` that rank ``q`` of ``n`` holds with a halo ``(lo, hi)``."""
    c, ln = chunk_range(n_len, n, q)
    return max(0, c - lo), min(n_len, c + ln + hi)


@functools.lru_cache(maxsize=4096)
def grow_plan(n_len: int, n: int, me: int, lo: int, hi: int) -> H.WindowPlan:
    """The exchange that turns every rank's owned chunk into its extended range (and, run
    backwards with ``halo.accumulate``, a partial extended tensor into the owned sums)."""
    return H.range_plan(n_len, n_len, n, me, tuple(ext_range(n_len, n, q, lo, hi) for q in range(n)))


def _offsets(spec: DTensorSpec, h: Halo, coord) -> tuple[int, int, int, int]:
    """``(s, c, e, t)``: extended start, owned start/stop, extended stop (global)."""
    n_len, n, q = spec.shape[h.dim], spec.mesh_shape[h.mesh_dim], coord[h.mesh_dim]
    c, ln = chunk_range(n_len, n, q)
    s, t = ext_range(n_len, n, q, h.lo, h.hi)
    return s, c, c + ln, t


def halo_widths(spec: DTensorSpec, dim: int) -> tuple[int, int]:
    """Nominal ``(lo, hi)`` of ``spec``'s halo on tensor dim ``dim`` (0, 0 without one)."""
    for h in halos(spec):
        if h.dim == dim:
            return h.lo, h.hi
    return 0, 0


def ext_shape(spec: DTensorSpec, coord) -> tuple[int, ...]:
    """This rank's local shape under ``spec`` (the owned shape widened by the halo)."""
    shape = list(spec.local_shape(coord))
    for h in halos(spec):
        s, _, _, t = _offsets(spec, h, coord)
        shape[h.dim] = t - s
    return tuple(shape)


def _target(halo_to: Sequence[Halo], h: Halo) -> Halo:
    for g in halo_to:
        if g.dim == h.dim:
            return g
    return Halo(h.dim, h.mesh_dim, 0, 0)


# ---------------------------------------------------------------------------------------------
# local tensors
# ---------------------------------------------------------------------------------------------


def narrow_local(local: torch.Tensor, spec: DTensorSpec, halo_to: Sequence[Halo], coord) -> torch.Tensor:
    """A replicated extended ``local`` (under ``spec``) narrowed to the halo ``halo_to`` (every
    width at most ``spec``'s; a view, no copy).  For partial tensors use :func:`pad_local`."""
    for h in halos(spec):
        g = _target(halo_to, h)
        if (g.lo, g.hi) == (h.lo, h.hi):
            continue
        s, _, _, t = _offsets(spec, h, coord)
        s2, _, _, t2 = _offsets(spec, g, coord)
        if s2 < s or t2 > t:
            raise AssertionError(f"narrow_local: {g} is wider than {h} of {spec}")
        local = local.narrow(h.dim, s2 - s, t2 - s2)
    return local


def pad_local(local: torch.Tensor, spec: DTensorSpec, halo_to: Sequence[Halo], coord) -> torch.Tensor:
    """A partial extended ``local`` (under ``spec``; a plain shard is a partial one with no halo)
    widened with zero contributions to the halo ``halo_to`` (every width at least ``spec``'s)."""
    import dtshard_kernels as K

    have = {h.dim: h for h in halos(spec)}
    for g in halo_to:
        h = have.get(g.dim, Halo(g.dim, g.mesh_dim, 0, 0))
        if (g.lo, g.hi) == (h.lo, h.hi):
            continue
        s, _, _, t = _offsets(spec, h, coord)
        s2, _, _, t2 = _offsets(spec, g, coord)
        if s2 > s or t2 < t:
            raise AssertionError(f"pad_local: {g} is narrower than {h} of {spec}")
        if s - s2 or t2 - t:
            local = K.halo_cat([local], g.dim, s - s2, t2 - t)
    return local


def plain_local(dt) -> torch.Tensor:
    """``dt``'s owned shard as a plain local tensor: a narrow of a replicated halo, or, for a
    partial one, the owners' sums (one ``halo.accumulate`` per halo dim, in reverse order: a
    collective, entered by every rank alike since the spec is the same everywhere)."""
    spec = dt._spec
    local = dt._local_tensor
    if not halos(spec):
        return local
    coord = C.mesh_coordinate(spec.mesh)
    if not halo_partial(spec):
        return narrow_local(local, spec, (), coord)
    for h in reversed(halos(spec)):
        plan = grow_plan(spec.shape[h.dim], spec.mesh_shape[h.mesh_dim], coord[h.mesh_dim], h.lo, h.hi)
        local = H.accumulate(local, plan, h.dim, spec.mesh, h.mesh_dim)
    return local


def strip(dt):
    """A DTensor of the same global tensor and placements without a halo (below autograd: a new
    wrapper, no graph).  ``dt`` itself when it has none."""
    if not halos(dt._spec):
        return dt

    return DTensor(plain_local(dt), dt._spec.plain, requires_grad=False)


def demote_(dt) -> None:
    """Drop ``dt``'s halo IN PLACE (its local tensor becomes the owned shard): for an op that
    writes into ``dt`` without knowing halos, and for partial halos, whose resolution is a
    collective worth doing once."""
    if halos(dt._spec):
        local = plain_local(dt)
        dt._local_tensor = local
        dt._spec = dt._spec.plain


_V = hooks.LAYOUT_VERSION  # the tensor class stamps the version the halo was made at


def stale(dt) -> bool:
    """Has an op written into ``dt`` (or an alias of it) since its halo was made?"""
    return bool(halos(dt._spec)) and dt.__dict__.get(_V) != dt._version


def fresh(dt) -> None:
    """Drop ``dt``'s halo in place when an op wrote into ``dt`` (or into a tensor it aliases,
    which shares its version counter) since the halo was made: the owned rows are then current
    but the neighbours' copies may not be.  Every op that reads halo rows calls this first."""
    if stale(dt):
        demote_(dt)


def written(dt) -> None:
    """``dt``'s halo rows were just written consistently with its owned rows (an in-place op
    that computes on them): valid after the version bump the write makes."""
    dt.__dict__[_V] = dt._version + 1


def grow_local(local: torch.Tensor, spec: DTensorSpec, halo_to: Sequence[Halo], coord, *, keep: bool = False):
    """The plain shard ``local`` (under the plain ``spec``) widened to the replicated halo
    ``halo_to``: one exchange per halo dim, in mesh-dim order (a later dim's exchange moves the
    rows the earlier ones brought, so corners arrive).  ``keep``: also return what each exchange
    received, so :func:`regrow_local` rebuilds the same tensor without traffic."""
    recvs = []
    for g in halo_to:
        plan = grow_plan(spec.shape[g.dim], spec.mesh_shape[g.mesh_dim], coord[g.mesh_dim], g.lo, g.hi)
        if keep:
            local, recv = H.exchange_keep(local, plan, g.dim, spec.mesh, g.mesh_dim)
            recvs.append(recv)
        else:
            local = H.exchange(local, plan, g.dim, spec.mesh, g.mesh_dim)
    return (local, recvs) if keep else local


def regrow_local(local: torch.Tensor, spec: DTensorSpec, halo_to: Sequence[Halo], coord, recvs) -> torch.Tensor:
    """:func:`grow_local` again from what its exchanges received (no traffic)."""
    for g, recv in zip(halo_to, recvs):
        plan = grow_plan(spec.shape[g.dim], spec.mesh_shape[g.mesh_dim], coord[g.mesh_dim], g.lo, g.hi)
        local = H.window_from(local, recv, plan, g.dim)
    return local


def accumulate_local(local: torch.Tensor, spec: DTensorSpec, halo: Sequence[Halo], coord) -> torch.Tensor:
    """A partial extended ``local`` with ``halo`` (over the plain ``spec``) reduced to the owned
    sums (the adjoint of :func:`grow_local`)."""
    for g in reversed(tuple(halo)):
        plan = grow_plan(spec.shape[g.dim], spec.mesh_shape[g.mesh_dim], coord[g.mesh_dim], g.lo, g.hi)
        local = H.accumulate(local, plan, g.dim, spec.mesh, g.mesh_dim)
    return local
