"""RMSNorm's fused kernels: ``_fused_rms_norm`` and ``_fused_rms_norm_backward``.

In torch 2.13 ``F.rms_norm`` / ``nn.RMSNorm`` on CPU decompose (pow, mean, add, rsqrt, mul: ops with
rules already); the fused ops are what they dispatch to where a fused kernel exists (CUDA), and
``_fused_rms_norm`` can be called on CPU directly.  Like layer_norm: shard the leading
(non-normalised) dims; rstd ``x.shape[:axis] + (1,) * len(normalized_shape)`` shards alike; the
weight gradient sums over the leading dims, hence Partial(sum); every gradient is linear in
grad_out, so a Partial grad_out passes through.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from dtshard.registry import OpCall, register_rule
from dtshard.rules._common import LINEAR_REDUCE_OPS, R

aten = torch.ops.aten


@register_rule(aten._fused_rms_norm.default)
def fused_rms_norm_rule(call: OpCall):
    # tensors: input, [weight]
    x = call.tensors[0]
    axis = x.ndim - len(call.arg(1, "normalized_shape"))
    n_params = len(call.tensors) - 1
    return [((Shard(d), Shard(d)), (Shard(d),) + (R,) * n_params) for d in range(axis)]


@register_rule(aten._fused_rms_norm_backward.default)
def fused_rms_norm_backward_rule(call: OpCall):
    # tensors: grad_out, input, rstd, [weight]; outputs: grad_input, grad_weight (None if not asked)
    x = call.tensors[1]
    axis = x.ndim - len(call.arg(2, "normalized_shape"))
    n_params = len(call.tensors) - 3
    strategies = []
    for d in range(axis):
        strategies.append(((Shard(d), Partial("sum")), (Shard(d),) * 3 + (R,) * n_params))
    for op in LINEAR_REDUCE_OPS:
        strategies.append(((Partial(op), Partial(op)), (Partial(op),) + (R,) * (2 + n_params)))
    return strategies
