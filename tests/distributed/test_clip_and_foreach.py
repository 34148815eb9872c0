"""Gradient clipping and foreach optimizer steps over sharded gradients.

``torch.nn.utils.clip_grad_norm_`` over dtshard DTensors issues ONE all_reduce per (mesh,
placements) group of reduced norms, not one per parameter, and materialises no replicated
gradient; a ``foreach=True`` optimizer step over sharded parameters issues no collective.  Values
against the same parameters in one process.
"""

from __future__ import annotations

import math

import torch

import dtshard
from dtshard import Replicate, Shard
from dtshard.testing import run_distributed


def _params(mesh, layouts, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps, ref = [], []
    for k, (shape, pl) in enumerate(layouts):
        w = torch.randn(shape, generator=g)
        grad = torch.randn(shape, generator=g)
        p = torch.nn.Parameter(dtshard.distribute_tensor(w, mesh, pl))
        p.grad = dtshard.distribute_tensor(grad, mesh, pl)
        r = torch.nn.Parameter(w.clone())
        r.grad = grad.clone()
        ps.append(p)
        ref.append(r)
    return ps, ref


def _clip():
    mesh = dtshard.init_device_mesh("cpu", (2,))
    problems = []
    # two groups that need a reduction (Shard(0) and Shard(1) both reduce to Partial on the mesh dim:
    # ONE group), plus replicated ones (no collective), uneven sizes included
    layouts = [((5, 3), [Shard(0)]), ((4, 7), [Shard(1)]), ((6,), [Shard(0)]), ((3, 3), [Replicate()]),
               ((2, 5), [Shard(0)]), ((4,), [Replicate()])]
    for ord_ in (2.0, 1.0, math.inf, 3.0):
        ps, ref = _params(mesh, layouts)
        with dtshard.debug.CommCounter() as comm:
            total = torch.nn.utils.clip_grad_norm_(ps, 0.5, norm_type=ord_)
        want = torch.nn.utils.clip_grad_norm_(ref, 0.5, norm_type=ord_)
        if comm.count() != 1 or comm.count("all_reduce") != 1:
            problems.append(f"ord {ord_}: {comm.count()} collectives ({comm.kinds()}), expected one all_reduce")
        got = total.full_tensor() if isinstance(total, dtshard.DTensor) else total
        if not torch.allclose(got, want, rtol=1e-5):
            problems.append(f"ord {ord_}: total norm {float(got)} vs {float(want)}")
        for k, (p, r) in enumerate(zip(ps, ref)):
            if not isinstance(p.grad, dtshard.DTensor) or p.grad.placements != p.placements:
                problems.append(f"ord {ord_}: grad {k} is {type(p.grad).__name__} {getattr(p.grad, 'placements', '')}")
            elif not torch.allclose(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-7):
                problems.append(f"ord {ord_}: clipped grad {k} differs")
    return problems


def _foreach_step():
    mesh = dtshard.init_device_mesh("cpu", (2,))
    problems = []
    layouts = [((5, 3), [Shard(0)]), ((4, 7), [Shard(1)]), ((6,), [Shard(0)]), ((3, 3), [Replicate()])]
    for make in (lambda p: torch.optim.AdamW(p, lr=0.1, foreach=True),
                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True)):
        ps, ref = _params(mesh, layouts, seed=1)
        opt, ropt = make(ps), make(ref)
        for _ in range(2):
            with dtshard.debug.CommCounter() as comm:
                opt.step()
            ropt.step()
            if comm.count():
                problems.append(f"{type(opt).__name__}: {comm.count()} collectives in a foreach step")
        for k, (p, r) in enumerate(zip(ps, ref)):
            if not torch.allclose(p.full_tensor(), r.detach(), rtol=1e-5, atol=1e-6):
                problems.append(f"{type(opt).__name__}: param {k} differs")
    return problems


def test_clip_grad_norm_one_all_reduce_per_group():
    for rank, problems in enumerate(run_distributed(_clip, 2)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def test_foreach_optimizer_steps_issue_no_collective():
    for rank, problems in enumerate(run_distributed(_foreach_step, 2)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
