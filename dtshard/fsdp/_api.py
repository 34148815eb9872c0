"""``fully_shard`` and ``FSDPModule``: PyTorch 2.13's FSDP2 API on dtshard DTensors."""

from __future__ import annotations

import functools
import threading
import types
import warnings
from typing import Any, Callable, Optional

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, OffloadPolicy
from torch.distributed.tensor.placement_types import Shard

from dtshard import collectives as C
from dtshard.tensor import DTensor
from dtshard.fsdp._group import ParamGroup, tp_mesh_inside
from dtshard.fsdp._state import FSDPState
from dtshard.spec import is_strided, mesh_identity, placements_str

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "register_fsdp_forward_method", "share_comm_ctx"]


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``: ``wait()`` finishes the all_gather."""

    def __init__(self, states: list):
        self._states = states

    def wait(self) -> None:
        for s in self._states:
            s.group.wait_unshard()
        self._states = []


class _Applying(threading.local):
    """Per thread: the FSDP modules whose ``_apply`` is running on this thread (their submodules'
    calls only convert).  Thread-local, so two threads converting two models at once (PyTorch's
    FSDP2 tests run ranks as threads of one process) never see each other's conversion."""

    def __init__(self):
        self.stack: list = []


_APPLYING = _Applying()


class FSDPModule:
    """Mixed into the class of every module ``fully_shard`` was applied to (``FSDP<Class>``), so
    ``isinstance(m, dtshard.fsdp.FSDPModule)`` holds and the methods below are available."""

    def __new__(cls, *args, **kwargs):
        # Containers build new instances of their own class (``nn.Sequential.__getitem__`` with
        # a slice): those are new, unsharded modules, so build the original class.
        orig = cls.__mro__[2]
        self = orig.__new__(orig, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo):
        raise RuntimeError(
            "dtshard.fsdp: a fully_shard module cannot be deep-copied (its parameters are shards with "
            "hooks); save and load its state_dict() instead, or deep-copy the model before fully_shard.")

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module.to`` / ``.half()`` / ``.double()`` / ``.cuda()`` / ``to_empty`` go through
        here: the full parameters are freed, the conversion swaps each sharded parameter for
        its converted self (same object, as ``torch.utils.swap_tensors`` keeps it: optimizers
        holding it stay valid), and every group is laid out again in the new dtype and device
        (:meth:`ParamGroup.rebuild`).  Meta-device init: build on ``meta``, ``fully_shard``,
        then ``to_empty(device=...)`` and initialise the (sharded) parameters in place."""
        stack = _APPLYING.stack
        if stack:  # a submodule inside an outer conversion: the outermost rebuilds (once)
            return super()._apply(fn, recurse)
        states = self._fsdp_states(recurse)
        for state in states:
            state.group.reshard()
        stack.append(self)
        try:
            out = super()._apply(fn, recurse)
        finally:
            stack.pop()
        for state in states:  # after every module of a module-list group was converted
            state.group.rebuild()
        return out

    @property
    def _fsdp_state(self) -> FSDPState:
        return self._dtshard_fsdp

    def _fsdp_states(self, recurse: bool) -> list:
        if not recurse:
            return [self._dtshard_fsdp]
        # a list of modules shares one state: each state once
        return list({id(m._dtshard_fsdp): m._dtshard_fsdp for m in self.modules() if isinstance(m, FSDPModule)}.values())

    def unshard(self, async_op: bool = False) -> Optional[UnshardHandle]:
        """All-gather this module's group (one collective); with ``async_op`` return a handle
        whose ``wait()`` finishes it (the next forward waits for it anyway)."""
        state = self._dtshard_fsdp
        state.group.unshard(async_op=async_op)
        return UnshardHandle([state]) if async_op else None

    def reshard(self) -> None:
        """Free the full parameters (the sharded ones are always kept)."""
        self._dtshard_fsdp.group.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """With ``False``, backward accumulates the full gradients locally (in the reduce dtype)
        without any reduce_scatter; the next backward with ``True`` reduces the sum."""
        for s in self._fsdp_states(recurse):
            s.group.requires_gradient_sync = requires_gradient_sync
            s.group.requires_all_reduce = requires_gradient_sync  # as PyTorch: both together

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward: expects a bool, got {reshard_after_forward!r}")
        for s in self._fsdp_states(recurse):
            s.group.reshard_after_forward = reshard_after_forward
            s.group.post_forward_mesh = None  # a bool: reshard over the whole shard group
            s.group.drop_post()
            s.auto_reshard = False

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for s in self._fsdp_states(recurse):
            s.group.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(self, modules: list) -> None:
        """Start these modules' all_gathers when this module's forward starts (replaces the
        default of prefetching the next module in forward order)."""
        self._dtshard_fsdp.forward_prefetch = [_state_of(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list) -> None:
        """Start these modules' all_gathers when this module's backward starts (replaces the
        default of prefetching the previous module in forward order)."""
        self._dtshard_fsdp.backward_prefetch = [_state_of(m, "set_modules_to_backward_prefetch") for m in modules]

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """With ``False`` the end of backward does not wait for the gradient reductions (they
        finish at the end of the next backward with ``True``, or at the next root forward)."""
        state = self._dtshard_fsdp
        state.lazy_init()
        state.ctx.is_last_backward = is_last_backward

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: with ``False`` the gradients are reduce-scattered over the shard dim but not
        all-reduced across the replicas; each such output is kept and added to the next
        reduction that does all-reduce (gradient accumulation with reduce_scatter only).
        ``.grad`` is set by that reduction.  No effect on 1-D FSDP (nothing to all-reduce)."""
        for s in self._fsdp_states(recurse):
            s.group.requires_all_reduce = requires_all_reduce

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the data-parallel size (this
        module's group only, as in PyTorch).  Works on every backend: dtshard sums in the
        collective and divides afterwards (PyTorch's ``PREMUL_SUM`` needs NCCL)."""
        if not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: the factor must be positive, got {factor!r}")
        self._dtshard_fsdp.group.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated alias of :meth:`set_gradient_divide_factor` (as in PyTorch)."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Use only sum reductions in the collectives and divide separately.  dtshard's
        collectives always sum; what changes is when the division happens, hence what an
        all-reduce hook sees: the sum (divided by a power-of-two pre-factor in float16) instead
        of the average, exactly as in PyTorch."""
        self._dtshard_fsdp.group.force_sum_reduction = bool(enable)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """``hook(reduce_output)`` runs on this group's reduced flat gradient shard (in the reduce
        dtype), after the reduce_scatter (HSDP: after the all-reduce too) and before ``.grad``
        is set from it; an in-place change of it changes the gradients.  ``stream``: the stream
        to run it on (not with HSDP, as in PyTorch).  Eager only."""
        group = self._dtshard_fsdp.group
        if stream is not None and group.hsdp:
            raise ValueError("set_all_reduce_hook: stream cannot be set when using HSDP (as in PyTorch)")
        group.all_reduce_hook = (hook, stream)

    def set_post_optim_event(self, event) -> None:
        """The root waits on ``event`` (recorded after the optimizer step) before its next
        forward's all_gather, instead of on the whole current stream; then drops it, so set a
        new event each iteration.  Any object with ``wait()`` (``torch.Event`` on an accelerator;
        the CPU has no events, and there the all_gather follows the step anyway)."""
        state = self._dtshard_fsdp
        state.lazy_init()
        state.ctx.post_optim_event = event

    def set_custom_all_gather(self, comm) -> None:
        """Run this group's all_gather with ``comm``, a ``torch.distributed.fsdp`` ``AllGather``:
        ``comm.allocate((n,), dtype=, device=)`` gives the output buffer and
        ``comm(output_tensor=, input_tensor=, group=, async_op=)`` fills it.  Eager only."""
        self._dtshard_fsdp.group.all_gather_comm = comm

    def set_custom_reduce_scatter(self, comm) -> None:
        """Run this group's reduce_scatter with ``comm``, a ``torch.distributed.fsdp``
        ``ReduceScatter`` (``allocate`` for the input and output buffers; called with
        ``op=ReduceOp.SUM``: FSDP divides afterwards).  Eager only."""
        self._dtshard_fsdp.group.reduce_scatter_comm = comm

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """With ``True``, every parameter of a group whose backward ran gets its ``.grad`` from
        the reduction, including those this rank's backward did not reach (zeros in, other
        ranks' terms out): the same ``.grad`` on every rank when control flow differs between
        ranks (mixture of experts).  dtshard's reduce_scatter always has the same size on
        every rank (zeros for missing gradients), so with ``False`` nothing hangs, but such a
        parameter's ``.grad`` is only set on the ranks that used it."""
        for s in self._fsdp_states(recurse):
            s.group.reduce_unused = reduce_scatter_unused_params

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many gradient reductions (and their reduce_scatter inputs, where the backend holds
        them) may be in flight at once (default 1, as PyTorch): a group's post-backward waits
        for the oldest ones beyond that before it issues its own (HSDP: and then starts their
        all-reduce).  More overlap, more memory."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for s in self._fsdp_states(recurse):
            s.group.max_rs_buffers = max_input_buffers

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run the gradient reduce_scatter on a process group of its own over the same shard ranks
        (one per set of ranks), so it can progress concurrently with all_gathers.  Collective:
        call it on every rank of the mesh.  ``False``: back to the shared group."""
        for s in self._fsdp_states(recurse):
            g = s.group
            if g.ddp:
                continue  # nothing is reduce-scattered
            g.rs_mesh = (C.separate_group_mesh(g.mesh, g.shard_dim), 0) if enable else None

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """With ``False``, this group's parameters are not all-gathered for backward (for groups
        whose backward needs none of their values, e.g. an embedding); a backward that does read
        them fails on the freed storage."""
        self._dtshard_fsdp.group.unshard_in_backward = unshard_in_backward

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Allocate the all_gather and reduce_scatter staging buffers from the process group's
        own allocator where its backend has one (NCCL's, for zero-copy transfers), else as
        usual (gloo).  Not together with a custom comm (as in PyTorch)."""
        group = self._dtshard_fsdp.group
        for comm in (group.all_gather_comm, group.reduce_scatter_comm):
            if comm is not None and not isinstance(comm, C.ProcessGroupAllocComm):
                raise ValueError(
                    "set_allocate_memory_from_process_group_for_comm: this module has a custom comm "
                    f"({type(comm).__name__}); it decides its own buffers")
        if not enable or group.ddp:
            group.all_gather_comm = group.reduce_scatter_comm = None
            return
        group.all_gather_comm = C.ProcessGroupAllocComm(group.mesh, group.shard_dim)
        group.reduce_scatter_comm = C.ProcessGroupAllocComm(*(group.rs_mesh or (group.mesh, group.shard_dim)))

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Symmetric-memory staging buffers for the all_gather (NCCL's copy-engine collectives).
        Needs CUDA and NCCL's symmetric memory; dtshard does not support it yet, and says so
        instead of silently running the usual path."""
        mesh = self._dtshard_fsdp.group.mesh
        if backend != "NCCL":
            raise ValueError(f"set_symm_mem_for_comm: only backend='NCCL' exists, got {backend!r}")
        raise NotImplementedError(
            f"set_symm_mem_for_comm: symmetric-memory all_gathers need NCCL on CUDA (this mesh is "
            f"{mesh.device_type!r}), and dtshard.fsdp does not support them yet; leave it unset (the usual "
            "all_gather runs) or use set_allocate_memory_from_process_group_for_comm(True)")

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: wait for the collectives in flight,
        reshard every group, drop the failed iteration's gradient reductions (and any
        accumulation), so the next iteration runs normally.  Call it on the root."""
        state = self._dtshard_fsdp
        if state.ctx is not None and not state.is_root:
            raise RuntimeError(
                f"reset_iter_state: {type(self).__name__} is not the root FSDP module (the root is "
                f"{type(state.ctx.root.module).__name__}); call it on the root")
        state.reset_iter_state()


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` (not ``forward``) all-gather and free the parameters the
    way ``forward`` does, e.g. a ``generate`` that does not call ``forward`` (PyTorch 2.13's
    function, same semantics: a module that is not an FSDP module is left alone)."""
    if not isinstance(module, FSDPModule):
        return
    if not hasattr(module, method_name):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method {method_name!r}")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        state = self._dtshard_fsdp
        args, kwargs = state._pre_forward(self, args, kwargs)
        return state._post_forward(self, args, orig(*args, **kwargs))

    module.__setattr__(method_name, types.MethodType(wrapped, module))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """PyTorch 2.13's ``share_comm_ctx(modules)``, same signature and argument checks: let several
    FSDP roots (pipeline-parallel model chunks) share one communication context.  In PyTorch that
    context is the CUDA streams FSDP issues its all_gathers, reduce_scatters and all_reduces on
    (shared to avoid memory fragmentation between streams).  dtshard.fsdp issues every collective
    on the process group's own stream (asynchronous work handles) and has no streams of its own,
    so every FSDP root already shares it: after checking the arguments (``ValueError`` for an
    element that is not an FSDP module, as PyTorch) there is nothing to rebind."""
    if len(modules) == 0:
        return
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"Expects list of FSDPModules but got {module}")


def _check_tp_param(where: str, fqn: str, p: DTensor, mesh) -> None:
    """FSDP x TP: a parameter that already is a dtshard DTensor (``parallelize_module`` on the
    ``"tp"`` sub-mesh) is sharded again over ``mesh`` (the ``"dp"`` sub-mesh of the same mesh)."""
    tp_mesh = p._spec.mesh
    desc = (f"parameter {fqn!r} (shape {tuple(p.shape)}, placements {placements_str(p._spec.placements)} on "
            f"mesh {tuple(tp_mesh.shape)} {tp_mesh.mesh_dim_names})")
    if tp_mesh.ndim != 1 or any(is_strided(q) or q.is_partial() for q in p._spec.placements):
        raise NotImplementedError(
            f"{desc}: FSDP x TP takes parameters sharded or replicated on a 1-D tensor-parallel mesh")
    if tp_mesh_inside(tp_mesh, mesh):
        # data x spatial (or context) parallelism: the parameter is replicated over a mesh whose
        # ranks all belong to the FSDP mesh (fully_shard on the flattened (dp, sp) mesh): one
        # reduce_scatter over all of them reduces the spatial partial gradients and the data-
        # parallel ones at once
        if not all(q.is_replicate() for q in p._spec.placements):
            raise NotImplementedError(
                f"{where}: {desc} is sharded on a mesh inside the FSDP mesh {tuple(mesh.shape)} "
                f"{mesh.mesh_dim_names}; only replicated parameters are supported there (data x spatial "
                "parallelism); for FSDP x TP use fully_shard(module, mesh=mesh['dp'])")
        return
    same_root = False
    try:
        root_dp, root_tp = mesh._get_root_mesh(), tp_mesh._get_root_mesh()
        same_root = mesh_identity(root_dp) == mesh_identity(root_tp) and root_dp is not mesh
    except Exception:  # noqa: BLE001 - a mesh without a root: not a sub-mesh
        pass
    names_ok = bool(mesh.mesh_dim_names) and bool(tp_mesh.mesh_dim_names) and \
        tp_mesh.mesh_dim_names[0] not in mesh.mesh_dim_names
    if not (same_root and names_ok):
        raise ValueError(
            f"{where}: {desc} is tensor-parallel on a mesh that is not another dim of the data-parallel "
            f"mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}. Build one mesh, e.g. mesh = "
            "init_device_mesh(device, (dp, tp), mesh_dim_names=('dp', 'tp')), parallelize with mesh['tp'] "
            "and call fully_shard(module, mesh=mesh['dp']) (HSDP x TP: a (replicate, shard, tp) mesh and "
            "mesh=mesh['replicate', 'shard'])")
    if p.dim() == 0 or p._local_tensor.dim() == 0:
        raise NotImplementedError(f"{where}: {desc} is 0-dim; FSDP shards dim 0")


def _names(v) -> tuple:
    return () if v is None else ((v,) if isinstance(v, str) else tuple(v))


def _spmd_meshes(where: str, mesh, dims):
    """``dp_mesh_dims``: the data-parallel mesh FSDP runs on (the shard dim, or the
    ``(replicate, shard)`` dims for HSDP) and ``(full mesh, DP dim indices, other dim index or
    None)``.  PyTorch 2.13's semantics; what dtshard does not support yet raises, the same on
    every rank."""
    shard, rep = _names(getattr(dims, "shard", None)), _names(getattr(dims, "replicate", None))
    names = mesh.mesh_dim_names
    if not shard and not rep:
        raise ValueError(f"{where}: dp_mesh_dims needs shard or replicate set")
    if names is None:
        raise ValueError(f"{where}: dp_mesh_dims needs a mesh with mesh_dim_names, got {tuple(mesh.shape)}")
    for n in shard + rep:
        if n not in names:
            raise ValueError(f"{where}: mesh dim name {n!r} of dp_mesh_dims is not in the mesh's {names}")
    if not shard and len(rep) > 1:
        raise NotImplementedError(f"{where}: dp_mesh_dims without a shard dim (DDP) over several (flattened) "
                                  f"replicate dims {rep} is not supported yet; name one")
    flattened = len(shard) > 1
    if len(rep) > 1 or (flattened and (rep or len(shard) != mesh.ndim)):
        raise NotImplementedError(
            f"{where}: dp_mesh_dims with several replicate dims {rep}, or several (flattened) shard dims {shard} "
            f"together with other mesh dims ({names}), is not supported yet: flattened shard dims must be all "
            "the mesh's dims (FSDP over the whole mesh), otherwise name one dim each")
    if flattened and tuple(shard) != tuple(names):
        raise NotImplementedError(f"{where}: dp_mesh_dims: flattened shard dims {shard} must be named in the mesh's "
                                  f"order {names}")
    if mesh._get_root_mesh() is not mesh:
        raise NotImplementedError(f"{where}: dp_mesh_dims needs the full mesh (a root mesh), got a sub-mesh "
                                  f"{tuple(mesh.shape)} {names}")
    dp = [names.index(n) for n in rep + shard]
    if rep and shard and dp[0] > dp[1]:
        raise NotImplementedError(f"{where}: dp_mesh_dims: the replicate dim {rep[0]!r} must come before the shard "
                                  f"dim {shard[0]!r} in the mesh {names}")
    others = [i for i in range(mesh.ndim) if i not in dp]
    if len(others) > 1:
        raise NotImplementedError(f"{where}: dp_mesh_dims on a mesh {names} with more than one non-data-parallel "
                                  "dim is not supported yet")
    if flattened:  # FSDP over the flattened group of every mesh dim (PyTorch flattens them the same way)
        dp_mesh = mesh._flatten("_".join(shard))
    elif not shard:  # DDP: the parameters stay replicated; each group's gradients are all-reduced
        dp_mesh = mesh[rep[0]]
    else:
        dp_mesh = mesh[rep + shard] if rep else mesh[shard[0]]
    return dp_mesh, (mesh, frozenset(dp), others[0] if others else None)


def _from_spmd(where: str, params: list, spmd) -> tuple[list, dict]:
    """``dp_mesh_dims``: each parameter is a dtshard DTensor on the full mesh, ``Replicate`` on
    the DP dims.  FSDP shards its local tensor like an FSDP x TP parameter: as a DTensor on the
    other mesh dim (``mesh[tp]``) with that dim's placement, or, with no other dim, as a plain
    tensor.  Returns the params so converted and ``{fqn: (full mesh, placements, shape, DP dim
    indices)}``: the layout the module gets back in forward."""
    full, dp_dims, other = spmd
    out, layouts = [], {}
    for fqn, p, owners in params:
        if not isinstance(p, DTensor) or mesh_identity(p._spec.mesh) != mesh_identity(full):
            raise ValueError(
                f"{where}: with dp_mesh_dims every parameter must be a dtshard DTensor on the mesh given to "
                f"fully_shard {tuple(full.shape)} {full.mesh_dim_names} (e.g. via distribute_module); parameter "
                f"{fqn!r} is {'a DTensor on another mesh' if isinstance(p, DTensor) else 'a plain tensor'}")
        bad = [full.mesh_dim_names[i] for i in dp_dims if not p._spec.placements[i].is_replicate()]
        if bad:
            raise ValueError(f"{where}: parameter {fqn!r} has placements {p._spec.placements}: with dp_mesh_dims it "
                             f"must be Replicate() on the data-parallel dims {bad}")
        layouts[fqn] = (full, p._spec.placements, tuple(p.shape), dp_dims)
        local = p._local_tensor.detach()
        if other is None:
            q = torch.nn.Parameter(local, requires_grad=p.requires_grad)
        else:
            tp_mesh = full[full.mesh_dim_names[other]]
            q = torch.nn.Parameter(DTensor.from_local(local, tp_mesh, [p._spec.placements[other]], shape=p.shape,
                                                      stride=p.stride()), requires_grad=p.requires_grad)
        out.append((fqn, q, owners))
    return out, layouts


def _placement_dim(where: str, fqn: str, p, placement) -> int:
    """The tensor dim a ``shard_placement_fn`` result shards (``None``: 0), as PyTorch reads it:
    a ``Shard`` (a negative dim counts from the end), else ``ValueError``."""
    if placement is None:
        return 0
    if type(placement).__name__ == "ShardPlacementResult":
        if getattr(placement, "mesh_info", None) is not None:
            raise NotImplementedError(
                f"{where}: shard_placement_fn returned a ShardPlacementResult with its own mesh for {fqn!r}; "
                "dtshard.fsdp shards every parameter of a group over the group's mesh: return a Shard(dim)")
        placement = placement.placement
        if placement is None:
            return 0
    if not isinstance(placement, Shard) or type(placement) is not Shard:
        raise ValueError(f"Invalid shard_placement_fn result: {placement} ({where}: for parameter {fqn!r} of shape "
                         f"{tuple(p.shape)}; return a Shard(dim) or None)")
    d = placement.dim + p.dim() if placement.dim < 0 else placement.dim
    if not 0 <= d < p.dim():
        raise ValueError(f"{where}: shard_placement_fn returned {placement} for parameter {fqn!r} of shape "
                         f"{tuple(p.shape)}: Shard dim {placement.dim} is invalid for a {p.dim()}D tensor")
    return d


def _state_of(m, what: str) -> FSDPState:
    if not isinstance(m, FSDPModule):
        raise ValueError(f"{what}: {type(m).__name__} is not a fully_shard module")
    return m._dtshard_fsdp


_fsdp_classes: dict = {}
#: guards the process-wide caches below (fully_shard may be called from several threads)
_LOCK = threading.Lock()


def _fsdp_class(cls: type) -> type:
    with _LOCK:  # one FSDP<Class> per class, also when two threads shard two models at once
        hit = _fsdp_classes.get(cls)
        if hit is None:
            hit = _fsdp_classes[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
        return hit


#: (device type, world size, id of the default process group) -> (that group, the mesh)
_DEFAULT_MESHES: dict = {}


def _default_mesh():
    """The mesh of ``fully_shard`` without ``mesh=``: the whole world, 1-D, on the accelerator if
    there is one (PyTorch's default).  Created once per (device type, world) and reused, so every
    module of a model sharded without ``mesh=`` holds its parameters on ONE mesh object.  Keyed
    by the default process group too: a new one (after ``destroy_process_group``, or each rank's
    own when ranks are threads of one process) gets its own mesh.  The mesh is built outside the
    lock (building it is collective: ranks that are threads must not wait on each other's lock)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        raise RuntimeError("fully_shard: no mesh given and no default process group; call "
                           "dtshard.collectives.init_process_group() or pass mesh=")
    device = torch.accelerator.current_accelerator().type if torch.accelerator.is_available() else "cpu"
    pg = dist.distributed_c10d._get_default_group()
    key = (device, dist.get_world_size(), id(pg))
    with _LOCK:
        hit = _DEFAULT_MESHES.get(key)
    if hit is not None and hit[0] is pg:
        return hit[1]
    mesh = C.init_device_mesh(device, (key[1],))
    with _LOCK:
        return _DEFAULT_MESHES.setdefault(key, (pg, mesh))[1]


def fully_shard(
    module,
    *,
    mesh=None,
    reshard_after_forward: bool | int | None = None,
    shard_placement_fn: Callable | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set | None = None,
    dp_mesh_dims: Any = None,
):
    """Shard ``module``'s parameters over ``mesh`` (PyTorch 2.13's ``fully_shard``, same signature).

    Apply it bottom-up (each block, then the root).  The parameters it owns (those of
    ``module.parameters()`` not owned by an earlier call on a submodule, minus ``ignored_params``)
    become ``dtshard.DTensor`` parameters, ``Shard(0)`` on a 1-D mesh (FSDP) or
    ``(Replicate(), Shard(0))`` on a 2-D ``(replicate, shard)`` mesh (HSDP), and form one group:
    one all_gather before the module's forward (and again before its backward when
    ``reshard_after_forward``), one reduce_scatter of its gradients (plus, HSDP, one all_reduce
    across replicas).  ``reshard_after_forward=None``: True except for the root.  Every rank must
    hold the same initial parameters (as with PyTorch).  Returns ``module``, whose class now
    also derives from :class:`FSDPModule`.

    FSDP x TP: parameters that already are dtshard DTensors on ``mesh_2d["tp"]`` (from
    ``dtshard.parallel.parallelize_module``) are sharded again over ``mesh=mesh_2d["dp"]``: the
    sharded parameters are DTensors on the 2-D mesh (a TP ``Shard(0)`` weight becomes
    ``(_StridedShard(0, split_factor=tp), Shard(0))``, as in PyTorch), the module computes with its
    usual TP DTensors, and the all_gather / reduce_scatter run over the dp mesh dim only.

    A list of modules makes ONE group of all their parameters (PyTorch's semantics): gathered when
    the first of them starts its forward, freed after the last; the list is returned.

    An int ``reshard_after_forward=k`` (a divisor of the shard mesh dim's size) reshards to k
    ranks after forward, as PyTorch does: each rank keeps 1/k of the group's gathered parameters
    until backward, whose all_gather then runs over k consecutive ranks only (intra-node).

    HSDP x TP: a ``(replicate, shard, tp)`` mesh, ``parallelize_module`` on ``mesh["tp"]``, then
    ``fully_shard(block, mesh=mesh["replicate", "shard"])``: the sharded parameters are DTensors
    on the 3-D mesh (``Replicate`` on the replicate dim), the all_gather runs over the shard dim,
    the reduce_scatter over the shard dim and the all_reduce over the replicate dim.

    ``dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...)`` (PyTorch 2.13's SPMD form):
    ``mesh`` is the full mesh and every parameter a DTensor on it, ``Replicate`` on the named
    data-parallel dims; FSDP shards over the shard dim (HSDP: replicates over the replicate dim)
    and hands the module DTensors on the full mesh in their original placements.  Their gradients
    keep what autograd gives on the data-parallel dims (a ``Partial`` is reduced by FSDP's
    reduce_scatter, no extra all_reduce) and are averaged over the data-parallel ranks, as in
    PyTorch.  One shard dim, at most one replicate dim (before it) and at most one other dim.

    Without ``mesh=`` the mesh is the whole world (1-D, the accelerator's device type or CPU),
    created once per (device type, world size, default process group) and reused: every module of
    a model sharded that way holds its parameters on one mesh object.

    ``shard_placement_fn(param)`` may return ``Shard(d)`` for any tensor dim (negative counts from
    the end) or None (``Shard(0)``); an uneven split of dim d is supported (PyTorch's FSDP2 refuses
    it for d > 0).  Each rank's piece is stored contiguously, so the sharded parameter is a
    contiguous ``Shard(d)`` DTensor, as in PyTorch.

    Shared (tied) parameters must be in ONE group (both modules in one ``fully_shard`` call, or
    in the enclosing module's group): a parameter another call already sharded raises
    ``ValueError(... already managed by another FSDP group ...)``, as PyTorch does (at its lazy
    init; dtshard at the second ``fully_shard`` call, before any collective).

    A parameter re-assigned after ``fully_shard`` and before the first forward (meta-device init,
    then ``module.w = nn.Parameter(...)``) is picked up by the lazy init: a DTensor in the sharded
    parameter's layout (PyTorch's case) or a plain tensor of the full shape, the same on every
    rank (dtshard keeps this rank's shard).

    What is registered: the sharded DTensor parameters, always, the same objects for the module's
    whole life (``parameters()``, ``state_dict()``, optimizers, DCP, ``clip_grad_norm_`` see them
    also between a forward and the next reshard).  PyTorch's FSDP2 instead registers the unsharded
    plain parameters while a group is unsharded (the root after forward, or
    ``reshard_after_forward=False``).  Inside a forward the module's attributes are the full plain
    tensors, as in PyTorch.

    A module of a multi-module group called on its own, outside the root's forward (a chunked
    loss: ``model.head(chunk)`` per chunk), gathers the group for that call; its gradients of all
    such calls are accumulated and reduced once.

    Not yet supported (raise): an int ``reshard_after_forward`` with FSDP x TP, placements
    other than ``Shard(0)`` from ``shard_placement_fn`` for tensor-parallel parameters or with
    ``dp_mesh_dims``, ``dp_mesh_dims`` with several dims flattened or without a shard dim.
    0-dim parameters raise ``ValueError`` as in PyTorch.
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    where = (f"fully_shard([{', '.join(type(m).__name__ for m in modules)}])" if isinstance(module, (list, tuple))
             else f"fully_shard({type(module).__name__})")
    # ---- validate everything before touching the module: the same checks on every rank, so a
    # bad call raises everywhere and no collective was issued
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise ValueError(f"fully_shard: expects an nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, FSDPModule) or getattr(m, "_dtshard_fsdp", None) is not None:
            raise ValueError(f"{where}: fully_shard was already applied to {type(m).__name__}; apply it once per "
                             "module (bottom-up: blocks first, then the root)")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError(f"{where}: a module appears twice in the list")
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, (bool, int)):
        raise ValueError(f"{where}: reshard_after_forward must be None, a bool, or an int (the number of ranks "
                         f"to reshard to after forward), got {reshard_after_forward!r}")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise ValueError(f"{where}: mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy")
    if not isinstance(offload_policy, OffloadPolicy):
        raise ValueError(f"{where}: offload_policy must be a torch.distributed.fsdp.OffloadPolicy")
    mesh = mesh if mesh is not None else _default_mesh()
    spmd = None  # dp_mesh_dims: (the full SPMD mesh, its DP dim indices, its other dim or None)
    ddp = False  # dp_mesh_dims with replicate dims only: no sharding, one all_reduce per group
    if dp_mesh_dims is not None:
        mesh, spmd = _spmd_meshes(where, mesh, dp_mesh_dims)
        ddp = not _names(getattr(dp_mesh_dims, "shard", None))
        if ddp and isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
            raise ValueError(f"{where}: reshard_after_forward={reshard_after_forward} (int) with dp_mesh_dims "
                             "without a shard dim (DDP): nothing is sharded; use a bool")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh} ({where}: 1-D for FSDP, 2-D "
                         "(replicate, shard) for HSDP; for FSDP x TP pass mesh['dp'], or use dp_mesh_dims)")
    post_k = None  # reshard_after_forward=k: reshard to groups of k ranks after forward
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        W = mesh.size(mesh.ndim - 1)
        k = reshard_after_forward
        if k < 1 or k > W or W % k:
            raise ValueError(f"{where}: reshard_after_forward={k}: an int must divide the shard mesh dim's size {W} "
                             f"(mesh {tuple(mesh.shape)}): the number of ranks to reshard to after forward")
        if k == 1:
            warnings.warn(f"{where}: reshard_after_forward=1 (int) reshards to world size 1, that is "
                          "reshard_after_forward=False", UserWarning, stacklevel=2)
            reshard_after_forward = False
        elif k == W:
            reshard_after_forward = True
        else:
            if mesh._get_root_mesh() is not mesh:
                raise NotImplementedError(
                    f"{where}: reshard_after_forward={k} on a sub-mesh {tuple(mesh.shape)} {mesh.mesh_dim_names} "
                    "(FSDP x TP) is not supported: the groups of k ranks are built from the whole mesh; use a bool")
            post_k = k
            reshard_after_forward = True
    device = torch.device(mesh.device_type) if mesh.device_type == "cpu" else \
        torch.device(mesh.device_type, torch.get_device_module(mesh.device_type).current_device())

    ignored = set(ignored_params or ())
    claimed = set()  # parameters of submodules that already are FSDP groups
    for top in modules:
        for sub in top.modules():
            if sub is not top and getattr(sub, "_dtshard_fsdp", None) is not None:
                claimed.update(id(p) for p in sub.parameters())
    owners: dict = {}  # id(param) -> (fqn, param, [(owner, name)])
    for k, top in enumerate(modules):
        prefix = f"[{k}]." if len(modules) > 1 else ""
        for mname, sub in top.named_modules(remove_duplicate=False):
            for pname, p in sub._parameters.items():
                if p is None or id(p) in claimed or p in ignored:
                    continue
                fqn = prefix + (f"{mname}.{pname}" if mname else pname)
                entry = owners.setdefault(id(p), (fqn, p, []))
                if (sub, pname) not in [(o, n) for o, n in entry[2]]:
                    entry[2].append((sub, pname))
    params = list(owners.values())
    for fqn, p, owned_by in params:
        taken = getattr(p, "_dtshard_fsdp_taken", None)
        if taken is not None:
            # a shared (tied) parameter another fully_shard call already sharded: this group would
            # shard a second copy of it, and the tie would be silently broken (PyTorch: ValueError)
            other_where, other_fqn = taken
            here = ", ".join(f"{type(o).__name__}.{n}" for o, n in owned_by)
            raise ValueError(
                f"{where}: parameter {fqn!r} (shape {tuple(p.shape)}, registered as {here}) is shared with a parameter "
                f"already managed by another FSDP group ({other_where}, as {other_fqn!r}). For shared/tied parameters, "
                "use fully_shard([module_a, module_b]) to place them in the same FSDP group, or let the enclosing "
                "module's group own both (fully_shard it without sharding either module on its own)")
    spmd_layouts = {}
    if spmd is not None:
        params, spmd_layouts = _from_spmd(where, params, spmd)
    shard_dims: dict = {}  # fqn -> the tensor dim shard_placement_fn chose, where not 0
    devices = sorted({str(p.device) for _, p, _ in params})
    if len(devices) > 1:
        listing = ", ".join(f"{fqn}: {p.device}" for fqn, p, _ in params)
        raise ValueError(f"{where}: the parameters are on different devices ({listing}); move the module "
                         f"to one device (the mesh's, {mesh.device_type}) before fully_shard")
    from torch.distributed.tensor import DTensor as TorchDTensor

    for fqn, p, _ in params:
        if isinstance(p, TorchDTensor):
            raise ValueError(
                f"{where}: parameter {fqn!r} (shape {tuple(p.shape)}, placements {p.placements}) is a "
                "torch.distributed.tensor.DTensor; dtshard.fsdp shards dtshard DTensors: convert it first "
                "with dtshard.DTensor.from_torch(param), or pass plain tensors")
        if getattr(p, "_dtshard_fsdp_sharded", False):
            raise ValueError(
                f"{where}: parameter {fqn!r} (shape {tuple(p.shape)}) is already sharded by fully_shard on an "
                "enclosing module; apply fully_shard bottom-up: each block first, then the root")
        if isinstance(p, DTensor):
            _check_tp_param(where, fqn, p, mesh)
        if p.dim() == 0:
            # PyTorch's wording and type (ValueError), with where it happened
            raise ValueError(f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D tensor with "
                             f"numel equal to 1. ({where}: parameter {fqn!r} is 0-dim; FSDP needs a dim to shard)")
        if shard_placement_fn is not None:
            d = _placement_dim(where, fqn, p, shard_placement_fn(p))
            if d:
                if isinstance(p, DTensor) or spmd is not None or ddp:
                    raise NotImplementedError(
                        f"{where}: shard_placement_fn returned Shard({d}) for {fqn!r} (shape {tuple(p.shape)}) "
                        "together with tensor parallelism or dp_mesh_dims; there FSDP shards dim 0 only: return "
                        "Shard(0) (or None) for such parameters")
                shard_dims[fqn] = d
    inside = {tp_mesh_inside(p._spec.mesh, mesh) for _, p, _ in params if isinstance(p, DTensor)}
    if True in inside and (len(inside) > 1 or any(not isinstance(p, DTensor) for _, p, _ in params)):
        raise ValueError(
            f"{where}: some parameters are replicated over a mesh inside the FSDP mesh (data x spatial "
            "parallelism) and others are not; give every parameter of the module the same layout "
            "(e.g. distribute_module(module, mesh['sp']) first)")
    tp_meshes = {id(p._spec.mesh._get_root_mesh()) for _, p, _ in params if isinstance(p, DTensor)}
    tp_names = {p._spec.mesh.mesh_dim_names for _, p, _ in params if isinstance(p, DTensor)}
    if len(tp_meshes) > 1 or len(tp_names) > 1:
        raise ValueError(f"{where}: the tensor-parallel parameters live on different meshes {sorted(tp_names)}; "
                         "parallelize the module on one mesh['tp']")
    dtypes = sorted({str(p.dtype) for _, p, _ in params})
    if len(dtypes) > 1:
        raise NotImplementedError(
            f"{where}: the parameters of one group must share a dtype, got {dtypes}; call fully_shard on "
            "submodules so each group has one dtype")
    if any(p.dtype.is_complex or not p.dtype.is_floating_point for _, p, _ in params):
        raise NotImplementedError(f"{where}: only floating-point parameters are supported, got {dtypes}")

    # ---- build the group
    if params and params[0][1].device != device and params[0][1].device.type != "meta":
        with torch.no_grad():
            params = [(fqn, p.to(device), o) for fqn, p, o in params]
    for top in modules:
        for buf_owner in top.modules():  # buffers follow the module to the mesh's device (as PyTorch)
            for k, b in buf_owner._buffers.items():
                if b is not None and b.device != device and b.device.type != "meta":
                    buf_owner._buffers[k] = b.to(device)
    group = ParamGroup(modules[0], params, mesh, device, mp_policy, offload_policy,
                       reshard_after_forward if reshard_after_forward is not None else True, spmd_layouts, ddp=ddp,
                       shard_dims=shard_dims)
    if post_k is not None:
        group.post_forward_mesh = C.regrouped_mesh(mesh, post_k)
    state = FSDPState(modules, group, mp_policy, auto_reshard=reshard_after_forward is None)
    below = {id(sub._dtshard_fsdp): sub._dtshard_fsdp for top in modules for sub in top.modules()
             if getattr(sub, "_dtshard_fsdp", None) is not None}
    for sub in below.values():
        sub.has_parent = True
    state.subtree = list(below.values())
    for m in modules:
        m._dtshard_fsdp = state
        m.__class__ = _fsdp_class(type(m))
    for fqn, p, _ in owners.values():  # a tied alias left on a module outside this group must not be sharded again
        p._dtshard_fsdp_taken = (where, fqn)
    return module
