"""``dtshard.experimental``: the counterpart of ``torch.distributed.tensor.experimental``."""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Callable, Iterator, Optional

import torch
from torch.utils import _pytree as pytree

from dtshard import collectives as _C
from dtshard import dispatch as _dispatch
from dtshard.spec import is_shard, local_shape, placements_str
from dtshard.tensor import DTensor

__all__ = ["implicit_replication", "local_map"]


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside this block a plain ``torch.Tensor`` that meets a DTensor in an op is treated as a
    ``Replicate()`` DTensor on that DTensor's mesh (PyTorch's ``implicit_replication()``; its own
    context works with dtshard too).  The caller vouches that the tensor holds the same value on
    every rank; nothing checks it.  Outside, mixing raises (only one-element tensors broadcast
    like scalars)."""
    _dispatch._implicit[0] += 1
    try:
        yield
    finally:
        _dispatch._implicit[0] -= 1


def local_map(func: Optional[Callable] = None, out_placements=None, in_placements=None, in_grad_placements=None,
              device_mesh=None, *, redistribute_inputs: bool = False):
    """Run ``func``, written for plain tensors, on the local shards of DTensor arguments and wrap
    its tensor outputs as DTensors with ``out_placements`` (PyTorch 2.13's
    ``torch.distributed.tensor.experimental.local_map``: same signature, same checks, usable as
    a decorator; differentiable, and traceable by ``torch.compile``).

    ``in_placements`` (one entry per flattened argument, None for non-tensors): the placements a
    DTensor argument must have; a different one raises ``ValueError`` unless
    ``redistribute_inputs=True``, which redistributes it first.  ``in_grad_placements``: the
    placements of each DTensor argument's gradient (default: its placements).  ``device_mesh``:
    the outputs' mesh (default: the first DTensor argument's).  Without DTensor arguments
    ``func`` runs on what it was given and its outputs are returned as they are.

    Uneven shards (beyond PyTorch, whose outputs assume even shards: pytorch#172812): when a
    DTensor argument is unevenly sharded, each sharded output's global shape is built from every
    rank's local shape (one small metadata all_gather over the mesh in eager mode; under
    ``torch.compile``, from the argument sharded the same way, which must be unique) and checked
    against the layout on every rank, so an output can never get a global shape its shards
    contradict."""
    if func is None:
        return lambda f: local_map(f, out_placements, in_placements, in_grad_placements, device_mesh,
                                   redistribute_inputs=redistribute_inputs)
    return functools.partial(_local_map_call, func, out_placements, in_placements, in_grad_placements,
                             device_mesh, redistribute_inputs)


def _local_map_call(func, out_placements, in_placements, in_grad_placements, device_mesh, redistribute_inputs,
                    *args, **kwargs):
    flat, tree = pytree.tree_flatten(args)
    if in_placements is not None and len(in_placements) != len(flat):
        raise AssertionError(f"local_map: in_placements has {len(in_placements)} entries but there are "
                             f"{len(flat)} input args")
    local_args = []
    dts = []
    for idx, arg in enumerate(flat):
        if isinstance(arg, DTensor):
            if device_mesh is None:
                device_mesh = arg.device_mesh
            if in_placements is not None:
                want = in_placements[idx]
                if want is None:
                    raise AssertionError(f"local_map: DTensor input {idx} of global shape {tuple(arg.shape)} "
                                         "expects placements but in_placements gives None")
                want = tuple(want)
                if tuple(arg.placements) != want:
                    if not redistribute_inputs:
                        raise ValueError(
                            f"local_map: input {idx} (global shape {tuple(arg.shape)}, mesh {tuple(arg.device_mesh.shape)}) "
                            f"has placements {placements_str(arg.placements)} but in_placements asks for "
                            f"{placements_str(want)}; redistribute it first or pass redistribute_inputs=True")
                    arg = arg.redistribute(arg.device_mesh, want)
            dts.append(arg)
            if in_grad_placements is not None:
                gp = in_grad_placements[idx]
                if gp is None:
                    raise AssertionError(f"local_map: DTensor input {idx} expects in_grad_placements but got None")
                local_args.append(arg.to_local(grad_placements=tuple(gp)))
            else:
                local_args.append(arg.to_local())
        else:
            if in_placements is not None and not isinstance(arg, torch.Tensor) and in_placements[idx] is not None:
                raise AssertionError(f"local_map: non-tensor input {idx} ({arg!r}) expects None placements, "
                                     f"got {in_placements[idx]}")
            local_args.append(arg)
    out = func(*pytree.tree_unflatten(local_args, tree), **kwargs)
    if not dts:
        return out
    flat_out, out_tree = pytree.tree_flatten(out)
    specs = out_placements if isinstance(out_placements, tuple) else (out_placements,)
    if len(flat_out) != len(specs):
        raise AssertionError(f"local_map: {len(specs)} out_placements for {len(flat_out)} outputs; give one "
                             "PlacementType per flattened output")
    for o, spec in zip(flat_out, specs):
        if isinstance(o, DTensor):
            raise AssertionError(f"local_map: func returned a DTensor (global shape {tuple(o.shape)}); it must "
                                 "return plain tensors")
        if not isinstance(o, torch.Tensor) and spec is not None:
            raise AssertionError(f"local_map: non-tensor output {o!r} expects None placements, got {spec}")
    shapes = _global_shapes(flat_out, specs, dts, device_mesh)
    wrapped = [DTensor.from_local(o, device_mesh, tuple(spec), shape=shape) if isinstance(o, torch.Tensor) else o
               for o, spec, shape in zip(flat_out, specs, shapes)]
    return pytree.tree_unflatten(wrapped, out_tree)


def _global_shapes(outs, specs, dts, mesh) -> list:
    """The global shape of each tensor output (None for non-tensors, and where even shards are
    assumed: every DTensor argument evenly sharded, as PyTorch assumes)."""
    if all(t._spec.is_even() for t in dts):
        return [None] * len(outs)
    tensors = [(k, o, tuple(spec)) for k, (o, spec) in enumerate(zip(outs, specs)) if isinstance(o, torch.Tensor)]
    shapes: list = [None] * len(outs)
    coord = _C.mesh_coordinate(mesh)
    if torch.compiler.is_compiling():
        for k, o, spec in tensors:
            shapes[k] = _shape_from_inputs(o, spec, dts, mesh)
            _check_layout({coord: tuple(o.shape)}, shapes[k], spec, mesh, k)
        return shapes
    # eager: every rank's local shapes, one metadata exchange; every rank decides the same
    table = dict(_C.all_gather_object_mesh((coord, [tuple(o.shape) for _, o, _ in tensors]), mesh))
    for j, (k, o, spec) in enumerate(tensors):
        locals_ = {c: v[j] for c, v in table.items()}
        shape = list(locals_[(0,) * mesh.ndim])
        for d in range(len(shape)):
            dims = [i for i, p in enumerate(spec) if is_shard(p) and p.dim == d]
            if dims:  # the sum over the shards of this dim (the other mesh dims at 0)
                shape[d] = sum(v[d] for c, v in locals_.items()
                               if all(c[i] == 0 for i in range(mesh.ndim) if i not in dims))
        shapes[k] = tuple(shape)
        _check_layout(locals_, shapes[k], spec, mesh, k)
    return shapes


def _shape_from_inputs(o, spec, dts, mesh) -> tuple:
    """Under torch.compile: each sharded dim's global size from the DTensor argument(s) sharded
    over the same mesh dims in the same order; it must be unique (metadata only)."""
    shape = list(o.shape)
    for d in range(o.dim()):
        dims = tuple(i for i, p in enumerate(spec) if is_shard(p) and p.dim == d)
        if not dims:
            continue
        cands = set()
        for t in dts:
            for dd in range(t.dim()):
                if tuple(t._spec.shard_mesh_dims(dd)) == dims:
                    cands.add(t.shape[dd])
        if len(cands) != 1:
            n = math.prod(mesh.size(i) for i in dims)
            if cands or o.shape[d] * n == 0:
                raise NotImplementedError(
                    f"local_map under torch.compile: output dim {d} is sharded over mesh dims {dims} of mesh "
                    f"{tuple(mesh.shape)} and the inputs are unevenly sharded; its global size is ambiguous (the "
                    f"inputs sharded the same way have sizes {sorted(cands)}). Run this local_map eagerly, or make "
                    "the shards even")
            shape[d] = o.shape[d] * n
        else:
            shape[d] = cands.pop()
    return tuple(shape)


def _check_layout(locals_: dict, shape, spec, mesh, k: int) -> None:
    for c, got in locals_.items():
        want = local_shape(shape, tuple(mesh.shape), spec, c)
        if tuple(got) != tuple(want):
            raise ValueError(
                f"local_map: output {k} has local shape {tuple(got)} at mesh coordinate {c}, but global shape "
                f"{tuple(shape)} with placements {placements_str(spec)} on mesh {tuple(mesh.shape)} gives "
                f"{tuple(want)} there: func's outputs must be shards of one global tensor in torch.chunk's "
                "layout")
