"""``config.halo_overlap`` (and ``halo_overlap_forward``): a spatially sharded convolution
computes the output rows that need no halo while its halo exchange is in flight, then the
boundary rows from the window; its backward computes the input gradient while the input window
for the weight gradient travels.

Checked in float64 on 2, 3 and 4 ranks (uneven shards, strided, dilated, even kernels, a local
extent barely above the stencil): the output equals the same op in one process and the
non-overlapped path, the split was really taken (the cached plan has it); in backward the input
window for the weight gradient travels while the input gradient is computed, and both gradients
equal one process's.  Under torch.compile the graphs place the all_to_all's wait after that
compute.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dtshard.testing import run_distributed

CASES = [  # (H, kernel, stride, padding, dilation)
    (24, 3, 1, 1, 1),
    (23, 5, 2, 2, 1),
    (26, 3, 1, 2, 2),
    (20, 4, 1, 1, 1),
    (30, 7, 1, 3, 1),
]


def _run(cases):
    import dtshard
    from dtshard import Replicate, Shard
    from dtshard.propagate import config
    from dtshard.rules import conv as conv_rules

    n = torch.distributed.get_world_size()
    mesh = dtshard.init_device_mesh("cpu", (n,))
    out = []
    for h, k, s, p, d in cases:
        g = torch.Generator().manual_seed(h * 31 + k)
        x = torch.randn(2, 3, h, 9, generator=g, dtype=torch.float64)
        w = torch.randn(4, 3, k, 3, generator=g, dtype=torch.float64)
        b = torch.randn(4, generator=g, dtype=torch.float64)
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        ref = F.conv2d(xr, wr, b, stride=(s, 1), padding=(p, 1), dilation=(d, 1))
        ref.sum().backward()
        dx = dtshard.distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
        dw = dtshard.distribute_tensor(w, mesh, [Replicate()]).requires_grad_()
        db = dtshard.distribute_tensor(b, mesh, [Replicate()])
        res = {}
        saved = (config.halo_overlap, config.halo_overlap_forward)
        for on in (False, True):
            config.halo_overlap = config.halo_overlap_forward = on
            try:
                conv_rules._conv_plans_cache.clear()
                y = F.conv2d(dx, dw, db, stride=(s, 1), padding=(p, 1), dilation=(d, 1))
                split = any(pl.overlap is not None for pl in conv_rules._conv_plans_cache.values())
                y.sum().backward()
                res[on] = (y.full_tensor(), dx.grad.full_tensor(), split, dw.grad.full_tensor())
                dx.grad = dw.grad = None
            finally:
                config.halo_overlap, config.halo_overlap_forward = saved
        split_any = [None] * n
        torch.distributed.all_gather_object(split_any, res[True][2])
        out.append(((res[True][0] - ref).abs().max().item(), (res[True][0] - res[False][0]).abs().max().item(),
                    max((res[True][1] - xr.grad).abs().max().item(), (res[True][3] - wr.grad).abs().max().item(),
                        (res[True][1] - res[False][1]).abs().max().item()),
                    any(split_any), y.placements))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_overlapped_convolution_is_exact(world):
    for rank_rows in run_distributed(_run, world, CASES, timeout=300):
        for (h, k, s, p, d), (err_ref, err_plain, err_grad, split, placements) in zip(CASES, rank_rows):
            assert err_ref < 1e-12 and err_plain < 1e-12 and err_grad < 1e-12, (h, k, s, p, d, err_ref, err_plain)
            assert str(placements) == "(Shard(dim=2),)"
        # the split is taken where the local extent allows it (at least one case on every mesh)
        assert any(row[3] for row in rank_rows), rank_rows


def _compiled(_=None):
    """The same H-sharded conv2d compiled (fullgraph, AOTAutograd, graphs recorded) with the
    overlap in forward and backward: each graph's order of all_to_all, compute and wait, and the
    values against the eager op."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    import dtshard
    from dtshard import Replicate, Shard
    from dtshard.propagate import config

    graphs: list = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    mesh = dtshard.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 24, 9, generator=g, dtype=torch.float64)
    w = torch.randn(4, 3, 3, 3, generator=g, dtype=torch.float64)
    res = {}
    saved = (config.halo_overlap, config.halo_overlap_forward, config.halo_overlap_compiled)
    config.halo_overlap = config.halo_overlap_forward = config.halo_overlap_compiled = True
    depth = dtshard.spatial.halo_depth(1)  # one layer: the per-layer exchange is what overlaps
    try:
        for compiled in (False, True):
            dx = dtshard.distribute_tensor(x, mesh, [Shard(2)]).requires_grad_()
            dw = dtshard.distribute_tensor(w, mesh, [Replicate()]).requires_grad_()

            def f(a, b):
                return F.conv2d(a, b, padding=1)

            if compiled:
                f = torch.compile(f, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
            y = f(dx, dw)
            y.sum().backward()
            res[compiled] = (y.full_tensor(), dx.grad.full_tensor(), dw.grad.full_tensor())
    finally:
        config.halo_overlap, config.halo_overlap_forward, config.halo_overlap_compiled = saved
        depth.__exit__()
    err = max((a - b).abs().max().item() for a, b in zip(res[False], res[True]))
    keep = ("all_to_all", "wait_tensor", "convolution")
    seqs = [[line.split("torch.ops.")[1].split("(")[0] for line in code.splitlines()
             if "torch.ops." in line and any(k in line for k in keep)] for code in graphs]
    return err, seqs


def test_compiled_overlap_waits_after_the_interior():
    """With ``config.halo_overlap_compiled`` (off by default: it does not pay on CPU), under
    torch.compile the exchange is an async functional all_to_all whose wait the graph
    has AFTER the compute that needs no halo: forward, the interior rows' convolution; backward,
    the input gradient's convolution_backward (while the input window for the weight gradient
    travels).  Values equal the eager op's."""
    a2a, wait = "_c10d_functional.all_to_all_single.default", "_c10d_functional.wait_tensor.default"
    conv, conv_bw = "aten.convolution.default", "aten.convolution_backward.default"
    for err, seqs in run_distributed(_compiled, 2, timeout=300):
        assert err < 1e-12, err
        assert len(seqs) == 2, seqs  # one forward graph, one backward graph
        fwd, bwd = seqs
        assert fwd[:3] == [a2a, conv, wait] and fwd.count(conv) >= 2, fwd
        assert bwd[:3] == [a2a, conv_bw, wait] and bwd.count(conv_bw) == 2, bwd
