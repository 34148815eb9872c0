"""View-like ops: view/_unsafe_view, expand, transpose/t/permute, unsqueeze/squeeze, slice,
select, split, unbind.

A sharded dim survives a reshape only when it is the outermost non-trivial dim of its group of
merged/split dims (then every rank's data is one contiguous range of the new dim).  The dispatcher
checks every such claim against the op's meta kernel on each distinct local shape, so a split that
does not line up with the chunk layout (uneven shards) falls back to a correct plan instead of
being mislabelled.  All views pass Partial through unchanged (they only rearrange elements).
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor.placement_types import Partial, Shard, _StridedShard

from dtshard.registry import OpCall, register_handler, register_rule
from dtshard.rules._common import norm_dim
from dtshard.spec import TensorMeta, contiguous_strides

aten = torch.ops.aten
# views and rearrangements move elements (or fill zeros: a valid term of every reduction, 0 being
# absorbing for product), so every Partial passes through them
_PARTIALS = (Partial("sum"), Partial("avg"), Partial("max"), Partial("min"), Partial("product"))


def _partials(n_in: int = 1, n_out: int = 1):
    return [((p,) * n_out, (p,) * n_in) for p in _PARTIALS]


def _resolve_shape(shape, numel: int) -> list[int]:
    shape = list(shape)
    if -1 in shape:
        k = shape.index(-1)
        rest = 1
        for j, v in enumerate(shape):
            if j != k:
                rest *= v
        shape[k] = numel // rest if rest else 0
    return shape


def view_groups(src, dst) -> list[tuple[list[int], list[int]]]:
    """Group dims of ``src`` and ``dst`` with equal products (shapes without zeros)."""
    groups, i, j = [], 0, 0
    while i < len(src) or j < len(dst):
        ins, outs, pi, pj = [], [], 1, 1
        if i < len(src):
            ins.append(i)
            pi *= src[i]
            i += 1
        if j < len(dst):
            outs.append(j)
            pj *= dst[j]
            j += 1
        while pi != pj:
            if pi < pj and i < len(src):
                ins.append(i)
                pi *= src[i]
                i += 1
            elif j < len(dst):
                outs.append(j)
                pj *= dst[j]
                j += 1
            else:
                break
        groups.append((ins, outs))
    return groups


def view_or_copy(op, x, size):
    """The global tensor's strides decided that a view is possible; a rank's local strides (a
    size-1 or empty shard) may not allow it. Then copy, as reshape would."""
    try:
        return op(x, size)
    except (RuntimeError, ValueError):  # eager raises RuntimeError; fake tensors (compile) ValueError
        return aten._unsafe_view.default(x.contiguous(), size)


def _view_meta(call: OpCall):
    """The view's output metadata for a contiguous input (contiguous, the size's -1 resolved);
    None (the meta kernel decides, and raises its own error) for any other input or a size that
    does not fit."""
    x = call.tensors[0]
    size = call.arg(1, "size")
    if x.stride != contiguous_strides(x.shape) or not all(type(v) is int for v in size) \
            or sum(v == -1 for v in size) > 1 or any(v < -1 for v in size):
        return None
    numel = math.prod(x.shape)
    out = _resolve_shape(size, numel)
    if math.prod(out) != numel:
        return None
    return [TensorMeta(tuple(out), contiguous_strides(out), x.dtype)]


@register_rule([aten.view.default, aten._unsafe_view.default, aten.view_copy.default], shape_args={1: 0},
               local=view_or_copy, meta=_view_meta)
def view_rule(call: OpCall):
    x = call.tensors[0]
    out_shape = _resolve_shape(call.arg(1, "size"), x.numel())
    strategies = _partials()
    if 0 in x.shape or 0 in out_shape:
        return strategies
    strided_in = call.strided[0] if call.strided else ()
    seen = set()  # (out dim, out split factor, in dim, in split factor): placements compare slowly
    for ins, outs in view_groups(x.shape, out_shape):
        first_in = next((d for d in ins if x.shape[d] != 1), None)
        first_out = next((d for d in outs if out_shape[d] != 1), None)
        keys = []
        if first_in is not None and first_out is not None:
            keys.append((first_out, 1, first_in, 1))
        elif first_in is None and first_out is None and ins and outs:
            # a group of size-1 dims ((1, 6) -> (1, 2, 3): dim 0 -> dim 0): a size-1 dim sharded
            # over the mesh (one rank holds it, the others nothing) stays the same layout as a
            # size-1 dim of the view, so the view keeps aliasing, as in PyTorch
            keys.append((outs[0], 1, ins[0], 1))
        # two mesh dims cutting this group (a flattened (batch, sequence) on (dp, cp)): the block
        # counts of _strided_view_strategies' divisors and multiples; unknown (None): offer them
        nested = call.sharded is None or sum(d in ins for d in call.sharded[0]) > 1
        keys += _strided_view_strategies(x.shape, out_shape, ins, outs, first_in, strided_in, nested)
        for key in keys:
            if key not in seen:
                seen.add(key)
                strategies.append(((_placement(key[0], key[1]),), (_placement(key[2], key[3]),)))
    return strategies


def _placement(dim: int, sf: int):
    return Shard(dim) if sf == 1 else _StridedShard(dim, split_factor=sf)


def _strided_view_strategies(in_shape, out_shape, ins, outs, first_in, strided_in, nested=True):
    """Shards that a merge or split of dims keeps as strided shards (no data moves), as
    ``(out dim, out split factor, in dim, in split factor)``.

    Within a group of merged/split dims, a shard of input dim ``i`` (split factor ``sf``) holds,
    for each of the ``E = sf x (product of the group's dims before i)`` outer blocks of the
    group, one chunk.  In the output that is a shard of the dim ``j`` whose outer blocks
    ``P_j`` divide ``E``, with split factor ``E / P_j``: ``(b, h)`` with ``h`` sharded viewed as
    ``b*h`` is ``_StridedShard(0, split_factor=b)``, and back.  The planner then checks every
    rank's elements exactly (propagate._view_regions_match), so an uneven split that does not
    line up is never used."""
    out = []
    sfs_of = {}
    for d, sf in strided_in:
        sfs_of.setdefault(d, set()).add(sf)
    group = 1
    for i in ins:
        group *= in_shape[i]
    for i in ins:
        if in_shape[i] == 1:
            continue
        prefix = 1
        for k in ins:
            if k == i:
                break
            prefix *= in_shape[k]
        for sf_in in {1} | sfs_of.get(i, set()):
            # E outer blocks; when another mesh dim also shards the group (the batch of a flattened
            # (batch, sequence) on a (dp, cp) mesh), this mesh dim's shards are cut from that
            # dim's chunks, which hold fewer or more of the blocks than E, by the other dim's
            # number of shards, which the rule does not know: then (``nested``) the divisors and
            # multiples of E are offered too (the planner's region check keeps only what lines up)
            for e in (_block_counts(prefix * sf_in, group) if nested else (prefix * sf_in,)):
                p_j = 1
                for j in outs:
                    b = out_shape[j]
                    if b != 1 and p_j <= e < p_j * b and e % p_j == 0 and b % (e // p_j) == 0:
                        out.append((j, e // p_j, i, sf_in))
                        break
                    p_j *= b
    return out


def _block_counts(e: int, group: int, most: int = 8) -> list[int]:
    """``e`` first, then up to ``most`` of its divisors (from the largest down) and of its
    multiples that divide ``group`` (the group's element count; from the smallest up)."""
    down = [d for d in range(e - 1, 0, -1) if e % d == 0][:most]
    up = [e * m for m in range(2, group // e + 1) if (group // e) % m == 0][:most]
    return [e] + down + up


@register_rule([aten.expand.default, aten.expand_copy.default], shape_args={1: 0})
def expand_rule(call: OpCall):
    x = call.tensors[0]
    size = list(call.arg(1, "size"))
    lead = len(size) - x.ndim
    out_shape = [x.shape[d - lead] if (v == -1 and d >= lead) else v for d, v in enumerate(size)]
    # An expanded dim is not offered sharded from a Replicate input: a replicated expand is a
    # free view on every rank, and a later op slices whatever shard it needs for free, whereas
    # picking a shard here (blindly: the next op's layout is unknown) can force that op to move
    # it (the gradient of a sum, expanded, then viewed like a strided activation).
    strategies = _partials()
    for d in range(len(out_shape)):
        xd = d - lead
        if xd >= 0 and x.shape[xd] == out_shape[d]:
            strategies.append(((Shard(d),), (Shard(xd),)))
    return strategies


def _dim_map_strategies(x, mapping: dict[int, int], partial: bool = True):
    """Shard(in d) -> Shard(mapping[d]) for every mapped dim, plus Partial passthrough."""
    strategies = _partials() if partial else []
    for d, o in mapping.items():
        strategies.append(((Shard(o),), (Shard(d),)))
    return strategies


@register_rule([aten.transpose.int, aten.transpose_copy.int])
def transpose_rule(call: OpCall):
    x = call.tensors[0]
    n = max(x.ndim, 1)
    a, b = norm_dim(call.arg(1, "dim0"), n), norm_dim(call.arg(2, "dim1"), n)
    perm = list(range(x.ndim))
    if x.ndim:
        perm[a], perm[b] = perm[b], perm[a]
    return _dim_map_strategies(x, {perm[o]: o for o in range(x.ndim)})


@register_rule([aten.t.default, aten.t_copy.default])
def t_rule(call: OpCall):
    x = call.tensors[0]
    return _dim_map_strategies(x, {0: 1, 1: 0} if x.ndim == 2 else {0: 0} if x.ndim == 1 else {})


@register_rule([aten.permute.default, aten.permute_copy.default])
def permute_rule(call: OpCall):
    x = call.tensors[0]
    dims = [norm_dim(d, x.ndim) for d in call.arg(1, "dims")]
    return _dim_map_strategies(x, {d: o for o, d in enumerate(dims)})


@register_rule([aten.unsqueeze.default, aten.unsqueeze_copy.default])
def unsqueeze_rule(call: OpCall):
    x = call.tensors[0]
    u = norm_dim(call.arg(1, "dim"), x.ndim + 1)
    return _dim_map_strategies(x, {d: d if d < u else d + 1 for d in range(x.ndim)})


def _squeeze_map(x, dims) -> dict[int, int]:
    dropped = [d for d in dims if x.shape[d] == 1]
    return {d: d - sum(1 for r in dropped if r < d) for d in range(x.ndim) if d not in dropped}


#: squeeze of all dims, or of one, as squeeze.dims of the GLOBAL size-1 dims
_SQUEEZE_AS_DIMS = {
    aten.squeeze.default: aten.squeeze.dims, aten.squeeze.dim: aten.squeeze.dims,
    aten.squeeze_.default: aten.squeeze_.dims, aten.squeeze_.dim: aten.squeeze_.dims,
    aten.squeeze_copy.default: aten.squeeze_copy.dims, aten.squeeze_copy.dim: aten.squeeze_copy.dims,
}


@register_handler(list(_SQUEEZE_AS_DIMS), keeps_strided=True)
def squeeze_global_dims(op, args, kwargs):
    """``squeeze()`` / ``squeeze(dim)`` drop the dims of size 1 of the GLOBAL tensor; run on a
    shard they would also drop a dim whose shard happens to have one row (and keep it on the rank
    whose shard has none).  Rewritten as ``squeeze.dims`` with the global dims, whose rule and
    local check then keep every rank's shard consistent (in place too: squeeze_ is an in-place
    view, see dispatch._set_wrapper_metadata)."""
    x = args[0]
    if op in (aten.squeeze.default, aten.squeeze_.default, aten.squeeze_copy.default):
        dims = [d for d in range(x.ndim) if x.shape[d] == 1]
    else:
        d = norm_dim(args[1] if len(args) > 1 else kwargs["dim"], x.ndim) if x.ndim else None
        dims = [d] if d is not None and x.shape[d] == 1 else []
    return _SQUEEZE_AS_DIMS[op](x, dims)


@register_rule([aten.squeeze.dims, aten.squeeze_copy.dims])
def squeeze_dims_rule(call: OpCall):
    x = call.tensors[0]
    dims = [norm_dim(d, x.ndim) for d in call.arg(1, "dim")] if x.ndim else []
    return _dim_map_strategies(x, _squeeze_map(x, dims))


def _whole_slice(size: int, start, end, step) -> bool:
    """Does ``slice(start, end, step)`` of a dim of ``size`` keep every index (``x[:, :n]`` with
    ``n >= size``, as models write to trim a cache or a mask to the length it already has)?"""
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    return (step is None or step == 1) and start <= 0 and end >= size


@register_rule([aten.slice.Tensor, aten.slice_copy.Tensor])
def slice_rule(call: OpCall):
    x = call.tensors[0]
    dim = norm_dim(call.arg(1, "dim", 0), x.ndim)
    # a whole slice is the identity: a shard of the sliced dim stays where it is (no exchange)
    whole = _whole_slice(x.shape[dim], call.arg(2, "start", None), call.arg(3, "end", None), call.arg(4, "step", 1))
    return _dim_map_strategies(x, {d: d for d in range(x.ndim) if d != dim or whole})


@register_rule([aten.select.int, aten.select_copy.int])
def select_rule(call: OpCall):
    x = call.tensors[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    return _dim_map_strategies(x, {d: d if d < dim else d - 1 for d in range(x.ndim) if d != dim})


@register_rule([aten.split.Tensor, aten.split_with_sizes.default, aten.unsafe_split.Tensor,
                aten.unsafe_split_with_sizes.default, aten.split_with_sizes_copy.default, aten.split_copy.Tensor])
def split_rule(call: OpCall):
    x = call.tensors[0]
    dim = norm_dim(call.arg(2, "dim", 0), x.ndim)
    return _dim_map_strategies(x, {d: d for d in range(x.ndim) if d != dim})


@register_rule([aten.unbind.int, aten.unbind_copy.int])
def unbind_rule(call: OpCall):
    x = call.tensors[0]
    dim = norm_dim(call.arg(1, "dim", 0), x.ndim)
    return _dim_map_strategies(x, {d: d if d < dim else d - 1 for d in range(x.ndim) if d != dim})


@register_rule(aten.select_backward.default, shape_args={1: 0})
def select_backward_rule(call: OpCall):
    # grad of select: the grad embedded at `index` of a zero tensor of input_sizes (linear in grad)
    g = call.tensors[0]
    dim = norm_dim(call.arg(2, "dim"), g.ndim + 1)
    return _dim_map_strategies(g, {d: d if d < dim else d + 1 for d in range(g.ndim)})


@register_rule(aten.slice_backward.default, shape_args={1: 0})
def slice_backward_rule(call: OpCall):
    g = call.tensors[0]
    dim = norm_dim(call.arg(2, "dim"), g.ndim)
    size = call.arg(1, "input_sizes")[dim]
    whole = g.shape[dim] == size and _whole_slice(size, call.arg(3, "start"), call.arg(4, "end"), call.arg(5, "step", 1))
    return _dim_map_strategies(g, {d: d for d in range(g.ndim) if d != dim or whole})


# ---------------------------------------------------------------------------------------------
# rearrangements: flip, roll, repeat, tril/triu (constant_pad_nd: conv.py's halo handler)
# ---------------------------------------------------------------------------------------------


@register_rule(aten.flip.default)
def flip_rule(call: OpCall):
    x = call.tensors[0]
    flipped = {norm_dim(d, x.ndim) for d in call.arg(1, "dims")} if x.ndim else set()
    return _dim_map_strategies(x, {d: d for d in range(x.ndim) if d not in flipped})


@register_rule(aten.roll.default)
def roll_rule(call: OpCall):
    x = call.tensors[0]
    dims = call.arg(2, "dims", [])
    if not dims:  # rolls the flattened tensor: every dim moves
        return _partials()
    rolled = {norm_dim(d, x.ndim) for d in dims}
    return _dim_map_strategies(x, {d: d for d in range(x.ndim) if d not in rolled})


@register_rule(aten.repeat.default)
def repeat_rule(call: OpCall):
    x = call.tensors[0]
    reps = list(call.arg(1, "repeats"))
    lead = len(reps) - x.ndim
    # a dim repeated once keeps its shard; repeating a sharded dim would interleave the chunks
    return _dim_map_strategies(x, {d: d + lead for d in range(x.ndim) if reps[d + lead] == 1})


@register_rule([aten.tril.default, aten.triu.default])
def tril_rule(call: OpCall):
    # the mask depends on the (row, col) position within the last two dims: batch dims only
    x = call.tensors[0]
    return _dim_map_strategies(x, {d: d for d in range(x.ndim - 2)})


@register_rule(aten.narrow_copy.default)
def narrow_copy_rule(call: OpCall):
    x = call.tensors[0]
    dim = norm_dim(call.arg(1, "dim"), x.ndim)
    return _dim_map_strategies(x, {d: d for d in range(x.ndim) if d != dim})


@register_rule(aten.select_scatter.default)
def select_scatter_rule(call: OpCall):
    # select_scatter(self, src, dim, index): src is self without `dim`; linear in (self, src)
    x = call.tensors[0]
    dim = norm_dim(call.arg(2, "dim"), x.ndim)
    strategies = [((Shard(d),), (Shard(d), Shard(d if d < dim else d - 1))) for d in range(x.ndim) if d != dim]
    return strategies + _partials(n_in=2)


@register_rule(aten.slice_scatter.default)
def slice_scatter_rule(call: OpCall):
    x = call.tensors[0]
    dim = norm_dim(call.arg(2, "dim", 0), x.ndim)
    strategies = [((Shard(d),), (Shard(d), Shard(d))) for d in range(x.ndim) if d != dim]
    return strategies + _partials(n_in=2)


@register_rule(aten.diagonal_backward.default, shape_args={1: 0})
def diagonal_backward_rule(call: OpCall):
    # grad has the batch dims of the input (in order) and the diagonal last; zeros elsewhere
    g = call.tensors[0]
    nd = len(call.arg(1, "input_sizes"))
    d1 = norm_dim(call.arg(3, "dim1"), nd)
    d2 = norm_dim(call.arg(4, "dim2"), nd)
    rest = [d for d in range(nd) if d not in (d1, d2)]
    return _dim_map_strategies(g, {o: d for o, d in enumerate(rest)})


# ---------------------------------------------------------------------------------------------
# complex views: view_as_real / view_as_complex (the real-imaginary pair is a trailing dim of
# size 2), and the lazy conjugate / negative bits (_conj, _neg_view; conj, resolve_conj and
# resolve_neg are CompositeImplicitAutograd and decompose into these, clone and copy)
# ---------------------------------------------------------------------------------------------

# Partial terms that stay valid through a complex view: the views are real-linear (the sum of
# the terms' real pairs is the pair of the sum), and max/min do not exist for complex values.
_LINEAR_PARTIALS = (Partial("sum"), Partial("avg"))


@register_rule(aten.view_as_real.default)
def view_as_real_rule(call: OpCall):
    # (...) complex -> (..., 2) real: every dim keeps its shard; the new pair dim is whole
    x = call.tensors[0]
    return _dim_map_strategies(x, {d: d for d in range(x.ndim)}, partial=False) + _partials_of(_LINEAR_PARTIALS)


@register_rule(aten.view_as_complex.default)
def view_as_complex_rule(call: OpCall):
    # (..., 2) real -> (...) complex: the pair dim disappears, so it is never offered sharded (a
    # rank would hold half a number); a Shard of it is gathered first
    x = call.tensors[0]
    return _dim_map_strategies(x, {d: d for d in range(x.ndim - 1)}, partial=False) + _partials_of(_LINEAR_PARTIALS)


@register_rule([aten._conj.default, aten._neg_view.default])
def conj_view_rule(call: OpCall):
    # elementwise and real-linear; on real tensors both are order-reversing or the identity, so
    # only sum/avg are kept (max of -x is -min x: not the same reduce op)
    x = call.tensors[0]
    return _dim_map_strategies(x, {d: d for d in range(x.ndim)}, partial=False) + _partials_of(_LINEAR_PARTIALS)


def _partials_of(partials, n_in: int = 1, n_out: int = 1):
    return [((p,) * n_out, (p,) * n_in) for p in partials]
