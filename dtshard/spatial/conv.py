"""Convolution (and ``constant_pad_nd``) over DTensors, including spatially sharded inputs.

``aten.convolution`` and ``aten.convolution_backward`` are handlers, because a spatially sharded
input needs a halo exchange (:mod:`dtshard.spatial.halo`, arithmetic in HALO.md), not only a
placement choice.  The handler picks, for each mesh dim, one *mode* from the placements of the
input ``x`` and the weight ``w``, redistributes the tensors to what that mode needs, runs the
local op and wraps the result:

==========  =====================  ======  =====  =====  =======  ======  ======  ======  ======
mode        when (x, w)            x       w      bias   out      g_out   g_in    g_w     g_b
==========  =====================  ======  =====  =====  =======  ======  ======  ======  ======
batch       x S(0)                 S(0)    R      R      S(0)     S(0)    S(0)    P       P
spatial     x S(d), d >= 2         S(d)    R      R      S(d)*    S(d)*   S(d)    P       P
inch        x S(1) or w S(1), g=1  S(1)    S(1)   P      P        R       S(1)    S(1)    R
xpartial    x P(sum)               P       R      P      P        R       R       P       R
outch       x R, w S(0), g=1       R       S(0)   S(0)   S(1)     S(1)    P       S(0)    S(0)
wpartial    x R, w P(sum)          R       P      P      P        R       P       R       R
rep         anything else          R       R      R      R        R       R       R       R
==========  =====================  ======  =====  =====  =======  ======  ======  ======  ======

(``P`` is ``Partial("sum")``; ``*``: the chunk layout of the OUTPUT length.)  A bias that must be
``P`` is zero on every rank but the first of the group (an exact R -> P).  Transposed convolutions
use batch / spatial / xpartial / rep.  A spatial dim sharded by two mesh dims keeps the outer one and
replicates the inner.  Mixed layouts (batch on mesh dim 0 and H on mesh dim 1, H and W on a 2-D
mesh, channels and H, ...) combine per mesh dim.

Spatial mode, forward: for each spatially sharded dim in mesh-dim order the rank exchanges halos
(``halo.exchange``: it receives exactly the window ``[lo, hi)`` its output chunk ``[a, b)`` reads,
zero-padded only at the global edges), then runs the local convolution with padding 0 on the
sharded dims (the original padding elsewhere), which yields exactly ``b - a`` outputs per dim.
Backward uses HALO.md scheme (A): the input window is rebuilt (only when ``grad_weight`` needs
it), the local ``convolution_backward`` gives the gradient of the window, and ``halo.accumulate``
(in reverse mesh-dim order) sends the halo parts back to their owners, who add them.  grad_weight
and grad_bias are Partial(sum) over the spatial (and batch) mesh dims: each output position is
computed by exactly one rank, so the local contributions sum to the full gradient.

Transposed convolution, spatial mode: input ``i`` reaches outputs ``i*s - p + t*d``, so output
chunk ``[a, b)`` reads inputs ``ceil((a + p - d(k-1)) / s) .. floor((b - 1 + p) / s)`` (clipped to the
input; :func:`_tconv_window`, exchanged with ``halo.range_plan``).  The local transposed convolution
of that window (padding and output_padding 0 on the sharded dims) starts at global output
``lo*s - p``; ``constant_pad_nd`` fits it to ``[a, b)`` (zeros where no input reaches, crops the
rest), then the bias is added.  Backward: the negated pads un-fit the output gradient, the local
``convolution_backward`` gives the window's gradient (accumulated to the owners as above),
grad_bias is the sum of the rank's output-gradient chunk (Partial).  With k = s (UNet's k2 s2
up-convolution) and even chunks every window is the rank's own shard: nothing moves.

``padding='same'`` with an even kernel arrives as ``constant_pad_nd`` (asymmetric, one extra
element on the right) followed by a symmetric convolution; its handler here shifts a sharded dim
with the same window exchange (kernel 1, stride 1, left padding = the pad), so the padded tensor
keeps ``Shard(d)`` in the chunk layout of the new length.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dtshard.handlers import DTensor, bind, check_dtensors, make_spec, meta_run, op_context, op_output, to_local, wrap
from dtshard.spatial import halo
from dtshard import collectives as C
from dtshard._config import config
from dtshard.spatial import conv_halo as HC
from dtshard.spatial import halo_layout as SL
from dtshard.spatial.halo_layout import halo_partial, halos, with_halo
from dtshard.registry import register_handler
from dtshard.spec import DTensorSpec, chunk_range, same_mesh
from dtshard import dispatch

aten = torch.ops.aten

__all__ = ["convolution_handler", "convolution_backward_handler", "constant_pad_nd_handler"]

R = Replicate()
PSUM = Partial("sum")


# ---------------------------------------------------------------------------------------------
# helpers shared with pool.py (the handler kit, dtshard.handlers, has the general ones)
# ---------------------------------------------------------------------------------------------


def expand_list(v, n: int) -> list[int]:
    """An int or a 1-element list broadcast to ``n`` ints (aten allows both)."""
    if isinstance(v, int):
        return [v] * n
    v = [int(x) for x in v]
    return v * n if len(v) == 1 else v


def spatial_shards(placements: Sequence[Placement], first_spatial: int, ndim: int) -> dict[int, int]:
    """``{mesh dim: tensor dim}`` of the mesh dims that shard a spatial dim (``>= first_spatial``),
    keeping only the OUTERMOST mesh dim per tensor dim (inner ones get replicated)."""
    out: dict[int, int] = {}
    seen: set[int] = set()
    for i, p in enumerate(placements):
        if isinstance(p, Shard) and first_spatial <= p.dim < ndim and p.dim not in seen:
            seen.add(p.dim)
            out[i] = p.dim
    return out


# ---------------------------------------------------------------------------------------------
# modes
# ---------------------------------------------------------------------------------------------

# mode -> (x, w, bias, out, g_out, g_in, g_w, g_b); "S" marks the spatial Shard(d) of that mesh dim
_TABLE = {
    "batch": (Shard(0), R, R, Shard(0), Shard(0), Shard(0), PSUM, PSUM),
    "spatial": ("S", R, R, "S", "S", "S", PSUM, PSUM),
    "inch": (Shard(1), Shard(1), PSUM, PSUM, R, Shard(1), Shard(1), R),
    "xpartial": (PSUM, R, PSUM, PSUM, R, R, PSUM, R),
    "outch": (R, Shard(0), Shard(0), Shard(1), Shard(1), PSUM, Shard(0), Shard(0)),
    "wpartial": (R, PSUM, PSUM, PSUM, R, PSUM, R, R),
    "rep": (R, R, R, R, R, R, R, R),
}
_COL = {name: k for k, name in enumerate(("x", "w", "bias", "out", "g_out", "g_in", "g_w", "g_b"))}


def conv_modes(x_spec: DTensorSpec, w_spec: DTensorSpec, transposed: bool, groups: int) -> list[tuple[str, int]]:
    """One ``(mode, spatial tensor dim or -1)`` per mesh dim (see the module docstring)."""
    spatial = spatial_shards(x_spec.placements, 2, x_spec.ndim)
    modes = []
    for i, (px, pw) in enumerate(zip(x_spec.placements, w_spec.placements)):
        mode = "rep"
        if isinstance(px, Shard) and px.dim == 0:
            mode = "batch"
        elif i in spatial:
            mode = "spatial"
        elif isinstance(px, Partial) and px.reduce_op == "sum":
            mode = "xpartial"
        elif not transposed and groups == 1 and (
            (isinstance(px, Shard) and px.dim == 1) or (isinstance(px, Replicate) and pw == Shard(1))
        ):
            mode = "inch"
        elif not transposed and groups == 1 and isinstance(px, Replicate) and pw == Shard(0):
            mode = "outch"
        elif not transposed and isinstance(px, Replicate) and isinstance(pw, Partial) and pw.reduce_op == "sum":
            mode = "wpartial"
        modes.append((mode, spatial.get(i, -1) if mode == "spatial" else -1))
    return modes


def placements_for(modes, column: str) -> tuple[Placement, ...]:
    col = _COL[column]
    out = []
    for mode, d in modes:
        p = _TABLE[mode][col]
        out.append(Shard(d) if p == "S" else p)
    return tuple(out)


def _conv_plans(modes, x_shape, out_shape, coord, mesh_shape, k_sizes, stride, dilation, padding,
                transposed: bool = False):
    """``[(mesh dim, tensor dim, WindowPlan)]`` of the spatial modes, in mesh-dim order; for a
    transposed convolution each rank's input range comes from :func:`_tconv_window`."""
    plans = []
    for i, (mode, d) in enumerate(modes):
        if mode != "spatial":
            continue
        j = d - 2
        k_eff = dilation[j] * (k_sizes[j] - 1) + 1
        n = mesh_shape[i]
        if transposed:
            wins = tuple(_tconv_window(x_shape[d], out_shape[d], n, r, stride[j], k_eff, padding[j]) for r in range(n))
            plan = halo.range_plan(x_shape[d], out_shape[d], n, coord[i], wins)
        else:
            plan = halo.window_plan(x_shape[d], out_shape[d], n, coord[i], stride[j], k_eff, padding[j])
        plans.append((i, d, plan))
    return plans


def _tconv_window(n_in: int, m_out: int, n: int, r: int, s: int, k_eff: int, p: int) -> tuple[int, int]:
    """Transposed convolution: the input range ``[lo, hi)`` that output chunk ``r`` of ``m_out``
    reads.  Input ``i`` reaches outputs ``i*s - p + t*d`` (``t`` in ``[0, k)``), so outputs ``[a, b)``
    need ``ceil((a + p - (K-1)) / s) <= i <= floor((b - 1 + p) / s)``, clipped to ``[0, N)``."""
    a, length = chunk_range(m_out, n, r)
    if length == 0:
        return (0, 0)
    lo = max(0, -((-(a + p - (k_eff - 1))) // s))
    hi = min(n_in, (a + length - 1 + p) // s + 1)
    return (lo, hi) if hi > lo else (0, 0)


def _tconv_fit(plans, k_sizes, stride, dilation, padding, ndim: int) -> list[int]:
    """``constant_pad_nd`` pads that turn the local transposed convolution of the windows (padding
    and output_padding 0 on the sharded dims) into this rank's output chunk: the local output
    starts at global position ``lo*s - p``; outputs the window does not reach are zero (cropped
    when it reaches beyond the chunk)."""
    pads = [0] * (2 * ndim)
    for _, d, plan in plans:
        j = d - 2
        length = plan.window_length
        k_eff = dilation[j] * (k_sizes[j] - 1) + 1
        local_out = (length - 1) * stride[j] + k_eff if length else 0
        left = plan.lo * stride[j] - padding[j] - plan.a
        right = (plan.b - plan.a) - left - local_out
        k = ndim - 1 - d
        pads[2 * k], pads[2 * k + 1] = left, right
    return pads


def _window_shape(local_shape, plans) -> list[int]:
    shape = list(local_shape)
    for _, d, plan in plans:
        shape[d] = plan.window_length
    return shape


# ---------------------------------------------------------------------------------------------
# convolution
# ---------------------------------------------------------------------------------------------


class _Plan:
    """A handler's cached plan: attributes set from keywords (subclasses name them in __slots__)."""

    __slots__ = ()

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


def _cached_plan(cache: dict, key, plan_fn, op, args, kwargs):
    """``(plan, bound arguments)``: the plan cached under ``key`` (then the arguments are the
    positional ``args`` the key was built from), else ``plan_fn(op, args, kwargs)``, stored when
    there is a key (``key`` None: a call the key cannot describe, planned every time)."""
    plan = cache.get(key) if key is not None else None
    if plan is not None:
        return plan, args
    plan = plan_fn(op, args, kwargs)
    if key is not None:
        if len(cache) > 4096:
            cache.clear()
        cache[key] = plan
    return plan, bind(op, args, kwargs)


class _ConvPlan(_Plan):
    """Everything a forward convolution call needs beyond its tensors, for one (specs, args)
    key: computed once by :func:`_plan_convolution`, then the call is local ops and exchanges."""

    __slots__ = ("x_target", "w_target", "b_target", "plans", "stride", "padding", "dilation", "local_padding",
                 "local_output_padding", "out_spec", "out_local_shape", "path", "modes", "coord", "w_k", "overlap",
                 "halo", "local_only")


_conv_plans_cache: dict = {}


def _tup(v):
    return tuple(v) if isinstance(v, (list, tuple)) else (v,)


def _conv_key(args, kwargs):
    """The cache key of a forward convolution call (all 9 arguments positional, as
    ``F.conv*d`` passes them, and the halo depth policy), or None (then the slow path plans and
    checks everything).  Specs stand in as their tokens (``DTensorSpec.token``: hashed in C)."""
    if kwargs or len(args) != 9:
        return None
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
    if type(x) is not DTensor or type(w) is not DTensor or not (bias is None or type(bias) is DTensor):
        return None
    try:
        specs = (x._spec._token or x._spec.token(), w._spec._token or w._spec.token(),
                 None if bias is None else bias._spec._token or bias._spec.token())
    except TypeError:  # a spec that cannot be hashed (symbolic shapes while tracing)
        return None
    try:  # F.conv*d passes lists
        return (*specs, tuple(stride), tuple(padding), tuple(dilation), transposed, tuple(output_padding), groups,
                SL.get_halo_depth())
    except TypeError:  # an int where aten allows one
        return (*specs, _tup(stride), _tup(padding), _tup(dilation), transposed, _tup(output_padding), groups,
                SL.get_halo_depth())


@register_handler(aten.convolution.default, keeps_layout_data=True)
def convolution_handler(op, args, kwargs):
    """Forward convolution on DTensors (any mode of the module docstring, per mesh dim).  A call
    whose (specs, arguments) were seen before runs its cached :class:`_ConvPlan`: no argument
    binding, mode table or window arithmetic per call."""
    plan, bound = _cached_plan(_conv_plans_cache, _conv_key(args, kwargs), _plan_convolution, op, args, kwargs)
    x, w, bias, _, _, _, transposed, output_padding, groups = bound
    if plan.local_only and x._spec.extra is None:  # batch / channel sharded: the local op alone
        out = op(x._local_tensor, w._local_tensor, None if bias is None else bias._local_tensor, plan.stride,
                 plan.local_padding, plan.dilation, transposed, output_padding, groups)
        if out.shape == plan.out_local_shape:
            return op_output(out, plan.out_spec)
        return _checked(op, out, plan)  # raises: never a mislabelled shard
    if SL.stale(x):
        SL.fresh(x)  # written in place since: its halo is dropped (so a new plan key)
        return convolution_handler(op, args, kwargs)
    if plan.halo is not None:
        out = _halo_forward(op, x, w, bias, plan, output_padding, groups)
        if out is not None:
            return out  # else the depth learned for this call is 1: the usual path
    if halos(x._spec):  # a halo this call cannot use
        x = SL.strip(x)
    stride, dilation = plan.stride, plan.dilation
    mesh = x._spec.mesh
    with op_context(op):
        xl = x._local_tensor if plan.x_target is None else to_local(x, plan.x_target)
        wl = w._local_tensor if plan.w_target is None else to_local(w, plan.w_target)
        bl = None if bias is None else (bias._local_tensor if plan.b_target is None else to_local(bias, plan.b_target))
        overlap = _overlap_on(xl, forward=True)  # the same on every rank (plan.overlap is not)
        if plan.overlap is not None and overlap:
            out = _overlapped(op, xl, wl, bl, plan, mesh, transposed, output_padding, groups)
            return _checked(op, out, plan)
        if not overlap and _keep_windows(x, w, plan):
            recvs = []
            for i, d, wplan in plan.plans:
                xl, recv = halo.exchange_keep(xl, wplan, d, mesh, i)
                recvs.append(recv)
            # the backward's weight gradient reads this same window: keep what arrived (the halo
            # rows) on the input, so the backward rebuilds the window without an exchange
            x.__dict__[_WINDOWS] = (x._version, plan.plans, recvs)
        else:
            for i, d, wplan in plan.plans:
                xl = halo.exchange(xl, wplan, d, mesh, i)
        if plan.path == "tconv":
            out = _tconv_forward(op, xl, wl, bl, plan.out_local_shape, plan.plans, plan.w_k, stride,
                                 plan.local_padding, plan.padding, dilation, plan.local_output_padding, groups)
        elif plan.path == "empty":
            # the zeros depend on the window: while tracing, its exchange stays in the graph
            out = C.consumed(xl.new_zeros(plan.out_local_shape), xl, wl)
            if bl is not None and _numel(plan.out_local_shape):
                out += bl.view([1, -1] + [1] * (x.dim() - 2))
        else:
            out = op(xl, wl, bl, stride, plan.local_padding, dilation, transposed, output_padding, groups)
    return _checked(op, out, plan)


def _halo_forward(op, x, w, bias, plan, output_padding, groups):
    """A convolution on a halo layout (:mod:`dtshard.spatial.conv_halo`): widen the input once for
    several layers, or consume the halo it carries; the output carries what is left.  Under the
    ``"auto"`` depth a widening learns from the chains it served (:class:`HC.Site`) and fetches
    no more rows than they used (None: it learned that a halo does not pay here)."""
    hp, coord = plan.halo, plan.coord
    if hp.grow is not None:
        hp, site = HC.widening_for(hp, w)
        if hp is None:
            return None
    else:
        site = x.__dict__.get(HC.SITE)
    if site is not None:
        site.consumed(hp.out_halo)
    with op_context(op):
        wl = w._local_tensor
        bl = None if bias is None else bias._local_tensor
        xl = x._local_tensor
        if hp.grow is not None:
            spec = x._spec.plain
            if halos(x._spec):
                xl = SL.plain_local(x)
            if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
                # the backward rebuilds this window from what arrived (under torch.compile the
                # joint graph's backward reads the forward's traced rows: AOTAutograd saves them)
                xl, recvs = SL.grow_local(xl, spec, hp.grow, coord, keep=True)
                x.__dict__[HC.KEPT] = (x._version, hp.grow, recvs)
            else:
                xl = SL.grow_local(xl, spec, hp.grow, coord)
        if _numel(hp.out_local_shape) == 0 or wl.numel() == 0:
            out = C.consumed(xl.new_zeros(hp.out_local_shape), xl)  # while tracing, the window's exchange stays
            if bl is not None and _numel(hp.out_local_shape):
                out += bl.view([1, -1] + [1] * (x.dim() - 2))
        else:
            out = op(HC.window(xl, hp.windows), wl, bl, plan.stride, plan.local_padding, plan.dilation, False,
                     output_padding, groups)
    if tuple(out.shape) != hp.out_local_shape:  # never return a mislabelled shard
        raise AssertionError(f"{op}: local output {tuple(out.shape)} does not match {hp.out_spec} at {coord}")
    res = wrap(out, hp.out_spec)
    if site is not None:
        res.__dict__[HC.SITE] = site
    return res


#: attribute of a convolution's input DTensor: ``(its version, the window plans, what each
#: exchange received)`` of the last forward that exchanged its halo (see :func:`_kept_window`)
_WINDOWS = "_dtshard_conv_windows"


def _keep_windows(x, w, plan) -> bool:
    """Keep the forward's received halo for the backward: eagerly, when a backward will run
    (grad mode, an input or the weight requires grad) and the window is the input's own shard
    widened (no re-layout).  Every condition here and in :func:`_kept_window` is the same on
    every rank (no per-rank path or overlap split), so all ranks skip the backward's exchange
    together: a rank-dependent choice would be a collective mismatch."""
    return (plan.x_target is None and bool(plan.plans) and torch.is_grad_enabled()
            and (x.requires_grad or w.requires_grad) and not torch.compiler.is_compiling())


def _kept_window(x, plan):
    """The input window the forward exchanged, rebuilt without traffic, or None: the same window
    plans, the input unchanged since (its version), eagerly."""
    kept = x.__dict__.get(_WINDOWS)
    if (kept is None or plan.x_target is not None or torch.compiler.is_compiling()
            or kept[0] != x._version or kept[1] != plan.plans):
        return None
    xl = x._local_tensor
    for (_, d, wplan), recv in zip(plan.plans, kept[2]):
        xl = halo.window_from(xl, recv, wplan, d)
    return xl


def _checked(op, out, plan):
    if tuple(out.shape) != plan.out_local_shape:  # never return a mislabelled shard
        raise AssertionError(
            f"{op}: local output {tuple(out.shape)} does not match {plan.out_spec} at {plan.coord} "
            f"(modes {plan.modes})")
    return wrap(out, plan.out_spec)


def _overlap_on(x, forward: bool = False) -> bool:
    if torch.compiler.is_compiling() and not config.halo_overlap_compiled:
        return False
    return config.halo_overlap and (config.halo_overlap_forward or not forward) and C.can_overlap(x)


def _overlap_split(plans, x_local_shape, stride, padding, dilation, k_sizes):
    """``(mesh dim, tensor dim, window plan, (oa, ob))``: the output rows ``[oa, ob)`` (global)
    whose input windows lie in this rank's own shard, when the convolution has one sharded
    dim with traffic and enough such rows to compute while the exchange is in flight (at least
    half of the rank's rows); else None."""
    if len(plans) != 1:
        return None
    i, d, wp = plans[0]
    if not wp.any_traffic or wp.b <= wp.a:
        return None
    j = d - 2
    s, p_l, k_eff = stride[j], padding[j], dilation[j] * (k_sizes[j] - 1) + 1
    oa = max(wp.a, -(-(wp.c + p_l) // s))
    ob = min(wp.b, (wp.e - k_eff + p_l) // s + 1)
    if ob - oa < max(1, (wp.b - wp.a) // 2) or x_local_shape[d] != wp.e - wp.c:
        return None
    return (i, d, wp, (oa, ob), s, p_l, k_eff)


def _overlapped(op, xl, wl, bl, plan, mesh, transposed, output_padding, groups):
    """The convolution with its halo exchange in flight while the interior rows are computed
    from the rank's own shard; then the boundary rows from the window; joined along the dim."""
    i, d, wp, (oa, ob), s, p_l, k_eff = plan.overlap
    pending = halo.exchange_async(xl, wp, d, mesh, i)

    def conv(t):
        return op(t, wl, bl, plan.stride, plan.local_padding, plan.dilation, transposed, output_padding, groups)

    interior = conv(xl.narrow(d, oa * s - p_l - wp.c, (ob - oa - 1) * s + k_eff))
    window = pending.wait()  # covers inputs [a*s - p_l, ...), the padding included
    parts = []
    if oa > wp.a:
        parts.append(conv(window.narrow(d, 0, (oa - wp.a - 1) * s + k_eff)))
    parts.append(interior)
    if wp.b > ob:
        parts.append(conv(window.narrow(d, (ob - wp.a) * s, (wp.b - ob - 1) * s + k_eff)))
    return torch.cat(parts, d) if len(parts) > 1 else interior


def _plan_convolution(op, args, kwargs) -> _ConvPlan:
    """Check one forward convolution call and plan it (the cached part of the handler)."""
    x, w, bias, stride, padding, dilation, transposed, output_padding, groups = bind(op, args, kwargs)
    check_dtensors(op, [x, w, bias])
    nsp = x.dim() - 2
    stride, padding, dilation = expand_list(stride, nsp), expand_list(padding, nsp), expand_list(dilation, nsp)
    output_padding = expand_list(output_padding, nsp)
    gout = meta_run(op, x, w, bias, stride, padding, dilation, transposed, output_padding, groups)
    mesh = x._spec.mesh
    if not same_mesh(w._spec.mesh, mesh) or (bias is not None and not same_mesh(bias._spec.mesh, mesh)):
        raise ValueError(f"{op}: input, weight and bias must live on the same mesh")
    modes = conv_modes(x._spec, w._spec, transposed, groups)
    coord = C.mesh_coordinate(mesh)
    out_spec = DTensorSpec(mesh, placements_for(modes, "out"), tuple(gout.shape), tuple(gout.stride()), gout.dtype)
    plans = _conv_plans(modes, x.shape, gout.shape, coord, mesh.shape, list(w.shape[2:]), stride, dilation,
                        padding, transposed)
    local_padding, local_output_padding = list(padding), list(output_padding)
    for _, d, _ in plans:
        local_padding[d - 2] = local_output_padding[d - 2] = 0
    out_local_shape = out_spec.local_shape(coord)

    def target(t, column):  # None: the tensor's own placements, its local tensor as it is
        want = placements_for(modes, column)
        return None if t is None or want == t._spec.placements else want

    x_target = target(x, "x")
    x_local_shape = (x._spec if x_target is None else x._spec.with_placements(x_target)).local_shape(coord)
    w_local_shape = (w._spec if target(w, "w") is None else w._spec.with_placements(target(w, "w"))).local_shape(coord)
    if transposed and plans:
        path = "tconv"
    elif _numel(out_local_shape) == 0 or _numel(_window_shape(x_local_shape, plans)) == 0 or _numel(w_local_shape) == 0:
        path = "empty"
    else:
        path = "local"
    overlap = _overlap_split(plans, x_local_shape, stride, padding, dilation, list(w.shape[2:])) \
        if path == "local" and not transposed else None
    halo_plan = HC.forward_plan(x._spec, out_spec, modes, stride, padding, dilation, tuple(w.shape), groups,
                                transposed, coord, x_target is None and target(w, "w") is None
                                and target(bias, "bias") is None)
    w_target, b_target = target(w, "w"), target(bias, "bias")
    # nothing to move, exchange or assemble: the call is the local op on the shards as they are
    local_only = (x_target is None and w_target is None and b_target is None and not plans and halo_plan is None
                  and path == "local" and overlap is None)
    return _ConvPlan(x_target=x_target, w_target=w_target, b_target=b_target, plans=plans,
                     overlap=overlap, halo=halo_plan, local_only=local_only,
                     stride=stride, padding=padding, dilation=dilation, local_padding=local_padding, local_output_padding=local_output_padding, out_spec=out_spec,
                     out_local_shape=out_local_shape, path=path, modes=modes, coord=coord, w_k=list(w.shape[2:]))


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _tconv_forward(op, xl, wl, bl, out_local_shape, plans, k_sizes, stride, local_padding, padding, dilation,
                   local_output_padding, groups):
    """Transposed convolution of the input windows, fitted to this rank's output chunk, plus bias
    (added after the fit: positions no input reaches still get it)."""
    nsp = xl.dim() - 2
    if _numel(out_local_shape) == 0:
        return xl.new_zeros(out_local_shape)
    if xl.numel() == 0 or wl.numel() == 0:
        out = C.consumed(xl.new_zeros(out_local_shape), xl)  # while tracing, the window's exchange stays
    else:
        out = op(xl, wl, None, stride, local_padding, dilation, True, local_output_padding, groups)
        out = aten.constant_pad_nd.default(out, _tconv_fit(plans, k_sizes, stride, dilation, padding, xl.dim()))
    if bl is not None:
        out = out + bl.view([1, -1] + [1] * nsp)
    return out


class _ConvBackwardPlan(_Plan):
    """The cached part of a ``convolution_backward`` call (see :class:`_ConvPlan`)."""

    __slots__ = ("g_target", "w_target", "x_target", "plans", "stride", "padding", "dilation", "output_padding",
                 "local_padding", "local_output_padding", "window_shape", "specs", "out_shapes", "path",
                 "local_bias", "mask", "w_k", "coord", "halo", "halo_kept")


_conv_backward_cache: dict = {}


def _register_caches() -> None:
    dispatch.handler_caches.extend([_conv_plans_cache, _conv_backward_cache])


_register_caches()


def _conv_backward_key(args, kwargs):
    if kwargs or len(args) != 11:
        return None
    g, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups, mask = args
    if type(g) is not DTensor or type(x) is not DTensor or type(w) is not DTensor:
        return None
    try:
        specs = (g._spec._token or g._spec.token(), x._spec._token or x._spec.token(),
                 w._spec._token or w._spec.token())
    except TypeError:  # a spec that cannot be hashed (symbolic shapes while tracing)
        return None
    return (*specs, None if bias_sizes is None else _tup(bias_sizes), _tup(stride),
            _tup(padding), _tup(dilation), transposed, _tup(output_padding), groups, tuple(bool(m) for m in mask))


@register_handler(aten.convolution_backward.default, keeps_layout_data=True)
def convolution_backward_handler(op, args, kwargs):
    """Backward of :func:`convolution_handler` (same modes, so it matches the forward layout);
    cached per (specs, arguments) like the forward."""
    plan, bound = _cached_plan(_conv_backward_cache, _conv_backward_key(args, kwargs), _plan_convolution_backward,
                               op, args, kwargs)
    g, x, w = bound[0], bound[1], bound[2]
    transposed, groups = bound[7], bound[9]
    if SL.stale(g) or SL.stale(x):
        SL.fresh(g), SL.fresh(x)  # written in place since: their halos are dropped (a new plan key)
        return convolution_backward_handler(op, args, kwargs)
    if plan.halo is not None:
        return _halo_backward(op, g, x, w, plan.halo, plan, transposed, groups)
    if plan.halo_kept is not None and HC.KEPT in x.__dict__:  # its forward widened x for several layers
        return _halo_backward(op, g, x, w, plan.halo_kept, plan, transposed, groups)
    if halos(g._spec):  # halos this call cannot use: the owners' sums of a partial one
        if halo_partial(g._spec):
            SL.demote_(g)
        else:
            g = SL.strip(g)
    if halos(x._spec):
        x = SL.strip(x)
    mesh = x._spec.mesh
    mask = plan.mask
    with op_context(op):
        # a Partial output takes a Replicate gradient
        gl = g._local_tensor if plan.g_target is None else to_local(g, plan.g_target)
        wl = w._local_tensor if plan.w_target is None else to_local(w, plan.w_target)
        kept = _kept_window(x, plan) if mask[1] else None
        if (kept is None and mask[0] and mask[1] and plan.path == "local" and len(plan.plans) == 1
                and plan.plans[0][2].any_traffic and _overlap_on(gl)):
            # the input window (for the weight gradient) travels while the input gradient is
            # computed; the input gradient needs only the window's shape
            xo = x._local_tensor if plan.x_target is None else to_local(x, plan.x_target)
            i, d, wplan = plan.plans[0]
            pending = halo.exchange_async(xo, wplan, d, mesh, i)
            shape_only = gl.new_zeros(plan.window_shape)
            gi, _, _ = op(gl, shape_only, wl, None, plan.stride, plan.local_padding, plan.dilation, transposed,
                          plan.output_padding, groups, [True, False, False])
            del shape_only
            _, gw, gb = op(gl, pending.wait(), wl, plan.local_bias, plan.stride, plan.local_padding, plan.dilation,
                           transposed, plan.output_padding, groups, [False, True, mask[2]])
            gi = halo.accumulate(gi, wplan, d, mesh, i)
            return _wrap_grads(op, (gi, gw, gb), plan)
        if kept is not None:  # the window the forward exchanged: no traffic
            xl = kept
        elif mask[1]:  # grad_weight reads the input window
            xl = x._local_tensor if plan.x_target is None else to_local(x, plan.x_target)
            for i, d, wplan in plan.plans:
                xl = halo.exchange(xl, wplan, d, mesh, i)
        else:  # grad_input only needs the window's shape
            xl = g._local_tensor.new_zeros(plan.window_shape)
        if plan.path == "tconv":
            gi, gw, gb = _tconv_backward(op, gl, xl, wl, plan.local_bias, plan.plans, plan.w_k, plan.stride,
                                         plan.local_padding, plan.padding, plan.dilation, plan.local_output_padding,
                                         groups, mask)
        else:
            gi, gw, gb = _local_backward(op, gl, xl, wl, plan, transposed, groups, plan.path == "empty")
        if mask[0]:
            for i, d, wplan in reversed(plan.plans):
                gi = halo.accumulate(gi, wplan, d, mesh, i)
    return _wrap_grads(op, (gi, gw, gb), plan)


def _local_backward(op, gl, xl, wl, plan, transposed, groups, empty: bool):
    """The local ``convolution_backward`` on the window ``xl``; zeros when a tensor is empty
    (the bias gradient needs no input: an empty in-channel chunk still has one)."""
    mask = plan.mask
    if not empty:
        return op(gl, xl, wl, plan.local_bias, plan.stride, plan.local_padding, plan.dilation, transposed,
                  plan.output_padding, groups, mask)
    # the zeros depend on the inputs: while tracing, what brought them (halo rows, a
    # redistributed gradient) stays in this rank's graph (C.consumed)
    gi = C.consumed(xl.new_zeros(xl.shape), gl, xl) if mask[0] else None
    gw = C.consumed(wl.new_zeros(wl.shape), gl, xl) if mask[1] else None
    gb = gl.sum([0] + list(range(2, gl.dim()))) if mask[2] and plan.local_bias is not None else None
    return gi, gw, gb


def _halo_backward(op, g, x, w, hb, plan, transposed, groups):
    """Backward of :func:`_halo_forward` (see :mod:`dtshard.spatial.conv_halo`): the input gradient on
    the rows around the shard that the output gradient's halo reaches; a partial halo when the
    input carries those rows, else sent back to their owners once."""
    coord, mask = plan.coord, plan.mask
    with op_context(op):
        gl = g._local_tensor if halo_partial(g._spec) or not halos(g._spec) else SL.plain_local(g)
        wl = w._local_tensor
        need_spec = with_halo(x._spec.plain, hb.need)
        xl = None
        if mask[1] and hb.grow is None:  # the input carries the rows
            xl = SL.narrow_local(x._local_tensor, x._spec, hb.need, coord)
        elif mask[1]:
            xo = SL.plain_local(x) if halos(x._spec) else x._local_tensor
            kept = x.__dict__.get(HC.KEPT)
            if (kept is not None and kept[0] == x._version
                    and len(kept[1]) == len(hb.grow) and all(
                        k.dim == n.dim and k.lo >= n.lo and k.hi >= n.hi for k, n in zip(kept[1], hb.grow))):
                xl = SL.regrow_local(xo, x._spec.plain, kept[1], coord, kept[2])  # the forward's window
                xl = SL.narrow_local(xl, with_halo(x._spec.plain, kept[1]), hb.need, coord)
            else:
                xl = SL.grow_local(xo, x._spec.plain, hb.grow, coord)
        if xl is None:  # the input gradient needs only the window's shape
            xl = gl.new_zeros(SL.ext_shape(need_spec, coord))
        xw = HC.window(xl, hb.windows)
        gi, gw, gb = _local_backward(op, gl, xw, wl, plan, transposed, groups,
                                     gl.numel() == 0 or xw.numel() == 0 or wl.numel() == 0)
        gi_spec = plan.specs[0]
        if mask[0]:
            for d, _, length, pad_l, _ in hb.windows:
                if gi.shape[d] != length:
                    gi = gi.narrow(d, pad_l, length)
            if hb.partial_out:
                gi_spec = with_halo(gi_spec, hb.need, partial=True)
            else:
                gi = SL.accumulate_local(gi, x._spec.plain, hb.grow, coord)
    outs = []
    for t, spec in zip((gi, gw, gb), (gi_spec, plan.specs[1], plan.specs[2])):
        if spec is None:
            outs.append(None)
            continue
        want = SL.ext_shape(spec, coord)
        if tuple(t.shape) != want:
            raise AssertionError(f"{op}: local gradient {tuple(t.shape)} does not match {spec} ({want}) at {coord}")
        outs.append(wrap(t, spec))
    return tuple(outs)


def _wrap_grads(op, grads, plan) -> tuple:
    outs = []
    for t, spec, shape in zip(grads, plan.specs, plan.out_shapes):
        if spec is None:
            outs.append(None)
            continue
        if tuple(t.shape) != shape:
            raise AssertionError(f"{op}: local gradient {tuple(t.shape)} does not match {spec} at {plan.coord}")
        outs.append(wrap(t, spec))
    return tuple(outs)


def _plan_convolution_backward(op, args, kwargs) -> _ConvBackwardPlan:
    (g, x, w, bias_sizes, stride, padding, dilation, transposed, output_padding, groups,
     output_mask) = bind(op, args, kwargs)
    check_dtensors(op, [g, x, w])
    nsp = x.dim() - 2
    stride, padding, dilation = expand_list(stride, nsp), expand_list(padding, nsp), expand_list(dilation, nsp)
    output_padding = expand_list(output_padding, nsp)
    mesh = x._spec.mesh
    modes = conv_modes(x._spec, w._spec, transposed, groups)
    coord = C.mesh_coordinate(mesh)
    mask = [bool(m) for m in output_mask]
    specs = [
        make_spec(mesh, placements_for(modes, "g_in"), x.shape, x.dtype) if mask[0] else None,
        make_spec(mesh, placements_for(modes, "g_w"), w.shape, w.dtype) if mask[1] else None,
        (make_spec(mesh, placements_for(modes, "g_b"), bias_sizes, g.dtype)
         if mask[2] and bias_sizes is not None else None),
    ]
    plans = _conv_plans(modes, x.shape, g.shape, coord, mesh.shape, list(w.shape[2:]), stride, dilation,
                        padding, transposed)
    local_padding, local_output_padding = list(padding), list(output_padding)
    for _, d, _ in plans:
        local_padding[d - 2] = local_output_padding[d - 2] = 0

    def target(t, column):
        want = placements_for(modes, column)
        return None if want == t._spec.placements else want

    def local_shape(t, tgt):
        return (t._spec if tgt is None else t._spec.with_placements(tgt)).local_shape(coord)

    g_target, w_target, x_target = target(g, "g_out"), target(w, "w"), target(x, "x")
    g_shape, w_shape = local_shape(g, g_target), local_shape(w, w_target)
    window_shape = _window_shape(local_shape(x, x_target), plans)
    if transposed and plans:
        path = "tconv"
    elif _numel(g_shape) == 0 or _numel(window_shape) == 0 or _numel(w_shape) == 0:
        path = "empty"
    else:
        path = "local"
    return _ConvBackwardPlan(
        g_target=g_target, w_target=w_target, x_target=x_target, plans=plans, stride=stride, padding=padding,
        dilation=dilation, output_padding=output_padding, local_padding=local_padding,
        local_output_padding=local_output_padding, window_shape=window_shape, specs=specs,
        out_shapes=[None if sp is None else sp.local_shape(coord) for sp in specs], path=path,
        local_bias=[g_shape[1]] if bias_sizes is not None else None, mask=mask, w_k=list(w.shape[2:]), coord=coord,
        halo=HC.backward_plan(g._spec, x._spec, modes, stride, padding, dilation, tuple(w.shape), transposed, coord,
                              g_target is None and w_target is None and x_target is None),
        halo_kept=HC.backward_plan(g._spec, x._spec, modes, stride, padding, dilation, tuple(w.shape), transposed,
                                   coord, g_target is None and w_target is None and x_target is None, kept=True))


def _tconv_backward(op, gl, xl, wl, local_bias, plans, k_sizes, stride, local_padding, padding, dilation,
                    local_output_padding, groups, mask):
    """Adjoint of :func:`_tconv_forward`: the output gradient un-fitted to the local transposed
    convolution's output (the negated pads), its backward on the windows; the bias gradient is
    the sum of this rank's output-gradient chunk (every output position belongs to one rank)."""
    gb = gl.sum([0] + list(range(2, gl.dim()))) if mask[2] and local_bias is not None else None
    if gl.numel() == 0 or xl.numel() == 0 or wl.numel() == 0:
        gi = C.consumed(xl.new_zeros(xl.shape), gl, xl) if mask[0] else None
        gw = C.consumed(wl.new_zeros(wl.shape), gl, xl) if mask[1] else None
        return gi, gw, gb
    pads = _tconv_fit(plans, k_sizes, stride, dilation, padding, xl.dim())
    g_local = aten.constant_pad_nd.default(gl, [-p for p in pads])
    gi, gw, _ = op(g_local, xl, wl, None, stride, local_padding, dilation, True, local_output_padding, groups,
                   [mask[0], mask[1], False])
    return gi, gw, gb


# ---------------------------------------------------------------------------------------------
# constant_pad_nd: shifting a sharded dim is a kernel-1 window exchange
# ---------------------------------------------------------------------------------------------


@register_handler(aten.constant_pad_nd.default)
def constant_pad_nd_handler(op, args, kwargs):
    """``constant_pad_nd`` with any placements.

    Per mesh dim: ``Shard(d)`` on an unpadded dim is kept; on a padded dim the OUTERMOST mesh dim
    sharding it keeps ``Shard(d)`` (chunk layout of the new length ``N + p_l + p_r``, data moved
    by a window exchange with kernel 1, stride 1, left padding ``p_l``; negative pads crop), inner
    ones replicate; ``Partial`` is kept when every term padded with ``value`` reduces to the padded
    value (avg/max/min always, sum when ``value == 0``); the rest is replicated.
    """
    x, pad, value = bind(op, args, kwargs)
    check_dtensors(op, [x])
    pad = [int(p) for p in pad]
    gout = meta_run(op, x, pad, value)
    ndim = x.dim()
    pads = {}  # tensor dim -> (left, right)
    for k in range(len(pad) // 2):
        d = ndim - 1 - k
        if pad[2 * k] or pad[2 * k + 1]:
            pads[d] = (pad[2 * k], pad[2 * k + 1])
    mesh = x._spec.mesh
    coord = C.mesh_coordinate(mesh)
    targets, shifted = [], []
    seen: set[int] = set()
    for i, p in enumerate(x._spec.placements):
        if isinstance(p, Shard):
            if p.dim not in pads:
                targets.append(p)
            elif p.dim not in seen:
                seen.add(p.dim)
                targets.append(p)
                shifted.append((i, p.dim))
            else:
                targets.append(R)
        elif isinstance(p, Partial):
            keep = p.reduce_op in ("avg", "max", "min") or (p.reduce_op == "sum" and value == 0)
            targets.append(p if keep else R)
        else:
            targets.append(R)
    out_spec = DTensorSpec(mesh, tuple(targets), tuple(gout.shape), tuple(gout.stride()), gout.dtype)
    with op_context(op):
        xl = to_local(x, targets)
        local_pad = list(pad)
        for i, d in shifted:
            pl, _ = pads[d]
            plan = halo.window_plan(x.shape[d], gout.shape[d], mesh.shape[i], coord[i], 1, 1, pl)
            xl = halo.exchange(xl, plan, d, mesh, i, fill=value)
            k = ndim - 1 - d
            local_pad[2 * k] = local_pad[2 * k + 1] = 0
        out = op(xl, local_pad, value) if any(local_pad) or not shifted else xl
        if out is x._local_tensor:  # never alias the input
            out = out.clone()
    if tuple(out.shape) != out_spec.local_shape(coord):
        raise AssertionError(f"{op}: local output {tuple(out.shape)} does not match {out_spec} at {coord}")
    return wrap(out, out_spec)
