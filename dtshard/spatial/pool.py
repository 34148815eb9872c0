"""Max and average pooling (2-D and 3-D, with their backward) over DTensors.

Pooling acts on each (batch, channel) plane separately, so per mesh dim:

- ``Shard(d)`` on a non-spatial dim (batch, channels) is simply kept (output and indices too);
- ``Shard(d)`` on a spatial dim (the last 2 or 3 dims) uses the window arithmetic of docs/HALO.md
  (:mod:`dtshard.halo`): with ``K = dilation*(k-1)+1`` each rank receives the input window of its
  output chunk (chunk layout of the OUTPUT length, ``ceil_mode`` included), padded at the GLOBAL
  edges only, and pools it with padding 0 on that dim.  The outermost mesh dim sharding a spatial
  dim does this; inner ones are replicated first;
- ``Partial(sum/avg)`` is kept by average pooling (it is linear); max pooling replicates it;
- anything else is replicated.

Max pooling pads with ``-inf`` (never selected over a real element, as in PyTorch) and returns
GLOBAL indices, as plain PyTorch does: the flat index over the full input's spatial dims.  The
local kernel's window indices are converted with the window origin ``lo`` of each sharded dim;
a window whose real elements are all ``-inf`` makes the local kernel keep its first (padding)
position, which is mapped to the first real element along the dilation grid, PyTorch's answer.
The backward converts the global indices back to window indices, scatters locally and sends the
halo parts of the gradient back to their owners (``halo.accumulate``).

Average pooling computes window SUMS locally (``divisor_override=1``) and divides by the divisor
PyTorch would use at each global output position: ``divisor_override`` if given, else the product
over spatial dims of the per-dim count, ``min(start + k, N + p) - start`` with
``count_include_pad`` (zeros counted at the global edges only, ceil-mode overhang not) or the
number of real elements without it.  Backward: scale the gradient by the same divisor, spread it
over the window, accumulate the halos.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard import collectives as C
from dtshard.spatial import halo
from dtshard.registry import register_handler
from dtshard.handlers import bind, check_dtensors, make_spec, meta_run, op_context, to_local, wrap
from dtshard.spatial.conv import expand_list, spatial_shards
from dtshard.spec import DTensorSpec

aten = torch.ops.aten

__all__ = ["max_pool_handler", "max_pool_backward_handler", "avg_pool_handler", "avg_pool_backward_handler"]

R = Replicate()
_MAX = {aten.max_pool2d_with_indices.default: 2, aten.max_pool3d_with_indices.default: 3}
_MAX_BWD = {aten.max_pool2d_with_indices_backward.default: 2, aten.max_pool3d_with_indices_backward.default: 3}
_AVG = {aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3}
_AVG_BWD = {aten.avg_pool2d_backward.default: 2, aten.avg_pool3d_backward.default: 3}


# ---------------------------------------------------------------------------------------------
# layout
# ---------------------------------------------------------------------------------------------


def _targets(spec: DTensorSpec, nsp: int, linear: bool):
    """(target placements, {mesh dim: spatial tensor dim}) for a pooling input."""
    first = spec.ndim - nsp
    spatial = spatial_shards(spec.placements, first, spec.ndim)
    out = []
    for i, p in enumerate(spec.placements):
        if isinstance(p, Shard) and (p.dim < first or i in spatial):
            out.append(p)
        elif isinstance(p, Partial) and linear and p.reduce_op in ("sum", "avg"):
            out.append(p)
        else:
            out.append(R)
    return tuple(out), spatial


def _params(nsp, kernel, stride, padding, dilation=1):
    kernel = expand_list(kernel, nsp)
    stride = expand_list(stride, nsp) if stride not in (None, [], ()) else list(kernel)
    return kernel, stride, expand_list(padding, nsp), expand_list(dilation, nsp)


def _plans(spatial, x_shape, out_shape, mesh, coord, first, kernel, stride, padding, dilation):
    plans = []
    for i, d in spatial.items():
        j = d - first
        k_eff = dilation[j] * (kernel[j] - 1) + 1
        plan = halo.window_plan(x_shape[d], out_shape[d], mesh.shape[i], coord[i], stride[j], k_eff, padding[j])
        plans.append((i, d, plan))
    return plans


def _local_padding(padding, plans, first: int) -> list[int]:
    """The op's padding with the halo-exchanged dims set to 0: their window already holds the
    global edge padding (HALO.md)."""
    local = list(padding)
    for _, d, _ in plans:
        local[d - first] = 0
    return local


def _window_shape(local_shape, plans) -> list[int]:
    shape = list(local_shape)
    for _, d, plan in plans:
        shape[d] = plan.window_length
    return shape


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _check(op, t: torch.Tensor, spec: DTensorSpec, coord) -> None:
    if tuple(t.shape) != spec.local_shape(coord):
        raise AssertionError(f"{op}: local result {tuple(t.shape)} does not match {spec} at {coord}")


# ---------------------------------------------------------------------------------------------
# index conversion for max pooling
# ---------------------------------------------------------------------------------------------


def _window_geometry(first, nsp, local_x_shape, x_shape, plans):
    """Per spatial dim j: (window extent, global extent, window origin in global coordinates)."""
    win = list(local_x_shape[first:])
    origin = [0] * nsp
    for _, d, plan in plans:
        win[d - first] = plan.window_length
        origin[d - first] = plan.lo
    return win, list(x_shape[first:]), origin


def _leading_shift(win, full, origin):
    """When the window differs from the global extent only in the first spatial dim (a tensor
    sharded on H, say), a flat index moves by a constant between the two: ``origin[0]`` rows of
    ``full[1:]`` elements.  Else None."""
    if any(w != n for w, n in zip(win[1:], full[1:])) or any(origin[1:]):
        return None
    return origin[0] * _numel(full[1:])


def _to_global(idx: torch.Tensor, win, full, origin, dilation) -> torch.Tensor:
    """Window-flat indices -> global flat indices (padding positions to the first real element).
    ``idx`` is the kernel's own output: it may be updated in place."""
    shift = _leading_shift(win, full, origin)
    if shift is not None:  # one add (two more passes where the window starts in the padding)
        out = idx.add_(shift)
        if origin[0] < 0:  # output row r reads window rows from r * stride on: only the first
            # -origin[0] output rows can have read a padding row
            first = out.dim() - len(win)
            head = out.narrow(first, 0, min(out.shape[first], -origin[0]))
            row, dl = _numel(full[1:]), dilation[0]
            head.copy_(torch.where(head < 0, head + ((row - 1 - head) // row + dl - 1) // dl * dl * row, head))
        return out
    coords = []
    rest = idx
    for w in reversed(win):
        coords.append(rest % w)
        rest = rest // w
    coords.reverse()
    out = torch.zeros_like(idx)
    for c, n, o, dl in zip(coords, full, origin, dilation):
        g = c + o
        if o < 0:  # a left-padding position: step along the dilation grid to the first real one
            g = torch.where(g < 0, g + ((-g + dl - 1) // dl) * dl, g)
        out = out * n + g
    return out


def _to_window(idx: torch.Tensor, win, full, origin) -> torch.Tensor:
    """Global flat indices -> window-flat indices."""
    shift = _leading_shift(win, full, origin)
    if shift is not None:
        return idx - shift
    coords = []
    rest = idx
    for n in reversed(full):
        coords.append(rest % n)
        rest = rest // n
    coords.reverse()
    out = torch.zeros_like(idx)
    for c, w, o in zip(coords, win, origin):
        out = out * w + (c - o)
    return out


# ---------------------------------------------------------------------------------------------
# max pooling
# ---------------------------------------------------------------------------------------------


@register_handler(list(_MAX))
def max_pool_handler(op, args, kwargs):
    x, kernel, stride, padding, dilation, ceil_mode = bind(op, args, kwargs)
    check_dtensors(op, [x])
    nsp = _MAX[op]
    kernel, stride, padding, dilation = _params(nsp, kernel, stride, padding, dilation)
    gout, gidx = meta_run(op, x, kernel, stride, padding, dilation, ceil_mode)
    mesh = x._spec.mesh
    coord = C.mesh_coordinate(mesh)
    targets, spatial = _targets(x._spec, nsp, linear=False)
    out_spec = make_spec(mesh, targets, gout.shape, gout.dtype)
    idx_spec = make_spec(mesh, targets, gidx.shape, gidx.dtype)
    first = x.dim() - nsp
    with op_context(op):
        xl = to_local(x, targets)
        local_x_shape = tuple(xl.shape)
        plans = _plans(spatial, x.shape, gout.shape, mesh, coord, first, kernel, stride, padding, dilation)
        local_padding = list(padding)
        for i, d, plan in plans:
            xl = halo.exchange(xl, plan, d, mesh, i, fill=float("-inf"))
            local_padding[d - first] = 0
        out_shape = out_spec.local_shape(coord)
        if _numel(out_shape) == 0 or xl.numel() == 0:
            # (the zeros depend on the window: while tracing, its halo exchange stays in the graph)
            out, idx = C.consumed(xl.new_zeros(out_shape), xl), torch.zeros(out_shape, dtype=torch.int64, device=xl.device)
        else:
            out, idx = op(xl, kernel, stride, local_padding, dilation, ceil_mode)
            if plans:
                win, full, origin = _window_geometry(first, nsp, local_x_shape, x.shape, plans)
                idx = _to_global(idx, win, full, origin, dilation)
    _check(op, out, out_spec, coord)
    return wrap(out, out_spec), wrap(idx, idx_spec)


@register_handler(list(_MAX_BWD))
def max_pool_backward_handler(op, args, kwargs):
    g, x, kernel, stride, padding, dilation, ceil_mode, indices = bind(op, args, kwargs)
    check_dtensors(op, [g, x, indices])
    nsp = _MAX_BWD[op]
    kernel, stride, padding, dilation = _params(nsp, kernel, stride, padding, dilation)
    mesh = x._spec.mesh
    coord = C.mesh_coordinate(mesh)
    targets, spatial = _targets(x._spec, nsp, linear=False)
    first = x.dim() - nsp
    gin_spec = make_spec(mesh, targets, x.shape, g.dtype)
    with op_context(op):
        gl = to_local(g, targets)
        il = to_local(indices, targets)
        local_x_shape = x._spec.with_placements(targets).local_shape(coord)
        plans = _plans(spatial, x.shape, g.shape, mesh, coord, first, kernel, stride, padding, dilation)
        local_padding = _local_padding(padding, plans, first)
        win_shape = _window_shape(local_x_shape, plans)
        if gl.numel() == 0 or _numel(win_shape) == 0:
            gw = C.consumed(gl.new_zeros(win_shape), gl)
        else:
            if plans:
                win, full, origin = _window_geometry(first, nsp, local_x_shape, x.shape, plans)
                il = _to_window(il, win, full, origin)
            shape_only = gl.new_empty(win_shape)  # the kernel reads only the input's shape (and layout)
            gw = op(gl, shape_only, kernel, stride, local_padding, dilation, ceil_mode, il)
        for i, d, plan in reversed(plans):
            gw = halo.accumulate(gw, plan, d, mesh, i)
    _check(op, gw, gin_spec, coord)
    return wrap(gw, gin_spec)


# ---------------------------------------------------------------------------------------------
# average pooling
# ---------------------------------------------------------------------------------------------


def _divisor(out_local_shape, out_offsets, x_shape, first, nsp, kernel, stride, padding, ceil_mode,
             count_include_pad, divisor_override, dtype, device):
    """PyTorch's per-output divisor for the local output block (broadcastable to it)."""
    if divisor_override:
        return torch.tensor(float(divisor_override), dtype=dtype, device=device)
    total = None
    for j in range(nsp):
        d = first + j
        n, k, s, p = x_shape[d], kernel[j], stride[j], padding[j]
        o = torch.arange(out_offsets[d], out_offsets[d] + out_local_shape[d], device=device)
        start = o * s - p
        end = torch.clamp(start + k, max=n + p)
        if count_include_pad:
            cnt = end - start
        else:
            cnt = torch.clamp(end, max=n) - torch.clamp(start, min=0)
        view = [1] * len(out_local_shape)
        view[d] = -1
        cnt = cnt.view(view)
        total = cnt if total is None else total * cnt
    return total.to(dtype)


@register_handler(list(_AVG))
def avg_pool_handler(op, args, kwargs):
    x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override = bind(op, args, kwargs)
    check_dtensors(op, [x])
    nsp = _AVG[op]
    kernel, stride, padding, _ = _params(nsp, kernel, stride, padding)
    gout = meta_run(op, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
    mesh = x._spec.mesh
    coord = C.mesh_coordinate(mesh)
    targets, spatial = _targets(x._spec, nsp, linear=True)
    out_spec = make_spec(mesh, targets, gout.shape, gout.dtype)
    first = x.dim() - nsp
    ones = [1] * nsp
    with op_context(op):
        xl = to_local(x, targets)
        plans = _plans(spatial, x.shape, gout.shape, mesh, coord, first, kernel, stride, padding, ones)
        out_shape, out_off = out_spec.local_shape_and_offset(coord)
        local_padding = list(padding)
        for i, d, plan in plans:
            xl = halo.exchange(xl, plan, d, mesh, i)
            local_padding[d - first] = 0
        if _numel(out_shape) == 0 or xl.numel() == 0:  # e.g. an empty channel chunk
            out = C.consumed(xl.new_zeros(out_shape), xl)
        elif not plans:
            out = op(xl, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override)
        else:
            sums = op(xl, kernel, stride, local_padding, ceil_mode, True, 1)
            out = sums / _divisor(out_shape, out_off, x.shape, first, nsp, kernel, stride, padding, ceil_mode,
                                  count_include_pad, divisor_override, sums.dtype, sums.device)
    _check(op, out, out_spec, coord)
    return wrap(out, out_spec)


@register_handler(list(_AVG_BWD))
def avg_pool_backward_handler(op, args, kwargs):
    g, x, kernel, stride, padding, ceil_mode, count_include_pad, divisor_override = bind(op, args, kwargs)
    check_dtensors(op, [g, x])
    nsp = _AVG_BWD[op]
    kernel, stride, padding, _ = _params(nsp, kernel, stride, padding)
    mesh = x._spec.mesh
    coord = C.mesh_coordinate(mesh)
    targets, spatial = _targets(x._spec, nsp, linear=True)
    # the gradient of a Partial output is the whole gradient: Replicate on those mesh dims
    g_targets = tuple(R if isinstance(p, Partial) else p for p in targets)
    gin_targets = g_targets
    first = x.dim() - nsp
    gin_spec = make_spec(mesh, gin_targets, x.shape, g.dtype)
    ones = [1] * nsp
    with op_context(op):
        gl = to_local(g, g_targets)
        local_x_shape = x._spec.with_placements(gin_targets).local_shape(coord)
        plans = _plans(spatial, x.shape, g.shape, mesh, coord, first, kernel, stride, padding, ones)
        local_padding = _local_padding(padding, plans, first)
        win_shape = _window_shape(local_x_shape, plans)
        if gl.numel() == 0 or _numel(win_shape) == 0:
            gw = C.consumed(gl.new_zeros(win_shape), gl)
        elif not plans:
            gw = op(gl, gl.new_zeros(local_x_shape), kernel, stride, padding, ceil_mode, count_include_pad,
                    divisor_override)
        else:
            g_spec = make_spec(mesh, g_targets, g.shape, g.dtype)
            _, out_off = g_spec.local_shape_and_offset(coord)
            scaled = gl / _divisor(tuple(gl.shape), out_off, x.shape, first, nsp, kernel, stride, padding,
                                   ceil_mode, count_include_pad, divisor_override, gl.dtype, gl.device)
            gw = op(scaled, gl.new_zeros(win_shape), kernel, stride, local_padding, ceil_mode, True, 1)
        for i, d, plan in reversed(plans):
            gw = halo.accumulate(gw, plan, d, mesh, i)
    _check(op, gw, gin_spec, coord)
    return wrap(gw, gin_spec)
