"""Normalisations: softmax / log_softmax and layer_norm, with their backward ops.

Softmax-like ops shard any dim but the one they normalise over.  layer_norm shards the leading
(batch-like) dims; its weight/bias gradients are sums over those dims, hence Partial(sum).  The
backward ops are linear in the incoming gradient, so a Partial gradient passes straight through.
Group norm and batch norm (instance norm is batch norm to PyTorch) are handlers: their statistics
over sharded dims are merged in ONE collective per direction (see "fused statistics").
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from dtshard.registry import OpCall, register_rule
from dtshard.rules._common import LINEAR_REDUCE_OPS, R, contiguous_strides, norm_dim
from dtshard.spec import TensorMeta

aten = torch.ops.aten


def _softmax_meta(call: OpCall):
    """_softmax / _log_softmax / _safe_softmax: the input's shape, contiguous, its dtype (declines
    half_to_float or a dtype, 0-d and integer inputs, plain-tensor arguments)."""
    x = call.arg(0, "self")
    third = call.arg(2, "dtype" if call.op is aten._safe_softmax.default else "half_to_float")
    if not isinstance(x, TensorMeta) or x.ndim == 0 or third:  # half_to_float, or a dtype
        return None
    dim = call.arg(1, "dim")
    if type(dim) is not int or not -x.ndim <= dim < x.ndim:
        return None  # the meta kernel does not check dim; the CPU kernel does: let them decide
    if not (x.dtype.is_floating_point or x.dtype.is_complex):
        return None  # integer inputs: let the kernel raise its own error
    return [TensorMeta(x.shape, contiguous_strides(x.shape), x.dtype)]


@register_rule([aten._softmax.default, aten._log_softmax.default, aten._safe_softmax.default], meta=_softmax_meta)
def softmax_rule(call: OpCall):
    x = call.tensors[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    return [((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]


@register_rule([aten._softmax_backward_data.default, aten._log_softmax_backward_data.default])
def softmax_backward_rule(call: OpCall):
    out = call.tensors[1]
    dim = norm_dim(call.arg(2, "dim"), out.ndim)
    strategies = [((Shard(d),), (Shard(d), Shard(d))) for d in range(out.ndim) if d != dim]
    for op in LINEAR_REDUCE_OPS:  # linear in the incoming gradient
        strategies.append(((Partial(op),), (Partial(op), R)))
    return strategies


def _layer_norm_meta(call: OpCall):
    """native_layer_norm's outputs as its meta kernel gives them: ``out`` like the input,
    ``mean``/``rstd`` with the normalised dims kept as 1, in the computation dtype (float32 for
    half/bfloat16 inputs); the same argument checks."""
    x = call.arg(0, "input")
    ns = tuple(call.arg(1, "normalized_shape"))
    weight, bias = call.arg(2, "weight"), call.arg(3, "bias")
    if not isinstance(x, TensorMeta) or not all(w is None or isinstance(w, TensorMeta) for w in (weight, bias)):
        return None  # plain tensors among the arguments: let the meta kernel decide
    if not ns or x.ndim < len(ns) or x.shape[x.ndim - len(ns):] != ns:
        raise RuntimeError(f"native_layer_norm: normalized_shape {list(ns)} does not match the input of size {x.shape}")
    for w in (weight, bias):
        if w is not None and w.shape != ns:
            raise RuntimeError(f"native_layer_norm: weight/bias of shape {w.shape}, expected {list(ns)}")
    if x.dtype.is_complex:
        raise RuntimeError("native_layer_norm does not support complex inputs")
    stat_shape = x.shape[: x.ndim - len(ns)] + (1,) * len(ns)
    stat_dtype = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    stat = TensorMeta(stat_shape, contiguous_strides(stat_shape), stat_dtype)
    return [TensorMeta(x.shape, contiguous_strides(x.shape), x.dtype), stat, stat]


@register_rule(aten.native_layer_norm.default, meta=_layer_norm_meta)
def layer_norm_rule(call: OpCall):
    x = call.tensors[0]
    axis = x.ndim - len(call.arg(1, "normalized_shape"))
    n_params = len(call.tensors) - 1  # weight and/or bias when given
    return [((Shard(d), Shard(d), Shard(d)), (Shard(d),) + (R,) * n_params) for d in range(axis)]


@register_rule(aten.native_layer_norm_backward.default)
def layer_norm_backward_rule(call: OpCall):
    # tensors: grad_out, input, mean, rstd, [weight], [bias]
    x = call.tensors[1]
    axis = x.ndim - len(call.arg(2, "normalized_shape"))
    n_params = len(call.tensors) - 4
    strategies = []
    for d in range(axis):
        ins = (Shard(d), Shard(d), Shard(d), Shard(d)) + (R,) * n_params
        strategies.append(((Shard(d), Partial("sum"), Partial("sum")), ins))
    for op in LINEAR_REDUCE_OPS:  # every output is linear in grad_out
        strategies.append(((Partial(op),) * 3, (Partial(op),) + (R,) * (3 + n_params)))
    return strategies


# ---------------------------------------------------------------------------------------------
# group_norm and batch_norm: handlers
# ---------------------------------------------------------------------------------------------
#
# native_group_norm takes the batch size N as an argument, so a batch shard cannot run the op with
# its global arguments (and a rule's local-shape check would reject it), and over spatial shards
# its statistics must be global: the handler merges every rank's (see "fused statistics" below),
# keeping the batch, spatial and whole-group channel shards.  Batch norm in training normalises
# with statistics over every dim but the channels: when those dims are sharded, the local kernel
# would use local statistics, so the handler merges the GLOBAL mean and variance the same way (one
# all_gather of per-rank statistics, exact for uneven and empty shards), and the backward reduces
# the global sums in one all_reduce; on channel shards alone (instance norm of a batch shard) it
# runs the kernel on each rank's channels.  Forward one collective, backward one, per norm.

from torch.distributed.tensor.placement_types import Replicate  # noqa: E402

from dtshard import collectives as C  # noqa: E402
from dtshard.handlers import (  # noqa: E402
    DTensor, bind, check_dtensors, make_spec, meta_run, op_context, to_local, wrap)
from dtshard.registry import register_handler  # noqa: E402
from dtshard.layout import group_coords
from dtshard.spatial.adaptive_pool import blocks_align
from dtshard.spec import placements_str
from dtshard.redistribute import redistribute_local
from dtshard.spatial.conv_halo import SITE
from dtshard.spatial import halo_layout as SL
from dtshard.spatial.halo_layout import halo_partial, halos, with_halo


def _keep_shards(x, allowed) -> list:
    """x's placements with every Shard whose dim is not in ``allowed`` (and every Partial) replaced
    by Replicate."""
    return [p if isinstance(p, Shard) and p.dim in allowed else Replicate() for p in x.placements]


def _to(x, placements):
    if x is None or not isinstance(x, DTensor):
        return x
    placements = list(placements)
    return x if tuple(x.placements) == tuple(placements) else x.redistribute(x.device_mesh, placements)


def _rep(x):
    return None if x is None else _to(x, [Replicate()] * x.device_mesh.ndim)


def _local(x):
    return None if x is None else (x.to_local() if isinstance(x, DTensor) else x)


def _wrap(local, mesh, placements, shape):
    return DTensor.from_local(local, mesh, list(placements), shape=tuple(shape), stride=contiguous_strides(shape))


# ---- group norm ------------------------------------------------------------------------------
#
# native_group_norm(x (N, C, *spatial), weight, bias, N, C, HxW, G, eps) -> (out, mean, rstd), the
# statistics of shape (N, G) over each group's D = C/G channels and all spatial positions.  Per mesh
# dim of x:
#
#   x Shard(0)                  kept; statistics Shard(0); weight/bias grads Partial(sum)
#   x Shard(d), d >= 2          kept; the (N, G) statistics are merged over this mesh dim (forward:
#                               one all_gather of 2*N*G per-rank numbers; backward: one all_reduce
#                               of N*G*2 sums); statistics Replicate; weight/bias grads Partial(sum)
#   x Shard(1), groups whole    kept when every channel chunk is made of whole groups and those are
#                               exactly the rank's chunk of G (blocks_align(C, G)); statistics
#                               Shard(1); weight/bias (and their grads) Shard(0)
#   anything else               Replicate
#
# Forward: each rank's (mean, M2) per (N_local, G_local) statistic, merged over the spatial mesh dims
# in one all_gather (:func:`_fused_stats`); rstd = 1/sqrt(var + eps); out = (x-mean)*rstd*w + b, all
# local but that collective.  Backward (xhat = (x-mean)*rstd, gw = g*w per channel):
# grad_input = rstd * (gw - mean(gw) - xhat * mean(gw*xhat)), the two group means reduced as ONE
# stacked Partial sum; grad_weight = sum g*xhat and grad_bias = sum g over (N, spatial), local sums
# that are Partial(sum) over the batch and spatial mesh dims.  Every decision depends only on global
# shapes and placements; an empty shard contributes zero sums.  Accumulation is in float32 at least.


def _gn_layout(spec, group: int):
    """(x targets, statistics targets, per-channel (C,) targets, placements of the local (N, G)
    sums, placements of the local (C,) weight/bias gradients) for group norm of an x with ``spec``."""
    c = spec.shape[1] if spec.ndim > 1 else 1
    channel_dims = [i for i, p in enumerate(spec.placements) if isinstance(p, Shard) and p.dim == 1]
    whole_groups = bool(channel_dims) and blocks_align(c, group, spec.mesh_shape, channel_dims)
    x_t, stat_t, chan_t, sums, grads = [], [], [], [], []
    for p in spec.placements:
        if isinstance(p, Shard) and p.dim == 0:
            x_t.append(p), stat_t.append(Shard(0)), chan_t.append(R), sums.append(Shard(0))
            grads.append(Partial("sum"))
        elif isinstance(p, Shard) and p.dim >= 2:
            x_t.append(p), stat_t.append(R), chan_t.append(R), sums.append(Partial("sum"))
            grads.append(Partial("sum"))
        elif isinstance(p, Shard) and p.dim == 1 and whole_groups:
            x_t.append(p), stat_t.append(Shard(1)), chan_t.append(Shard(0)), sums.append(Shard(1))
            grads.append(Shard(0))
        else:
            x_t.append(R), stat_t.append(R), chan_t.append(R), sums.append(R), grads.append(R)
    return tuple(x_t), tuple(stat_t), tuple(chan_t), tuple(sums), tuple(grads)


def _gn_context(op, tensors) -> str:
    ins = ", ".join(f"{tuple(t.shape)} {placements_str(t.placements)}" for t in tensors if t is not None)
    return f"{op} on inputs [{ins}] over mesh {tuple(tensors[0].device_mesh.shape)}"


def _gn_acc(t: torch.Tensor) -> torch.Tensor:
    """Accumulate half-precision inputs in float32."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _gn_reduce(local, mesh, sums, stat_t, shape, dtype):
    """Local (N, G[, k]) sums with placements ``sums`` reduced to ``stat_t`` (Partial -> Replicate:
    one all_reduce over the spatial mesh dims; nothing when none is sharded)."""
    return redistribute_local(local, make_spec(mesh, sums, shape, dtype), stat_t)


# ---- fused statistics: one collective per norm forward ----------------------------------------
#
# A norm's statistics over sharded dims need the global mean and variance.  Reducing the sum, then
# the centred squares about the global mean, is two collectives; one all_reduce of (sum, sum of
# squares) is unstable (the variance is a difference of two large numbers when |mean| >> std), and
# a shift every rank knows without communication does not exist in general (group norm has none;
# batch norm's running mean is 0 at the first step).  So each rank computes its own (mean, M2) per
# statistic (two passes: the mean, then the sum of squared deviations; float32 at least), the pairs
# of the group are gathered in ONE all_gather (2 numbers per statistic per rank: statistics, never
# activations), and every rank merges them the same way (Chan et al.'s parallel formula, in group
# order: mean = sum n_i m_i / N, M2 = sum M2_i + sum n_i (m_i - mean)^2), which is as stable as a
# two-pass variance and bitwise identical on every rank.  The counts n_i are metadata: every rank
# knows every rank's shard shape from the spec, so they do not travel.  The pairs travel and merge
# in float64 whatever the input's dtype (2 * 8 bytes per statistic per rank).


def _stat_counts(spec, mesh_dims, reduced, coord, per: int = 1) -> list[int]:
    """For each rank of the (flattened) group of ``mesh_dims`` around ``coord``, in group order:
    how many elements of one statistic its shard of ``spec`` holds (the product of its local
    sizes over the tensor dims ``reduced``, times ``per``)."""
    out = []
    for c in group_coords(spec.mesh_shape, mesh_dims, coord):
        shape = spec.local_shape(c)
        n = per
        for d in reduced:
            n *= shape[d]
        out.append(n)
    return out


def _fused_stats(xs, dims, counts, mesh, mesh_dims):
    """(mean, biased var) over ``dims`` of the local ``xs`` (accumulation dtype) merged over the
    group of ``mesh_dims`` (``counts``: elements per statistic of each member, group order) with
    one all_gather of the per-rank (mean, M2); no collective when ``mesh_dims`` is empty."""
    dims = tuple(d % xs.dim() for d in dims)
    n_local = 1
    for d in dims:
        n_local *= xs.shape[d]
    if n_local:
        mean, m2 = _mean_m2(xs, dims)
    else:  # an empty shard contributes nothing (its count is 0)
        shape = [s for d, s in enumerate(xs.shape) if d not in dims]
        mean = m2 = xs.new_zeros(shape)
    if not mesh_dims:
        return mean, m2 / n_local
    total = sum(counts)
    k = len(counts)
    # gathered and merged in float64 (a few numbers per statistic): the merged mean is then
    # rounded once to the accumulation dtype, as PyTorch's CPU kernels do (they accumulate in
    # double); float32 partial means would add their roundings
    stats = torch.stack([mean, m2]).to(torch.float64)
    parts = C.all_gather(stats, mesh, mesh_dims[0] if len(mesh_dims) == 1 else tuple(mesh_dims))
    parts = parts.view((k, 2) + tuple(mean.shape))
    n = torch.tensor(counts, dtype=torch.float64, device=xs.device).view((k,) + (1,) * mean.dim())
    means, m2s = parts[:, 0], parts[:, 1]
    mean = (n * means).sum(0) / total
    m2 = m2s.sum(0) + (n * (means - mean) ** 2).sum(0)
    return mean.to(xs.dtype), (m2 / total).to(xs.dtype)


def _mean_m2(xs, dims):
    """The local (mean, M2) over ``dims``, two-pass (the sum of squared deviations about the
    mean, as stable as ``var_mean`` and about 5x faster on CPU, whose Welford kernel is scalar)."""
    mean = xs.mean(dims, keepdim=True)
    m2 = torch.sub(xs, mean).square_().sum(dims)
    return mean.view(m2.shape), m2


def _partial_mesh_dims(sums) -> tuple:
    """The mesh dims whose local sums are Partial (the statistics are merged over them)."""
    return tuple(i for i, p in enumerate(sums) if isinstance(p, Partial))


def _gn_halo(x, x_t, weight, bias) -> bool:
    """Does this group norm compute on ``x``'s halo?  When the halo is replicated, on spatial
    dims, and nothing moves (see :mod:`dtshard.spatial`): the statistics then come from the
    owned rows only and the extended rows are normalised with them."""
    return (bool(halos(x._spec)) and not halo_partial(x._spec) and tuple(x_t) == tuple(x.placements)
            and all(h.dim >= 2 for h in halos(x._spec))
            and all(t is None or not halos(t._spec) for t in (weight, bias)))


def _with_halo_of(local, spec, x):
    """``local`` wrapped with ``spec`` plus ``x``'s halo (and the record of where it came from:
    spatial.conv_halo.SITE)."""
    res = wrap(local, with_halo(spec, halos(x._spec)))
    site = x.__dict__.get(SITE)
    if site is not None:
        res.__dict__[SITE] = site
    return res


def _owned(t, spec, coord):
    """The owned part of an extended local ``t`` laid out like ``spec`` (a view)."""
    return SL.narrow_local(t, spec, (), coord)


@register_handler(aten.native_group_norm.default, keeps_layout_data=True)
def group_norm_handler(op, args, kwargs):
    x, weight, bias, n, c, hxw, group, eps = bind(op, args, kwargs)
    check_dtensors(op, [t for t in (x, weight, bias) if t is not None])
    weight, bias = (None if t is None else SL.strip(t) for t in (weight, bias))
    SL.fresh(x)
    try:  # plain PyTorch's error for bad global shapes, with the context
        gout, gmean, grstd = meta_run(op, x, weight, bias, n, c, hxw, group, eps)
    except Exception as e:
        raise type(e)(f"{_gn_context(op, [x, weight, bias])}: {e}") from e
    mesh = x.device_mesh
    x_t, stat_t, chan_t, sums, _ = _gn_layout(x._spec, group)
    keep = _gn_halo(x, x_t, weight, bias)
    if halos(x._spec) and not keep:
        x = SL.strip(x)
    d = c // group
    with torch.no_grad(), op_context(op):
        xl = x._local_tensor if keep else to_local(x, x_t)
        wl = None if weight is None else to_local(weight, chan_t)
        bl = None if bias is None else to_local(bias, chan_t)
        nl, cl = xl.shape[0], xl.shape[1]
        gl = cl // d
        xo = _owned(xl, x._spec, C.mesh_coordinate(mesh)) if keep else xl  # the statistics' rows
        xg = _gn_acc(xo).reshape(nl, gl, d * _spatial_numel(xo))
        red = _partial_mesh_dims(sums)
        counts = _stat_counts(make_spec(mesh, x_t, x.shape, x.dtype), red, range(2, x.ndim), C.mesh_coordinate(mesh),
                              d) if red else ()
        mean, var = _fused_stats(xg, (-1,), counts, mesh, red)
        rstd = torch.rsqrt(var + eps)
        xc = _gn_acc(xl).reshape(nl, gl, d * _spatial_numel(xl)) - mean.unsqueeze(-1)
        y = (xc * rstd.unsqueeze(-1)).reshape(xl.shape)
        shape = [1, cl] + [1] * (xl.dim() - 2)
        if wl is not None:
            y = y * _gn_acc(wl).reshape(shape)
        if bl is not None:
            y = y + _gn_acc(bl).reshape(shape)
    out_spec = make_spec(mesh, x_t, gout.shape, gout.dtype)
    out = _with_halo_of(y.to(gout.dtype), out_spec, x) if keep else wrap(y.to(gout.dtype), out_spec)
    return (out,
            wrap(mean.to(gmean.dtype), make_spec(mesh, stat_t, gmean.shape, gmean.dtype)),
            wrap(rstd.to(grstd.dtype), make_spec(mesh, stat_t, grstd.shape, grstd.dtype)))


def _spatial_numel(t: torch.Tensor) -> int:
    n = 1
    for s in t.shape[2:]:
        n *= s
    return n


@register_handler(aten.native_group_norm_backward.default, keeps_layout_data=True)
def group_norm_backward_handler(op, args, kwargs):
    """Backward of :func:`group_norm_handler`.  With a halo (the forward normalised extended
    rows): the output gradient ``g`` is a partial halo (or a plain shard), ``x`` carries at least
    its rows.  The group sums run over every row ``g`` carries (each rank's contributions add up
    to the true sums); the input gradient's terms that do not scale ``g`` go on the owned rows
    only, so the result is a partial halo of ``g``'s widths."""
    g, x, mean, rstd, weight, n, c, hxw, group, mask = bind(op, args, kwargs)
    check_dtensors(op, [t for t in (g, x, mean, rstd, weight) if t is not None])
    mean, rstd, weight = (None if t is None else SL.strip(t) for t in (mean, rstd, weight))
    SL.fresh(g), SL.fresh(x)
    try:
        g_in, g_w, g_b = meta_run(op, g, x, mean, rstd, weight, n, c, hxw, group, mask)
    except Exception as e:
        raise type(e)(f"{_gn_context(op, [g, x, mean, rstd, weight])}: {e}") from e
    mesh = x.device_mesh
    x_t, stat_t, chan_t, sums, grads = _gn_layout(x._spec, group)
    coord = C.mesh_coordinate(mesh)
    if halos(g._spec) and not halo_partial(g._spec):
        g = SL.strip(g)
    # the rows g carries: x must carry them too (it does when the forward kept its halo)
    keep = bool(halos(g._spec)) and _gn_halo(x, x_t, None, None) and tuple(g.placements) == tuple(x_t) and all(
        SL.halo_widths(x._spec, h.dim)[0] >= h.lo and SL.halo_widths(x._spec, h.dim)[1] >= h.hi for h in halos(g._spec))
    if halos(g._spec) and not keep:
        SL.demote_(g)
    d = c // group
    count = d * hxw
    gi = gw = gb = None
    with torch.no_grad(), op_context(op):
        if keep:
            xl = SL.narrow_local(x._local_tensor, x._spec, halos(g._spec), coord)
            gl = g._local_tensor
        else:
            if halos(x._spec):
                x = SL.strip(x)
            xl, gl = to_local(x, x_t), to_local(g, x_t)
        nl, cl = xl.shape[0], xl.shape[1]
        gloc, hwl = cl // d, _spatial_numel(xl)
        shape4 = (nl, gloc, d, hwl)
        xg = _gn_acc(xl).reshape(shape4)
        gg = _gn_acc(gl).reshape(shape4)
        acc = xg.dtype
        meanl = _gn_acc(to_local(mean, stat_t)).reshape(nl, gloc, 1, 1)
        rstdl = _gn_acc(to_local(rstd, stat_t)).reshape(nl, gloc, 1, 1)
        xhat = (xg - meanl) * rstdl
        if mask[0]:
            gwt = gg if weight is None else gg * _gn_acc(to_local(weight, chan_t)).reshape(1, gloc, d, 1)
            s = torch.stack([gwt.sum((2, 3)), (gwt * xhat).sum((2, 3))], -1)  # (N, G, 2): one reduction
            s = _gn_reduce(s, mesh, sums, stat_t, (n, group, 2), acc) / count
            gi_spec = make_spec(mesh, x_t, x.shape, g_in.dtype)
            if keep:  # g's rows scaled on every row; the group terms once, on the owned rows
                gi = (rstdl * gwt).reshape(xl.shape)
                own = _owned(gi, g._spec, coord)  # a view: written in place
                xh = _owned(xhat.reshape(xl.shape), g._spec, coord)

                def per_channel(t):
                    return t.reshape(nl, gloc).repeat_interleave(d, 1).reshape((nl, cl) + (1,) * (xl.dim() - 2))

                own -= per_channel(rstdl) * (per_channel(s[..., 0]) + xh * per_channel(s[..., 1]))
                gi_spec = with_halo(gi_spec, halos(g._spec), partial=True)
            else:
                gi = (rstdl * (gwt - s[..., 0, None, None] - xhat * s[..., 1, None, None])).reshape(xl.shape)
            gi = wrap(gi.to(g_in.dtype), gi_spec)
        if mask[1] and g_w is not None:
            gw = (gg * xhat).sum((0, 3)).reshape(cl)
            gw = wrap(gw.to(g_w.dtype), make_spec(mesh, grads, (c,), g_w.dtype))
        if mask[2] and g_b is not None:
            gb = gg.sum((0, 3)).reshape(cl)
            gb = wrap(gb.to(g_b.dtype), make_spec(mesh, grads, (c,), g_b.dtype))
    return gi, gw, gb


def _bn_dims(x):
    return [0] + list(range(2, x.ndim))


def _bn_sharded(x) -> bool:
    return any(isinstance(p, Partial) or (isinstance(p, Shard) and p.dim != 1) for p in x.placements)


def _bn_train_forward(op, x, weight, bias, running_mean, running_var, momentum, eps):
    """Batch norm in training with global statistics on local shards: x keeps its shards off the
    channel dim, the per-channel (mean, var) come from one all_gather of the per-rank (mean, M2)
    (:func:`_fused_stats`); returns (out, mean, invstd)."""
    mesh = x.device_mesh
    target = _keep_shards(x, set(range(x.ndim)) - {1})
    with op_context(op):
        xl = to_local(x, target)
        out, mean, invstd = _bn_stats_normalise(x, make_spec(mesh, target, x.shape, x.dtype), xl, xl, weight, bias,
                                                running_mean, running_var, momentum, eps)
    rep = [Replicate()] * mesh.ndim
    return (wrap(out.to(x.dtype), make_spec(mesh, target, x.shape, x.dtype)),
            _wrap(mean.to(x.dtype), mesh, rep, (x.shape[1],)), _wrap(invstd.to(x.dtype), mesh, rep, (x.shape[1],)))


def _bn_stats_normalise(x, spec, xo, xl, weight, bias, running_mean, running_var, momentum, eps):
    """The local part of training batch norm: statistics of the owned local rows ``xo`` (laid
    out as ``spec``) merged over the sharded mesh dims in one collective, the running statistics
    updated, every row of ``xl`` normalised; (out, mean, invstd) as local tensors (accumulation
    dtype)."""
    mesh = x.device_mesh
    c = x.shape[1]
    n = x.numel() // c
    dims = tuple(_bn_dims(xl))
    red = _partial_mesh_dims(_bn_sums(spec))
    counts = _stat_counts(spec, red, dims, C.mesh_coordinate(mesh)) if red else ()
    mean, var = _fused_stats(_gn_acc(xo), dims, counts, mesh, red)
    invstd = torch.rsqrt(var + eps)
    # (x - mean) * invstd * w + b in one pass: the eval-mode kernel with the global statistics as
    # its running ones (what PyTorch's training kernel computes once it has the statistics)
    w = None if weight is None else _gn_acc(_local(_rep(weight)))
    b = None if bias is None else _gn_acc(_local(_rep(bias)))
    y = aten.native_batch_norm.default(_gn_acc(xl), w, b, mean, var, False, 0.0, eps)[0]
    rep = [Replicate()] * mesh.ndim
    for buf, new in ((running_mean, mean), (running_var, var * (n / (n - 1) if n > 1 else float("inf")))):
        if buf is not None:
            upd = _local(_rep(buf)) * (1 - momentum) + new.to(buf.dtype) * momentum
            aten.copy_.default(buf, _to(_wrap(upd, mesh, rep, (c,)), buf.placements))
    return y, mean, invstd


def _bn_local(op, x, rest, training):
    """Run the op on local shards: the input keeps shards off the channel dim in eval (and in
    training only when nothing is sharded there); per-channel tensors are replicated."""
    mesh = x.device_mesh
    target = _keep_shards(x, set(range(x.ndim)) - {1}) if not training else [Replicate()] * mesh.ndim
    x = _to(x, target)
    outs = op(_local(x), *[_local(_rep(a)) if isinstance(a, DTensor) else a for a in rest])
    res = [_wrap(outs[0], mesh, target, x.shape)]
    for o in outs[1:]:
        res.append(_wrap(o, mesh, [Replicate()] * mesh.ndim, tuple(o.shape)))
    return tuple(res)


def _bn_channel_shards(x) -> bool:
    """Is ``x`` sharded on the channel dim only (what instance norm's view (1, N*C, ...) makes of
    a batch shard)?  Batch norm is then local to each rank's channels, in training too."""
    return any(isinstance(p, Shard) for p in x.placements) and all(
        isinstance(p, Replicate) or (isinstance(p, Shard) and p.dim == 1) for p in x.placements)


def _bn_per_channel(x, t, chan):
    """A per-channel argument of batch norm: its local chunk of ``x``'s channels (a DTensor of
    x's channel count), else as it is (a DTensor replicated: an empty saved statistic)."""
    if not isinstance(t, DTensor):
        return t
    if t.ndim == 1 and t.shape[0] == x.shape[1]:
        return to_local(t, chan)
    return _local(_rep(t))


def _bn_channels(op, x, acts, rest, buffers=(), stats_per_channel=True):
    """Batch norm (forward or backward, ``op``) on ``x``'s channel shards: the op on each rank's
    channels (``acts``: the activations laid out like ``x``, first in the op's arguments), the
    per-channel arguments (``rest``) chunked alike, without a collective.  ``buffers``: the
    positions in ``rest`` of running statistics the kernel updates in place (written back).
    Outputs shaped like x keep its placements; per-channel outputs are chunks of the channels
    (``stats_per_channel``; otherwise an eval's empty saved statistics, replicated)."""
    mesh = x.device_mesh
    chan = [Shard(0) if isinstance(p, Shard) else Replicate() for p in x.placements]
    c = x.shape[1]
    with op_context(op):
        xl = [to_local(a, x.placements) for a in acts]
        rl = [_bn_per_channel(x, t, chan) for t in rest]
        for k in buffers:
            if rl[k] is not None:
                rl[k] = rl[k].clone()
        if xl[0].numel() == 0:  # no channel on this rank: the kernel refuses an empty input
            mask = rest[-1] if len(acts) == 2 else [True] * 3
            outs = [C.consumed(torch.zeros_like(xl[-1]), *xl)] + [
                xl[-1].new_empty(0) for _ in range(len(op._schema.returns) - 1)]
            outs = [o if keep else None for o, keep in zip(outs, mask)]
        else:
            outs = op(*xl, *rl)
        bufs = [k for k in buffers if isinstance(rest[k], DTensor)]
        if bufs:  # every rank's channels of the running statistics: one all_gather for all of them
            pieces = _wrap(torch.stack([rl[k] for k in bufs]), mesh, [Shard(1) if isinstance(p, Shard) else p for p in chan],
                           (len(bufs), c))
            whole = _rep(pieces)
            for i, k in enumerate(bufs):
                aten.copy_.default(rest[k], _to(aten.select.int(whole, 0, i), rest[k].placements))
    res = []
    for o in outs:
        if o is None:
            res.append(None)
        elif o.dim() == x.ndim:
            res.append(_wrap(o, mesh, x.placements, x.shape))
        elif o.dim() == 1 and stats_per_channel:
            res.append(_wrap(o, mesh, chan, (c,)))
        else:
            res.append(_wrap(o, mesh, [Replicate()] * mesh.ndim, tuple(o.shape)))
    return tuple(res)


def _write_back(dts, locals_):
    for d, loc in zip(dts, locals_):
        if isinstance(d, DTensor) and loc is not None:
            aten.copy_.default(d, _to(_wrap(loc, d.device_mesh, [Replicate()] * d.device_mesh.ndim, d.shape),
                                      d.placements))


def _bn_halo(x) -> bool:
    """Does batch norm in training compute on ``x``'s halo (replicated, on spatial dims, the
    channels not sharded)?  Statistics from the owned rows, every carried row normalised."""
    return (bool(halos(x._spec)) and not halo_partial(x._spec) and all(h.dim >= 2 for h in halos(x._spec))
            and not any(isinstance(p, Partial) or (isinstance(p, Shard) and p.dim == 1) for p in x.placements))


def _bn_sums(x):
    """Placements of per-channel local sums of ``x`` (or of a spec): Partial over the mesh dims
    that shard it (off the channel dim, as batch norm's layouts are)."""
    return [Partial("sum") if isinstance(p, Shard) else Replicate() for p in x.placements]


def _bn_halo_forward(op, x, weight, bias, running_mean, running_var, momentum, eps):
    """:func:`_bn_train_forward` on a halo layout, on local tensors: (out with x's halo, mean,
    invstd); the statistics of the owned rows are merged in one collective."""
    mesh = x.device_mesh
    coord = C.mesh_coordinate(mesh)
    rep = [Replicate()] * mesh.ndim
    c = x.shape[1]
    xl = x._local_tensor
    with op_context(op):
        y, mean, invstd = _bn_stats_normalise(x, x._spec, _owned(xl, x._spec, coord), xl, weight, bias,
                                              running_mean, running_var, momentum, eps)
    out = _with_halo_of(y.to(x.dtype), make_spec(mesh, x.placements, x.shape, x.dtype), x)
    return out, _wrap(mean.to(x.dtype), mesh, rep, (c,)), _wrap(invstd.to(x.dtype), mesh, rep, (c,))


def _bn_halo_backward(g, x, w, smean, sinv, mask, eps):
    """Backward of :func:`_bn_halo_forward` (as group norm's: sums over every row the partial
    gradient carries, the terms that do not scale it on the owned rows only)."""
    mesh = x.device_mesh
    coord = C.mesh_coordinate(mesh)
    rep = [Replicate()] * mesh.ndim
    c = x.shape[1]
    n = x.numel() // c
    xl = _gn_acc(SL.narrow_local(x._local_tensor, x._spec, halos(g._spec), coord))
    gl = _gn_acc(g._local_tensor)
    shape = [1, c] + [1] * (xl.dim() - 2)
    mean, inv = _gn_acc(_local(_rep(smean))), _gn_acc(_local(_rep(sinv)))
    local_g, local_gx = _bn_local_sums(gl, xl, mean, inv, eps)
    gi = gw = gb = None
    psum = _bn_sums(x)
    if mask[0]:
        s = _gn_reduce(torch.stack([local_g, local_gx]), mesh, psum, rep, (2, c), local_g.dtype) / n
        scale = inv if w is None else inv * _gn_acc(_local(_rep(w)))
        gi = gl * scale.view(shape)
        # the owned rows also get the terms of the statistics
        _owned(gi, g._spec, coord).add_(_bn_stat_terms(_owned(xl, g._spec, coord), mean, inv, scale, s, shape))
        gi = wrap(gi.to(g.dtype), with_halo(make_spec(mesh, x.placements, x.shape, g.dtype), halos(g._spec), partial=True))
    if mask[1]:
        gw = _wrap(local_gx.to(g.dtype), mesh, psum, (c,))
    if mask[2]:
        gb = _wrap(local_g.to(g.dtype), mesh, psum, (c,))
    return gi, gw, gb


def _bn_local_sums(gl, xl, mean, inv, eps):
    """This rank's per-channel (sum of g, sum of g * xhat), xhat = (x - mean) * inv, in one pass:
    PyTorch's backward kernel with the saved statistics computes exactly these as its bias and
    weight gradients.  (An empty shard sums to zero: the kernel divides by its size.)"""
    if xl.numel() == 0:
        return mean.new_zeros(mean.shape), mean.new_zeros(mean.shape)
    _, local_gx, local_g = aten.native_batch_norm_backward.default(
        gl, xl, None, None, None, mean, inv, True, eps, [False, True, True])
    return local_g, local_gx


def _bn_stat_terms(xl, mean, inv, scale, s, shape):
    """The input gradient's terms from the statistics, ``-scale * (s0 + xhat * s1)`` with xhat =
    (x - mean) * inv (``s``: the global means of g and g * xhat), as a new tensor shaped like
    ``xl``: (x - mean) * (-scale * inv * s1) - scale * s0, in two passes over one buffer."""
    t = torch.sub(xl, mean.view(shape))
    return torch.addcmul((-scale * s[0]).view(shape), t, (-scale * inv * s[1]).view(shape), out=t)


def _bn_train_backward(g, x, w, smean, sinv, mask, target, eps):
    """Backward of :func:`_bn_train_forward` on local shards (``g`` and ``x`` laid out as
    ``target``): the per-channel sums of g and g * xhat in ONE all_reduce (stacked), the input
    gradient local, the weight and bias gradients Partial sums."""
    mesh = x.device_mesh
    rep = [Replicate()] * mesh.ndim
    c = x.shape[1]
    n = x.numel() // c
    xl, gl = _gn_acc(to_local(x, target)), _gn_acc(to_local(g, target))
    shape = [1, c] + [1] * (xl.dim() - 2)
    mean, inv = _gn_acc(_local(_rep(smean))), _gn_acc(_local(_rep(sinv)))
    local_g, local_gx = _bn_local_sums(gl, xl, mean, inv, eps)
    psum = _bn_sums(make_spec(mesh, target, x.shape, x.dtype))
    gi = gw = gb = None
    if mask[0]:
        s = _gn_reduce(torch.stack([local_g, local_gx]), mesh, psum, rep, (2, c), local_g.dtype) / n
        scale = inv if w is None else inv * _gn_acc(_local(_rep(w)))
        gi = _bn_stat_terms(xl, mean, inv, scale, s, shape).addcmul_(gl, scale.view(shape))
        gi = wrap(gi.to(g.dtype), make_spec(mesh, target, x.shape, g.dtype))
    if mask[1]:
        gw = _wrap(local_gx.to(g.dtype), mesh, psum, (c,))
    if mask[2]:
        gb = _wrap(local_g.to(g.dtype), mesh, psum, (c,))
    return gi, gw, gb


def _bn_fresh(t) -> None:
    if isinstance(t, DTensor):
        SL.fresh(t)


def _bn_strip(t):
    if isinstance(t, DTensor) and halos(t._spec):
        if halo_partial(t._spec):
            SL.demote_(t)
            return t
        return SL.strip(t)
    return t


@register_handler([aten.native_batch_norm.default, aten._native_batch_norm_legit.default], keeps_layout_data=True)
def batch_norm_handler(op, args, kwargs):
    with torch.no_grad():
        names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
        x, w, b, rm, rv, training, momentum, eps = (list(args) + [kwargs.get(k) for k in names][len(args):])[:8]
        _bn_fresh(x)
        if training and _bn_halo(x):
            return _bn_halo_forward(op, x, w, b, rm, rv, momentum, eps)
        x = _bn_strip(x)
        if _bn_channel_shards(x):  # channels sharded only: local to each rank's channels
            return _bn_channels(op, x, [x], [w, b, rm, rv, training, momentum, eps], (2, 3) if training else (), training)
        if training and _bn_sharded(x):
            return _bn_train_forward(op, x, w, b, rm, rv, momentum, eps)
        if training:
            # whole batch on every rank: the local kernel updates the replicated running stats
            rml = _local(_rep(rm)).clone() if rm is not None else None
            rvl = _local(_rep(rv)).clone() if rv is not None else None
            mesh = x.device_mesh
            x = _rep(x)
            out = op(_local(x), _local(_rep(w)), _local(_rep(b)), rml, rvl, training, momentum, eps)
            _write_back([rm, rv], [rml, rvl])
            rep = [Replicate()] * mesh.ndim
            return tuple(_wrap(o, mesh, rep, tuple(o.shape)) for o in out)
        return _bn_local(op, x, [w, b, rm, rv, training, momentum, eps], False)


@register_handler(aten._native_batch_norm_legit.no_stats, keeps_layout_data=True)
def batch_norm_no_stats_handler(op, args, kwargs):
    with torch.no_grad():
        x, w, b, training, momentum, eps = (list(args) + [kwargs.get(k) for k in (
            "input", "weight", "bias", "training", "momentum", "eps")][len(args):])[:6]
        _bn_fresh(x)
        if _bn_halo(x):
            return _bn_halo_forward(op, x, w, b, None, None, momentum, eps)
        x = _bn_strip(x)
        if _bn_channel_shards(x):
            return _bn_channels(op, x, [x], [w, b, training, momentum, eps])
        if _bn_sharded(x):
            return _bn_train_forward(op, x, w, b, None, None, momentum, eps)
        return _bn_local(op, x, [w, b, training, momentum, eps], True)


@register_handler(aten.native_batch_norm_backward.default, keeps_layout_data=True)
def batch_norm_backward_handler(op, args, kwargs):
    with torch.no_grad():
        names = ("grad_out", "input", "weight", "running_mean", "running_var", "save_mean", "save_invstd",
                 "train", "eps", "output_mask")
        g, x, w, rm, rv, smean, sinv, train, eps, mask = (list(args) + [kwargs.get(k) for k in names][len(args):])[:10]
        _bn_fresh(g), _bn_fresh(x)
        if isinstance(g, DTensor) and halos(g._spec) and not halo_partial(g._spec):
            g = SL.strip(g)
        if (train and isinstance(g, DTensor) and halos(g._spec) and _bn_halo(x) and tuple(g.placements) == tuple(x.placements)
                and all(SL.halo_widths(x._spec, h.dim)[0] >= h.lo and SL.halo_widths(x._spec, h.dim)[1] >= h.hi
                        for h in halos(g._spec))):
            with op_context(op):
                return _bn_halo_backward(g, x, w, smean, sinv, mask, eps)
        g, x = _bn_strip(g), _bn_strip(x)
        if _bn_channel_shards(x):
            return _bn_channels(op, x, [g, x], [w, rm, rv, smean, sinv, train, eps, mask])
        mesh = x.device_mesh
        target = _keep_shards(x, set(range(x.ndim)) - {1})
        x, g = _to(x, target), _to(g, target)
        sharded = any(isinstance(p, Shard) for p in target)
        psum = [Partial("sum") if isinstance(p, Shard) else Replicate() for p in target]
        c = x.shape[1]
        if not train or not sharded:
            gi, gw, gb = op(_local(g), _local(x), _local(_rep(w)), _local(_rep(rm)), _local(_rep(rv)),
                            _local(_rep(smean)), _local(_rep(sinv)), train, eps, mask)
            return (None if gi is None else _wrap(gi, mesh, target, x.shape),
                    None if gw is None else _wrap(gw, mesh, psum, (c,)),
                    None if gb is None else _wrap(gb, mesh, psum, (c,)))
        with op_context(op):
            return _bn_train_backward(g, x, w, smean, sinv, mask, target, eps)


@register_handler(aten._batch_norm_with_update.default, keeps_layout_data=True)
def batch_norm_with_update_handler(op, args, kwargs):
    """(out, save_mean, save_invstd, reserve): native_batch_norm in training mode, plus an empty
    reserve buffer (CPU)."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "momentum", "eps")
    x, w, b, rm, rv, momentum, eps = (list(args) + [kwargs.get(k) for k in names][len(args):])[:7]
    out, mean, invstd = batch_norm_handler(aten.native_batch_norm.default, (x, w, b, rm, rv, True, momentum, eps), {})
    with torch.no_grad():
        mesh = x.device_mesh
        reserve = _wrap(torch.empty(0, dtype=torch.uint8), mesh, [Replicate()] * mesh.ndim, (0,))
    return out, mean, invstd, reserve


@register_handler(aten.batch_norm_backward.default, keeps_layout_data=True)
def batch_norm_backward_new_handler(op, args, kwargs):
    names = ("grad_out", "input", "weight", "running_mean", "running_var", "save_mean", "save_var",
             "update", "eps", "output_mask", "reserve")
    g, x, w, rm, rv, smean, svar, update, eps, mask, _ = (list(args) + [kwargs.get(k) for k in names][len(args):])[:11]
    return batch_norm_backward_handler(aten.native_batch_norm_backward.default,
                                       (g, x, w, rm, rv, smean, svar, update, eps, mask), {})
