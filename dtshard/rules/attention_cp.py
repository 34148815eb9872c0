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
- **ring**: K and V pass around the ring of the mesh dim, one block per step, each step's
  exchange issued before the compute of the block in hand and waited after it (eagerly an
  in-flight all_to_all; compiled, the wait sits after the block's compute in the graph), with the
  same block arithmetic and merge as allgather_kv; a rank holds two blocks, never the whole K/V.
  Backward: the blocks travel again, each with its gradient accumulator, and one last shift takes
  the accumulators home.  Received per rank, forward: ``(n-1)/n`` of K and V in ``n - 1`` steps.
- **ulysses**: q, k, v (and in backward ``out``, ``grad_out``, ``logsumexp``) move from sequence
  to heads with one all_to_all each, attention runs on whole sequences for ``H/n`` query and
  ``Hkv/n`` key/value heads, and the results move back.  Needs ``H`` and ``Hkv`` divisible by the
  mesh dim's size ``n`` (then query head chunk ``i`` maps onto key/value head chunk ``i``).
  Received per rank, forward: ``(n-1)/n^2`` of q, k, v and the output.

The cost (``_bytes``) is the bytes a rank receives in the forward, from global shapes only (the
same on every rank, so every rank takes the same strategy); ``config.attention_cp`` forces one.
Not here yet (issue #30): masks that shape the exchange (sliding windows as halos), FlexAttention,
strided (load-balanced) causal layouts, which go to the rule, and Ulysses x ring on two mesh dims.
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
STRATEGIES = ("ulysses", "allgather_kv", "ring")


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
    if not C.is_member(sq.mesh):
        return None  # a rank outside the mesh: the rule's path makes its empty outputs
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
    if strategy in ("allgather_kv", "ring"):
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
    the one whose forward receives the fewest bytes per rank; ties go to the first of STRATEGIES
    (all-gather of K/V before the ring: one collective instead of ``n - 1``), except that K and V
    are not gathered whole when that would hold more than ``config.attention_cp_gather_bytes``
    per rank (the ring holds two blocks)."""
    forced = config.attention_cp
    if forced != "auto":
        return forced if _bytes(forced, q, k, v, mesh_dim) is not None else None
    costs = [(c, s) for s in STRATEGIES if (c := _bytes(s, q, k, v, mesh_dim)) is not None]
    if any(s == "ring" for _, s in costs) and _gathered_bytes(q, k, v, mesh_dim) > config.attention_cp_gather_bytes:
        costs = [(c, s) for c, s in costs if s != "allgather_kv"]
    return min(costs, key=lambda cs: cs[0])[1] if costs else None


def _gathered_bytes(q, k, v, mesh_dim: int) -> float:
    """K and V gathered whole on one rank (their other mesh dims' shards kept)."""
    other = 1
    for i, p in enumerate(q._spec.placements):
        if i != mesh_dim and type(p) is Shard:
            other *= q._spec.mesh_shape[i]
    return (k.numel() + v.numel()) * k.element_size() / other


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


def _pieces(start: int, stop: int, a: int, b: int, causal: bool):
    """How query rows ``[start, stop)`` attend to keys ``[a, b)`` (global indices): a list of
    ``(row, key_from, key_to, causal)``, from local row ``row`` on, keys relative to ``a``.  Causal:
    keys before the rows are wholly visible (no mask); the diagonal part pairs rows and keys from
    the same global index on (top-left aligned, as the kernel is); keys after the rows are masked
    and never computed."""
    if not causal:
        return [(0, 0, b - a, False)] if b > a else []
    out = []
    visible = min(b, start)
    if visible > a:
        out.append((0, 0, visible - a, False))
    d0, d1 = max(a, start), min(b, stop)
    if d1 > d0:
        out.append((d0 - start, d0 - a, d1 - a, True))
    return out


class _Merge:
    """Attention over key blocks from each block's ``(out, logsumexp)`` on a suffix of the rows,
    merged online through the log-sum-exps, accumulated in float32 (float64 for float64)."""

    def __init__(self, ql, ev: int, lse_dtype):
        self.dtype, self.lse_dtype = ql.dtype, lse_dtype
        acc = torch.float64 if ql.dtype == torch.float64 else torch.float32
        self.out = ql.new_zeros(tuple(ql.shape[:-1]) + (ev,), dtype=acc)
        self.lse = ql.new_full(tuple(ql.shape[:-1]), float("-inf"), dtype=acc)

    def add(self, row: int, o, lse) -> None:
        old = self.lse[..., row:]
        new = torch.logaddexp(old, lse.to(old.dtype))
        acc = self.out[..., row:, :]
        acc.mul_(torch.exp(old - new).unsqueeze(-1)).add_(o.to(acc.dtype) * torch.exp(lse.to(old.dtype) - new).unsqueeze(-1))
        self.lse[..., row:] = new

    def result(self):
        return self.out.to(self.dtype), self.lse.to(self.lse_dtype)


def _forward_block(op, merge, ql, kb, vb, a, b, start, stop, causal, scale) -> None:
    """Rows ``[start, stop)`` (``ql``) attended to the key block ``[a, b)`` (``kb``, ``vb``)."""
    for row, k0, k1, c in _pieces(start, stop, a, b, causal):
        o, lse = op(ql[..., row:, :], kb[..., k0:k1, :], vb[..., k0:k1, :], 0.0, c, scale=scale)
        merge.add(row, o, lse)


def _backward_block(op, grads, gl, ql, kb, vb, outl, lsel, a, b, start, stop, causal, scale):
    """The gradients of rows ``[start, stop)`` against the key block ``[a, b)``: the kernel's
    backward with the GLOBAL output and log-sum-exp (each block's slice of the full softmax),
    added into ``grads = (dq, dk_block, dv_block)``."""
    dq, dk, dv = grads
    for row, k0, k1, c in _pieces(start, stop, a, b, causal):
        gq, gk, gv = op(gl[..., row:, :], ql[..., row:, :], kb[..., k0:k1, :], vb[..., k0:k1, :],
                        outl[..., row:, :], lsel[..., row:], 0.0, c, scale=scale)
        dq[..., row:, :].add_(gq)
        dk[..., k0:k1, :].add_(gk)
        dv[..., k0:k1, :].add_(gv)


def _chunks(t, mesh_dim: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of every rank's chunk of ``t``'s sequence along ``mesh_dim`` (the ranks
    that share this rank's other coordinates), from metadata."""
    spec = t._spec
    coord = list(C.mesh_coordinate(spec.mesh))
    seq = t.dim() - 2
    out = []
    for r in range(spec.mesh_shape[mesh_dim]):
        coord[mesh_dim] = r
        shape, offset = spec.local_shape_and_offset(coord)
        out.append((offset[seq], offset[seq] + shape[seq]))
    return out


def _shift(ts, rows_in: int, mesh, mesh_dim: int, n: int, me: int):
    """Send the tensors ``ts`` (same shape but for the sequence) to the next rank of the ring and
    receive the previous rank's (``rows_in`` sequence rows each), as one all_to_all in flight:
    returns ``(flat buffer, shapes)``, to be waited on with :func:`_arrived` after the compute it
    overlaps."""
    flat = torch.cat([t.reshape(-1) for t in ts]) if len(ts) > 1 else ts[0].reshape(-1)
    shapes = [tuple(t.shape[:-2]) + (rows_in, t.shape[-1]) for t in ts]
    ins, outs = [0] * n, [0] * n
    ins[(me + 1) % n] = flat.numel()
    outs[(me - 1) % n] = sum(_numel(sh) for sh in shapes)
    with C.in_flight(graph=True):
        buf = C.all_to_all(flat, outs, ins, mesh, mesh_dim)
    return buf, shapes


def _arrived(pending):
    """The tensors of a :func:`_shift`, waited on."""
    buf, shapes = pending
    buf = C.wait_in_graph(buf)  # eagerly the in-flight tensor's wait, compiled the graph's
    out, off = [], 0
    for sh in shapes:
        out.append(buf[off:off + _numel(sh)].view(sh))
        off += _numel(sh)
    return out


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


@register_handler(_FWD, before_rule=True)
def sdpa_context_parallel(op, args, kwargs):
    """Forward attention on sequence-sharded q, k, v (see the module docstring)."""
    q, k, v, dropout_p, is_causal, attn_mask, scale = bind(op, args, kwargs)
    i = _seq_mesh_dim(q, k, v) if attn_mask is None and not dropout_p else None
    strategy = None if i is None else choose_strategy(q, k, v, i)
    if strategy is None:
        return planned(op, args, kwargs)
    placements, causal = q._spec.placements, bool(is_causal)
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    lse_dtype = _lse_dtype(q.dtype)
    with op_context(op):
        if strategy == "ulysses":
            heads = _with(placements, i, Shard(q.dim() - 3))
            o, lse = op(to_local(q, heads), to_local(k, heads), to_local(v, heads), 0.0, causal, scale=scale)
            o = to_local(wrap(o, _spec_like(q, heads, out_shape)), placements)
            lse = to_local(wrap(lse, _spec_like(q, heads, out_shape[:-1], lse.dtype)), placements)
        else:
            ql = q._local_tensor
            start, stop = _rows(q, i)
            merge = _Merge(ql, v.shape[-1], lse_dtype)
            if strategy == "allgather_kv":
                full = _with(placements, i, Replicate())
                kl, vl = to_local(k, full), to_local(v, full)
                if stop > start:
                    _forward_block(op, merge, ql, kl, vl, 0, k.shape[-2], start, stop, causal, scale)
            else:
                _ring_forward(op, merge, q, k, v, i, start, stop, causal, scale)
            o, lse = merge.result()
        return (wrap(o, _spec_like(q, placements, out_shape)),
                wrap(lse, _spec_like(q, placements, out_shape[:-1], lse.dtype)))


def _ring_forward(op, merge, q, k, v, i, start, stop, causal, scale) -> None:
    """Pass K/V around the ring: at step ``t`` this rank holds the block of rank ``me - t`` and
    computes with it while the next block travels (issued before the compute, waited after)."""
    n, me = q._spec.mesh_shape[i], C.mesh_coordinate(q._spec.mesh)[i]
    chunks = _chunks(k, i)
    blocks = [k._local_tensor, v._local_tensor]
    for t in range(n):
        src = (me - t) % n
        pending = None
        if t < n - 1:
            a, b = chunks[(me - t - 1) % n]
            pending = _shift(blocks, b - a, q._spec.mesh, i, n, me)
        a, b = chunks[src]
        if stop > start:
            _forward_block(op, merge, q._local_tensor, blocks[0], blocks[1], a, b, start, stop, causal, scale)
        if pending is not None:
            blocks = _arrived(pending)


def _lse_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@register_handler(_BWD, before_rule=True)
def sdpa_context_parallel_backward(op, args, kwargs):
    """Backward of :func:`sdpa_context_parallel` (chooses its strategy again; each is exact)."""
    g, q, k, v, out, lse, dropout_p, is_causal, attn_mask, scale = bind(op, args, kwargs)
    i = _seq_mesh_dim(q, k, v) if attn_mask is None and not dropout_p else None
    if i is not None and not all(type(t) is DTensor and t._spec.placements == q._spec.placements
                                 and t._spec.extra is None for t in (g, out, lse)):
        i = None
    strategy = None if i is None else choose_strategy(q, k, v, i)
    if strategy is None:
        return planned(op, args, kwargs)
    placements, causal = q._spec.placements, bool(is_causal)
    with op_context(op):
        if strategy == "ulysses":
            heads = _with(placements, i, Shard(q.dim() - 3))
            gq, gk, gv = op(*(to_local(t, heads) for t in (g, q, k, v, out, lse)), 0.0, causal, scale=scale)
            return tuple(wrap(to_local(wrap(x, _spec_like(t, heads)), placements), _spec_like(t, placements))
                         for x, t in ((gq, q), (gk, k), (gv, v)))
        start, stop = _rows(q, i)
        local = [t._local_tensor for t in (g, q, out, lse)]
        dq = torch.zeros_like(q._local_tensor)
        if strategy == "allgather_kv":
            full = _with(placements, i, Replicate())
            kl, vl = to_local(k, full), to_local(v, full)
            dk, dv = torch.zeros_like(kl), torch.zeros_like(vl)
            if stop > start:
                _backward_block(op, (dq, dk, dv), local[0], local[1], kl, vl, local[2], local[3], 0, k.shape[-2],
                                start, stop, causal, scale)
            partial = _with(placements, i, Partial("sum"))
            dk = to_local(wrap(dk, _spec_like(k, partial)), placements)  # one reduce_scatter each
            dv = to_local(wrap(dv, _spec_like(v, partial)), placements)
        else:
            dk, dv = _ring_backward(op, dq, local, k, v, i, start, stop, causal, scale)
        return (wrap(dq, _spec_like(q, placements)), wrap(dk, _spec_like(k, placements)),
                wrap(dv, _spec_like(v, placements)))


def _ring_backward(op, dq, local, k, v, i, start, stop, causal, scale):
    """K/V travel the ring as in the forward, each with its gradient accumulator, which every
    rank adds its rows' contribution to; after the last step one more shift takes each
    accumulator home.  Returns this rank's ``(dk, dv)``."""
    n, me = k._spec.mesh_shape[i], C.mesh_coordinate(k._spec.mesh)[i]
    chunks = _chunks(k, i)
    kb, vb = k._local_tensor, v._local_tensor
    dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
    g, ql, outl, lsel = local
    for t in range(n):
        src = (me - t) % n
        pending = None
        if t < n - 1:
            a, b = chunks[(me - t - 1) % n]
            pending = _shift([kb, vb], b - a, k._spec.mesh, i, n, me)
        a, b = chunks[src]
        if stop > start:
            _backward_block(op, (dq, dk, dv), g, ql, kb, vb, outl, lsel, a, b, start, stop, causal, scale)
        # the accumulators follow their blocks (the last shift takes them to their owners)
        a, b = chunks[(me - t - 1) % n]
        grads = _arrived(_shift([dk, dv], b - a, k._spec.mesh, i, n, me))
        if pending is not None:
            kb, vb = _arrived(pending)
        dk, dv = grads
    return dk, dv
