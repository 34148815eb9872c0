"""The ``torch.ops.dtshard.*`` Triton ops (``torch.library.triton_op``) and their Python wrappers.

Each op validates its arguments (the checkers of :mod:`..reference`), allocates a new contiguous
output and launches :func:`.copy_kernels.block_copy` once (``halo_cat``: once per part).  Because
they are ``triton_op``s whose kernels are launched through ``wrap_triton``, ``torch.compile``
traces through them (with Inductor, the kernel calls are inlined into the compiled graph).

Autograd: each op has a backward made of its adjoint op (pack <-> unpack, a2a_pack <->
a2a_unpack, slice_copy -> zero-padding via halo_cat, halo_cat <-> halo_split), registered with
``register_autograd``.  The backward is not needed for correctness of the forward and is tested
against the reference's autograd.

``torch.ops.dtshard.halo_split`` returns the FLAT concatenation of the pieces (one new buffer);
the Python wrapper :func:`halo_split` splits it into contiguous views of that buffer.  (A custom
op may not return outputs that alias each other.)
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.library import triton_op

from ..reference import (
    _check_a2a_unpack,
    _check_halo_cat,
    _check_halo_split,
    _check_pack,
    _check_slice,
    _check_unpack,
    _numel_except,
    _with,
)
from .copy_kernels import block_copy, geometry, prod

__all__ = ["pack", "unpack", "a2a_pack", "a2a_unpack", "slice_copy", "halo_cat", "halo_split", "OP_NAMES"]

OP_NAMES = ("pack", "unpack", "a2a_pack", "a2a_unpack", "slice_copy", "halo_cat", "halo_split")


def _ready(x: torch.Tensor, dim: int):
    """``x`` (made contiguous if it has too many unmergeable dims) and its outer/inner geometry."""
    geo = geometry(x, dim)
    if geo is None:  # ndim > 5 with unmergeable strides: one extra pass
        x = x.contiguous()
        geo = geometry(x, dim)
    return x, geo[0], geo[1]


# --------------------------------------------------------------------------------------------
# the ops
# --------------------------------------------------------------------------------------------


@triton_op("dtshard::pack", mutates_args=())
def _pack(x: torch.Tensor, dim: int, sizes: list[int], block: Optional[int] = None) -> torch.Tensor:
    dim, sizes, block = _check_pack(x, dim, sizes, block)
    out = x.new_empty([len(sizes), *_with(x.shape, dim, block)])
    if out.numel() == 0:
        return out
    x, outer, inner = _ready(x, dim)
    n_outer, n_inner = prod(x.shape[:dim]), prod(x.shape[dim + 1:])
    st = x.stride(dim)
    blocks, off = [], 0
    for r, s in enumerate(sizes):
        blocks.append((off * st, 0, 0, s, r * n_outer * block * n_inner, block * n_inner, block))
        off += s
    block_copy(x, out, blocks, outer=outer, inner=inner, stride_l=st, n_outer=n_outer, n_inner=n_inner)
    return out


@triton_op("dtshard::unpack", mutates_args=())
def _unpack(buf: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
    dim, sizes = _check_unpack(buf, dim, sizes)
    total = sum(sizes)
    out = buf.new_empty(_with(buf.shape[1:], dim, total))
    if out.numel() == 0:
        return out
    buf0 = buf.select(0, 0)
    if geometry(buf0, dim) is None:
        buf = buf.contiguous()
        buf0 = buf.select(0, 0)
    _, outer, inner = _ready(buf0, dim)
    n_outer, n_inner = prod(buf0.shape[:dim]), prod(buf0.shape[dim + 1:])
    st = buf0.stride(dim)
    blocks, off = [], 0
    for r, s in enumerate(sizes):
        blocks.append((r * buf.stride(0), 0, 0, s, off * n_inner, total * n_inner, s))
        off += s
    block_copy(buf, out, blocks, outer=outer, inner=inner, stride_l=st, n_outer=n_outer, n_inner=n_inner)
    return out


@triton_op("dtshard::a2a_pack", mutates_args=())
def _a2a_pack(x: torch.Tensor, dim: int, sizes: list[int]) -> torch.Tensor:
    dim, sizes, _ = _check_pack(x, dim, sizes, None, fn="a2a_pack")
    out = x.new_empty([_numel_except(x.shape, dim) * sum(sizes)])
    if out.numel() == 0:
        return out
    x, outer, inner = _ready(x, dim)
    n_outer, n_inner = prod(x.shape[:dim]), prod(x.shape[dim + 1:])
    st = x.stride(dim)
    blocks, off = [], 0
    for s in sizes:
        blocks.append((off * st, 0, 0, s, n_outer * off * n_inner, s * n_inner, s))
        off += s
    block_copy(x, out, blocks, outer=outer, inner=inner, stride_l=st, n_outer=n_outer, n_inner=n_inner)
    return out


@triton_op("dtshard::a2a_unpack", mutates_args=())
def _a2a_unpack(flat: torch.Tensor, shape: list[int], dim: int, sizes: list[int]) -> torch.Tensor:
    dim, shape, sizes = _check_a2a_unpack(flat, shape, dim, sizes)
    total = sum(sizes)
    out = flat.new_empty(_with(shape, dim, total))
    if out.numel() == 0:
        return out
    n_outer, n_inner = prod(shape[:dim]), prod(shape[dim + 1:])
    k = flat.stride(0)
    # the pieces are contiguous (outer, s, inner) blocks of flat: the outer index is carried by the
    # per-block outer stride, the inner dims are one dim of stride k
    inner = ([n_inner], [k]) if n_inner > 1 else ([], [])
    blocks, off = [], 0
    for s in sizes:
        blocks.append((n_outer * off * n_inner * k, s * n_inner * k, 0, s, off * n_inner, total * n_inner, s))
        off += s
    block_copy(flat, out, blocks, outer=([], []), inner=inner, stride_l=n_inner * k,
               n_outer=n_outer, n_inner=n_inner)
    return out


@triton_op("dtshard::slice_copy", mutates_args=())
def _slice_copy(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    dim, start, length = _check_slice(x, dim, start, length)
    out = x.new_empty(_with(x.shape, dim, length))
    if out.numel() == 0:
        return out
    x, outer, inner = _ready(x, dim)
    n_outer, n_inner = prod(x.shape[:dim]), prod(x.shape[dim + 1:])
    st = x.stride(dim)
    blocks = [(start * st, 0, 0, length, 0, length * n_inner, length)]
    block_copy(x, out, blocks, outer=outer, inner=inner, stride_l=st, n_outer=n_outer, n_inner=n_inner)
    return out


@triton_op("dtshard::halo_cat", mutates_args=())
def _halo_cat(parts: list[torch.Tensor], dim: int, pad_left: int, pad_right: int) -> torch.Tensor:
    parts, dim, pad_left, pad_right = _check_halo_cat(parts, dim, pad_left, pad_right)
    lengths = [p.shape[dim] for p in parts]
    total = pad_left + sum(lengths) + pad_right
    out = parts[0].new_empty(_with(parts[0].shape, dim, total))
    if out.numel() == 0:
        return out
    n_outer, n_inner = prod(out.shape[:dim]), prod(out.shape[dim + 1:])
    start = pad_left
    last = len(parts) - 1
    for k, p in enumerate(parts):
        s = lengths[k]
        lead = pad_left if k == 0 else 0  # the zero halos ride along with the first/last part
        trail = pad_right if k == last else 0
        if s + lead + trail:
            p, outer, inner = _ready(p, dim)
            st = p.stride(dim)
            blocks = [(0, 0, lead, s, (start - lead) * n_inner, total * n_inner, lead + s + trail)]
            block_copy(p, out, blocks, outer=outer, inner=inner, stride_l=st, n_outer=n_outer, n_inner=n_inner)
        start += s
    return out


@triton_op("dtshard::halo_split", mutates_args=())
def _halo_split(grad: torch.Tensor, dim: int, sizes: list[int], pad_left: int, pad_right: int) -> torch.Tensor:
    dim, sizes, pad_left, pad_right = _check_halo_split(grad, dim, sizes, pad_left, pad_right)
    out = grad.new_empty([_numel_except(grad.shape, dim) * sum(sizes)])
    if out.numel() == 0:
        return out
    grad, outer, inner = _ready(grad, dim)
    n_outer, n_inner = prod(grad.shape[:dim]), prod(grad.shape[dim + 1:])
    st = grad.stride(dim)
    blocks, off = [], 0
    for s in sizes:
        blocks.append(((pad_left + off) * st, 0, 0, s, n_outer * off * n_inner, s * n_inner, s))
        off += s
    block_copy(grad, out, blocks, outer=outer, inner=inner, stride_l=st, n_outer=n_outer, n_inner=n_inner)
    return out


def _split_flat(flat: torch.Tensor, shape, dim: int, sizes) -> list[torch.Tensor]:
    per = _numel_except(shape, dim)
    pieces, off = [], 0
    for s in sizes:
        pieces.append(flat.narrow(0, per * off, per * s).view(_with(shape, dim, s)))
        off += s
    return pieces


# --------------------------------------------------------------------------------------------
# autograd: each backward is the adjoint op
# --------------------------------------------------------------------------------------------


def _pack_setup(ctx, inputs, output):
    x, dim, sizes, block = inputs
    ctx.dim, ctx.sizes, _ = _check_pack(x, dim, sizes, block)


def _pack_bwd(ctx, grad):
    return torch.ops.dtshard.unpack(grad, ctx.dim, ctx.sizes), None, None, None


def _unpack_setup(ctx, inputs, output):
    buf, dim, sizes = inputs
    ctx.dim, ctx.sizes = _check_unpack(buf, dim, sizes)
    ctx.block = buf.shape[ctx.dim + 1]


def _unpack_bwd(ctx, grad):
    return torch.ops.dtshard.pack(grad, ctx.dim, ctx.sizes, ctx.block), None, None


def _a2a_pack_setup(ctx, inputs, output):
    x, dim, sizes = inputs
    ctx.dim, ctx.sizes, _ = _check_pack(x, dim, sizes, None, fn="a2a_pack")
    ctx.shape = list(x.shape)


def _a2a_pack_bwd(ctx, grad):
    return torch.ops.dtshard.a2a_unpack(grad, ctx.shape, ctx.dim, ctx.sizes), None, None


def _a2a_unpack_setup(ctx, inputs, output):
    flat, shape, dim, sizes = inputs
    ctx.dim, _, ctx.sizes = _check_a2a_unpack(flat, shape, dim, sizes)


def _a2a_unpack_bwd(ctx, grad):
    return torch.ops.dtshard.a2a_pack(grad, ctx.dim, ctx.sizes), None, None, None


def _slice_setup(ctx, inputs, output):
    x, dim, start, length = inputs
    ctx.dim, ctx.start, ctx.length = _check_slice(x, dim, start, length)
    ctx.full = x.shape[ctx.dim]


def _slice_bwd(ctx, grad):
    right = ctx.full - ctx.start - ctx.length
    return torch.ops.dtshard.halo_cat([grad], ctx.dim, ctx.start, right), None, None, None


def _halo_cat_setup(ctx, inputs, output):
    parts, dim, pad_left, pad_right = inputs
    parts, ctx.dim, pl, pr = _check_halo_cat(parts, dim, pad_left, pad_right)
    ctx.sizes = [p.shape[ctx.dim] for p in parts]
    ctx.shape = list(parts[0].shape)
    ctx.pads = (pl, pr)


def _halo_cat_bwd(ctx, grad):
    flat = torch.ops.dtshard.halo_split(grad, ctx.dim, ctx.sizes, *ctx.pads)
    return _split_flat(flat, ctx.shape, ctx.dim, ctx.sizes), None, None, None


def _halo_split_setup(ctx, inputs, output):
    grad, dim, sizes, pad_left, pad_right = inputs
    ctx.dim, ctx.sizes, pl, pr = _check_halo_split(grad, dim, sizes, pad_left, pad_right)
    ctx.shape = list(grad.shape)
    ctx.pads = (pl, pr)


def _halo_split_bwd(ctx, grad_flat):
    pieces = _split_flat(grad_flat, ctx.shape, ctx.dim, ctx.sizes)
    return torch.ops.dtshard.halo_cat(pieces, ctx.dim, *ctx.pads), None, None, None, None


_pack.register_autograd(_pack_bwd, setup_context=_pack_setup)
_unpack.register_autograd(_unpack_bwd, setup_context=_unpack_setup)
_a2a_pack.register_autograd(_a2a_pack_bwd, setup_context=_a2a_pack_setup)
_a2a_unpack.register_autograd(_a2a_unpack_bwd, setup_context=_a2a_unpack_setup)
_slice_copy.register_autograd(_slice_bwd, setup_context=_slice_setup)
_halo_cat.register_autograd(_halo_cat_bwd, setup_context=_halo_cat_setup)
_halo_split.register_autograd(_halo_split_bwd, setup_context=_halo_split_setup)


# --------------------------------------------------------------------------------------------
# Python wrappers with the public signatures (less ``backend``)
# --------------------------------------------------------------------------------------------


def pack(x, dim, sizes, block=None):
    return torch.ops.dtshard.pack(x, dim, list(sizes), block)


def unpack(buf, dim, sizes):
    return torch.ops.dtshard.unpack(buf, dim, list(sizes))


def a2a_pack(x, dim, sizes):
    return torch.ops.dtshard.a2a_pack(x, dim, list(sizes))


def a2a_unpack(flat, shape, dim, sizes):
    return torch.ops.dtshard.a2a_unpack(flat, list(shape), dim, list(sizes))


def slice_copy(x, dim, start, length):
    return torch.ops.dtshard.slice_copy(x, dim, start, length)


def halo_cat(parts, dim, pad_left, pad_right):
    return torch.ops.dtshard.halo_cat(list(parts), dim, pad_left, pad_right)


def halo_split(grad, dim, sizes, pad_left, pad_right):
    sizes = list(sizes)
    flat = torch.ops.dtshard.halo_split(grad, dim, sizes, pad_left, pad_right)
    d = dim + grad.dim() if dim < 0 else dim
    return _split_flat(flat, grad.shape, d, sizes)
