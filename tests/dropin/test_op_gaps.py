"""Drop-in gaps (issue #17): code written for ``torch.distributed.tensor`` must run on dtshard by
changing only its import.

Each worker runs the SAME code on both packages where PyTorch's DTensor runs it (``_LIBS``: the
placements and the mesh are PyTorch's own classes, so only the module differs), compares both with
single-process PyTorch on every rank, forward and backward, and then checks what dtshard adds
(uneven shards, traffic, aliasing).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import dtshard
import dtshard.parallel
from dtshard.debug import CommCounter
from dtshard.testing import run_distributed

_meshes: dict = {}


def _mesh(shape):
    """One mesh per shape per worker process (both packages use PyTorch's DeviceMesh)."""
    m = _meshes.get(shape)
    if m is None:
        m = _meshes[shape] = dtshard.init_device_mesh("cpu", shape)
    return m


def _libs():
    """(name, DTensor package, tensor-parallel package): PyTorch's first, then dtshard."""
    import torch.distributed.tensor as torch_dt
    import torch.distributed.tensor.parallel as torch_tp

    return [("torch", torch_dt, torch_tp), ("dtshard", dtshard, dtshard.parallel)]


def _partial_terms(full: torch.Tensor, rank: int, n: int, op: str) -> torch.Tensor:
    """This rank's term of a ``Partial(op)`` of ``full`` (terms differ across ranks)."""
    g = torch.Generator().manual_seed(77)
    z = torch.randint(1, 4, full.shape, generator=g).to(full.dtype)
    if op == "sum":
        return full - (n - 1) * z if rank == 0 else z
    if op == "avg":
        return full * n - (n - 1) * z if rank == 0 else z
    if op in ("prod", "product"):
        return full / z ** (n - 1) if rank == 0 else z
    if op == "max":
        return full - rank * z
    if op == "min":
        return full + rank * z
    raise ValueError(op)


def _close(got, want, what):
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda s: f"{what}: {s}")


# ---------------------------------------------------------------------------------------------
# Item 1: torch.inference_mode()
# ---------------------------------------------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _composite_cases():
    """(name, fn, shapes, placements per input, runs on PyTorch's DTensor): CompositeImplicitAutograd
    ops that reach __torch_dispatch__ undecomposed under inference_mode.  Uneven shards only on
    dtshard (PyTorch's DTensor aborts in gloo on some of them under inference_mode)."""
    S0, S1, S2, Rp, Ps = Shard(0), Shard(1), Shard(2), Replicate(), Partial("sum")
    return [
        ("matmul 2d", torch.matmul, [(4, 6), (6, 4)], [S0, Rp], True),
        ("matmul 2d k", torch.matmul, [(4, 6), (6, 4)], [S1, Shard(0)], True),
        ("matmul 3d@2d", torch.matmul, [(2, 4, 6), (6, 4)], [S1, Rp], True),
        ("matmul bcast", torch.matmul, [(2, 1, 4, 6), (3, 6, 4)], [S0, S0], True),
        ("matmul 1d@3d", torch.matmul, [(6,), (2, 6, 4)], [Rp, S2], True),
        ("matmul 3d@1d", torch.matmul, [(2, 4, 6), (6,)], [S2, S0], True),
        ("matmul dot", torch.matmul, [(6,), (6,)], [S0, S0], True),
        ("matmul partial", torch.matmul, [(4, 6), (6, 4)], [Ps, Rp], True),
        ("linear", F.linear, [(2, 4, 6), (4, 6), (4,)], [S1, Rp, Rp], True),
        ("linear colwise", F.linear, [(4, 6), (4, 6), (4,)], [Rp, S0, S0], True),
        ("linear rowwise", F.linear, [(4, 6), (4, 6), (4,)], [S1, S1, Rp], True),
        ("linear partial", F.linear, [(4, 6), (4, 6), (4,)], [Ps, Rp, Rp], True),
        ("linear nobias", F.linear, [(4, 6), (4, 6)], [S0, Rp], True),
        ("einsum", lambda a, b: torch.einsum("bij,jk->bik", a, b), [(2, 4, 6), (6, 4)], [S0, Rp], True),
        ("softmax", lambda a: torch.softmax(a, -1), [(4, 6)], [S0], True),
        ("log_softmax", lambda a: F.log_softmax(a, 0), [(4, 6)], [S0], True),
        ("layer_norm", lambda a: F.layer_norm(a, (6,)), [(4, 6)], [S0], True),
        ("flatten", lambda a: a.flatten(), [(4, 6)], [S0], True),
        ("reshape", lambda a: a.reshape(2, 12), [(4, 6)], [S0], True),
        ("std", lambda a: a.std(0), [(4, 6)], [S0], True),
        ("cosine_similarity", lambda a, b: F.cosine_similarity(a, b, dim=0), [(4, 6), (4, 6)], [S0, S0], True),
        # uneven (dtshard only)
        ("matmul uneven", torch.matmul, [(5, 7), (7, 3)], [S0, Rp], False),
        ("matmul uneven k", torch.matmul, [(5, 7), (7, 3)], [S1, S0], False),
        ("linear uneven", F.linear, [(3, 5, 7), (5, 7), (5,)], [S1, S0, S0], False),
        ("softmax uneven", lambda a: torch.softmax(a, 0), [(5, 7)], [S0], False),
        ("flatten uneven", lambda a: a.flatten(0, 1), [(5, 3, 2)], [S1], False),
    ]


def _inference_mode_worker(world):
    m = _mesh((world,))
    rank = m.get_coordinate()[0]
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want_mlp = _mlp()(x)
    report = {}
    for name, dt, tp in _libs():
        # a Colwise -> Rowwise MLP (nn.Linear through the package's parallel styles)
        mlp = tp.parallelize_module(_mlp(), m, {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()})
        with CommCounter() as cc, torch.inference_mode():
            y = mlp(x)
        _close(y, want_mlp, f"{name} TP MLP")
        if name == "dtshard":
            assert cc.kinds() == ["all_reduce"] and cc.count() == 1, cc.summary()  # Rowwise's output
        # composite ops, one by one
        for case, fn, shapes, placements, on_torch in _composite_cases():
            if name == "torch" and not on_torch:
                continue
            fulls = [torch.randint(-4, 5, s, generator=torch.Generator().manual_seed(k)).float()
                     for k, s in enumerate(shapes)]
            args = []
            for full, p in zip(fulls, placements):
                if isinstance(p, Partial):
                    args.append(dt.DTensor.from_local(_partial_terms(full, rank, world, p.reduce_op), m, [p]))
                else:
                    args.append(dt.distribute_tensor(full, m, [p]))
            with torch.inference_mode():
                got = fn(*args)
                want = fn(*fulls)
                _close(got.full_tensor(), want, f"{name} {case}")
            report[(name, case)] = str(got.placements)
    return report


def test_inference_mode_composites():
    """Under inference_mode, CompositeImplicitAutograd ops (linear, matmul, softmax, reshape, ...)
    reach __torch_dispatch__ undecomposed: a TP MLP and each op give the single-process result on
    every rank, on PyTorch's DTensor and on dtshard."""
    for report in run_distributed(_inference_mode_worker, 2, 2):
        assert report[("dtshard", "linear colwise")] == "(Shard(dim=1),)"
        assert report[("dtshard", "matmul 2d k")] == "(Partial(sum),)"


def _inference_plans_worker(world):
    """linear and matmul have rules (one dispatch, no decomposition); an op without one runs its
    decomposition; a rule registered later takes precedence over the decomposition."""
    m = _mesh((world,))
    x = dtshard.distribute_tensor(torch.randn(4, 6), m, [Shard(0)])
    w = dtshard.distribute_tensor(torch.randn(3, 6), m, [Replicate()])
    seen = []
    with dtshard.debug.plan_log() as log, torch.inference_mode():
        F.linear(x, w)
        torch.matmul(x, w.t())
        seen.append(list(log))
    with dtshard.debug.plan_log() as log, torch.inference_mode():
        x.flatten()
        seen.append(list(log))
    # as on plain tensors: a view of a normal tensor made in inference mode is a normal tensor
    # (PyTorch's DTensor raises "Cannot set version_counter for inference tensor" here)
    wp = torch.randn(3, 6)
    with torch.inference_mode():
        wt, y = w.t(), x * 2
        seen.append((wt.is_inference(), y.is_inference(), wp.t().is_inference(), (wp * 2).is_inference()))
        _close(wt.full_tensor(), w.full_tensor().t(), "w.t() in inference mode")
    return seen


def test_inference_mode_linear_matmul_are_single_dispatches():
    for seen in run_distributed(_inference_plans_worker, 2, 2):
        linear_matmul, flatten, inference = seen
        assert inference == (False, True, False, True), inference
        assert [s.split()[0] for s in linear_matmul] == ["aten.linear.default", "aten.t.default",
                                                         "aten.matmul.default"], linear_matmul
        assert "aten.flatten.using_ints" not in " ".join(flatten) and flatten, flatten
