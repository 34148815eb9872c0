"""Convolutions on halo layouts (see halo_layout.py): the planning and the local window of each call.

A convolution qualifies when every mesh dim shards the batch, shards a spatial dim or
replicates, the weight and bias are replicated, and every sharded spatial dim has stride 1 and
"same" padding ``p = d (k - 1) / 2`` (so the output has the input's length and chunk layout).
Per sharded dim, with nominal widths:

* forward, input halo ``(lo, hi)`` with ``lo, hi >= p``: the output carries ``(lo - p, hi - p)``;
  no communication (a 1x1 convolution, ``p = 0``, keeps the halo as it is);
* forward, a narrower input halo and a depth ``n >= 2`` (:func:`layout.halo_depth`): ONE
  exchange widens the plain input to ``n p`` and the output carries ``(n - 1) p``;
* backward, output gradient with a partial halo ``(a, b)`` (``(0, 0)``: a plain shard): the
  input gradient is computed on the input rows ``(a + p, b + p)`` around the shard.  When the
  input carries at least that halo, the result is a partial halo of those widths (no
  communication); otherwise the input is plain (the chain's first convolution): its window comes
  from what the forward's exchange received (kept on the input) or from an exchange, and the
  gradient's halo is sent back to its owners once (``halo.accumulate``).

Every rank computes its local window from metadata alone: the extended ranges of halo_layout.py, zero
padding only at the global edges.
"""

from __future__ import annotations

import math

import dtshard_kernels as K
import torch

from dtshard.spatial import halo_layout as L
from dtshard.spatial.halo_layout import Halo, halo_partial, halos, with_halo
from dtshard.spec import chunk_range

__all__ = ["forward_plan", "backward_plan", "widening_for", "window", "KEPT", "SITE", "Site"]

#: attribute of a plain convolution input whose forward widened it: ``(its version, the halo it
#: was widened to, what each exchange received)``; the backward rebuilds the window from it
KEPT = "_dtshard_halo_kept"


#: attribute of a DTensor whose halo a widening convolution fetched: that widening's
#: :class:`Site` (pointwise ops, norms and consuming convolutions pass it on)
SITE = "_dtshard_halo_site"
#: attributes of a convolution's weight under the "auto" depth: its last widening's Site, and
#: the depth its chain was seen to need
LAST, CAP = "_dtshard_halo_last", "_dtshard_halo_cap"


class Site:
    """How far the rows one widening convolution fetched were used: ``width`` rows per side
    fetched, ``used`` the most any later convolution of its chain consumed (``width`` minus its
    output's halo).  The ``"auto"`` depth learns the chain's length from it (:func:`learn`).  All
    of it is metadata, the same on every rank (every rank runs the same ops)."""

    __slots__ = ("width", "used", "radius")

    def __init__(self, width: int, radius: int):
        self.width, self.used, self.radius = width, 0, radius

    def consumed(self, out_halo) -> None:
        left = min(min(h.lo, h.hi) for h in out_halo) if out_halo else 0
        self.used = max(self.used, self.width - left)


def learn(w) -> int | None:
    """The depth cap of the convolution with weight ``w``: the most layers of its widenings'
    rows its chains were seen to use (a chain that used every row may be longer; it is then
    served at the depth seen, which the model chose).  Kept on the weight, so it holds for every
    input shape of that layer (a larger input does not widen further than its chain needs)."""
    last = w.__dict__.pop(LAST, None)
    if last is not None and last.used > 0:
        need = -(-last.used // last.radius)
        w.__dict__[CAP] = max(need, w.__dict__.get(CAP, 0))
    return w.__dict__.get(CAP)


class HaloConv:
    """The halo part of a cached convolution plan (forward or backward)."""

    __slots__ = ("dims", "grow", "need", "out_halo", "windows", "partial_out", "out_local_shape", "out_spec",
                 "depth", "learns", "replan", "capped")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


def _qualifies(modes, stride, padding, dilation, k_sizes, transposed) -> list | None:
    """``[(mesh dim, tensor dim, p)]`` of the sharded spatial dims, or None."""
    if transposed:
        return None
    dims = []
    for i, (mode, d) in enumerate(modes):
        if mode == "spatial":
            j = d - 2
            eff = dilation[j] * (k_sizes[j] - 1)
            if stride[j] != 1 or eff % 2 or 2 * padding[j] != eff:
                return None
            dims.append((i, d, padding[j]))
        elif mode not in ("batch", "rep"):
            return None
    return dims or None


def _windows(spec, in_halo, out_halo, dims, coord) -> list:
    """Per sharded dim: ``(dim, narrow start, narrow length, pad left, pad right)`` taking the
    convolution's window for the output range ``out_halo`` from the input range ``in_halo``."""
    out = []
    for (i, d, p), hi_, ho in zip(dims, in_halo, out_halo):
        n_len, n, q = spec.shape[d], spec.mesh_shape[i], coord[i]
        s_in, t_in = L.ext_range(n_len, n, q, hi_.lo, hi_.hi)
        s_o, t_o = L.ext_range(n_len, n, q, ho.lo, ho.hi)
        start, stop = max(0, s_o - p), min(n_len, t_o + p)
        if t_o <= s_o:  # no output rows here: the (all-zero) input gradient has the input's rows
            out.append((d, 0, t_in - s_in, 0, 0))
            continue
        if start < s_in or stop > t_in:
            raise AssertionError(f"halo conv: window [{start}, {stop}) outside the input's [{s_in}, {t_in}) on dim {d}")
        out.append((d, start - s_in, stop - start, start - (s_o - p), (t_o + p) - stop))
    return out


def window(xl: torch.Tensor, windows) -> torch.Tensor:
    """The local convolution's input: the extended shard narrowed and zero-padded per dim."""
    for d, start, length, pad_l, pad_r in windows:
        if start or length != xl.shape[d]:
            xl = xl.narrow(d, start, length)
        if pad_l or pad_r:
            xl = K.halo_cat([xl], d, pad_l, pad_r)
    return xl


def _depth(x_spec, w_shape, groups, dims, coord) -> int:
    n = L.get_halo_depth()
    if n != "auto":
        return n
    # the model's inputs: global shapes over the mesh (the same on every rank)
    per_rank = list(x_spec.shape)
    for i, p in enumerate(x_spec.placements):
        if type(p).__name__ == "Shard":
            per_rank[p.dim] = chunk_range(x_spec.shape[p.dim], x_spec.mesh_shape[i], 0)[1]
    c_out, c_in_g = w_shape[0], w_shape[1]
    k = math.prod(w_shape[2:])
    radius = max(p for _, _, p in dims)
    d0 = dims[0][1]
    rows = math.prod(per_rank[2:]) // max(1, per_rank[d0])
    row_flops = 2.0 * per_rank[0] * c_out * c_in_g * k * rows
    width = min(per_rank[d] for _, d, _ in dims)
    return L.auto_depth(row_flops, radius, width)


def forward_plan(x_spec, out_spec, modes, stride, padding, dilation, w_shape, groups, transposed, coord,
                 targets_none: bool, cap: int | None = None):
    """The :class:`HaloConv` of a forward call, or None (the call runs as usual, without halos).
    ``cap``: the most layers a widening may serve (learned under ``"auto"``: see :class:`Site`)."""
    if not targets_none or halo_partial(x_spec):
        return None
    dims = _qualifies(modes, stride, padding, dilation, list(w_shape[2:]), transposed)
    if dims is None or any(h.dim not in {d for _, d, _ in dims} for h in halos(x_spec)):
        return None
    have = [L.halo_widths(x_spec, d) for _, d, _ in dims]
    if halos(x_spec) and all(lo >= p and hi >= p for (_, _, p), (lo, hi) in zip(dims, have)):
        grow = None
        in_halo = tuple(Halo(d, i, lo, hi) for (i, d, _), (lo, hi) in zip(dims, have))
        out_halo = tuple(Halo(d, i, lo - p, hi - p) for (i, d, p), (lo, hi) in zip(dims, have))
    else:
        if not any(p for _, _, p in dims):
            return None
        n = _depth(x_spec, w_shape, groups, dims, coord)
        if cap is not None:
            n = min(n, cap)
        if n < 2:
            return None
        grow = in_halo = tuple(Halo(d, i, n * p, n * p) for i, d, p in dims)
        out_halo = tuple(Halo(d, i, (n - 1) * p, (n - 1) * p) for i, d, p in dims)
    spec = with_halo(out_spec, out_halo)
    args = (x_spec, out_spec, modes, stride, padding, dilation, w_shape, groups, transposed, coord, targets_none)
    return HaloConv(dims=dims, grow=tuple(h for h in grow if h.lo or h.hi) if grow else None, need=in_halo,
                    out_halo=out_halo, windows=_windows(with_halo(x_spec.plain, in_halo), in_halo, out_halo, dims, coord),
                    partial_out=False, out_local_shape=L.ext_shape(spec, coord), out_spec=spec,
                    depth=n if grow else None, learns=bool(grow) and L.get_halo_depth() == "auto",
                    replan=lambda cap: forward_plan(*args, cap=cap), capped={})


def widening_for(hp: HaloConv, w) -> tuple:
    """``(the plan to run, its Site or None)`` of a widening convolution with weight ``w``: under
    ``"auto"``, the plan capped at the depth this layer's chains were seen to need (None: a halo
    does not pay here)."""
    if not hp.learns:
        return hp, None
    cap = learn(w)
    if cap is not None and cap < hp.depth:
        if cap not in hp.capped:
            hp.capped[cap] = hp.replan(cap)
        hp = hp.capped[cap]
        if hp is None:
            return None, None
    site = Site(min(min(h.lo, h.hi) for h in hp.grow), max(p for _, _, p in hp.dims))
    w.__dict__[LAST] = site
    return hp, site


def backward_plan(g_spec, x_spec, modes, stride, padding, dilation, w_shape, transposed, coord, targets_none: bool,
                  kept: bool = False):
    """The :class:`HaloConv` of a ``convolution_backward`` call whose output gradient or input
    carries a halo, or None (then both are used without).  ``kept``: the plan for plain ones
    whose forward widened the input (it kept the rows that arrived: :data:`KEPT`)."""
    if not targets_none or (halos(x_spec) and halo_partial(x_spec)):
        return None
    dims = _qualifies(modes, stride, padding, dilation, list(w_shape[2:]), transposed)
    if dims is None:
        return None
    spatial = {d for _, d, _ in dims}
    if any(h.dim not in spatial for h in halos(g_spec)) or any(h.dim not in spatial for h in halos(x_spec)):
        return None
    g_halo = tuple(Halo(d, i, *L.halo_widths(g_spec, d)) for i, d, _ in dims) if halo_partial(g_spec) \
        else tuple(Halo(d, i, 0, 0) for i, d, _ in dims)
    need = tuple(Halo(d, i, g.lo + p, g.hi + p) for (i, d, p), g in zip(dims, g_halo))
    have = [L.halo_widths(x_spec, d) for _, d, _ in dims]
    local = bool(halos(x_spec)) and all(lo >= n.lo and hi >= n.hi for (lo, hi), n in zip(have, need))
    if not local and not halo_partial(g_spec) and not (kept and not halos(g_spec) and not halos(x_spec)):
        return None  # nothing carried a usable halo: the usual path
    return HaloConv(dims=dims, grow=None if local else tuple(h for h in need if h.lo or h.hi), need=need,
                    out_halo=g_halo, windows=_windows(with_halo(x_spec.plain, need), need, g_halo, dims, coord),
                    partial_out=local, out_local_shape=L.ext_shape(with_halo(x_spec.plain, need), coord), out_spec=None,
                    depth=None, learns=False, replan=None, capped=None)
