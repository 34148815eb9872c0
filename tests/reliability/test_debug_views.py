"""Debug views print what users need, checked as inline expectations."""

from __future__ import annotations

import expecttest
import torch

import dtshard
from dtshard import Partial, Replicate, Shard
from dtshard.testing import run_distributed


def _views(path):
    mesh = dtshard.init_device_mesh("cpu", (2, 2))
    a = dtshard.distribute_tensor(torch.zeros(5, 8), mesh, [Shard(0), Shard(1)])
    b = dtshard.DTensor.from_local(torch.ones(3), mesh, [Replicate(), Partial()])
    with dtshard.debug.CommCounter() as comm:
        a.redistribute(mesh, [Replicate(), Shard(0)])
    return (dtshard.debug.visualize_sharding(a, path=path), dtshard.debug.visualize_sharding(b),
            comm.summary())


class TestDebugViews(expecttest.TestCase):
    def test_visualize_sharding_and_comm_summary(self):
        import os
        import tempfile

        with tempfile.TemporaryDirectory(prefix="dtshard-layout-") as tmp:  # removed afterwards
            path = os.path.join(tmp, "layout.png")
            grid, partial, summary = run_distributed(_views, 4, path)[0]
            drawn = os.path.getsize(path)
        self.assertExpectedInline(grid, """\
DTensor (5, 8) (S(0), S(1)) on mesh (2, 2)
rank  coord     indices 
   0  (0, 0)    0:3, 0:4
   1  (0, 1)    0:3, 4:8
   2  (1, 0)    3:5, 0:4
   3  (1, 1)    3:5, 4:8

    | 0:4 | 4:8
0:3 |  0  |  1 
3:5 |  2  |  3 """)
        self.assertExpectedInline(partial, """\
DTensor (3,) (R, P(sum)) on mesh (2, 2)
rank  coord     indices
   0  (0, 0)    0:3  (partial term)
   1  (0, 1)    0:3  (partial term)
   2  (1, 0)    0:3  (partial term)
   3  (1, 1)    0:3  (partial term)""")
        self.assertExpectedInline(summary, """\
<redistribute>: all_gather x1 on mesh dim 0, 48 bytes
<redistribute>: all_to_all x1 on mesh dim 1, 32 bytes""")
        assert drawn > 1000  # a PNG was drawn


def _per_module():
    mesh = dtshard.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    net[0].weight = torch.nn.Parameter(dtshard.distribute_tensor(net[0].weight.detach(), mesh, [Shard(0)]))
    net[0].bias = torch.nn.Parameter(dtshard.distribute_tensor(net[0].bias.detach(), mesh, [Shard(0)]))
    net[2].weight = torch.nn.Parameter(dtshard.distribute_tensor(net[2].weight.detach(), mesh, [Shard(1)]))
    net[2].bias = torch.nn.Parameter(dtshard.distribute_tensor(net[2].bias.detach(), mesh, [Replicate()]))
    x = dtshard.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])  # batch-sharded input
    with dtshard.debug.CommCounter(module=net) as comm:
        y = net(x).redistribute(mesh, [Replicate()])
        y.to_local().sum().backward()
    return comm.by_module()


class TestPerModule(expecttest.TestCase):
    def test_comm_counter_per_module(self):
        self.assertExpectedInline(run_distributed(_per_module, 2)[0], """\
0: all_gather x1, 32 bytes
<outside module forwards>: all_reduce x1, 64 bytes
<outside module forwards>: all_gather x1, 32 bytes""")
