"""Pure-PyTorch versions of the packing kernels: the CPU fallback and the test oracle.

Every function here has the signature of its public counterpart in :mod:`dtshard_kernels`
(less the ``backend`` argument), returns NEW contiguous tensors (never views of an input, even
where a view would do) and is made of plain differentiable torch ops (``new_empty``, ``narrow``,
``copy_``, ``zero_``, ``clone``), so autograd, ``torch.compile`` and every dtype and device work.
Each function writes every output byte once and reads every needed input byte once (no
intermediate ``contiguous()``/``cat`` copies), so the CPU fallback is also a one-pass copy.

The argument checkers (``_check_*``) are shared with the Triton backend: they normalise negative
dims, turn ``sizes`` into a list and raise ``ValueError`` naming the function, shape, dim and
sizes.  This module must stay importable without triton and must do no work at import time.
"""

from __future__ import annotations

import numbers
from typing import Sequence

import torch

__all__ = ["pack", "unpack", "a2a_pack", "a2a_unpack", "slice_copy", "halo_cat", "halo_split"]

_PREFIX = "dtshard_kernels"


# --------------------------------------------------------------------------------------------
# argument checking (shared with the triton backend)
# --------------------------------------------------------------------------------------------


def _err(fn: str, msg: str) -> ValueError:
    return ValueError(f"{_PREFIX}.{fn}: {msg}")


def _is_int(v) -> bool:
    return type(v) is int or (isinstance(v, (numbers.Integral, torch.SymInt)) and not isinstance(v, bool))


def _int(v):
    """A python int (numpy integers converted; SymInts kept symbolic)."""
    return v if isinstance(v, (int, torch.SymInt)) else int(v)


def _shape_str(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


def _check_tensor(fn: str, name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise _err(fn, f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _norm_dim(fn: str, dim, ndim: int, shape, what: str = "x") -> int:
    if type(dim) is int and 0 <= dim < ndim:
        return dim  # the common case, checked cheaply
    if not _is_int(dim):
        raise _err(fn, f"dim must be an int, got {dim!r} ({type(dim).__name__})")
    if ndim < 1:
        raise _err(fn, f"{what} must have at least 1 dim, got shape {_shape_str(shape)} (dim {dim})")
    if not -ndim <= dim < ndim:
        raise _err(fn, f"dim {dim} out of range for {what} of shape {_shape_str(shape)} (ndim {ndim})")
    return _int(dim + ndim if dim < 0 else dim)


def _check_size_list(fn: str, sizes, shape, dim, what: str = "sizes") -> list:
    if type(sizes) in (list, tuple) and all(type(s) is int and s >= 0 for s in sizes):
        return list(sizes)  # the common case, checked cheaply
    if isinstance(sizes, torch.Tensor) or not isinstance(sizes, Sequence) or isinstance(sizes, str):
        raise _err(fn, f"{what} must be a list of ints, got {sizes!r} (shape {_shape_str(shape)}, dim {dim})")
    sizes = list(sizes)
    for s in sizes:
        if not _is_int(s):
            raise _err(fn, f"{what} must be a list of ints, got {sizes!r} (shape {_shape_str(shape)}, dim {dim})")
        if s < 0:
            raise _err(fn, f"{what} must be >= 0, got {sizes!r} (shape {_shape_str(shape)}, dim {dim})")
    return [_int(s) for s in sizes]


def _check_nonneg(fn: str, name: str, v, shape, dim) -> None:
    if not _is_int(v) or v < 0:
        raise _err(fn, f"{name} must be an int >= 0, got {v!r} (shape {_shape_str(shape)}, dim {dim})")


def _check_pack(x, dim, sizes, block, fn: str = "pack"):
    _check_tensor(fn, "x", x)
    shape = tuple(x.shape)
    dim = _norm_dim(fn, dim, x.dim(), shape)
    sizes = _check_size_list(fn, sizes, shape, dim)
    if sum(sizes) != shape[dim]:
        raise _err(fn, f"sizes {sizes} sum to {sum(sizes)} but x.shape[{dim}] == {shape[dim]} "
                       f"(shape {_shape_str(shape)}, dim {dim})")
    biggest = max(sizes, default=0)
    if block is None:
        block = biggest
    elif not _is_int(block) or block < biggest:
        raise _err(fn, f"block must be an int >= max(sizes) == {biggest}, got {block!r} "
                       f"(shape {_shape_str(shape)}, dim {dim}, sizes {sizes})")
    return dim, sizes, _int(block)


def _check_unpack(buf, dim, sizes, fn: str = "unpack"):
    _check_tensor(fn, "buf", buf)
    shape = tuple(buf.shape)
    if buf.dim() < 2:
        raise _err(fn, f"buf must have shape (n, *block_shape) with at least 2 dims, got shape "
                       f"{_shape_str(shape)} (dim {dim})")
    dim = _norm_dim(fn, dim, buf.dim() - 1, shape[1:], what="the block (buf.shape[1:])")
    sizes = _check_size_list(fn, sizes, shape, dim)
    if len(sizes) != shape[0]:
        raise _err(fn, f"len(sizes) == {len(sizes)} but buf holds {shape[0]} blocks "
                       f"(buf shape {_shape_str(shape)}, dim {dim}, sizes {sizes})")
    block = shape[dim + 1]
    if max(sizes, default=0) > block:
        raise _err(fn, f"sizes {sizes} exceed the block length {block} along dim {dim} "
                       f"(buf shape {_shape_str(shape)})")
    return dim, sizes


def _check_a2a_unpack(flat, shape, dim, sizes, fn: str = "a2a_unpack"):
    _check_tensor(fn, "flat", flat)
    if isinstance(shape, torch.Size):
        shape = list(shape)
    shape = _check_size_list(fn, shape, shape, dim, what="shape")
    dim = _norm_dim(fn, dim, len(shape), shape, what="shape")
    sizes = _check_size_list(fn, sizes, shape, dim)
    if flat.dim() != 1:
        raise _err(fn, f"flat must be 1-D, got shape {_shape_str(tuple(flat.shape))} "
                       f"(shape {_shape_str(shape)}, dim {dim}, sizes {sizes})")
    per = 1
    for k, s in enumerate(shape):
        if k != dim:
            per *= s
    if flat.shape[0] != per * sum(sizes):
        raise _err(fn, f"flat has {flat.shape[0]} elements but pieces of shape {_shape_str(shape)} with "
                       f"dim {dim} of lengths {sizes} hold {per * sum(sizes)}")
    return dim, shape, sizes


def _check_slice(x, dim, start, length, fn: str = "slice_copy"):
    _check_tensor(fn, "x", x)
    shape = tuple(x.shape)
    dim = _norm_dim(fn, dim, x.dim(), shape)
    n = shape[dim]
    if not _is_int(start) or not _is_int(length):
        raise _err(fn, f"start and length must be ints, got start={start!r}, length={length!r} "
                       f"(shape {_shape_str(shape)}, dim {dim})")
    start, length = _int(start), _int(length)
    if start < 0:
        start = start + n  # narrow() semantics
    if start < 0 or length < 0 or start + length > n:
        raise _err(fn, f"range [start, start + length) = [{start}, {start + length}) is outside "
                       f"[0, {n}] (shape {_shape_str(shape)}, dim {dim})")
    return dim, start, length


def _check_halo_cat(parts, dim, pad_left, pad_right, fn: str = "halo_cat"):
    if isinstance(parts, torch.Tensor) or not isinstance(parts, Sequence) or len(parts) == 0:
        raise _err(fn, f"parts must be a non-empty list of tensors, got {type(parts).__name__}")
    parts = list(parts)
    for k, p in enumerate(parts):
        _check_tensor(fn, f"parts[{k}]", p)
    p0 = parts[0]
    shape0 = tuple(p0.shape)
    dim = _norm_dim(fn, dim, p0.dim(), shape0, what="parts[0]")
    for k, p in enumerate(parts):
        s = tuple(p.shape)
        if p.dim() != p0.dim() or any(a != b for j, (a, b) in enumerate(zip(s, shape0)) if j != dim):
            raise _err(fn, f"parts must agree on all dims but dim {dim}: parts[0] has shape "
                           f"{_shape_str(shape0)}, parts[{k}] has shape {_shape_str(s)}")
        if p.dtype != p0.dtype or p.device != p0.device:
            raise _err(fn, f"parts must share dtype and device: parts[0] is {p0.dtype} on {p0.device}, "
                           f"parts[{k}] is {p.dtype} on {p.device}")
    _check_nonneg(fn, "pad_left", pad_left, shape0, dim)
    _check_nonneg(fn, "pad_right", pad_right, shape0, dim)
    return parts, dim, _int(pad_left), _int(pad_right)


def _check_halo_split(grad, dim, sizes, pad_left, pad_right, fn: str = "halo_split"):
    _check_tensor(fn, "grad", grad)
    shape = tuple(grad.shape)
    dim = _norm_dim(fn, dim, grad.dim(), shape, what="grad")
    sizes = _check_size_list(fn, sizes, shape, dim)
    _check_nonneg(fn, "pad_left", pad_left, shape, dim)
    _check_nonneg(fn, "pad_right", pad_right, shape, dim)
    if pad_left + sum(sizes) + pad_right != shape[dim]:
        raise _err(fn, f"pad_left {pad_left} + sum(sizes {sizes}) + pad_right {pad_right} == "
                       f"{pad_left + sum(sizes) + pad_right} but grad.shape[{dim}] == {shape[dim]} "
                       f"(shape {_shape_str(shape)}, dim {dim})")
    return dim, sizes, _int(pad_left), _int(pad_right)


def _with(shape, dim: int, v) -> list:
    s = list(shape)
    s[dim] = v
    return s


def _numel_except(shape, dim: int):
    n = 1
    for k, s in enumerate(shape):
        if k != dim:
            n *= s
    return n


# --------------------------------------------------------------------------------------------
# the reference implementations
# --------------------------------------------------------------------------------------------


def pack(x: torch.Tensor, dim: int, sizes: Sequence[int], block: int | None = None) -> torch.Tensor:
    """Split ``x`` along ``dim`` into blocks of lengths ``sizes``, zero-pad each to ``block``, stack.

    Returns shape ``(len(sizes), *x.shape with dim replaced by block)``.
    """
    return _pack(x, *_check_pack(x, dim, sizes, block))


def unpack(buf: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Inverse of :func:`pack`: ``cat([buf[r].narrow(dim, 0, sizes[r]) for r], dim)``."""
    return _unpack(buf, *_check_unpack(buf, dim, sizes))


def a2a_pack(x: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """1-D concatenation of ``x.narrow(dim, off_r, sizes[r]).contiguous().reshape(-1)`` over r."""
    dim, sizes, _ = _check_pack(x, dim, sizes, None, fn="a2a_pack")
    return _a2a_pack(x, dim, sizes)


def a2a_unpack(flat: torch.Tensor, shape: Sequence[int], dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Inverse of receiving an :func:`a2a_pack` buffer.

    ``flat`` concatenates, over r, contiguous pieces of shape ``shape`` with ``shape[dim]``
    replaced by ``sizes[r]`` (``shape[dim]`` itself is ignored); the result is their
    concatenation along ``dim``.
    """
    dim, shape, sizes = _check_a2a_unpack(flat, shape, dim, sizes)
    return _a2a_unpack(flat, shape, dim, sizes)


def slice_copy(x: torch.Tensor, dim: int, start: int, length: int) -> torch.Tensor:
    """``x.narrow(dim, start, length)`` copied into a new contiguous tensor."""
    return _slice_copy(x, *_check_slice(x, dim, start, length))


def halo_cat(parts: Sequence[torch.Tensor], dim: int, pad_left: int, pad_right: int) -> torch.Tensor:
    """``cat([zeros(pad_left), *parts, zeros(pad_right)], dim)`` into one new contiguous buffer."""
    return _halo_cat(*_check_halo_cat(parts, dim, pad_left, pad_right))


def halo_split(grad: torch.Tensor, dim: int, sizes: Sequence[int], pad_left: int, pad_right: int) -> list[torch.Tensor]:
    """Adjoint of :func:`halo_cat`: drop the pads along ``dim``, split into contiguous pieces."""
    return _halo_split(grad, *_check_halo_split(grad, dim, sizes, pad_left, pad_right))


# The unchecked implementations (arguments already normalised by the _check_* functions; the
# public dtshard_kernels functions call these after checking once).


def _pack(x, dim, sizes, block):
    out = x.new_empty([len(sizes), *_with(x.shape, dim, block)])
    k, b = _leading_run(sizes)  # a run of full blocks: one strided copy
    if not k or b != block:
        k = 0
    if k:
        out[:k].copy_(x.narrow(dim, 0, k * block).unflatten(dim, (k, block)).movedim(dim, 0))
    off = k * block
    for r in range(k, len(sizes)):
        s = sizes[r]
        dst = out[r]
        if s:
            dst.narrow(dim, 0, s).copy_(x.narrow(dim, off, s))
        if block - s:
            dst.narrow(dim, s, block - s).zero_()
        off += s
    return out


def _unpack(buf, dim, sizes):
    block = buf.shape[dim + 1]
    out = buf.new_empty(_with(buf.shape[1:], dim, sum(sizes)))
    # the leading run of full blocks lands in ONE strided copy (the blocks' axis moved next to
    # ``dim``; see _leading_run)
    full, b = _leading_run(sizes)
    if full and b == block:
        out.narrow(dim, 0, full * block).unflatten(dim, (full, block)).copy_(buf[:full].movedim(0, dim))
    else:
        full = 0
    off = full * block
    for r in range(full, len(sizes)):
        s = sizes[r]
        if s:
            out.narrow(dim, off, s).copy_(buf[r].narrow(dim, 0, s))
        off += s
    return out


def _leading_run(sizes) -> tuple[int, int]:
    """(k, b): the first ``k`` sizes all equal ``b > 0`` (k >= 2), else (0, 0).  A chunk layout
    (torch.chunk: full chunks, one short, empty ones) is mostly such a run, and moving the run as
    ONE strided copy costs one kernel where a copy per piece costs one per rank of the group."""
    if len(sizes) < 2 or not sizes[0]:
        return 0, 0
    k = 1
    while k < len(sizes) and sizes[k] == sizes[0]:
        k += 1
    return (k, sizes[0]) if k >= 2 else (0, 0)


def _a2a_pack(x, dim, sizes):
    per = _numel_except(x.shape, dim)
    out = x.new_empty([per * sum(sizes)])
    k, b = _leading_run(sizes) if per else (0, 0)
    if k:
        out.narrow(0, 0, per * k * b).view(k, *_with(x.shape, dim, b)).copy_(
            x.narrow(dim, 0, k * b).unflatten(dim, (k, b)).movedim(dim, 0))
        sizes = sizes[k:]
    off = k * b
    for s in sizes:
        if s and per:
            out.narrow(0, per * off, per * s).view(_with(x.shape, dim, s)).copy_(x.narrow(dim, off, s))
        off += s
    return out


def _a2a_unpack(flat, shape, dim, sizes):
    per = _numel_except(shape, dim)
    out = flat.new_empty(_with(shape, dim, sum(sizes)))
    k, b = _leading_run(sizes) if per else (0, 0)
    if k:
        out.narrow(dim, 0, k * b).unflatten(dim, (k, b)).copy_(
            flat.narrow(0, 0, per * k * b).view(k, *_with(shape, dim, b)).movedim(0, dim))
        sizes = sizes[k:]
    off = k * b
    for s in sizes:
        if s and per:
            out.narrow(dim, off, s).copy_(flat.narrow(0, per * off, per * s).view(_with(shape, dim, s)))
        off += s
    return out


def _slice_copy(x, dim, start, length):
    return x.narrow(dim, start, length).clone(memory_format=torch.contiguous_format)


def _halo_cat(parts, dim, pad_left, pad_right):
    total = pad_left + sum(p.shape[dim] for p in parts) + pad_right
    out = parts[0].new_empty(_with(parts[0].shape, dim, total))
    if pad_left:
        out.narrow(dim, 0, pad_left).zero_()
    off = pad_left
    for p in parts:
        s = p.shape[dim]
        if s:
            out.narrow(dim, off, s).copy_(p)
        off += s
    if pad_right:
        out.narrow(dim, off, pad_right).zero_()
    return out


def _halo_split(grad, dim, sizes, pad_left, pad_right):
    out = []
    off = pad_left
    for s in sizes:
        out.append(grad.narrow(dim, off, s).clone(memory_format=torch.contiguous_format))
        off += s
    return out
