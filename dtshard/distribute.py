"""``distribute_tensor`` and ``distribute_module``: a full tensor, or a module's parameters and
buffers, laid out as DTensors (PyTorch's signatures and semantics)."""

from __future__ import annotations

import inspect
import warnings
from typing import Callable, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate

from dtshard import collectives as C
from dtshard.redistribute import redistribute_local
from dtshard.spec import DTensorSpec, contiguous_strides, normalize_placements, placements_str
from dtshard.tensor import DTensor, mesh_or_current, reject_distributed_input

__all__ = ["distribute_module", "distribute_tensor"]



def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: Optional[DeviceMesh] = None,
    placements: Optional[Sequence[Placement]] = None,
    *,
    src_data_rank: Optional[int] = 0,
) -> DTensor:
    """Distribute a full tensor over ``device_mesh`` with ``placements``.

    As in PyTorch, ``src_data_rank`` is a rank WITHIN each mesh dim's process group (not a global
    rank): the data comes from the rank at mesh coordinate ``(src_data_rank,) * mesh.ndim``
    (broadcast along each mesh dim).  So on a sub-mesh, e.g. ``mesh["tp"]`` of a ``("dp", "tp")``
    mesh, every tp group takes its own first rank's data with the default ``0``.  With
    ``src_data_rank=None`` every rank is trusted to hold the same tensor and only slices locally
    (no communication).  The result is a leaf when ``tensor`` is (requires_grad kept).
    """
    reject_distributed_input(tensor, "distribute_tensor")
    device_mesh = mesh_or_current(device_mesh, "distribute_tensor")
    placements = list(placements) if placements is not None else [Replicate()] * device_mesh.ndim
    placements = normalize_placements(placements, tensor.dim(), device_mesh.ndim, what="distribute_tensor")
    requires_grad = tensor.requires_grad
    full = tensor.detach()
    if not C.is_member(device_mesh):
        # a rank outside the mesh holds an empty shard and takes part in no collective (PyTorch)
        spec = DTensorSpec(device_mesh, tuple(placements), tuple(full.shape), contiguous_strides(full.shape),
                           full.dtype)
        return DTensor(full.new_empty(0), spec, requires_grad=requires_grad)
    if src_data_rank is not None:
        src_coord = _src_coordinate(device_mesh, src_data_rank, tensor, placements)
        for i in reversed(range(device_mesh.ndim)):
            # after the step for mesh dim i, every rank whose coordinates before i equal src's
            # holds src's data; after mesh dim 0, every rank does
            full = C.broadcast(full, src_coord[i], device_mesh, i)
    spec = DTensorSpec(device_mesh, tuple(Replicate() for _ in placements), tuple(full.shape),
                       tuple(full.stride()) if full.is_contiguous() else contiguous_strides(full.shape), full.dtype)
    local = redistribute_local(full.contiguous(), spec, placements)
    if torch._C._is_alias_of(local, tensor):  # storage identity: no data pointer, so it also traces
        local = local.clone()  # never alias the caller's tensor
    return DTensor(local, spec.with_placements(placements), requires_grad=requires_grad)


def _src_coordinate(mesh: DeviceMesh, src_data_rank: int, tensor: torch.Tensor,
                    placements: Sequence[Placement]) -> tuple[int, ...]:
    """The mesh coordinate whose data ``distribute_tensor`` uses: ``src_data_rank`` on every mesh dim.

    PyTorch scatters/broadcasts along each mesh dim from ``group_src=src_data_rank``, the rank
    within that dim's group, so the data ends up coming from coordinate ``(src, src, ...)``.  The
    check uses only the mesh's shape (the same on every rank), so a bad value raises on every rank
    before any collective.
    """
    sizes = tuple(mesh.shape)
    if not isinstance(src_data_rank, int) or isinstance(src_data_rank, bool) \
            or not all(0 <= src_data_rank < n for n in sizes):
        raise ValueError(
            f"distribute_tensor: src_data_rank={src_data_rank!r} is not a rank of every mesh dim's group "
            f"(tensor of shape {tuple(tensor.shape)}, placements {placements_str(placements)}, mesh "
            f"{sizes} with dim names {mesh.mesh_dim_names}): as in PyTorch it is the rank WITHIN each "
            f"mesh dim's process group, not a global rank, so it must be in [0, {min(sizes)}); "
            "pass src_data_rank=None to use every rank's own data."
        )
    return (src_data_rank,) * mesh.ndim


def distribute_module(
    module: torch.nn.Module,
    device_mesh: Optional[DeviceMesh] = None,
    partition_fn: Optional[Callable[[str, torch.nn.Module, DeviceMesh], None]] = None,
    input_fn: Optional[Callable] = None,
    output_fn: Optional[Callable] = None,
) -> torch.nn.Module:
    """Turn ``module``'s parameters and buffers into DTensors (PyTorch's signature).

    ``partition_fn(name, submodule, mesh)`` may distribute parameters itself; whatever it leaves as
    plain tensors is replicated.  ``input_fn(module, inputs, mesh)`` and
    ``output_fn(module, outputs, mesh)`` become forward pre-/post-hooks (the deprecated two-argument
    forms ``input_fn(inputs, mesh)`` / ``output_fn(outputs, mesh)`` work too, with a FutureWarning,
    as in PyTorch).
    """
    device_mesh = mesh_or_current(device_mesh, "distribute_module")
    rep = [Replicate()] * device_mesh.ndim

    def replicate_rest(m: torch.nn.Module) -> None:
        for key, param in list(m._parameters.items()):
            if param is not None and not isinstance(param, DTensor):
                m.register_parameter(
                    key, torch.nn.Parameter(distribute_tensor(param.data, device_mesh, rep), param.requires_grad)
                )
        for key, buf in list(m._buffers.items()):
            if buf is not None and not isinstance(buf, DTensor):
                m._buffers[key] = distribute_tensor(buf, device_mesh, rep)

    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, device_mesh)
        replicate_rest(sub)
    if input_fn is not None:
        if _hook_arity(input_fn, "input_fn") == 2:
            module.register_forward_pre_hook(lambda mod, inputs: input_fn(inputs, device_mesh))
        else:
            module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        if _hook_arity(output_fn, "output_fn") == 2:
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(outputs, device_mesh))
        else:
            module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    return module


def _hook_arity(fn: Callable, what: str) -> int:
    """2 or 3: how many arguments ``distribute_module``'s ``input_fn``/``output_fn`` takes.

    As in PyTorch (which reads the signature the same way): the old form ``fn(inputs, mesh)`` /
    ``fn(outputs, mesh)`` still works, with a FutureWarning; the current one is
    ``fn(module, inputs, mesh)``; any other count raises."""
    n = len(inspect.signature(fn).parameters)
    if n == 2:
        kind = "inputs" if what == "input_fn" else "outputs"
        warnings.warn(
            f"Deprecating {what} that takes two arguments ({kind}, device_mesh), "
            f"please use {what} that takes in (module, {kind}, device_mesh) instead!",
            FutureWarning, stacklevel=3)
    elif n != 3:
        raise ValueError(f"distribute_module: {what} should take in 3 arguments (module, "
                         f"{'inputs' if what == 'input_fn' else 'outputs'}, device_mesh), but got {n} arguments!")
    return n
