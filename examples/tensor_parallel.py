"""A tensor-parallel training script written for ``torch.distributed.tensor``, run on dtshard.

It follows PyTorch's own tensor-parallel example (a two-layer MLP, ``ColwiseParallel`` then
``RowwiseParallel`` through ``parallelize_module``, SGD on a replicated batch).  The ONLY lines
that differ from the PyTorch version are the two imports between the markers below; swap them
for ``torch.distributed.tensor`` / ``torch.distributed.tensor.parallel`` and the same file runs on
PyTorch's DTensor (``tests/dropin/test_example_script.py`` runs it both ways and compares).

    python examples/tensor_parallel.py            # spawns 2 CPU processes (gloo)
    torchrun --nproc-per-node 2 examples/tensor_parallel.py
"""

import os
import sys

import torch
import torch.nn as nn

# --- imports: the only lines that differ from the torch.distributed.tensor version ---
from dtshard import Replicate, Shard, distribute_tensor, init_device_mesh
from dtshard.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
# --- end of imports ---


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.in_proj = nn.Linear(10, 32)
        self.relu = nn.ReLU()
        self.out_proj = nn.Linear(32, 5)

    def forward(self, x):
        return self.out_proj(self.relu(self.in_proj(x)))


def train(steps: int = 5) -> list[float]:
    world = int(os.environ.get("WORLD_SIZE", torch.distributed.get_world_size()))
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = parallelize_module(ToyModel(), mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    assert model.in_proj.weight.placements == (Shard(0),)
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    losses = []
    for step in range(steps):
        torch.manual_seed(step)  # the same batch on every rank: the TP group shares its input
        x = torch.rand(20, 10)
        y = distribute_tensor(torch.rand(20, 5), mesh, [Replicate()]).to_local()
        out = model(x)
        loss = ((out - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _main():
    from dtshard.testing import launch

    results = launch(train, 2)
    print("losses per rank:", results)
    return 0 if all(r == results[0] for r in results) else 1


if __name__ == "__main__":
    sys.exit(_main())
