"""One FSDP parameter group: the parameters one ``fully_shard`` call owns, their flat buffers and
the collectives that move them.

Layout (all sizes follow from the parameters' global shapes and the mesh, the same on every rank):
with ``W`` ranks on the shard mesh dim, parameter ``i`` of global shape ``(R_i, *rest_i)`` is cut
along dim 0 the way ``torch.chunk`` cuts it (``c_i = ceil(R_i / W)`` rows per rank, the last
ranks short or empty).  Every rank's piece of parameter ``i`` is padded to ``c_i * prod(rest_i)``
elements, so the group's flat shard ``S = sum_i c_i * prod(rest_i)`` is the same size on every rank::

    rank r's flat shard:   [ p0 rows of r | pad ][ p1 rows of r | pad ] ...      (S elements)
    all_gather output:     [ rank 0's flat shard ][ rank 1's flat shard ] ...    (W * S elements)

The sharded parameters (``dtshard.DTensor``, ``Shard(0)`` on the shard dim) are views into the
flat shard, so one ``all_gather_into_tensor`` of it gathers the whole group.  Parameter ``i`` is
then strided across the gathered buffer (rank-major), so it is copied out, parameter after
parameter, into the group's flat unsharded buffer, of which the full parameters are views.
Gradients go the other way: copied (cast to the reduce dtype) into a ``W * S`` buffer in the
gathered layout, one ``reduce_scatter`` leaves this rank's flat gradient shard, whose pieces are
the sharded gradients.  HSDP (2-D mesh ``(replicate, shard)``) then all-reduces that shard across
the replicate dim.

``shard_placement_fn``'s ``Shard(d)`` with d > 0: the parameter is cut along dim d the same way
(``c_i = ceil(shape[d] / W)``, uneven too), and rank r's piece is stored in its natural layout
``shape[:d] + (rows_r,) + shape[d+1:]``, padded at its end (contiguous: the sharded parameter is
still a view of the flat shard); the copy-out reads the gathered pieces as ``(pre, rows_r, post)``
blocks (``_rank_pieces_dim``), and the gradients go in the same way.

With one rank on the shard dim (world size 1) nothing is issued: the "gathered" layout is the
flat shard, and the gradient sum is this rank's (HSDP with more replicas: their all_reduce only).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard import _trace
from dtshard import collectives as C
from dtshard.hooks import in_graph
from dtshard.spec import DTensorSpec, chunk_range, contiguous_strides, mesh_identity
from dtshard.tensor import DTensor


def _fsdp_op() -> _trace.op_context:
    """Traffic issued inside is attributed to ``<fsdp>`` by ``CommCounter`` (``CommRecord.op``)."""
    return _trace.op_context("<fsdp>")


class _Probe(torch.autograd.Function):
    """Calibration of :func:`_free_if_exclusive`: what a gradient nobody else holds looks like
    inside a Python ``backward`` of this PyTorch version."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        _Probe.seen.append((g._use_count(), torch._C._storage_Use_Count(g.untyped_storage()._cdata)))
        return None


_EXCLUSIVE: list = []  # [(tensor refs, storage refs)] of an exclusive, non-view gradient; [] = unknown
_EXCLUSIVE_LOCK = threading.Lock()  # the calibration runs once, also with ranks as threads


def _exclusive_counts() -> Optional[tuple]:
    if not _EXCLUSIVE:
        with _EXCLUSIVE_LOCK:
            if not _EXCLUSIVE:
                _Probe.seen.clear()
                x = torch.zeros(2, requires_grad=True)
                with torch.enable_grad():
                    (_Probe.apply(x) * torch.ones(2)).sum().backward()  # the product's gradient: a fresh tensor
                _EXCLUSIVE.append(_Probe.seen[0] if len(_Probe.seen) == 1 else None)
    return _EXCLUSIVE[0]


def _free_if_exclusive(g: torch.Tensor) -> None:
    """Free the storage of a gradient handed to ``_Unshard.backward`` once it has been copied into
    the reduction buffer, when nothing else can read it: no other reference to the tensor and no
    other tensor on its storage (a view's base counts only if the view is all that holds it).
    Autograd keeps a node's incoming gradients alive until its ``backward`` returns, so without
    this the group's full gradients, its reduction buffer and gloo's staging copy of it are alive
    together (PyTorch's FSDP2 frees its gradients before the reduce_scatter).  A gradient shared
    with another node (``y = x + b``: the same tensor flows to both) is left alone."""
    base_counts = _exclusive_counts()
    if base_counts is None or g.device.type == "meta":
        return
    uses, storage_uses = base_counts  # storage_uses includes the probe's temporary storage object
    if g._use_count() != uses:
        return
    base = g._base
    if base is None:
        ok = torch._C._storage_Use_Count(g.untyped_storage()._cdata) == storage_uses
    else:  # held by the view (1) and by ``base`` here (1); its storage by g, base and the temporary
        ok = base._base is None and base._use_count() == 2 and \
            torch._C._storage_Use_Count(g.untyped_storage()._cdata) == storage_uses + 1
    del base
    if ok:
        g.untyped_storage().resize_(0)


@dataclass
class _ParamInfo:
    """Where one parameter lives in the group's buffers (metadata shared by all ranks)."""

    fqn: str  # name relative to the fully_shard module, for error messages
    owners: list  # [(submodule, attribute name)]: where it is registered (several if tied)
    shape: tuple
    row_numel: int  # elements of one row along the shard dim (the product of the other dims)
    padded: int  # elements of one rank's padded piece (c_i * row_numel)
    shard_offset: int  # offset of its piece in the flat shard
    local_rows: int  # rows (indices along the shard dim) this rank holds (torch.chunk layout)
    full_offset: int  # offset in the flat unsharded buffer
    numel: int
    requires_grad: bool
    #: FSDP x TP: the parameter's tensor-parallel layout ``(tp mesh, placements, global shape)``;
    #: ``shape`` above is then its TP-local shape (what FSDP shards, gathers and reduces), and the
    #: full parameter handed to the module is a DTensor with this layout.  None for plain ones.
    tp: Optional[tuple] = None
    #: the sharded parameter's spec (global shape, the FSDP placements, with TP's on a 2-D mesh)
    spec: Optional[DTensorSpec] = None
    #: data x spatial: the parameter is replicated over a mesh INSIDE the FSDP mesh; its gradient
    #: stays a Partial over that mesh until FSDP's one reduce_scatter over all the ranks
    tp_inside: bool = False
    #: dp_mesh_dims: ``(full mesh, placements, global shape, DP dims)`` of the DTensor the module gets
    spmd: Optional[tuple] = None
    #: the tensor dim FSDP shards (``shard_placement_fn``'s ``Shard(dim)``; 0 by default).  A
    #: rank's piece is stored in its natural (contiguous) layout ``shape[:dim] + (rows,) +
    #: shape[dim + 1:]``, padded at its end, so the sharded parameter is a contiguous view
    dim: int = 0


class ParamGroup:
    """The parameters of one ``fully_shard`` call.  States: sharded -> (gathering) -> unsharded."""

    def __init__(self, module: nn.Module, params: list, mesh, device: torch.device, mp_policy,
                 offload_policy, reshard_after_forward: bool, spmd_layouts: Optional[dict] = None,
                 ddp: bool = False, shard_dims: Optional[dict] = None):
        self.spmd_layouts = spmd_layouts or {}
        #: fqn -> the tensor dim ``shard_placement_fn`` chose (absent: 0)
        self.shard_dims = shard_dims or {}
        #: dp_mesh_dims with replicate dims only (PyTorch's DDP mode of fully_shard): ``mesh`` is the
        #: replicate dim, nothing is sharded (W = 1: the "flat shard" is the whole group, "gathering"
        #: is a copy), and the gradients are all-reduced over ``mesh``: ONE all_reduce per group
        self.ddp = ddp
        self.module = module
        self.mesh = mesh
        self.device = device
        self.hsdp = mesh.ndim == 2
        self.shard_dim = mesh.ndim - 1  # HSDP: (replicate, shard)
        self.W = 1 if ddp else mesh.size(self.shard_dim)
        self.dp_size = mesh.size()  # gradients are averaged over every data-parallel rank
        self.rank = 0 if ddp else C.mesh_dim_rank(mesh, self.shard_dim)
        self.placements = (Replicate(),) if ddp else (Replicate(), Shard(0)) if self.hsdp else (Shard(0),)
        self.mp = mp_policy
        from torch.distributed.fsdp import CPUOffloadPolicy

        self.offload = isinstance(offload_policy, CPUOffloadPolicy)
        # where the sharded parameters (and the optimizer state) live.  A model built on the meta
        # device keeps its shards there (metadata only) until ``to_empty`` (see rebuild)
        on_meta = bool(params) and params[0][1].device.type == "meta"
        self.shard_device = torch.device("meta") if on_meta else torch.device("cpu") if self.offload else device
        self.reshard_after_forward = reshard_after_forward
        #: an int ``reshard_after_forward=k``: the mesh ``(-1, k)`` of the same ranks whose dim 1
        #: is the group of k the parameters are resharded to after forward (set by fully_shard)
        self.post_forward_mesh = None
        self._post: Optional[torch.Tensor] = None  # this rank's slab kept from forward to backward
        self._post_next: Optional[torch.Tensor] = None  # the slab cut from a forward's all_gather
        self._forward_gather = False  # the all_gather in flight was issued by a forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.infos: list[_ParamInfo] = []
        self.sharded_params: list[nn.Parameter] = []
        self.orig_dtype = params[0][1].dtype if params else torch.float32
        self.param_dtype = mp_policy.param_dtype or self.orig_dtype
        self.reduce_dtype = mp_policy.reduce_dtype or self.param_dtype
        self.state = "sharded"
        self._gather_work = None  # (work, gathered buffer) while an all_gather is in flight
        self._acc: Optional[torch.Tensor] = None  # gradients accumulated without sync (gathered layout)
        # ---- what FSDPModule's setters change (PyTorch 2.13's semantics; see _api.FSDPModule)
        #: HSDP (and DDP): all-reduce across the replicas; False keeps the reduce_scatter output in
        #: ``_partial_out`` and adds it to the next reduction that does all-reduce
        self.requires_all_reduce = True
        self._partial_out: Optional[list] = None  # [reduced flat shard, got flags]
        self.gradient_divide_factor: Optional[float] = None  # None: the data-parallel size
        self.force_sum_reduction = False  # divide outside the collectives (see _divide_plan)
        #: the gradients came as DTensors of one global loss (see _global_loss_grads): summed, not averaged
        self.global_loss = False
        #: indices of TP parameters whose gradient of this backward is this rank's TERM of a sum
        #: over FSDP's ranks (``_state._outer_terms``), not the value every rank holds
        self._grad_terms: set = set()
        self.all_reduce_hook = None  # (hook, stream): called on the reduced flat gradient shard
        self.reduce_unused = False  # set a (zero-based) .grad for parameters no rank's backward reached
        self.unshard_in_backward = True
        self.all_gather_comm = None  # a user's AllGather / ReduceScatter object (or the PG allocator's)
        self.reduce_scatter_comm = None
        self.rs_mesh = None  # (mesh, dim): a process group of the reduce_scatter's own
        self.max_rs_buffers = 1  # reduce_scatter inputs that may be held in flight at once
        #: gradients accumulated in ``_acc`` for a later call's backward (see reduce_grads' defer)
        self._deferred = False
        self._init_buffers(params)

    # ---- construction -------------------------------------------------------------------
    def _init_buffers(self, params: list) -> None:
        shard_off = full_off = 0
        for fqn, p, owners in params:
            # FSDP x TP: FSDP shards the TP-local tensor (each rank's TP shard, cut along dim 0)
            shape = tuple(p._local_tensor.shape) if isinstance(p, DTensor) else tuple(p.shape)
            d = self.shard_dims.get(fqn, 0)
            rows = shape[d]
            row_numel = math.prod(shape[:d]) * math.prod(shape[d + 1:])
            c = -(-rows // self.W)
            _, local_rows = chunk_range(rows, self.W, self.rank)
            numel = math.prod(shape)
            tp = spec = None
            inside = False
            if isinstance(p, DTensor):
                tp = (p._spec.mesh, p._spec.placements, tuple(p.shape))
                inside = tp_mesh_inside(p._spec.mesh, self.mesh)
            if isinstance(p, DTensor) and not inside:
                spec = _fsdp_tp_spec(self.mesh, p._spec, ddp=self.ddp)
            else:  # replicated over the FSDP mesh's inner ranks: FSDP's own layout of the whole tensor
                spec = DTensorSpec(self.mesh, self._param_placements(d), shape, contiguous_strides(shape), p.dtype)
            if inside:
                # the spatial ranks hold partial terms of ONE batch's gradient: average over the
                # data-parallel replicas only
                self.dp_size = self.mesh.size() // p._spec.mesh.size()
            spmd = self.spmd_layouts.get(fqn)
            if spmd is not None and tp is None and self.mesh.mesh_dim_names[-1] in spmd[0].mesh_dim_names:
                # no other mesh dim: FSDP's layout on the full mesh (flattened shard dims keep the
                # flattened mesh's Shard(0), as PyTorch's FSDP2 does)
                spec = DTensorSpec(spmd[0], self._spmd_placements(spmd), shape, contiguous_strides(shape), p.dtype)
            self.infos.append(_ParamInfo(fqn, owners, shape, row_numel, c * row_numel, shard_off, local_rows,
                                         full_off, numel, p.requires_grad, tp, spec, inside, spmd, d))
            shard_off += c * row_numel
            full_off += numel
        self.S = shard_off
        self.full_numel = full_off
        # the flat shard: zeros in the padding, so the gathered padding is deterministic
        self.flat_shard = torch.zeros(self.S, dtype=self.orig_dtype, device=self.shard_device)
        for info, (fqn, p, owners) in zip(self.infos, params):
            start, _ = chunk_range(info.shape[info.dim], self.W, self.rank)
            with torch.no_grad():
                local = self._shard_view(self.flat_shard, info)
                src = p._local_tensor if isinstance(p, DTensor) else p.detach()
                local.copy_(src.narrow(info.dim, start, info.local_rows))
            sharded = nn.Parameter(DTensor(local, info.spec, requires_grad=False), requires_grad=p.requires_grad)
            sharded._dtshard_fsdp_sharded = True  # a later fully_shard on a submodule must not take it
            self.sharded_params.append(sharded)
            for owner, name in owners:
                owner._parameters[name] = sharded
        # the flat unsharded buffer: its storage is allocated while unsharded and resized to 0
        # when resharded, so the full-parameter views (and the tensors autograd saved from them)
        # stay the same objects across reshard / unshard
        self.flat_full = torch.empty(self.full_numel, dtype=self.param_dtype, device=self.device)
        self._free(self.flat_full)

    def rebuild(self) -> None:
        """After ``nn.Module._apply`` (``to_empty``, ``.to(dtype / device)``, ``.half()`` ...)
        swapped the sharded parameters for converted ones: lay the group out again in their
        dtype and on their device, as PyTorch's ``reset_sharded_param`` does.  The new local
        shards are copied into a new flat shard (zero padding) and the parameters become views
        of it again; the full-parameter buffer is made in the new param dtype.  Gradients held
        for accumulation are converted.  Every rank converts the same way: no collective."""
        if not self.sharded_params:
            return
        self.reshard()
        self.drop_post()
        local0 = self.sharded_params[0]._local_tensor
        dtypes = {p.dtype for p in self.sharded_params}
        devices = {p._local_tensor.device for p in self.sharded_params}
        if len(dtypes) > 1 or len(devices) > 1:
            raise NotImplementedError(
                f"dtshard.fsdp: a conversion left the parameters of one fully_shard group in several dtypes / "
                f"devices ({sorted(map(str, dtypes))}, {sorted(map(str, devices))}); convert the whole group alike")
        self.orig_dtype = local0.dtype
        self.shard_device = local0.device
        if local0.device.type != "meta" and not self.offload:
            self.device = local0.device
        self.param_dtype = self.mp.param_dtype or self.orig_dtype
        self.reduce_dtype = self.mp.reduce_dtype or self.param_dtype
        flat = torch.zeros(self.S, dtype=self.orig_dtype, device=self.shard_device)
        with torch.no_grad():
            for p, info in zip(self.sharded_params, self.infos):
                view = self._shard_view(flat, info)
                view.copy_(p._local_tensor)
                p._local_tensor = view
                info.spec = p._spec
        self.flat_shard = flat
        self.flat_full = torch.empty(self.full_numel, dtype=self.param_dtype, device=self.device)
        self._free(self.flat_full)
        if self._acc is not None:
            self._acc = self._acc.to(dtype=self.reduce_dtype, device=self.device)
        if self._partial_out is not None:
            self._partial_out[0] = self._partial_out[0].to(dtype=self.reduce_dtype, device=self.device)

    def adopt_reassigned(self) -> None:
        """Lazy init: pick up parameters the user assigned after ``fully_shard`` and before the
        first forward (``module.weight_norm = nn.Parameter(...)`` after a meta-device init, as
        PyTorch's FSDP2 does in its lazy init).  The new value is either a dtshard DTensor laid out
        like the sharded parameter it replaces (e.g. computed from other sharded parameters), or
        a plain tensor of the parameter's full shape, the same on every rank, of which this rank
        keeps its shard.  The group is then laid out again (:meth:`rebuild`: no collective)."""
        changed = False
        for i, info in enumerate(self.infos):
            old = self.sharded_params[i]
            owner, name = info.owners[0]
            new = owner._parameters.get(name, old)
            if new is old or new is None:
                continue
            where = f"fully_shard({type(self.module).__name__}): parameter {info.fqn!r} (registered as " \
                f"{type(owner).__name__}.{name})"
            if info.tp is not None or info.spmd is not None:
                raise NotImplementedError(f"{where} was re-assigned after fully_shard; with tensor parallelism or "
                                          "dp_mesh_dims assign before fully_shard, or copy into the parameter in place")
            if isinstance(new, DTensor):
                if mesh_identity(new._spec.mesh) != mesh_identity(old._spec.mesh) or \
                        new._spec.placements != old._spec.placements or tuple(new.shape) != tuple(old.shape):
                    raise ValueError(
                        f"{where} was re-assigned after fully_shard with a DTensor of shape {tuple(new.shape)}, "
                        f"placements {new._spec.placements} on mesh {tuple(new._spec.mesh.shape)}; FSDP expects "
                        f"shape {tuple(old.shape)}, placements {old._spec.placements} on its mesh "
                        f"{tuple(old._spec.mesh.shape)}: assign a tensor of the full shape, or a DTensor in that layout")
                local = new._local_tensor.detach()
            elif isinstance(new, torch.Tensor):
                if tuple(new.shape) != tuple(old.shape):
                    raise ValueError(f"{where} was re-assigned after fully_shard with a tensor of shape "
                                     f"{tuple(new.shape)}; FSDP expects its full shape {tuple(old.shape)}")
                start, _ = chunk_range(info.shape[info.dim], self.W, self.rank)
                local = new.detach().narrow(info.dim, start, info.local_rows)
            else:
                continue
            if local.dtype != old.dtype:
                raise ValueError(f"{where} was re-assigned after fully_shard with dtype {local.dtype}; the group's "
                                 f"parameters are {old.dtype}: convert the tensor first")
            param = nn.Parameter(DTensor(local.clone(), old._spec, requires_grad=False),
                                 requires_grad=new.requires_grad)
            param._dtshard_fsdp_sharded = True
            for o, n in info.owners:
                o._parameters[n] = param
            self.sharded_params[i] = param
            info.requires_grad = param.requires_grad
            changed = True
        if changed:
            self.rebuild()

    def _spmd_placements(self, spmd) -> tuple:
        """dp_mesh_dims without another mesh dim: the full mesh's placements of a sharded
        parameter (``Shard(0)`` on the shard dim, ``Replicate`` on the replicate dim)."""
        full = spmd[0]
        dp_names = self.mesh.mesh_dim_names
        return tuple(Shard(0) if n == dp_names[-1] and not self.ddp else Replicate() for n in full.mesh_dim_names)

    def _param_placements(self, dim: int) -> tuple:
        """FSDP's placements of a parameter sharded on tensor dim ``dim`` (the group's, with
        ``Shard(dim)`` for ``Shard(0)``)."""
        if dim == 0:
            return self.placements
        return tuple(Shard(dim) if isinstance(q, Shard) else q for q in self.placements)

    @staticmethod
    def _shard_view(flat: torch.Tensor, info: _ParamInfo) -> torch.Tensor:
        n = info.local_rows * info.row_numel
        d = info.dim
        return flat[info.shard_offset:info.shard_offset + n].view(info.shape[:d] + (info.local_rows,) + info.shape[d + 1:])

    @staticmethod
    def _free(t: torch.Tensor) -> None:
        t.untyped_storage().resize_(0)

    def _alloc_full(self) -> None:
        nbytes = self.full_numel * self.flat_full.element_size()
        if self.flat_full.untyped_storage().size() != nbytes:
            self.flat_full.untyped_storage().resize_(nbytes)

    # ---- unshard / reshard ----------------------------------------------------------------
    def _gather_input(self) -> torch.Tensor:
        """This rank's flat shard in the param dtype on the compute device.  The sharded
        parameters are views of ``flat_shard`` unless something replaced a local tensor (then
        every piece is copied in, which also casts for mixed precision)."""
        direct = self.param_dtype == self.orig_dtype and self.shard_device == self.device
        if direct and all(self._is_view_of_flat(p, info) for p, info in zip(self.sharded_params, self.infos)):
            return self.flat_shard
        inp = torch.zeros(self.S, dtype=self.param_dtype, device=self.device)
        for p, info in zip(self.sharded_params, self.infos):
            self._shard_view(inp, info).copy_(p._local_tensor)  # the cast is fused into the copy-in
        return inp

    def _is_view_of_flat(self, p, info) -> bool:
        local = p._local_tensor
        return (local.untyped_storage().data_ptr() == self.flat_shard.untyped_storage().data_ptr()
                and local.storage_offset() == self.flat_shard.storage_offset() + info.shard_offset
                and local.is_contiguous() and local.dtype == self.orig_dtype)

    def unshard(self, async_op: bool = False) -> None:
        """Start (``async_op``) or do the group's ONE all_gather; no-op when not sharded."""
        if self.state == "gathering" and not async_op:
            return self.wait_unshard()  # prefetched: finish it
        if self.state != "sharded" or not self.infos:
            return
        in_backward = torch._C._current_graph_task_id() != -1
        self._forward_gather = not in_backward and torch.is_grad_enabled()
        with torch.no_grad():
            out = C.comm_allocate(self.all_gather_comm, self.W * self.S, self.param_dtype, self.device)
            if self._post is not None and in_backward:
                # resharded to k ranks after forward: gather the k slabs (the whole (W, S)
                # layout, in order) over those k ranks only
                inp, self._post = self._post, None
                with _fsdp_op():
                    work = C.all_gather_into(out, inp, self.post_forward_mesh, 1, async_op=True)
            elif self.ddp or self.W == 1:  # nothing sharded (DDP, or one shard rank): no collective,
                # the group's "gathered" layout is its flat shard (PyTorch's FSDP2 skips it too)
                self._post = None
                inp = self._gather_input()
                out.copy_(inp)
                work = None
            else:
                self._post = None  # a forward gathers from the shards (the optimizer moved them)
                inp = self._gather_input()
                with _fsdp_op():
                    work = C.all_gather_into(out, inp, self.mesh, self.shard_dim, async_op=True,
                                             comm=self.all_gather_comm)
        self._gather_work = (work, out, inp)
        self.state = "gathering"
        if not async_op:
            self.wait_unshard()

    def wait_unshard(self) -> None:
        """Finish an all_gather in flight: copy each parameter out into the flat unsharded buffer."""
        if self.state != "gathering":
            return
        work, out, inp = self._gather_work
        self._gather_work = None
        if work is not None:
            work.wait()
        if inp is not self.flat_shard:
            self._free(inp)  # a copy-in buffer
        self._alloc_full()
        gathered = out.view(self.W, self.S)
        # the copy-out writes the storage autograd saved views of; the data is the same parameter
        # value, so keep the version counter (as PyTorch's FSDP2 does)
        with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(self.flat_full):
            for info in self.infos:
                full = self.flat_full[info.full_offset:info.full_offset + info.numel]
                for dst, src in self._rank_pieces(full, gathered, info):
                    dst.copy_(src)
        if self.post_forward_mesh is not None and self._forward_gather:
            # reshard_after_forward=k: keep this rank's 1/k of the gathered layout (the rows of
            # W/k ranks' shards) for backward: member j of a group of k holds rows j*W/k ...
            k = self.post_forward_mesh.size(1)
            rows = self.W // k
            j = self.rank % k
            self._post_next = gathered[j * rows:(j + 1) * rows].reshape(-1).clone()
        # free the gathered buffer now, on this thread: the backend's work object may hold a
        # reference a little longer (and drop it on its own thread).  A user comm's buffer is
        # its own (it may reuse it): only dropped
        if self.all_gather_comm is None:
            self._free(out)
        self._versions = self._sharded_versions()
        self.state = "unsharded"

    def _sharded_versions(self) -> list:
        return [p._version for p in self.sharded_params]

    def is_stale(self) -> bool:
        """True when a sharded parameter changed in place (an optimizer step, load_state_dict)
        since the full parameters were gathered: they must be gathered again."""
        return self.state == "unsharded" and self._versions != self._sharded_versions()

    def _rank_pieces(self, full: torch.Tensor, gathered: torch.Tensor, info: _ParamInfo):
        """Pairs (piece of the flat full parameter, the same elements in the (W, S) gathered
        layout) covering the parameter in at most two strided views, no temporary: the ranks
        holding a whole chunk of ``c`` rows, then the one short chunk (empty ones hold nothing).
        ``Shard(dim)`` with ``dim > 0``: the full parameter read as ``(pre, R, post)`` (the dims
        before, along and after the shard dim), rank r's piece as ``(pre, rows_r, post)``."""
        if info.dim:
            return self._rank_pieces_dim(full, gathered, info)
        chunk = info.padded  # c rows
        whole = info.numel // chunk if chunk else 0
        pieces = []
        if whole:
            pieces.append((full[:whole * chunk].view(whole, chunk),
                           gathered[:whole, info.shard_offset:info.shard_offset + chunk]))
        rest = info.numel - whole * chunk
        if rest:
            pieces.append((full[whole * chunk:], gathered[whole, info.shard_offset:info.shard_offset + rest]))
        return pieces

    @staticmethod
    def _rank_pieces_dim(full: torch.Tensor, gathered: torch.Tensor, info: _ParamInfo):
        d = info.dim
        pre, R, post = math.prod(info.shape[:d]), info.shape[d], math.prod(info.shape[d + 1:])
        c = info.padded // info.row_numel if info.row_numel else 0
        whole = R // c if c else 0
        rest = R - whole * c
        f = full.view(pre, R, post)
        off = info.shard_offset
        pieces = []
        if whole:  # (whole ranks, pre, c, post) on both sides
            pieces.append((f[:, :whole * c].view(pre, whole, c, post).permute(1, 0, 2, 3),
                           gathered[:whole, off:off + pre * c * post].view(whole, pre, c, post)))
        if rest:
            pieces.append((f[:, whole * c:], gathered[whole, off:off + pre * rest * post].view(pre, rest, post)))
        return pieces

    def reshard(self, after_forward: bool = False) -> None:
        """Free the full parameters.  ``after_forward`` with an int ``reshard_after_forward``:
        keep the slab cut from the forward's all_gather, which backward gathers over k ranks."""
        if self.state == "gathering":
            self.wait_unshard()
        if self.state == "unsharded":
            self._free(self.flat_full)
            self.state = "sharded"
        self._post = self._post_next if after_forward else None
        self._post_next = None

    def drop_post(self) -> None:
        self._post = self._post_next = None

    def reset(self) -> None:
        """``reset_iter_state``: finish an all_gather in flight, free the full parameters and drop
        the gradients held for accumulation (a failed iteration's are lost, as in PyTorch)."""
        self.reshard()
        self.drop_post()
        self._acc = None
        self._acc_got = [False] * len(self.infos)
        self._deferred = False
        self._partial_out = None

    def full_views(self) -> list[torch.Tensor]:
        """Fresh views of the full parameters (one set per forward call: autograd attaches each
        forward's history to its own tensors); TP-local ones for FSDP x TP parameters."""
        return [self.flat_full[i.full_offset:i.full_offset + i.numel].view(i.shape) for i in self.infos]

    # ---- the compiled path (torch.compile: SimpleFSDP's design) ---------------------------
    def traced_full_params(self, recompute: bool) -> list[torch.Tensor]:
        """The full parameters as a traceable, differentiable function of the sharded ones: what
        the forward pre-hook uses under ``torch.compile``, where the eager buffers, work handles
        and autograd hooks cannot be traced.  The group is still ONE all_gather in forward and
        ONE reduce_scatter in backward:

            each rank's shards -> padded, concatenated: the flat shard (S elements, cast to the
            param dtype) -> as a Shard(0) DTensor of W*S elements, redistributed to Replicate
            (the all_gather) -> to_local with a Partial gradient, so backward is the
            redistribute Partial -> Shard(0): the reduce_scatter (HSDP: and the all_reduce over
            the replicate dim) in the reduce dtype -> each parameter cut out of the (W, S) layout.

        Autograd of these ops IS the gradient path: the sharded parameters receive their
        reduced shards (``Shard(0)`` DTensors) as ``.grad`` with no hook.  With ``recompute``
        (``reshard_after_forward``) the region runs under activation checkpointing, so the
        compiled graph frees the full parameters after forward and all-gathers them again in
        backward instead of saving them."""
        if not self.infos:
            return []
        if recompute and torch.is_grad_enabled():
            from torch.utils.checkpoint import checkpoint

            return list(checkpoint(self._traced_gather, *self.sharded_params, use_reentrant=False))
        return list(self._traced_gather(*self.sharded_params))

    def _traced_gather(self, *sharded) -> tuple:
        from torch.distributed.tensor.placement_types import Partial

        pieces = []
        for p, info in zip(sharded, self.infos):
            flat = p.to_local().reshape(-1)
            if flat.numel() != info.padded:  # a short or empty chunk: zeros up to the padded size
                flat = torch.nn.functional.pad(flat, (0, info.padded - flat.numel()))
            pieces.append(flat)
        flat = torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        n = self.W * self.S
        spec = DTensorSpec(self.mesh, self.placements, (n,), (1,), flat.dtype)
        dt = DTensor.from_local(flat, self.mesh, self.placements, shape=spec.shape, stride=spec.stride)
        full = dt.redistribute(self.mesh, tuple(Replicate() for _ in self.placements),
                               forward_dtype=self.param_dtype if self.param_dtype != flat.dtype else None,
                               backward_dtype=self.reduce_dtype)
        gathered = _ScaleGrad.apply(full.to_local(grad_placements=tuple(Partial() for _ in self.placements)),
                                    1.0 / float(self.gradient_divide_factor or self.dp_size)).view(self.W, self.S)
        # split (not one slice per parameter): its backward is ONE concatenation into the
        # reduce_scatter input, where slices would each scatter into a zero (W, S) buffer
        blocks = gathered.split([info.padded for info in self.infos], dim=1)
        # a plain parameter used with DTensor activations gets a DTensor gradient (of one global
        # loss): _global_loss_param turns it into this rank's term, rescaled against _ScaleGrad
        divide = float(self.gradient_divide_factor or self.dp_size)
        rescale = divide / float(self.gradient_divide_factor or 1)
        outs = []
        for info, block in zip(self.infos, blocks):
            c = info.padded // info.row_numel if info.row_numel else 0
            d = info.dim
            if d:  # the ranks' (pre, rows_r, post) pieces joined along the shard dim (as _rank_pieces_dim)
                pre, R, post = math.prod(info.shape[:d]), info.shape[d], math.prod(info.shape[d + 1:])
                whole = R // c if c else 0
                rest = R - whole * c
                parts = []
                if whole:
                    parts.append(block[:whole].reshape(whole, pre, c, post).permute(1, 0, 2, 3).reshape(pre, whole * c, post))
                if rest:  # the short piece is (pre, rest, post), padded at its end
                    parts.append(block[whole, :pre * rest * post].reshape(pre, rest, post))
                full = (torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).reshape(info.shape)
            else:
                full = block.reshape((self.W * c,) + info.shape[1:])[:info.shape[0]]
            if info.tp is None and torch.is_grad_enabled():
                full = _global_loss_param(full, self.mesh, rescale, type(self.module).__name__,
                                          self.has_tp and self.gradient_divide_factor is not None)
            outs.append(full)
        return tuple(outs)

    def _divide_plan(self) -> tuple:
        """``(pre, mid, post)``: the gradient sum is divided by ``pre`` before the reduce_scatter,
        by ``mid`` after the reductions and before the all-reduce hook, by ``post`` after the
        hook (None: not at that point).  The factor is ``set_gradient_divide_factor``'s, else the
        data-parallel size.  PyTorch's FSDP2 rules, so a hook sees the same values: in float32
        and bfloat16 PyTorch divides inside the collective (AVG / PREMUL_SUM), so the hook sees
        the average, unless ``set_force_sum_reduction_for_comms``; other dtypes (float16,
        float64) divide by a power of two about sqrt(factor) before and the rest after, so the
        sum can neither overflow nor underflow.  dtshard's collectives always sum."""
        factor = float(self.gradient_divide_factor or (1 if self.global_loss else self.dp_size))
        if self.reduce_dtype in (torch.float32, torch.bfloat16):
            if self.force_sum_reduction:
                return None, None, factor
            # bfloat16 divides first (exact for a power-of-two factor; the sum cannot overflow)
            return (factor, None, None) if self.reduce_dtype == torch.bfloat16 else (None, factor, None)
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return float(pre), None, factor / pre

    @property
    def has_tp(self) -> bool:
        return any(i.tp is not None for i in self.infos)

    # ---- gradients ------------------------------------------------------------------------
    def flush_deferred(self) -> Optional[tuple]:
        """End of backward: reduce gradients held by :meth:`reduce_grads` ``(defer=True)`` for a
        later call's node that never ran (the same decision on every rank: same program)."""
        if not self._deferred:
            return None
        return self.reduce_grads([None] * len(self.infos))

    def reduce_grads(self, grads, defer: bool = False) -> Optional[tuple]:
        """Post-backward: put the full gradients (None where a parameter got none) into the
        gathered layout in the reduce dtype; without gradient sync accumulate them there, else
        start the ONE reduce_scatter.  ``defer``: another call of the module has its backward
        still to come: accumulate, that one reduces the sum.  Returns what :meth:`finish_reduce`
        needs, or None."""
        got = [g is not None for g in grads]
        deferred, self._deferred = self._deferred, False
        if not any(got) and not deferred:
            return None
        if self._grad_terms or any(type(g) is DTensor for g in grads):
            grads = self._global_loss_grads(grads)
        with torch.no_grad():
            if self._acc is not None:
                buf = self._acc
            else:
                buf = C.comm_allocate(self.reduce_scatter_comm, self.W * self.S, self.reduce_dtype, self.device).zero_()
            for g, info in zip(grads, self.infos):
                if g is not None:
                    self._add_in(buf, g, info)  # (no view of g outlives the call)
                    _free_if_exclusive(g)
            had = getattr(self, "_acc_got", [False] * len(self.infos))
            got = [a or b for a, b in zip(got, had)]
            if not self.requires_gradient_sync or defer:
                self._acc, self._acc_got = buf, got
                self._deferred = defer and self.requires_gradient_sync
                return None
            self._acc = None
            self._acc_got = [False] * len(self.infos)
            pre = self._divide_plan()[0]
            if pre is not None:
                buf.div_(pre)
            if self.W == 1 and not self.ddp and not (self.hsdp and self.mesh.size(0) > 1):
                return [None, buf, None, got]  # one rank: the gradient sum is this rank's (no collective)
            if self.ddp or self.W == 1:  # ONE all_reduce of the group's gradients, in place (finish_reduce waits)
                # (DDP; or HSDP with one rank per shard group: only the replicas reduce)
                if not self.requires_all_reduce:
                    self._keep_partial(buf, got)
                    return None
                buf, got = self._add_partial(buf, got)
                with _fsdp_op():
                    work = C.all_reduce_(buf, "sum", self.mesh, 0, async_op=True)
                return [work, buf, None, got]
            out = C.comm_allocate(self.reduce_scatter_comm, self.S, self.reduce_dtype, self.device)
            mesh, dim = self.rs_mesh or (self.mesh, self.shard_dim)
            with _fsdp_op():
                # the buffer is not read after the call (gloo stages it): released right away,
                # so the reduction in flight behind the next block's backward holds one copy
                work = C.reduce_scatter_into(out, buf, "sum", mesh, dim, async_op=True, consume_input=True,
                                             comm=self.reduce_scatter_comm)
        return [work, out, buf, got]

    def _global_loss_grads(self, grads) -> list:
        """Gradients that arrive as DTensors at the plain full parameters: the module computed on
        DTensor activations (a sequence-sharded model, ``implicit_replication()`` promoting the
        full parameters to ``Replicate``), so each gradient is the gradient of ONE global loss,
        already summed over the whole batch, not one rank's share of a mean.  Each becomes this
        rank's additive term (``Partial`` over the mesh dims whose ranks are FSDP's, ``Replicate``
        over the others, which FSDP does not reduce over), the terms of all FSDP ranks summing to
        the gradient; the group then sums without dividing (``gradient_divide_factor`` still
        applies when set).  The layouts come from metadata every rank shares."""
        plain = [i for i, g in enumerate(grads) if g is not None and type(g) is not DTensor]
        terms, self._grad_terms = self._grad_terms, set()
        if plain and all(self.infos[i].tp is not None for i in plain):
            # tensor-parallel parameters: those _state._outer_terms saw hold this rank's term of
            # the sum over FSDP's ranks; for the others, DTensor.from_local (see _state._tp_param)
            # brought the activations' larger mesh down to the TP mesh, reducing the other dims,
            # so each holds the FULL TP-local gradient on every FSDP rank: the first FSDP rank's
            # copy is the term (Replicate -> Partial, exact), the others add zeros
            first = not any(C.mesh_coordinate(self.mesh))
            grads = [(g if first or i in terms else torch.zeros_like(g)) if i in plain else g
                     for i, g in enumerate(grads)]
            plain = []
        if plain:
            raise RuntimeError(
                f"fully_shard({type(self.module).__name__}): some of the group's parameters got DTensor gradients "
                "(computed with DTensor activations) and others plain ones; FSDP cannot tell whether to average "
                "the plain ones over the data-parallel ranks. Feed the module DTensor inputs throughout (e.g. "
                "distribute_tensor(input_ids, mesh, [Shard(0), Shard(1)])), or plain tensors throughout.")
        out = []
        for g in grads:
            if g is None or type(g) is not DTensor:
                out.append(g)
                continue
            with torch.no_grad():
                out.append(global_loss_term(g, self.mesh, type(self.module).__name__))
        self.global_loss = True
        return out

    def mark_grad_term(self, index: int) -> None:
        """This backward's gradient of parameter ``index`` is this rank's term of a sum over
        FSDP's ranks (``_state._outer_terms``): the group sums the terms, counting each once."""
        self._grad_terms.add(index)

    def outer_dims_are_fsdp(self, mesh, dims) -> bool:
        """Do the ranks of ``mesh`` along ``dims`` through this rank (a gradient's Partial dims
        outside a TP parameter's own mesh) make up exactly FSDP's ranks?  From metadata alone."""
        coord = C.mesh_coordinate(mesh)
        if not dims or coord is None:
            return False
        index = tuple(slice(None) if d in dims else c for d, c in enumerate(coord))
        return set(mesh.mesh[index].flatten().tolist()) == self._fsdp_ranks()

    def _fsdp_ranks(self) -> set:
        return set(self.mesh.mesh.flatten().tolist())

    def _keep_partial(self, out: torch.Tensor, got: list) -> None:
        """``set_requires_all_reduce(False)``: keep this reduction's output (summed over the
        shard group, not yet over the replicas) for the next one that all-reduces."""
        if self._partial_out is None:
            self._partial_out = [out, list(got)]
        else:
            self._partial_out[0].add_(out)
            self._partial_out[1] = [a or b for a, b in zip(self._partial_out[1], got)]

    def _add_partial(self, out: torch.Tensor, got: list) -> tuple:
        if self._partial_out is not None:
            kept, kept_got = self._partial_out
            self._partial_out = None
            out.add_(kept)
            got = [a or b for a, b in zip(got, kept_got)]
        return out, got

    def _add_in(self, buf: torch.Tensor, g: torch.Tensor, info: _ParamInfo) -> None:
        for src, dst in self._rank_pieces(g.reshape(-1), buf.view(self.W, self.S), info):
            dst.add_(src)  # casts to the reduce dtype

    def start_replicate_reduce(self, pending: list) -> None:
        """HSDP: once the reduce_scatter is done, start the all_reduce across the replicate dim."""
        work, out = pending[0], pending[1]
        work.wait()
        if self.reduce_scatter_comm is None:
            self._free(pending[2])  # the reduce_scatter input (see wait_unshard)
        if self.hsdp and not self.requires_all_reduce:
            self._keep_partial(out, pending[3])
            pending[0] = pending[1] = None  # nothing for finish_reduce to set
        elif self.hsdp:
            pending[1], pending[3] = self._add_partial(out, pending[3])
            with _fsdp_op():
                pending[0] = C.all_reduce_(out, "sum", self.mesh, 0, async_op=True)
        else:
            pending[0] = None
        pending[2] = None  # the reduce_scatter input can go

    def finish_reduce(self, pending: list) -> None:
        """Wait for the group's reduction and add this rank's gradient shards to the sharded
        parameters' ``.grad`` (DTensors with the parameters' placements, in their dtype)."""
        work, out, _, got = pending
        if work is not None:
            work.wait()
        if out is None:  # HSDP without all-reduce: kept for a later reduction
            return
        if self.reduce_unused:  # every rank sets the same .grad (zeros where no rank had one)
            got = [True] * len(got)
        _, mid, post = self._divide_plan()
        with torch.no_grad():
            if mid is not None:
                out.div_(mid)
            if self.all_reduce_hook is not None:
                hook, stream = self.all_reduce_hook
                if stream is not None:
                    with torch.get_device_module(self.device.type).stream(stream):
                        hook(out)
                else:
                    hook(out)
            if post is not None and post != 1:
                out.div_(post)
            for p, info, has in zip(self.sharded_params, self.infos, got):
                if not has or not p.requires_grad:
                    continue
                local = self._shard_view(out, info).to(device=self.shard_device, dtype=self.orig_dtype)
                if p.grad is None:
                    # a DTensor with the parameter's layout, already reduced (Shard, no Partial):
                    # dtshard's settle-grad hook has nothing to do for it
                    p.grad = DTensor(local, p._spec, requires_grad=False)
                else:
                    if p.grad._spec.placements != p._spec.placements:
                        # a gradient autograd accumulated into the sharded parameter itself (it
                        # was used outside the module's forward, e.g. in a regularizer)
                        p.grad = p.grad.redistribute(p._spec.mesh, p._spec.placements)
                    p.grad._local_tensor.add_(local)


def _term_placements(mesh, fsdp_mesh, module_name: str, placements) -> tuple:
    """The placements that make a gradient on ``mesh`` (the activations' mesh) this rank's
    additive term of its sum over FSDP's ranks: ``Partial`` on the mesh dims whose ranks are
    FSDP's, ``Replicate`` on the others (FSDP does not reduce over them).  From the rank tables
    (read outside any tracing mode: the same answer on every rank, also while compiling)."""
    def flat(t) -> set:  # the ranks in a (nested) table, or one rank
        return set().union(*(flat(x) for x in t)) if isinstance(t, list) else {t}

    def ranks_of(index) -> set:  # the ranks of a slice of the mesh's table
        return flat(C.rank_table(mesh, tuple(index)))

    fsdp_ranks = flat(C.rank_table(fsdp_mesh))
    coord = list(C.mesh_coordinate(mesh))
    # span: this rank's coordinate with every Partial mesh dim left free, read as ONE slice of the
    # rank table (never a set of coordinates, which would be a walk over FSDP's ranks)
    target, span = [], list(coord)
    for d in range(mesh.ndim):
        along = ranks_of([slice(None) if k == d else c for k, c in enumerate(coord)])
        if along <= fsdp_ranks:
            target.append(Partial("sum"))
            span[d] = slice(None)
        elif len(along & fsdp_ranks) == 1:
            target.append(Replicate())
        else:
            span = None
            break
    lined_up = span is not None and ranks_of(span) == fsdp_ranks
    if not lined_up:
        raise RuntimeError(
            f"fully_shard({module_name}): a parameter's gradient is a DTensor on mesh "
            f"{tuple(mesh.shape)} {mesh.mesh_dim_names} with placements {placements}, whose ranks do not "
            f"line up with FSDP's mesh {tuple(fsdp_mesh.shape)} {fsdp_mesh.mesh_dim_names}: FSDP must reduce over "
            "whole mesh dims of the activations' mesh (e.g. fully_shard(mesh=mesh['dp', 'cp']._flatten()) "
            "for activations on mesh['dp', 'cp']).")
    return tuple(target)


def global_loss_term(g: DTensor, fsdp_mesh, module_name: str) -> torch.Tensor:
    """A parameter gradient that arrived as a DTensor (the module ran on DTensor activations: the
    gradient of ONE global loss, already summed over the batch) as this rank's additive term of
    its sum over FSDP's ranks (a plain tensor, the parameter's full shape)."""
    mesh = g._spec.mesh
    target = _term_placements(mesh, fsdp_mesh, module_name, g._spec.placements)
    return g.redistribute(mesh, target)._local_tensor


class _GlobalLossGrad(torch.autograd.Function):
    """The compiled path's counterpart of :meth:`ParamGroup._global_loss_grads`, on one full
    parameter: identity in forward; in backward a DTensor gradient (DTensor activations) becomes
    this rank's term (:func:`global_loss_term`) times ``rescale``, which undoes the average the
    traced gather's :class:`_ScaleGrad` applies to per-rank gradients (global-loss gradients are
    summed over FSDP's ranks, divided only by ``set_gradient_divide_factor``'s factor).  A plain
    gradient passes unchanged."""

    @staticmethod
    def forward(ctx, x, fsdp_mesh, rescale: float, module_name: str, tp_divided: bool):
        ctx.fsdp_mesh, ctx.rescale, ctx.module_name, ctx.tp_divided = fsdp_mesh, rescale, module_name, tp_divided
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        if type(g) is DTensor:
            if ctx.tp_divided:
                # the group's tensor-parallel parameters reach the gather as full copies on every
                # FSDP rank (from_local's backward reduced them), which the average turns into
                # the sum only when the divisor is FSDP's size
                raise NotImplementedError(
                    f"fully_shard({ctx.module_name}) compiled on DTensor activations with tensor-parallel "
                    "parameters and set_gradient_divide_factor(): not supported (the factor would scale those "
                    "gradients by the data-parallel size); run this group eagerly or keep the default factor.")
            g = global_loss_term(g, ctx.fsdp_mesh, ctx.module_name)
            if ctx.rescale != 1.0:
                g = g * ctx.rescale
        return g, None, None, None, None


@in_graph
def _global_loss_param(x: torch.Tensor, fsdp_mesh, rescale: float, module_name: str, tp_divided: bool) -> torch.Tensor:
    """:class:`_GlobalLossGrad` as ONE node of a compiled graph (its backward reads the
    gradient's type, which Dynamo's own trace of the backward would fix to a plain tensor)."""
    return _GlobalLossGrad.apply(x, fsdp_mesh, rescale, module_name, tp_divided)


class _ScaleGrad(torch.autograd.Function):
    """Identity in forward; the gradient times ``scale`` (FSDP's average over the data-parallel
    ranks, applied to the full gradient before it is reduce-scattered)."""

    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.scale, None


def tp_mesh_inside(tp_mesh, mesh) -> bool:
    """Do all ranks of this rank's group of ``tp_mesh`` belong to its group of ``mesh`` (and the
    latter is larger)?  From the meshes' rank tables: the same answer on every rank."""
    tp_ranks = set(tp_mesh.mesh.flatten().tolist())
    ranks = set(mesh.mesh.flatten().tolist())
    return tp_ranks <= ranks and len(ranks) > len(tp_ranks) and len(tp_ranks) > 1


def _fsdp_tp_spec(dp_mesh, tp_spec: DTensorSpec, ddp: bool = False) -> DTensorSpec:
    """The sharded spec of a tensor-parallel parameter that FSDP shards again on ``dp_mesh``: a
    DTensor on the mesh of the dp and tp mesh dims (in the root mesh's order), whose shards are
    dim-0 chunks of each rank's TP shard.  ``dp_mesh`` is 1-D (FSDP x TP) or 2-D
    ``(replicate, shard)`` (HSDP x TP: ``Replicate`` on the replicate dim).  On the shard dim
    that is ``Shard(0)``, unless a mesh dim AFTER it in the root's order also shards dim 0 (TP's
    ``Shard(0)``): then TP cuts first and FSDP cuts each TP shard, which is
    ``_StridedShard(0, split_factor=tp)`` (PyTorch's FSDP2 x TP layout; ``fully_shard`` checked
    the meshes, see ``_api._check_tp_param``).  ``ddp`` (dp_mesh_dims without a shard dim):
    nothing is sharded, ``Replicate`` on the data-parallel dim."""
    from torch.distributed.tensor.placement_types import _StridedShard

    tp_mesh = tp_spec.mesh
    (tp_pl,) = tp_spec.placements
    tp_name = tp_mesh.mesh_dim_names[0]
    dp_names = tuple(dp_mesh.mesh_dim_names)
    shard_name = dp_names[-1]
    mesh_n = _joint_mesh(dp_mesh, tp_mesh)
    names = list(mesh_n.mesh_dim_names)
    placements = []
    for n in names:
        if n == tp_name:
            placements.append(tp_pl)
        elif n != shard_name or ddp:
            placements.append(Replicate())
        else:
            tp_after = names.index(tp_name) > names.index(shard_name)
            shards_dim0 = isinstance(tp_pl, Shard) and tp_pl.dim == 0
            placements.append(_StridedShard(0, split_factor=tp_mesh.size()) if tp_after and shards_dim0 else Shard(0))
    return DTensorSpec(mesh_n, tuple(placements), tp_spec.shape, contiguous_strides(tp_spec.shape), tp_spec.dtype)


def _joint_mesh(dp_mesh, tp_mesh):
    """The mesh of ``dp_mesh``'s dims and ``tp_mesh``'s dim, in the order of the mesh they were
    cut from (outer dims first).

    Sliced from the root mesh when the root names them all (``init_device_mesh(..., (dp, tp))``
    then ``mesh["dp"]``, ``mesh["tp"]``).  A mesh made by ``_unflatten`` of a 1-D world mesh (how
    torchtitan builds every mesh) has that world mesh as its root, which names none of them:
    then the dims are joined with ``DeviceMesh._concatenate``, which keeps their process groups
    (no new group, nothing collective), ordered by their rank strides (largest first, the
    row-major order of the mesh they came from)."""
    key = (mesh_identity(dp_mesh), tuple(dp_mesh.mesh_dim_names), mesh_identity(tp_mesh),
           tuple(tp_mesh.mesh_dim_names))
    hit = _JOINT_MESHES.get(key)
    if hit is None:
        hit = _JOINT_MESHES[key] = _build_joint_mesh(dp_mesh, tp_mesh)
    return hit


#: (dp mesh, tp mesh) -> their joint mesh: one mesh object for every parameter of a model (a
#: race between threads builds the same mesh twice and keeps one: nothing is lost)
_JOINT_MESHES: dict = {}


def _build_joint_mesh(dp_mesh, tp_mesh):
    from torch.distributed.device_mesh import DeviceMesh

    root = dp_mesh._get_root_mesh()
    wanted = set(dp_mesh.mesh_dim_names) | {tp_mesh.mesh_dim_names[0]}
    root_names = tuple(root.mesh_dim_names or ())
    if wanted <= set(root_names):
        names = tuple(n for n in root_names if n in wanted)
        return root if names == root_names else root[names]
    dims = [dp_mesh[n] for n in dp_mesh.mesh_dim_names] + [tp_mesh]

    def stride(m):  # ranks one step apart on this 1-D mesh (a size-1 dim: any place is the same)
        ranks = m.mesh.flatten().tolist()
        return ranks[1] - ranks[0] if len(ranks) > 1 else 0

    dims.sort(key=stride, reverse=True)
    try:
        return DeviceMesh._concatenate(dims)
    except Exception as e:  # noqa: BLE001 - say which meshes, and what to do
        raise ValueError(
            f"fully_shard: cannot join the data-parallel mesh {tuple(dp_mesh.shape)} {dp_mesh.mesh_dim_names} "
            f"and the tensor-parallel mesh {tuple(tp_mesh.shape)} {tp_mesh.mesh_dim_names} into one mesh "
            f"({e}); cut both from one mesh, e.g. mesh = init_device_mesh(device, (dp, tp), "
            "mesh_dim_names=('dp', 'tp')) or world._unflatten(0, (dp, tp), ('dp', 'tp'))") from e
