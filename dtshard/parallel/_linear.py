"""The eager fast path of a tensor-parallel ``nn.Linear``: one autograd node per module call.

Through the general path, a ``ColwiseParallel`` / ``RowwiseParallel`` linear costs per step an
input annotation (``from_local``, an autograd Function), the decomposed ``F.linear`` (``t``,
``addmm``) and an output redistribute and ``to_local`` (two more Functions) in the forward, and in
the backward each of their adjoints plus ``mm``, ``t``, ``sum`` and ``view`` on DTensors, and
AccumulateGrad's clone of the transposed weight gradient: about 14 dispatched DTensor ops and
Python autograd nodes per linear, each a few tens of microseconds of Python.  The style knows the
whole module call, so it plans it once (:class:`LinearPlan`, cached per input layout and
parameter specs) and runs it as what a hand-written Megatron layer does: one custom autograd
Function over the LOCAL tensors, whose forward is the input's move to the layout the linear needs,
one local ``F.linear``, and the output's move to ``output_layouts``, and whose backward is the
dual moves around three local matmuls.  The collectives are exactly the general path's (the same
plans of :func:`dtshard.redistribute.redistribute_local`, the same bytes), and the gradients
reach the parameters as DTensors with the parameters' own layout (contiguous, so AccumulateGrad
takes them without a copy).

The fast path runs only where it is the same computation: the module's forward is
``nn.Linear.forward``; weight and bias are DTensors on the style's mesh with the style's
placements (so FSDP's unsharded 2-D parameters, or parameters a user moved, take the general
path); the input is a plain tensor or a DTensor on that mesh (no Partial, strided shard or layout-extension data);
dtypes and devices agree; no ``torch.compile`` trace, dispatch or function mode, autocast, or
debug plan observer (``dtshard.debug``'s views see the general path's per-op plans) is active.
Anything else runs the general path: the style's input preparation, ``nn.Linear.forward`` on
DTensors, the output preparation, exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard import _trace
from dtshard import collectives as C
from dtshard import hooks
from dtshard._config import config
from dtshard.redistribute import redistribute_local
from dtshard.spec import DTensorSpec, contiguous_strides, normalize_placements, same_mesh
from dtshard.tensor import DTensor, _grad_placements

__all__ = ["TPLinearCall", "LinearPlan"]

_LINEAR_FORWARD = nn.Linear.forward


@dataclass(frozen=True)
class LinearPlan:
    """Everything one layout of a tensor-parallel linear call needs, built once per layout.

    ``x_spec``: the input as it arrives (a plain input: ``input_layouts``, even shards, as
    ``from_local`` assumes); ``in_spec``: the input the local linear reads (Replicate for colwise,
    Shard(-1) for rowwise); ``lin_spec``: the local linear's output (colwise Shard(-1), rowwise
    Partial(sum), before the bias); ``out_spec``: the module's output (``output_layouts``);
    ``gx_placements``: the layout of the input's gradient (the general path's: Partial as
    Replicate for a plain or moved input; a DTensor input that did not move gets the linear's own
    input gradient, Partial for colwise); ``w_spec`` / ``b_spec``: the parameters' gradients."""

    colwise: bool
    x_is_dtensor: bool
    x_spec: DTensorSpec
    in_spec: DTensorSpec
    lin_spec: DTensorSpec
    out_spec: DTensorSpec
    gx_placements: tuple
    g_lin_placements: tuple  # the local linear output's gradient: colwise Shard(-1), rowwise Replicate
    gin_spec: DTensorSpec  # the local linear input's gradient: colwise Partial, rowwise Shard(-1)
    gx_spec: DTensorSpec  # the module input's gradient (a DTensor input's)
    w_spec: DTensorSpec
    b_spec: Optional[DTensorSpec]
    local_output: bool


def _spec(like: DTensorSpec, placements, shape=None) -> DTensorSpec:
    shape = tuple(like.shape if shape is None else shape)
    return DTensorSpec(like.mesh, tuple(placements), shape, contiguous_strides(shape), like.dtype)


def _move(x: torch.Tensor, spec: DTensorSpec, placements) -> torch.Tensor:
    return x if tuple(placements) == spec.placements else redistribute_local(x, spec, placements)


def _plain_layout(ps, ndim: int):
    """``ps`` with negative shard dims normalised for an ``ndim``-D tensor, when they are only
    Replicate and plain Shard placements (no Partial, no strided shard) of a 1-D mesh; else None
    (the per-op path decides, and raises its own error for a bad placement)."""
    if not all(type(p) is Replicate or type(p) is Shard for p in ps):
        return None
    try:
        return normalize_placements(ps, ndim, 1, what="parallel style")
    except ValueError:
        return None


class _TPLinearFn(torch.autograd.Function):
    """``out = move(F.linear(move(x, in), w, b), out)`` on local tensors, with the dual moves and
    the linear's three local products in backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, plan: LinearPlan):
        x_local = x._local_tensor if plan.x_is_dtensor else x
        w = weight._local_tensor
        b = bias._local_tensor if bias is not None else None
        xin = _move(x_local, plan.x_spec, plan.in_spec.placements)
        if plan.colwise:
            y = F.linear(xin, w, b)
            y = _move(y, plan.lin_spec, plan.out_spec.placements)
        else:  # partial sums, reduced (all_reduce / reduce_scatter), then the replicated bias once
            y = _move(F.linear(xin, w), plan.lin_spec, plan.out_spec.placements)
            if b is not None:
                y = y + b
        ctx.plan = plan
        ctx.save_for_backward(xin, w)
        ctx.has_bias = bias is not None
        if plan.local_output:
            return y
        return DTensor(y, plan.out_spec, requires_grad=False)

    @staticmethod
    def backward(ctx, grad):
        plan: LinearPlan = ctx.plan
        xin, w = ctx.saved_tensors
        if isinstance(grad, DTensor):  # a DTensor output: its gradient in the output's layout
            if grad._spec.placements != plan.out_spec.placements:
                grad = grad.redistribute(grad.device_mesh, plan.out_spec.placements)
            grad = grad._local_tensor
        g = _move(grad, plan.out_spec, plan.g_lin_placements)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        gx = gw = gb = None
        g2 = g.reshape(-1, g.shape[-1])
        if need_w:
            gw = DTensor(g2.t().mm(xin.reshape(-1, xin.shape[-1])), plan.w_spec, requires_grad=False)
        if need_b and ctx.has_bias:
            gb = DTensor(g2.sum(0), plan.b_spec, requires_grad=False)
        if need_x:
            gx = _move(g.matmul(w), plan.gin_spec, plan.gx_placements)
            if plan.x_is_dtensor:
                gx = DTensor(gx, plan.gx_spec, requires_grad=False)
        return gx, gw, gb, None


class TPLinearCall:
    """``module.forward`` of an ``nn.Linear`` parallelized by ``ColwiseParallel`` /
    ``RowwiseParallel``: the one-node fast path when it applies (see the module docstring), else
    the general path (``prepare_input``, ``nn.Linear.forward`` on DTensors, ``prepare_output``,
    the style's hooks as in PyTorch)."""

    def __init__(self, module: nn.Module, style, device_mesh) -> None:
        self.module = module
        self.style = style
        self.mesh = device_mesh
        self.colwise = type(style).__name__ == "ColwiseParallel"
        self.w_placements = (Shard(0),) if self.colwise else (Shard(1),)
        self.b_placements = (Shard(0),) if self.colwise else (Replicate(),)
        self._plans: dict = {}
        self.fast_calls = 0  # module calls that took the fast path (tests and benchmarks read it)

    # copies (deepcopy of a parallelized model, pickling) get a call of their own, with no plans
    def __deepcopy__(self, memo):
        return TPLinearCall(memo.get(id(self.module), self.module), self.style, self.mesh)

    def __reduce__(self):
        return (TPLinearCall, (self.module, self.style, self.mesh))

    def __call__(self, *args, **kwargs):
        module = self.module
        if not kwargs and len(args) == 1 and not torch.compiler.is_compiling():
            plan = self._fast_plan(module, args[0])
            if plan is not None:
                self.fast_calls += 1
                return _TPLinearFn.apply(args[0], module.weight, module.bias, plan)
        style, mesh = self.style, self.mesh
        inputs = style._prepare_input_fn(style.input_layouts, style.desired_input_layouts, module, args, mesh)
        out = _LINEAR_FORWARD(module, inputs, *args[1:], **kwargs)
        return style._prepare_output_fn(style.output_layouts, style.use_local_output, module, out, mesh)

    def _fast_plan(self, module, x) -> Optional[LinearPlan]:
        if not config.tp_linear_fast_path or type(module).forward is not _LINEAR_FORWARD:
            return None
        if _trace.plan_observers or torch._C._len_torch_dispatch_stack() \
                or torch._C._is_torch_function_mode_enabled():
            return None
        w, b = module.weight, module.bias
        if not isinstance(w, DTensor) or (b is not None and not isinstance(b, DTensor)):
            return None
        tx = type(x)
        if tx is DTensor:
            if x._spec.extra is not None or type(x._local_tensor) is not torch.Tensor:
                return None
            key = (x._spec, w._spec, b._spec if b is not None else None)
        elif tx is torch.Tensor:
            key = (tuple(x.shape), x.dtype, w._spec, b._spec if b is not None else None)
        else:
            return None
        if torch.is_autocast_enabled(x.device.type):
            return None
        plan = self._plans.get(key, False)
        if plan is False:
            plan = self._plans[key] = self._build(x, w, b)
        if plan is not None and (x.device != w._local_tensor.device or type(w._local_tensor) is not torch.Tensor):
            return None
        return plan

    def _build(self, x, w, b) -> Optional[LinearPlan]:
        """The plan of one layout, or None when the fast path does not apply to it."""
        mesh, style = self.mesh, self.style
        ws = w._spec
        if ws.extra is not None or not same_mesh(ws.mesh, mesh):
            return None
        if ws.placements != self.w_placements or not C.is_member(mesh):
            return None
        if b is not None and (b._spec.placements != self.b_placements or b._spec.extra is not None
                              or not same_mesh(b._spec.mesh, mesh) or b.dtype != w.dtype):
            return None
        if x.dtype != w.dtype or x.dim() < 2 or len(ws.shape) != 2:
            return None
        nd = x.dim()
        want_in = _plain_layout(style.desired_input_layouts, nd)
        out = _plain_layout(style.output_layouts, nd)
        if want_in is None or out is None:
            return None
        if type(x) is DTensor:
            xs = x._spec
            if not same_mesh(xs.mesh, mesh) or _plain_layout(xs.placements, nd) is None:
                return None
            x_spec, x_is_dt = xs, True
        else:
            ins = _plain_layout(style.input_layouts, nd)
            if ins is None:
                return None
            shape = list(x.shape)  # even shards, as from_local assumes without shape=
            if type(ins[0]) is Shard:
                shape[ins[0].dim] *= mesh.size(0)
            x_spec, x_is_dt = DTensorSpec(mesh, ins, tuple(shape), contiguous_strides(shape), x.dtype), False
        if x_spec.shape[-1] != ws.shape[1]:
            return None  # a shape error: the general path raises it, worded as usual
        in_spec = _spec(x_spec, want_in)
        yshape = tuple(x_spec.shape[:-1]) + (ws.shape[0],)
        if self.colwise:
            if want_in != (Replicate(),):
                return None
            lin_spec = DTensorSpec(mesh, (Shard(nd - 1),), yshape, contiguous_strides(yshape), x.dtype)
        else:
            if want_in != (Shard(nd - 1),) or (b is not None and out != (Replicate(),)
                                               and any(type(p) is Shard and p.dim == nd - 1 for p in out)):
                return None  # a bias added after a reduce_scatter of the feature dim: general path
            lin_spec = DTensorSpec(mesh, (Partial(),), yshape, contiguous_strides(yshape), x.dtype)
        out_spec = _spec(lin_spec, out)
        # colwise: the input's gradient is Partial (each rank's output columns contribute)
        gin = (Partial(),) if self.colwise else want_in
        gx = gin if x_is_dt and x_spec.placements == want_in else _grad_placements(x_spec.placements)
        return LinearPlan(
            colwise=self.colwise, x_is_dtensor=x_is_dt, x_spec=x_spec, in_spec=in_spec, lin_spec=lin_spec,
            out_spec=out_spec, gx_placements=gx,
            g_lin_placements=lin_spec.placements if self.colwise else _grad_placements(lin_spec.placements),
            gin_spec=_spec(in_spec, gin), gx_spec=_spec(x_spec, gx), w_spec=_spec(ws, ws.placements),
            b_spec=_spec(b._spec, b._spec.placements) if b is not None else None,
            local_output=bool(style.use_local_output),
        )


# the TP linear's call and its autograd node run outside any traced graph too (dtshard.hooks)
hooks.runtime_entry_points(TPLinearCall.__call__, _TPLinearFn.forward, _TPLinearFn.backward)
