"""torch.compile without ``fullgraph``: graph breaks in user code behave as on plain tensors.

A training step ``loss = model(x).sum(); loss.backward()`` compiled with the default
``fullgraph=False`` breaks its graph at ``loss.backward()`` (Dynamo does not trace it unless
``trace_autograd_ops`` is on); the cases below add a second break inside the model's forward
(``torch._dynamo.graph_break()``, a ``print``, a call to a ``torch.compiler.disable``d function
working on the local shards).  The breaking call runs eagerly under Dynamo's frame hook, and on
DTensors it runs dtshard's Python code (the dispatcher, ``DTensor.__new__``, AOTAutograd's
subclass protocol, the autograd Functions' backward, the gradient hook): none of it may reach
Dynamo as frames of its own (it did, and failed in a resume function inside ``DTensor.__new__``:
"'DTensor' object has no attribute '_spec'", or in ``propagate`` on a SymInt).

Each case trains the same tiny MLP for a few SGD steps three ways on each of 2 ranks: compiled
plain tensors (the reference for the graph breaks: each rank's own single-process model), eager
dtshard, and compiled dtshard.  The graph breaks (reasons and counts) and the frames compiled
must be those of the plain model, no dtshard function may be handed to Dynamo's frame hook, and
the losses and gradients must be those of the plain model and of eager dtshard, every step.
Layouts: tensor parallel (Colwise then Rowwise) and data parallel (replicated weights, batch
sharded: the gradients are Partial and reduced by dtshard's post-accumulate hook).
"""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn as nn

from dtshard.testing import run_distributed
from test_compile_models import _counter, _graph_breaks, _reset

_STEPS = 3
_LR = 0.1


@torch.compiler.disable
def _relu_on_shards(h):
    """ReLU on this rank's shard, run eagerly, as a custom kernel on local tensors would be: the
    ``to_local``/``from_local`` pair runs outside any graph, and its backward (dtshard's autograd
    Functions) runs inside the compiled step's ``loss.backward()``."""
    if hasattr(h, "to_local"):
        return type(h).from_local(torch.relu(h.to_local()), h.device_mesh, h.placements)
    return torch.relu(h)


class _MLP(nn.Module):
    """Linear - ReLU - Linear, with an optional graph break between the two layers."""

    def __init__(self, brk: str):
        super().__init__()
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 4)
        self.brk = brk
        self.log = io.StringIO()

    def forward(self, x):
        if self.brk == "disable":  # Dynamo does not trace a disabled function: a graph break
            h = _relu_on_shards(self.up(x))
        else:
            h = torch.relu(self.up(x))
        if self.brk == "graph_break":
            torch._dynamo.graph_break()
        elif self.brk == "print":
            print("hidden computed", file=self.log)  # Dynamo cannot trace print: a graph break
        return self.down(h)


def _step(model, x):
    loss = model(x).sum()
    loss.backward()  # a graph break (trace_autograd_ops is off)
    return loss


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _train(model, x, step) -> dict:
    """``_STEPS`` SGD steps of ``step(model, x)``; the losses and gradients (full tensors) of each."""
    losses, grads = [], []
    for _ in range(_STEPS):
        for p in model.parameters():
            p.grad = None
        losses.append(_full(step(model, x)))
        grads.append({n: _full(p.grad) for n, p in model.named_parameters()})
        with torch.no_grad():
            for p in model.parameters():
                p.sub_(_LR * p.grad)
    return {"losses": losses, "grads": grads}


def _compiled(model, x, backend: str) -> dict:
    """``_train`` with ``_step`` compiled (default ``fullgraph=False``), and what Dynamo did:
    the frames compiled into graphs, the graph breaks, and the dtshard functions among the frames
    its frame hook was handed (to compile, or to look at and skip)."""
    import os

    from torch._dynamo.convert_frame import input_codes  # every code object the hook was handed

    import dtshard

    _reset()
    cnt = _counter(backend, [])
    res = _train(model, x, torch.compile(_step, backend=cnt))
    res["frames"] = cnt.frame_count
    res["breaks"] = _graph_breaks()
    root = os.path.dirname(dtshard.__file__)
    codes = [ref() for ref in input_codes.seen]
    res["dtshard_frames"] = sorted({f"{c.co_filename[len(root) + 1:]}:{c.co_name}" for c in codes
                                    if c is not None and c.co_filename.startswith(root + os.sep)})
    return res


def _case(layout: str, brk: str, backend: str) -> dict:
    import torch.distributed as dist

    import dtshard
    import dtshard.parallel as P
    from dtshard import Replicate, Shard

    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    ref = _MLP(brk)
    x = torch.randn(4, 8)

    def sharded():
        m = copy.deepcopy(ref)
        if layout == "tp":
            return P.parallelize_module(m, mesh, {"up": P.ColwiseParallel(), "down": P.RowwiseParallel()}), x
        for mod in (m.up, m.down):
            for name, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(name, nn.Parameter(dtshard.distribute_tensor(p.detach(), mesh, [Replicate()])))
        return m, dtshard.distribute_tensor(x, mesh, [Shard(0)])

    plain = _compiled(copy.deepcopy(ref), x, backend)
    eager = _train(*sharded(), _step)
    compiled = _compiled(*sharded(), backend)
    return {"plain": plain, "eager": eager, "compiled": compiled}


def _check(res) -> None:
    plain, eager, compiled = res["plain"], res["eager"], res["compiled"]
    assert compiled["breaks"] == plain["breaks"], (compiled["breaks"], plain["breaks"])
    assert compiled["frames"] == plain["frames"], f"{compiled['frames']} frames, plain: {plain['frames']}"
    assert compiled["dtshard_frames"] == [], f"Dynamo's frame hook ran on {compiled['dtshard_frames']}"
    assert sum(plain["breaks"].values()) >= 1  # the case does break its graph
    for other in (eager, plain):
        torch.testing.assert_close(compiled["losses"], other["losses"], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(compiled["grads"], other["grads"], rtol=1e-5, atol=1e-6)
    assert compiled["losses"][-1] < compiled["losses"][0], "the model did not train"


_CASES = [
    # (layout, break in the forward, backend)
    ("tp", "none", "aot_eager"),
    ("tp", "graph_break", "aot_eager"),
    ("tp", "print", "aot_eager"),
    ("dp", "none", "aot_eager"),
    ("dp", "graph_break", "aot_eager"),
    ("dp", "disable", "aot_eager"),
]


@pytest.mark.parametrize("layout,brk,backend", _CASES, ids=["-".join(c) for c in _CASES])
def test_graph_breaks_match_the_plain_model(layout, brk, backend):
    for res in run_distributed(_case, 2, layout, brk, backend, timeout=300):
        _check(res)
