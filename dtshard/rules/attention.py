"""Attention: the fused scaled-dot-product-attention kernels, forward and backward.

``F.scaled_dot_product_attention`` on CPU (float32/float64/bfloat16/half) dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu`` -> ``(out, logsumexp)``, and its backward to
``aten._scaled_dot_product_flash_attention_for_cpu_backward`` -> ``(grad_q, grad_k, grad_v)``.  (The
math fallback, taken e.g. when the mask needs a gradient, decomposes into matmul/softmax ops that
already have rules.)  Shapes: q ``(B, H, L, E)``, k ``(B, Hkv, S, E)``, v ``(B, Hkv, S, Ev)``, out
``(B, H, L, Ev)``, logsumexp ``(B, H, L)``, an optional additive/boolean mask broadcasting to
``(B, H, L, S)``.

Strategies on one mesh dim:

- a leading dim (batch, heads) sharded in q, k, v, out and logsumexp alike (the mask follows through
  broadcasting).  Heads only when q and k/v have the SAME number of heads: with grouped-query
  attention (``enable_gqa``, fewer k/v heads) a head chunk of q maps onto a chunk of k/v only when
  the chunk sizes line up, which depends on the mesh size (a rule cannot see it) and which the
  local-shape check cannot see either (the kernel accepts any head counts), so GQA keeps heads
  whole and shards the batch (repeat k/v to the query heads first, as Llama code does, to shard
  heads);
- query rows sharded (``L``, dim -2) with k and v replicated: each rank attends its own queries to
  every key.  Only without ``is_causal`` (the kernel aligns the causal mask to the LOCAL rows); a
  mask then shards its ``L`` dim alongside.  The backward gives grad_q sharded and grad_k/grad_v
  as Partial(sum) (sums over query rows);
- backward only: every gradient is linear in grad_out, so a Partial grad_out with everything else
  replicated gives Partial gradients.

With ``dropout_p > 0`` (F.scaled_dot_product_attention takes the math path then; only a direct
call gets here) the op runs replicated, so every rank draws the same full random mask as one process
would and the generators stay in step (the convention of ``rules/random.py``).

The CPU kernel crashes (SIGFPE) on zero heads or zero query rows, which uneven shards produce
(4 heads over 3 ranks: 2, 2, 0), so the local function returns empty/zero results for empty inputs.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from dtshard.registry import OpCall, register_rule
from dtshard.rules._common import LINEAR_REDUCE_OPS, R, follow_output

aten = torch.ops.aten

_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _mask_placement(mask, q, k, p):
    """Placement of the mask when the attention scores (B, H, L, S) have placement ``p``."""
    scores = tuple(q.shape[:-1]) + (k.shape[-2],)
    return follow_output(mask, scores, p)


def _leading_dims(q, k, v) -> list[int]:
    """Dims shardable alike in q, k, v: the leading ones where all three agree in size."""
    return [d for d in range(q.ndim - 2) if q.shape[d] == k.shape[d] == v.shape[d]]


@register_rule(_FWD, local=lambda op, *a, **kw: _sdpa_forward_local(op, *a, **kw))
def sdpa_flash_cpu_rule(call: OpCall):
    q, k, v = call.tensors[:3]
    mask = call.tensors[3] if len(call.tensors) > 3 else None
    is_causal = bool(call.arg(4, "is_causal", False))
    if call.arg(3, "dropout_p", 0.0):
        return []  # replicated: every rank draws the same full dropout mask (see rules/random.py)
    strategies = []
    for d in _leading_dims(q, k, v):
        p = Shard(d)
        ins = (p, p, p) + ((_mask_placement(mask, q, k, p),) if mask is not None else ())
        strategies.append(((p, p), ins))
    if not is_causal:
        rows = Shard(q.ndim - 2)  # L: also dim ndim-2 of logsumexp (B, H, L)
        ins = (rows, R, R) + ((_mask_placement(mask, q, k, rows),) if mask is not None else ())
        strategies.append(((rows, rows), ins))
    return strategies


@register_rule(_BWD, local=lambda op, *a, **kw: _sdpa_backward_local(op, *a, **kw))
def sdpa_flash_cpu_backward_rule(call: OpCall):
    # tensors: grad_out, q, k, v, out, logsumexp, [attn_mask]
    g, q, k, v, out, lse = call.tensors[:6]
    mask = call.tensors[6] if len(call.tensors) > 6 else None
    is_causal = bool(call.arg(7, "is_causal", False))
    if call.arg(6, "dropout_p", 0.0):
        return []
    strategies = []
    for d in _leading_dims(q, k, v):
        p = Shard(d)
        ins = (p,) * 6 + ((_mask_placement(mask, q, k, p),) if mask is not None else ())
        strategies.append(((p, p, p), ins))
    if not is_causal:
        rows = Shard(q.ndim - 2)
        ins = (rows, rows, R, R, rows, rows) + ((_mask_placement(mask, q, k, rows),) if mask is not None else ())
        strategies.append(((rows, Partial("sum"), Partial("sum")), ins))
    n_mask = 1 if mask is not None else 0
    for red in LINEAR_REDUCE_OPS:  # each gradient is linear in grad_out
        strategies.append(((Partial(red),) * 3, (Partial(red),) + (R,) * (5 + n_mask)))
    return strategies


def _sdpa_forward_local(op, q, k, v, *args, **kwargs):
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
        # no query rows: nothing to compute; no keys: the kernel's convention is not defined here,
        # but rules never shard the key length, so k/v are only empty together with q's batch/heads
        return q.new_zeros(out_shape), q.new_zeros(tuple(q.shape[:-1]), dtype=torch.float32
                                                   if q.dtype in (torch.float16, torch.bfloat16) else q.dtype)
    return op(q, k, v, *args, **kwargs)


def _sdpa_backward_local(op, g, q, k, v, out, lse, *args, **kwargs):
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    return op(g, q, k, v, out, lse, *args, **kwargs)
