"""Everything else: batched linear algebra (shard the batch dims), diagonal-style views, ops whose
output SHAPE depends on the data (nonzero, unique, masked_select, ...), and ops that are only
correct on whole tensors (replicate-only rules, so they work instead of raising NoRuleError).

- **Batched matrix ops** (``linalg.inv``, ``svd``, ``solve``, ``cholesky``, ``qr``, ``eigh``, ...)
  act on the last one or two dims independently per batch index: every input and output that has
  the leading batch dims may be sharded on one of them (the framework checks the local shapes of
  every output, so ops whose outputs lack the batch dims just replicate).
- **Data-dependent shapes** cannot be planned from metadata (the meta kernel cannot size the
  result): a handler replicates the inputs, runs the op on the full tensors on every rank and
  returns replicated results.
- **Replicate-only** ops (explicit, correct whole-tensor fallbacks; several could do better): an
  empty strategy list means "all-Replicate", which the framework always adds.  Registered only for
  ops no other family has a rule for, and this module is imported LAST, so a family file that
  adds a real rule later simply takes precedence.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard.registry import OpCall, register_handler, register_rule
from dtshard.rules._common import aten_ops, norm_dim
from dtshard.tensor import DTensor
from dtshard.registry import get_entry

aten = torch.ops.aten


# (op name, number of trailing "matrix" dims of the FIRST input)
_BATCHED = [
    ("linalg_inv_ex", 2), ("_linalg_solve_ex", 2), ("_linalg_svd", 2), ("_linalg_eigh", 2),
    ("linalg_cholesky_ex", 2), ("linalg_qr", 2), ("linalg_lu_factor_ex", 2), ("linalg_lu", 2),
    ("linalg_lu_solve", 2), ("_linalg_slogdet", 2), ("_linalg_det", 2), ("linalg_ldl_factor_ex", 2),
    ("linalg_ldl_solve", 2), ("linalg_householder_product", 2), ("cholesky_solve", 2),
    ("cholesky_inverse", 2), ("linalg_solve_triangular", 2), ("triangular_solve", 2), ("linalg_eig", 2),
    ("linalg_matrix_exp", 2), ("lu_unpack", 2), ("_linalg_eigvals", 2), ("ormqr", 2), ("geqrf", 2),
    ("linalg_lstsq", 2), ("_linalg_check_errors", 2), ("linalg_cross", 1), ("cholesky", 2),
    ("linalg_inv", 2), ("inverse", 2),
]


def _batched_rule(mat_dims: int):
    def rule(call: OpCall):
        ts = call.tensors
        x = ts[0]
        nb = x.ndim - mat_dims
        if nb <= 0:
            return []
        batch = x.shape[:nb]
        # only when every tensor input carries the same leading batch dims
        if any(t.ndim < nb or t.shape[:nb] != batch for t in ts):
            return []
        if call.op is aten.linalg_cross.default:
            dim = norm_dim(call.arg(2, "dim", -1), x.ndim)
            if dim < nb:
                return []
        return [((Shard(d),), (Shard(d),) * len(ts)) for d in range(nb)]

    return rule


for _name, _k in _BATCHED:
    for _op in aten_ops([_name]):
        register_rule(_op)(_batched_rule(_k))


@register_rule([aten.diagonal.default, aten.diagonal_copy.default])
def diagonal_rule(call: OpCall):
    x = call.tensors[0]
    d1 = norm_dim(call.arg(2, "dim1", 0), x.ndim)
    d2 = norm_dim(call.arg(3, "dim2", 1), x.ndim)
    rest = [d for d in range(x.ndim) if d not in (d1, d2)]
    strategies = [((Shard(o),), (Shard(d),)) for o, d in enumerate(rest)]
    strategies += [((p,), (p,)) for p in (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"))]
    return strategies


@register_rule(aten.diag_embed.default)
def diag_embed_rule(call: OpCall):
    # the last dim becomes a diagonal; leading dims keep their places (dim1/dim2 inserted)
    x = call.tensors[0]
    out_nd = x.ndim + 1
    d1 = norm_dim(call.arg(2, "dim1", -2), out_nd)
    d2 = norm_dim(call.arg(3, "dim2", -1), out_nd)
    rest = [o for o in range(out_nd) if o not in (d1, d2)]
    strategies = [((Shard(o),), (Shard(d),)) for d, o in enumerate(rest[: x.ndim - 1])]
    return strategies + [((p,), (p,)) for p in (Partial("sum"), Partial("avg"))]


# ---------------------------------------------------------------------------------------------
# data-dependent output shapes: replicate, run whole, return replicated results
# ---------------------------------------------------------------------------------------------

_DATA_DEPENDENT = aten_ops([
    "nonzero", "nonzero_static", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
    "_unique", "masked_scatter", "argwhere", "histogram.bin_ct", "histogram.bins_tensor",
    "_histogramdd_bin_edges", "_histogramdd_from_bin_cts", "_histogramdd_from_bin_tensors", "bincount",
    "repeat_interleave.Tensor", "repeat_interleave.self_Tensor", "segment_reduce", "_segment_reduce_backward",
    "equal", "allclose", "is_nonzero", "searchsorted.Tensor", "bucketize.Tensor",
    "_cdist_forward", "_cdist_backward", "_pdist_forward", "_pdist_backward",
])


def _walk(a, fn):
    if isinstance(a, (list, tuple)):
        return type(a)(_walk(b, fn) for b in a)
    return fn(a)


def replicate_handler(op, args, kwargs):
    """Run ``op`` on the full (replicated) tensors; results come back Replicate."""
    with torch.no_grad():
        mesh = []

        def full(a):
            if isinstance(a, DTensor):
                mesh.append(a.device_mesh)
                return a.redistribute(a.device_mesh, [Replicate()] * a.device_mesh.ndim).to_local()
            return a

        fargs = _walk(tuple(args), full)
        fkwargs = {k: _walk(v, full) for k, v in kwargs.items()}
        out = op(*fargs, **fkwargs)
        m = mesh[0]
        rep = [Replicate()] * m.ndim

        def wrap(o):
            if isinstance(o, torch.Tensor):
                return DTensor.from_local(o, m, rep, shape=tuple(o.shape), stride=tuple(o.stride()))
            return o

        return _walk(out, wrap)


# ---------------------------------------------------------------------------------------------
# explicit replicate-only rules (correct whole-tensor fallbacks)
# ---------------------------------------------------------------------------------------------

_REPLICATE_ONLY = aten_ops([
    "linalg_pinv.atol_rtol_tensor", "linalg_matrix_power", "linalg_vander", "linalg_tensorinv",
    "block_diag", "cross", "kron", "trace", "_fft_c2c", "_fft_r2c", "_fft_c2r", "im2col", "col2im",
    "diagonal_scatter", "as_strided", "as_strided_scatter", "as_strided_copy", "_trilinear",
    "grid_sampler_2d", "grid_sampler_3d", "grid_sampler_2d_backward", "grid_sampler_3d_backward",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_linear1d",
    "upsample_bilinear2d", "upsample_bicubic2d", "upsample_trilinear3d", "_upsample_bilinear2d_aa",
    "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d",
    "upsample_nearest1d_backward", "upsample_nearest2d_backward", "upsample_nearest3d_backward",
    "upsample_linear1d_backward", "upsample_bilinear2d_backward", "upsample_bicubic2d_backward",
    "upsample_trilinear3d_backward", "_upsample_bilinear2d_aa_backward",
    "_upsample_nearest_exact1d_backward", "_upsample_nearest_exact2d_backward",
    "_upsample_nearest_exact3d_backward", "reflection_pad1d", "reflection_pad2d", "reflection_pad3d",
    "replication_pad1d", "replication_pad2d", "replication_pad3d", "reflection_pad1d_backward",
    "reflection_pad2d_backward", "reflection_pad3d_backward", "replication_pad1d_backward",
    "replication_pad2d_backward", "replication_pad3d_backward", "_pad_circular",
    "max_unpool2d", "max_unpool3d", "im2col_backward", "glu", "glu_backward", "pixel_shuffle", "pixel_unshuffle",
    "channel_shuffle", "native_channel_shuffle", "_embedding_bag", "_embedding_bag_backward",
    "_embedding_bag_dense_backward", "_embedding_bag_per_sample_weights_backward", "linalg_matrix_norm",
    "rot90", "tensordot", "unfold", "unfold_backward", "multilabel_margin_loss_forward",
    "multilabel_margin_loss_backward", "multi_margin_loss", "multi_margin_loss_backward",
    "_ctc_loss", "_ctc_loss_backward", "binary_cross_entropy", "binary_cross_entropy_backward",
    "soft_margin_loss", "soft_margin_loss_backward", "kl_div", "poisson_nll_loss",
    "adaptive_max_pool2d", "adaptive_max_pool3d",
    "adaptive_max_pool2d_backward", "adaptive_max_pool3d_backward", "fractional_max_pool2d",
    "fractional_max_pool3d", "fractional_max_pool2d_backward", "fractional_max_pool3d_backward",
    "max_unpool2d", "_weight_norm_interface", "_weight_norm_interface_backward", "trapezoid.x",
    "trapezoid.dx", "linalg_multi_dot", "_linalg_matrix_rank", "linalg_matrix_rank.atol_rtol_tensor",
    "renorm", "logit_backward", "cumprod_backward", "_cummax_helper", "_cummin_helper",
    "cummaxmin_backward", "bilinear", "_efficientzerotensor", "hash_tensor",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "nll_loss2d_forward",
    "hardshrink_backward", "softshrink_backward", "mish_backward", "hardswish_backward",
    "rrelu_with_noise_backward",
])

_SEEN: set = set()


def _register_replicate_only() -> None:
    for op in _REPLICATE_ONLY:
        if op in _SEEN or get_entry(op) is not None:
            continue  # another family (or an earlier import) already has a rule
        _SEEN.add(op)
        register_rule(op)(_replicate_only)


def _replicate_only(call: OpCall):
    return []


_register_replicate_only()


def _register_data_dependent() -> None:
    ops = [op for op in _DATA_DEPENDENT if get_entry(op) is None]
    register_handler(ops)(replicate_handler)


_register_data_dependent()


@register_rule(aten.isin.Tensor_Tensor)
def isin_rule(call: OpCall):
    # elementwise over `elements`; the test set must be whole on every rank
    x = call.tensors[0]
    n = len(call.tensors)
    return [((Shard(d),), (Shard(d),) + (Replicate(),) * (n - 1)) for d in range(x.ndim)]
