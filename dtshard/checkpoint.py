"""Model state dicts of dtshard models in PyTorch's ``torch.distributed.checkpoint.state_dict`` form,
the full (gathered) form included.

PyTorch's helpers find the sharded values of a state dict with
``isinstance(value, torch.distributed.tensor.DTensor)``.  dtshard's DTensor is a class of its own,
so with ``full_state_dict=True`` PyTorch's ``get_model_state_dict`` would return the shards as they
are (a "full" checkpoint that holds one rank's pieces) and ``set_model_state_dict`` would refuse the
full tensors.  These two functions take the same arguments and do the gathering and the laying out
themselves; everything else (names, strictness, frozen parameters, the sharded form) is PyTorch's
own code::

    from dtshard.checkpoint import StateDictOptions, get_model_state_dict, set_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True))

Sharded checkpoints go through DCP (``dcp.save`` / ``dcp.load``) with PyTorch's own
``get_state_dict`` / ``set_state_dict``, which keep dtshard's DTensors as they are.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.distributed.checkpoint import state_dict as _torch_sd
from torch.distributed.checkpoint.state_dict import StateDictOptions

from dtshard.collectives import world_rank
from dtshard.distribute import distribute_tensor
from dtshard.tensor import DTensor

__all__ = ["StateDictOptions", "get_model_state_dict", "set_model_state_dict"]


def _as_sharded(options: StateDictOptions) -> StateDictOptions:
    return dataclasses.replace(options, full_state_dict=False, cpu_offload=False, broadcast_from_rank0=False)


def get_model_state_dict(model: nn.Module, *, submodules: Optional[set] = None,
                         options: Optional[StateDictOptions] = None) -> dict[str, Any]:
    """PyTorch's ``get_model_state_dict``. With ``full_state_dict=True`` every DTensor value is
    gathered into its full tensor (one collective per value, in the state dict's order, which
    every rank shares; call it on every rank); with ``cpu_offload=True`` as well, rank 0 keeps the
    values on the CPU and the other ranks get an empty dict, as PyTorch's does."""
    options = options or StateDictOptions()
    kwargs = {} if submodules is None else {"submodules": submodules}
    if not options.full_state_dict:
        return _torch_sd.get_model_state_dict(model, options=options, **kwargs)
    sharded = _torch_sd.get_model_state_dict(model, options=_as_sharded(options), **kwargs)
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in sharded.items()}
    if not options.cpu_offload:
        return full
    if world_rank() != 0:
        return {}
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in full.items()}


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         options: Optional[StateDictOptions] = None):
    """PyTorch's ``set_model_state_dict``. With ``full_state_dict=True`` each full tensor is laid
    out like the model's DTensor under that name (each rank keeps its own shard: no communication;
    every rank must hold the same full tensors) and loaded; plain values load as they are.
    ``broadcast_from_rank0=True`` (a full state dict on rank 0 only) is not supported yet: it
    raises; load the full state dict on every rank, or save and load through DCP."""
    options = options or StateDictOptions()
    if not options.full_state_dict:
        return _torch_sd.set_model_state_dict(model, model_state_dict, options=options)
    if options.broadcast_from_rank0:
        raise NotImplementedError(
            "dtshard.checkpoint.set_model_state_dict: broadcast_from_rank0=True is not supported yet; "
            "give every rank the full state dict (full_state_dict=True alone), or save and load a "
            "sharded checkpoint through torch.distributed.checkpoint (dcp.save / dcp.load).")
    current = _torch_sd.get_model_state_dict(model, options=_as_sharded(options))
    laid_out = dict(model_state_dict)
    for key, value in model_state_dict.items():
        target = current.get(key)
        if isinstance(target, DTensor) and isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(
                    f"dtshard.checkpoint.set_model_state_dict: {key!r} has shape {tuple(value.shape)} in the "
                    f"state dict and {tuple(target.shape)} in the model.")
            laid_out[key] = distribute_tensor(value.to(device=target.device, dtype=target.dtype),
                                              target.device_mesh, target.placements, src_data_rank=None)
    return _torch_sd.set_model_state_dict(model, laid_out, options=_as_sharded(options))
