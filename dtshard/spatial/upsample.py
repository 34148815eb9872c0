"""Interpolation (nearest / linear) and reflection / replication padding over DTensors, including
spatially sharded inputs.

All these ops map each output position of a spatial dim to a few input positions of the same dim
(an *index map*), independently per dim and per (batch, channel) plane:

- ``upsample_nearest{1,2,3}d`` and ``_upsample_nearest_exact{1,2,3}d``: output ``o`` copies input
  ``idx[o]``;
- ``reflection_pad{1,2,3}d`` / ``replication_pad{1,2,3}d``: output ``o`` copies input ``idx[o]``
  (reflected / clamped at the global edges);
- ``upsample_linear1d`` / ``upsample_bilinear2d`` / ``upsample_trilinear3d`` (``align_corners`` True or
  False): output ``o`` is ``l0[o] * x[i0[o]] + l1[o] * x[i1[o]]`` with ``i1 = i0 + 1`` except at
  the last input (a 1-element halo).

Gather maps (nearest, padding) are computed by running the op itself on ``arange(N)`` along one
dim (float64, exact), so they are PyTorch's own arithmetic, bit for bit, for every scale, size,
``scale_factor`` and padding.  Linear maps are computed with PyTorch's formulas
(``area_pixel_compute_scale``, ``area_pixel_compute_source_index``, ``guard_index_and_lambda``) in
the op's ``opmath`` dtype.

Layout, per mesh dim (like pooling):

- ``Shard(d)`` on a non-spatial dim (batch, channels) is kept;
- ``Shard(d)`` on a spatial dim: the OUTERMOST mesh dim sharding it keeps ``Shard(d)`` in the chunk
  layout of the OUTPUT length (inner ones are replicated first).  Rank ``r``'s output chunk
  ``[a, b)`` reads the input range ``[min idx[a:b], max idx[a:b] + 1)`` (``[i0[a], i1[b-1] + 1)``
  for linear); :func:`dtshard.spatial.halo.range_plan` turns the ranges of all ranks into one uneven
  all_to_all (halos from neighbours, multi-hop when a range spans several shards: downsampling,
  tiny shards, reflection of a short edge shard; nothing when every range lies in its own shard,
  e.g. nearest x2 with even chunks).  The sharded dims are then resampled locally by a gather
  (``index_select``) or a two-tap lerp on the window, the other spatial dims by the op itself
  (with identity sizes on the sharded dims);
- ``Partial``: gathers keep every reduce op (a copy commutes with sum/avg/max/min); linear
  interpolation keeps ``sum``/``avg``; the rest is replicated.

When a rank's window is one the op itself resamples exactly as the global op (nearest with an
integer factor whose chunk boundaries line up: the window is the rank's own shard and the local
op's probed index map equals the global one shifted), the op runs directly on the local shard.

Backward (``*_backward``): the transpose, per dim: ``index_add`` of the gradient into the window
(``l0``/``l1``-weighted for linear), the op's own backward for the unsharded spatial dims, and
``halo.accumulate`` to send halo gradients back to their owners, who add them.  Placements follow
the gradient's (``Partial`` sum/avg kept: the backward is linear).

Forward outputs are exact (gathers copy; linear agrees to float rounding, since PyTorch's CPU
kernels themselves choose between separable and direct formulas by size and layout).  Bicubic and
antialiased modes are not handled here (``misc.py`` replicates them: correct).
"""

from __future__ import annotations

import functools
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard import collectives as C
from dtshard.spatial import halo
from dtshard.registry import register_handler
from dtshard.handlers import bind, check_dtensors, make_spec, meta_run, op_context, to_local, wrap
from dtshard.spatial.conv import spatial_shards
from dtshard.spec import DTensorSpec, chunk_range
from dtshard.tensor import DTensor

aten = torch.ops.aten

__all__ = ["interp_handler", "interp_backward_handler", "pad_handler", "pad_backward_handler"]

R = Replicate()
_ALL_REDUCE = frozenset({"sum", "avg", "max", "min"})
_LINEAR_REDUCE = frozenset({"sum", "avg"})

# op -> (kind, number of spatial dims, 1-D op used to probe gather maps)
_INTERP = {
    aten.upsample_nearest1d.default: ("nearest", 1, aten.upsample_nearest1d.default),
    aten.upsample_nearest2d.default: ("nearest", 2, aten.upsample_nearest1d.default),
    aten.upsample_nearest3d.default: ("nearest", 3, aten.upsample_nearest1d.default),
    aten._upsample_nearest_exact1d.default: ("nearest", 1, aten._upsample_nearest_exact1d.default),
    aten._upsample_nearest_exact2d.default: ("nearest", 2, aten._upsample_nearest_exact1d.default),
    aten._upsample_nearest_exact3d.default: ("nearest", 3, aten._upsample_nearest_exact1d.default),
    aten.upsample_linear1d.default: ("linear", 1, None),
    aten.upsample_bilinear2d.default: ("linear", 2, None),
    aten.upsample_trilinear3d.default: ("linear", 3, None),
}
_INTERP_BWD = {
    aten.upsample_nearest1d_backward.default: aten.upsample_nearest1d.default,
    aten.upsample_nearest2d_backward.default: aten.upsample_nearest2d.default,
    aten.upsample_nearest3d_backward.default: aten.upsample_nearest3d.default,
    aten._upsample_nearest_exact1d_backward.default: aten._upsample_nearest_exact1d.default,
    aten._upsample_nearest_exact2d_backward.default: aten._upsample_nearest_exact2d.default,
    aten._upsample_nearest_exact3d_backward.default: aten._upsample_nearest_exact3d.default,
    aten.upsample_linear1d_backward.default: aten.upsample_linear1d.default,
    aten.upsample_bilinear2d_backward.default: aten.upsample_bilinear2d.default,
    aten.upsample_trilinear3d_backward.default: aten.upsample_trilinear3d.default,
}
_PAD = {
    aten.reflection_pad1d.default: (1, aten.reflection_pad1d.default),
    aten.reflection_pad2d.default: (2, aten.reflection_pad1d.default),
    aten.reflection_pad3d.default: (3, aten.reflection_pad1d.default),
    aten.replication_pad1d.default: (1, aten.replication_pad1d.default),
    aten.replication_pad2d.default: (2, aten.replication_pad1d.default),
    aten.replication_pad3d.default: (3, aten.replication_pad1d.default),
}
_PAD_BWD = {
    aten.reflection_pad1d_backward.default: aten.reflection_pad1d.default,
    aten.reflection_pad2d_backward.default: aten.reflection_pad2d.default,
    aten.reflection_pad3d_backward.default: aten.reflection_pad3d.default,
    aten.replication_pad1d_backward.default: aten.replication_pad1d.default,
    aten.replication_pad2d_backward.default: aten.replication_pad2d.default,
    aten.replication_pad3d_backward.default: aten.replication_pad3d.default,
}


# ---------------------------------------------------------------------------------------------
# index maps (metadata; cached)
# ---------------------------------------------------------------------------------------------


def _no_fake():
    """Index maps are metadata computed on real tensors: outside every dispatch mode (fake,
    functionalization and proxy modes under ``torch.compile``), so they are neither faked nor traced."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def _local_map(mp: "_Map", a: int, b: int, lo: int) -> tuple:
    """``mp.local(a, b, lo)``: the index / weight tensors an op on the window reads.  Under
    ``torch.compile`` they are rebuilt from their values inside the trace (graph constants): the
    cached real tensors cannot mix with fake ones."""
    if not torch.compiler.is_compiling():
        return mp.local(a, b, lo)
    with _no_fake():
        values = [(t.tolist(), t.dtype) for t in mp.local(a, b, lo)]
    return tuple(torch.tensor(v, dtype=dtype) for v, dtype in values)


class _Map:
    """One spatial dim's index map from output positions ``[0, M)`` to input positions ``[0, N)``.

    ``idx`` (gather) or ``i0, i1, l0, l1`` (linear), all of length ``M``.  Per-rank windows and
    local index tensors are memoised on the object (it is itself cached per shape and scale)."""

    def __init__(self, n_in: int, m_out: int, idx=None, lin=None) -> None:
        self.n_in, self.m_out = n_in, m_out
        self.idx = idx
        self.lin = lin  # (i0, i1, l0, l1)
        self.lo_map = idx if idx is not None else lin[0]
        self.hi_map = idx if idx is not None else lin[1]
        self._windows: dict = {}
        self._local: dict = {}

    @property
    def gather(self) -> bool:
        return self.idx is not None

    def windows(self, n: int) -> tuple[tuple[int, int], ...]:
        """``(lo, hi)`` of the input range each of ``n`` ranks' output chunk reads."""
        w = self._windows.get(n)
        if w is None:
            out = []
            for r in range(n):
                a, ln = chunk_range(self.m_out, n, r)
                if ln == 0:
                    out.append((0, 0))
                else:
                    out.append((int(self.lo_map[a : a + ln].min()), int(self.hi_map[a : a + ln].max()) + 1))
            w = self._windows[n] = tuple(out)
        return w

    def local(self, a: int, b: int, lo: int):
        """The map of outputs ``[a, b)`` in window coordinates (the window starts at input ``lo``)."""
        key = (a, b, lo)
        hit = self._local.get(key)
        if hit is None:
            if self.gather:
                hit = (self.idx[a:b] - lo,)
            else:
                i0, i1, l0, l1 = self.lin
                hit = (i0[a:b] - lo, i1[a:b] - lo, l0[a:b], l1[a:b])
            if len(self._local) > 256:
                self._local.clear()
            self._local[key] = hit
        return hit


def _probe(op, n_in: int, *extra) -> torch.Tensor:
    """``op`` applied to ``arange(n_in)`` (float64, shape (1, 1, N)): its own gather map."""
    with _no_fake():
        x = torch.arange(n_in, dtype=torch.float64).view(1, 1, n_in)
        return op(x, *extra).view(-1).to(torch.int64)


@functools.lru_cache(maxsize=1024)
def _nearest_map(probe_op, n_in: int, m_out: int, scale) -> _Map:
    return _Map(n_in, m_out, idx=_probe(probe_op, n_in, [m_out], scale))


@functools.lru_cache(maxsize=1024)
def _pad_map(probe_op, n_in: int, p_l: int, p_r: int) -> _Map:
    return _Map(n_in, n_in + p_l + p_r, idx=_probe(probe_op, n_in, [p_l, p_r]))


def _opmath(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@functools.lru_cache(maxsize=1024)
def _linear_map(n_in: int, m_out: int, align_corners: bool, scale, opmath: torch.dtype) -> _Map:
    """PyTorch's ``compute_source_index_and_lambda`` for every output position."""
    with _no_fake():
        o = torch.arange(m_out, dtype=torch.int64)
        if m_out == n_in:  # "scale_factor = 1, simply copy"
            one = torch.ones(m_out, dtype=opmath)
            return _Map(n_in, m_out, lin=(o, o.clone(), one, torch.zeros(m_out, dtype=opmath)))
        of = o.to(opmath)
        if align_corners:
            s = (torch.tensor(n_in - 1, dtype=opmath) / (m_out - 1)) if m_out > 1 else torch.tensor(0, dtype=opmath)
            real = s * of
        else:
            if scale is not None and scale > 0:
                s = torch.tensor(1.0 / scale, dtype=opmath)
            else:
                s = torch.tensor(n_in, dtype=opmath) / m_out
            real = s * (of + 0.5) - 0.5
            real = torch.where(real < 0, torch.zeros((), dtype=opmath), real)
        # guard_index_and_lambda (floorf: a float floor, also for double)
        i0 = torch.clamp(torch.floor(real.to(torch.float32)).to(torch.int64), max=n_in - 1)
        l1 = torch.clamp(real - i0.to(opmath), 0, 1)
        i1 = i0 + (i0 < n_in - 1).to(torch.int64)
        l0 = 1 - l1
        return _Map(n_in, m_out, lin=(i0, i1, l0, l1))


# ---------------------------------------------------------------------------------------------
# local steps along one sharded dim
# ---------------------------------------------------------------------------------------------


def _bview(w: torch.Tensor, ndim: int, d: int) -> torch.Tensor:
    shape = [1] * ndim
    shape[d] = -1
    return w.view(shape)


def _apply(x: torch.Tensor, mp: _Map, d: int, a: int, b: int, lo: int) -> torch.Tensor:
    loc = _local_map(mp, a, b, lo)
    if mp.gather:
        return x.index_select(d, loc[0])
    i0, i1, l0, l1 = loc
    y = x.index_select(d, i0) * _bview(l0, x.dim(), d) + x.index_select(d, i1) * _bview(l1, x.dim(), d)
    return y.to(x.dtype)


def _apply_transpose(g: torch.Tensor, mp: _Map, d: int, a: int, b: int, lo: int, length: int) -> torch.Tensor:
    loc = _local_map(mp, a, b, lo)
    shape = list(g.shape)
    shape[d] = length
    if mp.gather:
        return g.new_zeros(shape).index_add_(d, loc[0], g)
    i0, i1, l0, l1 = loc
    acc = g.new_zeros(shape, dtype=torch.promote_types(g.dtype, l0.dtype))
    acc.index_add_(d, i0, g * _bview(l0, g.dim(), d))
    acc.index_add_(d, i1, g * _bview(l1, g.dim(), d))
    return acc.to(g.dtype)


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------


def _targets(spec: DTensorSpec, nsp: int, partial_ok: frozenset):
    first = spec.ndim - nsp
    spatial = spatial_shards(spec.placements, first, spec.ndim)
    out = []
    for i, p in enumerate(spec.placements):
        if isinstance(p, Shard) and (p.dim < first or i in spatial):
            out.append(p)
        elif isinstance(p, Partial) and p.reduce_op in partial_ok:
            out.append(p)
        else:
            out.append(R)
    return tuple(out), spatial


class _Dim:
    """One sharded spatial dim of one call, on this rank.

    ``mode``: ``'gather'`` (the explicit map on the window), ``'local'`` (the op itself on the
    window reproduces the global map of this rank's outputs: the aligned fast path, no gather) or
    ``'full'`` (the op itself on the whole dim, then this rank's output chunk is kept; backward: the
    gradient chunk zero-padded to the whole dim; for nearest index maps PyTorch's kernels disagree
    on, see :func:`_ambiguous`)."""

    __slots__ = ("i", "d", "j", "plan", "map", "mode")

    def __init__(self, i, d, j, plan, mp, mode) -> None:
        self.i, self.d, self.j, self.plan, self.map, self.mode = i, d, j, plan, mp, mode


def _dims(mesh, coord, spatial, first, in_shape, out_shape, map_of, local_ok=None, full=None) -> list[_Dim]:
    """The sharded spatial dims in mesh-dim order, with their plans (metadata only: every rank
    computes every rank's window, so the exchanges agree)."""
    with _no_fake():
        return _dims_impl(mesh, coord, spatial, first, in_shape, out_shape, map_of, local_ok, full)


def _dims_impl(mesh, coord, spatial, first, in_shape, out_shape, map_of, local_ok, full) -> list[_Dim]:
    dims = []
    for i, d in spatial.items():
        j = d - first
        n_in, m_out, n = in_shape[d], out_shape[d], mesh.shape[i]
        if full is not None and full(j):
            wins = tuple((0, n_in) if chunk_range(m_out, n, r)[1] else (0, 0) for r in range(n))
            plan = halo.range_plan(n_in, m_out, n, coord[i], wins)
            dims.append(_Dim(i, d, j, plan, None, "full"))
            continue
        mp = map_of(j)
        plan = halo.range_plan(n_in, m_out, n, coord[i], mp.windows(n))
        mode = "local" if local_ok is not None and local_ok(j, plan, mp) else "gather"
        dims.append(_Dim(i, d, j, plan, mp, mode))
    return dims


def _shortcut(n_in: int, m_out: int):
    """PyTorch's ``nearest_idx`` special cases (``M == N``: copy; ``M == 2N``: ``o >> 1``)."""
    o = torch.arange(m_out, dtype=torch.int64)
    if m_out == n_in:
        return o
    if m_out == 2 * n_in:
        return o // 2
    return None


def _ambiguous(probe_op, n_in: int, m_out: int, scale) -> bool:
    """Legacy nearest only: with ``M == N`` or ``M == 2N`` and a ``scale`` that disagrees, PyTorch's
    1-D/3-D forward kernels use the float formula while the 2-D forward and every backward kernel
    use the shortcut (so the global op's own forward and backward disagree).  Such a dim is
    computed by the op itself on the whole dim ('full' mode), reproducing whatever it does."""
    if probe_op is not aten.upsample_nearest1d.default:
        return False
    with _no_fake():
        cut = _shortcut(n_in, m_out)
        return cut is not None and not torch.equal(cut, _nearest_map(probe_op, n_in, m_out, scale).idx)


def _nearest_local_ok(probe_op, scales):
    """The aligned fast path for nearest: this rank's window gives, under the op itself, exactly
    the global map of its outputs (and not through a special case the kernels disagree on)."""

    def ok(j, plan, mp) -> bool:
        w, m = plan.window_length, plan.b - plan.a
        if w == 0 or m == 0 or _ambiguous(probe_op, w, m, scales[j]):
            return False
        local = _nearest_map(probe_op, w, m, scales[j]).idx
        return bool(torch.equal(local, mp.idx[plan.a : plan.b] - plan.lo))

    return ok


def _check(op, t: torch.Tensor, spec: DTensorSpec, coord) -> None:
    if tuple(t.shape) != spec.local_shape(coord):
        raise AssertionError(f"{op}: local result {tuple(t.shape)} does not match {spec} at {coord}")


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---------------------------------------------------------------------------------------------
# interpolation
# ---------------------------------------------------------------------------------------------


def _interp_args(op, vals):
    """(x, output_size, align_corners or None, scales) of a forward interpolation call."""
    kind, nsp, _ = _INTERP[op]
    if kind == "linear":
        return vals[0], [int(s) for s in vals[1]], bool(vals[2]), list(vals[3 : 3 + nsp])
    return vals[0], [int(s) for s in vals[1]], None, list(vals[2 : 2 + nsp])


def _interp_call(op, x, out_sizes, align, scales):
    if _INTERP[op][0] == "linear":
        return op(x, out_sizes, align, *scales)
    return op(x, out_sizes, *scales)


def _interp_bwd_call(op_bwd, fwd, g, out_sizes, in_sizes, align, scales):
    if _INTERP[fwd][0] == "linear":
        return op_bwd(g, out_sizes, in_sizes, align, *scales)
    return op_bwd(g, out_sizes, in_sizes, *scales)


def _interp_dims(fwd, mesh, coord, spatial, first, in_shape, out_shape, align, scales, dtype) -> list[_Dim]:
    kind, _, probe_op = _INTERP[fwd]
    in_sp, out_sp = in_shape[first:], out_shape[first:]
    if kind == "linear":
        return _dims(mesh, coord, spatial, first, in_shape, out_shape,
                     lambda j: _linear_map(in_sp[j], out_sp[j], align, scales[j], _opmath(dtype)))
    return _dims(mesh, coord, spatial, first, in_shape, out_shape,
                 lambda j: _nearest_map(probe_op, in_sp[j], out_sp[j], scales[j]),
                 _nearest_local_ok(probe_op, scales),
                 lambda j: _ambiguous(probe_op, in_sp[j], out_sp[j], scales[j]))


def _call_sizes(dims: list[_Dim], in_sp, out_sp, scales):
    """(input lengths, output lengths, scales) of the op on this rank's window, and whether the
    call changes anything (else it is skipped)."""
    by_j = {dm.j: dm for dm in dims}
    win_in, op_out, sc, active = [], [], [], False
    for j in range(len(in_sp)):
        dm = by_j.get(j)
        if dm is None or dm.mode == "full":  # the op's own sizes on the whole dim
            n, m, s = in_sp[j], out_sp[j], scales[j]
        elif dm.mode == "local":
            n, m, s = dm.plan.window_length, dm.plan.b - dm.plan.a, scales[j]
        else:  # gathered explicitly: identity for the op
            n = m = dm.plan.window_length
            s = None
        win_in.append(n), op_out.append(m), sc.append(s)
        active |= n != m or s is not None
    return win_in, op_out, sc, active


@register_handler(list(_INTERP))
def interp_handler(op, args, kwargs):
    """Nearest / linear interpolation (module docstring)."""
    vals = bind(op, args, kwargs)
    x, out_sizes, align, scales = _interp_args(op, vals)
    check_dtensors(op, [x])
    kind, nsp, _ = _INTERP[op]
    gout = meta_run(op, *vals)
    mesh = x._spec.mesh
    coord = C.mesh_coordinate(mesh)
    first = x.dim() - nsp
    targets, spatial = _targets(x._spec, nsp, _ALL_REDUCE if kind == "nearest" else _LINEAR_REDUCE)
    out_spec = make_spec(mesh, targets, gout.shape, gout.dtype)
    in_sp, out_sp = list(x.shape[first:]), list(gout.shape[first:])
    with op_context(op):
        xl = to_local(x, targets)
        out_shape = out_spec.local_shape(coord)
        dims = _interp_dims(op, mesh, coord, spatial, first, tuple(x.shape), tuple(gout.shape), align, scales, x.dtype)
        for dm in dims:
            xl = halo.exchange(xl, dm.plan, dm.d, mesh, dm.i)
        if _numel(out_shape) == 0 or xl.numel() == 0:
            out = C.consumed(xl.new_zeros(out_shape), xl)  # while tracing, the halo exchange stays
        else:
            _, op_out, sc, active = _call_sizes(dims, in_sp, out_sp, scales)
            if active:  # unsharded, aligned and 'full' dims: the op itself
                xl = _interp_call(op, xl, op_out, align, sc)
            # gathered dims: the contiguous-most first, as PyTorch's separable kernel
            for dm in sorted(dims, key=lambda t: -t.d):
                if dm.mode == "full":
                    xl = xl.narrow(dm.d, dm.plan.a, dm.plan.b - dm.plan.a)
                elif dm.mode == "gather":
                    xl = _apply(xl, dm.map, dm.d, dm.plan.a, dm.plan.b, dm.plan.lo)
            out = xl if xl is not x._local_tensor else xl.clone()
            if any(dm.mode == "full" for dm in dims):
                out = out.contiguous()
    _check(op, out, out_spec, coord)
    return wrap(out, out_spec)


@register_handler(list(_INTERP_BWD))
def interp_backward_handler(op, args, kwargs):
    """Backward of :func:`interp_handler`; placements follow the gradient's."""
    fwd = _INTERP_BWD[op]
    kind, nsp, _ = _INTERP[fwd]
    vals = bind(op, args, kwargs)
    g, in_sizes = vals[0], [int(s) for s in vals[2]]
    if kind == "linear":
        align, scales = bool(vals[3]), list(vals[4 : 4 + nsp])
    else:
        align, scales = None, list(vals[3 : 3 + nsp])
    check_dtensors(op, [g])
    meta_run(op, *vals)  # PyTorch's argument checks
    mesh = g._spec.mesh
    coord = C.mesh_coordinate(mesh)
    first = g.dim() - nsp
    targets, spatial = _targets(g._spec, nsp, _LINEAR_REDUCE)
    gin_spec = make_spec(mesh, targets, in_sizes, g.dtype)
    in_sp, out_sp = in_sizes[first:], list(g.shape[first:])
    with op_context(op):
        gl = to_local(g, targets)
        in_local = gin_spec.local_shape(coord)
        dims = _interp_dims(fwd, mesh, coord, spatial, first, tuple(in_sizes), tuple(g.shape), align, scales, g.dtype)
        win_in, op_out, sc, active = _call_sizes(dims, in_sp, out_sp, scales)
        win_shape = list(in_local[:first]) + win_in
        for dm in dims:
            win_shape[dm.d] = dm.plan.window_length
        if _numel(win_shape) == 0 or gl.numel() == 0:
            gw = C.consumed(gl.new_zeros(win_shape), gl)
        else:
            gw = gl
            for dm in sorted(dims, key=lambda t: t.d):
                if dm.mode == "gather":
                    gw = _apply_transpose(gw, dm.map, dm.d, dm.plan.a, dm.plan.b, dm.plan.lo, dm.plan.window_length)
                elif dm.mode == "full":  # this rank's chunk of the gradient, zero elsewhere
                    shape = list(gw.shape)
                    shape[dm.d] = dm.plan.out_length
                    z = gw.new_zeros(shape)
                    z.narrow(dm.d, dm.plan.a, dm.plan.b - dm.plan.a).copy_(gw)
                    gw = z
            if active:
                gw = _interp_bwd_call(op, fwd, gw, op_out, win_shape, align, sc)
            elif gw is g._local_tensor:
                gw = gw.clone()
        for dm in reversed(dims):
            gw = halo.accumulate(gw, dm.plan, dm.d, mesh, dm.i)
    _check(op, gw, gin_spec, coord)
    return wrap(gw, gin_spec)


# ---------------------------------------------------------------------------------------------
# reflection / replication padding
# ---------------------------------------------------------------------------------------------


def _pad_pairs(padding, nsp: int) -> list[tuple[int, int]]:
    """Per spatial dim j (0 = first spatial dim): (left, right); ``padding`` lists the LAST dim first."""
    padding = [int(p) for p in padding]
    return [(padding[2 * (nsp - 1 - j)], padding[2 * (nsp - 1 - j) + 1]) for j in range(nsp)]


def _pad_list(pairs) -> list[int]:
    out = []
    for pl, pr in reversed(pairs):
        out += [pl, pr]
    return out


def _pad_dims(fwd, x_shape, out_shape, spatial, first, mesh, coord, pairs):
    nsp, probe_op = _PAD[fwd]
    dims = _dims(mesh, coord, spatial, first, x_shape, out_shape,
                 lambda j: _pad_map(probe_op, x_shape[first + j], *pairs[j]))
    local_pairs = list(pairs)
    for dm in dims:
        local_pairs[dm.j] = (0, 0)
    return dims, local_pairs


@register_handler(list(_PAD))
def pad_handler(op, args, kwargs):
    """Reflection / replication padding (module docstring)."""
    x, padding = bind(op, args, kwargs)
    check_dtensors(op, [x])
    nsp = _PAD[op][0]
    gout = meta_run(op, x, padding)
    pairs = _pad_pairs(padding, nsp)
    mesh = x._spec.mesh
    coord = C.mesh_coordinate(mesh)
    first = x.dim() - nsp
    targets, spatial = _targets(x._spec, nsp, _ALL_REDUCE)
    out_spec = make_spec(mesh, targets, gout.shape, gout.dtype)
    with op_context(op):
        xl = to_local(x, targets)
        out_shape = out_spec.local_shape(coord)
        dims, local_pairs = _pad_dims(op, x.shape, gout.shape, spatial, first, mesh, coord, pairs)
        for dm in dims:
            xl = halo.exchange(xl, dm.plan, dm.d, mesh, dm.i)
        if _numel(out_shape) == 0 or xl.numel() == 0:
            out = C.consumed(xl.new_zeros(out_shape), xl)
        else:
            if any(p for pr in local_pairs for p in pr):
                xl = op(xl, _pad_list(local_pairs))
            for dm in dims:
                xl = _apply(xl, dm.map, dm.d, dm.plan.a, dm.plan.b, dm.plan.lo)
            out = xl if xl is not x._local_tensor else xl.clone()
    _check(op, out, out_spec, coord)
    return wrap(out, out_spec)


@register_handler(list(_PAD_BWD))
def pad_backward_handler(op, args, kwargs):
    """Backward of :func:`pad_handler`; placements follow the gradient's."""
    g, x, padding = bind(op, args, kwargs)
    check_dtensors(op, [g, x])
    fwd = _PAD_BWD[op]
    nsp = _PAD[fwd][0]
    meta_run(op, g, x, padding)
    pairs = _pad_pairs(padding, nsp)
    mesh = g._spec.mesh
    coord = C.mesh_coordinate(mesh)
    first = g.dim() - nsp
    targets, spatial = _targets(g._spec, nsp, _LINEAR_REDUCE)
    gin_spec = make_spec(mesh, targets, x.shape, g.dtype)
    with op_context(op):
        gl = to_local(g, targets)
        in_local = gin_spec.local_shape(coord)
        dims, local_pairs = _pad_dims(fwd, x.shape, g.shape, spatial, first, mesh, coord, pairs)
        win_shape = list(in_local)
        for dm in dims:
            win_shape[dm.d] = dm.plan.window_length
        if _numel(win_shape) == 0 or gl.numel() == 0:
            gw = C.consumed(gl.new_zeros(win_shape), gl)
        else:
            gw = gl
            for dm in dims:
                gw = _apply_transpose(gw, dm.map, dm.d, dm.plan.a, dm.plan.b, dm.plan.lo, dm.plan.window_length)
            if any(p for pr in local_pairs for p in pr):
                gw = op(gw, gw.new_zeros(win_shape), _pad_list(local_pairs))
            elif gw is g._local_tensor:
                gw = gw.clone()
        for dm in reversed(dims):
            gw = halo.accumulate(gw, dm.plan, dm.d, mesh, dm.i)
    _check(op, gw, gin_spec, coord)
    return wrap(gw, gin_spec)


# ---------------------------------------------------------------------------------------------
# torch.compile: the interpolation ops must reach interp_handler under compile too
# ---------------------------------------------------------------------------------------------


def _run_cpp_kernels_for_dtensors(ops) -> None:
    """Under ``torch.compile`` PyTorch's Python dispatcher runs the Python decompositions
    registered for these ops at the ``Autograd`` and ``CompositeImplicitAutograd`` keys, which come
    BEFORE a tensor subclass's ``__torch_dispatch__``; they index the input with plain
    ``torch.arange`` tensors, which cannot mix with DTensors (``aten._unsafe_index`` got a plain
    tensor).  In eager the C++ kernels run and the op reaches :func:`interp_handler`.  So for a
    DTensor input the C++ kernels run under compile too; other inputs keep PyTorch's decomposition.
    PyTorch's own DTensor met the same problem (pytorch/pytorch#175447)."""
    from torch._C import DispatchKey
    from torch._dispatch.python import no_python_dispatcher

    for op in ops:
        for key in (DispatchKey.Autograd, DispatchKey.CompositeImplicitAutograd):
            decomposition = op.py_kernels.get(key)
            if decomposition is None or getattr(decomposition, "_dtshard_cpp_for_dtensors", False):
                continue

            def kernel(*args, _op=op, _decomposition=decomposition, **kwargs):
                x = args[0] if args else kwargs.get("input", kwargs.get("self"))
                if isinstance(x, DTensor):
                    with no_python_dispatcher():
                        return _op(*args, **kwargs)
                return _decomposition(*args, **kwargs)

            kernel._dtshard_cpp_for_dtensors = True
            op.py_kernels[key] = kernel
        op._dispatch_cache.clear()


_run_cpp_kernels_for_dtensors(
    [getattr(op.overloadpacket, overload) for op in _INTERP for overload in ("default", "vec")]
)
