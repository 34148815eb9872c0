"""``fully_shard([m1, m2])``: one group for several modules (PyTorch FSDP2's list form), gathered
when the first of them runs and freed after the last; numerics against one process."""

from __future__ import annotations

import torch
import torch.nn as nn

import dtshard
from dtshard.fsdp import fully_shard
from dtshard.models import ResidualMLP
from dtshard.testing import run_distributed


Block = ResidualMLP


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


class Head(nn.Module):
    """A root whose input and output layers are grouped by one fully_shard call on a list."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList([Block(7, 9), Block(7, 9)])
        self.out = nn.Linear(7, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _module_list():
    import torch.distributed as dist

    from dtshard.debug import CommCounter

    rank = dist.get_rank()
    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    model, ref = Head(), Head()
    ref.load_state_dict(model.state_dict())
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    grouped = fully_shard([model.inp, model.out], mesh=mesh)  # one group for two modules
    fully_shard(model, mesh=mesh)  # the root owns nothing left
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    rows = []
    for step in range(4):
        x, y = _batch(step, 0)
        xs, ys = x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]
        with CommCounter() as c:
            loss = ((model(xs) - ys) ** 2).mean()
            loss.backward()
        opt.step()
        opt.zero_grad()
        rl = ((ref(x) - y) ** 2).mean()
        rl.backward()
        ropt.step()
        ropt.zero_grad()
        rows.append((c.count("all_gather"), c.count("reduce_scatter")))
    err = max((p.full_tensor() - q.detach()).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    same_state = model.inp._dtshard_fsdp is model.out._dtshard_fsdp
    return rows, err, same_state, isinstance(grouped, list), [type(m).__name__ for m in grouped]


def test_fully_shard_on_a_list_of_modules():
    for rows, err, same_state, is_list, names in run_distributed(_module_list, 2):
        assert same_state and is_list and names == ["FSDPLinear", "FSDPLinear"]
        # groups: 2 blocks + the [inp, out] group (the root owns no parameter): gathered once in
        # forward each; in backward the blocks again (resharded after forward), the list group is
        # freed after out's forward too (it is not the root), so gathered again; one reduce each
        for ag, rs in rows:
            assert (ag, rs) == (6, 3), rows
        assert err < 1e-5, err
