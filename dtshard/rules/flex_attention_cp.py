"""FlexAttention on DTensors: ``torch.nn.attention.flex_attention.flex_attention`` (forward).

``flex_attention`` is a HigherOrderOperator (``torch.ops.higher_order.flex_attention``), not an
aten op, so no rule or ``register_handler`` reaches it: this module registers the HOP's
implementation for :class:`dtshard.DTensor` (``flex_attention.py_impl(DTensor)``).  The public
function validates its arguments on the GLOBAL shapes and, even without ``torch.compile``, runs
the HOP through Dynamo with the ``eager`` backend; the HOP then calls :func:`flex_attention_dtensor`
with the DTensors, the ``score_mod``, the block mask as a tuple (``BlockMask.as_tuple()``) and the
tensors the mods capture (``*_other_buffers``).

**Context parallelism.**  When q, k and v are 4-D DTensors ``(B, H, L, E)`` on one mesh with the
same placements, the sequence (dim 2) ``Shard``-ed on one or more mesh dims and every other mesh
dim ``Replicate`` or sharding the batch (dim 0, equal in all three), each rank attends its own
query rows ``[start, stop)`` (global indices, from metadata) to the keys it needs, and the outputs
(``out``, the log-sum-exp, the max scores) keep q's placements: no merge of partial softmaxes is
needed, each row sees every key it needs in one kernel call.  K and V travel with their OWN heads
(grouped-query and multi-query attention never move repeated heads):

- without a block mask (or when every rank needs every key), K and V are all-gathered along the
  sequence mesh dims (``handlers.to_local``, through the planner);
- with a block mask, eagerly, each rank receives only the keys of the KV blocks its query blocks
  touch (``kv_num_blocks``/``kv_indices`` and ``full_kv_*`` of the global BlockMask at its query
  blocks, for its batch rows), in one ``all_to_all`` of K and V packed together.  This trusts the
  BlockMask's contract: a key in no listed block is masked (``create_block_mask``'s blocks cover
  its ``mask_mod``; torch's compiled kernels skip unlisted blocks, while its eager CPU path
  evaluates ``mask_mod`` everywhere).  A mask whose ``mask_mod`` is ``noop_mask``
  (``BlockMask.from_kv_blocks`` without one), where the two readings differ most, gathers whole.  The block mask
  is the same on every rank (a plain tensor structure made for the global lengths), so every
  rank computes every rank's needs and the splits agree.  While tracing (``torch.compile``, and
  Dynamo's metadata run of the eager call) the block mask's values are unknown and K/V are
  gathered whole.

The rank's local call sees GLOBAL indices: ``score_mod`` and ``mask_mod`` are wrapped so that
``b -> b + b0`` (the rank's first batch row), ``q_idx -> q_idx + start`` and ``kv_idx`` -> the
global index of the received key.  The local block mask is made again from the wrapped
``mask_mod`` on the local lengths with the global mask's ``BLOCK_SIZE``
(``create_block_mask`` pads lengths that are not multiples of it), over the rank's batch rows
when the global mask has one per batch row.  Tensors the mods capture arrive as the HOP's
``*_other_buffers``: plain tensors are taken to be the same on every rank (as the block mask
is); DTensor ones are replicated first.

Every other layout (different placements for q, k, v; Partial; heads or the embedding sharded;
strided shards) runs replicated: q, k and v are gathered whole, the HOP runs on them with the
mods unchanged, and the outputs are laid out as q (Replicate where q is Partial).

**Compiled.**  ``torch.compile(..., fullgraph=True)`` traces this implementation (checked with the
``aot_eager`` backend in the tests, and by hand with ``inductor`` in float32: inductor's CPU
FlexAttention takes float32/float16/bfloat16 only): K/V are gathered whole and the local block
mask is made in the graph.  While Dynamo traces the call (always, since ``flex_attention`` runs
through Dynamo even eagerly), the mods' example indices are 0-d DTensors (``query.new_empty``),
so a mod that indexes a captured PLAIN tensor (``doc_ids[q_idx]``) raises dtshard's
mixed-tensor error; write it with arithmetic on the indices, or call the HOP without Dynamo
(``torch.nn.attention.flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True``, the same
kernel on CPU).  Dynamo's metadata run of the HOP (fake tensors, nothing recording) gets the
output shapes without running anything.

**Forward only.**  torch 2.13 has no FlexAttention backward on CPU: ``flex_attention`` raises
"FlexAttention does not support backward on CPU" when an input requires grad.  The backward HOP
(``flex_attention_backward``), reached only by calling the HOP directly, raises here instead of
computing a per-rank gradient that would be silently wrong.
"""

from __future__ import annotations

import torch
from torch._higher_order_ops.flex_attention import flex_attention as flex_attention_hop
from torch._higher_order_ops.flex_attention import flex_attention_backward as flex_attention_backward_hop
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard
from torch.nn.attention.flex_attention import create_block_mask, noop_mask
from torch._subclasses.fake_tensor import is_fake

from dtshard import collectives as C
from dtshard.handlers import DTensor, make_spec, mixed_error, op_context, to_local, wrap
from dtshard.rules.attention_cp import unwatched, values_readable
from dtshard.spec import same_mesh

__all__ = ["flex_attention_dtensor", "needed_keys"]

_OP = "flex_attention"
_NO_MASK_BLOCK = 1 << 30  # the block size of flex_attention's "no block mask" (_LARGE_SPARSE_BLOCK_SIZE)
_TUPLE_LEN = 17  # BlockMask.as_tuple() in torch 2.13: 2 lengths, 12 tensors (or None), 2 block sizes, mask_mod


def _describe(*ts) -> str:
    return ", ".join(f"{tuple(t.shape)} {tuple(map(str, t._spec.placements))}" for t in ts)


def _layout(q, k, v) -> tuple[int, ...] | None:
    """The mesh dims that shard the sequence of q, k and v alike (possibly none), when the
    context-parallel path takes the call; None for the replicated fallback."""
    sq, sk, sv = q._spec, k._spec, v._spec
    if sq.extra is not None or sk.extra is not None or sv.extra is not None:
        return None
    if not (sq.placements == sk.placements == sv.placements):
        return None
    seq = []
    for i, p in enumerate(sq.placements):
        if type(p) is Shard and p.dim == 2:
            seq.append(i)
        elif type(p) is Shard and p.dim == 0:
            if not q.shape[0] == k.shape[0] == v.shape[0]:
                return None
        elif type(p) is not Replicate:
            return None  # Partial, strided, heads or embedding sharded: replicated
    return tuple(seq)


class _Mask:
    """The global BlockMask, from its tuple (``BlockMask.as_tuple()``)."""

    def __init__(self, t: tuple):
        if len(t) != _TUPLE_LEN:
            raise NotImplementedError(
                f"dtshard {_OP}: a block mask tuple of {len(t)} entries; this module reads torch 2.13's "
                f"BlockMask.as_tuple() ({_TUPLE_LEN} entries). Update dtshard/rules/flex_attention_cp.py for "
                "this torch version.")
        self.q_len, self.kv_len = t[0], t[1]
        self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices = t[2:6]
        self.q_block, self.kv_block = t[14], t[15]
        self.mask_mod = t[16]
        self.none = self.q_block == _NO_MASK_BLOCK and self.kv_block == _NO_MASK_BLOCK
        self.B, self.H = self.kv_num_blocks.shape[0], self.kv_num_blocks.shape[1]


def needed_keys(mask: _Mask, rows: list[tuple[int, int]], batch: tuple[int, int]) -> torch.Tensor:
    """``(len(rows), kv_len)`` bools: the keys that query rows ``rows[s] = [start, stop)`` of batch
    rows ``batch = [b0, b1)`` may attend to, from the block mask's KV blocks (partial and full)
    at the query blocks those rows touch, over every head.  Pure function of the block mask and
    metadata: the same on every rank."""
    need = torch.zeros(len(rows), mask.kv_len, dtype=torch.bool)
    bsel = slice(batch[0], batch[1]) if mask.B > 1 else slice(None)
    pairs = [(mask.kv_num_blocks, mask.kv_indices)]
    if mask.full_kv_num_blocks is not None:
        pairs.append((mask.full_kv_num_blocks, mask.full_kv_indices))
    kv_blocks = -(-mask.kv_len // mask.kv_block)
    for s, (a, b) in enumerate(rows):
        if b <= a:
            continue
        qs = slice(a // mask.q_block, (b - 1) // mask.q_block + 1)
        blocks = torch.zeros(kv_blocks + 1, dtype=torch.bool)
        for num, idx in pairs:
            num, idx = num[bsel, :, qs].cpu(), idx[bsel, :, qs].cpu()
            valid = torch.arange(idx.shape[-1]) < num.unsqueeze(-1)
            blocks[idx[valid].long().clamp(max=kv_blocks)] = True
        need[s] = blocks[:kv_blocks].repeat_interleave(mask.kv_block)[:mask.kv_len]
    return need


def _metadata_only(t: torch.Tensor) -> bool:
    """A run for output metadata only: fake tensors with nothing recording the ops (Dynamo runs
    the HOP node so, once per trace); any tracer that records ops has its proxy mode on."""
    return is_fake(t) and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is None


def _concrete(t: torch.Tensor) -> bool:
    """Real data at hand (nothing traces; an observing dispatch mode does not count, see
    ``attention_cp.values_readable``): the block mask's values may be read."""
    return values_readable(t)


def _chunks(t, mesh_dim: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of every rank's sequence chunk of ``t`` along ``mesh_dim`` (the ranks that
    share this rank's other coordinates), from metadata."""
    spec = t._spec
    coord = list(C.mesh_coordinate(spec.mesh))
    out = []
    for r in range(spec.mesh_shape[mesh_dim]):
        coord[mesh_dim] = r
        shape, offset = spec.local_shape_and_offset(coord)
        out.append((offset[2], offset[2] + shape[2]))
    return out


def _exchange(k, v, mesh_dim: int, need: torch.Tensor):
    """K and V rows this rank needs (``need[me]``), each rank sending the needed rows of its chunk,
    K and V packed in one all_to_all.  Returns local ``(k, v)`` holding the needed keys in global
    order, and their global indices."""
    mesh = k._spec.mesh
    me = C.mesh_coordinate(mesh)[mesh_dim]
    chunks = _chunks(k, mesh_dim)
    kl, vl = k._local_tensor, v._local_tensor
    b, hkv, _, e = kl.shape
    ev = vl.shape[-1]
    a0, a1 = chunks[me]
    rows = torch.cat([kl.permute(2, 0, 1, 3).reshape(a1 - a0, -1),
                      vl.permute(2, 0, 1, 3).reshape(a1 - a0, -1)], dim=1)
    send, ins, outs = [], [], []
    for s in range(len(chunks)):
        idx = need[s, a0:a1].nonzero().squeeze(1)
        send.append(rows.index_select(0, idx))
        ins.append(idx.numel())
        r0, r1 = chunks[s]
        outs.append(int(need[me, r0:r1].sum()))
    got = C.all_to_all(torch.cat(send), outs, ins, mesh, mesh_dim)
    n = got.shape[0]
    ko = got[:, :b * hkv * e].reshape(n, b, hkv, e).permute(1, 2, 0, 3)
    vo = got[:, b * hkv * e:].reshape(n, b, hkv, ev).permute(1, 2, 0, 3)
    return ko, vo, need[me].nonzero().squeeze(1)


def _buffers(bufs: tuple) -> tuple:
    """The mods' captured tensors: DTensors replicated, plain tensors as they are."""
    return tuple(to_local(t, [Replicate()] * t._spec.mesh.ndim) if isinstance(t, DTensor) else t for t in bufs)


def _local_mods(score_mod, mask_mod, b0: int, start: int, kv_map):
    """``score_mod`` and ``mask_mod`` of the local call, on global indices."""
    def kv(i):
        return i if kv_map is None else kv_map[i]

    def local_score(score, b, h, q_idx, kv_idx, *bufs):
        return score_mod(score, b + b0, h, q_idx + start, kv(kv_idx), *bufs)

    def local_mask(b, h, q_idx, kv_idx, *bufs):
        return mask_mod(b + b0, h, q_idx + start, kv(kv_idx), *bufs)

    return local_score, local_mask


def _empty(ql, vl, lq: int):
    """What the kernel gives rows that see no key (also for no rows): zeros, -inf statistics."""
    b, h = ql.shape[0], ql.shape[1]
    acc = torch.float64 if ql.dtype == torch.float64 else torch.float32
    lse = ql.new_full((b, h, lq), float("-inf"), dtype=acc)
    return ql.new_zeros((b, h, lq, vl.shape[-1])), lse, lse.clone()


def _outputs(q, v, placements, o, lse, mx):
    mesh, shape = q._spec.mesh, tuple(q.shape[:3])
    return (wrap(o.contiguous(), make_spec(mesh, placements, shape + (v.shape[-1],), o.dtype)),
            wrap(lse.contiguous(), make_spec(mesh, placements, shape, lse.dtype)),
            wrap(mx.contiguous(), make_spec(mesh, placements, shape, mx.dtype)))


@flex_attention_hop.py_impl(DTensor)
def flex_attention_dtensor(query, key, value, score_mod, block_mask, scale, kernel_options,
                           score_mod_other_buffers=(), mask_mod_other_buffers=()):
    """The flex_attention HOP on DTensors (see the module docstring)."""
    q, k, v = query, key, value
    for t in (q, k, v):
        if not isinstance(t, DTensor):
            raise mixed_error(_OP, t)
    if not (same_mesh(q._spec.mesh, k._spec.mesh) and same_mesh(q._spec.mesh, v._spec.mesh)):
        raise ValueError(
            f"dtshard {_OP}: query, key and value live on different meshes ({q._spec.mesh}, {k._spec.mesh}, "
            f"{v._spec.mesh}); shapes and placements {_describe(q, k, v)}. Redistribute them onto one mesh.")
    if q.dim() != 4:
        raise ValueError(f"dtshard {_OP}: expects 4-D (B, H, L, E) inputs, got {_describe(q, k, v)}")
    mesh = q._spec.mesh
    if not C.is_member(mesh):
        raise NotImplementedError(
            f"dtshard {_OP}: this rank is not part of the mesh {mesh} of query, key and value "
            f"({_describe(q, k, v)}); call flex_attention only on the mesh's ranks.")
    mask = _Mask(block_mask)
    with op_context(_OP):
        sbufs, mbufs = _buffers(score_mod_other_buffers), _buffers(mask_mod_other_buffers)
        seq = _layout(q, k, v)
        if seq is None:
            return _replicated(q, k, v, score_mod, block_mask, scale, kernel_options, sbufs, mbufs)
        placements = q._spec.placements
        shape, offset = q._spec.local_shape_and_offset(C.mesh_coordinate(mesh))
        b0, start, stop = offset[0], offset[2], offset[2] + shape[2]
        ql = q._local_tensor
        if _metadata_only(ql):  # the local outputs' shapes and dtypes, as the HOP's fake kernel gives them
            lse = ql.new_empty(tuple(ql.shape[:3]), dtype=torch.float32)
            return _outputs(q, v, placements, ql.new_empty(tuple(ql.shape[:3]) + (v.shape[-1],)), lse, lse)
        kv_map = None
        if seq and not mask.none and len(seq) == 1 and mask.mask_mod is not noop_mask and _concrete(ql):
            with unwatched():  # (an observer sees the run, not the planning)
                need = needed_keys(mask, _chunks(q, seq[0]), (b0, b0 + shape[0]))
            if not bool(need.all()):
                kl, vl, kv_map = _exchange(k, v, seq[0], need)
        if kv_map is None:
            full = tuple(Replicate() if i in seq else p for i, p in enumerate(placements))
            kl, vl = to_local(k, full), to_local(v, full)
        lq, lkv = ql.shape[2], kl.shape[2]
        if lq == 0 or lkv == 0:
            return _outputs(q, v, placements, *_empty(ql, vl, lq))
        local_score, local_mask = _local_mods(score_mod, mask.mask_mod, b0, start, kv_map)
        if mask.none:
            local_block = block_mask  # one block of any length: nothing to move
        else:
            bm = shape[0] if mask.B > 1 else 1
            cb = b0 if mask.B > 1 else 0  # a mask made for batch row 0 only: as it was made

            def create_mask(b, h, q_idx, kv_idx):
                return local_mask(b + cb - b0, h, q_idx, kv_idx, *mbufs)

            made = create_block_mask(create_mask, bm, mask.H, lq, lkv, device=ql.device,
                                     BLOCK_SIZE=(mask.q_block, mask.kv_block))
            local_block = made.as_tuple()[:-1] + (local_mask,)
        o, lse, mx = flex_attention_hop(ql, kl, vl, local_score, local_block, scale, kernel_options, sbufs, mbufs)
        return _outputs(q, v, placements, o, lse, mx)


def _replicated(q, k, v, score_mod, block_mask, scale, kernel_options, sbufs, mbufs):
    """Any other layout: q, k, v gathered whole, the HOP on them, the outputs laid out as q."""
    mesh = q._spec.mesh
    rep = (Replicate(),) * mesh.ndim
    ql, kl, vl = to_local(q, rep), to_local(k, rep), to_local(v, rep)
    o, lse, mx = flex_attention_hop(ql, kl, vl, score_mod, block_mask, scale, kernel_options, sbufs, mbufs)
    outs = _outputs(q, v, rep, o, lse, mx)
    target = tuple(Replicate() if isinstance(p, Partial) else p for p in q._spec.placements)
    if target == rep:
        return outs
    return tuple(wrap(to_local(t, target), make_spec(mesh, target, t.shape, t.dtype)) for t in outs)


@flex_attention_backward_hop.py_impl(DTensor)
def flex_attention_backward_dtensor(*args, **kwargs):
    """Not implemented: raise rather than compute a per-rank gradient that would be wrong."""
    raise NotImplementedError(
        f"dtshard {_OP}: the backward of flex_attention on DTensors is not implemented (torch 2.13 has no "
        "FlexAttention backward on CPU either). Run flex_attention on DTensors for inference, under "
        "torch.no_grad(), or use F.scaled_dot_product_attention (dtshard/rules/attention_cp.py), which "
        "has a sequence-sharded backward.")
