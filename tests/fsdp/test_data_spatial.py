"""Data x spatial parallelism with ONE gradient reduction: a conv model whose images are sharded
on H over the ``"sp"`` mesh dim, and whose parameters FSDP shards over the flattened
``("dp", "sp")`` mesh (``fully_shard(module, mesh=mesh._flatten())``, torchtitan's recipe for
context parallelism).

The parameters are replicated over ``sp`` (``distribute_module``), so each spatial rank's weight
gradient is a Partial term of its dp batch's gradient.  dtshard keeps it Partial and reduces it
in FSDP's one reduce_scatter over all 4 ranks: 0.75 G sent per rank on 2x2 (G = a group's
gradient bytes), where an all_reduce over sp then a reduce_scatter over dp would send 1.5 G.
Checked: losses and parameters against one process (global batch, AdamW), no all_reduce in
backward, one reduce_scatter per group over the 4 ranks with exactly 0.75 G sent.
"""

from __future__ import annotations

import copy

import torch
import torch.nn as nn

import dtshard
from dtshard import Shard
from dtshard.debug import CommCounter
from dtshard.fsdp import fully_shard
from dtshard.testing import run_distributed

H = W = 8
STEPS = 5


def _model():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()),
              nn.Sequential(nn.Conv2d(8, 8, 3, padding=1), nn.ReLU())]
    return nn.Sequential(*blocks, nn.Conv2d(8, 4, 3, padding=1))


def _batch(step: int):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(4, 3, H, W, generator=g), torch.randn(4, 4, H, W, generator=g)


def _data_spatial():
    mesh = dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    sp, flat = mesh["sp"], mesh._flatten("dp_sp")
    ref = _model()
    model = dtshard.distribute_module(copy.deepcopy(ref), sp)  # parameters Replicate over sp
    for block in model[:2]:
        fully_shard(block, mesh=flat)
    fully_shard(model, mesh=flat)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dp_i, sp_i = mesh.get_coordinate()
    rows = []
    for step in range(STEPS):
        x, t = _batch(step)
        mine = slice(2 * dp_i, 2 * dp_i + 2)
        h = slice(sp_i * H // 2, (sp_i + 1) * H // 2)
        xd = dtshard.DTensor.from_local(x[mine][:, :, h].contiguous(), sp, [Shard(2)])
        td = dtshard.DTensor.from_local(t[mine][:, :, h].contiguous(), sp, [Shard(2)])
        loss = ((model(xd) - td) ** 2).mean()
        with CommCounter() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad()
        rloss = ((ref(x) - t) ** 2).mean()
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        grad_bytes = [sum(p.numel() for p in m.parameters()) * 4 for m in (model[0], model[1], model[2])]
        rs = [r for r in bwd.records if r.kind == "reduce_scatter" and r.op == "<fsdp>"]
        rows.append((loss.full_tensor().item(), rloss.item(),
                     sum(r.kind == "all_reduce" for r in bwd.records),
                     [(r.group_size, r.nbytes) for r in rs], grad_bytes))
    ref_params = dict(ref.named_parameters())
    err = max((p.full_tensor() - ref_params[n].detach()).abs().max().item() for n, p in model.named_parameters())
    placements = {n: str(p.placements) for n, p in model.named_parameters()}
    return rows, err, placements


def test_one_flattened_reduction_for_data_x_spatial():
    res = run_distributed(_data_spatial, 4, timeout=300)
    for rank, (rows, err, placements) in enumerate(res):
        partner = res[rank ^ 2][0]  # same sp coordinate, the other dp replica
        for step, (loss, rloss, n_ar, rs, grad_bytes) in enumerate(rows):
            # each dp replica's loss is over its own 2 images; their mean is the global batch's
            assert abs((loss + partner[step][0]) / 2 - rloss) < 1e-5, (step, loss, rloss)
            assert n_ar == 0, n_ar  # no all_reduce of the spatial partial gradients
            assert len(rs) == 3 and all(g == 4 for g, _ in rs), rs
            # one reduce_scatter over the 4 ranks of each group's (padded) gradient: 3/4 of it sent
            group_bytes = sorted(grad_bytes)
            sent = sorted(nb for _, nb in rs)
            for s, g in zip(sent, group_bytes):
                assert g * 3 / 4 <= s <= g * 3 / 4 + 3 * 4 * 4, (s, g)  # + padding of each piece
        assert err < 1e-5, err
        assert set(placements.values()) == {"(Shard(dim=0),)"}, placements
