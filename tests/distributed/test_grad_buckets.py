"""Bucketed Partial-gradient reductions (``dtshard.grad_buckets``, DDP's design): a tensor-parallel
Llama step reduces its replicated weights' Partial gradients in one all_reduce per bucket instead
of one per parameter, asynchronously, finished when ``backward()`` returns; the gradients are
exactly those of the unbucketed path (and every ``.grad`` is settled, never left Partial)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import dtshard
import dtshard.parallel
from dtshard import Partial
from dtshard.debug import CommCounter
from dtshard.models import LlamaConfig, Transformer, parallelize
from dtshard.testing import run_distributed


def _step(cap: int):
    dtshard.config.grad_bucket_bytes = cap
    try:
        mesh = dtshard.init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = parallelize(Transformer(LlamaConfig()), mesh, dtshard.parallel, local_output=True)
        g = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, 64, (2, 9), generator=g)
        with dtshard.parallel.loss_parallel():
            loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(0, 1))
            with CommCounter() as bwd:
                loss.backward()
        grads = {n: (str(p.grad.placements), p.grad.full_tensor()) for n, p in model.named_parameters()}
        buckets = sum(1 for r in bwd.records if r.op == "<grad bucket>")
        alone = sum(1 for r in bwd.records if r.op == "<redistribute>" and r.kind == "all_reduce")
        settled = all(not any(isinstance(q, Partial) for q in p.grad.placements) for p in model.parameters())
        return grads, buckets, alone, settled
    finally:
        dtshard.config.grad_bucket_bytes = 25 * 2**20


def _compare():
    one = _step(0)  # one collective per gradient
    bucketed = _step(25 * 2**20)  # every replicated weight's gradient in one bucket
    tiny = _step(1)  # every gradient fills its own bucket: issued at once
    return one, bucketed, tiny


def test_partial_gradients_reduce_in_buckets():
    for one, bucketed, tiny in run_distributed(_compare, 2, timeout=240):
        grads0, b0, a0, s0 = one
        n_partial = tiny[1]  # a bucket per Partial gradient: the RMSNorm weights (sequence parallel)
        assert n_partial == 2 * LlamaConfig().n_layers + 1, n_partial
        # unbucketed: one all_reduce per Partial gradient, plus the others of the step (the loss's)
        assert b0 == 0 and s0 and a0 > n_partial, (b0, a0)
        for grads, buckets, alone, settled in (bucketed, tiny):
            assert settled
            assert alone == a0 - n_partial, (alone, a0, n_partial)
            assert buckets == (1 if grads is bucketed[0] else n_partial), buckets
            for name, (placements, full) in grads.items():
                assert placements == grads0[name][0], (name, placements, grads0[name][0])
                assert torch.equal(full, grads0[name][1]), name  # the same sums, bit for bit


def _compiled_step():
    """torch.compile(model): the forward and backward graphs run compiled, the Partial gradients
    they return are bucketed like eager ones (one all_reduce for the bucket after the graph)."""
    mesh = dtshard.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    base = Transformer(LlamaConfig())
    eager = parallelize(copy.deepcopy(base), mesh, dtshard.parallel, local_output=True)
    model = parallelize(copy.deepcopy(base), mesh, dtshard.parallel, local_output=True)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    tokens = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7))
    out = {}
    for name, m, owner in (("eager", eager, eager), ("compiled", compiled, model)):
        for _ in range(2):  # the second step runs the cached graphs
            owner.zero_grad(set_to_none=True)
            with dtshard.parallel.loss_parallel():
                loss = F.cross_entropy(m(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(0, 1))
                with CommCounter() as bwd:
                    loss.backward()
        out[name] = (sum(1 for r in bwd.records if r.op == "<grad bucket>"),
                     {n: (str(p.grad.placements), p.grad.full_tensor()) for n, p in owner.named_parameters()})
    return out


def test_compiled_model_gradients_reduce_in_one_bucket():
    for res in run_distributed(_compiled_step, 2, timeout=300):
        (b_eager, g_eager), (b_comp, g_comp) = res["eager"], res["compiled"]
        assert b_eager == 1 and b_comp == 1, (b_eager, b_comp)
        for name, (placements, full) in g_comp.items():
            assert placements == g_eager[name][0], (name, placements)
            torch.testing.assert_close(full, g_eager[name][1], msg=name)


def _accumulated(micro: int, cap: int):
    """``micro`` backwards into the same gradients (no zero_grad between them), as gradient
    accumulation does: per backward, the bucket all_reduces and the per-gradient ones; the
    accumulated gradients and their layouts."""
    dtshard.config.grad_bucket_bytes = cap
    try:
        mesh = dtshard.init_device_mesh("cpu", (2,))
        torch.manual_seed(0)
        model = parallelize(Transformer(LlamaConfig()), mesh, dtshard.parallel, local_output=True)
        g = torch.Generator().manual_seed(11)
        per_backward = []
        for _ in range(micro):
            tokens = torch.randint(0, 64, (2, 9), generator=g)
            with dtshard.parallel.loss_parallel():
                loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten(0, 1))
                with CommCounter() as bwd:
                    loss.backward()
            per_backward.append((sum(1 for r in bwd.records if r.op == "<grad bucket>"),
                                 sum(1 for r in bwd.records if r.op == "aten.add_.Tensor")))
        grads = {n: (str(p.grad.placements), p.grad.full_tensor()) for n, p in model.named_parameters()}
        return per_backward, grads
    finally:
        dtshard.config.grad_bucket_bytes = 25 * 2**20


def _accumulation():
    return _accumulated(3, 25 * 2**20), _accumulated(3, 0)


def test_gradient_accumulation_keeps_the_buckets():
    """Issue #31 item 3: the second and third backward into settled gradients still reduce the
    Partial ones in ONE bucket each (no all_reduce inside AccumulateGrad's add_), and the sums
    equal the unbucketed path's (which reduces each in add_) to rounding, with the same layouts."""
    for (bucketed, grads), (unbucketed, grads0) in run_distributed(_accumulation, 2, timeout=300):
        assert bucketed == [(1, 0)] * 3, bucketed
        assert unbucketed[0] == (0, 0) and all(adds > 0 for _, adds in unbucketed[1:]), unbucketed
        for name, (placements, full) in grads.items():
            assert placements == grads0[name][0], (name, placements)
            torch.testing.assert_close(full, grads0[name][1], rtol=1e-6, atol=1e-7, msg=name)
