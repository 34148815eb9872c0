"""Context parallelism: attention on a sequence-sharded DTensor, as strategies chosen by cost.

When ``q``, ``k`` and ``v`` are sharded alike with ``Shard(seq)`` (the sequence dim, ``-2``) on ONE
mesh dim, the fused CPU attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and
its backward, what ``F.scaled_dot_product_attention`` runs) is computed by one of these strategies;
every other layout goes to the op's rule (``rules/attention.py``) unchanged.  The outputs keep the
query's layout (``out`` and ``logsumexp`` sequence-sharded), whatever strategy ran, so the backward
(which chooses again) and the next layer see the same layout.

- **allgather_kv**: K and V are gathered along the sequence, each with its OWN heads (grouped-query
  and multi-query attention move ``Hkv`` heads, never the repeated ones), and each rank attends its
  own query rows to them.  Causal attention needs the rank's position in the sequence, which a rule
  cannot see: the keys split into a block before the rank's first query row (wholly visible, no
  mask) and the diagonal block (causal, top-left aligned, as the kernel is); blocks after the
  rank's rows are wholly masked and never computed.  The blocks' partial results merge through
  their log-sum-exp, in float32 for low-precision inputs.  Backward: each block's gradients from
  the kernel with the GLOBAL output and log-sum-exp (the slice of the full softmax), ``dq`` summed
  over blocks, ``dk``/``dv`` for every key (zeros past the rank's rows) reduced to their owners
  with one reduce_scatter each.  Received per rank, forward: ``(n-1)/n`` of K and V.
- **ulysses**: q, k, v (and in backward ``out``, ``grad_out``, ``logsumexp``) move from sequence
  to heads with one all_to_all each, attention runs on whole sequences for ``H/n`` query and
  ``Hkv/n`` key/value heads, and the results move back.  Needs ``H`` and ``Hkv`` divisible by the
  mesh dim's size ``n`` (then query head chunk ``i`` maps onto key/value head chunk ``i``).
  Received per rank, forward: ``(n-1)/n^2`` of q, k, v and the output.

The cost (``_bytes``) is the bytes a rank receives in the forward, from global shapes only (the
same on every rank, so every rank takes the same strategy); ``config.attention_cp`` forces one.
Not here yet (issue #30): a pass-KV ring that overlaps the exchange with compute, masks that
shape the exchange (sliding windows as halos), FlexAttention, and strided (load-balanced) causal
layouts, which go to the rule.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard import collectives as C
from dtshard._config import config
from dtshard.handlers import DTensor, bind, make_spec, op_context, planned, to_local, wrap
from dtshard.registry import register_handler

__all__ = ["choose_strategy"]

aten = torch.ops.aten
_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
STRATEGIES = ("ulysses", "allgather_kv")


def _seq_mesh_dim(q, k, v) -> int | None:
    """The mesh dim that shards the sequence of q, k and v alike, when context parallelism takes
    the call: plain DTensors on one mesh with the same placements, the sequence (dim -2) sharded
    by exactly one mesh dim with a plain ``Shard``, every other mesh dim replicating or sharding a
    leading dim of equal size in all three (batch; heads only without grouped-query attention)."""
    if not (type(q) is DTensor and type(k) is DTensor and type(v) is DTensor):
        return None
    sq, sk, sv = q._spec, k._spec, v._spec
    if sq.extra is not None or sk.extra is not None or sv.extra is not None or q.dim() < 3:
        return None
    if not (sq.mesh is sk.mesh is sv.mesh and sq.placements == sk.placements == sv.placements):
        return None
    seq = q.dim() - 2
    found = None
    for i, p in enumerate(sq.placements):
        if type(p) is Shard and p.dim == seq:
            if found is not None:
                return None
            found = i
        elif type(p) is Shard:
            if not (p.dim < seq and q.shape[p.dim] == k.shape[p.dim] == v.shape[p.dim]):
                return None
        elif type(p) is not Replicate:
            return None  # Partial or strided: the rule's path
    return found


def _bytes(strategy: str, q, k, v, mesh_dim: int) -> float | None:
    """Bytes each rank receives in the forward under ``strategy`` (None: it does not apply)."""
    n = q._spec.mesh_shape[mesh_dim]
    other = 1  # the other mesh dims' shards of the leading dims
    for i, p in enumerate(q._spec.placements):
        if i != mesh_dim and type(p) is Shard:
            other *= q._spec.mesh_shape[i]
    item = q.element_size()
    if strategy == "allgather_kv":
        return (n - 1) / n * (k.numel() + v.numel()) * item / other
    if strategy == "ulysses":
        h = q.dim() - 3
        if any(type(p) is Shard and p.dim == h for p in q._spec.placements):
            return None  # heads already sharded by another mesh dim
        if q.shape[h] % n or k.shape[h] % n:
            return None
        out = q.numel() // q.shape[-1] * v.shape[-1]
        return (n - 1) / n / n * (q.numel() + k.numel() + v.numel() + out) * item / other
    raise ValueError(f"config.attention_cp: unknown strategy {strategy!r}; one of 'auto', {STRATEGIES}")


def choose_strategy(q, k, v, mesh_dim: int) -> str | None:
    """The strategy for this call: ``config.attention_cp`` when it names one that applies, else
    the one whose forward receives the fewest bytes per rank (ties: the first of STRATEGIES)."""
    forced = config.attention_cp
    if forced != "auto":
        return forced if _bytes(forced, q, k, v, mesh_dim) is not None else None
    costs = [(c, s) for s in STRATEGIES if (c := _bytes(s, q, k, v, mesh_dim)) is not None]
    return min(costs, key=lambda cs: cs[0])[1] if costs else None


def _with(placements, mesh_dim: int, p) -> tuple:
    return tuple(p if i == mesh_dim else x for i, x in enumerate(placements))


def _spec_like(t, placements, shape=None, dtype=None):
    return make_spec(t._spec.mesh, placements, t.shape if shape is None else shape, t.dtype if dtype is None else dtype)


def _rows(q, mesh_dim: int) -> tuple[int, int]:
    """This rank's query rows ``[start, stop)`` of the global sequence."""
    spec = q._spec
    coord = C.mesh_coordinate(spec.mesh)
    shape, offset = spec.local_shape_and_offset(coord)
    seq = q.dim() - 2
    return offset[seq], offset[seq] + shape[seq]


def _blocks(start: int, stop: int, kv_len: int, causal: bool):
    """``(key start, key stop, causal)`` of the key blocks rows ``[start, stop)`` attend to."""
    if not causal:
        return [(0, kv_len, False)]
    out = []
    if min(start, kv_len) > 0:
        out.append((0, min(start, kv_len), False))  # before the rank's rows: wholly visible
    if start < kv_len:
        out.append((start, min(stop, kv_len), True))  # the diagonal block (top-left aligned)
    return out


def _merge(parts, out_dtype):
    """Attention over key blocks from each block's ``(out, logsumexp)``: weights from the log-sum-
    exps, accumulated in float32 (or float64) whatever the inputs' precision."""
    acc = torch.float64 if out_dtype == torch.float64 else torch.float32
    if len(parts) == 1:
        return parts[0]
    lse = parts[0][1].to(acc)
    for _, l in parts[1:]:
        lse = torch.logaddexp(lse, l.to(acc))
    out = sum(o.to(acc) * torch.exp(l.to(acc) - lse).unsqueeze(-1) for o, l in parts)
    return out.to(out_dtype), lse.to(parts[0][1].dtype)


def _attend(op, ql, kl, vl, causal: bool, scale, start: int, stop: int):
    """This rank's rows ``[start, stop)`` attended to the whole keys ``kl``/``vl``: block by block."""
    parts = []
    for a, b, c in _blocks(start, stop, kl.shape[-2], causal):
        parts.append(op(ql, kl.narrow(-2, a, b - a), vl.narrow(-2, a, b - a), 0.0, c, scale=scale))
    return _merge(parts, ql.dtype)


@register_handler(_FWD, before_rule=True)
def sdpa_context_parallel(op, args, kwargs):
    """Forward attention on sequence-sharded q, k, v (see the module docstring)."""
    q, k, v, dropout_p, is_causal, attn_mask, scale = bind(op, args, kwargs)
    i = _seq_mesh_dim(q, k, v) if attn_mask is None and not dropout_p else None
    strategy = None if i is None else choose_strategy(q, k, v, i)
    if strategy is None:
        return planned(op, args, kwargs)
    placements = q._spec.placements
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    with op_context(op):
        if strategy == "allgather_kv":
            full = _with(placements, i, Replicate())
            kl, vl = to_local(k, full), to_local(v, full)
            start, stop = _rows(q, i)
            ql = q._local_tensor
            if stop == start:  # no rows here (uneven shards): the kernel cannot run on none
                o = ql.new_zeros(tuple(ql.shape[:-1]) + (v.shape[-1],))
                lse = ql.new_zeros(tuple(ql.shape[:-1]), dtype=_lse_dtype(q.dtype))
            else:
                o, lse = _attend(op, ql, kl, vl, bool(is_causal), scale, start, stop)
            return (wrap(o, _spec_like(q, placements, out_shape, q.dtype)),
                    wrap(lse, _spec_like(q, placements, out_shape[:-1], lse.dtype)))
        heads = _with(placements, i, Shard(q.dim() - 3))
        o, lse = op(to_local(q, heads), to_local(k, heads), to_local(v, heads), 0.0, bool(is_causal), scale=scale)
        o_dt = wrap(o, _spec_like(q, heads, out_shape, q.dtype))
        lse_dt = wrap(lse, _spec_like(q, heads, out_shape[:-1], lse.dtype))
        return (wrap(to_local(o_dt, placements), _spec_like(q, placements, out_shape, q.dtype)),
                wrap(to_local(lse_dt, placements), _spec_like(q, placements, out_shape[:-1], lse.dtype)))


def _lse_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@register_handler(_BWD, before_rule=True)
def sdpa_context_parallel_backward(op, args, kwargs):
    """Backward of :func:`sdpa_context_parallel` (chooses its strategy again; both are exact)."""
    g, q, k, v, out, lse, dropout_p, is_causal, attn_mask, scale = bind(op, args, kwargs)
    i = _seq_mesh_dim(q, k, v) if attn_mask is None and not dropout_p else None
    if i is not None and not all(type(t) is DTensor and t._spec.placements == q._spec.placements
                                 and t._spec.extra is None for t in (g, out, lse)):
        i = None
    strategy = None if i is None else choose_strategy(q, k, v, i)
    if strategy is None:
        return planned(op, args, kwargs)
    placements = q._spec.placements
    with op_context(op):
        if strategy == "allgather_kv":
            full = _with(placements, i, Replicate())
            kl, vl = to_local(k, full), to_local(v, full)
            start, stop = _rows(q, i)
            ql = q._local_tensor
            dk, dv = torch.zeros_like(kl), torch.zeros_like(vl)
            dq = torch.zeros_like(ql)
            if stop > start:
                for a, b, c in _blocks(start, stop, kl.shape[-2], bool(is_causal)):
                    gq, gk, gv = op(g._local_tensor, ql, kl.narrow(-2, a, b - a), vl.narrow(-2, a, b - a),
                                    out._local_tensor, lse._local_tensor, 0.0, c, scale=scale)
                    dq += gq
                    dk.narrow(-2, a, b - a).add_(gk)
                    dv.narrow(-2, a, b - a).add_(gv)
            partial = _with(placements, i, Partial("sum"))
            dk = to_local(wrap(dk, _spec_like(k, partial)), placements)  # one reduce_scatter each
            dv = to_local(wrap(dv, _spec_like(v, partial)), placements)
            return (wrap(dq, _spec_like(q, placements)), wrap(dk, _spec_like(k, placements)),
                    wrap(dv, _spec_like(v, placements)))
        heads = _with(placements, i, Shard(q.dim() - 3))
        gq, gk, gv = op(*(to_local(t, heads) for t in (g, q, k, v, out, lse)), 0.0, bool(is_causal), scale=scale)
        return tuple(wrap(to_local(wrap(x, _spec_like(t, heads)), placements), _spec_like(t, placements))
                     for x, t in ((gq, q), (gk, k), (gv, v)))
