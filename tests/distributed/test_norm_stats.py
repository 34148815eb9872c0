"""Norm statistics over sharded dims in ONE collective per direction (issue #31, item 1).

Batch norm (training, with running statistics), instance norm (``F.instance_norm``: batch norm
over (1, N*C, ...)) and group norm on activations sharded on the batch and spatial dims, against
one process, on every rank:

- float64: the output, the input / weight / bias gradients and the running statistics equal
  PyTorch's to ~1e-12 relative, with uneven shards (H = 7 over 3 ranks: 3, 3, 1), empty shards
  (H = 2 over 4 ranks: 1, 1, 0, 0) and two sharded mesh dims (2x2: H x W, batch x H);
- float32 with a large mean (1e4 + N(0, 1)): within float32 tolerance of the float64 truth (a
  one-collective (sum, sum of squares) scheme loses every digit of the variance here);
- traffic: forward exactly one collective, the all_gather of each rank's (mean, M2) per
  statistic (its bytes are statistics, never the activation); backward exactly one all_reduce
  attributed to the norm's backward op (the stacked sums); nothing when no reduced dim is sharded
  (batch shards of group and instance norm; channel shards of batch norm, whose updated running
  statistics are gathered in one all_gather);
- compiled (``torch.compile(fullgraph=True)``, aot_eager): the same values and gradients, one
  all_gather per norm in the forward graph and none backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtshard
from dtshard import Replicate
from dtshard.debug import CommCounter
from dtshard.testing import run_distributed

from _cases import Ps, mesh

_FWD_OPS = ("aten.native_batch_norm.default", "aten._native_batch_norm_legit.default",
            "aten._native_batch_norm_legit.no_stats", "aten._batch_norm_with_update.default",
            "aten.native_group_norm.default")
_BWD_OPS = ("aten.native_batch_norm_backward.default", "aten.batch_norm_backward.default",
            "aten.native_group_norm_backward.default")


def _fn(kind: str, groups: int):
    if kind == "bn":
        return lambda t, w, b, rm, rv: F.batch_norm(t, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
    if kind == "in":
        return lambda t, w, b, rm, rv: F.instance_norm(t, weight=w, bias=b, use_input_stats=True, eps=1e-5)
    return lambda t, w, b, rm, rv: F.group_norm(t, groups, w, b, eps=1e-5)


def _n_stats(kind: str, shape, groups: int) -> int:
    return {"bn": shape[1], "in": shape[0] * shape[1], "gn": shape[0] * groups}[kind]


def _check(cfg, m) -> list[str]:
    kind, shape, x_place = cfg["kind"], cfg["shape"], cfg["x"]
    groups, dtype, offset = cfg.get("groups", 2), cfg.get("dtype", torch.float64), cfg.get("offset", 1.0)
    name = f"{kind} {shape} {x_place} {dtype}"
    g = torch.Generator().manual_seed(7)
    c = shape[1]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * cfg.get("scale", 3.0) + offset)
    w, b = 1 + torch.randn(c, generator=g, dtype=torch.float64) * 0.3, torch.randn(c, generator=g, dtype=torch.float64)
    gy = torch.randn(shape, generator=g, dtype=torch.float64)
    fn = _fn(kind, groups)

    def reference(dt):
        xr, wr, br = (t.to(dt).clone().requires_grad_() for t in (x, w, b))
        rm, rv = torch.zeros(c, dtype=dt), torch.ones(c, dtype=dt)
        y = fn(xr, wr, br, rm, rv)
        (y * gy.to(dt)).sum().backward()
        return [y.detach(), xr.grad, wr.grad, br.grad] + ([rm, rv] if kind == "bn" else [])

    truth = reference(torch.float64)
    rep = [Replicate()] * m.ndim
    xd = dtshard.distribute_tensor(x.to(dtype), m, Ps(x_place)).requires_grad_()
    wd, bd = (dtshard.distribute_tensor(t.to(dtype), m, rep).requires_grad_() for t in (w, b))
    rmd = dtshard.distribute_tensor(torch.zeros(c, dtype=dtype), m, rep)
    rvd = dtshard.distribute_tensor(torch.ones(c, dtype=dtype), m, rep)
    with CommCounter() as fwd:
        y = fn(xd, wd, bd, rmd, rvd)
    with CommCounter() as bwd:
        y.backward(dtshard.distribute_tensor(gy.to(dtype), m, y.placements))
    got = [y.full_tensor(), xd.grad.full_tensor(), wd.grad.full_tensor(), bd.grad.full_tensor()]
    got += [rmd.full_tensor(), rvd.full_tensor()] if kind == "bn" else []
    failures = []
    names = ["out", "grad_x", "grad_w", "grad_b", "running_mean", "running_var"]
    if dtype == torch.float64:
        for k, (a, r) in enumerate(zip(got, truth)):
            err = float((a.detach() - r).abs().max() / r.abs().max().clamp_min(1e-30))
            if not err <= 1e-12:
                failures.append(f"{name} {names[k]}: relative error {err:.2e}")
    else:  # float32: as close to the float64 truth as float32 PyTorch in one process, within 8x + 1e-5
        ref32 = reference(torch.float32)
        for k, (a, r32, r) in enumerate(zip(got, ref32, truth)):
            scale = r.abs().max().clamp_min(1e-30)
            err, err_torch = float((a.detach().double() - r).abs().max() / scale), float((r32.double() - r).abs().max() / scale)
            if not err <= 8 * err_torch + 1e-5:
                failures.append(f"{name} {names[k]}: relative error {err:.2e} (one process float32: {err_torch:.2e})")
    # traffic: one collective per direction, of statistics only
    reduced = cfg.get("reduced", True)
    elem = 8  # the (mean, M2) pairs travel in float64
    stats = _n_stats(kind, shape, groups)
    n = 1
    for i, p in enumerate(xd.placements):
        if p.is_shard() and reduced:
            n *= m.size(i)
    want_fwd = [("all_gather", (n - 1) * 2 * stats * elem)] if reduced else []
    got_fwd = [(r.kind, r.nbytes) for r in fwd.records]
    if cfg.get("channels"):  # channels sharded: local; the running statistics' chunks gathered once
        want_fwd = [("all_gather", cfg["channels"])]
    if got_fwd != want_fwd or any(r.op not in _FWD_OPS for r in fwd.records):
        failures.append(f"{name}: forward traffic {[(r.kind, r.op, r.nbytes) for r in fwd.records]}, want {want_fwd}")
    norm_bwd = [r.kind for r in bwd.records if r.op in _BWD_OPS]
    # channels sharded: the weight's and bias's gradients come channel-sharded and are gathered to
    # their parameters' Replicate layout (README "Gradients"); never the activation's
    gathers = [r.op for r in bwd.records if r.kind == "all_gather"]
    if norm_bwd != (["all_reduce"] if reduced else []) \
            or gathers != (["<redistribute>"] * 2 if cfg.get("channels") else []):
        failures.append(f"{name}: backward traffic {[(r.kind, r.op, r.nbytes) for r in bwd.records]}")
    return failures


def _run(cfgs, mesh_shape) -> list[str]:
    m = mesh(mesh_shape)
    failures = []
    for cfg in cfgs:
        try:
            failures += _check(cfg, m)
        except Exception as e:
            failures.append(f"{cfg}: {type(e).__name__}: {str(e)[:600]}")
    return failures


def _cfgs(world: int) -> tuple[tuple, list[dict]]:
    if world == 3:  # H = 7: shards 3, 3, 1
        f64 = [dict(kind=k, shape=(2, 4, 7, 5), x=["S2"]) for k in ("bn", "in", "gn")]
        f64 += [dict(kind="bn", shape=(5, 3, 4, 3), x=["S0"]),  # batch shards 2, 2, 1
                dict(kind="gn", shape=(5, 4, 4, 3), x=["S0"], reduced=False),  # per-sample stats: local
                dict(kind="in", shape=(6, 4, 4, 3), x=["S0"], reduced=False),  # even: the view keeps it
                dict(kind="bn", shape=(2, 4, 3, 7, 2), x=["S3"]),  # 3-D, W... H of a volume
                dict(kind="gn", shape=(2, 4, 7, 3, 2), x=["S2"], groups=4),
                # channels sharded (2, 1, 1 of 4): local; running mean and var gathered in one
                # all_gather of (2, c) chunks padded to 2 channels: 2 * 2 * 8 bytes to each other
                dict(kind="bn", shape=(2, 4, 5, 3), x=["S1"], reduced=False, channels=2 * (2 * 2 * 8))]
        big = [dict(kind=k, shape=(2, 4, 7, 5), x=["S2"], dtype=torch.float32, offset=1e4, scale=1.0)
               for k in ("bn", "in", "gn")]
        return (3,), f64 + big
    if world == 4:  # H = 2 over 4 ranks: 1, 1, 0, 0
        return (4,), [dict(kind=k, shape=(2, 4, 2, 3), x=["S2"]) for k in ("bn", "in", "gn")]
    assert world == -4  # the 2x2 mesh
    cfgs = [dict(kind=k, shape=(2, 4, 7, 5), x=["S2", "S3"]) for k in ("bn", "in", "gn")]
    cfgs += [dict(kind="bn", shape=(3, 4, 5, 3), x=["S0", "S2"])]
    return (2, 2), cfgs


@pytest.mark.parametrize("world", [3, 4, -4], ids=["3-uneven-and-large-mean", "4-empty-shards", "2x2"])
def test_norm_statistics_one_collective_per_direction(world):
    mesh_shape, cfgs = _cfgs(world)
    for rank, failures in enumerate(run_distributed(_run, abs(world), cfgs, mesh_shape, timeout=300)):
        assert not failures, f"rank {rank}: {len(failures)} failures\n" + "\n".join(failures)


def _compiled():
    """batch norm -> instance norm -> group norm on an H-sharded input under
    ``torch.compile(fullgraph=True)`` (aot_eager, graphs recorded): values and gradients against
    one process in float64, and the collectives in the graphs: one all_gather of statistics per
    norm forward, no all_reduce there; no all_gather backward."""
    import torch._dynamo
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    m = mesh((2,))
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4, 7, 5, generator=g, dtype=torch.float64) * 2 + 5
    w = 1 + 0.3 * torch.randn(4, generator=g, dtype=torch.float64)
    b = 0.3 * torch.randn(4, generator=g, dtype=torch.float64)
    gy = torch.randn(2, 4, 7, 5, generator=g, dtype=torch.float64)

    def fn(t, ww, bb, rm, rv):
        t = F.batch_norm(t, rm, rv, ww, bb, training=True)
        t = F.instance_norm(t, weight=ww, bias=bb)
        return F.group_norm(t, 2, ww, bb)

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm.forward)

    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    rmr, rvr = torch.zeros(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64)
    ref = fn(xr, wr, br, rmr, rvr)
    (ref * gy).sum().backward()
    rep = [Replicate()]
    xd = dtshard.distribute_tensor(x, m, Ps(["S2"])).requires_grad_()
    wd, bd = (dtshard.distribute_tensor(t, m, rep).requires_grad_() for t in (w, b))
    rmd = dtshard.distribute_tensor(torch.zeros(4, dtype=torch.float64), m, rep)
    rvd = dtshard.distribute_tensor(torch.ones(4, dtype=torch.float64), m, rep)
    cfn = torch.compile(fn, backend=aot_autograd(fw_compiler=record, bw_compiler=record), fullgraph=True)
    y = cfn(xd, wd, bd, rmd, rvd)
    y.backward(dtshard.distribute_tensor(gy, m, y.placements))
    errs = {}
    for name, a, r in (("out", y.detach().full_tensor(), ref.detach()), ("grad_x", xd.grad.full_tensor(), xr.grad),
                       ("grad_w", wd.grad.full_tensor(), wr.grad), ("grad_b", bd.grad.full_tensor(), br.grad),
                       ("running_mean", rmd.full_tensor(), rmr), ("running_var", rvd.full_tensor(), rvr)):
        errs[name] = float((a - r).abs().max() / r.abs().max())
    fw, bw = graphs[0], graphs[-1]
    return (errs, str(y.placements), fw.count("_c10d_functional.all_gather_into_tensor"),
            fw.count("_c10d_functional.all_reduce"), bw.count("_c10d_functional.all_gather_into_tensor"),
            bw.count("_c10d_functional.all_reduce.default("), len(graphs))


def test_norm_statistics_compiled():
    for rank, (errs, placements, fw_ag, fw_ar, bw_ag, bw_ar, n_graphs) in enumerate(run_distributed(_compiled, 2)):
        bad = {k: v for k, v in errs.items() if not v <= 1e-12}
        assert not bad, f"rank {rank}: {bad}"
        assert placements == "(Shard(dim=2),)"
        assert n_graphs == 2  # one forward, one backward graph: no graph break
        assert (fw_ag, fw_ar, bw_ag) == (3, 0, 0), (fw_ag, fw_ar, bw_ag)
        assert bw_ar >= 3, bw_ar  # one stacked reduction per norm (+ the weight gradients')
