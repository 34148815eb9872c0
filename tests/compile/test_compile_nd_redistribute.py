"""Flattened-group redistribute steps under torch.compile(fullgraph=True): an exchange (all_to_all
with split sizes), one all_reduce over all Partial dims, a reduce_scatter and a reduce, forward and
backward, equal to eager on every rank of a 2x2 mesh.  The flattened process group may be
created while Dynamo traces (its rank table is read outside the fake mode)."""

from __future__ import annotations

import torch

import dtshard
from dtshard import Partial, Replicate, Shard
from dtshard.testing import run_distributed


def _compiled_transitions():
    torch._dynamo.reset()
    mesh = dtshard.init_device_mesh("cpu", (2, 2))
    torch.manual_seed(0)
    x = torch.randn(8, 6)
    problems = []
    cases = [((Shard(0), Shard(1)), (Shard(1), Shard(0))), ((Partial(), Partial()), (Replicate(), Replicate())),
             ((Replicate(), Shard(0)), (Shard(0), Shard(0))), ((Partial(), Shard(0)), (Shard(0), Shard(0))),
             # one rank keeps the whole result: a reduce into it (an all_reduce when traced)
             ((Partial(), Partial()), (Shard(1), Shard(1)), torch.randn(2, 1))]
    for src, dst, *given in cases:
        value = given[0] if given else x
        terms = [Partial() if isinstance(p, Partial) else Replicate() for p in src]
        coord = mesh.get_coordinate()
        keep = all(coord[i] == 0 for i, p in enumerate(src) if isinstance(p, Partial))
        d = dtshard.DTensor.from_local(value if keep else torch.zeros_like(value), mesh, terms).redistribute(mesh, src)
        d = d.detach().requires_grad_()

        def fn(t, dst=dst):
            return (t.redistribute(mesh, dst) * 2).to_local().sum()

        compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
        with dtshard.debug.CommCounter() as comm:
            got = compiled(d)
        got.backward()
        g_compiled = d.grad.full_tensor().clone()
        d.grad = None
        want = fn(d)
        want.backward()
        if not torch.allclose(got, want):
            problems.append(f"{src} -> {dst}: compiled {float(got)} vs eager {float(want)}")
        if not torch.allclose(g_compiled, d.grad.full_tensor()):
            problems.append(f"{src} -> {dst}: gradients differ")
        if any(isinstance(r.mesh_dim, tuple) for r in comm.records) is False and src[0] != Replicate():
            problems.append(f"{src} -> {dst}: no flattened-group collective ran ({comm.summary()})")
    return problems


def test_flattened_group_steps_compile_fullgraph():
    for rank, problems in enumerate(run_distributed(_compiled_transitions, 4)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def _sub_mesh_output_gradient():
    """A compiled region returns a DTensor on a sub-mesh (a tensor-parallel weight on ``tp``, as
    FSDP's gathered parameters are when its hooks compile as a graph of their own); eager code
    uses it with activations on the whole ``(dp, tp)`` mesh (``implicit_replication()``), so its
    gradient arrives on the larger mesh, a Partial over ``dp``. The compiled backward was traced
    for the sub-mesh layout: the gradient's ``dp`` terms are summed and it continues on ``tp``.
    Values and the weight's gradient against one process."""
    torch._dynamo.reset()
    mesh = dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    g = torch.Generator().manual_seed(3)
    W, X = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(4, 5, generator=g, dtype=torch.float64)
    w = dtshard.distribute_tensor(W, mesh["tp"], [Shard(0)]).requires_grad_()
    x = dtshard.distribute_tensor(X, mesh, [Shard(0), Replicate()])
    scaled = torch.compile(lambda t: t * 3, backend="aot_eager", fullgraph=True)(w)
    with dtshard.experimental.implicit_replication():
        loss = (torch.tanh(x @ scaled.t()) ** 2).sum()
    loss.backward()
    w_ref = W.clone().requires_grad_()
    (torch.tanh(X @ (w_ref * 3).t()) ** 2).sum().backward()
    return (float((loss.full_tensor() - (torch.tanh(X @ (W * 3).t()) ** 2).sum()).abs()),
            str(w.grad.placements), tuple(w.grad.device_mesh.shape),
            float((w.grad.full_tensor() - w_ref.grad).abs().max()))


def test_compiled_sub_mesh_output_takes_a_gradient_from_the_larger_mesh():
    for rank, (loss_err, placements, mesh_shape, grad_err) in enumerate(run_distributed(_sub_mesh_output_gradient, 4)):
        assert loss_err < 1e-12 and grad_err < 1e-12, (rank, loss_err, grad_err)
        assert placements == "(Shard(dim=0),)" and mesh_shape == (2,), (rank, placements, mesh_shape)


def _spatial_empty_shards_compiled():
    """Spatially sharded ops where one rank holds no rows (3 rows over 4 ranks), compiled with a
    plain AOTAutograd backend, whose default partitioner keeps only what the outputs need: the
    empty rank skips its kernels, and its zeros must still depend on the halo windows and
    gradients that collectives brought it (collectives.consumed), or that rank's graph loses
    those collectives and the ranks deadlock. Values and gradients against eager."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    mesh = dtshard.init_device_mesh("cpu", (4,))
    g = torch.Generator().manual_seed(5)
    X = torch.randn(1, 2, 3, 6, generator=g, dtype=torch.float64)
    W1, W2 = (torch.randn(2, 2, 3, 3, generator=g, dtype=torch.float64) for _ in range(2))

    def fn(x, w1, w2):
        h = torch.nn.functional.conv2d(x, w1, padding=1).relu()
        h = torch.nn.functional.max_pool2d(h, 3, stride=1, padding=1)
        h = torch.nn.functional.avg_pool2d(h, 3, stride=1, padding=1)
        return torch.nn.functional.conv_transpose2d(h, w2, padding=1).square().sum()

    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward))
    compiled = torch.compile(fn, backend=backend, fullgraph=True)
    results = []
    for f in (compiled, fn):
        x = dtshard.distribute_tensor(X, mesh, [Shard(2)]).requires_grad_()
        w1, w2 = (dtshard.distribute_tensor(w, mesh, [Replicate()]).requires_grad_() for w in (W1, W2))
        loss = f(x, w1, w2)
        loss.backward()
        results.append([loss.full_tensor(), x.grad.full_tensor(), w1.grad.full_tensor(), w2.grad.full_tensor()])
    return [float((a - b).abs().max()) for a, b in zip(*results)], x.to_local().shape[2]


def test_compiled_spatial_ops_with_an_empty_shard_keep_their_collectives():
    out = run_distributed(_spatial_empty_shards_compiled, 4)
    assert [rows for _, rows in out] == [1, 1, 1, 0], out  # the last rank holds no rows
    for rank, (errs, _) in enumerate(out):
        assert max(errs) < 1e-12, (rank, errs)
