"""CPU stand-ins for PyTorch's CUDA-only fused attention kernels, so that dtshard's handling of
them (their rules, the context-parallel strategies, the rule validator's samples) runs on a
machine without a GPU.

``aten._scaled_dot_product_flash_attention`` / ``_efficient_attention`` / ``_cudnn_attention``
and their backwards have only CUDA kernels (and meta kernels); :func:`install` registers CPU
kernels for them with ``torch.library``, computed in float64 by the textbook formulas, with the
CUDA kernels' contracts: the outputs of the op's meta kernel (shapes, dtypes: the log-sum-exp is
float32; efficient pads it to a multiple of 32 rows, cuDNN adds a trailing dim of 1), a causal
mask aligned top-left, and a backward that uses the log-sum-exp and output it is given (so a
block of keys gets its slice of the whole softmax, as on the GPU).  Rows with no unmasked key
give output 0 and log-sum-exp 0.  No dropout.  The same kernels run in the one-process reference,
so a test compares dtshard's plan, not these formulas; ``tests/distributed/test_sdpa_cuda_kernels.py``
also checks them against ``F.scaled_dot_product_attention``.  ``benchmarks/gpu_check.sh`` runs the
real CUDA kernels when a GPU is lent.

:func:`install` changes the process it runs in (aten ops gain CPU kernels; nothing that runs on
CPU today changes: ``F.scaled_dot_product_attention`` on CPU tensors never picks these ops).  It
is meant for test and validation processes.
"""

from __future__ import annotations

import math

import torch

aten = torch.ops.aten
_LIB = None


__all__ = ["install"]


def install() -> None:
    """Register the CPU kernels for the six ops (once per process)."""
    global _LIB
    if _LIB is not None:
        return
    lib = torch.library.Library("aten", "IMPL")
    lib.impl("_scaled_dot_product_flash_attention", _flash, "CPU")
    lib.impl("_scaled_dot_product_flash_attention_backward", _flash_backward, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention", _efficient, "CPU")
    lib.impl("_scaled_dot_product_efficient_attention_backward", _efficient_backward, "CPU")
    lib.impl("_scaled_dot_product_cudnn_attention", _cudnn, "CPU")
    lib.impl("_scaled_dot_product_cudnn_attention_backward", _cudnn_backward, "CPU")
    _LIB = lib


def _expand_kv(q, t):
    """Grouped-query attention: k/v heads repeated to q's."""
    h, hkv = q.shape[-3], t.shape[-3]
    return t if h == hkv else t.repeat_interleave(h // hkv, dim=-3)


def _scores(q, k, bias, causal, scale):
    s = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    sc = (q.double() @ _expand_kv(q, k).double().transpose(-1, -2)) * s
    if causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        sc = sc.masked_fill(~keep, float("-inf"))
    if bias is not None:
        sc = sc + bias.double()
    return sc, s


def _attend(q, k, v, bias, causal, scale):
    """``(out in q's dtype, log-sum-exp (B, H, L) float32)``."""
    sc, _ = _scores(q, k, bias, causal, scale)
    lse = torch.logsumexp(sc, -1)
    dead = lse == float("-inf")
    p = torch.exp(sc - lse.masked_fill(dead, 0.0).unsqueeze(-1))
    out = p @ _expand_kv(q, v).double()
    return out.masked_fill(dead.unsqueeze(-1), 0.0).to(q.dtype), lse.masked_fill(dead, 0.0).float()


def _grads(g, q, k, v, out, lse, bias, causal, scale):
    """``(dq, dk, dv, dscores)`` from the GIVEN out and log-sum-exp (rows ``(B, H, L)``)."""
    sc, s = _scores(q, k, bias, causal, scale)
    p = torch.exp(sc - lse.double().unsqueeze(-1))
    g64, v64 = g.double(), _expand_kv(q, v).double()
    dp = g64 @ v64.transpose(-1, -2)
    ds = p * (dp - (g64 * out.double()).sum(-1, keepdim=True))
    dq = (ds @ _expand_kv(q, k).double()) * s
    dk = (ds.transpose(-1, -2) @ q.double()) * s
    dv = p.transpose(-1, -2) @ g64
    h, hkv = q.shape[-3], k.shape[-3]
    if h != hkv:  # sum the repeated heads' gradients into their k/v head
        dk = dk.unflatten(-3, (hkv, h // hkv)).sum(-3)
        dv = dv.unflatten(-3, (hkv, h // hkv)).sum(-3)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), ds


def _u64(shape):
    return torch.zeros(shape, dtype=torch.uint64)


def _flash(q, k, v, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    assert not dropout_p, "the CPU stand-in has no dropout"
    out, lse = _attend(q, k, v, None, is_causal, scale)
    return (out, lse, None, None, q.shape[-2], k.shape[-2], _u64((2,)), _u64(()),
            torch.empty(0, dtype=q.dtype))


def _flash_backward(g, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, is_causal, seed, offset, *,
                    scale=None):
    return _grads(g, q, k, v, out, lse, None, is_causal, scale)[:3]


def _efficient(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, *, scale=None):
    assert not dropout_p, "the CPU stand-in has no dropout"
    out, lse = _attend(q, k, v, attn_bias, is_causal, scale)
    n = q.shape[-2]
    rows = -(-n // 32) * 32 if compute_log_sumexp else 0
    padded = lse.new_zeros(tuple(lse.shape[:-1]) + (rows,))
    if rows:
        padded[..., :n] = lse
    z = torch.zeros((), dtype=torch.int64)
    return out, padded, z, z.clone()


def _efficient_backward(g, q, k, v, attn_bias, out, lse, seed, offset, dropout_p, grad_input_mask, is_causal=False,
                        *, scale=None):
    dq, dk, dv, ds = _grads(g, q, k, v, out, lse[..., :q.shape[-2]], attn_bias, is_causal, scale)
    db = None
    if attn_bias is not None and grad_input_mask[3]:
        db = ds.to(attn_bias.dtype)
    return dq, dk, dv, db


def _cudnn(q, k, v, attn_bias, compute_log_sumexp, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
           scale=None):
    assert not dropout_p, "the CPU stand-in has no dropout"
    out, lse = _attend(q, k, v, attn_bias, is_causal, scale)
    z = torch.zeros((), dtype=torch.int64)
    return out, lse.unsqueeze(-1), None, None, q.shape[-2], k.shape[-2], z, z.clone(), None


def _cudnn_backward(g, q, k, v, out, lse, seed, offset, attn_bias, cum_q, cum_k, max_q, max_k, dropout_p,
                    is_causal, *, scale=None):
    return _grads(g, q, k, v, out, lse.squeeze(-1), attn_bias, is_causal, scale)[:3]
