"""``dtshard.DTensor``: a tensor subclass holding this rank's shard of a global tensor.

To the model code a DTensor behaves like the global tensor (shape, dtype, autograd); underneath,
every aten op goes through :func:`dtshard.dispatch.dispatch`.  The public API mirrors
``torch.distributed.tensor`` (same signatures, same chunk layout for uneven shards), so code written
for it runs unchanged, and tensors convert both ways without moving data (:meth:`DTensor.from_torch`,
:meth:`DTensor.to_torch`).
"""

from __future__ import annotations

import sys
from typing import Callable, Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dtshard import collectives as C
from dtshard.dispatch import bind_tensor_class, dispatch
from dtshard.redistribute import redistribute_local
from dtshard.spec import DTensorSpec, mesh_identity, normalize_placements, placements_str

__all__ = ["DTensor", "distribute_tensor", "distribute_module"]


def _contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _settle_grads_of(leaf: "DTensor") -> None:
    """Reduce a Partial gradient of ``leaf`` once, when autograd has accumulated it, to the leaf's
    own placements on those mesh dims (Replicate: all_reduce; Shard: reduce_scatter).

    The gradient of a replicated weight is naturally a Partial sum (each rank saw its part of the
    batch); left Partial, every optimizer op that reads it (momentum, Adam's moments, the update)
    would reduce it again.  Like DDP's bucketed all_reduce, this reduces each gradient once per
    backward.  Off: ``dtshard.propagate.config.settle_partial_grads = False``."""
    if getattr(leaf, "_dtshard_settles_grads", False) or torch.compiler.is_compiling():
        return
    leaf.register_post_accumulate_grad_hook(_settle_grad)
    leaf._dtshard_settles_grads = True


def _settle_grad(param: "DTensor") -> None:
    from dtshard.propagate import config

    grad = param.grad
    if not config.settle_partial_grads or not isinstance(grad, DTensor) or not isinstance(param, DTensor):
        return
    gp, pp = grad._spec.placements, param._spec.placements
    if not any(isinstance(p, Partial) for p in gp) or len(gp) != len(pp):
        return
    target = [
        (Replicate() if isinstance(q, Partial) else q) if isinstance(p, Partial) else p
        for p, q in zip(gp, pp)
    ]
    with torch.no_grad():
        try:
            param.grad = grad.redistribute(grad.device_mesh, target)
        except ValueError:  # no legal path to that layout: the gradient stays as it is (correct)
            pass


def _grad_placements(ps: Sequence[Placement]) -> tuple[Placement, ...]:
    """Placements a gradient flowing back to a tensor with placements ``ps`` should take: the
    gradient of every partial term is the whole gradient, so Partial becomes Replicate."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in ps)


class DTensor(torch.Tensor):
    """A distributed tensor: ``_local_tensor`` is this rank's shard, ``_spec`` the global layout."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local_tensor: torch.Tensor, spec: DTensorSpec, *, requires_grad: bool):
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            strides=spec.stride,
            dtype=spec.dtype,
            device=local_tensor.device,
            layout=local_tensor.layout,
            requires_grad=requires_grad,
        )
        r._local_tensor = local_tensor
        r._spec = spec
        if requires_grad:  # a new leaf (distribute_tensor(..., requires_grad=True), ...)
            _settle_grads_of(r)
        return r

    def requires_grad_(self, requires_grad: bool = True) -> "DTensor":
        """As ``torch.Tensor.requires_grad_``; a leaf DTensor that starts requiring grad (e.g. the
        tensor ``nn.Parameter(dtensor)`` builds) gets its gradients settled once (see
        :func:`_settle_grads_of`)."""
        super().requires_grad_(requires_grad)
        if requires_grad and self.is_leaf:
            _settle_grads_of(self)
        return self

    def __repr__(self) -> str:  # never gathers
        return (
            f"dtshard.DTensor(local={self._local_tensor}, shape={tuple(self._spec.shape)}, "
            f"placements={placements_str(self._spec.placements)}, mesh={tuple(self._spec.mesh.shape)})"
        )

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return dispatch(func, args, kwargs or {})

    # ---- torch.compile support -----------------------------------------------------------
    def __tensor_flatten__(self):
        return ["_local_tensor"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner_tensors, spec, outer_size, outer_stride):
        local = inner_tensors["_local_tensor"]
        if tuple(outer_size) != spec.shape or tuple(outer_stride) != spec.stride:
            spec = DTensorSpec(spec.mesh, spec.placements, tuple(outer_size), tuple(outer_stride), spec.dtype)
        return DTensor(local, spec, requires_grad=local.requires_grad)

    def __coerce_same_metadata_as_tangent__(self, flatten_spec, expected_type=None):
        # AOTAutograd traced the backward for a tangent with ``flatten_spec`` (our spec); the
        # gradient that arrives at run time may have other placements (e.g. Partial): move it.
        if expected_type is not None and expected_type is not DTensor:
            return None
        spec = flatten_spec
        if spec.placements == self._spec.placements:
            return self
        return self.redistribute(self._spec.mesh, spec.placements)

    def __coerce_tangent_metadata__(self):
        # Tangents for AOTAutograd must not be Partial: reduce them to Replicate.
        if not any(isinstance(p, Partial) for p in self._spec.placements):
            return self
        return self.redistribute(self._spec.mesh, _grad_placements(self._spec.placements))

    # ---- public API ----------------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        return self._spec.mesh

    @staticmethod
    def from_local(
        local_tensor: torch.Tensor,
        device_mesh: Optional[DeviceMesh] = None,
        placements: Optional[Sequence[Placement]] = None,
        *,
        run_check: bool = False,
        shape: Optional[torch.Size] = None,
        stride: Optional[tuple[int, ...]] = None,
        grad_placements: Optional[Sequence[Placement]] = None,
    ) -> "DTensor":
        """Wrap this rank's ``local_tensor`` as the shard of a global tensor (differentiable).

        In backward the gradient is redistributed to ``grad_placements`` (default: these
        placements, with Partial as Replicate) before its local shard flows to ``local_tensor``.

        Without ``shape``, shards are assumed even (global size = local size x mesh dim size on
        each sharded dim), as in PyTorch.  Uneven layouts need ``shape``.  ``run_check=True``
        gathers every rank's local shape and raises the same error on every rank when they do not
        fit ``shape``/``placements`` (costs one collective).
        """
        _reject_distributed_input(local_tensor, "DTensor.from_local")
        if device_mesh is None:
            raise ValueError("DTensor.from_local: pass device_mesh (dtshard has no implicit global mesh)")
        if placements is None:
            placements = [Replicate()] * device_mesh.ndim
        placements = normalize_placements(placements, local_tensor.dim(), device_mesh.ndim, what="DTensor.from_local")
        if shape is None:
            gshape = list(local_tensor.shape)
            for i, p in enumerate(placements):
                if isinstance(p, Shard):
                    gshape[p.dim] *= device_mesh.size(i)
            shape = tuple(gshape)
        shape = tuple(shape)
        stride = tuple(stride) if stride is not None else _contiguous_stride(shape)
        spec = DTensorSpec(device_mesh, tuple(placements), shape, stride, local_tensor.dtype)
        if run_check:
            _check_from_local(local_tensor, spec)
        elif not torch.compiler.is_compiling():
            want = spec.local_shape(C.mesh_coordinate(device_mesh))
            if tuple(local_tensor.shape) != want:
                raise ValueError(
                    f"DTensor.from_local: this rank's local tensor has shape {tuple(local_tensor.shape)} "
                    f"but global shape {shape} with placements {placements_str(placements)} on mesh "
                    f"{tuple(device_mesh.shape)} gives it {want}; pass shape= for uneven shards."
                )
        if not (local_tensor.requires_grad and torch.is_grad_enabled()):
            return DTensor(local_tensor.view_as(local_tensor), spec, requires_grad=False)
        grad_placements = tuple(grad_placements) if grad_placements is not None else None
        if torch.compiler.is_dynamo_compiling():  # one graph node (see _from_local_in_graph)
            return _from_local_in_graph(local_tensor, device_mesh, spec.placements, shape, stride, grad_placements)
        return _FromLocal.apply(local_tensor, spec, grad_placements)

    def to_local(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> torch.Tensor:
        """This rank's shard as a plain tensor (differentiable: the gradient is taken to have
        ``grad_placements``, by default this tensor's placements)."""
        if not (self.requires_grad and torch.is_grad_enabled()):
            return self._local_tensor
        return _ToLocal.apply(self, tuple(grad_placements) if grad_placements is not None else None)

    def redistribute(
        self,
        device_mesh: Optional[DeviceMesh] = None,
        placements: Optional[Sequence[Placement]] = None,
        *,
        async_op: bool = False,
    ) -> "DTensor":
        """Move the data to new placements on the same mesh (differentiable; minimum traffic)."""
        mesh = self._spec.mesh
        # under torch.compile the mesh argument is an opaque proxy: the tensor's own mesh rules
        if device_mesh is not None and device_mesh is not mesh and not torch.compiler.is_compiling() \
                and mesh_identity(device_mesh) != mesh_identity(mesh):
            raise ValueError(
                f"redistribute: moving a DTensor of shape {tuple(self.shape)} to another mesh "
                f"({tuple(mesh.shape)} -> {tuple(device_mesh.shape)}) is not supported; "
                "redistribute on its own mesh."
            )
        if placements is None:
            raise ValueError("redistribute: pass the target placements")
        placements = normalize_placements(placements, self.dim(), mesh.ndim, what="DTensor.redistribute")
        if placements == self._spec.placements:
            return self
        if not (self.requires_grad and torch.is_grad_enabled()):
            src = self._spec
            return DTensor(redistribute_local(self._local_tensor, src, placements), src.with_placements(placements),
                           requires_grad=False)
        return _Redistribute.apply(self, placements)

    def full_tensor(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> torch.Tensor:
        """The whole global tensor on every rank (all-gathers / all-reduces as needed)."""
        rep = self.redistribute(self._spec.mesh, [Replicate()] * self._spec.mesh.ndim)
        return rep.to_local(grad_placements=grad_placements)

    # ---- torch.distributed.checkpoint (DCP) protocol ---------------------------------------
    # DCP saves each rank's chunk (offsets and sizes in the global tensor) and, on load, copies
    # the overlapping parts of the saved chunks into each rank's local tensor, so a checkpoint
    # loads into any other sharding and any number of ranks. Replicated chunks are deduplicated
    # by DCP's planner.

    def _check_checkpointable(self) -> None:
        if any(isinstance(p, Partial) for p in self._spec.placements):
            raise ValueError(
                f"dtshard: cannot checkpoint a DTensor of shape {tuple(self.shape)} with Partial "
                f"placements {placements_str(self._spec.placements)} (its value is a pending "
                "reduction); redistribute it to Replicate or Shard first."
            )

    def _chunk(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        self._check_checkpointable()
        sizes, offsets = self._spec.local_shape_and_offset(C.mesh_coordinate(self._spec.mesh))
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))

    def __create_write_items__(self, fqn: str, obj):
        from torch.distributed.checkpoint.metadata import MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        chunk = self._chunk()
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self._local_tensor),
                    size=self.size(),
                ),
            )
        ]

    def __create_chunk_list__(self):
        return [self._chunk()]

    def __get_tensor_shard__(self, index):
        self._check_checkpointable()
        return self._local_tensor

    # ---- interop with torch.distributed.tensor ------------------------------------------
    @staticmethod
    def from_torch(dt) -> "DTensor":
        """A dtshard DTensor with the same mesh, placements and local shard as a
        ``torch.distributed.tensor.DTensor`` (no communication; differentiable)."""
        return DTensor.from_local(
            dt.to_local(), dt.device_mesh, dt.placements, shape=dt.shape, stride=dt.stride()
        )

    def to_torch(self):
        """The equivalent ``torch.distributed.tensor.DTensor`` (no communication; differentiable)."""
        from torch.distributed.tensor import DTensor as TorchDTensor

        return TorchDTensor.from_local(
            self.to_local(), self._spec.mesh, self._spec.placements, shape=self.shape, stride=self.stride()
        )


def _reject_distributed_input(t, what: str) -> None:
    """``from_local`` and ``distribute_tensor`` take a plain tensor.  Given a DTensor, wrapping it
    would build a DTensor nested in a DTensor (its "local" shape is a global shape, so the global
    shape comes out multiplied by the mesh size, silently).  Raise, on every rank alike (the
    check uses only the argument's type and metadata), and say what to call instead."""
    if isinstance(t, DTensor):
        raise ValueError(
            f"{what}: the tensor is already a DTensor (dtshard, global shape {tuple(t.shape)}, placements "
            f"{placements_str(t.placements)} on mesh {tuple(t.device_mesh.shape)}). To change its "
            f"placements use dt.redistribute(mesh, placements); to wrap its shard, pass dt.to_local()."
        )
    torch_dt = sys.modules.get("torch.distributed.tensor")
    if torch_dt is not None and isinstance(t, torch_dt.DTensor):
        raise ValueError(
            f"{what}: the tensor is a torch.distributed.tensor.DTensor (global shape {tuple(t.shape)}, "
            f"placements {placements_str(t.placements)}). Convert it without moving data with "
            f"dtshard.DTensor.from_torch(dt) (then .redistribute(...) to change placements), or pass "
            f"dt.to_local() to wrap its shard."
        )


def _check_from_local(local: torch.Tensor, spec: DTensorSpec) -> None:
    """Collective check of every rank's local shape; raises the same message on every rank."""
    mesh = spec.mesh
    info = (C.world_rank(), C.mesh_coordinate(mesh), tuple(local.shape), str(local.dtype))
    # gather along each mesh dim in turn gives every rank the whole table
    table = [info]
    for i in range(mesh.ndim):
        table = [x for part in C.all_gather_object(table, mesh, i) for x in part]
    rows, bad = [], False
    table = sorted(set(table))
    dtype0 = table[0][3]
    for rank, coord, lshape, dtype in table:
        want = spec.local_shape(coord)
        ok = lshape == want and dtype == dtype0
        bad = bad or not ok
        rows.append(
            f"rank {rank} (mesh coordinate {coord}) has {lshape} {dtype}"
            + ("" if ok else f" but needs {want} {dtype0}")
        )
    if bad:
        raise ValueError(
            f"DTensor.from_local(run_check=True): the local shards do not form a tensor of shape "
            f"{tuple(spec.shape)} with placements {placements_str(spec.placements)} on mesh "
            f"{tuple(mesh.shape)}: " + "; ".join(rows)
        )


bind_tensor_class(DTensor)


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, grad_placements):
        ctx.spec = spec
        ctx.grad_placements = grad_placements
        # a fresh alias, so autograd sees a new tensor (as PyTorch's from_local does)
        return DTensor(local.view_as(local), spec, requires_grad=local.requires_grad)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        if not isinstance(grad, DTensor):
            return grad, None, None
        target = ctx.grad_placements or _grad_placements(spec.placements)
        if grad._spec.placements != target:
            grad = grad.redistribute(spec.mesh, target)
        return grad.to_local(), None, None


def _from_local_in_graph(local, mesh, placements, shape, stride, grad_placements) -> DTensor:
    """``from_local`` of a tensor that requires grad, as ONE node of a ``torch.compile`` graph
    (registered with ``torch.compiler.allow_in_graph`` below; AOTAutograd then traces
    ``_FromLocal`` as usual).  PyTorch's Dynamo puts its own ``DTensor.from_local`` in the graph the
    same way.  Traced inline instead, ``_FromLocal.forward`` becomes a Dynamo subgraph, and when the
    mesh is a graph input (a ``DeviceMesh`` from a closure or a module, e.g. a parallel style's input
    hook) the spec built in that subgraph holds the mesh proxy of the outer graph, which Dynamo does
    not lift out of a dataclass: "create_node using arg not from this SubgraphTracer"."""
    spec = DTensorSpec(mesh, tuple(placements), tuple(shape), tuple(stride), local.dtype)
    return _FromLocal.apply(local, spec, grad_placements)


def _register_with_dynamo() -> None:
    """What torch.compile needs from dtshard, set up once ``torch._dynamo`` is imported:

    - ``from_local`` with grad is one graph node (see :func:`_from_local_in_graph`);
    - the dispatcher's frames are never compiled by Dynamo: when a compiled function breaks its
      graph (``torch.optim`` does on purpose), the rest runs eagerly and DTensor ops re-enter
      ``__torch_dispatch__``, which Dynamo would otherwise try to trace and recompile for every
      op until its recompile limit (PyTorch's DTensor wraps its dispatch in
      ``torch._disable_dynamo``; ``skip_code`` does the same without a wrapper on the eager path);
    - rules for the prims Dynamo rewrites ops into (``prims.fma``).
    """
    from torch._dynamo.eval_frame import skip_code

    from dtshard import dispatch as _dispatch
    from dtshard.rules.pointwise import register_compile_prims

    torch.compiler.allow_in_graph(_from_local_in_graph)
    for fn in (DTensor.__torch_dispatch__, _dispatch.dispatch, _dispatch._dispatch_general):
        skip_code(getattr(fn, "__func__", fn).__code__)
    register_compile_prims()


class _OnDynamoImport:
    """Runs :func:`_register_with_dynamo` right after ``torch._dynamo`` is imported (importing it
    here would add about a second to ``import dtshard``; a program that compiles imports it anyway)."""

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _register_with_dynamo()

        spec.loader.exec_module = exec_then_register
        return spec


if "torch._dynamo" in sys.modules:
    _register_with_dynamo()
else:
    sys.meta_path.insert(0, _OnDynamoImport())


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt: DTensor, grad_placements):
        ctx.spec = dt._spec
        ctx.grad_placements = grad_placements
        return dt._local_tensor.view_as(dt._local_tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        placements = ctx.grad_placements or spec.placements
        gspec = DTensorSpec(spec.mesh, tuple(placements), spec.shape, _contiguous_stride(spec.shape), grad.dtype)
        return DTensor(grad, gspec, requires_grad=False), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt: DTensor, placements):
        src = dt._spec
        ctx.src = src
        local = redistribute_local(dt._local_tensor, src, placements)
        return DTensor(local, src.with_placements(placements), requires_grad=dt.requires_grad)

    @staticmethod
    def backward(ctx, grad):
        src = ctx.src
        if not isinstance(grad, DTensor):
            raise TypeError("dtshard: the gradient of a DTensor redistribute must be a DTensor")
        target = _grad_placements(src.placements)
        return grad.redistribute(src.mesh, target), None


# ---------------------------------------------------------------------------------------------
# distribute_tensor / distribute_module
# ---------------------------------------------------------------------------------------------


def distribute_tensor(
    tensor: torch.Tensor,
    device_mesh: Optional[DeviceMesh] = None,
    placements: Optional[Sequence[Placement]] = None,
    *,
    src_data_rank: Optional[int] = 0,
) -> DTensor:
    """Distribute a full tensor over ``device_mesh`` with ``placements``.

    As in PyTorch, the data of the mesh's rank ``src_data_rank`` is used (broadcast along each mesh
    dim); with ``src_data_rank=None`` every rank is trusted to hold the same tensor and only slices
    locally (no communication).  The result is a leaf when ``tensor`` is (requires_grad kept).
    """
    if device_mesh is None:
        raise ValueError("distribute_tensor: pass device_mesh")
    _reject_distributed_input(tensor, "distribute_tensor")
    placements = list(placements) if placements is not None else [Replicate()] * device_mesh.ndim
    placements = normalize_placements(placements, tensor.dim(), device_mesh.ndim, what="distribute_tensor")
    requires_grad = tensor.requires_grad
    full = tensor.detach()
    if src_data_rank is not None:
        src_coord = _mesh_coord_of(device_mesh, src_data_rank)
        for i in reversed(range(device_mesh.ndim)):
            # after the step for mesh dim i, every rank whose coordinates before i equal src's
            # holds src's data; after mesh dim 0, every rank does
            full = C.broadcast(full, src_coord[i], device_mesh, i)
    spec = DTensorSpec(device_mesh, tuple(Replicate() for _ in placements), tuple(full.shape),
                       tuple(full.stride()) if full.is_contiguous() else _contiguous_stride(full.shape), full.dtype)
    local = redistribute_local(full.contiguous(), spec, placements)
    if torch._C._is_alias_of(local, tensor):  # storage identity: no data pointer, so it also traces
        local = local.clone()  # never alias the caller's tensor
    return DTensor(local, spec.with_placements(placements), requires_grad=requires_grad)


def _mesh_coord_of(mesh: DeviceMesh, rank: int) -> tuple[int, ...]:
    idx = (mesh.mesh == rank).nonzero()
    if idx.numel() == 0:
        raise ValueError(f"src_data_rank={rank} is not a rank of mesh {mesh.mesh.tolist()}")
    return tuple(int(v) for v in idx[0])


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
    ``output_fn(module, outputs, mesh)`` become forward pre-/post-hooks.
    """
    if device_mesh is None:
        raise ValueError("distribute_module: pass device_mesh")
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
        module.register_forward_pre_hook(lambda mod, inputs: input_fn(mod, inputs, device_mesh))
    if output_fn is not None:
        module.register_forward_hook(lambda mod, inputs, outputs: output_fn(mod, outputs, device_mesh))
    return module
