"""Per-module FSDP state: the hooks that drive a group through forward and backward, and the
per-model context the root shares with every group under it.

One training step with blocks ``b1..bN`` under a root ``r`` (``reshard_after_forward=None``):

    forward   r.pre: gather r (sync);  b1.pre: gather b1, prefetch b2;  b1 runs;  b1.post: free b1 ...
    backward  bN.pre-backward: gather bN, prefetch bN-1; ... bN's grads done -> reduce_scatter bN
              (async) ... r's grads done -> reduce_scatter r;  end of backward (engine callback):
              wait every reduction, set the sharded .grad, free what is still unsharded.

The full parameters are handed to the module by :class:`_Unshard`, an autograd Function whose
inputs are the sharded parameters and whose outputs are views of the flat unsharded buffer.
The engine runs its backward once, after every gradient of those outputs is complete, which is
exactly when the group's gradients can be reduced (the post-backward hook).  It returns no
gradient for the sharded parameters: their ``.grad`` is set from the reduce_scatter instead.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.utils._pytree import tree_flatten, tree_map

from torch.distributed.tensor.placement_types import Partial, Replicate

from dtshard import collectives as C

from dtshard.fsdp._group import ParamGroup
from dtshard.hooks import in_graph
from dtshard.spec import DTensorSpec, contiguous_strides
from dtshard.tensor import DTensor, _promote_plain


class _Unshard(torch.autograd.Function):
    @staticmethod
    def forward(ctx, state: "FSDPState", *sharded):
        ctx.state = state
        ctx.set_materialize_grads(False)  # unused parameters: None, not zeros
        views = state.group.full_views()
        frozen = [v for v, p in zip(views, sharded) if not p.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return tuple(views)

    @staticmethod
    def backward(ctx, *grads):
        ctx.state._post_backward(grads)
        return (None,) * (len(grads) + 1)


class _Context:
    """What the root and every FSDP module under it share for one model."""

    def __init__(self, root: "FSDPState", states: list):
        self.root = root
        self.states = states
        self.forward_order: list = []  # states in the order their forward started (1st step)
        self.order_fixed = False
        self.callback_queued = False
        self.pending: list = []  # [(state, reduction)] waiting for the end of backward
        self.is_last_backward = True
        #: the root's forward is running (between its pre- and post-forward hooks): a module of a
        #: multi-module group called while it is not runs on its own (see FSDPState._pre_forward)
        self.in_forward = False
        #: set_post_optim_event: the root's first all_gather of the next forward waits on it
        self.post_optim_event = None


class FSDPState:
    """Attached to a module by ``fully_shard`` (``module._dtshard_fsdp``); with a list of modules,
    ONE state (and one group) shared by all of them: the group is gathered when the first of them
    starts its forward and freed when the last has finished (or at the end of the root's
    forward, for one that did not run)."""

    def __init__(self, module, group: ParamGroup, mp_policy, auto_reshard: bool):
        self.modules = list(module) if isinstance(module, (list, tuple)) else [module]
        self.module = self.modules[0]
        self.group = group
        self.mp = mp_policy
        self.auto_reshard = auto_reshard  # reshard_after_forward=None: decided at lazy init
        self.ctx: Optional[_Context] = None
        self.forward_prefetch: Optional[list] = None  # explicit lists (set_modules_to_*_prefetch)
        self.backward_prefetch: Optional[list] = None
        self._bound: list = []  # (owner, name) entries put in owner.__dict__ for a forward
        self._live = 0  # _Unshard nodes of this iteration whose backward has not run yet
        self._to_run: set = set()  # a module list: ids of the modules still to run in this forward
        #: set by a later fully_shard on an enclosing module: this state is not the root (known
        #: before any forward, which the compiled path needs: it has no lazy init)
        self.has_parent = False
        self.subtree: list = []  # the states of the FSDP modules under this one (set likewise)
        self._handles = []
        for m in self.modules:
            self._handles += [m.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
                              m.register_forward_hook(self._post_forward)]

    # ---- lazy init: the first module whose forward runs is the root -----------------------
    def lazy_init(self) -> None:
        if self.ctx is not None:
            return
        states = list({id(m._dtshard_fsdp): m._dtshard_fsdp for m in self.module.modules()
                       if getattr(m, "_dtshard_fsdp", None) is not None}.values())
        for s in states:
            if s.ctx is not None:
                raise RuntimeError(
                    f"fully_shard: {type(s.module).__name__} already ran as part of another FSDP model "
                    f"(root {type(s.ctx.root.module).__name__}); run the outermost fully_shard module first.")
        ctx = _Context(self, states)
        for s in states:
            s.ctx = ctx
            if s.auto_reshard:  # the root's parameters are needed first in backward: keep them
                s.group.reshard_after_forward = s is not self
        for s in states:  # parameters assigned after fully_shard (PyTorch's lazy init does the same)
            s.group.adopt_reassigned()

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    # ---- forward ---------------------------------------------------------------------------
    def _pre_forward(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            return self._traced_pre_forward(args, kwargs)
        self.lazy_init()
        ctx = self.ctx
        standalone = False
        if len(self.modules) > 1 and not _in_backward():
            if not ctx.in_forward and not self.is_root:
                # called on its own, outside the root's forward (torchtitan's chunked loss:
                # model.head(chunk) per chunk): gathered for this call alone, like a group of one
                # module; its backward gradients accumulate with the group's other calls
                # (_post_backward) and are reduced once
                self._to_run.clear()
                standalone = True
            elif self._to_run:  # another module of the list started the group: it is gathered
                return self._cast_inputs(args, kwargs)
            else:
                self._to_run = {id(m) for m in self.modules}
        if _in_backward():
            # a forward recomputed in backward (activation checkpointing): the group was
            # gathered by its pre-backward hook; only hand the module its parameters
            self.group.unshard()
            self._bind(count=False)
            return self._cast_inputs(args, kwargs)
        if self.is_root:
            ctx.in_forward = True
            self._finish_iteration()  # a forward without backward (eval) may have left work
            if ctx.post_optim_event is not None:  # the optimizer step is done before we gather
                event, ctx.post_optim_event = ctx.post_optim_event, None
                event.wait()
        if not ctx.order_fixed and self not in ctx.forward_order:
            ctx.forward_order.append(self)
        if self.group.is_stale():
            # kept unsharded (the root, reshard_after_forward=False, a forward whose backward
            # never ran) while the optimizer updated the shards: never compute on old values
            self.group.reshard()
        self.group.unshard()  # waits for a prefetched all_gather
        for other in ([] if standalone else self._next_in_forward()):  # no forward follows a standalone call
            other.group.unshard(async_op=True)
        self._bind()
        return self._cast_inputs(args, kwargs)

    def _cast_inputs(self, args, kwargs):
        if self.mp.param_dtype is not None and self.mp.cast_forward_inputs:
            cast = _caster(self.mp.param_dtype)
            args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return args, kwargs

    def _post_forward(self, module, args, output):
        ctx = self.ctx
        if self.mp.output_dtype is not None:
            output = tree_map(_caster(self.mp.output_dtype), output)
        if torch.compiler.is_compiling():
            return self._traced_post_forward(module, output)
        if _in_backward():
            self._unbind()
            return output  # recomputation: the post-backward hook frees the parameters
        if len(self.modules) > 1:
            self._to_run.discard(id(module))
            if self._to_run:  # the list's other modules still run with the gathered parameters
                self._hook_backward(output)
                return output
        self._finish_forward()
        if self.is_root:
            ctx.in_forward = False
            ctx.order_fixed = True
            for s in ctx.states:  # a module list whose members did not all run: finish it
                if s is not self and s._to_run:
                    s._to_run.clear()
                    s._finish_forward()
        self._hook_backward(output)
        return output

    # ---- under torch.compile: the traced path ----------------------------------------------
    # Dynamo traces these hooks into the graph.  No buffers, work handles or autograd hooks:
    # the full parameters are a differentiable function of the sharded ones
    # (ParamGroup.traced_full_params: one all_gather; its autograd is the one reduce_scatter),
    # and reshard_after_forward is recomputation (the all_gather runs again in backward).
    # Prefetch and overlap are the compiler's scheduling of the functional collectives.
    def _traced_pre_forward(self, args, kwargs):
        g = self.group
        if g.all_gather_comm is not None or g.reduce_scatter_comm is not None or g.all_reduce_hook is not None:
            raise NotImplementedError(
                f"dtshard.fsdp: {type(self.module).__name__} has a custom all_gather / reduce_scatter comm or an "
                "all-reduce hook, which run in eager mode only; under torch.compile the collectives are the "
                "graph's. Compile without them, or run this module eagerly.")
        if not self._bound:  # a module list: the first module to run gathers the group
            reshard = self.has_parent if self.auto_reshard else self.group.reshard_after_forward
            self._bind_fulls(self.group.traced_full_params(recompute=reshard))
        return self._cast_inputs(args, kwargs)

    def _traced_post_forward(self, module, output):
        if len(self.modules) == 1:
            self._unbind()
        if not self.has_parent:  # the root: a module list's parameters are bound until here
            for s in self.subtree:
                s._unbind()
        return output

    def _finish_forward(self) -> None:
        self._unbind()
        # without grad no backward will need the full parameters: free them (the root too)
        if self.group.reshard_after_forward or not torch.is_grad_enabled():
            self.group.reshard(after_forward=torch.is_grad_enabled())

    def _hook_backward(self, output) -> None:
        """Gather the group again when a gradient reaches this output (the pre-backward hook)."""
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors and torch.is_grad_enabled():
            if any(t._base is not None for t in tensors):
                warnings.warn(
                    f"dtshard.fsdp: {type(self.module).__name__} returned a view; an in-place op on it "
                    "(`out += y`) would drop the hook that all-gathers its parameters before its backward "
                    "(backward then fails on freed parameters). Use out-of-place ops or .clone() it.",
                    UserWarning, stacklevel=2)
            register_multi_grad_hook(tensors, self._pre_backward, mode="any")

    def _bind(self, count: bool = True) -> None:
        """Give the module its full parameters for this forward call.  The sharded parameters
        stay in ``_parameters`` (so ``parameters()`` / ``state_dict()`` always see the sharded
        DTensors); the full ones shadow them in the owners' instance ``__dict__``, which normal
        attribute lookup reads before ``nn.Module.__getattr__`` looks in ``_parameters``."""
        g = self.group
        if not g.infos:
            return
        fulls = _Unshard.apply(self, *g.sharded_params)
        if count and torch.is_grad_enabled() and any(p.requires_grad for p in g.sharded_params):
            self._live += 1  # one more _Unshard node whose backward will run
        self._bind_fulls(fulls)

    def _bind_fulls(self, fulls) -> None:
        g = self.group
        if g.spmd_layouts:
            fulls = [_spmd_param(full, *info.spmd[:3], tuple(sorted(info.spmd[3]))) if info.spmd is not None else full
                     for full, info in zip(fulls, g.infos)]
        elif g.has_tp:
            fulls = [full if info.tp is None else _tp_param(full, info, g, k) for k, (full, info) in enumerate(zip(fulls, g.infos))]
        for full, info in zip(fulls, g.infos):
            for owner, name in info.owners:
                owner.__dict__[name] = full
                self._bound.append((owner, name))

    def _unbind(self) -> None:
        for owner, name in self._bound:
            owner.__dict__.pop(name, None)
        self._bound.clear()

    def _next_in_forward(self) -> list:
        if self.forward_prefetch is not None:
            return self.forward_prefetch
        order = self.ctx.forward_order
        if self.ctx.order_fixed and self in order:
            i = order.index(self)
            return order[i + 1:i + 2]
        return []

    def _prev_in_forward(self) -> list:
        if self.backward_prefetch is not None:
            return self.backward_prefetch
        order = self.ctx.forward_order
        if self.ctx.order_fixed and self in order:
            i = order.index(self)
            return order[i - 1:i] if i > 0 else []
        return []

    # ---- backward --------------------------------------------------------------------------
    def _pre_backward(self, grad) -> None:
        ctx = self.ctx
        if not ctx.callback_queued:
            ctx.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        if self.group.unshard_in_backward:  # set_unshard_in_backward(False): backward needs none
            self._unshard_for_backward()
        for other in self._prev_in_forward():
            if other.group.unshard_in_backward:
                other.group.unshard(async_op=True)

    def _unshard_for_backward(self) -> None:
        """Gather this group for its backward (waits for a prefetch) and bind it if needed."""
        self.group.unshard()
        if not self._bound and any(p.requires_grad for p in self.group.sharded_params):
            # a forward recomputed in this backward (activation checkpointing inside the module's
            # forward) reads the module's attributes: give it the full parameters, requiring grad
            # as in forward so it saves the same tensors (that _Unshard node never runs backward)
            with torch.enable_grad():  # backward runs with grad mode off
                self._bind(count=False)

    def _post_backward(self, grads) -> None:
        g = self.group
        self._unbind()
        # the previous groups' reduce_scatters have had this group's backward to run: move them
        # on (HSDP: start their all_reduce across replicas), all but the newest k - 1 of them
        self._cap_reduce_inputs()
        # a module called twice in one forward has two _Unshard nodes: free the full parameters
        # only after the last of them, the other's backward may still read them.  Free them
        # BEFORE the gradient buffer is allocated (every node that read them has run: this node
        # runs once all their gradients exist), so the two are never alive together
        self._live = max(self._live - 1, 0)
        if g.reshard_after_backward and self._live == 0:
            g.reshard()
        # a module called several times (chunked loss: model.head(chunk) per chunk; a block reused)
        # has one _Unshard node per call: the gradients of all but the last node to run are
        # accumulated, and the group reduces their sum once (end of backward at the latest)
        red = g.reduce_grads(grads, defer=self._live > 0)
        if red is not None:
            self.ctx.pending.append((self, red))

    def _cap_reduce_inputs(self) -> None:
        """Before this group's reduce_scatter is issued, wait for the oldest reductions in flight
        (and free their inputs, where the backend holds them) until fewer than k are left:
        ``set_reduce_scatter_max_input_buffers(k)``, 1 by default (PyTorch's default)."""
        k = self.group.max_rs_buffers
        held = [(s, red) for s, red in self.ctx.pending if red[2] is not None]
        while len(held) >= k:
            s, red = held.pop(0)
            s.group.start_replicate_reduce(red)

    def _end_of_backward(self) -> None:
        """Engine callback, after the whole backward: every gradient is reduced and in place
        when ``backward()`` returns, so the optimizer reads finished sharded gradients."""
        ctx = self.ctx
        ctx.callback_queued = False
        for s in ctx.states:  # calls whose backward did not run (an unused chunk): reduce what came
            red = s.group.flush_deferred()
            if red is not None:
                ctx.pending.append((s, red))
        if ctx.is_last_backward:
            self._drain()
        for s in ctx.states:
            s._unbind()
            s._live = 0
            s.group.drop_post()  # a group resharded to k ranks whose backward never ran
            if s.group.reshard_after_backward or s.group.state == "gathering":
                s.group.reshard()  # also an unused prefetch, or a group whose backward never ran

    def _drain(self) -> None:
        ctx = self.ctx
        for s, red in ctx.pending:
            if red[2] is not None:
                s.group.start_replicate_reduce(red)
        for s, red in ctx.pending:
            s.group.finish_reduce(red)
        ctx.pending.clear()

    def reset_iter_state(self) -> None:
        """After an exception aborted a forward or backward: wait for the collectives in flight,
        reshard every group, drop the failed iteration's gradient reductions and accumulation,
        and clear the per-iteration state, so the next iteration runs normally."""
        ctx = self.ctx
        if ctx is None:
            return
        for _, red in ctx.pending:  # every rank issued them: wait, so the process group stays in step
            if red[0] is not None:
                red[0].wait()
        ctx.pending.clear()
        ctx.callback_queued = False
        ctx.in_forward = False
        ctx.is_last_backward = True
        ctx.post_optim_event = None
        if not ctx.order_fixed:
            ctx.forward_order.clear()
        for s in ctx.states:
            s._unbind()
            s._live = 0
            s._to_run.clear()
            s.group.reset()

    def _finish_iteration(self) -> None:
        ctx = self.ctx
        if ctx.pending and ctx.is_last_backward:
            self._drain()
        for s in ctx.states:
            s._live = 0
            if s.group.state == "gathering":
                s.group.reshard()


class _SpmdParam(torch.autograd.Function):
    """dp_mesh_dims: the gathered local parameter as the module's DTensor on the full mesh, in its
    original placements.  In backward the gradient's non-data-parallel dims are brought to those
    placements; on the data-parallel dims it keeps what autograd produced (a Partial sum is left
    for FSDP's reduce_scatter, as PyTorch does: no extra all_reduce), and its local tensor goes to
    FSDP's reduction."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, layout):
        mesh, placements, shape, _ = layout
        ctx.layout = layout
        spec = DTensorSpec(mesh, placements, shape, contiguous_strides(shape), local.dtype)
        # autograd marks the output (see tensor._FromLocal: a DTensor built requiring grad is a leaf)
        return DTensor(local.view_as(local), spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):
        mesh, placements, shape, dp_dims = ctx.layout
        if not isinstance(grad, DTensor):
            grad = _promote_plain(grad, mesh, shape=shape, what="the gradient of a dp_mesh_dims parameter")
        target = tuple(
            (g if (g.is_partial() or g.is_replicate()) else Replicate()) if i in dp_dims else p
            for i, (g, p) in enumerate(zip(grad._spec.placements, placements)))
        if target != grad._spec.placements:
            grad = grad.redistribute(mesh, target)
        return grad._local_tensor, None


@in_graph
def _spmd_param(local: torch.Tensor, mesh, placements, shape, dp_dims) -> torch.Tensor:
    """:class:`_SpmdParam` as ONE node of a compiled graph (traced inline, the DTensor it builds
    from the mesh proxy fails in Dynamo: see ``_from_local_in_graph`` in dtshard/tensor.py)."""
    return _SpmdParam.apply(local, (mesh, placements, shape, dp_dims))


def _tp_param(local: torch.Tensor, info, group: ParamGroup, index: int) -> torch.Tensor:
    """FSDP x TP: the gathered TP-local parameter as the module's tensor-parallel DTensor (its
    mesh, placements and global shape from before ``fully_shard``).  Differentiable: in backward
    its gradient is brought to those placements (a Partial over the TP mesh, the gradient of a
    replicated weight under sequence parallelism, is all-reduced there) and its TP-local part
    flows to ``local``, which FSDP then reduce-scatters over the data-parallel mesh."""
    mesh, placements, shape = info.tp
    grad_placements = None
    if info.tp_inside:
        # data x spatial: keep the gradient a Partial over the spatial mesh (no all_reduce); FSDP's
        # reduce_scatter over the whole (dp x sp) mesh sums those terms with the other replicas'
        grad_placements = tuple(Partial() for _ in placements)
    full = DTensor.from_local(local, mesh, placements, shape=shape, stride=contiguous_strides(shape),
                              grad_placements=grad_placements)
    if not torch.compiler.is_compiling() and full.grad_fn is not None:
        # a pre-hook of from_local's backward node: it replaces the gradient that node receives
        full.grad_fn.register_prehook(lambda grads: _outer_terms(grads, group, index, mesh))
    return full


def _outer_terms(grads: tuple, group: ParamGroup, index: int, mesh):
    """The gradient of a TP parameter that joined ops on the activations' larger mesh (CP x FSDP
    x TP: a ``(dp, cp, tp)`` mesh, the parameter on ``mesh["tp"]``) arrives there as a Partial
    over the other dims.  ``from_local``'s backward would all-reduce it over them (the value every
    rank then holds), and FSDP would reduce-scatter one copy of it over the same ranks: twice the
    traffic.  When the other dims are exactly FSDP's ranks, this rank's TERM goes to FSDP instead
    (Partial(sum) on those dims: a Replicate one is zeroed but at coordinate 0, no traffic) and
    the group's one reduce_scatter sums the terms (``ParamGroup._global_loss_grads``).  The term
    enters ``from_local``'s backward as a DTensor on the parameter's own mesh whose local tensor
    is the term, for that one node only (a pre-hook of the node that FSDP's internal unsharded
    parameter came from; nothing else reads that gradient).  Eager only (a compiled graph has no
    such mixed-mesh gradient)."""
    grad = grads[0]
    if type(grad) is not DTensor or grad._spec.mesh is mesh:
        return None
    big = grad._spec.mesh
    dims = C.sub_mesh_dims(big, mesh)
    if dims is None or not group.outer_dims_are_fsdp(big, [d for d in range(big.ndim) if d not in dims]):
        return None  # the backward's own lowering (reduce, then FSDP counts one copy)
    target = tuple(p if d in dims else Partial("sum") for d, p in enumerate(grad._spec.placements))
    if target != grad._spec.placements:
        grad = grad.redistribute(big, target)
    group.mark_grad_term(index)
    return (DTensor.from_local(grad.to_local(), mesh, tuple(target[d] for d in dims), shape=grad.shape,
                               stride=grad.stride(), run_check=False),)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward on this thread."""
    return torch._C._current_graph_task_id() != -1


def _caster(dtype: torch.dtype):
    def cast(x):
        if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype:
            return x.to(dtype)
        return x

    return cast
