"""``dtshard.DTensor``: a tensor subclass holding this rank's shard of a global tensor.

To the model code a DTensor behaves like the global tensor (shape, dtype, autograd); underneath,
every aten op goes through :func:`dtshard.dispatch.dispatch`.  The public API mirrors
``torch.distributed.tensor`` (same signatures, same chunk layout for uneven shards), so code written
for it runs unchanged, and tensors convert both ways without moving data (:meth:`DTensor.from_torch`,
:meth:`DTensor.to_torch`).
"""

from __future__ import annotations

import functools
import itertools
import sys
from typing import Optional, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard
from torch.utils._python_dispatch import _get_current_dispatch_mode

from dtshard import collectives as C
from dtshard import hooks
from dtshard._config import config
from dtshard.dispatch import bind_tensor_class, resolved_local, torch_dispatch
from dtshard.redistribute import redistribute_local
from dtshard.spec import (DTensorSpec, TensorMeta, contiguous_strides, global_stride_from_local, is_shard, same_mesh, normalize_placements,
                          placements_equal, placements_str)

__all__ = ["DTensor", "mesh_or_current", "op_output", "reject_distributed_input"]


def mesh_or_current(device_mesh: Optional[DeviceMesh], what: str) -> DeviceMesh:
    """``device_mesh``, or else the mesh of the innermost ``with mesh:`` block (PyTorch's current
    mesh, the stack ``DeviceMesh.__enter__`` pushes to), as ``torch.distributed.tensor`` does."""
    if device_mesh is not None:
        return device_mesh
    from torch.distributed.device_mesh import _mesh_resources

    try:
        return _mesh_resources.get_current_mesh()
    except RuntimeError:  # "No device mesh is currently active!"
        pass
    raise ValueError(f"{what}: pass device_mesh, or call it inside a `with mesh:` block "
                     "(no DeviceMesh is active).")


def _install_grad_hooks(leaf: "DTensor") -> None:
    """Hooks every leaf DTensor that requires grad gets, once:

    - a tensor hook that lays every gradient out like the leaf (:func:`_grad_as_dtensor`).
      Autograd builds some gradients itself, without any DTensor input, so they never reach
      ``__torch_dispatch__``: zero-filled gradients (``_efficientzerotensor`` / ``zeros`` in
      derivative formulas, e.g. ``copysign``'s gradient for ``other``, ``sgn``'s), and undefined
      gradients materialised for custom Functions: those become DTensors.  The hook runs for
      ``.backward()`` and for ``torch.autograd.grad`` alike, so neither ``.grad`` nor a returned
      gradient is ever plain.  A DTensor gradient that goes into ``.grad`` but that its backward
      left in another layout (``x @ w`` with ``x`` sharded on its columns gives ``w`` a
      row-sharded gradient) is redistributed to the leaf's placements, its Partial mesh dims kept
      for the settlement below.
    - a post-accumulate hook that settles a Partial gradient once (:func:`_settle_grad`).
    """
    if getattr(leaf, "_dtshard_settles_grads", False) or torch.compiler.is_compiling():
        return
    # the hook holds the spec, never the leaf (not even weakly: nn.Module.to / .half() / to_empty
    # swap a parameter with torch.utils.swap_tensors, which refuses a tensor with a weakref)
    hook = functools.partial(_grad_as_dtensor, leaf._spec)
    hook.__torch_unserializable__ = True  # torch.save: __setstate__ installs fresh hooks (no warning)
    leaf.register_hook(hook)
    leaf.register_post_accumulate_grad_hook(_settle_grad)
    leaf._dtshard_settles_grads = True


def _grad_as_dtensor(spec: DTensorSpec, grad: torch.Tensor):
    """Tensor hook of a leaf DTensor with ``spec``: a plain gradient becomes a DTensor laid out like
    the leaf (Partial as Replicate).  A DTensor gradient that goes into ``.grad`` is moved to the
    leaf's layout but for its Partial mesh dims (:func:`_in_grad_layout`), or copied into the
    leaf's memory layout where AccumulateGrad would copy it (:func:`_in_leaf_layout`), and a Partial
    one that AccumulateGrad is about to add into a settled ``.grad`` reopens it first
    (:func:`_reopen_settled_grad`); one that ``torch.autograd.grad`` returns keeps the layout its
    backward gave it, as in PyTorch's DTensor (the caller decides what to move).  None: unchanged."""
    if grad is None:  # an undefined gradient (allow_unused)
        return None
    if isinstance(grad, DTensor):
        out = grad
        if not same_mesh(grad._spec.mesh, spec.mesh):
            out = _onto_sub_mesh(grad, spec.mesh, "the gradient of a leaf DTensor")
        accumulates, node = _accumulating_node()
        if accumulates:
            out = _in_grad_layout(spec, out)
        if out._spec.stride != spec.stride:
            copied = _in_leaf_layout(spec, out)
            if copied is not None:
                out = copied
        if node is not None:
            for p in out._spec.placements:
                if isinstance(p, Partial):
                    _reopen_settled_grad(node.variable, out)
                    break
        return None if out is grad else out
    return _promote_plain(grad, spec.mesh, _grad_placements(spec.placements), shape=spec.shape,
                          what="the gradient of a leaf DTensor")


def _accumulating_node():
    """``(accumulates, node)`` for the gradient a leaf's tensor hook sees: whether it goes into the
    leaf's ``.grad`` (``backward()``) rather than being returned (``torch.autograd.grad``), and the
    AccumulateGrad node about to add it (None when the engine does not say: the gradient is then
    taken to go into ``.grad``, and nothing is reopened)."""
    node = torch._C._current_autograd_node()
    if node is None or type(node).__name__ != "AccumulateGrad":
        return True, None
    try:
        return (True, node) if torch._C._will_engine_execute_node(node) else (False, None)
    except RuntimeError:  # torch.autograd.grad: "A leaf node was passed to _will_engine_execute_node"
        return False, None


def _in_grad_layout(spec: DTensorSpec, grad: "DTensor") -> "DTensor":
    """``grad`` (on the leaf's mesh) redistributed to the placements of the leaf's gradients
    (:func:`_grad_placements`) on every mesh dim where it is not Partial: ``grad`` itself when it
    already is.  The Partial dims stay for :func:`_settle_grad` (bucketed with other gradients, or
    left Partial when ``config.settle_partial_grads`` is off).  Accumulation then adds gradients of
    one layout (never one that moves a settled ``.grad``), and the optimizer, clipping and
    checkpoints read ``.grad`` in the parameter's layout, as with PyTorch's DTensor and FSDP2."""
    gp = grad._spec.placements
    want = _grad_placements(spec.placements)
    if len(gp) != len(want):
        return grad
    target = tuple(g if isinstance(g, Partial) else w for g, w in zip(gp, want))
    if placements_equal(gp, target) or grad._spec.extra is not None or spec.extra is not None:
        return grad  # (layout-extension data: its extension lays out its gradients)
    try:
        return grad.redistribute(grad._spec.mesh, target)
    except ValueError:  # no legal path to that layout: the gradient stays as it is (correct)
        return grad


def _reopen_settled_grad(param: "DTensor", new: "DTensor") -> None:
    """Gradient accumulation (a second ``backward()`` without ``zero_grad``) with buckets on: the
    Partial(sum) gradient ``new`` that AccumulateGrad is about to add into ``param.grad``, which an
    earlier backward settled to Replicate on those mesh dims.  Added as it is, ``add_`` would reduce
    it at once (one all_reduce per parameter); instead ``.grad`` becomes a NEW Partial tensor holding
    the settled value as its terms (the first rank of each Partial mesh dim keeps it, the others hold
    zeros: the same sum), AccumulateGrad adds ``new`` into that locally, and the post-accumulate
    hook buckets the sum like the first backward's.  The settled tensor is not touched: every
    alias of it (``p.grad.detach()``, ``p.grad.to_local()``, a view) keeps its meaning, and the
    settlement writes the reduced sum back into it in place and makes it ``.grad`` again
    (:func:`_store_settled`), so after ``backward()`` ``.grad`` is the same tensor holding the
    accumulated gradient on every rank, as in one process.  Only without grad mode (with
    ``create_graph`` AccumulateGrad adds out of place), eagerly, on plain local tensors."""
    if not config.settle_partial_grads or not config.grad_bucket_bytes or torch.is_grad_enabled() \
            or torch.compiler.is_compiling():
        return  # (buckets off: AccumulateGrad's add_ reduces the new terms in place, one all_reduce)
    old = param.grad
    if not _reopenable(old, new):
        return
    ns = new._spec
    coord = C.mesh_coordinate(ns.mesh)
    first = all(coord[i] == 0 for i, p in enumerate(ns.placements) if isinstance(p, Partial))
    local = old._local_tensor.clone() if first else torch.zeros_like(old._local_tensor)
    reopened = DTensor(local, old._spec.with_placements(ns.placements), requires_grad=False)
    reopened._dtshard_settles_into = old
    param.grad = reopened


def _reopenable(grad, new) -> bool:
    """``grad`` (settled) and ``new`` (Partial sums) the same tensor's layouts but for Replicate
    in ``grad`` where ``new`` is Partial(sum), on plain local tensors, eagerly."""
    if type(grad) is not DTensor or type(new) is not DTensor:
        return False
    gs, ns = grad._spec, new._spec
    if gs.has_strided or ns.has_strided or not C.is_member(gs.mesh):
        return False
    if gs.extra is not None or ns.extra is not None or gs.shape != ns.shape or gs.dtype != ns.dtype \
            or not same_mesh(gs.mesh, ns.mesh) or "_dtshard_settles_into" in grad.__dict__:
        return False
    g_local, n_local = grad._local_tensor, new._local_tensor
    if type(g_local) is not torch.Tensor or type(n_local) is not torch.Tensor or g_local.shape != n_local.shape \
            or _get_current_dispatch_mode() is not None or g_local.is_conj() or g_local.is_neg():
        return False
    reopened = False
    for g, n in zip(gs.placements, ns.placements):
        if isinstance(n, Partial):
            if n.reduce_op != "sum" or not isinstance(g, Replicate):
                return False
            reopened = True
        elif not placements_equal((g,), (n,)):
            return False
    return reopened


def _onto_sub_mesh(grad: "DTensor", mesh: DeviceMesh, what: str) -> "DTensor":
    """A gradient computed on a larger mesh than its tensor's (a sub-mesh DTensor, e.g. a
    tensor-parallel parameter, lifted onto the activations' mesh inside
    ``implicit_replication()``) as a DTensor on the tensor's own mesh: its other dims reduced or
    gathered to ``Replicate`` (their Partial terms summed: the gradient over every rank's batch
    and sequence), then dropped."""
    dims = C.sub_mesh_dims(grad._spec.mesh, mesh) if C.is_member(grad._spec.mesh) else None
    if dims is None:
        raise ValueError(
            f"{what}: a gradient on mesh {tuple(grad._spec.mesh.shape)} {grad._spec.mesh.mesh_dim_names} for a "
            f"DTensor on mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}, which is not a sub-mesh of it")
    gs = grad._spec
    target = tuple(p if d in dims else Replicate() for d, p in enumerate(gs.placements))
    if target != gs.placements:
        grad = grad.redistribute(gs.mesh, target)
    spec = DTensorSpec(mesh, tuple(gs.placements[d] for d in dims), gs.shape, grad._spec.stride, gs.dtype)
    return DTensor(grad._local_tensor, spec, requires_grad=False)


def _in_leaf_layout(spec: DTensorSpec, grad: "DTensor"):
    """A gradient that is not laid out like its leaf (a transposed weight gradient: the backward
    of ``x @ w.t()``, as compiled graphs return it) is copied by AccumulateGrad into the leaf's
    layout when the leaf has no gradient yet; for a DTensor that copy is three dispatched ops
    (detach, new_empty_strided, copy_).  Made here instead, as one local copy, for a contiguous
    leaf and no double backward.  When the leaf already holds a gradient (accumulation),
    AccumulateGrad adds this one in place, so the copy was not needed: one local copy more, never
    a different value (the hook cannot look at the leaf: it holds no reference to it)."""
    gs = grad._spec
    if torch.is_grad_enabled() or gs.extra is not None or spec.extra is not None or gs.shape != spec.shape or gs.dtype != spec.dtype \
            or not placements_equal(gs.placements, spec.placements) or spec.stride != contiguous_strides(spec.shape):
        return None
    # the same layout as the leaf but for the strides: the leaf's own (contiguous) spec
    return DTensor(grad._local_tensor.contiguous(), spec, requires_grad=False)


def _promote_plain(t: torch.Tensor, mesh: DeviceMesh, placements=None, *, shape=None, what: str) -> "DTensor":
    """A plain tensor that autograd created from metadata alone (a zero-filled gradient, a factory
    in a derivative formula) as a DTensor: it holds the GLOBAL value and is the same on every
    rank, so it is Replicate, then sliced locally (no communication) to ``placements``.  With
    ``shape`` (the global shape it must have) a tensor of any other shape raises: never guess."""
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise RuntimeError(
            f"dtshard: {what} of global shape {tuple(shape)} on mesh {tuple(mesh.shape)} arrived as a "
            f"plain torch.Tensor of shape {tuple(t.shape)}; a gradient of a DTensor must be a DTensor "
            "(a custom autograd.Function should return DTensor gradients for DTensor inputs).")
    if t._is_zerotensor():  # autograd's lazy zeros: materialise (a ZeroTensor cannot be sliced)
        t = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    rep = DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim)
    if placements is None or tuple(placements) == rep.placements:
        return rep
    return rep.redistribute(mesh, placements)


def _settle_grad(param: "DTensor") -> None:
    """Post-accumulate hook of a leaf DTensor: a gradient not in the parameter's layout (a Partial
    one; the tensor hook already moved every other mesh dim) is settled to it, by the first
    gradient settler that takes it (``dtshard.hooks.grad_settler``: a bucket with others when that
    is a plain all_reduce, ``dtshard.grad_buckets``), else on its own
    (:func:`reduce_partial_grad`)."""
    grad = param.grad
    if not config.settle_partial_grads or not isinstance(grad, DTensor) or not isinstance(param, DTensor):
        return
    gp, pp = grad._spec.placements, param._spec.placements
    if len(gp) != len(pp) or placements_equal(gp, _grad_placements(pp)):
        return
    if any(isinstance(p, Partial) for p in gp):
        for settle in hooks.grad_settlers:
            if settle(param, grad):
                return
    reduce_partial_grad(param)


def reduce_partial_grad(param: "DTensor") -> None:
    """Settle ``param``'s gradient to the parameter's layout now (one redistribute; Partial as
    Replicate), into the tensor it was reopened from if it was (:func:`_store_settled`)."""
    grad = param.grad
    if not isinstance(grad, DTensor):
        return
    gp, pp = grad._spec.placements, param._spec.placements
    target = _grad_placements(pp)
    if len(gp) != len(pp) or placements_equal(gp, target):
        return
    with torch.no_grad():
        try:
            settled = grad.redistribute(grad.device_mesh, target)
        except ValueError:  # no legal path to that layout: the gradient stays as it is (correct)
            return
        _store_settled(param, grad, settled)


def _store_settled(param: "DTensor", grad: "DTensor", settled: "DTensor") -> None:
    """``param.grad = settled``, the settlement of ``param``'s gradient ``grad``.  When ``grad`` was
    reopened from a settled gradient (:func:`_reopen_settled_grad`), that tensor takes the value in
    place instead and is ``.grad`` again: what one process's in-place accumulation does, so every
    alias of it reads the accumulated gradient (the same values on every rank)."""
    into = grad.__dict__.get("_dtshard_settles_into")
    if into is not None:
        s, t = settled._spec, into._spec
        if placements_equal(s.placements, t.placements) and s.shape == t.shape and s.dtype == t.dtype \
                and settled._local_tensor.shape == into._local_tensor.shape:
            with torch.no_grad():
                into.copy_(settled)
            param.grad = into
            return
    param.grad = settled


def _grad_placements(ps: Sequence[Placement]) -> tuple[Placement, ...]:
    """Placements a gradient flowing back to a tensor with placements ``ps`` should take: the
    gradient of every partial term is the whole gradient, so Partial becomes Replicate."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in ps)


def _drop_extra(t: "DTensor") -> "DTensor":
    """``t`` without the layout-extension data its spec carries (differentiable), by the
    extension that owns the data."""
    return hooks.extension_of(t._spec.extra).drop(t)


class _DTensorType(type(torch.Tensor)):
    """The metaclass of dtshard's :class:`DTensor`: the class compares equal (``==``, never
    ``is``) to PyTorch's ``torch.distributed.tensor.DTensor``.

    PyTorch's debugging modes (``CommDebugMode``, ``MemTracker``, FSDP2's memory tracker) pick out
    its DTensor with ``any(t == DTensor for t in types)`` and, for it, return ``NotImplemented`` so
    that the DTensor dispatches with the mode still on: the collectives it issues then reach the
    mode.  Any other subclass they run with the mode off, so nothing dtshard issued inside an op (a
    cumsum's all_to_all, a matmul's all_gather) was counted.  Equal under ``==``, dtshard's DTensor
    is handled as PyTorch's is; code that tells the classes apart uses ``is``/``isinstance``/
    ``issubclass``, which this does not touch."""

    def __eq__(cls, other):
        if cls is other:
            return True
        return cls is DTensor and other is _torch_dtensor_class()

    def __ne__(cls, other):
        return not _DTensorType.__eq__(cls, other)  # (cls.__eq__ is the tensor's elementwise ==)

    __hash__ = type.__hash__


@functools.lru_cache(maxsize=None)
def _torch_dtensor_class():
    from torch.distributed.tensor import DTensor as TorchDTensor

    return TorchDTensor


class DTensor(torch.Tensor, metaclass=_DTensorType):
    """A distributed tensor: ``_local_tensor`` is this rank's shard, ``_spec`` the global layout."""

    _local_tensor: torch.Tensor
    _spec: DTensorSpec
    #: set when this DTensor came out of a view op whose plan had to move the base (so it is a
    #: copy, not a view): says why; in-place ops on it raise (see dispatch._note_view)
    _copied_view: Optional[str] = None

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
        if spec.extra is not None:  # the layout data describes this version of the shard
            r.__dict__[hooks.LAYOUT_VERSION] = r._version
        # the lazy conjugate / negative bits live on the tensor, not in the storage: the wrapper
        # carries its shard's (as PyTorch's DTensor does), so PyTorch's Conjugate and Negative
        # fallbacks see them (they run before __torch_dispatch__: conj().mul(...) is resolved first)
        if local_tensor.is_conj():
            torch._C._set_conj(r, True)
        if local_tensor.is_neg():
            torch._C._set_neg(r, True)
        if requires_grad:  # a new leaf (distribute_tensor(..., requires_grad=True), ...)
            _install_grad_hooks(r)
        return r

    @property
    def data(self) -> "DTensor":
        """As ``torch.Tensor.data``: this DTensor detached from autograd, sharing its shard."""
        return torch._C.TensorBase.data.__get__(self, type(self))

    @data.setter
    def data(self, new) -> None:
        """``x.data = new`` (``nn.utils.vector_to_parameters``, ``p.data = p.data.to(dtype)``,
        weight-loading code): ``x`` takes ``new``'s values, dtype and device and keeps its own
        layout, so a parameter stays laid out as its parallel plan made it (``new`` is
        redistributed to ``x``'s placements when they differ). ``new`` must be a DTensor of the
        same global shape on the same mesh. (``torch.Tensor``'s own setter would update only the
        wrapper's metadata and leave this rank's shard, so the assignment would do nothing.)"""
        if not isinstance(new, DTensor):
            raise TypeError(
                f"dtshard: `.data = ` on a DTensor {tuple(self.shape)} {placements_str(self._spec.placements)} "
                f"on mesh {tuple(self._spec.mesh.shape)} got a plain {type(new).__name__}"
                f"{' of shape ' + str(tuple(new.shape)) if isinstance(new, torch.Tensor) else ''}, which does not "
                "say how it is laid out over the mesh. Assign dtshard.distribute_tensor(t, mesh, placements) "
                "(every rank holding the full tensor) or dtshard.DTensor.from_local(t, mesh, placements) (this "
                "rank's shard), or copy the values in place: `with torch.no_grad(): x.copy_(...)`.")
        spec = new._spec
        if not same_mesh(spec.mesh, self._spec.mesh):
            raise ValueError(
                f"dtshard: `.data = ` on a DTensor on mesh {tuple(self._spec.mesh.shape)} "
                f"{self._spec.mesh.mesh_dim_names} got one on mesh {tuple(spec.mesh.shape)} {spec.mesh.mesh_dim_names}: "
                "redistribute it onto this tensor's mesh first.")
        if tuple(spec.shape) != tuple(self._spec.shape):
            raise ValueError(
                f"dtshard: `.data = ` on a DTensor of global shape {tuple(self._spec.shape)} got one of shape "
                f"{tuple(spec.shape)}: a DTensor keeps its global shape (its layout, gradient hooks and any "
                "FSDP/TP group are built for it); make a new tensor instead.")
        if not placements_equal(spec.placements, self._spec.placements):
            new = new.detach().redistribute(self._spec.mesh, self._spec.placements)
            spec = new._spec
        torch._C.TensorBase.data.__set__(self, new)  # the wrapper's dtype, device and strides
        self._local_tensor = new._local_tensor
        self._spec = spec
        if spec.extra is not None:  # the layout data describes this version of the shard
            self.__dict__[hooks.LAYOUT_VERSION] = self._version
        else:
            self.__dict__.pop(hooks.LAYOUT_VERSION, None)

    def requires_grad_(self, requires_grad: bool = True) -> "DTensor":
        """As ``torch.Tensor.requires_grad_``; a leaf DTensor that starts requiring grad (e.g. the
        tensor ``nn.Parameter(dtensor)`` builds) gets its gradients settled once (see
        :func:`_install_grad_hooks`)."""
        super().requires_grad_(requires_grad)
        if requires_grad and self.is_leaf:
            _install_grad_hooks(self)
        return self

    def __setstate__(self, state) -> None:
        """Unpickling (``torch.load``, ``pickle``): the saved ``__dict__`` comes back, but tensor hooks
        are not serialized, so a loaded leaf that requires grad installs its own (the saved flag
        that says "installed" is dropped)."""
        def drop_flag(d):
            return {k: v for k, v in d.items() if k != "_dtshard_settles_grads"} if d else d

        state = (drop_flag(state[0]), state[1]) if isinstance(state, tuple) else drop_flag(state)
        torch._utils._set_obj_state(self, state)
        if self.requires_grad and self.is_leaf:
            _install_grad_hooks(self)

    def __format__(self, format_spec: str) -> str:
        """``f"{loss:.4f}"``: a 0-d DTensor that every rank holds whole (Replicate) formats its
        value, as a 0-d ``torch.Tensor`` does. A Partial one would need a collective, which a
        format on one rank only (a print on rank 0) would leave the other ranks out of: it keeps
        the repr without a format spec and raises with one. Other DTensors format as their repr."""
        if self.dim() == 0 and not self.is_meta:
            if not any(isinstance(p, Partial) for p in self._spec.placements):
                return self._local_tensor.item().__format__(format_spec)
            if format_spec:
                raise ValueError(
                    f"dtshard: format spec {format_spec!r} on a 0-d DTensor with placements "
                    f"{placements_str(self._spec.placements)}: its value is a reduction over ranks, which only a "
                    "collective gives. Reduce it on every rank first (x.full_tensor(), or x.item() on every "
                    "rank) and format that.")
        return object.__format__(self, format_spec)

    def __repr__(self) -> str:  # never gathers
        return (
            f"dtshard.DTensor(local={self._local_tensor}, shape={tuple(self._spec.shape)}, "
            f"placements={placements_str(self._spec.placements)}, mesh={tuple(self._spec.mesh.shape)}"
            + (f", {self._spec.extra})" if self._spec.extra is not None else ")")
        )

    #: every aten op on a DTensor: the dispatcher's entry itself (dtshard.dispatch.torch_dispatch)
    __torch_dispatch__ = classmethod(torch_dispatch)

    # ---- torch.compile support -----------------------------------------------------------
    def __tensor_flatten__(self):
        return ["_local_tensor"], self._spec

    @staticmethod
    def __tensor_unflatten__(inner_tensors, spec, outer_size, outer_stride):
        local = inner_tensors["_local_tensor"]
        if tuple(outer_size) != spec.shape or tuple(outer_stride) != spec.stride:
            spec = DTensorSpec(spec.mesh, spec.placements, tuple(outer_size), tuple(outer_stride), spec.dtype,
                               spec.extra)
        return DTensor(local, spec, requires_grad=local.requires_grad)

    def __coerce_same_metadata_as_tangent__(self, flatten_spec, expected_type=None):
        # AOTAutograd traced the backward for a tangent with ``flatten_spec`` (our spec); the
        # gradient that arrives at run time may have other placements (e.g. Partial): move it.
        if expected_type is not None and expected_type is not DTensor:
            if expected_type is torch.Tensor:
                raise RuntimeError(
                    f"dtshard: a compiled region returned a plain tensor that later code used with DTensors (implicit "
                    f"replication), so its gradient arrived as a DTensor ({placements_str(self._spec.placements)} on mesh "
                    f"{tuple(self._spec.mesh.shape)} {self._spec.mesh.mesh_dim_names}, global shape {tuple(self.shape)}); "
                    "the compiled backward was traced for a plain gradient and cannot take it. Seen with FSDP on DTensor "
                    "activations when a module's hooks compile as a frame of their own (the parameter gather): set "
                    "torch._dynamo.config.wrap_top_frame = True before compiling, so each compiled module's hooks "
                    "join its graph; elsewhere, use the tensor inside the compiled region or make it a DTensor there.")
            return None
        spec = flatten_spec
        if self._spec.extra is not None and spec.extra is None:
            return _drop_extra(self).__coerce_same_metadata_as_tangent__(flatten_spec, expected_type)
        if spec.placements == self._spec.placements and spec.extra == self._spec.extra:
            return self
        if not same_mesh(spec.mesh, self._spec.mesh):
            # a gradient computed on the activations' larger mesh for an output on a sub-mesh (a
            # tensor-parallel parameter that FSDP gathered inside the compiled region)
            return _onto_sub_mesh(self, spec.mesh, "the gradient of a compiled region's output") \
                .__coerce_same_metadata_as_tangent__(flatten_spec, expected_type)
        return self.redistribute(self._spec.mesh, spec.placements)

    def __coerce_tangent_metadata__(self):
        # Tangents for AOTAutograd must not be Partial: reduce them to Replicate; nor carry
        # layout-extension data
        if self._spec.extra is not None:
            return _drop_extra(self).__coerce_tangent_metadata__()
        if not any(isinstance(p, Partial) for p in self._spec.placements):
            return self
        return self.redistribute(self._spec.mesh, _grad_placements(self._spec.placements))

    # ---- public API ----------------------------------------------------------------------
    @property
    def placements(self) -> tuple[Placement, ...]:
        """One placement per mesh dim (``Shard``, ``Replicate``, ``Partial``, ``_StridedShard``), as in PyTorch's DTensor."""
        return self._spec.placements

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh the tensor is laid out on (PyTorch's ``DeviceMesh``, shared with ``torch.distributed.tensor``)."""
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
        reject_distributed_input(local_tensor, "DTensor.from_local")
        device_mesh = mesh_or_current(device_mesh, "DTensor.from_local")
        if placements is None:
            placements = [Replicate()] * device_mesh.ndim
        placements = normalize_placements(placements, local_tensor.dim(), device_mesh.ndim, what="DTensor.from_local")
        if stride is not None and shape is None:
            # a global stride without the global shape: the shape would be guessed from even
            # shards, whatever the stride was meant for (PyTorch raises the same).  shape= alone is
            # taken (PyTorch raises there): the global layout is then the contiguous one
            raise RuntimeError(
                f"DTensor.from_local: got stride={tuple(stride)} without shape= for a local tensor of shape "
                f"{tuple(local_tensor.shape)} with placements {placements_str(placements)} on mesh "
                f"{tuple(device_mesh.shape)}. Please pass both shape and stride at the same time (the global "
                "tensor's), shape alone, or neither for even shards.")
        if shape is None:
            gshape = list(local_tensor.shape)
            for i, p in enumerate(placements):
                if is_shard(p):
                    gshape[p.dim] *= device_mesh.size(i)
            shape = tuple(gshape)
            if stride is None:  # as PyTorch: the global layout follows the local one (a transposed
                # shard is a transposed tensor), computed from the local strides
                stride = global_stride_from_local(local_tensor.stride(), tuple(device_mesh.shape), placements)
        shape = tuple(shape)
        stride = tuple(stride) if stride is not None else contiguous_strides(shape)
        spec = DTensorSpec(device_mesh, tuple(placements), shape, stride, local_tensor.dtype)
        if run_check:
            _check_from_local(local_tensor, spec)
        elif not torch.compiler.is_compiling() and C.is_member(device_mesh):
            want = spec.local_shape(C.mesh_coordinate(device_mesh))
            if tuple(local_tensor.shape) != want:
                raise ValueError(
                    f"DTensor.from_local: this rank's local tensor has shape {tuple(local_tensor.shape)} "
                    f"but global shape {shape} with placements {placements_str(placements)} on mesh "
                    f"{tuple(device_mesh.shape)} gives it {want}; pass shape= for uneven shards."
                )
        elif not torch.compiler.is_compiling():
            # a rank outside the mesh holds an empty shard whatever it passed, as in PyTorch (the
            # global shape above still comes from what it passed)
            return DTensor(local_tensor.new_empty(0), spec, requires_grad=False)
        if not (local_tensor.requires_grad and torch.is_grad_enabled()):
            return DTensor(local_tensor.view_as(local_tensor), spec, requires_grad=False)
        grad_placements = tuple(grad_placements) if grad_placements is not None else None
        if torch.compiler.is_dynamo_compiling():  # one graph node (see _from_local_in_graph)
            return _from_local_in_graph(local_tensor, device_mesh, spec.placements, shape, stride, grad_placements)
        return _FromLocal.apply(local_tensor, spec, grad_placements)

    def to_local(self, *, grad_placements: Optional[Sequence[Placement]] = None) -> torch.Tensor:
        """This rank's shard as a plain tensor (differentiable: the gradient is taken to have
        ``grad_placements``, by default this tensor's placements)."""
        if self._spec.extra is not None:  # the shard the placements say, without extension data
            return _drop_extra(self).to_local(grad_placements=grad_placements)
        if not (self.requires_grad and torch.is_grad_enabled()):
            return self._local_tensor
        return _ToLocal.apply(self, tuple(grad_placements) if grad_placements is not None else None)

    def redistribute(
        self,
        device_mesh: Optional[DeviceMesh] = None,
        placements: Optional[Sequence[Placement]] = None,
        *,
        async_op: bool = False,
        forward_dtype: Optional[torch.dtype] = None,
        backward_dtype: Optional[torch.dtype] = None,
    ) -> "DTensor":
        """Move the data to new placements on the same mesh (differentiable; minimum traffic).

        As in PyTorch: ``forward_dtype`` casts the local shard before the collectives (the result
        has that dtype: a bf16 all_gather of an fp32 tensor); ``backward_dtype`` casts the
        gradient before the backward collectives, after which it is cast back to this tensor's
        dtype (``None``: the backward collectives run in this tensor's dtype).  ``async_op``
        ``True``: the last collective of the transition may still be in flight when this returns
        (the local shard is PyTorch's ``AsyncCollectiveTensor``, waited on first use), so work
        in between overlaps it, as with PyTorch's DTensor."""
        if self._spec.extra is not None:  # moving data: without extension data
            return _drop_extra(self).redistribute(device_mesh, placements, async_op=async_op,
                                                  forward_dtype=forward_dtype, backward_dtype=backward_dtype)
        mesh = self._spec.mesh
        # under torch.compile the mesh argument is an opaque proxy: the tensor's own mesh rules
        if device_mesh is not None and device_mesh is not mesh and not torch.compiler.is_compiling() \
                and not same_mesh(device_mesh, mesh):
            raise ValueError(
                f"redistribute: moving a DTensor of shape {tuple(self.shape)} to another mesh "
                f"({tuple(mesh.shape)} -> {tuple(device_mesh.shape)}) is not supported; "
                "redistribute on its own mesh."
            )
        if placements is None:
            raise ValueError("redistribute: pass the target placements")
        placements = normalize_placements(placements, self.dim(), mesh.ndim, what="DTensor.redistribute")
        if forward_dtype == self.dtype:
            forward_dtype = None
        if backward_dtype == self.dtype:
            backward_dtype = None
        if placements == self._spec.placements and forward_dtype is None:
            return self
        if not C.is_member(mesh):  # a rank outside the mesh: nothing moves (PyTorch's behaviour)
            spec = _with_dtype(self._spec, forward_dtype or self.dtype).with_placements(placements)
            return DTensor(self._local_tensor.to(spec.dtype), spec, requires_grad=self.requires_grad)
        if forward_dtype is not None or backward_dtype is not None:
            return _RedistributeCast.apply(self, placements, forward_dtype, backward_dtype)
        if not (self.requires_grad and torch.is_grad_enabled()):
            src = self._spec
            return DTensor(redistribute_local(resolved_local(self), src, placements, async_op=async_op),
                           src.with_placements(placements), requires_grad=False)
        return _Redistribute.apply(self, placements, async_op)

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

    def _blocks(self) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
        """This rank's shard as blocks of the global tensor: ``(global offsets, sizes, local
        offsets)``.  One block for plain layouts; a strided shard that is not one block (a view
        of merged dims) is the product of its per-dim intervals, each a view of the shard."""
        self._check_checkpointable()
        region = self._spec.local_region(C.mesh_coordinate(self._spec.mesh))
        if any(not ivs for ivs in region):  # an empty shard: one empty block
            return [(tuple(ivs[0][0] if ivs else 0 for ivs in region), tuple(self._local_tensor.shape),
                     (0,) * len(region))]
        per_dim = []
        for ivs in region:
            pos, opts = 0, []
            for lo, hi in ivs:
                opts.append((lo, hi - lo, pos))
                pos += hi - lo
            per_dim.append(opts)
        return [(tuple(o for o, _, _ in c), tuple(n for _, n, _ in c), tuple(lp for _, _, lp in c))
                for c in itertools.product(*per_dim)]

    def __create_write_items__(self, fqn: str, obj):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        items = []
        for offsets, sizes, _ in self._blocks():
            chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
            items.append(WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=chunk,
                    properties=TensorProperties.create_from_tensor(self._local_tensor),
                    size=self.size(),
                ),
            ))
        return items

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n, _ in self._blocks()]

    def __get_tensor_shard__(self, index):
        blocks = self._blocks()
        if len(blocks) == 1:
            return self._local_tensor
        want = tuple(index.offset) if index.offset is not None else None
        for offsets, sizes, local in blocks:
            if offsets == want:
                t = self._local_tensor
                for d, (lo, n) in enumerate(zip(local, sizes)):
                    if lo != 0 or n != t.shape[d]:
                        t = t.narrow(d, lo, n)
                return t
        raise ValueError(f"dtshard: no block of this rank's shard of {tuple(self.shape)} "
                         f"{placements_str(self._spec.placements)} starts at {want}")

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


def reject_distributed_input(t, what: str) -> None:
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
    """Collective check of every rank's local tensor; raises the same message on every rank.

    Every rank's local shape must be its shard of ``spec``; dtype, ``requires_grad`` and the global
    stride (passed, or computed from the local strides) must be the same on every rank (PyTorch's
    ``run_check`` compares dtype, requires_grad, shape and stride too)."""
    mesh = spec.mesh
    info = (C.world_rank(), C.mesh_coordinate(mesh), tuple(local.shape), str(local.dtype),
            bool(local.requires_grad), tuple(spec.stride))
    # gather along each mesh dim in turn gives every rank the whole table
    table = [info]
    for i in range(mesh.ndim):
        table = [x for part in C.all_gather_object(table, mesh, i) for x in part]
    rows, bad = [], False
    table = sorted(set(table))
    _, _, _, dtype0, grad0, stride0 = table[0]
    grads_differ = len({row[4] for row in table}) > 1
    strides_differ = len({row[5] for row in table}) > 1
    for rank, coord, lshape, dtype, grad, stride in table:
        want = spec.local_shape(coord)
        row = f"rank {rank} (mesh coordinate {coord}) has {lshape} {dtype}"
        if lshape != want or dtype != dtype0:
            row += f" but needs {want} {dtype0}"
        if grads_differ:  # shown only when the ranks disagree, for every rank
            row += f", requires_grad={grad}" + ("" if grad == grad0 else f" but needs requires_grad={grad0}")
        if strides_differ:
            row += f", local strides giving global stride {stride}" + (
                "" if stride == stride0 else f" but needs global stride {stride0}")
        bad = bad or lshape != want or dtype != dtype0 or grad != grad0 or stride != stride0
        rows.append(row)
    if bad:
        raise ValueError(
            f"DTensor.from_local(run_check=True): the local shards do not form a tensor of shape "
            f"{tuple(spec.shape)} with placements {placements_str(spec.placements)} on mesh "
            f"{tuple(mesh.shape)}: " + "; ".join(rows)
            + ". Give every rank a local tensor of the same dtype, requires_grad and memory layout "
            "(e.g. .contiguous()), shaped as its shard."
        )


_make_wrapper = torch.Tensor._make_wrapper_subclass


def op_output(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """``DTensor(local, spec, requires_grad=False)`` for a spec without layout-extension data:
    the dispatcher's wrap of an op's output (its hot path), without the constructor's call
    overhead and its extension-data and leaf branches, which never apply there; the conjugate /
    negative bits still do."""
    # positional: (size, strides, storage_offset, memory_format, dtype, layout, device), the
    # Python argument parser's cheapest form
    r = _make_wrapper(DTensor, spec.shape, spec.stride, None, None, spec.dtype, local.layout, local.device)
    r._local_tensor = local
    r._spec = spec
    if local.is_conj():
        torch._C._set_conj(r, True)
    if local.is_neg():
        torch._C._set_neg(r, True)
    return r


bind_tensor_class(DTensor, _promote_plain, op_output)

# ``torch.load``'s default ``weights_only=True`` unpickles only allowlisted classes: dtshard's DTensor
# and its spec join the ones ``torch.distributed.tensor`` registers for its own DTensor (DeviceMesh,
# its layout, the placements), so a saved DTensor loads without ``weights_only=False``.
torch.serialization.add_safe_globals([DTensor, DTensorSpec, TensorMeta, DeviceMesh, Shard, Replicate, Partial])


def _register_foreach_support() -> None:
    """Let ``torch.optim`` and ``torch.nn.utils.clip_grad_norm_`` take their ``_foreach_*`` paths
    for dtshard DTensors, as PyTorch registers its own DTensor: lists of DTensors then go through
    dtshard's foreach handlers (``dtshard/rules/foreach.py``), and ``clip_grad_norm_`` reduces the
    norms of a whole (mesh, placements) group with one collective."""
    from torch.optim.optimizer import _foreach_supported_types as optim_types
    from torch.utils._foreach_utils import _foreach_supported_types as util_types

    for types in (optim_types, util_types):
        if DTensor not in types:
            types.append(DTensor)


_register_foreach_support()


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, spec: DTensorSpec, grad_placements):
        ctx.spec = spec
        ctx.grad_placements = grad_placements
        # a fresh alias, so autograd sees a new tensor (as PyTorch's from_local does).  Built
        # without requires_grad: autograd marks a Function's outputs itself, and a DTensor built
        # requiring grad is a leaf that installs leaf hooks (_install_grad_hooks), whose hook dict
        # then never reaches this node: a user's out.register_hook(...) would never be called
        return DTensor(local.view_as(local), spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):
        spec = ctx.spec
        if not isinstance(grad, DTensor):  # built by autograd from metadata (zeros): the global value
            grad = _promote_plain(grad, spec.mesh, shape=spec.shape, what="the gradient of DTensor.from_local")
        elif not same_mesh(grad._spec.mesh, spec.mesh):
            grad = _onto_sub_mesh(grad, spec.mesh, "the gradient of DTensor.from_local")
        target = ctx.grad_placements or _grad_placements(spec.placements)
        if grad._spec.placements != target:
            grad = grad.redistribute(spec.mesh, target)
        return grad.to_local(), None, None


@hooks.in_graph
def _from_local_in_graph(local, mesh, placements, shape, stride, grad_placements) -> DTensor:
    """``from_local`` of a tensor that requires grad, as ONE node of a ``torch.compile`` graph
    (``dtshard.hooks.in_graph``: ``torch.compiler.allow_in_graph``; AOTAutograd then traces
    ``_FromLocal`` as usual).  PyTorch's Dynamo puts its own ``DTensor.from_local`` in the graph the
    same way.  Traced inline instead, ``_FromLocal.forward`` becomes a Dynamo subgraph, and when the
    mesh is a graph input (a ``DeviceMesh`` from a closure or a module, e.g. a parallel style's input
    hook) the spec built in that subgraph holds the mesh proxy of the outer graph, which Dynamo does
    not lift out of a dataclass: "create_node using arg not from this SubgraphTracer"."""
    spec = DTensorSpec(mesh, tuple(placements), tuple(shape), tuple(stride), local.dtype)
    return _FromLocal.apply(local, spec, grad_placements)


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt: DTensor, grad_placements):
        ctx.spec = dt._spec
        ctx.grad_placements = grad_placements
        local = C.waited(dt._local_tensor)  # never an in-flight result: see collectives.waited
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spec = ctx.spec
        placements = ctx.grad_placements or spec.placements
        gspec = DTensorSpec(spec.mesh, tuple(placements), spec.shape, contiguous_strides(spec.shape), grad.dtype)
        return DTensor(grad, gspec, requires_grad=False), None


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, dt: DTensor, placements, async_op: bool = False):
        src = dt._spec
        ctx.src = src
        local = redistribute_local(resolved_local(dt), src, placements, async_op=async_op)  # conj / neg applied
        return DTensor(local, src.with_placements(placements), requires_grad=False)  # see _FromLocal

    @staticmethod
    def backward(ctx, grad):
        src = ctx.src
        if not isinstance(grad, DTensor):  # built by autograd from metadata (zeros): the global value
            grad = _promote_plain(grad, src.mesh, shape=src.shape, what="the gradient of a redistribute")
        target = _grad_placements(src.placements)
        return grad.redistribute(src.mesh, target), None, None


def _with_dtype(spec: DTensorSpec, dtype: torch.dtype) -> DTensorSpec:
    return DTensorSpec(spec.mesh, spec.placements, spec.shape, spec.stride, dtype)


class _RedistributeCast(torch.autograd.Function):
    """``redistribute`` with ``forward_dtype`` / ``backward_dtype`` (PyTorch's semantics): the
    local shard is cast before the forward collectives; the gradient is cast to
    ``backward_dtype`` (default: the input's dtype) before the backward collectives and to the
    input's dtype after them."""

    @staticmethod
    def forward(ctx, dt: DTensor, placements, forward_dtype, backward_dtype):
        src = dt._spec
        ctx.src, ctx.backward_dtype = src, backward_dtype
        local = resolved_local(dt)
        dtype = forward_dtype or src.dtype
        if local.dtype != dtype:
            local = local.to(dtype)
        spec = _with_dtype(src, dtype)
        out = redistribute_local(local, spec, placements)
        return DTensor(out, spec.with_placements(placements), requires_grad=False)  # see _FromLocal

    @staticmethod
    def backward(ctx, grad):
        src = ctx.src
        if not isinstance(grad, DTensor):
            grad = _promote_plain(grad, src.mesh, shape=src.shape, what="the gradient of a redistribute")
        wire = ctx.backward_dtype or src.dtype
        if grad.dtype != wire:
            grad = grad.to(wire)
        grad = grad.redistribute(src.mesh, _grad_placements(src.placements))
        if grad.dtype != src.dtype:
            grad = grad.to(src.dtype)
        return grad, None, None, None


# The tensor class's runtime, which Dynamo must never compile as frames of their own (see
# dtshard.hooks.runtime_entry_points): the tensor constructor and the subclass protocol
# (AOTAutograd's runtime wrappers rebuild DTensors from their inner tensors and compare specs
# with ``==``), and the backward of the autograd Functions and the gradient hook (the autograd
# engine calls them).  At the END of the module: it names classes defined above.
hooks.runtime_entry_points(
    DTensor.__torch_dispatch__, DTensor.__new__, DTensor.__tensor_flatten__, DTensor.__tensor_unflatten__,
    DTensor.__coerce_same_metadata_as_tangent__, DTensor.__coerce_tangent_metadata__,
    DTensorSpec.__eq__, DTensorSpec.__hash__, DTensorSpec.token,
    _FromLocal.backward, _ToLocal.backward, _Redistribute.backward, _RedistributeCast.backward,
    _settle_grad, _grad_as_dtensor, _store_settled,
    _DTensorType.__eq__, _DTensorType.__ne__,  # PyTorch's modes compare the class (t == DTensor)
)
