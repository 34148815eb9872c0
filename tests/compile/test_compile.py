"""torch.compile over dtshard tensors: the demo's tensor-parallel block, compiled two ways.

(a) the compiled model: forward compiled with fullgraph=True, backward through AOTAutograd;
(b) one compiled function doing forward, loss and backward() with fullgraph=True
    (needs torch._dynamo.config.trace_autograd_ops in 2.13, for plain tensors too).
Each is compared with eager dtshard for 5 SGD steps; graph breaks and recompilations counted.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from dtshard.testing import run_distributed


def _setup(seed=0):
    import dtshard
    from dtshard.demo import Block, Config, shard_block

    mesh = dtshard.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    cfg = Config()
    torch.manual_seed(seed)
    ref = Block(cfg)
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim)
    target = torch.randn(cfg.batch, cfg.seq, cfg.dim)
    eager = shard_block(copy.deepcopy(ref), mesh)
    compiled = shard_block(copy.deepcopy(ref), mesh)
    rep = [dtshard.Replicate()]
    dx = dtshard.distribute_tensor(x, mesh, rep)
    dt = dtshard.distribute_tensor(target, mesh, rep)
    return mesh, eager, compiled, dx, dt


def _max_param_diff(a, b) -> float:
    return max((p.full_tensor() - q.full_tensor()).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _compiled_model(backend: str, steps: int):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    mesh, eager, compiled, dx, dt = _setup()
    cnt = CompileCounterWithBackend(backend)
    cmodel = torch.compile(compiled, backend=cnt, fullgraph=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.1)
    losses = []
    for _ in range(steps):
        for model, opt in ((eager, opt_e), (cmodel, opt_c)):
            opt.zero_grad(set_to_none=True)
            loss = F.mse_loss(model(dx), dt)
            loss.backward()
            opt.step()
            losses.append(loss.full_tensor().item())
    return losses, cnt.frame_count, sum(counters["graph_break"].values()), _max_param_diff(eager, compiled)


def test_compiled_model_matches_eager():
    """aot_eager: the same local ops as eager, so the tolerance is float32 summation order. Inductor
    on tensor-parallel models is tested where it adds something (tests/README.md, "Where the
    time goes"): FSDP x TP with bf16 parameters (fsdp/test_fsdp_compile.py) and the spatially
    sharded UNet's halo ops (compile/test_compile_models.py); an inductor run of this block cost
    ~40 s of the suite and checked nothing those two do not."""
    for losses, frames, breaks, wdiff in run_distributed(_compiled_model, 2, "aot_eager", 5, timeout=600):
        eager, comp = losses[0::2], losses[1::2]
        torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-6)
        assert breaks == 0, f"{breaks} graph breaks"
        assert frames == 1, f"{frames} frames compiled: recompiled after the first step"
        assert wdiff < 1e-5


def _compiled_step(steps: int):
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch._dynamo.config.trace_autograd_ops = True
    mesh, eager, compiled, dx, dt = _setup()
    cnt = CompileCounterWithBackend("aot_eager")

    def step(model, x, t):
        loss = F.mse_loss(model(x), t)
        loss.backward()
        return loss.detach()

    cstep = torch.compile(step, backend=cnt, fullgraph=True)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    opt_c = torch.optim.SGD(compiled.parameters(), lr=0.1)
    # the optimizer step compiles too, without fullgraph (torch.optim breaks graphs on purpose)
    opt_step = torch.compile(opt_c.step, backend="aot_eager")
    losses = []
    step_breaks = 0  # breaks inside the fullgraph step only (the optimizer may break on purpose)
    for _ in range(steps):
        # grads are zeroed, not freed, so the compiled step sees the same guards every time
        opt_e.zero_grad(set_to_none=False)
        le = step(eager, dx, dt)
        opt_e.step()
        opt_c.zero_grad(set_to_none=False)
        before = sum(counters["graph_break"].values())
        lc = cstep(compiled, dx, dt)
        step_breaks += sum(counters["graph_break"].values()) - before
        opt_step()
        losses.append((le.full_tensor().item(), lc.full_tensor().item()))
    torch._dynamo.config.trace_autograd_ops = False
    return losses, cnt.frame_count, step_breaks, _max_param_diff(eager, compiled)


def test_compiled_forward_loss_backward_step():
    for losses, frames, breaks, wdiff in run_distributed(_compiled_step, 2, 5, timeout=600):
        eager = [a for a, _ in losses]
        comp = [b for _, b in losses]
        torch.testing.assert_close(comp, eager, rtol=1e-5, atol=1e-6)
        assert breaks == 0, f"{breaks} graph breaks in the fullgraph step"
        # one frame for the step; the first call sees grads=None, later ones real grads
        assert frames <= 2, f"{frames} frames compiled"
        assert wdiff < 1e-5


def _graph_ops():
    """Capture the graphs AOTAutograd produces: collectives must be functional collectives."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    import dtshard
    from dtshard import Replicate, Shard

    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    backend = aot_autograd(fw_compiler=record, bw_compiler=record)
    mesh = dtshard.init_device_mesh("cpu", (2,))
    w1 = dtshard.distribute_tensor(torch.randn(16, 8), mesh, [Shard(0)]).requires_grad_()
    w2 = dtshard.distribute_tensor(torch.randn(8, 16), mesh, [Shard(1)]).requires_grad_()

    def f(x_local, w1, w2):
        x = dtshard.DTensor.from_local(x_local, mesh, [Replicate()])
        y = F.linear(F.relu(F.linear(x, w1)), w2)  # Partial(sum)
        return y.full_tensor().sum()

    out = torch.compile(f, backend=backend, fullgraph=True)(torch.randn(4, 8), w1, w2)
    out.backward()
    return graphs


def test_collectives_are_functional_collectives_in_the_graph():
    for rank, graphs in enumerate(run_distributed(_graph_ops, 2, timeout=600)):
        forward = graphs[0]
        assert "_c10d_functional.all_reduce" in forward and "_c10d_functional.wait_tensor" in forward, (
            f"rank {rank}: {forward}")


def _no_recompile_on_new_values():
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    import dtshard
    from dtshard import Shard

    torch._dynamo.reset()
    mesh = dtshard.init_device_mesh("cpu", (2,))
    cnt = CompileCounterWithBackend("aot_eager")
    f = torch.compile(lambda a, b: (a * b).sum(), backend=cnt, fullgraph=True)
    results = []
    for seed in range(4):
        torch.manual_seed(seed)
        a = dtshard.distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
        b = dtshard.distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)])
        got = f(a, b).full_tensor()
        results.append(torch.allclose(got, (a.full_tensor() * b.full_tensor()).sum()))
    return all(results), cnt.frame_count


def test_changing_values_never_recompiles():
    for ok, frames in run_distributed(_no_recompile_on_new_values, 2, timeout=300):
        assert ok and frames == 1


def _conv_graph():
    """A spatially sharded conv step compiles fullgraph; the halo exchange is a custom op node."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    import dtshard
    from dtshard import Replicate, Shard
    from dtshard.spatial.halo import mesh_id

    torch._dynamo.reset()
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    mesh = dtshard.init_device_mesh("cpu", (2,))
    mesh_id(mesh)  # register the mesh outside the traced code (see dtshard/spatial/halo.py)
    torch.manual_seed(0)
    x, w = torch.randn(2, 3, 9, 6), torch.randn(4, 3, 3, 3)
    xd = dtshard.distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
    wd = dtshard.distribute_tensor(w, mesh, [Replicate()]).requires_grad_()

    def step(x, w):
        return F.conv2d(x, w, padding=1).relu().sum()

    out = torch.compile(step, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)(xd, wd)
    out.backward()
    ref_x, ref_w = x.clone().requires_grad_(), w.clone().requires_grad_()
    step(ref_x, ref_w).backward()
    ok = (torch.allclose(out.full_tensor(), step(x, w), atol=1e-4)
          and torch.allclose(xd.grad.full_tensor(), ref_x.grad, atol=1e-4)
          and torch.allclose(wd.grad.full_tensor(), ref_w.grad, atol=1e-4))
    return ok, graphs


def test_spatial_conv_compiles_with_the_halo_exchange_as_a_custom_op():
    for rank, (ok, graphs) in enumerate(run_distributed(_conv_graph, 2, timeout=600)):
        assert ok, f"rank {rank}: compiled values or gradients differ from eager"
        assert "dtshard.halo_exchange" in graphs[0], f"rank {rank}: {graphs[0]}"
        assert "dtshard.halo_accumulate" in graphs[1] or "dtshard.halo_exchange" in graphs[1], (
            f"rank {rank}: {graphs[1]}")


def _resampling_ops():
    """Interpolation and padding over H-sharded images compile fullgraph and match eager: under
    compile PyTorch decomposes the upsample ops above __torch_dispatch__ unless dtshard routes
    DTensors to the C++ kernels, and the gather maps must become graph constants
    (dtshard/spatial/upsample.py)."""
    import torch._dynamo

    import dtshard
    from dtshard import Replicate, Shard
    from dtshard.spatial.halo import mesh_id

    mesh = dtshard.init_device_mesh("cpu", (2,))
    mesh_id(mesh)
    g = torch.Generator().manual_seed(0)
    x, b = torch.randn(2, 3, 9, 6, generator=g), torch.randn(3, generator=g)
    cases = {
        "nearest x2": lambda t: F.interpolate(t, scale_factor=2, mode="nearest"),
        "nearest to size": lambda t: F.interpolate(t, size=(13, 5), mode="nearest"),
        "nearest-exact": lambda t: F.interpolate(t, size=(11, 7), mode="nearest-exact"),
        "bilinear": lambda t: F.interpolate(t, size=(11, 9), mode="bilinear"),
        "bilinear align_corners": lambda t: F.interpolate(t, scale_factor=1.5, mode="bilinear", align_corners=True),
        "reflect pad": lambda t: F.pad(t, (1, 2, 2, 1), mode="reflect"),
        "replicate pad": lambda t: F.pad(t, (1, 2, 3, 1), mode="replicate"),
    }
    bad = {}
    for name, op in cases.items():
        torch._dynamo.reset()

        def f(t, bias):
            return (op(t) * bias.view(1, 3, 1, 1)).square().mean()

        xd = dtshard.distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
        bd = dtshard.distribute_tensor(b, mesh, [Replicate()]).requires_grad_()
        got = torch.compile(f, backend="aot_eager", fullgraph=True)(xd, bd)
        got.backward()
        xr, br = x.clone().requires_grad_(), b.clone().requires_grad_()
        want = f(xr, br)
        want.backward()
        for what, a, r in (("out", got, want), ("grad x", xd.grad, xr.grad), ("grad bias", bd.grad, br.grad)):
            if not torch.allclose(a.full_tensor(), r.detach(), rtol=1e-5, atol=1e-6):
                bad[f"{name}: {what}"] = (a.full_tensor() - r).abs().max().item()
    return bad


def test_interpolation_and_padding_compile_on_spatial_shards():
    for bad in run_distributed(_resampling_ops, 2, timeout=600):
        assert bad == {}, bad


def test_import_after_torch_dynamo():
    """``import torch._dynamo`` BEFORE ``import dtshard`` (what any script that sets up compilation
    first does): dtshard imports and registers its Dynamo hooks (here: the prims.fma rule)."""
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    code = ("import torch, torch._dynamo, dtshard, dtshard.registry; "
            "assert dtshard.__file__.startswith(%r), dtshard.__file__; "
            "assert dtshard.registry.get_entry(torch.ops.prims.fma.default) is not None; print('ok')" % root)
    p = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
