"""The generic strided block-copy Triton kernel and its host-side launcher.

Every packing op is expressed as ONE kind of copy: for each of ``n`` blocks ``b``, a region of
shape ``(outer, len_b, inner)`` of a strided source is copied into a region of shape
``(outer, dst_len_b, inner)`` of a contiguous destination, with zeros written at rows outside
``[lead_b, lead_b + len_b)`` (the padding of ``pack`` and the halos of ``halo_cat``)::

    dst[dst_base_b + o * dst_ostride_b + l * inner + i] =
        src[src_base_b + o * src_ostride_b + outer_offset(o) + (l - lead_b) * stride_l + inner_offset(i)]
            if lead_b <= l < lead_b + len_b else 0

``outer_offset``/``inner_offset`` decompose the linear outer/inner index into at most 4 source dims
each (after the host has merged mergeable dims, so a contiguous source has one inner and one
outer dim).  The per-block numbers live in a small ``(7, n)`` int64 tensor, so every op is ONE
launch however many blocks it has (``halo_cat`` is one launch per part: the parts are separate
allocations).  The grid is 1-D over ``(block, tile of outer, tile of len, tile of inner)``, each
program copying a ``BLOCK_O x BLOCK_L x BLOCK_I`` tile of up to 4096 elements / 16 KiB (short
rows are batched along ``outer`` so every program moves a full tile); it is sized for the longest
block and shorter blocks mask their surplus programs off.  The dim decompositions are per row
(``BLOCK_O`` vector) and per inner element (``BLOCK_I`` vector), never per tile element.
Interior tiles take an unmasked path; offsets and strides known on the host to be multiples of up
to one 16-byte vector are passed divided by that alignment and multiplied back by a constexpr
(``*_ALIGN``), so the compiler can prove alignment and emit 16-byte vector loads/stores, masked or
not (checked by compiling for sm_90 in the tests; ``tl.multiple_of`` hints on the 3-D tiles
crashed Triton 3.9's coalescing pass).

All copies are bitwise: the data is reinterpreted as the unsigned/signed integer type of the same
width (bool -> uint8, bf16/fp16 -> int16, fp32 -> int32, int64/fp64 -> int64), so no float
conversion (and no NaN canonicalisation) can happen, and fp32 and int32 share a compiled kernel.

Under ``TRITON_INTERPRET=1`` (tests on CPU), ``triton.jit`` returns an ``InterpretedFunction``,
which ``torch.library.wrap_triton`` passes through untraced: ``torch.compile`` then fails with
"Cannot access data pointer of Tensor (e.g. FakeTensor...)".  So under the interpreter we build a
real ``JITFunction`` (which ``wrap_triton`` can trace into a graph) whose ``run`` executes the
interpreter instead of compiling for a GPU.  Eager calls, ``make_fx`` and
``torch.compile(backend="aot_eager")`` then all work on CPU.  The interpreter choice is made when
this module is first imported.
"""

from __future__ import annotations

import collections
import math
import os

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton
from triton.runtime.jit import JITFunction

__all__ = ["INTERPRETED", "block_copy", "interpreting", "int_view_dtype"]

# Work per program (per direction): up to 16 KiB / 4096 elements, i.e. 16 elements (one to four
# 16-byte vectors) per thread at 8 warps; large tiles also keep the interpreter's overhead down.
_TILE_BYTES = 16384
_TILE_ELEMS = 4096  # at most 16 elements per thread at 8 warps
_MAX_DIMS = 4  # source dims per side (outer / inner) after merging; ndim <= 5 always fits
_MAX_GRID = 2**31 - 1

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        try:
            return bool(knobs.runtime.interpret)
        except AttributeError:
            pass
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class _InterpretedJITFunction(JITFunction):
    """A ``JITFunction`` (traceable by ``wrap_triton``) that runs in the Triton interpreter."""

    def __init__(self, fn):
        super().__init__(fn)
        from triton.runtime.interpreter import InterpretedFunction

        self._interpreted = InterpretedFunction(fn)

    def run(self, *args, grid, warmup, **kwargs):
        return self._interpreted.run(*args, grid=grid, warmup=warmup, **kwargs)


def _jit(fn):
    return _InterpretedJITFunction(fn) if interpreting() else triton.jit(fn)


def _block_copy_kernel(
    src_ptr,
    dst_ptr,
    meta_ptr,  # int64 (7, n_blocks): src_start, src_ostride (/ SRC_ALIGN), lead, len,
    #            dst_base, dst_ostride (/ DST_ALIGN), dst_len
    n_blocks,
    n_outer,
    inner,  # / I_ALIGN
    tiles_o,
    tiles_l,
    tiles_i,
    size_o1,
    size_o2,
    size_o3,
    stride_o0,  # / O_ALIGN
    stride_o1,  # / O_ALIGN
    stride_o2,  # / O_ALIGN
    stride_o3,  # / O_ALIGN
    stride_l,  # / L_ALIGN
    size_i1,
    size_i2,
    size_i3,
    stride_i0,
    stride_i1,
    stride_i2,
    stride_i3,
    OUTER_DIMS: tl.constexpr,
    INNER_DIMS: tl.constexpr,
    BLOCK_O: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_I: tl.constexpr,
    SRC_ALIGN: tl.constexpr,
    DST_ALIGN: tl.constexpr,
    O_ALIGN: tl.constexpr,
    L_ALIGN: tl.constexpr,
    I_ALIGN: tl.constexpr,
):
    # Alignment: a quantity q known on the host to be a multiple of A (a power of two up to one
    # 16-byte vector) is passed as q // A and rebuilt here as (q // A) * A with A a constexpr, so
    # the compiler knows its divisibility and can vectorise loads, stores and masks.
    inner = inner * I_ALIGN
    stride_l = stride_l * L_ALIGN

    pid = tl.program_id(0).to(tl.int64)
    t_i = pid % tiles_i
    rest = pid // tiles_i
    t_l = rest % tiles_l
    rest = rest // tiles_l
    t_o = rest % tiles_o
    b = rest // tiles_o

    src_start = tl.load(meta_ptr + b) * SRC_ALIGN  # where row 0 of the block starts in the source
    src_ostride = tl.load(meta_ptr + n_blocks + b) * SRC_ALIGN
    lead = tl.load(meta_ptr + 2 * n_blocks + b)
    length = tl.load(meta_ptr + 3 * n_blocks + b)
    dst_base = tl.load(meta_ptr + 4 * n_blocks + b) * DST_ALIGN
    dst_ostride = tl.load(meta_ptr + 5 * n_blocks + b) * DST_ALIGN
    dst_len = tl.load(meta_ptr + 6 * n_blocks + b)

    # a BLOCK_O x BLOCK_L x BLOCK_I tile of (outer, len, inner)
    o_start = t_o * BLOCK_O
    l_start = t_l * BLOCK_L
    i_start = t_i * BLOCK_I
    offs_o = o_start + tl.arange(0, BLOCK_O)[:, None, None]
    offs_l = l_start + tl.arange(0, BLOCK_L)[None, :, None]
    offs_i = i_start + tl.arange(0, BLOCK_I)[None, None, :]

    # source offset of each outer row (a BLOCK_O vector; as many dims as the source really has)
    if OUTER_DIMS == 1:
        src_o = offs_o * (stride_o3 * O_ALIGN)
    else:
        src_o = (offs_o % size_o3) * (stride_o3 * O_ALIGN)
        q = offs_o // size_o3
        if OUTER_DIMS == 2:
            src_o += q * (stride_o2 * O_ALIGN)
        else:
            src_o += (q % size_o2) * (stride_o2 * O_ALIGN)
            q = q // size_o2
            if OUTER_DIMS == 3:
                src_o += q * (stride_o1 * O_ALIGN)
            else:
                src_o += (q % size_o1) * (stride_o1 * O_ALIGN) + (q // size_o1) * (stride_o0 * O_ALIGN)

    # source offset of each inner element (a BLOCK_I vector)
    if INNER_DIMS == 1:
        src_i = offs_i * stride_i3
    else:
        src_i = (offs_i % size_i3) * stride_i3
        q = offs_i // size_i3
        if INNER_DIMS == 2:
            src_i += q * stride_i2
        else:
            src_i += (q % size_i2) * stride_i2
            q = q // size_i2
            if INNER_DIMS == 3:
                src_i += q * stride_i1
            else:
                src_i += (q % size_i1) * stride_i1 + (q // size_i1) * stride_i0

    src_ptrs = src_ptr + (src_start + offs_o * src_ostride + src_o) + offs_l * stride_l + src_i
    dst_ptrs = dst_ptr + (dst_base + offs_o * dst_ostride) + offs_l * inner + offs_i

    full = ((o_start + BLOCK_O <= n_outer) & (i_start + BLOCK_I <= inner)
            & (l_start >= lead) & (l_start + BLOCK_L <= lead + length))
    if full:  # interior tile: no masks, so nothing limits vectorisation but alignment
        tl.store(dst_ptrs, tl.load(src_ptrs))
    else:
        in_dst = (offs_o < n_outer) & (offs_l < dst_len) & (offs_i < inner)
        in_src = in_dst & (offs_l >= lead) & (offs_l < lead + length)
        tl.store(dst_ptrs, tl.load(src_ptrs, mask=in_src, other=0), mask=in_dst)


block_copy_kernel = _jit(_block_copy_kernel)
#: True when the kernels were built for the CPU interpreter (TRITON_INTERPRET=1 at import time).
INTERPRETED = isinstance(block_copy_kernel, _InterpretedJITFunction)


# --------------------------------------------------------------------------------------------
# host side
# --------------------------------------------------------------------------------------------


def int_view_dtype(dtype: torch.dtype) -> torch.dtype:
    """The integer dtype of the same width, used to copy ``dtype`` bitwise."""
    size = dtype.itemsize
    if size not in _INT_VIEW:
        raise TypeError(f"dtshard_kernels (triton backend): dtype {dtype} ({size}-byte elements) is not "
                        f"supported; supported element sizes are 1, 2, 4 and 8 bytes")
    return _INT_VIEW[size]


def collapse(sizes, strides) -> tuple[list, list]:
    """Drop size-1 dims and merge neighbours that are contiguous with each other (outermost first)."""
    out_s: list = []
    out_t: list = []
    for s, t in zip(sizes, strides):
        if s == 1:
            continue
        if out_s and out_t[-1] == s * t:
            out_s[-1] = out_s[-1] * s
            out_t[-1] = t
        else:
            out_s.append(s)
            out_t.append(t)
    return out_s, out_t


def geometry(x: torch.Tensor, dim: int):
    """``(outer, inner)`` merged ``(sizes, strides)`` of ``x`` around ``dim``, or None if either side
    keeps more than 4 dims (only possible for ndim > 5; the caller then copies ``x`` contiguous)."""
    shape, strides = list(x.shape), list(x.stride())
    outer = collapse(shape[:dim], strides[:dim])
    inner = collapse(shape[dim + 1:], strides[dim + 1:])
    if len(outer[0]) > _MAX_DIMS or len(inner[0]) > _MAX_DIMS:
        return None
    return outer, inner


def _next_pow2(v: int) -> int:
    return 1 if v <= 1 else 1 << (int(v) - 1).bit_length()


def _pow2_divisor(values, cap: int) -> int:
    p = cap
    while p > 1 and any(v % p for v in values):
        p //= 2
    return p


_META_CACHE: "collections.OrderedDict[tuple, torch.Tensor]" = collections.OrderedDict()
_META_CACHE_SIZE = 512


def _meta_tensor(rows, dst: torch.Tensor) -> torch.Tensor:
    """The ``(7, n)`` int64 per-block table on ``dst``'s device.

    On CUDA (eager, real tensors) the tables are cached per (device, contents): a fresh
    ``torch.tensor(..., device="cuda")`` is a synchronous host-to-device copy, which would stall
    the CPU on every call; the same shapes and split sizes recur every step, so after the first
    step no copy is made (which also keeps the ops capturable in CUDA graphs once warmed up).
    Under tracing (fake/functional tensors) the table is a plain graph constant.
    """
    if type(dst) is not torch.Tensor or dst.device.type != "cuda":
        return torch.tensor(rows, dtype=torch.int64, device=dst.device)
    key = (dst.device, tuple(tuple(r) for r in rows))
    meta = _META_CACHE.get(key)
    if meta is None:
        host = torch.tensor(rows, dtype=torch.int64)
        try:
            meta = host.pin_memory().to(dst.device, non_blocking=True)
        except RuntimeError:
            meta = host.to(dst.device)
        _META_CACHE[key] = meta
        if len(_META_CACHE) > _META_CACHE_SIZE:
            _META_CACHE.popitem(last=False)
    else:
        _META_CACHE.move_to_end(key)
    return meta


def block_copy(src: torch.Tensor, dst: torch.Tensor, blocks, *, outer, inner, stride_l,
               n_outer: int, n_inner: int) -> None:
    """Launch the block-copy kernel once.

    ``blocks``: one ``(src_base, src_ostride, lead, len, dst_base, dst_ostride, dst_len)`` tuple per
    block, in elements.  ``outer``/``inner``: merged ``(sizes, strides)`` of the source around the
    copied dim (at most 4 dims each); their sizes multiply to ``n_outer``/``n_inner`` unless the
    outer index is carried by ``src_ostride`` instead (then ``outer`` is empty).
    ``dst`` must be contiguous; ``src`` may be any strided tensor of the same dtype.
    """
    n = len(blocks)
    max_len = max((blk[6] for blk in blocks), default=0)
    if n == 0 or n_outer == 0 or n_inner == 0 or max_len == 0 or dst.numel() == 0:
        return
    if src.numel() == 0:
        src = dst  # nothing is read (every len is 0): any valid pointer of the right dtype will do
    view = int_view_dtype(dst.dtype)
    itemsize = dst.dtype.itemsize

    tile = min(_TILE_ELEMS, _TILE_BYTES // itemsize)
    block_i = min(_next_pow2(n_inner), tile)
    block_l = min(_next_pow2(max_len), tile // block_i)
    block_o = min(_next_pow2(n_outer), tile // (block_i * block_l))
    tiles_i = -(-n_inner // block_i)
    tiles_l = -(-max_len // block_l)
    tiles_o = -(-n_outer // block_o)
    grid = n * tiles_o * tiles_l * tiles_i
    if grid > _MAX_GRID:
        raise ValueError(f"dtshard_kernels (triton backend): copy too large for one launch ({grid} programs)")

    def pad4(sizes_strides):
        sizes, strides = list(sizes_strides[0]), list(sizes_strides[1])
        dims = max(1, len(sizes))
        if not sizes:
            sizes, strides = [1], [0]
        k = _MAX_DIMS - len(sizes)
        return dims, [1] * k + sizes, [0] * k + strides

    outer_dims, o_sizes, o_strides = pad4(outer)
    inner_dims, i_sizes, i_strides = pad4(inner)

    # Alignments (elements, powers of two up to one 16-byte vector), see the kernel.
    vec = max(1, 16 // itemsize)
    starts = [blk[0] - blk[2] * stride_l for blk in blocks]
    src_align = _pow2_divisor(starts + [blk[1] for blk in blocks], vec)
    dst_align = _pow2_divisor([blk[4] for blk in blocks] + [blk[5] for blk in blocks], vec)
    o_align = _pow2_divisor(o_strides, vec)
    l_align = _pow2_divisor([stride_l], vec)
    i_align = _pow2_divisor([n_inner], vec)

    rows = [[s // src_align for s in starts], [blk[1] // src_align for blk in blocks],
            [blk[2] for blk in blocks], [blk[3] for blk in blocks],
            [blk[4] // dst_align for blk in blocks], [blk[5] // dst_align for blk in blocks],
            [blk[6] for blk in blocks]]
    meta = _meta_tensor(rows, dst)
    wrap_triton(block_copy_kernel)[(grid,)](
        src.view(view), dst.view(view), meta,
        n, n_outer, n_inner // i_align, tiles_o, tiles_l, tiles_i,
        o_sizes[1], o_sizes[2], o_sizes[3],
        *[t // o_align for t in o_strides],
        stride_l // l_align,
        i_sizes[1], i_sizes[2], i_sizes[3],
        i_strides[0], i_strides[1], i_strides[2], i_strides[3],
        OUTER_DIMS=outer_dims, INNER_DIMS=inner_dims,
        BLOCK_O=block_o, BLOCK_L=block_l, BLOCK_I=block_i,
        SRC_ALIGN=src_align, DST_ALIGN=dst_align, O_ALIGN=o_align, L_ALIGN=l_align, I_ALIGN=i_align,
        num_warps=max(1, min(8, _next_pow2(block_o * block_l * block_i) // 512)),
    )


def prod(vals) -> int:
    return math.prod(vals) if vals else 1
