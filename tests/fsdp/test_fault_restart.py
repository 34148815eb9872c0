"""Faults lose no work: FSDP training checkpointed with DCP every step; a rank that dies mid-step
makes the run fail fast with a clear error on every rank (no hang), and a run restarted from the
last checkpoint (model + optimizer + step) reproduces the uninterrupted run's losses exactly."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn as nn

import dtshard
from dtshard.fsdp import fully_shard
from dtshard.models import ResidualMLP
from dtshard.testing import DistributedTestError, run_distributed


Block = ResidualMLP


def _model(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), Block(7, 9), Block(7, 9), nn.Linear(7, 3))
    for b in model[1:3]:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)


def _train(path: str, start: int, stop: int, die_at: int | None = None):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    rank = dist.get_rank()
    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    model = _model(mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if start > 0:
        # the optimizer state must exist (in its sharded layout) to be loaded into: one step, then
        # everything, parameters included, comes from the checkpoint
        x, y = _batch(0, rank)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": torch.tensor(0)}
        dcp.load(state, checkpoint_id=os.path.join(path, f"step{start - 1}"))
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        assert int(state["step"]) == start - 1
    losses = []
    for step in range(start, stop):
        x, y = _batch(step, rank)
        loss = ((model(x) - y) ** 2).mean()
        if step == die_at and rank == 1:
            os._exit(7)  # this rank dies mid-step (forward done, before the backward's collectives)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        dcp.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": torch.tensor(step)},
                 checkpoint_id=os.path.join(path, f"step{step}"))
    return losses


def test_a_dead_rank_fails_fast_and_a_restart_reproduces_the_run(tmp_path):
    straight = run_distributed(_train, 2, str(tmp_path / "a"), 0, 6)
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as err:
        run_distributed(_train, 2, str(tmp_path / "b"), 0, 6, 3, timeout=120)
    elapsed = time.monotonic() - t0
    msg = str(err.value)
    assert "rank 1" in msg and ("exit" in msg or "died" in msg), msg
    assert elapsed < 60, elapsed  # well within the process-group timeout of the pool, no hang
    # steps 0..2 were checkpointed before the failure: restart from step 2's checkpoint
    resumed = run_distributed(_train, 2, str(tmp_path / "b"), 3, 6)
    for rank in range(2):
        assert resumed[rank] == straight[rank][3:], (resumed[rank], straight[rank][3:])

