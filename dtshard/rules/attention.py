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
  broadcasting).  With grouped-query attention (fewer k/v heads, ``Hq = g * Hkv``; query head
  ``h`` reads k/v head ``h // g``) the heads shard too, where each rank's query heads are exactly
  the ``g``-groups of its own k/v heads: ``Hq_local == g * Hkv_local`` on every rank (``Hkv``
  divisible by the mesh dim's size, or chunks that happen to line up).  Whether they do depends on
  the mesh size, which a rule does not see, and the kernel would accept the misaligned shapes (3
  query heads over 1 k/v head computes, wrongly), so the rule's ``local_ok``
  (:func:`_heads_line_up`) checks every rank's local head counts in the planner's local-shape
  check; where they do not line up the planner takes another strategy (the batch, or the heads
  gathered).  Tensor-parallel Llama attention (q, k, v projections column-sharded) thus runs
  without communication;
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

**The CUDA kernels** (what ``F.scaled_dot_product_attention`` runs on a GPU, chosen from the
DTensor's global metadata): ``_scaled_dot_product_flash_attention``,
``_scaled_dot_product_efficient_attention`` and ``_scaled_dot_product_cudnn_attention`` and their
backwards get the same strategies (:func:`fused_cuda_rule`), with the arguments and outputs found
by their schema names: their log-sum-exp is float32 (efficient: ``(B, H, L)`` padded to a multiple of 32 rows, so a
query-row shard passes the local-shape check only where every rank's rows are a multiple of 32;
cuDNN: ``(B, H, L, 1)``); the dropout generator's state (``rng_state``/``philox_*``) is
replicated, zeros without dropout (the kernels leave it unset then); ``cum_seq_*`` are undefined
and ``max_q``/``max_k`` the rank's lengths.  A debug attention mask, dropout, or a gradient for the
efficient/cuDNN kernels' ``attn_bias`` runs the op replicated.  Sequence-sharded q, k, v go to
context parallelism first (``rules/attention_cp.py``).
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Shard

from dtshard import collectives as C
from dtshard.registry import OpCall, op_facts, register_rule
from dtshard.rules._common import LINEAR_REDUCE_OPS, R, follow_output
from dtshard.spec import TensorMeta

aten = torch.ops.aten

_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _mask_placement(mask, q, k, p):
    """Placement of the mask when the attention scores (B, H, L, S) have placement ``p``."""
    scores = tuple(q.shape[:-1]) + (k.shape[-2],)
    return follow_output(mask, scores, p)


def _leading_dims(q, k, v) -> list[int]:
    """Dims shardable alike in q, k, v: the leading ones where all three agree in size, and the
    heads (dim -3) of grouped-query attention, whose k/v heads divide q's (the planner then checks
    that they line up on each rank: :func:`_heads_line_up`)."""
    heads = q.ndim - 3
    return [d for d in range(q.ndim - 2) if k.shape[d] == v.shape[d] and (
        q.shape[d] == k.shape[d] or (d == heads and k.shape[d] > 0 and q.shape[d] % k.shape[d] == 0))]


def _gqa_lines_up(q, k, q_local, k_local) -> bool:
    """Grouped-query attention with sharded heads computes the right thing on a rank only where
    its query heads are the ``g``-groups of its own k/v heads (``g = Hq / Hkv``): the local head
    counts are ``g`` to 1.  Without GQA (equal head counts) any layout lines up."""
    h = q.ndim - 3
    if h < 0 or q.shape[h] == k.shape[h]:
        return True
    return q_local[h] == (q.shape[h] // k.shape[h]) * k_local[h]


def _heads_line_up(call: OpCall, local_shapes) -> bool:
    """``local_ok`` of the CPU kernels (forward: q, k, v first; backward: grad_out, q, k, v)."""
    iq = 1 if call.op == _BWD else 0
    return _gqa_lines_up(call.tensors[iq], call.tensors[iq + 1], local_shapes[iq], local_shapes[iq + 1])


@register_rule(_FWD, local=lambda op, *a, **kw: _sdpa_forward_local(op, *a, **kw), local_ok=_heads_line_up)
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


@register_rule(_BWD, local=lambda op, *a, **kw: _sdpa_backward_local(op, *a, **kw), local_ok=_heads_line_up)
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
        # but rules never shard the key length, so k/v are only empty together with q's batch/heads.
        # The zeros depend on k and v (C.consumed): while tracing, what brought them stays in the graph
        return C.consumed(q.new_zeros(out_shape), k, v), q.new_zeros(
            tuple(q.shape[:-1]), dtype=torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype)
    return op(q, k, v, *args, **kwargs)


def _sdpa_backward_local(op, g, q, k, v, out, lse, *args, **kwargs):
    if q.numel() == 0 or k.numel() == 0 or v.numel() == 0:
        return C.consumed(torch.zeros_like(q), g, out, lse), C.consumed(torch.zeros_like(k), k), \
            C.consumed(torch.zeros_like(v), v)
    return op(g, q, k, v, out, lse, *args, **kwargs)


# --- the CUDA kernels -------------------------------------------------------------------------

CUDA_FWD = (aten._scaled_dot_product_flash_attention.default,
            aten._scaled_dot_product_efficient_attention.default,
            aten._scaled_dot_product_cudnn_attention.default)
CUDA_BWD = (aten._scaled_dot_product_flash_attention_backward.default,
            aten._scaled_dot_product_efficient_attention_backward.default,
            aten._scaled_dot_product_cudnn_attention_backward.default)

#: the role of each tensor argument of the CUDA kernels, by schema name: q, k, v; "rows" follow
#: the query rows (grad_out, out, logsumexp); "mask" is the attention bias; "aux" is replicated
_ROLES = {"query": "q", "key": "k", "value": "v", "grad_out": "rows", "grad_out_": "rows", "out": "rows",
          "logsumexp": "rows", "attn_bias": "mask", "philox_seed": "aux", "philox_offset": "aux",
          "cum_seq_q": "aux", "cum_seq_k": "aux"}
#: outputs that are the dropout generator's state (zeros without dropout), by op
_RNG_OUTPUTS = {CUDA_FWD[0]: (6, 7), CUDA_FWD[1]: (2, 3), CUDA_FWD[2]: (6, 7)}


def _roles(call: OpCall) -> list[str]:
    """The role (:data:`_ROLES`) of each DTensor argument, in ``call.tensors`` order."""
    out = []
    for i, name in enumerate(op_facts(call.op).names):
        a = call.args[i] if i < len(call.args) else call.kwargs.get(name)
        if isinstance(a, TensorMeta):
            out.append(_ROLES[name])
    return out


def _named(call: OpCall, name: str, default=None):
    """The argument ``name`` of the call (by position or keyword), ``default`` when absent."""
    names = op_facts(call.op).names
    return call.arg(names.index(name), name, default) if name in names else default


def _cuda_local(op, *args, **kwargs):
    """The kernel on this rank's shards: empty shards give zeros of the meta kernel's shapes
    (no launch), and without dropout the generator-state outputs are zeros, so their Replicate
    DTensors hold the same values on every rank."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    operands = tensors[:4] if op in CUDA_BWD else tensors[:3]  # (grad_out,) q, k, v
    if any(t.numel() == 0 for t in operands):
        metas = op(*[a.to("meta") if isinstance(a, torch.Tensor) else a for a in args],
                   **{n: a.to("meta") if isinstance(a, torch.Tensor) else a for n, a in kwargs.items()})
        dev = tensors[0].device
        zeros = [torch.zeros(m.shape, dtype=m.dtype, device=dev) if isinstance(m, torch.Tensor) else m for m in metas]
        zeros[0] = C.consumed(zeros[0], *tensors)  # while tracing, what brought the inputs stays in the graph
        return tuple(zeros)
    out = op(*args, **kwargs)
    rng = _RNG_OUTPUTS.get(op)
    if rng is None:
        return out
    names = op_facts(op).names
    dropout = args[names.index("dropout_p")] if len(args) > names.index("dropout_p") else kwargs.get("dropout_p", 0.0)
    if dropout:
        return out
    out = list(out)
    for j in rng:
        if isinstance(out[j], torch.Tensor):
            out[j] = torch.zeros_like(out[j])
    return tuple(out)


def _cuda_heads_line_up(call: OpCall, local_shapes) -> bool:
    """``local_ok`` of the CUDA kernels: q and k found by their roles."""
    roles = _roles(call)
    iq, ik = roles.index("q"), roles.index("k")
    return _gqa_lines_up(call.tensors[iq], call.tensors[ik], local_shapes[iq], local_shapes[ik])


@register_rule(list(CUDA_FWD + CUDA_BWD), local=_cuda_local, local_ok=_cuda_heads_line_up)
def fused_cuda_rule(call: OpCall):
    """Leading dims (batch; heads, grouped-query heads where they line up) sharded alike, query rows
    sharded against whole keys (not causal), and, in backward, a Partial grad_out: the strategies
    of the CPU kernel's rule, for the CUDA kernels' schemas (see the module docstring)."""
    roles = _roles(call)
    ts = call.tensors
    q, k, v = (ts[roles.index(r)] for r in ("q", "k", "v"))
    mask = ts[roles.index("mask")] if "mask" in roles else None
    backward = call.op in CUDA_BWD
    n_out = len(call.op._schema.returns)
    if _named(call, "dropout_p", 0.0) or _named(call, "return_debug_mask", False):
        return []  # replicated: one full random mask / debug matrix, as one process draws it
    wanted = _named(call, "grad_input_mask")
    if mask is not None and wanted is not None and len(wanted) > 3 and wanted[3]:
        return []  # the bias's own gradient: replicated
    is_causal = bool(_named(call, "is_causal", False))

    def ins_for(p_qkv, p_kv, p_rows):
        m = {"q": p_qkv, "k": p_kv, "v": p_kv, "rows": p_rows, "aux": R}
        return tuple(_mask_placement(mask, q, k, p_rows) if r == "mask" else m[r] for r in roles)

    strategies = []
    for d in _leading_dims(q, k, v):
        p = Shard(d)
        outs = (p, p, p) if backward else (p, p)
        strategies.append((outs + (R,) * (n_out - len(outs)), ins_for(p, p, p)))
    if not is_causal:
        rows = Shard(q.ndim - 2)  # L: also dim ndim-2 of logsumexp (B, H, L[, 1])
        outs = (rows, Partial("sum"), Partial("sum")) if backward else (rows, rows)
        strategies.append((outs + (R,) * (n_out - len(outs)), ins_for(rows, R, rows)))
    if backward:
        for red in LINEAR_REDUCE_OPS:  # each gradient is linear in grad_out
            ins = tuple(Partial(red) if r == "rows" and i == roles.index("rows") else R for i, r in enumerate(roles))
            strategies.append(((Partial(red),) * 3 + (R,) * (n_out - 3), ins))
    return strategies
