"""Tensor factories: ``dtshard.zeros``, ``ones``, ``empty``, ``full``, ``rand``, ``randn``.

The same signatures as ``torch.distributed.tensor.zeros`` & co. (a tensor subclass cannot
override ``torch.zeros``, so both libraries have functions of their own).  Without
``device_mesh`` they use the mesh of the innermost ``with mesh:`` block; without ``placements``
they replicate.

- ``zeros``/``ones``/``empty``/``full`` allocate only this rank's local shard: no global-size
  tensor, no communication.
- ``rand``/``randn`` give, on any placements, exactly the values ``torch.rand``/``torch.randn`` of
  the global shape draw in one process under the same seed.  They reuse dtshard's random rule
  (:mod:`dtshard.rules.random`): the local shard is allocated empty and filled by ``uniform_`` /
  ``normal_`` (which is what ``torch.rand`` / ``torch.randn`` run), and that rule draws the full-size
  tensor on every rank and keeps this rank's slice (no communication, O(global) work; see its
  docstring for why).  PyTorch's own factories instead draw per shard from an offset RNG, which
  does not reproduce the single-process values.

Partial placements hold the documented value (zeros, ones, ``fill_value``, the draw) as a pending
sum/avg/max/min: dtshard builds the Replicate tensor and redistributes it to Partial, which is
local (the value on one coordinate, the reduction's identity elsewhere).  PyTorch fills every
rank's local tensor with the value instead, so ``ones(..., placements=[Partial()])`` there reduces
to ``n`` ones; dtshard's reduces to ones, as the docstring of both promises.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate

from dtshard import collectives as C
from dtshard.spec import DTensorSpec, contiguous_strides, normalize_placements
from dtshard.tensor import DTensor, mesh_or_current

__all__ = ["empty", "full", "ones", "rand", "randn", "zeros"]


def _size(size) -> tuple[int, ...]:
    """``f(2, 3)``, ``f((2, 3))``, ``f([2, 3])`` and ``f(torch.Size([2, 3]))`` all mean shape (2, 3)."""
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = size[0]
    return tuple(int(s) for s in size)


def _factory(what: str, make_local, size, *, dtype, layout, requires_grad, device_mesh, placements,
             fill=None):
    """A DTensor of global shape ``size`` whose local shard ``make_local(local_shape, dtype, device)``
    builds; ``fill(dtensor)`` (the random factories) then fills it in place."""
    mesh = mesh_or_current(device_mesh, f"dtshard.{what}")
    shape = _size(size)
    if layout != torch.strided:
        raise ValueError(f"dtshard.{what}: layout {layout} is not supported for a DTensor of shape {shape}; "
                         "use torch.strided.")
    if placements is None:
        placements = [Replicate()] * mesh.ndim
    placements = normalize_placements(placements, len(shape), mesh.ndim, what=f"dtshard.{what}")
    # a Partial value is built as Replicate, then redistributed (locally, see the module docstring)
    built = tuple(Replicate() if isinstance(p, Partial) else p for p in placements)
    stride = contiguous_strides(shape)
    probe = DTensorSpec(mesh, built, shape, stride, dtype or torch.get_default_dtype())
    # a rank outside the mesh holds an empty shard (PyTorch's behaviour)
    lshape = probe.local_shape(C.mesh_coordinate(mesh)) if C.is_member(mesh) else (0,)
    local = make_local(lshape, dtype, torch.device(mesh.device_type))
    out = DTensor(local, DTensorSpec(mesh, built, shape, stride, local.dtype), requires_grad=False)
    with torch.no_grad():
        if fill is not None:
            fill(out)
        if built != placements:
            out = out.redistribute(mesh, placements)
    if requires_grad:
        out.requires_grad_(True)
    return out


def zeros(*size, requires_grad: bool = False, dtype: Optional[torch.dtype] = None,
          layout: torch.layout = torch.strided, device_mesh: Optional[DeviceMesh] = None,
          placements: Optional[Sequence[Placement]] = None):
    """A DTensor of zeros of global shape ``size`` (as ``torch.distributed.tensor.zeros``)."""
    return _factory("zeros", lambda s, dt, dev: torch.zeros(s, dtype=dt, device=dev), size, dtype=dtype,
                    layout=layout, requires_grad=requires_grad, device_mesh=device_mesh, placements=placements)


def ones(*size, dtype: Optional[torch.dtype] = None, layout: torch.layout = torch.strided,
         requires_grad: bool = False, device_mesh: Optional[DeviceMesh] = None,
         placements: Optional[Sequence[Placement]] = None):
    """A DTensor of ones of global shape ``size`` (as ``torch.distributed.tensor.ones``).

    Different on a ``Partial`` placement: the value is ones (one coordinate holds them, the
    reduction's identity the others); PyTorch's ``ones(..., placements=[Partial()])`` fills every
    rank, so its value reduces to ``n`` ones."""
    return _factory("ones", lambda s, dt, dev: torch.ones(s, dtype=dt, device=dev), size, dtype=dtype,
                    layout=layout, requires_grad=requires_grad, device_mesh=device_mesh, placements=placements)


def empty(*size, dtype: Optional[torch.dtype] = None, layout: torch.layout = torch.strided,
          requires_grad: bool = False, device_mesh: Optional[DeviceMesh] = None,
          placements: Optional[Sequence[Placement]] = None):
    """An uninitialised DTensor of global shape ``size`` (as ``torch.distributed.tensor.empty``)."""
    return _factory("empty", lambda s, dt, dev: torch.empty(s, dtype=dt, device=dev), size, dtype=dtype,
                    layout=layout, requires_grad=requires_grad, device_mesh=device_mesh, placements=placements)


def full(size, fill_value, *, dtype: Optional[torch.dtype] = None, layout: torch.layout = torch.strided,
         requires_grad: bool = False, device_mesh: Optional[DeviceMesh] = None,
         placements: Optional[Sequence[Placement]] = None):
    """A DTensor of global shape ``size`` filled with ``fill_value`` (as
    ``torch.distributed.tensor.full``; without ``dtype`` it follows ``torch.full``'s inference)."""
    return _factory("full", lambda s, dt, dev: torch.full(s, fill_value, dtype=dt, device=dev), (size,),
                    dtype=dtype, layout=layout, requires_grad=requires_grad, device_mesh=device_mesh,
                    placements=placements)


def rand(*size, requires_grad: bool = False, dtype: Optional[torch.dtype] = None,
         layout: torch.layout = torch.strided, device_mesh: Optional[DeviceMesh] = None,
         placements: Optional[Sequence[Placement]] = None):
    """Uniform [0, 1) random DTensor of global shape ``size``: the values ``torch.rand(size)`` draws in
    one process under the same seed, on any placements (see the module docstring).

    Different from ``torch.distributed.tensor.rand``, which draws each shard from an offset RNG (its
    values change with the mesh and placements, and it raises on a CPU mesh); here every rank draws
    the global tensor and keeps its slice (no communication, O(global) work)."""
    return _factory("rand", lambda s, dt, dev: torch.empty(s, dtype=dt, device=dev), size, dtype=dtype,
                    layout=layout, requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
                    fill=lambda t: t.uniform_(0.0, 1.0))


def randn(*size, requires_grad: bool = False, dtype: Optional[torch.dtype] = None,
          layout: torch.layout = torch.strided, device_mesh: Optional[DeviceMesh] = None,
          placements: Optional[Sequence[Placement]] = None):
    """Standard normal random DTensor of global shape ``size``: the values ``torch.randn(size)`` draws
    in one process under the same seed, on any placements (see the module docstring).

    Different from ``torch.distributed.tensor.randn``: see :func:`rand`."""
    return _factory("randn", lambda s, dt, dev: torch.empty(s, dtype=dt, device=dev), size, dtype=dtype,
                    layout=layout, requires_grad=requires_grad, device_mesh=device_mesh, placements=placements,
                    fill=lambda t: t.normal_(0.0, 1.0))
