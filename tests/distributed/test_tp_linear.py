"""The one-node eager path of tensor-parallel ``nn.Linear`` calls (``dtshard/parallel/_linear.py``).

Every layout ``ColwiseParallel`` / ``RowwiseParallel`` offers (sequence-parallel inputs and
outputs, replicated outputs, DTensor inputs and outputs, with and without bias, inputs that need
a gradient or not) on 2 and 3 ranks (uneven feature shards), in float64: the output, the
parameter gradients (full tensors) and the input gradient equal single-process PyTorch's, and the
fast path issues exactly the collectives of the per-op path (kinds and bytes, in order) and leaves
every gradient in the same layout.  Then the cases where it must step aside: a dispatch mode, a
parameter moved to another layout, autocast, an input of the wrong width (the per-op error).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

import dtshard
from dtshard import DTensor, Replicate, Shard
from dtshard.debug import CommCounter
from dtshard.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from dtshard.testing import run_distributed

B, S, IN, OUT = 2, 6, 12, 9  # OUT splits unevenly over 2 and 3 ranks; a plain input's shards are even

# (style name, style kwargs, input kind): input kind "plain" (a local tensor in input_layouts) or
# "dtensor" (a DTensor in the layout the linear reads, as PrepareModuleInput(use_local_output=False)
# hands it over, or in input_layouts)
CASES = [
    ("col", {}, "plain"),
    ("col", {"input_layouts": Shard(1)}, "plain"),
    ("col", {"output_layouts": Replicate()}, "plain"),
    ("col", {"use_local_output": False}, "plain"),
    ("col", {}, "dtensor"),
    ("col", {"input_layouts": Shard(1)}, "dtensor"),
    ("row", {}, "plain"),
    ("row", {"output_layouts": Shard(1)}, "plain"),
    ("row", {"use_local_output": False}, "plain"),
    ("row", {"input_layouts": Replicate()}, "plain"),
    ("row", {}, "dtensor"),
]


def _style(name, kw):
    return (ColwiseParallel if name == "col" else RowwiseParallel)(**kw)


def _global_input(name, kw, kind, mesh, x):
    """The module input for this rank: a plain local tensor or a DTensor (leaf, requires grad)."""
    layout = kw.get("input_layouts", Replicate() if name == "col" else Shard(-1))
    if kind == "dtensor":
        return dtshard.distribute_tensor(x, mesh, [layout]).requires_grad_()
    local = dtshard.distribute_tensor(x, mesh, [layout]).to_local().detach().requires_grad_()
    return local


def _output_full(out, name, kw, mesh):
    """The module output as the full global tensor (differentiable)."""
    if isinstance(out, DTensor):
        return out.full_tensor()
    layout = kw.get("output_layouts", Shard(-1) if name == "col" else Replicate())
    return DTensor.from_local(out, mesh, [layout], shape=(B, S, OUT)).full_tensor()


def _input_grad_full(x_in, name, kw, kind, mesh):
    if kind == "dtensor":
        return x_in.grad.full_tensor()
    layout = kw.get("input_layouts", Replicate() if name == "col" else Shard(-1))
    return DTensor.from_local(x_in.grad, mesh, [layout], shape=(B, S, IN)).full_tensor()


def _run_case(name, kw, kind, bias, x_grad, fast):
    dtshard.config.tp_linear_fast_path = fast
    try:
        mesh = dtshard.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        torch.manual_seed(0)
        full = nn.Linear(IN, OUT, bias=bias).double()
        x = torch.randn(B, S, IN, dtype=torch.float64)
        c = torch.randn(B, S, OUT, dtype=torch.float64)
        model = parallelize_module(copy.deepcopy(full), mesh, _style(name, kw))
        x_in = _global_input(name, kw, kind, mesh, x)
        if not x_grad:
            x_in.requires_grad_(False)
        with CommCounter() as comms:
            out = model(x_in)
            loss = (_output_full(out, name, kw, mesh) * c).sum()
            loss.backward()
        grads = {n: (tuple(p.grad.placements), p.grad.full_tensor()) for n, p in model.named_parameters()}
        gx = _input_grad_full(x_in, name, kw, kind, mesh) if x_grad else None
        return {
            "y": _output_full(out, name, kw, mesh).detach(), "grads": grads, "gx": gx,
            "out_type": "DTensor" if isinstance(out, DTensor) else "plain", "out_placements": tuple(out.placements) if isinstance(out, DTensor) else None,
            "comms": [(r.kind, r.nbytes) for r in comms.records],
            "fast_calls": model.forward.fast_calls,
        }
    finally:
        dtshard.config.tp_linear_fast_path = True


def _reference(bias, x_grad):
    torch.manual_seed(0)
    full = nn.Linear(IN, OUT, bias=bias).double()
    x = torch.randn(B, S, IN, dtype=torch.float64, requires_grad=x_grad)
    c = torch.randn(B, S, OUT, dtype=torch.float64)
    y = full(x)
    (y * c).sum().backward()
    return y.detach(), {n: p.grad for n, p in full.named_parameters()}, x.grad


def _all_cases():
    out = []
    for name, kw, kind in CASES:
        for bias, x_grad in ((True, True), (False, False)):
            out.append((_run_case(name, kw, kind, bias, x_grad, True), _run_case(name, kw, kind, bias, x_grad, False)))
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_fast_path_matches_torch_and_the_per_op_path(world):
    results = run_distributed(_all_cases, world, timeout=240)
    k = 0
    for name, kw, kind in CASES:
        for bias, x_grad in ((True, True), (False, False)):
            y_ref, g_ref, gx_ref = _reference(bias, x_grad)
            what = f"{name} {kw} {kind} bias={bias} x_grad={x_grad} on {world} ranks"
            for rank, per_rank in enumerate(results):
                fast, slow = per_rank[k]
                assert fast["fast_calls"] == 1 and slow["fast_calls"] == 0, what
                torch.testing.assert_close(fast["y"], y_ref, msg=what)
                for n, (placements, g) in fast["grads"].items():
                    torch.testing.assert_close(g, g_ref[n], msg=f"{what}: grad of {n} on rank {rank}")
                    assert placements == slow["grads"][n][0], (what, n, placements, slow["grads"][n][0])
                if x_grad:
                    torch.testing.assert_close(fast["gx"], gx_ref, msg=f"{what}: input grad on rank {rank}")
                assert (fast["out_type"], fast["out_placements"]) == (slow["out_type"], slow["out_placements"]), what
                # the same collectives, in the same order, with the same bytes
                assert fast["comms"] == slow["comms"], (what, fast["comms"], slow["comms"])
            k += 1


def _fallbacks():
    from torch.utils._python_dispatch import TorchDispatchMode

    mesh = dtshard.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    torch.manual_seed(0)
    full = nn.Linear(IN, OUT)
    x = torch.randn(B, S, IN)
    ref = full(x)
    res = {}

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    model = parallelize_module(copy.deepcopy(full), mesh, ColwiseParallel(output_layouts=Replicate()))
    with Passthrough():  # a mode sees every op of the per-op path
        y = model(x)
    res["mode"] = (model.forward.fast_calls, torch.allclose(y, ref, atol=1e-6))
    y = model(x)
    res["plain"] = (model.forward.fast_calls, torch.allclose(y, ref, atol=1e-6))
    # a weight moved to another layout: the per-op path (still the right values)
    model.weight = nn.Parameter(model.weight.detach().redistribute(mesh, [Replicate()]))
    model.forward.fast_calls = 0
    y = model(x)
    res["moved"] = (model.forward.fast_calls, torch.allclose(y, ref, atol=1e-6))
    model = parallelize_module(copy.deepcopy(full), mesh, RowwiseParallel())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        xs = dtshard.distribute_tensor(x, mesh, [Shard(-1)]).to_local()
        y = model(xs)
    res["autocast"] = (model.forward.fast_calls, y.dtype)
    try:
        model(torch.randn(B, S, IN + 2))  # a width the weight does not take: the per-op error
        res["error"] = None
    except Exception as e:  # noqa: BLE001
        res["error"] = type(e).__name__
    return res


def test_fast_path_steps_aside():
    for res in run_distributed(_fallbacks, 2, timeout=120):
        assert res["mode"] == (0, True), res
        assert res["plain"] == (1, True), res
        assert res["moved"] == (0, True), res
        assert res["autocast"] == (0, torch.bfloat16), res
        assert res["error"] is not None, res
