"""Context parallelism: attention on a sequence-sharded DTensor, as strategies chosen by cost.

When ``q``, ``k`` and ``v`` are sharded alike with ``Shard(seq)`` or ``_StridedShard(seq)`` (the
sequence dim, ``-2``) on ONE mesh dim, or with ``Shard(seq)`` on TWO (Ulysses x ring, below), the
fused attention kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward,
what ``F.scaled_dot_product_attention`` runs on CPU; the CUDA kernels, see **Kernels**) is
computed by one of these strategies;
every other layout goes to the op's rule (``rules/attention.py``) unchanged.  The outputs keep the
query's layout (``out`` and ``logsumexp`` sequence-sharded), whatever strategy ran, so the backward
(which chooses again) and the next layer see the same layout.

- **allgather_kv**: K and V are gathered along the sequence, each with its OWN heads (grouped-query
  and multi-query attention move ``Hkv`` heads, never the repeated ones), and each rank attends its
  own query rows to them.  Causal attention needs the rank's positions in the sequence, which a
  rule cannot see: row by row a causal query sees a PREFIX of any key block (keys are held in
  position order), so the rows split into segments that see a fixed prefix (one call, no mask) or
  one more key per row (a wholly visible part and a top-left-aligned causal part), from the
  layout's runs of positions (:func:`_segments`); keys after a row are never computed.  A plain
  ``Shard`` is one run (the visible block and the diagonal); the striped layout
  ``_StridedShard(seq, split_factor=S/n)`` (rank ``r`` holds tokens ``r, r+n, ...``) is one
  causal call per block, and every rank computes about the same number of (query, key) pairs
  (a plain ``Shard``'s last rank computes ``2n-1`` times its first's); smaller split factors
  stripe blocks of tokens (one call per block of rows).  The blocks' partial results merge through
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
- **mask_kv** (with a mask whose values can be read): ONE all_to_all brings each rank exactly the
  K/V rows (their own heads) its query rows leave unmasked somewhere, from their owners; the rank
  attends its rows to them in one kernel call (the mask's columns of those keys, in global key
  order).  Backward: the same exchange, then dK/dV of the received rows go back to their owners
  with the reverse all_to_all and are summed in (index_add).  A sliding window of ``w`` keys is a
  halo (about ``w`` rows from the predecessors); a document mask brings only the documents that
  overlap the rank's rows.  Received per rank, forward: the rows the table says, the most over
  the ranks as the cost.  Plain ``Shard`` layouts only (a strided layout takes the others).
- **balanced** (causal, no mask, a plain ``Shard``): allgather_kv with the causal work evened out.
  On a contiguous layout rank ``r``'s rows see ``r + 1/2`` chunks of keys, so the last rank
  evaluates ``2n-1`` times the first's (query, key) pairs and the step waits for it.  The ranks
  pair up ``(r, n-1-r)``; the busier of a pair sends its LAST ``m`` query rows to its partner (one
  all_to_all), which holds every key too and attends them whole (no merge), and sends their output
  and log-sum-exp back (one all_to_all, widened to float32/64 so they arrive exact); ``m`` evens
  the pair's pairs (:class:`_Balance`, from metadata).  Backward: K and V gathered again, those
  rows' grad_out, q, out and log-sum-exp to the partner, which adds their dK/dV into its whole-size
  accumulators (reduce_scattered to the owners as allgather_kv's) and sends their dq back.
  Received per rank, forward: allgather_kv's plus ``m`` query rows (or their output rows).
  Eager only: while a graph is traced (torch.compile) it does not apply and ``auto`` takes the
  others (the busy and the idle rank trace different programs, which AOTAutograd partitioned into
  backward graphs with different collectives); forced there, the call takes the rule's plan.
- **Ulysses x ring** (the sequence on two mesh dims ``(i0, i1)``, heads divisible by ``i1``'s
  size): q, k, v move their ``i1`` shards from the sequence to the heads (Ulysses, one all_to_all
  each), the call runs again with the sequence on ``i0`` alone (any strategy above, by cost, the
  heads staying sharded on ``i1``), and the results move back.  Ulysses' traffic stays inside the
  inner (fast) group; the outer groups pass K/V blocks of ``Hkv/n1`` heads.  With fewer KV heads
  than that (multi-query attention), a Ulysses step would replicate KV heads: K and V are
  gathered over both dims instead (allgather_kv on the flattened pair: each element received
  once, ``(N-1)/N`` of K and V; backward dK/dV reduce_scattered over the outer then the inner
  dim, ``(N-1)/N`` again).

**Masks.**  Every strategy takes an attention mask that every rank holds whole and identical: a
plain tensor or a DTensor replicated on every mesh dim (its local tensor), additive in q's dtype
(``F.scaled_dot_product_attention`` turns a boolean mask into one before the kernel, a new tensor
every call), 2-D ``(L, S)`` or 4-D broadcasting to ``(B, H, L, S)``.  Each kernel call gets the
mask's slice for its rows and keys (and batch, or Ulysses' head chunk, where those are split): a
range of rows and columns for a plain ``Shard``, the rows and columns at the positions a strided
layout's runs hold (an index) otherwise.
A row with no key in a block (every entry ``-inf``) gets log-sum-exp ``-inf`` there, so the merge
gives the block weight 0; a row masked everywhere ends with output 0 and log-sum-exp 0, what the
kernel gives in one process.  A sharded or partial mask, one that needs a gradient, or a mask
with ``is_causal`` goes to the rule; when no strategy applies, a plain mask goes to the rule as a
Replicate DTensor.  mask_kv's table (which keys each rank's rows need: an entry ``!= -inf``, so an
HF-style ``finfo.min`` mask needs every key) is read from the whole mask ONCE per mask (cached by
the tensor's identity, version counter and layout, 8 entries; ``mask_table_stats`` counts the
reads): pass an additive mask of q's dtype to have it read once across calls, a boolean one is
read on every forward (its backward reuses it).  While tracing (torch.compile, fake, meta,
functional or symbolic-shaped masks, a fake / proxy / functionalization mode on the stack:
:func:`values_readable`) the values cannot be read, mask_kv does not apply, and the others run
with the mask sliced.  Any other dispatch mode (CommDebugMode, FlopCounterMode, a user's counter
that defers to tensor subclasses) only watches: the same plan and collectives as without it, the
table read with the modes off.

**Agreement.**  Every collective's sizes follow from data every rank shares: global shapes, and
for mask_kv the table, which every rank computes from its copy of the same mask, so the
all_to_all splits agree without a message.  A mask that differs between ranks is a user error
these plans cannot see (the result would be wrong, or the exchange sizes would disagree);
``config.attention_cp_check_masks = True`` checks it on every call (a digest of the mask's bytes
over the mesh).

**Kernels.**  The strategies call the fused kernel on blocks with the CPU kernel's signatures.
On a GPU, ``F.scaled_dot_product_attention`` runs ``_scaled_dot_product_flash_attention`` /
``_efficient_attention`` / ``_cudnn_attention`` instead; the handlers take those too, and call them
through a :class:`_CudaKernel` adapter (their own arguments filled in: no dropout, zeroed generator
state; the log-sum-exp's padding (efficient: a multiple of 32 rows) or trailing dim (cuDNN) taken
off and put back; the bias aligned as the efficient kernel needs; causal blocks square).  The
efficient kernel's padded log-sum-exp lines up with sequence shards only when the sequence is a
multiple of 32: other lengths go to the rule.  The op's other outputs (the generator state,
``max_q``/``max_k``) are those of one call on the global shapes, replicated.

**The choice.**  ``auto`` takes the strategy with the least estimated step time (forward +
backward) of the SLOWEST rank (:func:`estimate`): the (query, key) pairs that rank evaluates (the
causal triangle of its rows, the mask's table for mask_kv, whole sequences of ``H/n`` heads for
Ulysses) at ``config.attention_cp_pair_seconds`` per pair, head and element of ``E + Ev``, plus
the communication it waits for: the bytes it receives (``_bytes`` for the forward, the
strategy's multiple for the step) at ``config.attention_cp_byte_seconds`` and each collective at
``config.attention_cp_collective_seconds``, the ring's exchange counted only where it outlasts
the compute it travels under.  Everything comes from global shapes, the layout and the mask's
table (the same on every rank, so every rank takes the same strategy); without a mask the
decision is cached by that metadata and the settings.  ``config.attention_cp`` forces one where
it applies.  ``dtshard.debug.explain`` prints, per call, the strategy that ran, why (auto or
forced) and every estimate.
FlexAttention: ``rules/flex_attention_cp.py``.
"""

from __future__ import annotations

import bisect
import hashlib
import math
import weakref
from collections import OrderedDict

import torch
from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch._subclasses.functional_tensor import FunctionalTensorMode
from torch.fx.experimental.proxy_tensor import ProxyTorchDispatchMode
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from dtshard import _trace
from dtshard import collectives as C
from dtshard._config import config
from dtshard.handlers import DTensor, bind, make_spec, meta_run, op_context, planned, to_local, wrap
from dtshard.registry import op_facts, register_handler
from dtshard.rules.attention import CUDA_BWD, CUDA_FWD
from dtshard.spec import same_mesh

__all__ = ["Estimate", "choose_strategy", "estimate", "mask_table_stats", "unwatched", "values_readable"]

aten = torch.ops.aten
_FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
_BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
STRATEGIES = ("ulysses", "allgather_kv", "ring", "mask_kv", "balanced")


# --- the kernels -----------------------------------------------------------------------------
# The strategies call a kernel on blocks with the CPU kernel's signatures, forward
# ``(q, k, v, dropout_p, is_causal, attn_mask=None, scale=None) -> (out, logsumexp)`` and backward
# ``(grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask=None, scale=None) ->
# (dq, dk, dv)``, log-sum-exp as ``(..., L)`` rows.  The CPU kernel is that; each CUDA kernel is
# adapted to it by a _CudaKernel (its own arguments filled in, its log-sum-exp's padding or
# trailing dim taken off and put back).


def _pad32(n: int) -> int:
    return -(-n // 32) * 32


class _CudaKernel:
    """A CUDA fused attention kernel (flash, efficient, cuDNN) called as the CPU kernel is.

    Causal calls are split so that the kernel only ever sees square causal blocks: the CPU
    kernel's causal mask is aligned top-left, and a CUDA kernel's alignment for more query rows
    than keys is not that on every version; on a square block every convention agrees."""

    def __init__(self, fwd_op, bwd_op):
        self.fwd_op, self.bwd_op = fwd_op, bwd_op
        self.kind = fwd_op.__name__.split("_scaled_dot_product_")[1].split("_attention")[0]

    def _aux(self, like, shape, dtype):
        """The generator-state argument of a call without dropout: zeros (a Replicate DTensor
        when the call's tensors are DTensors)."""
        z = torch.zeros(shape, dtype=dtype, device=like.device)
        if type(like) is DTensor:
            mesh = like._spec.mesh
            return wrap(z, make_spec(mesh, (Replicate(),) * mesh.ndim, shape, dtype))
        return z

    def forward(self, q, k, v, dropout_p, is_causal, attn_mask=None, scale=None):
        nq, nk = q.shape[-2], k.shape[-2]
        if is_causal and nq > nk:  # a square causal block, and the rows below it see every key
            o1, l1 = self.forward(q[..., :nk, :], k, v, dropout_p, True, _rows_of(attn_mask, 0, nk), scale)
            o2, l2 = self.forward(q[..., nk:, :], k, v, dropout_p, False, _rows_of(attn_mask, nk, nq), scale)
            return torch.cat([o1, o2], -2), torch.cat([l1, l2], -1)
        if self.kind == "flash":
            if attn_mask is not None:
                raise ValueError(f"{self.fwd_op} takes no attention mask")
            out = self.fwd_op(q, k, v, dropout_p, is_causal, False, scale=scale)
        elif self.kind == "efficient":
            out = self.fwd_op(q, k, v, _aligned_bias(attn_mask, q, k), True, dropout_p, is_causal, scale=scale)
        else:
            out = self.fwd_op(q, k, v, _aligned_bias(attn_mask, q, k), True, dropout_p, is_causal, False, scale=scale)
        return out[0], self.lse_rows(out[1], nq)

    __call__ = forward

    def backward(self, g, q, k, v, out, lse, dropout_p, is_causal, attn_mask=None, scale=None):
        nq, nk = q.shape[-2], k.shape[-2]
        if is_causal and nq > nk:
            a, b = slice(0, nk), slice(nk, nq)
            g1 = self.backward(g[..., a, :], q[..., a, :], k, v, out[..., a, :], lse[..., a], dropout_p, True,
                               _rows_of(attn_mask, 0, nk), scale)
            g2 = self.backward(g[..., b, :], q[..., b, :], k, v, out[..., b, :], lse[..., b], dropout_p, False,
                               _rows_of(attn_mask, nk, nq), scale)
            return torch.cat([g1[0], g2[0]], -2), g1[1] + g2[1], g1[2] + g2[2]
        if self.kind == "flash":
            seed, offset = self._aux(q, (2,), torch.uint64), self._aux(q, (), torch.uint64)
            return self.bwd_op(g, q, k, v, out, lse, None, None, nq, nk, dropout_p, is_causal, seed, offset,
                               scale=scale)
        seed, offset = self._aux(q, (), torch.int64), self._aux(q, (), torch.int64)
        bias = _aligned_bias(attn_mask, q, k)
        if self.kind == "efficient":
            if lse.shape[-1] != _pad32(nq):
                lse = torch.nn.functional.pad(lse, (0, _pad32(nq) - lse.shape[-1]))
            grads = self.bwd_op(g, q, k, v, bias, out, lse, seed, offset, dropout_p, [True, True, True, False],
                                is_causal, scale=scale)
            return grads[0], grads[1], grads[2]
        return self.bwd_op(g, q, k, v, out, lse.unsqueeze(-1), seed, offset, bias, None, None, nq, nk, dropout_p,
                           is_causal, scale=scale)

    def lse_rows(self, lse, nq: int):
        """The kernel's log-sum-exp as ``(..., L)`` rows (efficient pads them to a multiple of 32,
        cuDNN adds a trailing dim of 1)."""
        if self.kind == "cudnn":
            return lse.squeeze(-1)
        if self.kind == "efficient" and lse.shape[-1] != nq:
            return lse[..., :nq]
        return lse


def _rows_of(mask, r0: int, r1: int):
    return mask if mask is None or mask.shape[-2] == 1 else mask[..., r0:r1, :]


def _aligned_bias(mask, q, k):
    """The attention bias as the CUDA kernels take it: 4-D (a broadcast view) with rows that start
    at aligned addresses, 16 elements apart or a multiple of that (the memory-efficient kernel's
    requirement, which ``F.scaled_dot_product_attention`` meets by padding the same way): a slice
    of a larger mask is copied into a padded buffer when it does not line up."""
    if mask is None:
        return None
    if mask.stride(-1) != 1 or mask.stride(-2) % 16 or mask.storage_offset() % 16:
        n = mask.shape[-1]
        buf = mask.new_zeros(tuple(mask.shape[:-1]) + (n + (-n) % 16,))
        buf[..., :n] = mask
        mask = buf[..., :n]
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask.expand(tuple(q.shape[:-1]) + (k.shape[-2],))


class _Family:
    """How one fused kernel's calls bind (schema names) and what its forward returns."""

    def __init__(self, fwd_op, mask_name, kernel, backward):
        #: ``kernel`` / ``backward``: the forward / backward as the strategies call them on blocks
        self.fwd_op, self.mask_name, self.kernel, self.backward = fwd_op, mask_name, kernel, backward

    def bind(self, op, args, kwargs) -> dict:
        return dict(zip(op_facts(op).names, bind(op, args, kwargs)))

    def takes(self, b: dict, q) -> bool:
        """Can context parallelism produce this call's outputs (no debug mask; the log-sum-exp
        laid out by query rows: efficient pads it to a multiple of 32 rows, which only lines up
        with the rows' shards when the sequence is a multiple of 32)?"""
        if b.get("return_debug_mask"):
            return False
        return self.fwd_op is not CUDA_FWD[1] or q.shape[-2] % 32 == 0 or not b["compute_log_sumexp"]

    def outputs(self, op, args, kwargs, o, lse):
        """The op's whole output from this rank's ``(out, logsumexp rows)`` DTensors: the CPU
        kernel's pair, or a CUDA kernel's tuple (log-sum-exp in its own layout, the generator
        state as replicated zeros, the lengths global)."""
        if op is _FWD:
            return o, lse
        metas = meta_run(op, *args, **kwargs)
        mesh = o._spec.mesh
        lm = metas[1]
        if lm.numel() == 0:  # compute_log_sumexp=False: an empty log-sum-exp
            lse = wrap(torch.zeros(lm.shape, dtype=lm.dtype, device=o.device),
                       make_spec(mesh, (Replicate(),) * mesh.ndim, lm.shape, lm.dtype))
        else:  # the kernel's dtype (float32) and layout (cuDNN: a trailing dim of 1)
            local = lse._local_tensor.to(lm.dtype)
            lse = wrap(local if lm.dim() == lse.dim() else local.unsqueeze(-1),
                       _spec_like(lse, lse._spec.placements, lm.shape, lm.dtype))
        res = [o, lse]
        for m in metas[2:]:
            if isinstance(m, torch.Tensor):
                z = torch.zeros(m.shape, dtype=m.dtype, device=o.device)
                res.append(wrap(z, make_spec(mesh, (Replicate(),) * mesh.ndim, m.shape, m.dtype)))
            else:
                res.append(m)
        return tuple(res)


_FAMILIES = {_FWD: _Family(_FWD, "attn_mask", _FWD, _BWD)}
_FAMILIES[_BWD] = _FAMILIES[_FWD]
for _f, _b in zip(CUDA_FWD, CUDA_BWD):
    _k = _CudaKernel(_f, _b)
    _FAMILIES[_f] = _FAMILIES[_b] = _Family(_f, None if _f is CUDA_FWD[0] else "attn_bias", _k, _k.backward)


def _with_arg(op, args, kwargs, name, value):
    """``(args, kwargs)`` with the argument ``name`` set to ``value``."""
    names = op_facts(op).names
    i = names.index(name)
    if i < len(args):
        args = tuple(args[:i]) + (value,) + tuple(args[i + 1:])
    else:
        kwargs = dict(kwargs, **{name: value})
    return args, kwargs


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
    if not (same_mesh(sq.mesh, sk.mesh) and same_mesh(sq.mesh, sv.mesh) and sq.placements == sk.placements == sv.placements):
        return None
    if not C.is_member(sq.mesh):
        return None  # a rank outside the mesh: the rule's path makes its empty outputs
    seq = q.dim() - 2
    found = None
    for i, p in enumerate(sq.placements):
        if (type(p) is Shard or type(p) is _StridedShard) and p.dim == seq:
            if found is not None:
                return None  # two mesh dims: Ulysses x ring (_usp_dims)
            found = i
        elif type(p) is Shard:
            n = sq.mesh_shape[i]
            if not (p.dim < seq and (q.shape[p.dim] == k.shape[p.dim] == v.shape[p.dim] or (
                    p.dim == seq - 1 and q.shape[p.dim] % n == 0 and k.shape[p.dim] % n == 0
                    and k.shape[p.dim] == v.shape[p.dim]))):
                return None  # (heads of grouped-query attention: only chunks that line up)
        elif type(p) is not Replicate:
            return None  # Partial, or another dim strided: the rule's path
    return found


def _usp_dims(q, k, v) -> tuple[int, int] | None:
    """Ulysses x ring: the sequence sharded (plain ``Shard``) on exactly two mesh dims ``(i0,
    i1)`` of q, k, v alike, every other mesh dim replicating or sharding the batch, and the query
    and key/value heads divisible by the inner dim's size: the inner dim's sequence shards move to
    heads (Ulysses), and the outer dim runs a single-dim strategy on what is left."""
    dims = _two_seq_dims(q, k, v)
    if dims is None:
        return None
    n1, h = q._spec.mesh_shape[dims[1]], q.dim() - 3
    if q.shape[h] % n1 or k.shape[h] % n1:
        return None
    return dims


def _two_dims_plan(q, k, v, dropout_p, attn_mask):
    """The sequence on two mesh dims: ``("usp", dims)`` (Ulysses on the inner dim x a single-dim
    strategy on the outer one) where the heads divide the inner dim's size; else ``("flat",
    dims)``: K and V gathered over both dims once, with their own heads (multi-query attention
    with fewer KV heads than the inner dim: a Ulysses step would have to replicate the KV heads),
    each rank's query rows attended to them (allgather_kv on the flattened group) while
    ``config.attention_cp`` is "auto" or "allgather_kv" and the whole K/V fits
    ``config.attention_cp_gather_bytes``; None: not this layout (or the rule's path)."""
    if dropout_p or attn_mask is not None:
        return None
    dims = _two_seq_dims(q, k, v)
    if dims is None:
        return None
    if _usp_dims(q, k, v) is not None:
        return "usp", dims
    if config.attention_cp not in ("auto", "allgather_kv"):
        return None
    other = 1
    for j, p in enumerate(q._spec.placements):
        if j not in dims and type(p) is Shard:
            other *= q._spec.mesh_shape[j]
    if (k.numel() + v.numel()) * k.element_size() / other > config.attention_cp_gather_bytes:
        return None
    return "flat", dims


def _two_seq_dims(q, k, v) -> tuple[int, int] | None:
    """The two mesh dims that shard the sequence (plain ``Shard``) of q, k, v alike, every other
    mesh dim replicating or sharding the batch; None for any other layout."""
    if not (type(q) is DTensor and type(k) is DTensor and type(v) is DTensor) or q.dim() < 3:
        return None
    sq = q._spec
    if not (same_mesh(sq.mesh, k._spec.mesh) and same_mesh(sq.mesh, v._spec.mesh) and sq.placements == k._spec.placements == v._spec.placements):
        return None
    if sq.extra is not None or k._spec.extra is not None or v._spec.extra is not None or not C.is_member(sq.mesh):
        return None
    seq = q.dim() - 2
    dims = [i for i, p in enumerate(sq.placements) if type(p) is Shard and p.dim == seq]
    if len(dims) != 2:
        return None
    for i, p in enumerate(sq.placements):
        if i in dims or type(p) is Replicate:
            continue
        if not (type(p) is Shard and p.dim < seq - 1 and q.shape[p.dim] == k.shape[p.dim] == v.shape[p.dim]):
            return None
    if k.shape[seq - 1] != v.shape[seq - 1]:
        return None
    return dims[0], dims[1]


def _flat_forward(kern, q, k, v, dims, causal, scale):
    """allgather_kv over the flattened pair of sequence mesh dims ``dims``: K and V gathered over
    both (their own heads, each element received once), this rank's query rows (a contiguous run
    of the sequence) attended to them, keys after a causal row never computed."""
    full = tuple(Replicate() if j in dims else p for j, p in enumerate(q._spec.placements))
    kl, vl = to_local(k, full), to_local(v, full)
    ql = q._local_tensor
    merge = _Merge(ql, v.shape[-1], _lse_dtype(q.dtype))
    _forward_block(kern, merge, ql, kl, vl, _runs(q, dims[0]), ((0, k.shape[-2]),), causal, scale)
    return merge.result()


def _flat_backward(kern, g, q, k, v, out, lse, dims, causal, scale):
    """The backward of :func:`_flat_forward`: K and V gathered again, each rank's rows' gradients
    against every key, dK and dV reduced to their owners (a reduce_scatter over both dims)."""
    placements = q._spec.placements
    full = tuple(Replicate() if j in dims else p for j, p in enumerate(placements))
    kl, vl = to_local(k, full), to_local(v, full)
    dq = torch.zeros_like(q._local_tensor)
    dk, dv = torch.zeros_like(kl), torch.zeros_like(vl)
    _backward_block(kern, (dq, dk, dv), g._local_tensor, q._local_tensor, kl, vl, out._local_tensor,
                    lse._local_tensor, _runs(q, dims[0]), ((0, k.shape[-2]),), causal, scale)
    partial = tuple(Partial("sum") if j in dims else p for j, p in enumerate(placements))
    # the outer dim first (a reduce_scatter to its halves), then the inner one within them: each
    # rank receives (n-1)/n of dK and dV over the two steps, as the forward's gathers
    outer = _with(partial, dims[0], placements[dims[0]])
    grads = []
    for x, t in ((dk, k), (dv, v)):
        x = to_local(wrap(x, _spec_like(t, partial)), outer)
        grads.append(to_local(wrap(x, _spec_like(t, outer)), placements))
    return dq, grads[0], grads[1]


def _bytes(strategy: str, q, k, v, mesh_dim: int, mask=None, causal: bool = False) -> float | None:
    """Bytes each rank receives in the forward under ``strategy`` (None: it does not apply).
    ``mask``: the attention mask's whole tensor (see :func:`_whole_mask`), or None; ``causal``:
    the call's ``is_causal`` (balanced applies to causal calls only)."""
    n = q._spec.mesh_shape[mesh_dim]
    other = _other(q, mesh_dim)  # the other mesh dims' shards of the leading dims
    item = q.element_size()
    if strategy in ("allgather_kv", "ring"):
        return (n - 1) / n * (k.numel() + v.numel()) * item / other
    if strategy == "balanced":
        plan = _balance(q, k, mesh_dim, causal, mask)
        if plan is None:
            return None
        gathered = (n - 1) / n * (k.numel() + v.numel()) * item / other
        return gathered + plan.max_moved * _query_row_bytes(q, v, other)
    if strategy == "ulysses":
        h = q.dim() - 3
        if any(type(p) is Shard and p.dim == h for p in q._spec.placements):
            return None  # heads already sharded by another mesh dim
        if q.shape[h] % n or k.shape[h] % n:
            return None
        out = q.numel() // q.shape[-1] * v.shape[-1]
        return (n - 1) / n / n * (q.numel() + k.numel() + v.numel() + out) * item / other
    if strategy == "mask_kv":
        if mask is None or not _readable(mask) or q._spec.has_strided:
            return None  # no mask, its values cannot be read (tracing), or a strided layout
        table = _mask_table(mask, q, k, mesh_dim)
        return table.max_received * _key_row_bytes(k, v, other)
    raise ValueError(f"config.attention_cp: unknown strategy {strategy!r}; one of 'auto', {STRATEGIES}")


def _key_row_bytes(k, v, other: int) -> float:
    """Bytes of one key row of K and V together (their own heads, this rank's leading dims)."""
    seq = k.shape[-2]
    return (k.numel() + v.numel()) // max(seq, 1) * k.element_size() / other


def _other(q, mesh_dim) -> int:
    """How many shards the mesh dims other than ``mesh_dim`` cut the leading dims into."""
    other = 1
    for i, p in enumerate(q._spec.placements):
        if i != mesh_dim and type(p) is Shard:
            other *= q._spec.mesh_shape[i]
    return other


def _query_row_bytes(q, v, other: int) -> float:
    """Bytes of one query row of q plus its output row and log-sum-exp (this rank's leading dims),
    what balanced moves per row each way in the forward."""
    lead = q.numel() // max(q.shape[-1] * q.shape[-2], 1)
    return lead * (q.shape[-1] + v.shape[-1] + 1) * q.element_size() / other


def _all_runs(q, mesh_dim: int) -> list[tuple]:
    """Every rank's runs (:func:`_runs`) of the query sequence along ``mesh_dim``: arithmetic for a
    plain ``Shard`` (``torch.chunk``'s split), the spec's regions for a strided layout."""
    if hasattr(q._spec, "local_region"):  # (a real spec: the layout's own split)
        return _chunks(q, mesh_dim)
    n, seq = q._spec.mesh_shape[mesh_dim], q.shape[-2]
    c = -(-seq // n)
    return [((min(r * c, seq), min((r + 1) * c, seq)),) if r * c < seq else () for r in range(n)]


def _pairs(runs, nk: int, causal: bool) -> int:
    """(query, key) pairs that rows at the global positions ``runs`` evaluate against the keys
    ``[0, nk)``: every key, or causally (top-left aligned, as the CPU kernel) row ``p`` the first
    ``min(p + 1, nk)``."""
    if not causal:
        return _length(runs) * nk
    total = 0
    for a, b in runs:
        m = min(b, nk)
        if a < m:
            total += (a + 1 + m) * (m - a) // 2
        total += max(b - max(a, m), 0) * nk
    return total


class _Balance:
    """balanced: allgather_kv whose causal work is evened out between the pairs of ranks ``(r, n-1-r)``
    of a plain ``Shard`` sequence: the busier one (the later rows see more keys) sends its LAST
    ``m`` query rows to its partner, which holds every key too and attends them (the whole rows:
    no merge), and sends their output and log-sum-exp back; in backward those rows' ``grad_out``,
    q, out and log-sum-exp travel the same way, the partner's dK/dV (whole-size, reduce_scattered
    as allgather_kv's) take their contribution and their dq goes back.  ``m`` evens the pair's
    (query, key) pairs.  Every number here is metadata, the same on every rank.

    ``moves``: ``{busy rank: (partner, m)}``; ``work``: pairs each rank evaluates after the moves."""

    def __init__(self, runs, nk: int):
        n = len(runs)
        work = [_pairs(r, nk, True) for r in runs]
        self.before = list(work)
        self.moves: dict[int, tuple[int, int]] = {}
        for r in range(n // 2):
            s = n - 1 - r
            busy, idle = (s, r) if work[s] >= work[r] else (r, s)
            if not runs[busy]:
                continue
            a, b = runs[busy][0]

            def moved(m, b=b):
                return _pairs(((b - m, b),), nk, True)

            lo, hi = 0, b - a  # the least m with busy - moved(m) <= idle + moved(m)
            while lo < hi:
                mid = (lo + hi) // 2
                if work[busy] - moved(mid) > work[idle] + moved(mid):
                    lo = mid + 1
                else:
                    hi = mid
            m = min((x for x in (lo - 1, lo) if 0 <= x <= b - a),
                    key=lambda x: max(work[busy] - moved(x), work[idle] + moved(x)))
            if m:
                self.moves[busy] = (idle, m)
                work[busy] -= moved(m)
                work[idle] += moved(m)
        self.work = work
        self.max_moved = max((m for _, m in self.moves.values()), default=0)
        self.n = n

    def role(self, me: int):
        """``(rows I send, rows I receive, partner, the received rows' global start)``."""
        if me in self.moves:
            partner, m = self.moves[me]
            return m, 0, partner, None
        for busy, (idle, m) in self.moves.items():
            if idle == me:
                return 0, m, busy, busy
        return 0, 0, None, None

    def counts(self, me: int):
        """``(send_counts, recv_counts)`` of this rank's all_to_all of rows (busy to partner)."""
        send, recv = [0] * self.n, [0] * self.n
        m_out, m_in, partner, _ = self.role(me)
        if m_out:
            send[partner] = m_out
        if m_in:
            recv[partner] = m_in
        return send, recv


_BALANCES: OrderedDict = OrderedDict()


def _balance(q, k, mesh_dim: int, causal: bool, mask=None) -> _Balance | None:
    """The balanced plan of this call, or None where it does not apply (a causal call with no
    mask, on a plain ``Shard`` of one mesh dim, whose pairs of ranks differ)."""
    if not causal or mask is not None or getattr(q._spec, "has_strided", False):
        return None
    if q._spec.placements[mesh_dim] != Shard(q.dim() - 2) or _tracing():
        return None
    key = (q.shape[-2], k.shape[-2], q._spec.mesh_shape[mesh_dim])
    plan = _BALANCES.get(key)
    if plan is None:
        plan = _BALANCES[key] = _Balance(_all_runs(q, mesh_dim), k.shape[-2])
        while len(_BALANCES) > 64:
            _BALANCES.popitem(last=False)
    return plan


class Estimate:
    """A strategy's estimated step (forward + backward) time on its SLOWEST rank: the compute of the
    (query, key) pairs that rank evaluates (``config.attention_cp_pair_seconds`` per pair, head
    and element of ``E + Ev``) plus the communication it waits for (bytes received at
    ``config.attention_cp_byte_seconds`` each, ``config.attention_cp_collective_seconds`` per
    collective; the ring's exchange hides behind its compute)."""

    def __init__(self, strategy, compute, comm, pairs_max, pairs_mean, fwd_bytes, step_bytes, collectives):
        self.strategy, self.compute, self.comm = strategy, compute, comm
        self.pairs_max, self.pairs_mean = pairs_max, pairs_mean
        self.fwd_bytes, self.step_bytes, self.collectives = fwd_bytes, step_bytes, collectives
        self.seconds = compute + comm

    @property
    def imbalance(self) -> float:
        """The slowest rank's pairs over the mean."""
        return self.pairs_max / self.pairs_mean if self.pairs_mean else 1.0

    def __repr__(self):
        return (f"{self.strategy} {self.seconds * 1e3:.3g} ms (slowest rank: compute {self.compute * 1e3:.3g} ms, "
                f"{self.pairs_max:,} pairs = {self.imbalance:.2f}x the mean; communication "
                f"{self.comm * 1e3:.3g} ms exposed, {self.step_bytes / 2**20:.3g} MiB received forward + "
                f"backward, {self.collectives} collectives)")


def estimate(strategy: str, q, k, v, mesh_dim: int, mask=None, causal: bool = False) -> Estimate | None:
    """The :class:`Estimate` of ``strategy`` for this call (None: it does not apply), from global
    shapes, the layout and the mask's table (every rank computes the same)."""
    fwd = _bytes(strategy, q, k, v, mesh_dim, mask, causal)
    if fwd is None:
        return None
    n, nk = q._spec.mesh_shape[mesh_dim], k.shape[-2]
    other = _other(q, mesh_dim)
    item = q.element_size()
    runs = _all_runs(q, mesh_dim)
    lead = q.numel() // max(q.shape[-1] * q.shape[-2], 1) / other  # batch x query heads on a rank
    per_pair = lead * (q.shape[-1] + v.shape[-1]) * config.attention_cp_pair_seconds
    causal_pairs = causal and mask is None
    if strategy == "ulysses":
        total = _pairs(((0, q.shape[-2]),), nk, causal_pairs)
        work = [total / n] * n  # whole sequences of H/n heads: every rank alike
        out = q.numel() // q.shape[-1] * v.shape[-1]
        step = fwd + (n - 1) / n / n * (2 * out + q.numel() + k.numel() + v.numel() + out // v.shape[-1]
                                        + q.numel() + k.numel() + v.numel()) * item / other
        colls = 14
    elif strategy == "mask_kv":
        table = _mask_table(mask, q, k, mesh_dim)
        work = [_length(r) * len(table.need[j]) for j, r in enumerate(runs)]
        step, colls = 3 * fwd, 3
    elif strategy == "balanced":
        plan = _balance(q, k, mesh_dim, causal, mask)
        work = plan.work
        kv = (n - 1) / n * (k.numel() + v.numel()) * item / other
        row = _query_row_bytes(q, v, other)
        # forward: q rows out, output + lse back; backward: grad_out, q, out, lse out, dq back
        moved_bwd = plan.max_moved * row / (q.shape[-1] + v.shape[-1] + 1) * (2 * q.shape[-1] + 2 * v.shape[-1] + 1)
        step = fwd + 2 * kv + moved_bwd
        colls = 6 + (4 if plan.moves else 0)
    else:
        work = [_pairs(r, nk, causal_pairs) for r in runs]
        if strategy == "allgather_kv":
            step, colls = 3 * fwd, 6
        else:  # ring: blocks again in backward, and the accumulators once around
            step, colls = fwd * (3 * n - 2) / max(n - 1, 1), 3 * n - 2
    compute = max(work) * per_pair
    comm = step * config.attention_cp_byte_seconds
    if strategy == "ring":  # each step's exchange travels under the compute of the block in hand
        comm = max(comm - compute * (n - 1) / n, 0.0)
    comm += colls * config.attention_cp_collective_seconds
    return Estimate(strategy, compute, comm, int(max(work)), sum(work) / n, fwd, step, colls)


def choose_strategy(q, k, v, mesh_dim: int, mask=None, causal: bool = False) -> str | None:
    """The strategy for this call: ``config.attention_cp`` when it names one that applies, else
    the one with the least estimated step time of the slowest rank (:func:`estimate`); ties go to
    the first of STRATEGIES; K and V are not gathered whole (allgather_kv, balanced) when that
    would hold more than ``config.attention_cp_gather_bytes`` per rank (the ring holds two
    blocks; mask_kv holds the rows the mask needs, counted the same way)."""
    return _decide(q, k, v, mesh_dim, mask, causal)[0]


_DECISIONS: OrderedDict = OrderedDict()


def _decide(q, k, v, mesh_dim: int, mask=None, causal: bool = False):
    """``(strategy or None, why: text, the estimates considered)``; without a mask cached by the
    metadata and settings it depends on (every call of a training step asks again)."""
    if mask is not None or not hasattr(q._spec, "mesh"):
        return _decide_now(q, k, v, mesh_dim, mask, causal)
    key = (config.attention_cp, config.attention_cp_gather_bytes, config.attention_cp_pair_seconds,
           config.attention_cp_byte_seconds, config.attention_cp_collective_seconds, tuple(q.shape),
           tuple(k.shape), tuple(v.shape), q.dtype, q._spec.placements, q._spec.mesh_shape, mesh_dim, causal)
    hit = _DECISIONS.get(key)
    if hit is None:
        hit = _DECISIONS[key] = _decide_now(q, k, v, mesh_dim, mask, causal)
        while len(_DECISIONS) > 64:
            _DECISIONS.popitem(last=False)
    return hit


def _decide_now(q, k, v, mesh_dim: int, mask=None, causal: bool = False):
    forced = config.attention_cp
    if forced != "auto":
        ok = _bytes(forced, q, k, v, mesh_dim, mask, causal) is not None
        return (forced if ok else None), ("forced by dtshard.config.attention_cp" if ok else
                                          f"dtshard.config.attention_cp = {forced!r} does not apply"), []
    ests = [e for s in STRATEGIES if (e := estimate(s, q, k, v, mesh_dim, mask, causal)) is not None]
    why = "auto: the least estimated step time of the slowest rank"
    if any(e.strategy == "ring" for e in ests):
        cap = config.attention_cp_gather_bytes
        if _gathered_bytes(q, k, v, mesh_dim) > cap:
            ests = [e for e in ests if e.strategy not in ("allgather_kv", "balanced")]
            why += f"; K/V whole over attention_cp_gather_bytes ({cap} B): not gathered"
        if any(e.strategy == "mask_kv" for e in ests) and _mask_held_bytes(mask, q, k, v, mesh_dim) > cap:
            ests = [e for e in ests if e.strategy != "mask_kv"]
    if not ests:
        return None, "no strategy applies", []
    best = min(ests, key=lambda e: e.seconds)
    return best.strategy, why, sorted(ests, key=lambda e: e.seconds)


class _Decision:
    """What ``dtshard.debug.explain`` / ``plan_log`` print for a context-parallel call: the strategy
    that ran and why (the estimates of the others, fastest first)."""

    considered = ()

    def __init__(self, op, text):
        self.op, self.text = op, text

    def describe(self, specs=None) -> str:
        return f"{self.op}: context parallelism: {self.text}"


def _explain(op, q, mesh_dim, strategy, why, ests) -> None:
    """Tell the plan observers (``dtshard.debug.explain``) which strategy runs and why."""
    lines = [f"{strategy} on mesh dim {mesh_dim} ({why}), q {tuple(q.shape)} {tuple(q._spec.placements)}"]
    lines += [f"    {'->' if e.strategy == strategy else '  '} {e!r}" for e in ests]
    for obs in _trace.plan_observers:
        obs(str(op), _Decision(op, "\n".join(lines)), None)


def _mask_held_bytes(mask, q, k, v, mesh_dim: int) -> float:
    """K and V rows one rank holds under mask_kv (received and its own), the most over the ranks."""
    other = _other(q, mesh_dim)
    return _mask_table(mask, q, k, mesh_dim).max_held * _key_row_bytes(k, v, other)


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
    """This rank's query rows ``[start, stop)`` of the global sequence (a plain ``Shard``)."""
    spec = q._spec
    coord = C.mesh_coordinate(spec.mesh)
    shape, offset = spec.local_shape_and_offset(coord)
    seq = q.dim() - 2
    return offset[seq], offset[seq] + shape[seq]


def _runs(t, mesh_dim: int, rank: int | None = None) -> tuple:
    """The global sequence positions a rank holds of ``t``, as ``[lo, hi)`` runs in local order
    (one run for a plain ``Shard``; a strided shard holds one per chunk): this rank's, or with
    ``rank`` the one at that coordinate of ``mesh_dim`` (this rank's other coordinates)."""
    spec = t._spec
    coord = list(C.mesh_coordinate(spec.mesh))
    if rank is not None:
        coord[mesh_dim] = rank
    return tuple(spec.local_region(coord)[t.dim() - 2])


def _length(runs) -> int:
    return sum(hi - lo for lo, hi in runs)


#: attention work per call, for the load-balance test: (query, key) pairs the kernel computes
work_stats = {"pairs": 0}


def _segments(rows, keys, causal: bool) -> list[tuple[int, int, int, int]]:
    """How query rows attend a block of keys, both given as runs of global positions in local
    order: ``(r0, r1, c0, cap)`` row segments (local rows ``[r0, r1)``) where row ``r`` attends
    the first ``min(c0 + r - r0, cap)`` local keys (keys sorted by position, so causal attention
    always sees a prefix of a block).  Without ``causal`` one segment of every key.  Rows that
    see no key are left out.  From metadata only (the same on every rank)."""
    nk = _length(keys)
    nr = _length(rows)
    if not causal:
        return [(0, nr, nk, nk)] if nr and nk else []
    starts = [lo for lo, _ in keys]
    cum = [0]
    for lo, hi in keys:
        cum.append(cum[-1] + hi - lo)
    pieces = []  # (r0, r1, keys seen by row r0, slope 0 or 1)
    r = 0
    for lo, hi in rows:
        g = lo
        while g < hi:
            idx = bisect.bisect_right(starts, g) - 1
            if idx >= 0 and g < keys[idx][1]:  # inside a key run: one more key per row
                end = min(hi, keys[idx][1])
                pieces.append((r + g - lo, r + end - lo, cum[idx] + g - keys[idx][0] + 1, 1))
            else:  # between key runs: the same keys for every row
                end = min(hi, starts[idx + 1]) if idx + 1 < len(starts) else hi
                pieces.append((r + g - lo, r + end - lo, cum[idx + 1], 0))
            g = end
        r += hi - lo
    segs: list[list[int]] = []
    for r0, r1, c, slope in pieces:
        if c == 0 and slope == 0:
            continue
        if c == 0:  # the run's first row sees nothing yet
            r0, c = r0 + 1, 1
            if r0 == r1:
                continue
        cur = segs[-1] if segs else None
        if cur is not None and cur[1] == r0 and cur[3] is None and c == cur[2] + r0 - cur[0]:
            if slope == 1 or r1 - r0 == 1:
                cur[1] = r1  # the diagonal goes on
                continue
            cur[1], cur[3] = r1, c  # the diagonal reaches its last key: capped from here
            continue
        if cur is not None and cur[1] == r0 and cur[3] is not None and slope == 0 and c == cur[3]:
            cur[1] = r1
            continue
        segs.append([r0, r1, c, None if slope == 1 or r1 - r0 == 1 else c])
    return [(r0, r1, c0, cap if cap is not None else c0 + r1 - r0 - 1) for r0, r1, c0, cap in segs]


def _calls(rows, keys, causal: bool):
    """The kernel calls of :func:`_segments`: ``(r0, r1, k0, k1, causal)`` in local indices (a
    wholly visible part, and a top-left-aligned causal part where the rows' keys grow)."""
    out = []
    for r0, r1, c0, cap in _segments(rows, keys, causal):
        if cap == c0:
            out.append((r0, r1, 0, c0, False))
            work_stats["pairs"] += (r1 - r0) * c0
            continue
        if c0 > 1:
            out.append((r0, r1, 0, c0 - 1, False))
            work_stats["pairs"] += (r1 - r0) * (c0 - 1)
        out.append((r0, r1, c0 - 1, cap, True))
        width = cap - c0 + 1
        work_stats["pairs"] += sum(min(t + 1, width) for t in range(r1 - r0))
    return out


class _Merge:
    """Attention over key blocks from each block's ``(out, logsumexp)`` on a suffix of the rows,
    merged online through the log-sum-exps, accumulated in float32 (float64 for float64).  A
    block a row has no key in carries log-sum-exp ``-inf`` (see :func:`_dead_rows`): weight 0,
    and no NaN while the row has no key yet; a row with no key anywhere ends with output 0 and
    log-sum-exp 0, what the kernel gives in one process."""

    def __init__(self, ql, ev: int, lse_dtype):
        self.dtype, self.lse_dtype = ql.dtype, lse_dtype
        acc = torch.float64 if ql.dtype == torch.float64 else torch.float32
        self.out = ql.new_zeros(tuple(ql.shape[:-1]) + (ev,), dtype=acc)
        self.lse = ql.new_full(tuple(ql.shape[:-1]), float("-inf"), dtype=acc)

    def add(self, row: int, o, lse) -> None:
        """Merge a call's ``(out, logsumexp)`` for the rows ``[row, row + its rows)``."""
        end = row + o.shape[-2]
        old = self.lse[..., row:end]
        lse = lse.to(old.dtype)
        new = torch.logaddexp(old, lse)
        ref = new.masked_fill(new == float("-inf"), 0.0)  # no key yet: both weights exp(-inf) = 0
        acc = self.out[..., row:end, :]
        acc.mul_(torch.exp(old - ref).unsqueeze(-1)).add_(o.to(acc.dtype) * torch.exp(lse - ref).unsqueeze(-1))
        self.lse[..., row:end] = new

    def result(self):
        lse = self.lse.masked_fill(self.lse == float("-inf"), 0.0)
        return self.out.to(self.dtype), lse.to(self.lse_dtype)


def _forward_block(op, merge, ql, kb, vb, rows, keys, causal, scale, mask=None) -> None:
    """This rank's query rows (``ql``, at the global positions ``rows``) attended to a key block
    (``kb``, ``vb`` at ``keys``), both as runs (:func:`_runs`); ``mask``: this rank's mask (all
    query rows and keys, see :func:`_local_mask`; only with single runs) or None."""
    for r0, r1, k0, k1, c in _calls(rows, keys, causal):
        if mask is None:
            o, lse = op(ql[..., r0:r1, :], kb[..., k0:k1, :], vb[..., k0:k1, :], 0.0, c, scale=scale)
        else:
            mb = _mask_block(mask, _positions(rows, r0, r1, mask.device), _positions(keys, k0, k1, mask.device))
            o, lse = op(ql[..., r0:r1, :], kb[..., k0:k1, :], vb[..., k0:k1, :], 0.0, c, attn_mask=mb, scale=scale)
            dead = _dead_rows(mb)
            o, lse = o.masked_fill(dead.unsqueeze(-1), 0.0), lse.masked_fill(dead, float("-inf"))
        merge.add(r0, o, lse)


def _backward_block(op, grads, gl, ql, kb, vb, outl, lsel, rows, keys, causal, scale, mask=None):
    """The gradients of this rank's rows against a key block (runs as in
    :func:`_forward_block`): the kernel's backward with the GLOBAL output and log-sum-exp (each
    block's slice of the full softmax; a masked entry's probability ``exp(-inf - lse)`` is 0),
    added into ``grads = (dq, dk_block, dv_block)``."""
    dq, dk, dv = grads
    for r0, r1, k0, k1, c in _calls(rows, keys, causal):
        extra = {}
        if mask is not None:
            extra = {"attn_mask": _mask_block(mask, _positions(rows, r0, r1, mask.device),
                                              _positions(keys, k0, k1, mask.device))}
        gq, gk, gv = op(gl[..., r0:r1, :], ql[..., r0:r1, :], kb[..., k0:k1, :], vb[..., k0:k1, :],
                        outl[..., r0:r1, :], lsel[..., r0:r1], 0.0, c, scale=scale, **extra)
        dq[..., r0:r1, :].add_(gq)
        dk[..., k0:k1, :].add_(gk)
        dv[..., k0:k1, :].add_(gv)


def _chunks(t, mesh_dim: int) -> list[tuple]:
    """Every rank's runs (:func:`_runs`) of ``t``'s sequence along ``mesh_dim`` (the ranks that
    share this rank's other coordinates), from metadata."""
    return [_runs(t, mesh_dim, r) for r in range(t._spec.mesh_shape[mesh_dim])]


def _chunk_ranges(t, mesh_dim: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of every rank's chunk of a plain ``Shard`` sequence along ``mesh_dim``."""
    out = []
    for runs in _chunks(t, mesh_dim):
        out.append((runs[0][0], runs[-1][1]) if runs else (0, 0))
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
    outs[(me - 1) % n] = sum(math.prod(sh) for sh in shapes)
    with C.in_flight(graph=True):
        buf = C.all_to_all(flat, outs, ins, mesh, mesh_dim)
    return buf, shapes


def _arrived(pending):
    """The tensors of a :func:`_shift`, waited on."""
    buf, shapes = pending
    buf = C.wait_in_graph(buf)  # eagerly the in-flight tensor's wait, compiled the graph's
    out, off = [], 0
    for sh in shapes:
        out.append(buf[off:off + math.prod(sh)].view(sh))
        off += math.prod(sh)
    return out


# --- attention masks -------------------------------------------------------------------------


def _whole_mask(mask, q, k, is_causal):
    """The plain tensor of an attention mask every rank holds whole and identical (a plain
    tensor, or a DTensor replicated on every dim of q's mesh: its local tensor), in q's dtype
    (``F.scaled_dot_product_attention`` has already turned a boolean mask into an additive one),
    2-D or 4-D, broadcasting to the scores ``(B, H, L, S)``; None when the call goes to the rule
    instead (a sharded or partial mask, one that needs a gradient, a mask with ``is_causal``)."""
    if is_causal or mask.requires_grad:
        return None
    if type(mask) is DTensor:
        spec = mask._spec
        if spec.extra is not None or not same_mesh(spec.mesh, q._spec.mesh) \
                or any(type(p) is not Replicate for p in spec.placements):
            return None
        mask = mask._local_tensor
    elif not isinstance(mask, torch.Tensor) or isinstance(mask, DTensor) or not _plain_or_traced(mask):
        return None
    if mask.dtype != q.dtype or mask.dim() not in (2, 4) or mask.dim() > q.dim():
        return None  # the kernel's own error, on the rule's path
    scores = tuple(q.shape[:-1]) + (k.shape[-2],)
    for m, s in zip(reversed(mask.shape), reversed(scores)):
        if m not in (1, s):
            return None
    return mask


def _plain_or_traced(t) -> bool:
    """A plain tensor, or a tracing stand-in for one (fake or functional: torch.compile)."""
    return type(t) is torch.Tensor or is_fake(t) or torch._is_functional_tensor(t)


#: the dispatch modes under which a tensor's values cannot be read or must not be: fake tensors
#: (no data), a tracer that records ops (a table read from the values would be baked into its
#: graph), functionalization (a tracer's too)
_TRACING_KEYS = tuple(getattr(torch._C._TorchDispatchModeKey, k) for k in ("FAKE", "PROXY", "FUNCTIONAL"))
_TRACING_MODES = (FakeTensorMode, ProxyTorchDispatchMode, FunctionalTensorMode)


def values_readable(t) -> bool:
    """Can ``t``'s values be read now, and the plan depend on them?  Not for a tensor with no
    data (fake, meta), a functional or symbolic-shaped one, nor while anything traces
    (torch.compile, or a fake / proxy / functionalization mode anywhere on the mode stack).  Any
    other dispatch mode (CommDebugMode, FlopCounterMode, a user's counter that defers to tensor
    subclasses) watches a run without changing it: the same plan, the same collectives.  Read the
    values inside :func:`unwatched` so that such a mode does not see the reading either."""
    if type(t) is not torch.Tensor or t.device.type == "meta" or is_fake(t) or torch._is_functional_tensor(t):
        return False
    if torch.compiler.is_compiling() or any(isinstance(s, torch.SymInt) for s in t.shape):
        return False
    if any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_KEYS):
        return False
    return not any(isinstance(m, _TRACING_MODES) for m in _get_current_dispatch_mode_stack())


def _explain_two_dims(op, q, k, how, dims) -> None:
    """``dtshard.debug.explain`` for the sequence on two mesh dims."""
    n1, h = q._spec.mesh_shape[dims[1]], q.dim() - 3
    if how == "flat":
        text = (f"allgather_kv over mesh dims {dims} (the sequence on both; {k.shape[h]} KV heads do not "
                f"divide the inner dim's {n1} ranks, so a Ulysses step would replicate them: K and V "
                f"gathered once over both dims instead), q {tuple(q.shape)} {tuple(q._spec.placements)}")
    else:
        text = (f"ulysses on mesh dim {dims[1]} (the inner of the two sequence dims: {q.shape[h]} query and "
                f"{k.shape[h]} KV heads over its {n1} ranks), then the call on mesh dim {dims[0]} alone "
                f"(its own choice below), q {tuple(q.shape)} {tuple(q._spec.placements)}")
    for obs in _trace.plan_observers:
        obs(str(op), _Decision(op, text), None)


def _tracing() -> bool:
    """Is a graph being traced (torch.compile, or a fake / proxy / functionalization mode)?"""
    if torch.compiler.is_compiling() or any(torch._C._get_dispatch_mode(key) is not None for key in _TRACING_KEYS):
        return True
    return any(isinstance(m, _TRACING_MODES) for m in _get_current_dispatch_mode_stack())


def unwatched():
    """The dispatch modes off (a reading of values that the plan depends on: an observer's
    counts must be those of a run without it).  Only after :func:`values_readable`, so no
    tracing mode is among them."""
    return _disable_current_modes()


_readable = values_readable


def _local_mask(mask, q, mesh_dim: int):
    """The mask's part for this rank's leading dims (batch, heads) where another mesh dim shards
    them; the query and key dims stay whole."""
    spec = q._spec
    if all(type(p) is not Shard or i == mesh_dim for i, p in enumerate(spec.placements)):
        return mask
    shape, offset = spec.local_shape_and_offset(C.mesh_coordinate(spec.mesh))
    lead = q.dim() - mask.dim()
    for d in range(q.dim() - 2):
        md = d - lead
        if md >= 0 and mask.shape[md] != 1 and shape[d] != q.shape[d]:
            mask = mask.narrow(md, offset[d], shape[d])
    return mask


def _positions(runs, a: int, b: int, device):
    """The global positions of local indices ``[a, b)`` of a layout's runs (:func:`_runs`): a
    ``(lo, hi)`` range when they are contiguous (a plain ``Shard``), else an index tensor."""
    out, pos = [], 0
    for lo, hi in runs:
        s, e = max(a - pos, 0), min(b - pos, hi - lo)
        if s < e:
            out.append((lo + s, lo + e))
        pos += hi - lo
    if len(out) <= 1:
        return out[0] if out else (0, 0)
    return torch.cat([torch.arange(lo, hi, device=device) for lo, hi in out])


def _mask_block(mask, rows, keys):
    """The mask for the query rows ``rows`` and the keys ``keys`` (each a ``(lo, hi)`` range or an
    index tensor of global positions), size-1 (broadcast) dims kept."""
    if mask.shape[-2] != 1:
        mask = mask[..., rows[0]:rows[1], :] if isinstance(rows, tuple) else mask.index_select(-2, rows)
    if mask.shape[-1] != 1:
        mask = mask[..., keys[0]:keys[1]] if isinstance(keys, tuple) else mask.index_select(-1, keys)
    return mask


def _dead_rows(mask_block):
    """Rows with no key left in this block (every entry ``-inf``): the kernel returns output 0 and
    log-sum-exp 0 for them (as one process does for a row masked everywhere), which merged with
    the other blocks would count as weight ``exp(0)``; they are given ``-inf`` instead."""
    return (mask_block == float("-inf")).all(-1)


class _MaskTable:
    """Which key rows each rank's query chunk attends to, from the whole mask: ``need[r]`` holds
    the global key indices (sorted) that some query row of rank ``r`` (any batch, any head)
    leaves unmasked (``!= -inf``).  Every rank computes the same table from the same mask, so
    the all_to_all sizes it gives agree on every rank without a message."""

    def __init__(self, mask, q_chunks, k_chunks, n_keys: int):
        self.n = len(q_chunks)
        starts = torch.tensor([a for a, _ in k_chunks])
        stops = torch.tensor([b for _, b in k_chunks])
        self.need, self.counts = [], []  # counts[r][j]: keys rank r needs from owner j
        for a, b in q_chunks:
            part = mask if mask.shape[-2] == 1 else mask[..., a:b, :]
            if b <= a or part.numel() == 0:
                alive = torch.zeros(n_keys, dtype=torch.bool)
            else:
                alive = (part != float("-inf")).reshape(-1, part.shape[-1]).any(0)
                if alive.numel() == 1:
                    alive = alive.expand(n_keys)
            idx = alive.nonzero().flatten()
            self.need.append(idx)
            lo, hi = torch.searchsorted(idx, starts).tolist(), torch.searchsorted(idx, stops).tolist()
            self.counts.append([max(h - l, 0) for l, h in zip(lo, hi)])
        self.k_chunks = list(k_chunks)
        self.max_received = max(sum(c) - c[r] for r, c in enumerate(self.counts))
        self.max_held = max(sum(c) for c in self.counts)
        self._plans: dict = {}

    def plan(self, me: int):
        """This rank's exchange: ``(send_idx, send_counts, recv_idx, recv_counts)``: the local
        key rows it sends (to rank 0, 1, ... in turn, as one index), how many to each rank, the
        global keys it receives (global key order, owner by owner), how many from each owner."""
        hit = self._plans.get(me)
        if hit is None:
            with unwatched():
                return self._plan(me)
        return hit

    def _plan(self, me: int):
        hit = self._plans.get(me)
        if hit is None:
            a = self.k_chunks[me][0]
            sends, send_counts = [], []
            for r in range(self.n):
                lo = int(torch.searchsorted(self.need[r], a)) if self.counts[r][me] else 0
                sends.append(self.need[r][lo:lo + self.counts[r][me]] - a)
                send_counts.append(self.counts[r][me])
            hit = self._plans[me] = (torch.cat(sends), send_counts, self.need[me], list(self.counts[me]))
        return hit


_MASK_TABLES: OrderedDict = OrderedDict()
_MASK_TABLES_MAX = 8
#: table computations (misses) and reuses (hits) since import: a mask is read once while it lives
#: unchanged (keyed by the tensor's identity and version counter)
mask_table_stats = {"misses": 0, "hits": 0}


def _mask_table(mask, q, k, mesh_dim: int) -> _MaskTable:
    """The table of ``mask`` for this call's chunks, computed once per mask: cached by the
    tensor's identity (a weak reference, so a dead mask's id reused by a new one never hits),
    version counter (an in-place write reads it again), storage and layout, and the chunks."""
    q_chunks, k_chunks = tuple(_chunk_ranges(q, mesh_dim)), tuple(_chunk_ranges(k, mesh_dim))
    key = (id(mask), mask._version, mask.data_ptr(), tuple(mask.shape), tuple(mask.stride()), q_chunks, k_chunks)
    hit = _MASK_TABLES.get(key)
    if hit is not None and hit[0]() is mask:
        _MASK_TABLES.move_to_end(key)
        mask_table_stats["hits"] += 1
        return hit[1]
    mask_table_stats["misses"] += 1
    with unwatched():  # (an observer sees the run, not the planning)
        table = _MaskTable(mask, q_chunks, k_chunks, k.shape[-2])
    _MASK_TABLES[key] = (weakref.ref(mask), table)
    while len(_MASK_TABLES) > _MASK_TABLES_MAX:
        _MASK_TABLES.popitem(last=False)
    return table


def _check_mask_agreement(op, mask, q) -> None:
    """``config.attention_cp_check_masks``: raise unless every rank of q's mesh holds the same
    mask (a digest of its bytes, one all_gather_object over the mesh)."""
    with unwatched():
        m = mask.contiguous()
        digest = hashlib.blake2b(m.reshape(-1).view(torch.uint8).numpy().tobytes(), digest_size=16).hexdigest()
    got = C.all_gather_object_mesh((tuple(m.shape), str(m.dtype), digest), q._spec.mesh)
    if len(set(got)) > 1:
        raise ValueError(
            f"{op}: the attention mask {tuple(mask.shape)} differs between the ranks of mesh "
            f"{tuple(q._spec.mesh.shape)} (q {tuple(q.shape)}, placements {tuple(q._spec.placements)}); "
            "context parallelism needs the same whole mask on every rank")


def _exchange_rows(x, send_idx, send_counts, recv_counts, mesh, mesh_dim: int):
    """Rows ``send_idx`` of ``x`` (the sequence dim, -2) to their ranks, and the rows from each
    owner back, as ONE all_to_all: returns the received rows, sequence at -2."""
    rows = x.movedim(-2, 0).index_select(0, send_idx)
    got = C.all_to_all(rows, recv_counts, send_counts, mesh, mesh_dim)
    return got.movedim(0, -2)


@register_handler([_FWD, *CUDA_FWD], before_rule=True)
def sdpa_context_parallel(op, args, kwargs):
    """Forward attention on sequence-sharded q, k, v (see the module docstring)."""
    fam = _FAMILIES[op]
    b = fam.bind(op, args, kwargs)
    q, k, v, dropout_p, is_causal = b["query"], b["key"], b["value"], b["dropout_p"], b["is_causal"]
    attn_mask, scale, kern = b.get(fam.mask_name), b["scale"], fam.kernel
    if not fam.takes(b, q):
        return planned(op, args, kwargs)
    two = _two_dims_plan(q, k, v, dropout_p, attn_mask)
    if two is not None:
        how, usp = two
        if _trace.plan_observers:
            _explain_two_dims(op, q, k, how, usp)
        with op_context(op):
            if how == "flat":
                o, lse = _flat_forward(kern, q, k, v, usp, bool(is_causal), scale)
                out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
                o = wrap(o, _spec_like(q, q._spec.placements, out_shape))
                lse = wrap(lse, _spec_like(q, q._spec.placements, out_shape[:-1], lse.dtype))
                return fam.outputs(op, args, kwargs, o, lse)
            o, lse = kern(*_to_heads(usp, q, k, v), 0.0, bool(is_causal), scale=scale)  # one sequence dim left
            o, lse = (_from_heads(t, q._spec.placements) for t in (o, lse))
            return fam.outputs(op, args, kwargs, o, lse)
    i = _seq_mesh_dim(q, k, v) if not dropout_p else None
    i, mask = _with_mask(op, i, attn_mask, q, k, is_causal)
    strategy = None if i is None else _choose(op, q, k, v, i, mask, bool(is_causal))
    if strategy is None:
        return planned(op, *_replicated_mask(op, args, kwargs, fam.mask_name, mask, q))
    placements, causal = q._spec.placements, bool(is_causal)
    out_shape = tuple(q.shape[:-1]) + (v.shape[-1],)
    lse_dtype = _lse_dtype(q.dtype)
    ml = None if mask is None else _local_mask(mask, q, i)
    with op_context(op):
        if strategy == "ulysses":
            heads = _with(placements, i, Shard(q.dim() - 3))
            extra = {} if ml is None else {"attn_mask": _heads_mask(ml, q, i)}
            o, lse = kern(to_local(q, heads), to_local(k, heads), to_local(v, heads), 0.0, causal, scale=scale, **extra)
            o = to_local(wrap(o, _spec_like(q, heads, out_shape)), placements)
            lse = to_local(wrap(lse, _spec_like(q, heads, out_shape[:-1], lse.dtype)), placements)
        elif strategy == "mask_kv":
            o, lse = _mask_kv_forward(kern, q, k, v, mask, ml, i, scale, lse_dtype)
        elif strategy == "balanced":
            o, lse = _balanced_forward(kern, q, k, v, i, scale, lse_dtype)
        else:
            ql = q._local_tensor
            rows = _runs(q, i)
            merge = _Merge(ql, v.shape[-1], lse_dtype)
            if strategy == "allgather_kv":
                full = _with(placements, i, Replicate())
                kl, vl = to_local(k, full), to_local(v, full)
                _forward_block(kern, merge, ql, kl, vl, rows, ((0, k.shape[-2]),), causal, scale, ml)
                received = (kl, vl)
            else:
                received = _ring_forward(kern, merge, q, k, v, i, rows, causal, scale, ml)
            o, lse = merge.result()
            # (compiled: a rank with no query row computes nothing with what it received; the
            # exchanges stay in its graph all the same)
            o = C.consumed(o, *received)
        return fam.outputs(op, args, kwargs, wrap(o, _spec_like(q, placements, out_shape)),
                           wrap(lse, _spec_like(q, placements, out_shape[:-1], lse.dtype)))


def _choose(op, q, k, v, i, mask, causal):
    """:func:`choose_strategy`, told to ``dtshard.debug.explain`` when it listens."""
    strategy, why, ests = _decide(q, k, v, i, mask, causal)
    if strategy is not None and _trace.plan_observers:
        _explain(op, q, i, strategy, why, ests)
    return strategy


def _acc_dtype(dtype):
    """The dtype rows travel in when tensors of ``dtype`` and a float32/float64 log-sum-exp go
    together: a widening, so the values arrive exactly."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _send_rows(x, plan, me, mesh, i, back: bool = False):
    """balanced's one all_to_all: ``x`` (rows at dim -2) from each busy rank to its partner, or with
    ``back`` from the partner to the busy rank (the counts reversed); returns the received rows,
    dim -2."""
    send, recv = plan.counts(me)
    if back:
        send, recv = recv, send
    got = C.all_to_all(x.movedim(-2, 0).contiguous(), recv, send, mesh, i)
    return got.movedim(0, -2)


def _balanced_forward(kern, q, k, v, i, scale, lse_dtype):
    """balanced (:class:`_Balance`): K and V gathered as allgather_kv; a busy rank attends all but
    its last ``m`` rows, its partner those rows (sent over, whole rows against every key), whose
    output and log-sum-exp come back; nothing moves when the plan moves no row."""
    full = _with(q._spec.placements, i, Replicate())
    kl, vl = to_local(k, full), to_local(v, full)
    ql = q._local_tensor
    mesh, me = q._spec.mesh, C.mesh_coordinate(q._spec.mesh)[i]
    plan = _balance(q, k, i, True)
    keys = ((0, k.shape[-2]),)
    (a, b), = _runs(q, i) or ((0, 0),)
    m_out, m_in, partner, src = plan.role(me)
    merge = _Merge(ql, v.shape[-1], lse_dtype)
    acc = _acc_dtype(ql.dtype)
    if plan.moves:
        theirs = _send_rows(ql[..., ql.shape[-2] - m_out:, :], plan, me, mesh, i)  # (m_in rows)
    _forward_block(kern, merge, ql[..., :ql.shape[-2] - m_out, :], kl, vl, ((a, b - m_out),), keys, True, scale)
    if not plan.moves:
        return merge.result()
    ev = v.shape[-1]
    if m_in:
        sb = _runs(q, i, partner)[0][1]  # the busy partner's rows [sb - m_in, sb)
        theirs_merge = _Merge(theirs, ev, lse_dtype)
        _forward_block(kern, theirs_merge, theirs, kl, vl, ((sb - m_in, sb),), keys, True, scale)
        to, tl = theirs_merge.out, theirs_merge.lse
        packed = torch.cat([to.to(acc), tl.to(acc).unsqueeze(-1)], -1)
    else:
        packed = ql.new_zeros(tuple(ql.shape[:-2]) + (0, ev + 1), dtype=acc)
    back = _send_rows(packed, plan, me, mesh, i, back=True)  # (m_out rows)
    if m_out:
        c = ql.shape[-2]
        merge.out[..., c - m_out:, :] = back[..., :ev].to(merge.out.dtype)
        merge.lse[..., c - m_out:] = back[..., ev].to(merge.lse.dtype)
    o, lse = merge.result()
    # (compiled: the exchange this rank receives nothing from stays in its graph)
    unread = [t for t, m in ((theirs, m_in), (back, m_out)) if not m]
    return C.consumed(o, *unread), lse


def _balanced_backward(kern, dq, dk, dv, local, kl, vl, q, k, i, scale):
    """The backward of :func:`_balanced_forward` (K and V already gathered, ``dk``/``dv`` the
    whole-size accumulators the caller reduce_scatters): the busy rank's last ``m`` rows' grad_out,
    q, out and log-sum-exp go to its partner, which adds their dK/dV into its accumulators and
    sends their dq back.  Returns ``dq`` (filled in)."""
    g, ql, outl, lsel = local
    mesh, me = q._spec.mesh, C.mesh_coordinate(q._spec.mesh)[i]
    plan = _balance(q, k, i, True)
    keys = ((0, k.shape[-2]),)
    (a, b), = _runs(q, i) or ((0, 0),)
    m_out, m_in, partner, _ = plan.role(me)
    c, e, ev = ql.shape[-2], ql.shape[-1], outl.shape[-1]
    acc = _acc_dtype(ql.dtype)
    if plan.moves:
        t = slice(c - m_out, c)
        packed = torch.cat([g[..., t, :].to(acc), ql[..., t, :].to(acc), outl[..., t, :].to(acc),
                            lsel[..., t].to(acc).unsqueeze(-1)], -1)
        theirs = _send_rows(packed, plan, me, mesh, i)
    h = slice(0, c - m_out)
    _backward_block(kern, (dq[..., h, :], dk, dv), g[..., h, :], ql[..., h, :], kl, vl, outl[..., h, :],
                    lsel[..., h], ((a, b - m_out),), keys, True, scale)
    if not plan.moves:
        return dq
    if m_in:
        sb = _runs(q, i, partner)[0][1]
        tg, tq = theirs[..., :ev].to(g.dtype), theirs[..., ev:ev + e].to(ql.dtype)
        to, tl = theirs[..., ev + e:ev + e + ev].to(outl.dtype), theirs[..., ev + e + ev].to(lsel.dtype)
        tdq = torch.zeros_like(tq)
        _backward_block(kern, (tdq, dk, dv), tg, tq, kl, vl, to, tl, ((sb - m_in, sb),), keys, True, scale)
    else:
        tdq = ql.new_zeros(tuple(ql.shape[:-2]) + (0, e))
    back = _send_rows(tdq, plan, me, mesh, i, back=True)
    if m_out:
        dq[..., c - m_out:, :] = back
    return C.consumed(dq, *[t for t, m in ((theirs, m_in), (back, m_out)) if not m])


def _ring_forward(op, merge, q, k, v, i, rows, causal, scale, mask=None) -> list:
    """Pass K/V around the ring: at step ``t`` this rank holds the block of rank ``me - t`` and
    computes with it while the next block travels (issued before the compute, waited after).
    Returns the blocks received (for :func:`collectives.consumed`)."""
    n, me = q._spec.mesh_shape[i], C.mesh_coordinate(q._spec.mesh)[i]
    chunks = _chunks(k, i)
    blocks = [k._local_tensor, v._local_tensor]
    received = []
    for t in range(n):
        src = (me - t) % n
        pending = None
        if t < n - 1:
            pending = _shift(blocks, _length(chunks[(me - t - 1) % n]), q._spec.mesh, i, n, me)
        _forward_block(op, merge, q._local_tensor, blocks[0], blocks[1], rows, chunks[src], causal, scale, mask)
        if pending is not None:
            blocks = _arrived(pending)
            received += blocks
    return received


def _lse_dtype(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


@register_handler([_BWD, *CUDA_BWD], before_rule=True)
def sdpa_context_parallel_backward(op, args, kwargs):
    """Backward of :func:`sdpa_context_parallel` (chooses its strategy again; each is exact)."""
    fam = _FAMILIES[op]
    b = fam.bind(op, args, kwargs)
    g = b["grad_out"] if "grad_out" in b else b["grad_out_"]
    q, k, v, out, lse = b["query"], b["key"], b["value"], b["out"], b["logsumexp"]
    if type(g) is DTensor and type(q) is DTensor and same_mesh(g._spec.mesh, q._spec.mesh) and g._spec.extra is None \
            and g._spec.placements != q._spec.placements and all(type(p) is Replicate for p in g._spec.placements):
        g = wrap(to_local(g, q._spec.placements), _spec_like(g, q._spec.placements))  # (loss.sum(): a slice)
    dropout_p, is_causal, attn_mask, scale = b["dropout_p"], b["is_causal"], b.get(fam.mask_name), b["scale"]
    wanted = b.get("grad_input_mask")
    if attn_mask is not None and wanted is not None and wanted[3]:
        return planned(op, args, kwargs)  # the bias's own gradient: the rule's path
    lse = _lse_rows(lse, q)
    if lse is None:
        return planned(op, args, kwargs)
    kern = fam.backward
    n_out = len(op._schema.returns)
    two = _two_dims_plan(q, k, v, dropout_p, attn_mask)
    if two is not None and all(type(t) is DTensor and t._spec.placements == q._spec.placements
                               and same_mesh(t._spec.mesh, q._spec.mesh) and t._spec.extra is None for t in (g, out, lse)):
        how, usp = two
        with op_context(op):
            if how == "flat":
                dq, dk, dv = _flat_backward(kern, g, q, k, v, out, lse, usp, bool(is_causal), scale)
                return (wrap(dq, _spec_like(q, q._spec.placements)), wrap(dk, _spec_like(k, k._spec.placements)),
                        wrap(dv, _spec_like(v, v._spec.placements))) + (None,) * (n_out - 3)
            grads = kern(*_to_heads(usp, g, q, k, v, out, lse), 0.0, bool(is_causal), scale=scale)
            return tuple(_from_heads(t, q._spec.placements) for t in grads) + (None,) * (n_out - 3)
    i = _seq_mesh_dim(q, k, v) if not dropout_p else None
    if i is not None and not all(type(t) is DTensor and t._spec.placements == q._spec.placements
                                 and same_mesh(t._spec.mesh, q._spec.mesh) and t._spec.extra is None for t in (g, out, lse)):
        i = None
    i, mask = _with_mask(op, i, attn_mask, q, k, is_causal)
    strategy = None if i is None else _choose(op, q, k, v, i, mask, bool(is_causal))
    if strategy is None:
        return planned(op, *_replicated_mask(op, args, kwargs, fam.mask_name, mask, q))
    placements, causal = q._spec.placements, bool(is_causal)
    ml = None if mask is None else _local_mask(mask, q, i)
    with op_context(op):
        if strategy == "ulysses":
            heads = _with(placements, i, Shard(q.dim() - 3))
            extra = {} if ml is None else {"attn_mask": _heads_mask(ml, q, i)}
            gq, gk, gv = kern(*(to_local(t, heads) for t in (g, q, k, v, out, lse)), 0.0, causal, scale=scale, **extra)
            return tuple(wrap(to_local(wrap(x, _spec_like(t, heads)), placements), _spec_like(t, placements))
                         for x, t in ((gq, q), (gk, k), (gv, v))) + (None,) * (n_out - 3)
        if strategy == "mask_kv":
            dq, dk, dv = _mask_kv_backward(kern, g, q, k, v, out, lse, mask, ml, i, scale)
            return (wrap(dq, _spec_like(q, placements)), wrap(dk, _spec_like(k, placements)),
                    wrap(dv, _spec_like(v, placements))) + (None,) * (n_out - 3)
        rows = _runs(q, i)
        local = [t._local_tensor for t in (g, q, out, lse)]
        dq = torch.zeros_like(q._local_tensor)
        if strategy in ("allgather_kv", "balanced"):
            full = _with(placements, i, Replicate())
            kl, vl = to_local(k, full), to_local(v, full)
            dk, dv = torch.zeros_like(kl), torch.zeros_like(vl)
            if strategy == "balanced":
                dq = _balanced_backward(kern, dq, dk, dv, local, kl, vl, q, k, i, scale)
            else:
                _backward_block(kern, (dq, dk, dv), local[0], local[1], kl, vl, local[2], local[3], rows,
                                ((0, k.shape[-2]),), causal, scale, ml)
            partial = _with(placements, i, Partial("sum"))
            dk = to_local(wrap(dk, _spec_like(k, partial)), placements)  # one reduce_scatter each
            dv = to_local(wrap(dv, _spec_like(v, partial)), placements)
            dq = C.consumed(dq, kl, vl)  # (compiled: a rank with no row computes nothing with them)
        else:
            dk, dv = _ring_backward(kern, dq, local, k, v, i, rows, causal, scale, ml)
        return (wrap(dq, _spec_like(q, placements)), wrap(dk, _spec_like(k, placements)),
                wrap(dv, _spec_like(v, placements))) + (None,) * (n_out - 3)


def _lse_rows(lse, q):
    """The backward's log-sum-exp DTensor as ``(..., L)`` rows: cuDNN's trailing dim of 1 taken
    off; None when it does not line up with the query rows (efficient's padding of a sequence
    that is not a multiple of 32: the forward went to the rule)."""
    if type(lse) is not DTensor or lse._spec.extra is not None:
        return lse
    if lse.dim() == q.dim() and lse.shape[-1] == 1:
        return wrap(lse._local_tensor.squeeze(-1), _spec_like(lse, lse._spec.placements, lse.shape[:-1]))
    if lse.shape[-1] != q.shape[-2]:
        return None
    return lse


def _ring_backward(op, dq, local, k, v, i, rows, causal, scale, mask=None):
    """K/V travel the ring as in the forward, each with its gradient accumulator, which every
    rank adds its rows' contribution to; after the last step one more shift takes each
    accumulator home.  Returns this rank's ``(dk, dv)``."""
    n, me = k._spec.mesh_shape[i], C.mesh_coordinate(k._spec.mesh)[i]
    chunks = _chunks(k, i)
    kb, vb = k._local_tensor, v._local_tensor
    dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)
    g, ql, outl, lsel = local
    received = []
    for t in range(n):
        src = (me - t) % n
        pending = None
        if t < n - 1:
            pending = _shift([kb, vb], _length(chunks[(me - t - 1) % n]), k._spec.mesh, i, n, me)
        _backward_block(op, (dq, dk, dv), g, ql, kb, vb, outl, lsel, rows, chunks[src], causal, scale, mask)
        # the accumulators follow their blocks (the last shift takes them to their owners)
        grads = _arrived(_shift([dk, dv], _length(chunks[(me - t - 1) % n]), k._spec.mesh, i, n, me))
        if pending is not None:
            kb, vb = _arrived(pending)
            received += [kb, vb]
        dk, dv = grads
    return C.consumed(dk, *received), dv  # (compiled: blocks a rank with no row never reads)


def _to_heads(usp, *ts):
    """Ulysses on the inner of the two sequence mesh dims: each tensor's shards of that dim move
    from the sequence to the heads (one all_to_all each; q, k, v, out, lse have their heads at
    dim ``-3`` or, for the 3-D log-sum-exp, ``-2``), as DTensors the single-dim strategies take."""
    i0, i1 = usp
    out = []
    for t in ts:
        heads = t.dim() - 3 if t.dim() >= 4 else t.dim() - 2
        target = _with(t._spec.placements, i1, Shard(heads))
        out.append(wrap(to_local(t, target), _spec_like(t, target)))
    return out


def _from_heads(t, placements):
    """The inverse of :func:`_to_heads` for one result: back to the sequence on both mesh dims."""
    return wrap(to_local(t, placements), _spec_like(t, placements))


def _with_mask(op, i, attn_mask, q, k, is_causal):
    """``(mesh dim, whole mask)`` for the call: the mesh dim kept when there is no mask or the
    mask is one every strategy takes (:func:`_whole_mask`), else None (the rule's path)."""
    if i is None or attn_mask is None:
        return i, None
    mask = _whole_mask(attn_mask, q, k, is_causal)
    if mask is None:
        return None, None
    if config.attention_cp_check_masks and _readable(mask):
        _check_mask_agreement(op, mask, q)
    return i, mask


def _replicated_mask(op, args, kwargs, name, mask, q) -> tuple:
    """``(args, kwargs)`` for the rule's path of a call whose plain-tensor mask (argument ``name``)
    context parallelism took as whole and identical on every rank (none of its strategies
    applies): the same tensor as a Replicate DTensor (no communication), so the rule shards it
    along with the queries."""
    if mask is None:
        return args, kwargs
    m = bind(op, args, kwargs)[op_facts(op).names.index(name)]
    if m is None or isinstance(m, DTensor):
        return args, kwargs
    mesh = q._spec.mesh
    return _with_arg(op, args, kwargs, name,
                     wrap(mask, make_spec(mesh, (Replicate(),) * mesh.ndim, mask.shape, mask.dtype)))


def _heads_mask(ml, q, i):
    """Ulysses: the mask for this rank's chunk of query heads (when it has a heads dim of H)."""
    if ml.dim() < 4 or ml.shape[-3] == 1:
        return ml
    n, me = q._spec.mesh_shape[i], C.mesh_coordinate(q._spec.mesh)[i]
    h = q.shape[-3] // n
    return ml.narrow(-3, me * h, h)


def _mask_kv_exchange(k, v, table, i):
    """mask_kv: the key rows this rank's queries need, from their owners, as ONE all_to_all of K
    and V together (their own heads).  Returns ``(kr, vr, plan)``."""
    me = C.mesh_coordinate(k._spec.mesh)[i]
    plan = send_idx, send_counts, recv_idx, recv_counts = table.plan(me)
    kl, vl = k._local_tensor, v._local_tensor
    if table.max_held == 0:  # no rank needs any key (every rank knows it from the same table)
        empty = tuple(kl.shape[:-2]) + (0,)
        return kl.new_zeros(empty + (kl.shape[-1],)), vl.new_zeros(empty + (vl.shape[-1],)), plan
    kv = _exchange_rows(torch.cat([kl, vl], -1), send_idx, send_counts, recv_counts, k._spec.mesh, i)
    e = kl.shape[-1]
    return kv[..., :e].contiguous(), kv[..., e:].contiguous(), plan


def _mask_kv_forward(op, q, k, v, mask, ml, i, scale, lse_dtype):
    """This rank's rows attended to exactly the keys they need (one kernel call, the mask's
    columns of those keys in global key order); no query row, or no key for any of them: output 0
    and log-sum-exp 0, what one process gives rows masked everywhere."""
    kr, vr, plan = _mask_kv_exchange(k, v, _mask_table(mask, q, k, i), i)
    ql = q._local_tensor
    start, stop = _rows(q, i)
    if stop > start and kr.shape[-2]:
        return op(ql, kr, vr, 0.0, False, attn_mask=_mask_block(ml, (start, stop), plan[2]), scale=scale)
    return ql.new_zeros(tuple(ql.shape[:-1]) + (vr.shape[-1],)), ql.new_zeros(tuple(ql.shape[:-1]), dtype=lse_dtype)


def _mask_kv_backward(op, g, q, k, v, out, lse, mask, ml, i, scale):
    """The forward's exchange again, the kernel's backward on the received keys, and dK/dV of
    those rows back to their owners (the reverse all_to_all), summed in with index_add."""
    table = _mask_table(mask, q, k, i)
    kr, vr, (send_idx, send_counts, recv_idx, recv_counts) = _mask_kv_exchange(k, v, table, i)
    ql, kl, vl = q._local_tensor, k._local_tensor, v._local_tensor
    start, stop = _rows(q, i)
    if stop > start and kr.shape[-2]:
        dq, gk, gv = op(g._local_tensor, ql, kr, vr, out._local_tensor, lse._local_tensor, 0.0, False,
                        attn_mask=_mask_block(ml, (start, stop), recv_idx), scale=scale)
    else:
        dq, gk, gv = torch.zeros_like(ql), torch.zeros_like(kr), torch.zeros_like(vr)
    if table.max_held == 0:
        return dq, torch.zeros_like(kl), torch.zeros_like(vl)
    back = C.all_to_all(torch.cat([gk, gv], -1).movedim(-2, 0).contiguous(), send_counts, recv_counts,
                        k._spec.mesh, i)
    dkv = back.new_zeros((kl.shape[-2],) + tuple(back.shape[1:])).index_add_(0, send_idx, back).movedim(0, -2)
    e = kl.shape[-1]
    return dq, dkv[..., :e].contiguous(), dkv[..., e:].contiguous()
