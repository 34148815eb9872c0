"""Full (gathered) model state dicts of dtshard models: ``dtshard.checkpoint`` against one process
and against PyTorch's FSDP2 with PyTorch's own ``get_model_state_dict`` / ``set_model_state_dict``
on the same model (PyTorch's helpers do not recognise dtshard's DTensor: with
``full_state_dict=True`` they would return its shards as they are)."""

from __future__ import annotations

import torch
import torch.nn as nn

import dtshard
from dtshard.testing import run_distributed


def _model(seed, hidden=7):
    """7 hidden rows: 4 + 3 on 2 ranks for FSDP; a TP plan's local outputs need an even split (8)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, hidden), nn.ReLU(), nn.Linear(hidden, 3))


def _full_state_dicts():
    import torch.distributed.checkpoint.state_dict as tsd
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import dtshard.checkpoint as dsd
    import dtshard.parallel as dp
    from dtshard.fsdp import fully_shard

    mesh = dtshard.init_device_mesh("cpu", (2,))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    full_opts = tsd.StateDictOptions(full_state_dict=True)
    out = {}

    def tp(m):
        return dp.parallelize_module(m, mesh, {"0": dp.ColwiseParallel(), "2": dp.RowwiseParallel()})

    for name, shard, hidden in (("fsdp", lambda m: fully_shard(m, mesh=mesh), 7), ("tp", tp, 8)):
        ref = _model(0, hidden)
        full = {k: v.clone() for k, v in ref.state_dict().items()}
        m = _model(1, hidden)  # other values: the load must replace them
        shard(m)
        res = dsd.set_model_state_dict(m, full, options=full_opts)
        y = m(dtshard.distribute_tensor(x, mesh, [dtshard.Replicate()]) if name == "tp" else x)
        y = y.full_tensor() if isinstance(y, dtshard.DTensor) else y
        got = dsd.get_model_state_dict(m, options=full_opts)
        offloaded = dsd.get_model_state_dict(m, options=tsd.StateDictOptions(full_state_dict=True, cpu_offload=True))
        out[name] = dict(
            keys=(list(res.missing_keys), list(res.unexpected_keys)),
            # (FSDP gathers the whole weights: the same matmul; TP sums two partial products)
            output=torch.equal(y, ref(x)) if name == "fsdp" else torch.allclose(y, ref(x), rtol=1e-6, atol=1e-6),
            layouts={k: str(tuple(p.placements)) for k, p in m.named_parameters()},
            full={k: type(v) is torch.Tensor and torch.equal(v, full[k]) for k, v in got.items()},
            offloaded=sorted(offloaded))
    # PyTorch's FSDP2 and its own helpers on the same model: the same full state dict
    full = {k: v.clone() for k, v in _model(0).state_dict().items()}
    tm = _model(1)
    torch_fully_shard(tm, mesh=mesh)
    tsd.set_model_state_dict(tm, dict(full), options=full_opts)  # (PyTorch's replaces the dict's values)
    theirs = tsd.get_model_state_dict(tm, options=full_opts)
    ours = dsd.get_model_state_dict(out.setdefault("_m", _model(1)), options=full_opts)  # a plain model too
    out["torch"] = {k: torch.equal(v.full_tensor() if hasattr(v, "full_tensor") else v, full[k])
                    for k, v in theirs.items()}
    out["plain"] = sorted(ours) == sorted(full)
    try:
        dsd.set_model_state_dict(_model(1), full, options=tsd.StateDictOptions(full_state_dict=True,
                                                                                broadcast_from_rank0=True))
        out["broadcast"] = "no error"
    except NotImplementedError as e:
        out["broadcast"] = "broadcast_from_rank0" in str(e)
    del out["_m"]
    return out


def test_full_state_dict_round_trip_on_fsdp_and_tp_models():
    for rank, out in enumerate(run_distributed(_full_state_dicts, 2)):
        for name in ("fsdp", "tp"):
            o = out[name]
            assert o["keys"] == ([], []), (rank, name, o)
            assert o["output"], (rank, name)  # the loaded model computes what one process does
            assert all(o["full"].values()) and len(o["full"]) == 4, (rank, name, o["full"])
            assert o["offloaded"] == (sorted(o["full"]) if rank == 0 else []), (rank, name, o["offloaded"])
        assert out["fsdp"]["layouts"]["0.weight"] == "(Shard(dim=0),)", out["fsdp"]["layouts"]
        assert out["tp"]["layouts"] == {"0.weight": "(Shard(dim=0),)", "0.bias": "(Shard(dim=0),)",
                                        "2.weight": "(Shard(dim=1),)", "2.bias": "(Replicate(),)"}, out["tp"]
        assert all(out["torch"].values()) and len(out["torch"]) == 4, out["torch"]
        assert out["plain"] and out["broadcast"] is True, out
