"""``dtshard.experimental.local_map``: PyTorch's own ``local_map`` usage patterns (the row-wise
matmul with a Partial output, the decorator with placement checks and redistribution, non-tensor
inputs and outputs, gradient placements), run on dtshard and on PyTorch's DTensor side by side and
against one process, forward and backward; uneven shards (where PyTorch's assumes even ones) and
``torch.compile``.  2 ranks, one ``run_distributed`` call.
"""
from __future__ import annotations

import torch
import torch._dynamo
import torch.distributed as dist

from dtshard.testing import run_distributed


def _patterns(lib: str):
    """The same user code on either library; returns full values and gradients."""
    if lib == "ours":
        import dtshard as dt
        from dtshard.experimental import local_map
    else:
        import torch.distributed.tensor as dt
        from torch.distributed.tensor.experimental import local_map
    from torch.distributed.device_mesh import init_device_mesh

    from torch.distributed.tensor import Partial, Replicate, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    W = torch.randn(6, 8, generator=g, dtype=torch.float64)
    X = torch.randn(8, 4, generator=g, dtype=torch.float64)
    out = {}
    # 1. row-wise matmul: W col-sharded, X row-sharded, the local product is a Partial sum
    mm = local_map(torch.mm, out_placements=[Partial()], in_placements=([Shard(1)], [Shard(0)]), device_mesh=mesh)
    w = dt.distribute_tensor(W, mesh, [Shard(1)]).requires_grad_()
    x = dt.distribute_tensor(X, mesh, [Shard(0)]).requires_grad_()
    y = mm(w, x)
    y.full_tensor().pow(2).sum().backward()
    out["mm"] = (y.full_tensor(), str(y.placements), w.grad.full_tensor(), x.grad.full_tensor(), str(w.grad.placements))

    # 2. decorator form: a mismatched placement raises, redistribute_inputs redistributes
    @local_map(out_placements=[Shard(0)], in_placements=([Shard(0)], None))
    def scale(t, k):
        return t * k

    xr = dt.distribute_tensor(X, mesh, [Replicate()])
    try:
        scale(xr, 2.0)
        out["mismatch"] = "no error"
    except ValueError:
        out["mismatch"] = "ValueError"
    redist = local_map(lambda t, k: t * k, out_placements=[Shard(0)], in_placements=([Shard(0)], None),
                       redistribute_inputs=True)(xr, 2.0)
    out["redistribute"] = (redist.full_tensor(), str(redist.placements))

    # 3. non-tensor outputs (None placements) and several outputs
    both = local_map(lambda t: (t.sum(0), t.shape[0]), out_placements=([Partial()], None))(
        dt.distribute_tensor(X, mesh, [Shard(0)]))
    out["multi"] = (both[0].full_tensor(), both[1])

    # 4. gradient placements: a replicated weight used on row shards gets a Partial gradient
    b = dt.distribute_tensor(torch.randn(4, generator=g, dtype=torch.float64), mesh, [Replicate()]).requires_grad_()
    xs = dt.distribute_tensor(X, mesh, [Shard(0)]).requires_grad_()
    addb = local_map(lambda t, v: t + v, out_placements=[Shard(0)], in_placements=([Shard(0)], [Replicate()]),
                     in_grad_placements=([Shard(0)], [Partial()]))
    z = addb(xs, b)
    z.full_tensor().pow(3).sum().backward()
    out["grad_placements"] = (z.full_tensor(), b.grad.full_tensor(), xs.grad.full_tensor())

    # 5. no DTensor argument: func's output comes back as it is
    out["plain"] = type(mm(W, X)).__name__
    return out


def _reference():
    g = torch.Generator().manual_seed(0)
    W = torch.randn(6, 8, generator=g, dtype=torch.float64, requires_grad=True)
    X = torch.randn(8, 4, generator=g, dtype=torch.float64, requires_grad=True)
    y = W @ X
    y.pow(2).sum().backward()
    ref = {"mm": (y.detach(), W.grad, X.grad)}
    b = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    x2 = X.detach().clone().requires_grad_()
    z = x2 + b
    z.pow(3).sum().backward()
    ref["grad_placements"] = (z.detach(), b.grad, x2.grad)
    ref["X"] = X.detach()
    return ref


def _uneven_and_compiled():
    import dtshard
    from dtshard.experimental import local_map
    from torch.distributed.tensor import Shard

    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    full = torch.arange(7 * 3, dtype=torch.float64).reshape(7, 3)
    x = dtshard.distribute_tensor(full, mesh, [Shard(0)])  # 4 + 3 rows
    out = {}
    y = local_map(lambda t: t * 2 + 1, out_placements=[Shard(0)])(x)
    s = local_map(lambda t: t.sum(1, keepdim=True), out_placements=[Shard(0)])(x)
    out["uneven"] = (tuple(y.shape), y.full_tensor(), tuple(s.shape), s.full_tensor())
    # shards that no torch.chunk layout has: a clear error on every rank
    bad = local_map(lambda t: t[:1] if dist.get_rank() == 0 else torch.cat([t, t]), out_placements=[Shard(0)])
    try:
        bad(x)
        out["bad"] = "no error"
    except ValueError as e:
        out["bad"] = str(e)
    # compiled (fullgraph): even and uneven inputs, forward and backward, against eager
    torch._dynamo.reset()
    f = local_map(lambda t, w: torch.tanh(t @ w), out_placements=[Shard(0)])
    wfull = torch.randn(3, 5, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    rows = []
    for n in (8, 7):
        xf = torch.randn(n, 3, generator=torch.Generator().manual_seed(n), dtype=torch.float64)
        res = []
        for compiled in (False, True):
            xd = dtshard.distribute_tensor(xf, mesh, [Shard(0)]).requires_grad_()

            def step(xd):
                return f(xd, wfull)

            fn = torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step
            yd = fn(xd)
            yd.full_tensor().sum().backward()
            res.append((tuple(yd.shape), yd.full_tensor(), xd.grad.full_tensor()))
        xr = xf.clone().requires_grad_()
        torch.tanh(xr @ wfull).sum().backward()
        rows.append((n, res, (torch.tanh(xf @ wfull), xr.grad)))
    out["compiled"] = rows
    return out


def _all():
    return {"ours": _patterns("ours"), "theirs": _patterns("theirs"), "ref": _reference(),
            "uneven": _uneven_and_compiled()}


def test_local_map_patterns_uneven_and_compiled():
    tol = 1e-12
    for rank, r in enumerate(run_distributed(_all, 2, timeout=300)):
        ours, theirs, ref = r["ours"], r["theirs"], r["ref"]
        y, pl, gw, gx, gpl = ours["mm"]
        assert pl == "(Partial(sum),)" and gpl == "(Shard(dim=1),)", (pl, gpl)
        for a, b in zip((y, gw, gx), ref["mm"]):
            assert (a - b).abs().max() < tol
        for a, b in zip(ours["mm"][:4:2], theirs["mm"][:4:2]):
            assert (a - b).abs().max() < tol
        assert ours["mismatch"] == theirs["mismatch"] == "ValueError"
        assert torch.equal(ours["redistribute"][0], 2 * ref["X"]) and ours["redistribute"][1] == "(Shard(dim=0),)"
        assert torch.allclose(ours["multi"][0], ref["X"].sum(0), atol=tol) and ours["multi"][1] == theirs["multi"][1] == 4
        for a, b, c in zip(ours["grad_placements"], theirs["grad_placements"], ref["grad_placements"]):
            assert (a - c).abs().max() < tol and (b - c).abs().max() < tol
        assert ours["plain"] == theirs["plain"] == "Tensor"

        u = r["uneven"]
        shape, y, sshape, s = u["uneven"]
        full = torch.arange(21, dtype=torch.float64).reshape(7, 3)
        assert shape == (7, 3) and torch.equal(y, full * 2 + 1), (shape, y)
        assert sshape == (7, 1) and torch.equal(s, full.sum(1, keepdim=True))
        assert "local shape" in u["bad"] and "torch.chunk" in u["bad"], u["bad"]
        for n, ((eshape, ey, eg), (cshape, cy, cg)), (want_y, want_g) in u["compiled"]:
            assert eshape == cshape == (n, 5), (n, eshape, cshape)
            assert (ey - want_y).abs().max() < tol and (cy - want_y).abs().max() < tol, n
            assert (eg - want_g).abs().max() < tol and (cg - want_g).abs().max() < tol, n
