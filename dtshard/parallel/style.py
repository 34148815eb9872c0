"""Parallel styles: how a module's parameters, inputs and outputs are laid out on a 1-D mesh.

Same classes, signatures and semantics as ``torch.distributed.tensor.parallel.style`` (torch 2.13),
built on dtshard's ``DTensor``, ``distribute_tensor`` and ``distribute_module``; placements and
meshes are PyTorch's own classes, so a plan written for PyTorch ports by changing the import.

- :class:`ColwiseParallel`: ``nn.Linear`` weight and bias ``Shard(0)`` (output features), input
  replicated, output ``Shard(-1)``; ``nn.Embedding`` weight ``Shard(1)``.
- :class:`RowwiseParallel`: ``nn.Linear`` weight ``Shard(1)`` (input features), bias replicated,
  input ``Shard(-1)``, output ``Partial(sum)`` reduced to ``output_layouts`` (``Replicate()`` by
  default, ``Shard(1)`` for sequence parallelism: a reduce_scatter); ``nn.Embedding`` weight
  ``Shard(0)`` (vocab rows: each rank looks up the ids in its rows, see ``dtshard.rules.embedding``),
  input replicated.
- :class:`SequenceParallel`: replicated parameters (norms), input and output sharded on the
  sequence dim.
- :class:`PrepareModuleInput` / :class:`PrepareModuleOutput` / :class:`PrepareModuleInputOutput`:
  annotate plain tensors as DTensors and redistribute them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import partial
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Placement, Replicate, Shard

from dtshard import collectives as C
from dtshard.parallel._linear import TPLinearCall
from dtshard.distribute import distribute_module, distribute_tensor
from dtshard.tensor import DTensor

__all__ = [
    "ParallelStyle",
    "RowwiseParallel",
    "SequenceParallel",
    "ColwiseParallel",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
]


def _is_torch_dtensor(t) -> bool:
    if isinstance(t, DTensor):
        return False
    try:
        from torch.distributed.tensor import DTensor as TorchDTensor
    except ImportError:  # pragma: no cover
        return False
    return isinstance(t, TorchDTensor)


def _to_layout(t: DTensor, device_mesh: DeviceMesh, layouts) -> DTensor:
    """``t`` moved to ``layouts`` on the module's mesh (async, as PyTorch's styles do).  A DTensor
    on a larger mesh of which the module's mesh is a sub-mesh (activations laid out over
    ``(dp, cp, tp)`` entering a block parallelized on ``mesh["tp"]``) moves on those dims only,
    keeping its other dims' placements (the block's parameters join it inside
    ``implicit_replication()``)."""
    layouts = tuple(layouts)
    mesh = t.device_mesh
    if mesh is device_mesh or mesh.ndim == len(layouts):
        return t if tuple(t.placements) == layouts else t.redistribute(placements=layouts, async_op=True)
    dims = C.sub_mesh_dims(mesh, device_mesh)
    if dims is None:
        raise ValueError(
            f"a tensor-parallel module on mesh {tuple(device_mesh.shape)} {device_mesh.mesh_dim_names} got a DTensor "
            f"on mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, which that mesh is not a sub-mesh of")
    target = list(t.placements)
    for d, p in zip(dims, layouts):
        target[d] = p
    target = tuple(target)
    return t if tuple(t.placements) == target else t.redistribute(mesh, target, async_op=True)


def _as_dtshard(t):
    """A torch.distributed.tensor.DTensor becomes the equivalent dtshard DTensor (no data moves)."""
    return DTensor.from_torch(t) if _is_torch_dtensor(t) else t


class ParallelStyle(ABC):
    """The contract of a parallel style: ``_apply(module, device_mesh)`` parallelizes ``module``."""

    src_data_rank: int | None = 0

    def _distribute_param(self, module: nn.Module, name: str, device_mesh: DeviceMesh, placement: Placement) -> None:
        """Replace ``module.<name>`` by a DTensor parameter with ``placement``."""
        param = getattr(module, name)
        module.register_parameter(
            name,
            nn.Parameter(
                distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            ),
        )

    def _distribute_all_params(self, module: nn.Module, device_mesh: DeviceMesh, placement: Placement) -> None:
        for name, _ in list(module.named_parameters(recurse=False)):
            self._distribute_param(module, name, device_mesh, placement)

    def _distribute_with_hooks(self, module: nn.Module, device_mesh: DeviceMesh, partition_fn) -> nn.Module:
        """distribute_module with this style's input and output hooks (Colwise/Rowwise).

        An ``nn.Linear`` gets them inside its forward instead (:class:`TPLinearCall`): the whole
        module call is then planned once per layout and runs as ONE autograd node in eager mode
        when it can (``dtshard/parallel/_linear.py``), and as the hooks would run it otherwise."""
        if isinstance(module, nn.Linear):
            distribute_module(module, device_mesh, partition_fn)
            module.forward = TPLinearCall(module, self, device_mesh)
            return module
        return distribute_module(
            module,
            device_mesh,
            partition_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(input_layouts={getattr(self, 'input_layouts', None)}, "
                f"output_layouts={getattr(self, 'output_layouts', None)}, "
                f"use_local_output={getattr(self, 'use_local_output', None)})")

    @staticmethod
    def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
        """Annotate a plain input as a DTensor with ``input_layouts`` and move it to
        ``desired_input_layouts`` (Colwise/Rowwise: the module's first input)."""
        input_tensor = _as_dtshard(inputs[0])
        if not isinstance(input_tensor, DTensor):
            input_tensor = DTensor.from_local(input_tensor, device_mesh, input_layouts, run_check=False)
        if input_layouts != desired_input_layouts:
            input_tensor = _to_layout(input_tensor, device_mesh, desired_input_layouts)
        return input_tensor

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        """Move the module's output to ``output_layouts`` (a Partial output: to Replicate is an
        all_reduce, to Shard a reduce_scatter); hand back the local tensor if asked."""
        outputs = _to_layout(outputs, device_mesh, output_layouts)
        return outputs.to_local() if use_local_output else outputs

    @abstractmethod
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module: ...


class ColwiseParallel(ParallelStyle):
    """Partition ``nn.Linear`` / ``nn.Embedding`` column-wise (PyTorch's semantics).

    Keyword Args:
        input_layouts: layout of the module input, used to annotate a plain tensor as a DTensor
            (default ``Replicate()``).
        output_layouts: layout the output is redistributed to (default ``Shard(-1)``).
        use_local_output: return the local shard (a plain tensor) instead of the DTensor
            (default True).
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ):
        super().__init__()
        self.input_layouts = (input_layouts or Replicate(),)
        self.output_layouts = (output_layouts or Shard(-1),)
        # colwise linear: replicated input, output sharded on the last dim
        self.desired_input_layouts = (Replicate(),)
        self.use_local_output = use_local_output

    def _partition_linear_fn(self, name, module, device_mesh):
        # weight (out, in) and bias (out,) Shard(0): y = x W^T + b is sharded on its last dim
        self._distribute_all_params(module, device_mesh, Shard(0))

    def _partition_embedding_fn(self, name, module, device_mesh):
        # embedding dim sharded: each rank looks up its columns of every id
        self._distribute_all_params(module, device_mesh, Shard(1))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            partition_fn = self._partition_linear_fn
        elif isinstance(module, nn.Embedding):
            partition_fn = self._partition_embedding_fn
        else:
            raise NotImplementedError("ColwiseParallel currently only support nn.Linear and nn.Embedding!")
        return self._distribute_with_hooks(module, device_mesh, partition_fn)


class RowwiseParallel(ParallelStyle):
    """Partition ``nn.Linear`` / ``nn.Embedding`` row-wise (PyTorch's semantics).

    Keyword Args:
        input_layouts: layout of the module input, used to annotate a plain tensor as a DTensor
            (default ``Shard(-1)``).
        output_layouts: layout the (partial) output is reduced to (default ``Replicate()``).
        use_local_output: return the local shard instead of the DTensor (default True).
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | None = None,
        output_layouts: Placement | None = None,
        use_local_output: bool = True,
    ):
        super().__init__()
        self.input_layouts = (input_layouts or Shard(-1),)
        self.output_layouts = (output_layouts or Replicate(),)
        self.use_local_output = use_local_output

    def _partition_linear_fn(self, name, module, device_mesh):
        # weight (out, in) Shard(1): x (sharded on in) @ W^T is a Partial(sum); the bias is replicated
        # (added once: the Partial output takes it on one rank)
        self._distribute_param(module, "weight", device_mesh, Shard(1))
        if getattr(module, "bias", None) is not None:
            self._distribute_param(module, "bias", device_mesh, Replicate())

    def _partition_embedding_fn(self, name, module, device_mesh):
        # vocab rows sharded: each rank looks up the ids in its rows (zeros elsewhere) -> Partial(sum)
        self._distribute_all_params(module, device_mesh, Shard(0))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if isinstance(module, nn.Linear):
            partition_fn = self._partition_linear_fn
            self.desired_input_layouts: tuple[Placement, ...] = (Shard(-1),)
        elif isinstance(module, nn.Embedding):
            partition_fn = self._partition_embedding_fn
            self.desired_input_layouts = (Replicate(),)
        else:
            raise NotImplementedError("RowwiseParallel currently only support nn.Linear and nn.Embedding!")
        return self._distribute_with_hooks(module, device_mesh, partition_fn)


class SequenceParallel(ParallelStyle):
    """Replicated parameters, input and output sharded on the sequence dim (norms, dropout).

    As in PyTorch, the parameters are replicated with ``DTensor.from_local`` (each rank keeps its
    own values: norms are initialised to ones; broadcast custom inits yourself), and a plain input
    is taken to be this rank's (even) sequence shard.

    Keyword Args:
        sequence_dim: the sequence dim of the input (default 1).
        use_local_output: return the local shard instead of the DTensor (default False).
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = False):
        super().__init__()
        self.sequence_sharding = (Shard(sequence_dim),)
        self.use_local_output = use_local_output

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh):
        for p_name, param in module.named_parameters(recurse=False):
            replicated_param = nn.Parameter(
                DTensor.from_local(param, device_mesh, [Replicate()], run_check=False),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(p_name, replicated_param)

    @staticmethod
    def _prepare_input_fn(sequence_sharding, mod, inputs, device_mesh):
        input_tensor = _as_dtshard(inputs[0])
        if isinstance(input_tensor, DTensor):
            return _to_layout(input_tensor, device_mesh, sequence_sharding)
        elif isinstance(input_tensor, torch.Tensor):
            return DTensor.from_local(input_tensor, device_mesh, sequence_sharding, run_check=False)
        else:
            raise ValueError(f"expecting input of {mod} to be a torch.Tensor or DTensor, but got {input_tensor}")

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        return outputs.to_local() if use_local_output else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._replicate_module_fn,
            partial(self._prepare_input_fn, self.sequence_sharding),
            partial(self._prepare_output_fn, self.use_local_output),
        )

    def __repr__(self) -> str:
        tmpstr = self.__class__.__name__ + "("
        if len(self.sequence_sharding) == 1:
            tmpstr += f"sequence_dim={self.sequence_sharding[0].dim}, "
        return tmpstr + f"use_local_output={self.use_local_output})"


class PrepareModuleInput(ParallelStyle):
    """Annotate a module's inputs as DTensors (``input_layouts``) and redistribute them to
    ``desired_input_layouts`` at runtime; ``None`` entries pass an input through untouched.

    Keyword Args:
        input_layouts, desired_input_layouts: one placement (or None) per positional input.
        input_kwarg_layouts, desired_input_kwarg_layouts: the same for keyword inputs.
        use_local_output: hand the module local tensors instead of DTensors (default False).
    """

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_output: bool = False,
    ):
        self.input_layouts = (input_layouts,) if isinstance(input_layouts, Placement) else input_layouts
        self.desired_input_layouts = (
            (desired_input_layouts,) if isinstance(desired_input_layouts, Placement) else desired_input_layouts
        )
        self.use_local_output = use_local_output
        if self.input_layouts is not None:
            if self.desired_input_layouts is None:
                raise AssertionError("desired module inputs should not be None!")
            if len(self.input_layouts) != len(self.desired_input_layouts):
                raise AssertionError("input_layouts and desired_input_layouts should have same length!")
        self.with_kwargs = input_kwarg_layouts is not None
        self.input_kwarg_layouts = input_kwarg_layouts or {}
        self.desired_input_kwarg_layouts = desired_input_kwarg_layouts or {}
        if self.with_kwargs:
            if len(self.input_kwarg_layouts) != len(self.desired_input_kwarg_layouts):
                raise AssertionError("input_kwarg_layouts and desired_input_kwarg_layouts should have same length!")

    def _prepare_input_arg(self, input: Any, mesh: DeviceMesh, input_layout: Placement | None,
                           desired_layout: Placement | None):
        if input_layout is not None:
            input = _as_dtshard(input)
            if isinstance(input, DTensor):
                dt_inp = input
            else:
                if not isinstance(input, torch.Tensor):
                    raise AssertionError("expecting input to be a torch.Tensor!")
                dt_inp = DTensor.from_local(input, mesh, (input_layout,), run_check=False)
            if desired_layout is not None and input_layout != desired_layout:
                dt_inp = dt_inp.redistribute(placements=(desired_layout,))
            return dt_inp.to_local() if self.use_local_output else dt_inp
        return input

    def _prepare_input_fn(self, inputs, device_mesh):
        if self.input_layouts is None:
            return inputs
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        if len(inputs) != len(self.input_layouts):
            raise ValueError("module inputs and input_layouts should have same length!")
        if self.desired_input_layouts is None:
            raise AssertionError("desired module inputs should not be None!")
        return tuple(
            self._prepare_input_arg(inp, device_mesh, layout, desired)
            for inp, layout, desired in zip(inputs, self.input_layouts, self.desired_input_layouts)
        )

    def _prepare_input_kwarg_fn(self, inputs, kwarg_inputs, device_mesh):
        prepared_arg_inputs = self._prepare_input_fn(inputs, device_mesh)
        prepared_kwarg_inputs = {
            key: self._prepare_input_arg(value, device_mesh, self.input_kwarg_layouts.get(key),
                                         self.desired_input_kwarg_layouts.get(key))
            for key, value in kwarg_inputs.items()
        }
        return prepared_arg_inputs, prepared_kwarg_inputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.with_kwargs:
            module.register_forward_pre_hook(
                lambda _, inputs, kwargs: self._prepare_input_kwarg_fn(inputs, kwargs, device_mesh),
                with_kwargs=True,
            )
        else:
            module.register_forward_pre_hook(lambda _, inputs: self._prepare_input_fn(inputs, device_mesh))
        return module

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(input_layouts={self.input_layouts}, "
                f"desired_input_layouts={self.desired_input_layouts}, "
                f"input_kwarg_layouts={self.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={self.desired_input_kwarg_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleOutput(ParallelStyle):
    """Annotate a module's outputs as DTensors (``output_layouts``) and redistribute them to
    ``desired_output_layouts``; ``None`` entries pass an output through untouched.

    Keyword Args:
        output_layouts, desired_output_layouts: one placement (or None) per output.
        use_local_output: return local tensors instead of DTensors (default True).
    """

    def __init__(
        self,
        *,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement, ...],
        use_local_output: bool = True,
    ):
        self.output_layouts = (output_layouts,) if isinstance(output_layouts, Placement) else output_layouts
        self.desired_output_layouts = (
            (desired_output_layouts,) if isinstance(desired_output_layouts, Placement) else desired_output_layouts
        )
        self.use_local_output = use_local_output
        if len(self.output_layouts) != len(self.desired_output_layouts):
            raise AssertionError("output_layouts and desired_output_layouts should have same length!")

    def _prepare_out_fn(self, outputs, device_mesh):
        prepared_outputs = []
        if not isinstance(outputs, tuple):
            outputs = (outputs,)
        if len(outputs) != len(self.output_layouts):
            raise ValueError("module outputs and output_layouts should have same length!")
        for out, out_layout, desired_out_layout in zip(outputs, self.output_layouts, self.desired_output_layouts):
            if out_layout is not None:
                out = _as_dtshard(out)
                if isinstance(out, DTensor):
                    dt_out = out
                else:
                    dt_out = DTensor.from_local(out, device_mesh, (out_layout,), run_check=False)
                if out_layout != desired_out_layout:
                    dt_out = dt_out.redistribute(placements=(desired_out_layout,))
                prepared_outputs.append(dt_out.to_local() if self.use_local_output else dt_out)
            else:
                prepared_outputs.append(out)
        return prepared_outputs[0] if len(prepared_outputs) == 1 else tuple(prepared_outputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda _, inputs, outputs: self._prepare_out_fn(outputs, device_mesh))
        return module

    def __repr__(self) -> str:
        return (f"{self.__class__.__name__}(output_layouts={self.output_layouts}, "
                f"desired_output_layouts={self.desired_output_layouts}, "
                f"use_local_output={self.use_local_output})")


class PrepareModuleInputOutput(ParallelStyle):
    """:class:`PrepareModuleInput` and :class:`PrepareModuleOutput` on one module."""

    def __init__(
        self,
        *,
        input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        desired_input_layouts: Placement | tuple[Placement | None, ...] | None = None,
        input_kwarg_layouts: dict[str, Placement] | None = None,
        desired_input_kwarg_layouts: dict[str, Placement] | None = None,
        use_local_input: bool = False,
        output_layouts: Placement | tuple[Placement | None, ...],
        desired_output_layouts: Placement | tuple[Placement, ...],
        use_local_output: bool = True,
    ):
        self.prepare_module_input = PrepareModuleInput(
            input_layouts=input_layouts,
            desired_input_layouts=desired_input_layouts,
            input_kwarg_layouts=input_kwarg_layouts,
            desired_input_kwarg_layouts=desired_input_kwarg_layouts,
            use_local_output=use_local_input,
        )
        self.prepare_module_output = PrepareModuleOutput(
            output_layouts=output_layouts,
            desired_output_layouts=desired_output_layouts,
            use_local_output=use_local_output,
        )

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.prepare_module_input._apply(module, device_mesh)
        self.prepare_module_output._apply(module, device_mesh)
        return module

    def __repr__(self) -> str:
        i, o = self.prepare_module_input, self.prepare_module_output
        return (f"{self.__class__.__name__}(input_layouts={i.input_layouts}, "
                f"desired_input_layouts={i.desired_input_layouts}, "
                f"input_kwarg_layouts={i.input_kwarg_layouts}, "
                f"desired_input_kwarg_layouts={i.desired_input_kwarg_layouts}, "
                f"use_local_input={i.use_local_output}, output_layouts={o.output_layouts}, "
                f"desired_output_layouts={o.desired_output_layouts}, use_local_output={o.use_local_output})")
