"""dtshard_kernels: one-pass packing copies around collectives.

Public functions (all return NEW contiguous tensors, never views of an input; ``sizes`` are lists
of ints; negative dims are normalised; bad arguments raise ``ValueError`` naming the function,
shape, dim and sizes):

- :func:`pack` ``(x, dim, sizes, block=None)`` -> ``(n, *x.shape with dim -> block)``: split along
  ``dim`` into blocks of lengths ``sizes``, zero-pad each to ``block`` (default ``max(sizes)``),
  stack.  Input of uneven all_gather / reduce_scatter on dim != 0.
- :func:`unpack` ``(buf, dim, sizes)``: inverse of :func:`pack`,
  ``cat([buf[r].narrow(dim, 0, sizes[r]) for r], dim)``.
- :func:`a2a_pack` ``(x, dim, sizes)`` -> 1-D: concatenation of the flattened (contiguous) pieces
  ``x.narrow(dim, off_r, sizes[r])``, no padding (all_to_all_single with uneven splits).
- :func:`a2a_unpack` ``(flat, shape, dim, sizes)``: ``flat`` concatenates contiguous pieces of shape
  ``shape`` with ``shape[dim] -> sizes[r]``; returns their concatenation along ``dim``.
- :func:`slice_copy` ``(x, dim, start, length)``: ``x.narrow(dim, start, length)`` copied.
- :func:`halo_cat` ``(parts, dim, pad_left, pad_right)``: ``cat([0s, *parts, 0s], dim)``;
  :func:`halo_split` ``(grad, dim, sizes, pad_left, pad_right)`` -> list: its adjoint.

Backends (argument ``backend``, or the ``DTSHARD_KERNELS`` environment variable when it is None):

- ``auto`` (default): Triton for CUDA tensors when triton imports, the reference otherwise;
- ``reference``: :mod:`dtshard_kernels.reference`, plain differentiable torch ops (any device);
- ``triton``: :mod:`dtshard_kernels.triton` (``torch.ops.dtshard.*``, traceable by
  ``torch.compile``, bitwise-equal to the reference, with backward formulas registered).  On CPU
  tensors only when ``TRITON_INTERPRET=1`` (Triton's interpreter, set before the first use).

Importing this package needs neither triton nor a GPU and does no work; the Triton backend is
imported on first use.  To call the ops inside ``torch.compile(fullgraph=True)`` with the Triton
backend, import :mod:`dtshard_kernels.triton` before compiling (an import inside the traced
region is a graph break).
"""

from __future__ import annotations

# The package lives in kernels/dtshard_kernels/ of the repository; kernels/ is no package, but from the
# repository root (without PyPI's `kernels` installed) Python would still import this folder as
# `kernels.dtshard_kernels`: a second copy whose torch.library ops would clash with the first.
if __name__ != "dtshard_kernels":
    raise ImportError(f"{__name__}: import this package as `dtshard_kernels` (pip install -e . in the "
                      "repository root installs it under that name), never through the kernels/ folder")

import importlib
import os
import warnings
from typing import Sequence

import torch

from . import reference

__all__ = [
    "pack",
    "unpack",
    "a2a_pack",
    "a2a_unpack",
    "slice_copy",
    "halo_cat",
    "halo_split",
    "resolve_backend",
    "triton_available",
    "BACKENDS",
    "ENV_VAR",
]

BACKENDS = ("auto", "reference", "triton")
ENV_VAR = "DTSHARD_KERNELS"

_triton_mod = None  # the imported dtshard_kernels.triton package, once loaded
_triton_err: BaseException | None = None  # why importing it failed, once tried


def _set_triton_backend(mod) -> None:
    """Called by dtshard_kernels.triton when it is imported (directly or by _load_triton), so that
    later calls find it in a global: no import is traced inside torch.compile."""
    global _triton_mod
    _triton_mod = mod


def _load_triton():
    global _triton_mod, _triton_err
    if _triton_mod is None and _triton_err is None:
        try:
            _triton_mod = importlib.import_module(".triton", __name__)
        except Exception as e:  # ImportError, or a broken triton install
            _triton_err = e
            warnings.warn(f"dtshard_kernels: the Triton backend is unavailable ({e!r}); "
                          f"using the PyTorch reference", RuntimeWarning, stacklevel=3)
    return _triton_mod


def triton_available() -> bool:
    """Whether the Triton backend can be imported (imports it, once)."""
    return _load_triton() is not None


def resolve_backend(t: torch.Tensor, backend: str | None = None, fn: str = "resolve_backend") -> str:
    """The backend (``"reference"`` or ``"triton"``) that a call on tensor ``t`` would use."""
    name = backend if backend is not None else os.environ.get(ENV_VAR, "auto")
    if name == "auto" and t.device.type == "cpu":
        return "reference"  # the common CPU case, decided without the checks below
    if not isinstance(name, str) or name.strip().lower() not in BACKENDS:
        src = "backend" if backend is not None else f"${ENV_VAR}"
        raise ValueError(f"dtshard_kernels.{fn}: {src} must be one of {', '.join(BACKENDS)}, got {name!r}")
    name = name.strip().lower()
    if name == "reference":
        return "reference"
    if name == "auto":
        return "triton" if t.device.type == "cuda" and _load_triton() is not None else "reference"
    # explicit triton
    if t.device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise RuntimeError(
                f"dtshard_kernels.{fn}: backend 'triton' on a CPU tensor needs Triton's interpreter: "
                f"set TRITON_INTERPRET=1 before importing triton (or use backend='reference'/'auto')")
    elif t.device.type != "cuda":
        raise RuntimeError(f"dtshard_kernels.{fn}: backend 'triton' needs a CUDA tensor (or a CPU tensor "
                           f"with TRITON_INTERPRET=1), got a tensor on {t.device}")
    mod = _load_triton()
    if mod is None:
        raise RuntimeError(f"dtshard_kernels.{fn}: backend 'triton' requested but triton could not be "
                           f"imported: {_triton_err!r}")
    if t.device.type == "cpu" and not mod.INTERPRETED:
        raise RuntimeError(
            f"dtshard_kernels.{fn}: backend 'triton' on a CPU tensor, but dtshard_kernels.triton was imported "
            f"before TRITON_INTERPRET=1 was set, so its kernels were compiled for a GPU")
    return "triton"


def _use_triton(fn: str, t, backend) -> bool:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"dtshard_kernels.{fn}: expected a torch.Tensor, got {type(t).__name__}")
    return resolve_backend(t, backend, fn) == "triton"


# Each function checks its arguments once (reference._check_*: ValueError naming the function,
# shape, dim and sizes), then runs the Triton op or the unchecked reference implementation.


def pack(x: torch.Tensor, dim: int, sizes: Sequence[int], block: int | None = None,
         backend: str | None = None) -> torch.Tensor:
    """Split ``x`` along ``dim`` into consecutive blocks of lengths ``sizes`` (summing to
    ``x.shape[dim]``, zeros allowed), zero-pad each along ``dim`` to ``block`` (default
    ``max(sizes)``, must be ``>= max(sizes)``) and stack: shape ``(len(sizes), *x.shape with dim
    replaced by block)``."""
    triton = _use_triton("pack", x, backend)
    dim, sizes, block = reference._check_pack(x, dim, sizes, block)
    return (_triton_mod.pack if triton else reference._pack)(x, dim, sizes, block)


def unpack(buf: torch.Tensor, dim: int, sizes: Sequence[int], backend: str | None = None) -> torch.Tensor:
    """Inverse of :func:`pack`: ``buf`` has shape ``(n, *block_shape)``; returns
    ``cat([buf[r].narrow(dim, 0, sizes[r]) for r], dim)`` (``dim`` indexes ``block_shape``)."""
    triton = _use_triton("unpack", buf, backend)
    dim, sizes = reference._check_unpack(buf, dim, sizes)
    return (_triton_mod.unpack if triton else reference._unpack)(buf, dim, sizes)


def a2a_pack(x: torch.Tensor, dim: int, sizes: Sequence[int], backend: str | None = None) -> torch.Tensor:
    """1-D concatenation over r of ``x.narrow(dim, off_r, sizes[r]).contiguous().reshape(-1)``."""
    triton = _use_triton("a2a_pack", x, backend)
    dim, sizes, _ = reference._check_pack(x, dim, sizes, None, fn="a2a_pack")
    return (_triton_mod.a2a_pack if triton else reference._a2a_pack)(x, dim, sizes)


def a2a_unpack(flat: torch.Tensor, shape: Sequence[int], dim: int, sizes: Sequence[int],
               backend: str | None = None) -> torch.Tensor:
    """``flat`` (1-D) concatenates contiguous pieces of shape ``shape`` with ``shape[dim]`` replaced
    by ``sizes[r]``; returns their concatenation along ``dim`` (``shape[dim]`` is ignored)."""
    triton = _use_triton("a2a_unpack", flat, backend)
    dim, shape, sizes = reference._check_a2a_unpack(flat, shape, dim, sizes)
    return (_triton_mod.a2a_unpack if triton else reference._a2a_unpack)(flat, shape, dim, sizes)


def slice_copy(x: torch.Tensor, dim: int, start: int, length: int, backend: str | None = None) -> torch.Tensor:
    """``x.narrow(dim, start, length).contiguous()`` as one copy, always a new tensor."""
    triton = _use_triton("slice_copy", x, backend)
    dim, start, length = reference._check_slice(x, dim, start, length)
    return (_triton_mod.slice_copy if triton else reference._slice_copy)(x, dim, start, length)


def halo_cat(parts: Sequence[torch.Tensor], dim: int, pad_left: int, pad_right: int,
             backend: str | None = None) -> torch.Tensor:
    """``cat([zeros(pad_left), *parts, zeros(pad_right)], dim)`` in one new contiguous buffer
    (``parts`` agree on every dim but ``dim``, share dtype and device)."""
    parts, dim, pad_left, pad_right = reference._check_halo_cat(parts, dim, pad_left, pad_right)
    triton = _use_triton("halo_cat", parts[0], backend)
    return (_triton_mod.halo_cat if triton else reference._halo_cat)(parts, dim, pad_left, pad_right)


def halo_split(grad: torch.Tensor, dim: int, sizes: Sequence[int], pad_left: int, pad_right: int,
               backend: str | None = None) -> list[torch.Tensor]:
    """Adjoint of :func:`halo_cat`: drop ``pad_left``/``pad_right`` elements at the ends of ``dim``
    and return contiguous pieces of lengths ``sizes`` (the Triton backend returns contiguous views
    of ONE new buffer; the reference returns separate tensors)."""
    triton = _use_triton("halo_split", grad, backend)
    dim, sizes, pad_left, pad_right = reference._check_halo_split(grad, dim, sizes, pad_left, pad_right)
    return (_triton_mod.halo_split if triton else reference._halo_split)(grad, dim, sizes, pad_left, pad_right)
