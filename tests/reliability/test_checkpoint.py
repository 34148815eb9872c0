"""torch.distributed.checkpoint with dtshard parameters: save in one sharding, load in another
(and on another number of ranks); optimizer state too; Partial refused with a clear error."""

from __future__ import annotations

import torch

import dtshard
from dtshard import Partial, Replicate, Shard
from dtshard.testing import run_distributed


def _model(mesh, placements_w, placements_b):
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 5)
    full_w, full_b = lin.weight.detach().clone(), lin.bias.detach().clone()
    lin.weight = torch.nn.Parameter(dtshard.distribute_tensor(lin.weight.detach(), mesh, placements_w))
    lin.bias = torch.nn.Parameter(dtshard.distribute_tensor(lin.bias.detach(), mesh, placements_b))
    return lin, full_w, full_b


def _save(path):
    import torch.distributed.checkpoint as dcp

    mesh = dtshard.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    lin, full_w, full_b = _model(mesh, [Shard(0)], [Shard(0)])
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, foreach=False)
    x = dtshard.distribute_tensor(torch.randn(3, 6), mesh, [Replicate()])
    lin(x).sum().backward()
    opt.step()
    dcp.save({"model": lin.state_dict(), "optim": opt.state_dict()}, checkpoint_id=path)
    return (lin.weight.full_tensor(), lin.bias.full_tensor(),
            opt.state[lin.weight]["exp_avg"].full_tensor())


def _load(path, placements_w):
    import torch.distributed.checkpoint as dcp

    mesh = dtshard.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    torch.manual_seed(1)  # different initial values: everything must come from the checkpoint
    lin = torch.nn.Linear(6, 5)
    lin.weight = torch.nn.Parameter(dtshard.distribute_tensor(torch.zeros(5, 6), mesh, [placements_w]))
    lin.bias = torch.nn.Parameter(dtshard.distribute_tensor(torch.zeros(5), mesh, [Replicate()]))
    opt = torch.optim.AdamW(lin.parameters(), lr=0.1, foreach=False)
    x = dtshard.distribute_tensor(torch.randn(3, 6), mesh, [Replicate()])
    lin(x).sum().backward()
    opt.step()  # creates optimizer state of the right layout to load into
    state = {"model": lin.state_dict(), "optim": opt.state_dict()}
    dcp.load(state, checkpoint_id=path)
    lin.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    assert lin.weight.placements == (placements_w,)
    return (lin.weight.full_tensor(), lin.bias.full_tensor(),
            opt.state[lin.weight]["exp_avg"].full_tensor())


def test_save_shard0_on_2_load_replicate_shard1_and_on_4_ranks(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(_save, 2, path)[0]
    for world, placement in [(2, Replicate()), (2, Shard(1)), (4, Shard(1)), (3, Shard(0))]:
        for got in run_distributed(_load, world, path, placement):
            for g, want in zip(got, saved):
                torch.testing.assert_close(g, want, rtol=0, atol=0)


def _partial_refused(path):
    import torch.distributed.checkpoint as dcp

    mesh = dtshard.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    p = dtshard.DTensor.from_local(torch.ones(2, 2), mesh, [Partial()])
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        dcp.save({"p": p}, checkpoint_id=path)
    except (Exception, CheckpointException) as e:
        return str(e)
    return "no error"


def test_partial_is_refused_with_a_clear_error(tmp_path):
    for msg in run_distributed(_partial_refused, 2, str(tmp_path / "p")):
        assert "cannot checkpoint" in msg and "Partial" in msg and "redistribute" in msg, msg
