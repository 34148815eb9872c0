"""Normalisations: softmax / log_softmax and layer_norm, with their backward ops.

Softmax-like ops shard any dim but the one they normalise over.  layer_norm shards the leading
(batch-like) dims; its weight/bias gradients are sums over those dims, hence Partial(sum).  The
backward ops are linear in the incoming gradient, so a Partial gradient passes straight through.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from dtshard.registry import OpCall, register_rule
from dtshard.rules._common import LINEAR_REDUCE_OPS, R, norm_dim

aten = torch.ops.aten


@register_rule([aten._softmax.default, aten._log_softmax.default])
def softmax_rule(call: OpCall):
    x = call.tensors[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    return [((Shard(d),), (Shard(d),)) for d in range(x.ndim) if d != dim]


@register_rule([aten._softmax_backward_data.default, aten._log_softmax_backward_data.default])
def softmax_backward_rule(call: OpCall):
    grad, out = call.tensors[0], call.tensors[1]
    dim = norm_dim(call.arg(2, "dim"), out.ndim)
    strategies = [((Shard(d),), (Shard(d), Shard(d))) for d in range(out.ndim) if d != dim]
    for op in LINEAR_REDUCE_OPS:  # linear in the incoming gradient
        strategies.append(((Partial(op),), (Partial(op), R)))
    return strategies


@register_rule(aten.native_layer_norm.default)
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
