"""A Llama-style model trained with tensor + sequence parallelism on dtshard, against the same
model in one process: 5 AdamW steps, the loss of every step and every weight after every step.

The model and its plan are :mod:`dtshard.models`' (``python -m dtshard.demo --model llama`` trains
them too).  The plan is torchtitan's (``tp_plan``): q/k/v and the MLP's gate/up projections
``ColwiseParallel``, the attention output and MLP down projections ``RowwiseParallel`` (reducing
to sequence shards), ``SequenceParallel`` RMSNorms, the embedding row- or column-wise, the LM head
``ColwiseParallel`` with its logits left sharded on the vocabulary for ``loss_parallel``.  Two
variants of the same model code: the projections hand local shards to the attention/MLP bodies
(PyTorch's default, needs ``n_kv_heads`` divisible by the mesh size), or keep DTensors throughout,
so ``scaled_dot_product_attention`` runs on DTensors with the heads sharded (any head count; on 4
ranks the 2 k/v heads cannot be split evenly, and the planner moves them).

Tolerances (float32): the loss within 1e-5 relative, and each weight tensor within 1e-5 of its
largest magnitude (AdamW divides by the root of the squared gradients, so an element whose
gradient nearly cancels, ~1e-6 against summands of ~1e-1, amplifies rounding noise; measured
per element the deviations stay below 1e-6 + 1e-5 * |w| here anyway).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import dtshard
import dtshard.parallel
from dtshard.models import LlamaConfig, Transformer, parallelize
from dtshard.testing import run_distributed

from _cases import mesh

STEPS = 5
LR = 2e-3
RTOL = 1e-5
#: per element: |dW| <= RTOL * |W| + ATOL (a weight near zero still may not drift)
ATOL = 1e-6


def _train(world, plan, tie, foreach):
    """Train the single-process reference and the dtshard copy side by side; per step: both losses
    and the worst weight deviations (relative to each tensor's scale, and elementwise)."""
    m = mesh((world,))
    cfg = LlamaConfig(tie_embeddings=tie)
    ref = Transformer(cfg)
    model = parallelize(copy.deepcopy(ref), m, dtshard.parallel, **plan)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=foreach)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=g)  # batch 2, sequence 8 (+1 label)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    ref_params = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(ref_params), (names, list(ref_params))
    rows = []
    for _ in range(STEPS):
        loss_ref = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten(0, 1))
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        with dtshard.parallel.loss_parallel():
            logits = model(inputs)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
        opt.step()
        opt.zero_grad()
        dev_scaled = dev_elem = 0.0
        for n, p in model.named_parameters():
            assert isinstance(p, dtshard.DTensor), f"{n} is not a DTensor"
            full, want = p.full_tensor(), ref_params[n].detach()
            d = (full - want).abs()
            dev_scaled = max(dev_scaled, (d.max() / want.abs().max()).item())
            dev_elem = max(dev_elem, (d - RTOL * want.abs()).max().item())
        rows.append((loss_ref.item(), loss.full_tensor().item(), dev_scaled, dev_elem))
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    return rows, placements


def _check(rows):
    for step, (want, got, dev_scaled, dev_elem) in enumerate(rows, 1):
        assert abs(got - want) <= RTOL * abs(want), f"step {step}: loss {got} vs {want}"
        assert dev_scaled <= RTOL, f"step {step}: a weight deviates by {dev_scaled:.2e} of its scale"
        assert dev_elem <= ATOL, (f"step {step}: a weight element deviates by {dev_elem:.2e} more "
                                  f"than {RTOL:g} of its value")
    assert rows[-1][0] < rows[0][0] - 0.2, "the model did not train"


_CONFIGS = [
    # (world, plan, tied LM head, foreach AdamW)
    pytest.param(2, dict(local_output=True, embedding="rowwise"), False, False, id="2-local-rowwise"),
    pytest.param(2, dict(local_output=False, embedding="colwise"), False, True, id="2-dtensor-colwise-foreach"),
    pytest.param(4, dict(local_output=False, embedding="rowwise"), True, False, id="4-dtensor-rowwise-tied"),
]


@pytest.mark.parametrize("world,plan,tie,foreach", _CONFIGS)
def test_llama_tp_sp_matches_single_process(world, plan, tie, foreach):
    results = run_distributed(_train, world, world, plan, tie, foreach, timeout=300)
    for rows, placements in results:
        _check(rows)
    rows, placements = results[0]
    assert placements["tok_embeddings.weight"] == ("(Shard(dim=0),)" if plan["embedding"] == "rowwise"
                                                   else "(Shard(dim=1),)")
    assert placements["layers.0.attention.wq.weight"] == "(Shard(dim=0),)"
    assert placements["layers.0.attention.wo.weight"] == "(Shard(dim=1),)"
    assert placements["layers.0.attention_norm.weight"] == "(Replicate(),)"
    print(f"\n{world} ranks {plan} tied={tie} foreach={foreach}")
    for step, (want, got, dev_scaled, dev_elem) in enumerate(rows, 1):
        print(f"  step {step}: loss {want:.7f} vs {got:.7f} (|d| {abs(got - want):.1e}), "
              f"max|dW|/max|W| {dev_scaled:.1e}, max(|dW| - 1e-5|W|) {dev_elem:.1e}")


def _local_plan_needs_divisible_kv_heads():
    """torchtitan's local-shard plan on 4 ranks with 2 k/v heads: the local k projection holds half
    a head, and the model's view(..., -1, head_dim) fails, as it does with PyTorch's DTensor."""
    m = mesh((4,))
    model = parallelize(Transformer(LlamaConfig()), m, dtshard.parallel, local_output=True)
    try:
        with dtshard.parallel.loss_parallel():
            model(torch.zeros(2, 8, dtype=torch.long))
    except RuntimeError as e:
        return "view" in str(e) or "shape" in str(e)
    return False


def test_local_plan_with_too_few_kv_heads_fails_loudly():
    assert all(run_distributed(_local_plan_needs_divisible_kv_heads, 4))


def _llama_torch_vs_dtshard(world):
    """tp_plan applied with torch.distributed.tensor.parallel and with dtshard.parallel (the same
    function, the module passed in): one forward/backward each, against one process."""
    import torch.distributed.tensor.parallel as torch_tp

    m = mesh((world,))
    ref = Transformer(LlamaConfig())
    g = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, ref.cfg.vocab_size, (2, 9), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    want = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten(0, 1))
    want.backward()
    out = {}
    for tp in (torch_tp, dtshard.parallel):
        model = parallelize(copy.deepcopy(ref), m, tp, local_output=True)
        with tp.loss_parallel():
            loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(0, 1))
            loss.backward()
        torch.testing.assert_close(loss.full_tensor(), want.detach())
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=lambda s: f"{tp.__name__} {n}: {s}")
        out[tp.__name__] = type(loss).__module__
    return out


def test_same_llama_plan_runs_on_torch_and_dtshard():
    for out in run_distributed(_llama_torch_vs_dtshard, 2, 2):
        assert out == {"torch.distributed.tensor.parallel": "torch.distributed.tensor",
                       "dtshard.parallel": "dtshard.tensor"}, out
