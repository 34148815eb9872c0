"""DTensorSpec and the shard-layout arithmetic.

A DTensor's layout is fully described by its spec: the mesh, one placement per mesh dim, and the
global tensor's shape, stride and dtype.  Everything here is pure metadata (no tensors are
touched), so rules, the planner and the tests can all reason about layouts without a process group.

Layout convention (identical to ``torch.distributed.tensor`` so tensors convert without moving
data): ``Shard(d)`` on a mesh dim of size ``n`` splits tensor dim ``d`` the way ``torch.chunk``
does: chunk size ``ceil(N / n)``, so trailing ranks may hold a short or empty chunk.  When several
mesh dims shard the same tensor dim, they apply in mesh-dim order: mesh dim 0 splits first, mesh
dim 1 then splits each of those chunks, and so on.
"""

from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard, _StridedShard

__all__ = [
    "DTensorSpec",
    "SpecToken",
    "TensorMeta",
    "Region",
    "chunk_classes",
    "chunk_range",
    "chunk_sizes",
    "dim_patterns",
    "dim_region",
    "dim_steps",
    "is_shard",
    "is_strided",
    "local_region",
    "local_shape",
    "local_shape_and_offset",
    "local_shape_classes",
    "local_shapes",
    "placement_str",
    "placements_str",
    "take_region",
]

#: A rank's part of a global tensor, per tensor dim: the sorted, disjoint global index intervals
#: ``(start, stop)`` it holds.  The local shard is the product of these index lists in row-major
#: order (so its elements appear in global order).  Plain Shard/Replicate layouts hold one
#: interval per dim (a box); a strided shard holds several.
Region = tuple[tuple[tuple[int, int], ...], ...]


def chunk_range(size: int, n: int, index: int) -> tuple[int, int]:
    """Return ``(offset, length)`` of chunk ``index`` when ``size`` elements split in ``n``
    chunks the way ``torch.chunk`` does (full chunks of ``ceil(size/n)``, then a short one,
    then empty ones)."""
    step = -(-size // n) if n else 0
    start = min(index * step, size)
    stop = min(start + step, size)
    return start, stop - start


def chunk_sizes(size: int, n: int) -> list[int]:
    """Lengths of the ``n`` chunks of ``size`` elements (torch.chunk layout, empty chunks kept):
    ``full`` chunks of ``ceil(size/n)``, then one short chunk, then empty ones (list arithmetic,
    no per-chunk Python: a group may hold thousands of ranks)."""
    step = -(-size // n) if n else 0
    if not step:
        return [0] * n
    full, rem = divmod(size, step)
    return [step] * full + [rem] * (rem > 0) + [0] * (n - full - (rem > 0))


def is_strided(p: Placement) -> bool:
    """A strided shard: torch's ``_StridedShard(dim, split_factor=sf)`` (see :func:`local_region`)."""
    return type(p) is _StridedShard


def is_shard(p: Placement) -> bool:
    """A plain or strided shard (both split a tensor dim; ``_StridedShard`` is not a ``Shard``)."""
    return isinstance(p, Shard) or type(p) is _StridedShard


#: placement type -> kind letter, memoised by exact type (placement_kind)
_KINDS: dict[type, str] = {Shard: "S", Replicate: "R", Partial: "P", _StridedShard: "T"}


def placement_kind(p: Placement) -> str:
    """``"S"`` (a ``Shard``), ``"T"`` (a strided shard), ``"R"`` (``Replicate``) or ``"P"``
    (``Partial``): one dict lookup by exact type, for the planner's inner loops (``isinstance``
    on placement classes goes through a slow metaclass hook in torch)."""
    k = _KINDS.get(type(p))
    if k is None:
        k = ("T" if isinstance(p, _StridedShard) else "S" if isinstance(p, Shard)
             else "R" if isinstance(p, Replicate) else "P" if isinstance(p, Partial) else "?")
        _KINDS[type(p)] = k
    return k


def split_factor(p: Placement) -> int:
    return int(p.split_factor)


def _pick(intervals: Sequence[tuple[int, int]], start: int, length: int) -> list[tuple[int, int]]:
    """The global intervals at local positions ``[start, start + length)`` of a rank holding
    ``intervals`` (its local positions enumerate them in order)."""
    out, pos, stop = [], 0, start + length
    for lo, hi in intervals:
        n = hi - lo
        a, b = max(start, pos), min(stop, pos + n)
        if a < b:
            out.append((lo + a - pos, lo + b - pos))
        pos += n
        if pos >= stop:
            break
    return out


def _merge(intervals: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in intervals:
        if hi <= lo:
            continue
        if out and out[-1][1] == lo:
            out[-1] = (out[-1][0], hi)
        else:
            out.append((lo, hi))
    return tuple(out)


def local_region(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> Region:
    """The global index intervals, per tensor dim, of the shard held at ``coordinate``.

    Placements apply in mesh-dim order to what the earlier mesh dims left (PyTorch's
    left-to-right convention):

    - ``Shard(d)`` on a mesh dim of size ``n`` keeps chunk ``c`` (torch.chunk layout) of the
      rank's current dim-``d`` positions;
    - ``_StridedShard(d, split_factor=sf)`` first cuts the current positions into ``sf`` chunks,
      cuts each of them into ``n`` chunks, and keeps chunk ``c`` of every one, in order.  This is
      a dim sharded "inner first" (FSDP's ``Shard(0)`` of a tensor-parallel ``Shard(0)`` weight),
      or a dim that a view merged from several dims of which a non-first one was sharded
      (``(b, h)`` with ``h`` sharded, viewed as ``b*h``: ``sf = b``).
    """
    region: list = [((0, n),) if n else () for n in global_shape]
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            d, parts = p.dim, 1
        elif type(p) is _StridedShard:
            d, parts = p.dim, split_factor(p)
        else:
            continue
        region[d] = _shard_step(region[d], mesh_shape[mesh_dim], parts, coordinate[mesh_dim])
    return tuple(region)


def _shard_step(cur: Sequence[tuple[int, int]], n: int, parts: int, c: int) -> tuple[tuple[int, int], ...]:
    """What coordinate ``c`` of a mesh dim of size ``n`` keeps of a dim whose current (merged)
    intervals are ``cur``, under a shard of ``parts`` parts (1: ``Shard``; ``sf``: a strided
    shard): :func:`local_region`'s step for one mesh dim."""
    total = sum(hi - lo for lo, hi in cur)
    kept: list[tuple[int, int]] = []
    for j in range(parts):
        o, ln = chunk_range(total, parts, j)
        a, b = chunk_range(ln, n, c)
        kept.extend(_pick(cur, o + a, b))
    return _merge(kept)


def local_shape(global_shape, mesh_shape, placements, coordinate) -> tuple[int, ...]:
    """Shape of the local shard held at ``coordinate`` (any placements, strided ones included)."""
    if not any(type(p) is _StridedShard for p in placements):
        return local_shape_and_offset(global_shape, mesh_shape, placements, coordinate)[0]
    return tuple(sum(hi - lo for lo, hi in r) for r in local_region(global_shape, mesh_shape, placements, coordinate))


def take_region(full, region: Region):
    """This rank's shard of the full tensor ``full`` (a copy when the region is not a box)."""
    out = full
    for d, ivs in enumerate(region):
        if len(ivs) == 1:
            lo, hi = ivs[0]
            if lo != 0 or hi != full.shape[d]:
                out = out.narrow(d, lo, hi - lo)
        elif not ivs:
            out = out.narrow(d, 0, 0)
        else:
            import torch as _torch

            out = _torch.cat([out.narrow(d, lo, hi - lo) for lo, hi in ivs], dim=d)
    return out


# ---------------------------------------------------------------------------------------------
# facts about EVERY rank's shard, at a cost independent of the world size
#
# A check over all ranks never walks the mesh's coordinates (up to tens of thousands).  Two facts
# make that possible:
#
# - a LENGTH is a function of lengths: the local length of a tensor dim after a shard on a mesh
#   dim of size n depends only on the dim's current local length (torch.chunk layout: full
#   chunks, one short chunk, then empty ones; a strided shard sums that over its parts).  Along
#   one mesh dim it is constant on at most a few ranges of coordinates (_shard_len_starts), so
#   the distinct local shapes over the whole mesh are found by walking the mesh dims in order and
#   keeping the distinct length states (local_shape_classes);
# - a tensor dim's REGION depends only on the coordinates of the mesh dims that shard that dim,
#   through the sequence of those shards (dim_steps): two layouts with the same sequence hold the
#   same indices of the dim on every rank.
# ---------------------------------------------------------------------------------------------


#: the most coordinates of several mesh dims a check may walk where no per-dim argument decides
#: (the op planner's region checks, an exchange's feasibility); past it a check answers in its safe
#: direction (a slower, correct plan), so no check grows with the world
ENUMERATION_LIMIT = 4096


def chunk_classes(size: int, n: int) -> tuple[tuple[int, int, int], ...]:
    """``(start, stop, length)``: the ranges of chunk indices in ``range(n)`` over which the
    length of chunk ``c`` of ``size`` elements (torch.chunk layout) is constant: full chunks
    ``[0, q)``, at most one short chunk ``{q}``, then empty ones."""
    if size == 0:
        return ((0, n, 0),)
    step = -(-size // n)
    q = size // step  # 1 <= q <= n
    r = size - q * step
    out = [(0, q, step)]
    if q < n:
        if r:
            out.append((q, q + 1, r))
            if q + 1 < n:
                out.append((q + 1, n, 0))
        else:
            out.append((q, n, 0))
    return tuple(out)


def _part_lengths(total: int, parts: int) -> tuple[tuple[int, int], ...]:
    """``(count, length)`` of the parts a strided shard of ``parts`` parts cuts ``total`` into."""
    return tuple((b - a, ln) for a, b, ln in chunk_classes(total, parts) if ln)


def _shard_len(total: int, n: int, parts: int, c: int) -> int:
    """The local length at coordinate ``c`` (of ``n``) of a dim of current local length ``total``
    after a shard of ``parts`` parts (what :func:`_shard_step` keeps, counted)."""
    if parts == 1:
        return chunk_range(total, n, c)[1]
    return sum(k * chunk_range(ln, n, c)[1] for k, ln in _part_lengths(total, parts))


def _shard_len_starts(total: int, n: int, parts: int) -> set[int]:
    """Coordinates in ``range(n)`` at which :func:`_shard_len` may change (0 included): the union
    of each part length's class boundaries, so the length is constant from each to the next."""
    starts = {0}
    for _, ln in ((1, total),) if parts == 1 else _part_lengths(total, parts):
        starts.update(a for a, _, _ in chunk_classes(ln, n))
    return starts


def _sharded_dim(p: Placement) -> tuple[int, int] | None:
    """``(tensor dim, parts)`` of a shard placement (parts: 1 for ``Shard``, the split factor for a
    strided shard), None for any other."""
    t = type(p)
    if t is Shard or (t is not _StridedShard and isinstance(p, Shard)):
        return p.dim, 1
    if t is _StridedShard:
        return p.dim, split_factor(p)
    return None


def local_shape_classes(layouts: Sequence, mesh_shape: Sequence[int],
                        pinned: dict[int, int] | None = None) -> dict[tuple, tuple[int, ...]]:
    """The distinct combinations of local shapes over every coordinate of the mesh, each with the
    lexicographically first coordinate that holds it, in that coordinate's order.

    ``layouts``: ``(global_shape, placements)`` pairs (None entries stay None in every key), all
    on ``mesh_shape``; a key holds each layout's :func:`local_shape` at the coordinate.  ``pinned``
    (``{mesh dim: coordinate}``) restricts those mesh dims to one coordinate each.

    Exact, at a cost independent of the world size: a local length is a function of the current
    local length (:func:`_shard_len`), constant along a mesh dim on the ranges that
    :func:`_shard_len_starts` gives; walking the mesh dims in order, the coordinates that reach one
    combination of lengths have the same futures, so only the distinct combinations are kept
    (the first coordinate of each range stands for it, which keeps each class's first coordinate).
    Their count is bounded by the product over mesh dims of the few ranges each has, not by the
    number of ranks."""
    pinned = pinned or {}
    start = tuple(None if lay is None else tuple(lay[0]) for lay in layouts)
    states: dict[tuple, tuple[int, ...]] = {start: ()}
    for i, n in enumerate(mesh_shape):
        acts = []
        for k, lay in enumerate(layouts):
            if lay is not None:
                sd = _sharded_dim(lay[1][i])
                if sd is not None:
                    acts.append((k, sd[0], sd[1]))
        new: dict[tuple, tuple[int, ...]] = {}
        for st, pre in states.items():
            if i in pinned:
                coords = (pinned[i],)
            elif not acts or n == 1:
                coords = (0,)
            else:
                cs: set[int] = set()
                for k, d, parts in acts:
                    cs |= _shard_len_starts(st[k][d], n, parts)
                coords = sorted(cs)
            for c in coords:
                nxt = list(st)
                for k, d, parts in acts:
                    sh = list(nxt[k])
                    sh[d] = _shard_len(sh[d], n, parts, c)
                    nxt[k] = tuple(sh)
                key = tuple(nxt)
                if key not in new:
                    new[key] = pre + (c,)
        states = new
    return states


def local_shapes(global_shape, mesh_shape, placements) -> list[tuple[int, ...]]:
    """The distinct local shapes of one layout over every coordinate of the mesh
    (:func:`local_shape_classes`), in the order of their first coordinates."""
    return [k[0] for k in local_shape_classes(((tuple(global_shape), tuple(placements)),), mesh_shape)]


def dim_steps(placements: Sequence[Placement], d: int, mesh_shape: Sequence[int],
              ndim: int | None = None) -> tuple[tuple[int, int, int], ...]:
    """``(mesh dim, size, parts)`` of each mesh dim that shards tensor dim ``d``, in mesh order,
    size-1 mesh dims left out (a shard over one rank keeps everything).  Tensor dim ``d``'s region
    at a coordinate is a function of its global length, these steps and the coordinates of
    their mesh dims only (:func:`dim_region`): two layouts with equal steps and length hold the
    same indices of the dim on every rank.  ``ndim`` (the tensor's): shard dims and ``d`` compare
    modulo it, as :func:`local_region` indexes them (a negative dim counts from the end)."""
    out = []
    if ndim:
        d %= ndim
    for i, p in enumerate(placements):
        sd = _sharded_dim(p)
        if sd is not None and (sd[0] % ndim if ndim else sd[0]) == d and mesh_shape[i] > 1:
            out.append((i, mesh_shape[i], sd[1]))
    return tuple(out)


def dim_region(length: int, steps, coordinate) -> tuple[tuple[int, int], ...]:
    """:func:`local_region` of one tensor dim of global ``length`` sharded by ``steps``
    (:func:`dim_steps`) at ``coordinate`` (indexable by mesh dim: a tuple or a dict)."""
    cur: tuple = ((0, length),) if length else ()
    for i, n, parts in steps:
        cur = _shard_step(cur, n, parts, coordinate[i])
    return cur


def _canonical(pattern: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """Intervals of lengths ``pattern``, one index apart."""
    out, pos = [], 0
    for ln in pattern:
        out.append((pos, pos + ln))
        pos += ln + 1
    return tuple(out)


def dim_patterns(length: int, steps) -> set[tuple[int, ...]]:
    """The distinct interval-length patterns (the lengths of a region's intervals, in order) that
    tensor dim of global ``length`` sharded by ``steps`` (:func:`dim_steps`) has over every
    coordinate.  Exact, linear in the mesh dims' sizes at most: what a shard keeps of a region
    depends on the region's positions only through its pattern (kept intervals of distinct
    merged intervals never touch, so the gaps' sizes do not matter: the pattern is carried by
    intervals one index apart, :func:`_canonical`).  A one-interval region under a shard keeps a
    pattern set by the parts' chunk lengths, constant on :func:`_shard_len_starts`' ranges, and by
    which consecutive picks touch, possible only at coordinate 0 (a pick at the start of its part);
    so coordinates 0, 1 and the ranges' starts stand for all.  A region of several intervals is
    walked over every coordinate of that one mesh dim."""
    pats: set[tuple[int, ...]] = {(length,) if length else ()}
    for _, n, parts in steps:
        new: set[tuple[int, ...]] = set()
        for pat in pats:
            total = sum(pat)
            if len(pat) <= 1:
                coords = _shard_len_starts(total, n, parts)
                if n > 1:
                    coords.add(1)
            else:
                coords = range(n)
            cur = _canonical(pat)
            for c in coords:
                new.add(tuple(hi - lo for lo, hi in _shard_step(cur, n, parts, c)))
        pats = new
    return pats


@functools.lru_cache(maxsize=4096)
def _strided_is_blocks(global_shape, mesh_shape, placements) -> bool:
    """Is every rank's region one block (one interval per dim)?  Per tensor dim (a dim's region
    depends on its own shards only), from the dim's interval patterns (:func:`dim_patterns`):
    exact, without walking the mesh's coordinates; a dim that no strided shard splits is one
    interval everywhere (a chunk of an interval)."""
    for d, length in enumerate(global_shape):
        steps = dim_steps(placements, d, mesh_shape, len(global_shape))
        if any(parts > 1 for _, _, parts in steps) and any(
                len(pat) > 1 for pat in dim_patterns(length, steps)):
            return False
    return True


def local_shape_and_offset(
    global_shape: Sequence[int],
    mesh_shape: Sequence[int],
    placements: Sequence[Placement],
    coordinate: Sequence[int],
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and global offset of the local shard held at ``coordinate`` of the mesh.

    A strided shard whose region is not one box (per dim one interval) has no offset: that
    raises ValueError (use :func:`local_region`)."""
    if any(type(p) is _StridedShard for p in placements):
        region = local_region(global_shape, mesh_shape, placements, coordinate)
        # decided for the whole mesh, not this rank alone: an error on some ranks only would
        # leave the others waiting in their next collective
        if not _strided_is_blocks(tuple(global_shape), tuple(mesh_shape), tuple(placements)):
            raise ValueError(
                f"the shards of a {tuple(global_shape)} tensor with placements {placements_str(placements)} "
                f"on mesh {tuple(mesh_shape)} are not one block of the global tensor each (a strided "
                "shard), so they have no single offset; use "
                "dtshard.spec.local_region, or redistribute to plain Shard placements first")
        return (tuple(r[0][1] - r[0][0] if r else 0 for r in region),
                tuple(r[0][0] if r else 0 for r in region))
    shape = list(global_shape)
    offset = [0] * len(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Shard):
            d = p.dim
            start, length = chunk_range(shape[d], mesh_shape[mesh_dim], coordinate[mesh_dim])
            offset[d] += start
            shape[d] = length
    return tuple(shape), tuple(offset)


def global_stride_from_local(local_stride: Sequence[int], mesh_shape: Sequence[int],
                             placements: Sequence[Placement]) -> tuple[int, ...]:
    """The global stride of evenly sharded local shards laid out like ``local_stride``: PyTorch's
    rule (``compute_global_tensor_info``, used by its ``DTensor.from_local``).  For each mesh dim
    that shards tensor dim ``d`` over ``n`` ranks, every stride at least ``local_stride[d]`` (the
    dims laid out outside ``d``) grows ``n`` times, so a transposed shard gives a transposed global
    tensor and a contiguous shard a contiguous one."""
    stride = list(local_stride)
    for mesh_dim, p in enumerate(placements):
        if is_shard(p):
            n, base = mesh_shape[mesh_dim], stride[p.dim]
            stride = [s * n if i != p.dim and s >= base else s for i, s in enumerate(stride)]
    return tuple(stride)


def placement_str(p: Placement) -> str:
    """Short stable text of one placement: S(0), R, P(sum)."""
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if type(p) is _StridedShard:
        return f"_S({p.dim}, {split_factor(p)})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return f"P({p.reduce_op})"
    return repr(p)


def placements_str(ps: Sequence[Placement]) -> str:
    return "(" + ", ".join(placement_str(p) for p in ps) + ")"


def placement_equal(a: Placement, b: Placement) -> bool:
    """``a == b`` for placements, by exact type first (Placement.__eq__ and isinstance on
    placement classes are slow Python; this sits on dispatch-cache key comparisons)."""
    if a is b:
        return True
    t = type(a)
    if t is not type(b):
        return False
    if t is Shard:
        return a.dim == b.dim
    if t is Replicate:
        return True
    return a == b


_MISSING = object()


def memo(cache: dict, key, compute, limit: int = 8192):
    """``cache[key]``, computed by ``compute()`` on a miss: the planner's memos of pure layout
    facts (rank boxes, exchange costs, sub-plans).  A full cache is emptied before the next
    entry goes in, so it stays bounded however many shapes a program uses."""
    hit = cache.get(key, _MISSING)
    if hit is _MISSING:
        hit = compute()
        if len(cache) >= limit:
            cache.clear()
        cache[key] = hit
    return hit


def placement_key(p: Placement) -> tuple:
    """A plain, hashable value that two placements share exactly when ``placement_equal`` says
    they are equal (the exact type first: a ``_StridedShard`` never equals a ``Shard``)."""
    t = type(p)
    if t is Shard:
        return ("S", p.dim)
    if t is Replicate:
        return ("R",)
    if t is Partial:
        return ("P", p.reduce_op)
    return (t.__name__, p)


def placements_equal(a: Sequence[Placement], b: Sequence[Placement]) -> bool:
    """``placement_equal`` over two sequences (inlined: the planner compares every choice's inputs
    with where they are)."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x is y:
            continue
        t = type(x)
        if t is not type(y):
            return False
        if t is Shard:
            if x.dim != y.dim:
                return False
        elif t is not Replicate and x != y:
            return False
    return True


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """torch's strides for a contiguous tensor of ``shape`` (zero sizes count as one)."""
    stride, acc = [], 1
    for n in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


@dataclass(frozen=True)
class TensorMeta:
    """What a sharding rule sees of a tensor argument: global shape, stride and dtype."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n


class SpecToken:
    """A spec's stand-in in the dispatcher's plan-cache keys: ONE token per class of equal specs
    (:meth:`DTensorSpec.token`).  Hashing and comparing a token is a C-level identity operation,
    where a spec's own ``__hash__`` / ``__eq__`` are Python calls, once per DTensor argument per
    op.  A token never equals anything but itself (not a number, not a tuple), so a key position
    that holds a DTensor in one call and another argument in the next can never match."""

    __slots__ = ()


#: the token of every class of equal specs, by the spec's key (:meth:`DTensorSpec._key`); bounded:
#: when full it starts afresh, and specs made before keep their old tokens, which stay unique (a
#: token is never handed out twice), so a reset costs plan-cache misses, never a wrong plan
_tokens: dict[tuple, SpecToken] = {}
_TOKENS_LIMIT = 100_000


#: what a DTensorSpec computes once and keeps as plain attributes (never pickled: a hash or a token
#: belongs to this process)
_DERIVED = frozenset({"_hash", "_eqkey", "_mesh_shape", "_has_strided", "_token", "_tensor_meta",
                      "_contiguous_meta", "_sharded_dims"})


@dataclass(frozen=True, eq=False)
class DTensorSpec:
    """Immutable description of a distributed tensor's layout.

    Hash and equality cover (mesh, placements, shape, stride, dtype, extra); the hash is computed
    once, since specs are dispatch-cache keys on the hot path.

    ``extra`` (None for almost every tensor): data that a layout extension attaches to the layout
    (``dtshard.hooks.layout_extension``, keyed by the data's type), e.g. the neighbours' rows a
    spatial shard carries.  It must be immutable and hashable.  The core never reads it: it only
    sends ops on DTensors whose spec has it to the extension that owns its type, and keeps it out
    of what it does itself (``plain``, ``with_placements``).
    """

    mesh: "torch.distributed.device_mesh.DeviceMesh"
    placements: tuple[Placement, ...]
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    extra: object = None

    def _key(self) -> tuple:
        """What equality compares, as one tuple of plain values (the mesh by identity, each
        placement by exact type: ``placement_key``), built once, lazily (a spec built while
        torch.compile traces may hold proxies), and kept as a plain attribute, not a dataclass
        field (compile rebuilds specs from fields).  Specs are dispatch-cache keys: comparing
        two equal specs is then one C-level tuple comparison instead of a Python walk."""
        k = self.__dict__.get("_eqkey")
        if k is None:
            k = (mesh_identity(self.mesh), tuple(placement_key(p) for p in self.placements), self.shape,
                 self.stride, self.dtype, self.extra)
            object.__setattr__(self, "_eqkey", k)
        return k

    #: the spec's :class:`SpecToken` once :meth:`token` made it (a class attribute until then)
    _token = None

    def token(self) -> SpecToken:
        """This spec's :class:`SpecToken` (equal specs, equal tokens), made once per spec object.
        Raises TypeError for a spec that cannot be hashed (symbolic shapes while tracing)."""
        t = self._token
        if t is None:
            k = self._key()
            t = _tokens.get(k)
            if t is None:
                if len(_tokens) >= _TOKENS_LIMIT:
                    _tokens.clear()
                t = _tokens[k] = SpecToken()
            object.__setattr__(self, "_token", t)
        return t

    def __hash__(self) -> int:
        h = self.__dict__.get("_hash")
        if h is None:
            h = hash(self._key())
            object.__setattr__(self, "_hash", h)
        return h

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, DTensorSpec) and self._key() == other._key())

    def __getstate__(self) -> dict:
        # pickling (torch.save, deepcopy): the fields only.  The cached hash covers the mesh's
        # identity (its process group names), which a load in another process may not share; a
        # token belongs to this process's plan cache.
        return {k: v for k, v in self.__dict__.items()
                if k not in _DERIVED}

    # ---- derived metadata -------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    # what a spec works out once and keeps (one of _DERIVED), like its hash: each property reads
    # the kept value and computes it only the first time
    def _keep(self, name: str, value):
        object.__setattr__(self, name, value)
        return value

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """The mesh's shape (ranks per mesh dim), kept once per spec."""
        # DeviceMesh.shape rebuilds a tuple from its layout on every call
        ms = self.__dict__.get("_mesh_shape")
        return ms if ms is not None else self._keep("_mesh_shape", tuple(self.mesh.shape))

    @property
    def tensor_meta(self) -> TensorMeta:
        """What a rule sees of this tensor."""
        m = self.__dict__.get("_tensor_meta")
        return m if m is not None else self._keep("_tensor_meta", TensorMeta(self.shape, self.stride, self.dtype))

    @property
    def contiguous_meta(self) -> TensorMeta:
        """:attr:`tensor_meta` with contiguous strides (what the planner runs meta functions on)."""
        m = self.__dict__.get("_contiguous_meta")
        if m is not None:
            return m
        m, strides = self.tensor_meta, contiguous_strides(self.shape)
        return self._keep("_contiguous_meta", m if m.stride == strides else TensorMeta(self.shape, strides, self.dtype))

    @property
    def sharded_dims(self) -> tuple[tuple[int, ...], tuple[tuple[int, int], ...]]:
        """``(tensor dim of each sharding mesh dim, (dim, split factor) of each strided shard)``,
        in mesh order: what a rule's :class:`~dtshard.registry.OpCall` says of this input."""
        d = self.__dict__.get("_sharded_dims")
        return d if d is not None else self._keep("_sharded_dims", (
            tuple(p.dim for p in self.placements if is_shard(p)),
            tuple((p.dim, split_factor(p)) for p in self.placements if is_strided(p))))

    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    def nbytes(self) -> int:
        """Bytes of the GLOBAL tensor (``numel() * itemsize``)."""
        return self.numel() * _itemsize(self.dtype)

    def with_placements(self, placements: Sequence[Placement]) -> "DTensorSpec":
        """The same tensor with other placements (and no layout-extension data)."""
        return self.on_mesh(tuple(placements), self.shape, self.stride, self.dtype)

    def on_mesh(self, placements: tuple, shape: tuple, stride: tuple, dtype: torch.dtype) -> "DTensorSpec":
        """A spec of another tensor on this spec's mesh (what the planner builds for an op's
        outputs; the mesh's shape, cached here, carries over)."""
        spec = DTensorSpec(self.mesh, placements, shape, stride, dtype)
        ms = self.__dict__.get("_mesh_shape")
        if ms is not None:
            spec._keep("_mesh_shape", ms)
        return spec

    @property
    def plain(self) -> "DTensorSpec":
        """This spec without its layout-extension data (itself when it has none)."""
        if self.extra is None:
            return self
        return DTensorSpec(self.mesh, self.placements, self.shape, self.stride, self.dtype)

    def with_extra(self, extra: object) -> "DTensorSpec":
        """This spec carrying the layout-extension data ``extra`` (None: the plain spec)."""
        if extra is None:
            return self.plain
        return DTensorSpec(self.mesh, self.placements, self.shape, self.stride, self.dtype, extra)

    def local_shape(self, coordinate: Sequence[int]) -> tuple[int, ...]:
        """Shape of the shard the rank at mesh ``coordinate`` holds (``torch.chunk`` layout; strided shards included)."""
        return local_shape(self.shape, self.mesh_shape, self.placements, coordinate)

    def local_region(self, coordinate: Sequence[int]) -> Region:
        """The global indices the rank at mesh ``coordinate`` holds: per tensor dim a list of ``(start, stop)`` intervals (one for plain shards, several for strided ones)."""
        return local_region(self.shape, self.mesh_shape, self.placements, coordinate)

    @property
    def has_strided(self) -> bool:
        """Does any mesh dim hold a strided shard (``_StridedShard``)?"""
        h = self.__dict__.get("_has_strided")
        return h if h is not None else self._keep("_has_strided",
                                                  any(type(p) is _StridedShard for p in self.placements))

    def local_shape_and_offset(self, coordinate: Sequence[int]):
        """``(local shape, global offset)`` of the rank at mesh ``coordinate``, as PyTorch's ``compute_local_shape_and_global_offset`` (plain shards)."""
        return local_shape_and_offset(self.shape, self.mesh_shape, self.placements, coordinate)

    def is_even(self) -> bool:
        """True when every sharded dim splits into equal chunks (no padding anywhere): then every
        rank's shard has the same shape."""
        shape = None
        mesh_shape = self.mesh_shape
        for mesh_dim, p in enumerate(self.placements):
            t = type(p)  # exact types first (the planner asks this per choice)
            if t is Replicate or t is Partial:
                continue
            if t is _StridedShard:
                n = mesh_shape[mesh_dim] * split_factor(p)
            elif t is Shard or isinstance(p, Shard):
                n = mesh_shape[mesh_dim]
            else:
                continue
            if shape is None:
                shape = list(self.shape)
            if shape[p.dim] % n:
                return False
            shape[p.dim] //= mesh_shape[mesh_dim]
        return True

    def shard_mesh_dims(self, tensor_dim: int) -> list[int]:
        """Mesh dims that shard ``tensor_dim``, outermost first."""
        return [i for i, p in enumerate(self.placements) if is_shard(p) and p.dim == tensor_dim]

    def __repr__(self) -> str:
        extra = "" if self.extra is None else f", {self.extra}"
        return (
            f"DTensorSpec(shape={tuple(self.shape)}, placements={placements_str(self.placements)}, "
            f"mesh={tuple(self.mesh_shape)}, dtype={self.dtype}{extra})"
        )


_ITEMSIZE: dict[torch.dtype, int] = {}


def mesh_key(mesh) -> int:
    """``mesh``'s class under PyTorch's ``DeviceMesh.__eq__`` as a small int: two meshes get the
    same key exactly when they hold the same ranks in the same layout, with the same dim names, the
    same device type (and, as in PyTorch, were made on the same thread), whatever process groups
    each owns (two ``init_device_mesh`` calls with one layout, FSDP's default mesh made twice).
    Every check whether two DTensors share a mesh asks this (:func:`same_mesh`).  An object that is
    not a ``DeviceMesh`` (a test's stand-in) is its own class.  Cached per object."""
    hit = _mesh_keys.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    real = _real_mesh(mesh)
    if real is not mesh:
        key = mesh_key(real)
        _cache_per_mesh(_mesh_keys, mesh, key)
        return key
    hash_key = getattr(mesh, "_hash_key", None)
    try:
        eq = hash_key() if hash_key is not None else None
        key = _mesh_classes.get(eq) if eq is not None else -1 - id(mesh)  # no class: the object itself
    except TypeError:  # an unhashable layout (a stand-in mesh): the object itself
        eq, key = None, -1 - id(mesh)
    if key is None:
        with _mesh_classes_lock:  # ranks run as threads in PyTorch's tests: one int per class
            key = _mesh_classes.setdefault(eq, len(_mesh_classes))
    _cache_per_mesh(_mesh_keys, mesh, key)
    return key


def _real_mesh(mesh):
    """The mesh behind the opaque stand-in torch.compile traces with (a ``FakeScriptObject``, whose
    members other than the registered ones raise), else ``mesh`` itself."""
    if type(mesh).__name__ == "FakeScriptObject":
        real = object.__getattribute__(mesh, "real_obj")
        if real is not None:
            return real
    return mesh


def same_mesh(a, b) -> bool:
    """Are ``a`` and ``b`` one mesh for an op's inputs, a gradient and its leaf, a redistribute?
    PyTorch's answer (``a == b``): same ranks in the same layout, dim names and device type."""
    return a is b or mesh_key(a) == mesh_key(b)


def mesh_str(mesh) -> str:
    """``mesh`` for an error message: shape, dim names, device type and its ranks (the first 16 of
    a large mesh), everything ``same_mesh`` compares."""
    try:
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():  # the rank table is a real tensor; a fake mode may be on
            ranks = mesh.mesh.flatten()[:17].tolist()
        ranks_s = ", ".join(map(str, ranks[:16])) + (", ..." if len(ranks) > 16 else "")
    except Exception:  # noqa: BLE001 - a stand-in mesh without a rank table
        ranks_s = "?"
    return (f"{tuple(mesh.shape)} {getattr(mesh, 'mesh_dim_names', None)} on "
            f"{getattr(mesh, 'device_type', '?')} ranks [{ranks_s}]")


def mesh_identity(mesh) -> tuple:
    """What makes two mesh objects interchangeable inside a cache: the same mesh
    (:func:`mesh_key`) AND the same process groups.

    Two ``init_device_mesh`` calls with one layout are one mesh (:func:`same_mesh`) but own
    different process groups; a spec, and so every cached plan, keeps the groups its collectives
    run on, so specs on them differ (each gets its own plan; an op mixing them is planned on its
    first input's mesh).  A deepcopy (compile guards make them) keeps the groups.  Cached per
    object."""
    hit = _mesh_ids.get(id(mesh))
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    names = getattr(_real_mesh(mesh), "_dim_group_names", None)
    ident = (mesh_key(mesh), tuple(names) if names is not None else ())
    _cache_per_mesh(_mesh_ids, mesh, ident)
    return ident


def _cache_per_mesh(cache: dict, mesh, value) -> None:
    """``cache[id(mesh)] = (weak reference, value)``; a freed mesh leaves the cache (slicing makes
    a new mesh object every time).  A mesh that cannot be weakly referenced is not cached."""
    key = id(mesh)

    def drop(ref):
        hit = cache.get(key)
        if hit is not None and hit[0] is ref:
            del cache[key]

    try:
        cache[key] = (weakref.ref(mesh, drop), value)
    except TypeError:
        pass


_mesh_ids: dict[int, tuple] = {}
_mesh_keys: dict[int, tuple] = {}
#: PyTorch's equality key of every mesh seen (``DeviceMesh._hash_key()``: rank map, layout, device
#: type, dim names, thread) -> its small int; one entry per distinct mesh, not per mesh object
_mesh_classes: dict[tuple, int] = {}
_mesh_classes_lock = threading.Lock()


def _itemsize(dtype: torch.dtype) -> int:
    size = _ITEMSIZE.get(dtype)
    if size is None:
        size = _ITEMSIZE[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


#: The reduce ops of ``Partial`` that dtshard supports: PyTorch's ``Partial.ALL_REDUCE_OPS`` minus
#: the bitwise ones, by their canonical names (PyTorch's).
REDUCE_OPS = ("sum", "avg", "max", "min", "product")

#: Every spelling of them that PyTorch's ``Partial`` takes -> the canonical name: any case (its
#: functional collectives read ``"PRODUCT"`` as ``"product"``) and ``"prod"`` (which PyTorch keeps
#: as a pending placement, as in its ``test_redistribute_to_partial``, but fails to reduce).
#: dtshard's placements carry the canonical name: ``Partial("prod")`` is reported, compared and
#: reduced as ``Partial("product")``.
REDUCE_OP_SPELLINGS = {**{n: n for n in REDUCE_OPS}, **{n.upper(): n for n in REDUCE_OPS},
                       "prod": "product", "PROD": "product"}


def canonical_reduce_op(op: str) -> str | None:
    """The canonical name of a ``Partial`` reduce op in any spelling PyTorch takes; None for one
    dtshard does not support (the bitwise ones, names of no reduction)."""
    hit = REDUCE_OP_SPELLINGS.get(op)
    if hit is None and isinstance(op, str):
        hit = REDUCE_OP_SPELLINGS.get(op.lower())
    return hit


def normalize_placements(placements: Sequence[Placement], ndim: int, mesh_ndim: int, *, what: str) -> tuple[Placement, ...]:
    """Validate user placements (count, types, dims) and normalise negative shard dims."""
    placements = tuple(placements)
    if len(placements) != mesh_ndim:
        raise ValueError(
            f"{what}: got {len(placements)} placements {placements_str(placements)} for a "
            f"{mesh_ndim}-D mesh; give exactly one placement per mesh dim."
        )
    out = []
    for p in placements:
        if isinstance(p, Shard):
            d = p.dim
            if not -max(ndim, 1) <= d < max(ndim, 1) or ndim == 0:
                raise ValueError(
                    f"{what}: placement Shard({d}) is out of range for a {ndim}-D tensor; "
                    f"use a dim in [-{ndim}, {ndim})."
                )
            out.append(Shard(d % ndim) if d < 0 else p)
        elif type(p) is _StridedShard:
            d, sf = p.dim, split_factor(p)
            if not -max(ndim, 1) <= d < max(ndim, 1) or ndim == 0:
                raise ValueError(
                    f"{what}: placement {placement_str(p)} is out of range for a {ndim}-D tensor; "
                    f"use a dim in [-{ndim}, {ndim})."
                )
            if sf < 1:
                raise ValueError(f"{what}: placement {placement_str(p)} needs a split_factor >= 1.")
            d = d % ndim
            # split factor 1 is a plain shard: one canonical spelling per layout
            out.append(Shard(d) if sf == 1 else (p if d == p.dim else _StridedShard(d, split_factor=sf)))
        elif isinstance(p, Partial):
            if p.reduce_op not in REDUCE_OPS:
                op = canonical_reduce_op(p.reduce_op)
                if op is None:
                    raise ValueError(
                        f"{what}: Partial({p.reduce_op!r}) is not supported; dtshard supports Partial('sum'), "
                        "Partial('avg'), Partial('max'), Partial('min') and Partial('product') (in any case, "
                        "and 'prod'). Reduce a bitwise partial value with torch.distributed.all_reduce on the "
                        "local tensors, then wrap it with DTensor.from_local(t, mesh, [Replicate()]).")
                if type(p) is not Partial:  # a subclass with its own meaning: dtshard cannot rename it
                    raise ValueError(f"{what}: {p!r} spells its reduce op {p.reduce_op!r}; use {op!r}.")
                p = Partial(op)
            out.append(p)
        elif isinstance(p, Replicate):
            out.append(p)
        else:
            raise TypeError(f"{what}: unsupported placement {p!r}; use Shard(d), Replicate(), Partial(op) "
                            "or _StridedShard(d, split_factor=sf).")
    ops = {p.reduce_op for p in out if isinstance(p, Partial)}
    if "product" in ops and len(ops) > 1:
        # a product of sums is not a sum of products: the value would depend on the order in which
        # the mesh dims are reduced (PyTorch rejects mixed Partial types for the same reason)
        raise ValueError(
            f"{what}: placements {placements_str(out)} mix Partial('product') with "
            f"{sorted(ops - {'product'})}; the reduction order would decide the value. Reduce one of "
            "them first (x.redistribute(mesh, placements) with Replicate() on those mesh dims)."
        )
    return tuple(out)
