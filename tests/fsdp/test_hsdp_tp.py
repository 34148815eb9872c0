"""HSDP x TP on a 2x2x2 mesh ``(replicate, shard, tp)``: ``parallelize_module(model, mesh["tp"])``
then ``fully_shard(block, mesh=mesh["replicate", "shard"])`` for each block and the root
(torchtitan's HSDP + TP recipe), the Llama model of ``dtshard.models``, 8 ranks.

Checked on every rank against the same model trained in one process (float64, AdamW, 4 steps, the
global batch = the 4 data-parallel ranks' batches): losses and final full parameters; the layout
(3-D DTensors: ``Replicate`` on the replicate dim, a TP ``Shard(0)`` weight as
``_StridedShard(0, split_factor=2)`` on the shard dim); per step one all_gather per group over
the shard dim in forward, one reduce_scatter per group over the shard dim and one all_reduce per
group over the replicate dim in backward; the optimizer step issues no collective.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import dtshard
import dtshard.parallel
from dtshard.debug import CommCounter
from dtshard.fsdp import fully_shard
from dtshard.models import LlamaConfig, Transformer, parallelize
from dtshard.testing import run_distributed

STEPS = 2  # the first step and one after an optimizer step (8 ranks on the CI's 2 cores: the suite's time)


def _hsdp_tp(steps: int = STEPS):
    mesh = dtshard.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("replicate", "shard", "tp"))
    dp, tp = mesh["replicate", "shard"], mesh["tp"]
    cfg = LlamaConfig()
    torch.manual_seed(0)
    ref = Transformer(cfg).double()  # float64: summation order across 8 ranks cannot hide an error
    model = parallelize(copy.deepcopy(ref), tp, dtshard.parallel, local_output=True)
    for layer in model.layers:
        fully_shard(layer, mesh=dp)
    fully_shard(model, mesh=dp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False)
    coord = dp.get_coordinate()
    me = coord[0] * 2 + coord[1]  # this rank's data-parallel index of 4
    g = torch.Generator().manual_seed(7)
    rows = []
    layout = {n: (str(p.placements), tuple(p.device_mesh.mesh_dim_names)) for n, p in model.named_parameters()}
    for _ in range(steps):
        tokens = torch.randint(0, cfg.vocab_size, (8, 9), generator=g)  # 2 sequences per dp rank
        inputs, labels = tokens[:, :-1], tokens[:, 1:]
        mine = slice(2 * me, 2 * me + 2)
        with CommCounter() as fwd:
            with dtshard.parallel.loss_parallel():
                loss = F.cross_entropy(model(inputs[mine]).flatten(0, 1), labels[mine].flatten(0, 1))
        with CommCounter() as bwd:
            with dtshard.parallel.loss_parallel():
                loss.backward()
        grads_ok = all(type(p.grad) is dtshard.DTensor and p.grad.placements == p.placements
                       and p.grad.to_local().shape == p.to_local().shape for p in model.parameters())
        with CommCounter() as optc:
            opt.step()
            opt.zero_grad()
        rloss = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten(0, 1))
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        f = [(r.kind, r.mesh_dim) for r in fwd.records if r.op == "<fsdp>"]
        b = [(r.kind, r.mesh_dim) for r in bwd.records if r.op == "<fsdp>"]
        rows.append((loss.full_tensor().item(), rloss.item(), sorted(set(f)), len(f),
                     sorted(set(b)), {k: sum(1 for x in b if x[0] == k) for k, _ in b}, grads_ok,
                     optc.get_total_counts()))
    ref_params = dict(ref.named_parameters())
    err = max(((p.full_tensor() - ref_params[n].detach()).abs().max() / ref_params[n].abs().max()).item()
              for n, p in model.named_parameters())
    return rows, err, layout, me


def test_hsdp_times_tp_llama_2x2x2():
    groups = LlamaConfig().n_layers + 1
    res = run_distributed(_hsdp_tp, 8, timeout=400)
    losses = {}
    for rows, err, layout, me in res:
        for step, (loss, rloss, fkinds, nf, bkinds, bcounts, grads_ok, opt_comm) in enumerate(rows):
            losses.setdefault(step, {})[me] = (loss, rloss)
            assert fkinds == [("all_gather", 1)] and nf == groups, rows[step]
            assert bkinds == [("all_gather", 1), ("all_reduce", 0), ("reduce_scatter", 1)], bkinds
            assert bcounts == {"all_gather": groups - 1, "reduce_scatter": groups, "all_reduce": groups}, bcounts
            assert grads_ok, step
            assert opt_comm == 0, opt_comm
        assert err < 1e-10, err
        names = ("replicate", "shard", "tp")
        assert layout["layers.0.attention.wq.weight"] == (
            "(Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0))", names), layout["layers.0.attention.wq.weight"]
        assert layout["layers.0.attention.wo.weight"] == ("(Replicate(), Shard(dim=0), Shard(dim=1))", names)
    for step, per_dp in losses.items():
        assert sorted(per_dp) == [0, 1, 2, 3]
        # each dp rank's loss is the mean over its own sequences: their mean is the global loss
        mean = sum(v[0] for v in per_dp.values()) / 4
        assert abs(mean - per_dp[0][1]) < 1e-10, (step, mean, per_dp[0][1])
