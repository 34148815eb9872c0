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


def _grad_scaler(lib: str, first: str):
    """torch.amp.GradScaler over sharded parameters (two dtypes: two unscale calls sharing one
    found-inf flag), 4 steps, the second with an inf in ONE element of one gradient, held by rank
    1's shard only: every rank must find it and skip that step, as one process does. ``first``:
    which parameter comes first in the list ("shard" or "replicate"; PyTorch's DTensor reads the
    first gradient's placements to decide what to reduce)."""
    import torch.distributed.tensor as tdt

    mod = dtshard if lib == "dtshard" else tdt
    mesh = mod.init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(7)
    layouts = [((5, 3), torch.float32, [Shard(0)]), ((4, 7), torch.float32, [Shard(1)]),
               ((6,), torch.bfloat16, [Shard(0)]), ((3, 3), torch.float32, [Replicate()])]
    if first == "replicate":
        layouts = layouts[::-1]
    weights = [torch.randn(shape, generator=g).to(dt) for shape, dt, _ in layouts]
    coefs = [[torch.randn(shape, generator=g).to(dt) for shape, dt, _ in layouts] for _ in range(4)]
    hit = next(k for k, (shape, _, pl) in enumerate(layouts) if shape == (5, 3))
    coefs[1][hit][4, 1] = float("inf")  # row 4 of 5: rank 1's shard (rows 3-4)
    runs = {}
    for name in ("sharded", "one process"):
        if name == "sharded":
            # (a clone: PyTorch's distribute_tensor keeps a Replicate tensor's storage as the shard)
            ps = [torch.nn.Parameter(mod.distribute_tensor(w.clone(), mesh, pl)) for w, (_, _, pl) in zip(weights, layouts)]
            cs = [[mod.distribute_tensor(c, mesh, pl) for c, (_, _, pl) in zip(step, layouts)] for step in coefs]
        else:
            ps = [torch.nn.Parameter(w.clone()) for w in weights]
            cs = coefs
        opt = torch.optim.SGD(ps, lr=0.1)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10, growth_interval=2)
        trace = []
        for step in range(4):
            loss = sum((p * c).float().sum() for p, c in zip(ps, cs[step]))
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            found = sum(v.item() for v in scaler._found_inf_per_device(opt).values())
            # (full_tensor() of a Replicate DTensor is its shard itself, which the step then updates)
            grads = [p.grad.full_tensor().clone() if hasattr(p.grad, "full_tensor") else p.grad.clone() for p in ps]
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            values = [p.full_tensor().clone() if hasattr(p, "full_tensor") else p.detach().clone() for p in ps]
            trace.append((found, scaler.get_scale(), grads, values))
        runs[name] = trace
    problems = []
    for step, (got, want) in enumerate(zip(runs["sharded"], runs["one process"])):
        if got[:2] != want[:2]:
            problems.append(f"step {step}: found_inf, scale {got[:2]} vs one process {want[:2]}")
        for k, (a, b) in enumerate(zip(got[2] + got[3], want[2] + want[3])):
            if not torch.equal(a, b):
                problems.append(f"step {step}: tensor {k} differs from one process")
    return [runs["sharded"][s][0] for s in range(4)], problems


def test_grad_scaler_skips_the_step_on_every_rank_when_one_shard_overflows():
    """dtshard with either parameter first; PyTorch's DTensor on the same code where its rule (the
    first gradient's placements) covers it."""
    for lib, first in (("dtshard", "shard"), ("dtshard", "replicate"), ("torch", "shard")):
        for rank, (found, problems) in enumerate(run_distributed(_grad_scaler, 2, lib, first)):
            assert found == [0.0, 1.0, 0.0, 0.0], (lib, first, rank, found)
            assert not problems, f"{lib}, {first} first, rank {rank}:\n" + "\n".join(problems)
