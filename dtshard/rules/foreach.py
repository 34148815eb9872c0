"""``_foreach_*`` list ops (what ``torch.optim`` runs with ``foreach=True``) and the fused Adam/AdamW
steps.

A foreach op applies one op to each index of its tensor lists, and optimizer lists mix placements
freely (a column-sharded weight next to a replicated bias).  A rule sees no placements, so a
single strategy cannot describe such a list; these are **handlers** that run the per-element op on
each index's DTensors (``_foreach_add_.List(xs, ys, alpha=a)`` -> ``xs[i].add_(ys[i], alpha=a)``).
Each element goes through the normal dispatch (cached plans, exact for uneven shards), so an
element keeps its own placement; an in-place element op that would have to change ``self``'s
placement raises as the plain in-place op does.

``_fused_adam_`` / ``_fused_adamw_`` are written as the same per-parameter math with DTensor ops
(the reference formulas of ``torch.optim.adam``'s single-tensor path).

``_amp_foreach_non_finite_check_and_unscale_`` (``torch.amp.GradScaler.unscale_``) runs aten's
kernel on every gradient's shard and then makes the found-inf flag the same on every rank (a
max over each mesh the gradients live on), so all ranks skip, or all take, the optimizer step.
"""

from __future__ import annotations

import math

import torch

from torch.distributed.tensor.placement_types import Partial, Replicate

from dtshard import handlers as H
from dtshard.registry import op_facts, register_handler
from dtshard.tensor import DTensor
from dtshard.spec import mesh_key  # PyTorch's mesh equality: equal meshes are one

aten = torch.ops.aten


def _dt_class():
    return DTensor


# foreach base name -> the per-element function (python API: it picks the right overload)
_SPECIAL = {
    "norm": lambda x, ord=2, dtype=None: torch.linalg.vector_norm(x, ord, dtype=dtype),
    "max": lambda x: torch.max(x),
    "copy": lambda x, src, non_blocking=False: x.clone().copy_(src, non_blocking),
    "zero": lambda x: torch.zeros_like(x),
    "clone": lambda x, memory_format=None: x.clone(memory_format=memory_format)
    if memory_format is not None else x.clone(),
    "powsum": lambda x, ord=2, dtype=None: torch.sum(torch.pow(torch.abs(x), ord), dtype=dtype),
}
_SPECIAL_INPLACE = {
    "copy_": lambda x, src, non_blocking=False: x.copy_(src, non_blocking),
    "zero_": lambda x: x.zero_(),
}
# ops whose scalar is the keyword-only `value` of the element op
_VALUE_KW = {"addcmul", "addcdiv"}


def _element_fn(name: str):
    inplace = name.endswith("_")
    base = name[:-1] if inplace else name
    if inplace and name in _SPECIAL_INPLACE:
        return _SPECIAL_INPLACE[name]
    if not inplace and base in _SPECIAL:
        return _SPECIAL[base]
    if inplace:
        method = getattr(torch.Tensor, name, None)
        if method is not None:
            return method
        out_of_place = _element_fn(base)
        return lambda x, *a, **k: x.copy_(out_of_place(x, *a, **k))  # e.g. maximum_: no Tensor method
    fn = getattr(torch, base, None)
    if fn is None:
        fn = getattr(torch.special, base, None)
    if fn is None:
        raise NotImplementedError(f"dtshard: no per-element op for _foreach_{name}")
    return fn


def _foreach_handler(op, args, kwargs):
    name = op._overloadpacket.__name__[len("_foreach_"):]
    fn = _element_fn(name)
    base = name.rstrip("_")
    schema = op._schema.arguments
    # lengths: the tensor lists (Tensor[]) and scalar lists (Scalar[]) are indexed per element
    bound = []
    for k, a in enumerate(schema):
        if k < len(args):
            bound.append((a, args[k], False))
        elif a.name in kwargs:
            bound.append((a, kwargs[a.name], True))
    lists = [v for a, v, _ in bound if isinstance(a.type, torch.ListType)]
    if not lists:
        raise NotImplementedError(f"dtshard: {op} has no list argument")
    n = len(lists[0])
    outs = []
    for i in range(n):
        pos, kw = [], {}
        for a, v, is_kw in bound:
            if isinstance(a.type, torch.ListType):
                v = v[i]
            elif str(a.type) == "Tensor" and a.name == "scalars":  # addcmul/addcdiv .Tensor: one scalar per element
                v = v[i].item()
            if base in _VALUE_KW and a.name in ("value", "scalars"):
                kw["value"] = v
            elif is_kw or a.kwarg_only:
                kw[a.name] = v
            else:
                pos.append(v)
        outs.append(fn(*pos, **kw))
    returns = op._schema.returns
    if not returns:
        return None
    return outs


def _foreach_ops() -> list:
    ops = []
    for schema in torch._C._jit_get_all_schemas():
        if not schema.name.startswith("aten::_foreach_"):
            continue
        packet = getattr(aten, schema.name[6:], None)
        op = getattr(packet, schema.overload_name or "default", None) if packet is not None else None
        if op is None or op in ops:
            continue
        if op_facts(op).mode == "out":
            continue  # .out overloads: not used by torch.optim
        if schema.name[len("aten::_foreach_"):] in ("mm",):
            continue
        ops.append(op)
    return ops


_NORMS = [op for op in (getattr(aten._foreach_norm, n, None) for n in ("Scalar", "Scalar_dtype")) if op is not None]


def _foreach_norm_handler(op, args, kwargs):
    """``_foreach_norm(tensors, ord, dtype=None)`` (``clip_grad_norm_``'s first step) with ONE
    collective per (mesh, placements) group instead of one per tensor: each tensor's reduction
    (the sum of ``|x| ** ord``, or the max / min of ``|x|``) stays a Partial of its shard, the
    Partials of a group are stacked and reduced together, and the root is taken after."""
    tensors = args[0]
    ord_ = float(args[1] if len(args) > 1 else kwargs.get("ord", 2))
    dtype = args[2] if len(args) > 2 else kwargs.get("dtype")
    DT = _dt_class()
    if not tensors or not all(isinstance(t, DT) for t in tensors) or ord_ not in (ord_,):  # NaN ord
        return _foreach_handler(op, args, kwargs)
    with torch.no_grad():
        parts = []
        for x in tensors:
            if dtype is not None and dtype != x.dtype:
                x = aten._to_copy.default(x, dtype=dtype)
            a = aten.abs.default(x)
            if ord_ == math.inf:
                parts.append(aten.amax.default(a, list(range(a.ndim)), False))
            elif ord_ == -math.inf:
                parts.append(aten.amin.default(a, list(range(a.ndim)), False))
            elif ord_ == 0:
                parts.append(aten.sum.default(aten._to_copy.default(aten.ne.Scalar(a, 0), dtype=a.dtype)))
            elif ord_ == 1:
                parts.append(aten.sum.default(a))
            elif ord_ == 2:
                parts.append(aten.sum.default(aten.mul.Tensor(a, a)))
            else:
                parts.append(aten.sum.default(aten.pow.Tensor_Scalar(a, ord_)))

        groups: dict = {}
        for k, p in enumerate(parts):
            groups.setdefault((mesh_key(p.device_mesh), p.placements, p.dtype), []).append(k)
        out = [None] * len(parts)
        for idx in groups.values():
            stacked = aten.stack.default([parts[k] for k in idx])
            mesh = stacked.device_mesh
            reduced = stacked.redistribute(mesh, [Replicate()] * mesh.ndim)  # one collective
            if ord_ not in (math.inf, -math.inf, 0.0, 1.0):
                reduced = aten.sqrt.default(reduced) if ord_ == 2 else aten.pow.Tensor_Scalar(reduced, 1.0 / ord_)
            for j, k in enumerate(aten.unbind.int(reduced, 0)):
                out[idx[j]] = k
        return out


register_handler(_NORMS, keeps_strided=True)(_foreach_norm_handler)
register_handler([op for op in _foreach_ops() if op not in _NORMS], keeps_strided=True)(_foreach_handler)


# ---------------------------------------------------------------------------------------------
# fused Adam / AdamW
# ---------------------------------------------------------------------------------------------


def _scalar(v):
    return v.item() if isinstance(v, torch.Tensor) else v


def _fused_adam_handler(op, args, kwargs):
    """``_fused_adam(w)_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *,
    lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, grad_scale, found_inf)``: the step
    counters are plain tensors already incremented by the optimizer (as for the fused kernel)."""
    bound = dict(zip(op_facts(op).names, args))
    bound.update(kwargs)
    params, grads = bound["self"], bound["grads"]
    exp_avgs, exp_avg_sqs = bound["exp_avgs"], bound["exp_avg_sqs"]
    max_sqs, steps = bound["max_exp_avg_sqs"], bound["state_steps"]
    lr, beta1, beta2 = _scalar(bound["lr"]), bound["beta1"], bound["beta2"]
    wd, eps = bound["weight_decay"], bound["eps"]
    amsgrad, maximize = bound["amsgrad"], bound["maximize"]
    grad_scale, found_inf = bound.get("grad_scale"), bound.get("found_inf")
    if found_inf is not None and float(_scalar(found_inf)) != 0.0:
        return None
    adamw = op._overloadpacket is aten._fused_adamw_
    for i, p in enumerate(params):
        g = grads[i]
        if grad_scale is not None:
            g = g / _scalar(grad_scale)
        if maximize:
            g = -g
        step = float(_scalar(steps[i]))
        if wd != 0:
            if adamw:
                p.mul_(1 - lr * wd)
            else:
                g = g + p * wd
        exp_avgs[i].lerp_(g, 1 - beta1)
        exp_avg_sqs[i].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias1 = 1 - beta1 ** step
        bias2 = 1 - beta2 ** step
        step_size = lr / bias1
        bias2_sqrt = math.sqrt(bias2)
        if amsgrad:
            max_sqs[i].copy_(torch.maximum(max_sqs[i], exp_avg_sqs[i]))
            denom = (max_sqs[i].sqrt() / bias2_sqrt).add_(eps)
        else:
            denom = (exp_avg_sqs[i].sqrt() / bias2_sqrt).add_(eps)
        p.addcdiv_(exp_avgs[i], denom, value=-step_size)
    return None


_FUSED = [op for name in ("_fused_adam_", "_fused_adamw_") for op in (
    getattr(getattr(aten, name, None), ov, None) for ov in ("default", "tensor_lr")) if op is not None]
register_handler(_FUSED, keeps_strided=True)(_fused_adam_handler)


# ---------------------------------------------------------------------------------------------
# GradScaler's unscale
# ---------------------------------------------------------------------------------------------


def _local_of(op, t, what: str) -> torch.Tensor:
    """A plain tensor as it is; a DTensor's shard, which must be its whole value (Replicate)."""
    if not isinstance(t, DTensor):
        return t
    if any(not isinstance(p, Replicate) for p in t.placements):
        raise ValueError(f"{op}: {what} must be a plain tensor or a Replicate DTensor (every rank holds "
                         f"its whole value), not {tuple(t.shape)} {t.placements} on mesh {tuple(t.device_mesh.shape)}.")
    return H.to_local(t, t.placements)


@register_handler([aten._amp_foreach_non_finite_check_and_unscale_.default], keeps_strided=True)
def amp_unscale_handler(op, args, kwargs):
    """``_amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)``: each gradient
    times ``inv_scale`` in place, and ``found_inf`` set to 1 where any gradient holds an inf or a
    NaN. Unscaling is elementwise, so aten's kernel runs on every shard as it is (any placement,
    uneven and strided shards, Partial terms: a sum, max or mean of terms scales with them, and a
    non-finite term makes the reduced value non-finite). The flag then has to be the same on every
    rank, or ranks would disagree on skipping the step: each rank's flag is reduced with max over
    every mesh the gradients live on (one all_reduce of one element per mesh, in the order the
    meshes first appear in the list, which every rank shares). Plain tensors in the list are
    unscaled as they are and their flag joins the reduction."""
    grads, found_inf, inv_scale = H.bind(op, args, kwargs)
    flag_out = _local_of(op, found_inf, "found_inf")
    inv = _local_of(op, inv_scale, "inv_scale")
    flag = flag_out.clone()
    meshes: dict = {}
    local_grads = []
    for g in grads:
        if isinstance(g, DTensor):
            meshes.setdefault(mesh_key(g.device_mesh), g.device_mesh)
            local_grads.append(H.to_local(g, g.placements))
        else:
            local_grads.append(g)
    op(local_grads, flag, inv)
    with H.op_context(op):
        for mesh in meshes.values():
            spec = H.make_spec(mesh, [Partial("max")] * mesh.ndim, flag.shape, flag.dtype)
            flag = H.wrap(flag, spec).redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
    flag_out.copy_(flag)
    return None
