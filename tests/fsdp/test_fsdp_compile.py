"""dtshard.fsdp under ``torch.compile(fullgraph=True)`` (issue #13, "Beyond FSDP2" item 1).

Under compile the FSDP hooks take a traced path (SimpleFSDP's design): each group's full
parameters are a differentiable function of its sharded ones, ONE all_gather in the forward
graph, whose autograd is ONE reduce_scatter in the backward graph; ``reshard_after_forward`` is
recomputation, so the backward graph all-gathers the resharded groups again.  Checked here from
the graphs AOTAutograd hands the compiler (min-cut partitioner, as inductor uses), with 0 graph
breaks and no recompilation, and against the same model trained in one process:

- FSDP (2 and 4 ranks) and HSDP (2x2), ``reshard_after_forward`` None / True / False;
- ``torch.compile(model)`` with dynamo's default top frame (the root's hooks run in a graph of
  their own) and with ``wrap_top_frame`` (one forward graph, one backward graph);
- one compiled function doing forward, loss and ``backward()`` (one graph for the whole step);
- FSDP x TP, the Llama model on 2x2;
- mixed precision on inductor against eager dtshard FSDP with the same policy.
"""

from __future__ import annotations

import copy

import pytest
import torch.nn.functional as F

import dtshard
from dtshard.fsdp import MixedPrecisionPolicy, fully_shard
from dtshard.testing import run_distributed
from test_fully_shard import N_BLOCKS, _batch, _dp_index, _full_params, _models, _shard

AG = "torch.ops._c10d_functional.all_gather_into_tensor.default"
RS = "torch.ops._c10d_functional.reduce_scatter_tensor.default"
AR = "torch.ops._c10d_functional.all_reduce.default"


def _recording_backend(graphs: list):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record, partition_fn=min_cut_rematerialization_partition)


def _counts(code: str) -> tuple[int, int, int]:
    return code.count(AG), code.count(RS), code.count(AR)


def _compiled_training(mesh_shape, raf, mode: str, steps: int = 3):
    """Train the FSDP MLP stack compiled (``mode``: "model", "wrap" = wrap_top_frame, "step" =
    forward + loss + backward in one compiled function) next to the one-process reference."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.config.wrap_top_frame = mode == "wrap"
    torch._dynamo.config.trace_autograd_ops = mode == "step"
    try:
        graphs: list = []
        backend = _recording_backend(graphs)
        mesh = dtshard.init_device_mesh("cpu", mesh_shape)
        model, ref = _models()
        _shard(model, mesh, reshard_after_forward=raf)
        if mode == "step":
            def step(x, y):
                loss = ((model(x) - y) ** 2).mean()
                loss.backward()
                return loss.detach()

            run = torch.compile(step, backend=backend, fullgraph=True)
        else:
            cmodel = torch.compile(model, backend=backend, fullgraph=True)

            def run(x, y):
                loss = ((cmodel(x) - y) ** 2).mean()
                loss.backward()
                return loss.detach()

        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        me, n = _dp_index(mesh)
        losses, grads_ok = [], True
        for s in range(steps):
            x, y = _batch(s, n)
            loss = run(x[4 * me:4 * me + 4], y[4 * me:4 * me + 4])
            grads_ok &= all(type(p.grad) is dtshard.DTensor and p.grad.placements == p.placements
                            and p.grad.to_local().shape == p.to_local().shape for p in model.parameters())
            opt.step()
            opt.zero_grad()
            rloss = ((ref(x) - y) ** 2).mean()
            rloss.backward()
            ropt.step()
            ropt.zero_grad()
            losses.append((loss.item(), rloss.item()))
        err = max((a - b.detach()).abs().max().item() for a, b in zip(_full_params(model), ref.parameters()))
        bound = any(k in m.__dict__ for m in model.modules() for k in ("weight", "bias"))
        return losses, err, [_counts(g) for g in graphs], sum(counters["graph_break"].values()), grads_ok, bound
    finally:
        torch._dynamo.config.wrap_top_frame = False
        torch._dynamo.config.trace_autograd_ops = False


def _check(res, mesh_shape, raf, mode):
    groups = N_BLOCKS + 1
    hsdp = len(mesh_shape) == 2
    regathered = {None: N_BLOCKS, True: groups, False: 0}[raf]
    if mode == "model" and raf is True:
        regathered -= 1  # the root's gather is in the hook's graph: its output is saved
    for losses, err, graphs, breaks, grads_ok, bound in res:
        assert breaks == 0, breaks
        assert grads_ok
        assert not bound, "full parameters left bound to the modules after the compiled forward"
        assert err < 1e-5, err
        if mode == "step":  # one graph for the whole step: forward and backward collectives in it
            assert graphs == [(groups, groups, groups if hsdp else 0)], graphs
            continue
        if mode == "model":
            # dynamo runs the root module's hooks outside its forward frame: the root's group is
            # gathered by a graph of its own, and (not resharded by default) saved for backward
            assert len(graphs) == 4, graphs  # root hook fwd, model fwd, model bwd, root hook bwd
            fwd = [graphs[0], graphs[1]]
            bwd = [graphs[2], graphs[3]]
        else:
            assert len(graphs) == 2, graphs  # one forward graph, one backward graph, no recompile
            fwd, bwd = [graphs[0]], [graphs[1]]
        assert sum(g[0] for g in fwd) == groups, graphs
        assert sum(g[1] + g[2] for g in fwd) == 0, graphs
        assert sum(g[0] for g in bwd) == regathered, graphs
        assert sum(g[1] for g in bwd) == groups, graphs
        assert sum(g[2] for g in bwd) == (groups if hsdp else 0), graphs


@pytest.mark.parametrize("raf", [None, True, False])
def test_compiled_fsdp_one_all_gather_and_one_reduce_scatter_per_group(raf):
    res = run_distributed(_compiled_training, 2, (2,), raf, "wrap", timeout=300)
    _check(res, (2,), raf, "wrap")


@pytest.mark.parametrize("mesh_shape,raf,mode", [((2,), None, "model"), ((2,), True, "model"),
                                                 ((2,), None, "step"), ((4,), None, "wrap"),
                                                 ((2, 2), None, "wrap"), ((2, 2), True, "step")])
def test_compiled_fsdp_modes_and_meshes(mesh_shape, raf, mode):
    import math

    res = run_distributed(_compiled_training, math.prod(mesh_shape), mesh_shape, raf, mode, timeout=300)
    _check(res, mesh_shape, raf, mode)


def _compiled_fsdp_tp(backend: str, mp: bool, steps: int = 3, n_layers: int = 2, forms=("model",)):
    """FSDP x TP (Llama, 2x2), compiled, next to eager dtshard FSDP x TP (mixed precision) or
    the one-process fp32 reference.  ``forms``: how each compiled model is compiled, "model"
    (``torch.compile(model)``) or "blocks" (each transformer block, as torchtitan's
    ``apply_compile`` does: the embedding, final norm and output stay eager); mixed precision
    takes one form."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import dtshard.parallel
    from dtshard.models import LlamaConfig, Transformer, parallelize

    torch._dynamo.reset()
    counters.clear()
    mesh = dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp, tp = mesh["dp"], mesh["tp"]
    cfg = LlamaConfig(n_layers=n_layers)
    torch.manual_seed(0)
    ref = Transformer(cfg)
    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}
    models = []
    # mixed precision: [compiled bf16, eager bf16, eager fp32]; the fp32 run is the yardstick of
    # what bf16 rounding alone explains.  fp32: one compiled model per form.
    assert not mp or len(forms) == 1, forms
    for k in range(3 if mp else len(forms)):
        m = parallelize(copy.deepcopy(ref), tp, dtshard.parallel, local_output=True)
        for layer in m.layers:
            fully_shard(layer, mesh=dp, **(kw if k < 2 else {}))
        fully_shard(m, mesh=dp, **(kw if k < 2 else {}))
        models.append(m)
    runs = list(models)  # what each step calls: the compiled forms, then the eager models
    for k, form in enumerate(forms):
        if form == "blocks":
            for layer in models[k].layers:  # (static: the hooks' code was compiled for other sizes)
                layer.compile(backend=backend, fullgraph=True, dynamic=False)
        else:
            runs[k] = torch.compile(models[k], backend=backend, fullgraph=True)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    me = dp.get_local_rank()
    g = torch.Generator().manual_seed(7)
    rows = []
    first_grads: dict = {}  # model index -> the first step's full gradients
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (4, 9), generator=g)
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        mine = slice(2 * me, 2 * me + 2)
        losses = []
        for k, (fn, opt) in enumerate(zip(runs, opts)):
            with dtshard.parallel.loss_parallel():
                loss = F.cross_entropy(fn(inputs[mine]).flatten(0, 1), labels[mine].flatten(0, 1))
                loss.backward()
            if mp and not rows:
                first_grads[k] = {n: p.grad.full_tensor() for n, p in models[k].named_parameters()}
            opt.step()
            opt.zero_grad()
            losses.append(loss.full_tensor().item())
        if not mp:
            rloss = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten(0, 1))
            rloss.backward()
            ropt.step()
            ropt.zero_grad()
            losses.append(rloss.item())
        rows.append(losses)
    if mp:  # AdamW's first steps move every weight by ~lr * sign(grad): compare the gradients
        def grad_err(a, b):  # the largest norm-relative difference over the parameters
            return max(((a[n] - b[n]).norm() / b[n].norm()).item() for n in b)

        fp32 = first_grads[2]
        # (compiled vs eager bf16, compiled vs fp32, eager bf16 vs fp32)
        err = (grad_err(first_grads[0], first_grads[1]), grad_err(first_grads[0], fp32),
               grad_err(first_grads[1], fp32))
    else:
        other = {n: p.detach() for n, p in ref.named_parameters()}
        err = {form: max(((p.full_tensor() - other[n]).abs().max() / other[n].abs().max()).item()
                         for n, p in m.named_parameters()) for form, m in zip(forms, models)}
    return rows, err, sum(counters["graph_break"].values())


def test_compiled_fsdp_times_tp_llama_2x2():
    """The whole model compiled, and each block compiled as torchtitan's ``apply_compile`` does
    (the embedding before the first block is eager: its output, the local tensor of a
    reduce-scatter still in flight, enters the compiled block; PyTorch 2.13's own DTensor gives
    that embedding a zero gradient, ``tools/repro_torch_compiled_tp_grad.py``), each trained 3
    AdamW steps next to one process: every parameter within 1e-4, losses within 1e-5."""
    forms = ("model", "blocks")
    res = run_distributed(_compiled_fsdp_tp, 4, "aot_eager", False, n_layers=1, forms=forms, timeout=300)
    for rank, (rows, err, breaks) in enumerate(res):
        assert breaks == 0, breaks
        assert max(err.values()) < 1e-4, err
        other = res[rank ^ 2][0]  # same tp coordinate, the other dp rank
        for step, (mine, theirs) in enumerate(zip(rows, other)):
            ref = mine[-1]
            for form, a, b in zip(forms, mine, theirs):
                # each dp rank's loss is the mean over its own sequences: their mean is the global loss
                assert abs((a + b) / 2 - ref) < 1e-5, (form, step, a, b, ref)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_fsdp_times_tp_mixed_precision(backend):
    """bf16 parameters, fp32 reduction: against eager dtshard FSDP x TP with the same policy,
    and both against eager fp32 FSDP x TP. aot_eager runs the same kernels: bit-identical.
    Inductor's fused kernels keep bf16 intermediates in fp32 registers, so they round
    differently; the bound is what bf16 explains: the compiled run may be no further from the
    fp32 run than eager bf16 is, give or take one bf16 rounding of the loss (its unit in the
    last place: the loss itself is a bf16 number) and 25% on the first-step gradients (measured:
    the compiled gradients 2.5% from fp32's, eager bf16's 2.4%; one loss a bf16 ulp off).
    PyTorch's compiled FSDP2 is not a second yardstick here because it cannot run this config
    correctly: compiling its whole FSDP x TP model fails (torchtitan#534), and compiling each
    block, as torchtitan does, gives the embedding a zero gradient (measured: err 1.0 on the
    first-step gradients; ``tools/repro_torch_compiled_tp_grad.py`` shows it in plain PyTorch).
    Eager PyTorch FSDP2 + DTensor with the same policy is compared in test_fsdp_tp.py."""
    import math

    def bf16_ulp(x):
        return 2.0 ** (math.floor(math.log2(abs(x))) - 7)

    for rank, (rows, err, breaks) in enumerate(
            run_distributed(_compiled_fsdp_tp, 4, backend, True, n_layers=1, timeout=600)):
        assert breaks == 0
        vs_eager, compiled_vs_fp32, eager_vs_fp32 = err
        for step, (compiled, eager, fp32) in enumerate(rows):
            if backend == "aot_eager":
                assert compiled == eager, (rank, step, rows)
            else:
                assert abs(compiled - fp32) <= abs(eager - fp32) + bf16_ulp(fp32), (rank, step, rows)
        if backend == "aot_eager":
            assert vs_eager == 0.0, (rank, err)
        else:
            assert compiled_vs_fp32 <= 1.25 * eager_vs_fp32, (rank, err)
