"""torchtitan's training flow, step by step, on dtshard and on PyTorch's DTensor + FSDP2 side by side
(issue #27): a Llama-style model built on ``meta``; meshes made by ``_unflatten`` from a 1-D world
mesh (as torchtitan's ``ParallelDims``); tensor parallelism with ``parallelize_module``;
``fully_shard`` per block and on the root with a mixed-precision policy; ``to_empty``; the model's
own ``init_weights``; 3 AdamW steps with ``clip_grad_norm_``; a DCP save of the model and
optimizer state dicts (``get_state_dict``); a load into a fresh ``meta``-built model on ANOTHER
layout (FSDP over the 4 ranks, no TP); one more step.  Losses, gradient norms and the final
parameters must match PyTorch's run of the same code, and dtshard's ``init_weights`` must equal
one process's bit for bit (sharding-invariant random numbers; PyTorch's per-shard draws cannot:
its run copies the single-process values in instead).  4 ranks, one ``run_distributed`` call.

The model keeps fp64 master weights and computes in fp32 (``param_dtype=float32``,
``reduce_dtype=float64``), so the two libraries agree to fp32 rounding and a wrong shard cannot
hide in a loose bound.
"""
from __future__ import annotations

import math
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtshard.models import LlamaConfig, Transformer, parallelize, rope_tables
from dtshard.testing import run_distributed

STEPS_BEFORE, LR, MAX_NORM = 3, 1e-2, 0.5  # the gradient norms are 0.75-0.79: every step clips


class TitanLlama(Transformer):
    """``dtshard.models.Transformer`` initialised as torchtitan's Llama is: nothing at construction
    (it may be on ``meta``), everything in ``init_weights()`` after ``to_empty`` (the rope tables
    again, since ``to_empty`` leaves buffers uninitialised)."""

    def _init_weights(self) -> None:
        pass

    def init_buffers(self) -> None:
        cfg = self.cfg
        cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        with torch.no_grad():
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    def init_weights(self, copy_from=None) -> None:
        self.init_buffers()
        cfg = self.cfg
        if copy_from is not None:  # PyTorch's run: the single-process values, laid out
            with torch.no_grad():
                for p, v in zip(self.parameters(), copy_from):
                    p.copy_(v)
            return
        nn.init.normal_(self.tok_embeddings.weight)
        for i, layer in enumerate(self.layers):
            depth_std = 0.02 / math.sqrt(2 * (i + 1))
            for lin in (layer.attention.wq, layer.attention.wk, layer.attention.wv, layer.feed_forward.w1):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=0.02)
            for lin in (layer.attention.wo, layer.feed_forward.w2, layer.feed_forward.w3):
                nn.init.trunc_normal_(lin.weight, mean=0.0, std=depth_std)
            nn.init.ones_(layer.attention_norm.weight)
            nn.init.ones_(layer.ffn_norm.weight)
        nn.init.ones_(self.norm.weight)
        bound = 3 * cfg.dim ** -0.5
        nn.init.trunc_normal_(self.output.weight, mean=0.0, std=cfg.dim ** -0.5, a=-bound, b=bound)


def _libs(name):
    if name == "dtshard":
        import dtshard
        import dtshard.parallel as tp
        from dtshard.fsdp import MixedPrecisionPolicy, fully_shard

        return dtshard.init_device_mesh, tp, fully_shard, MixedPrecisionPolicy, dtshard.distribute_tensor
    import torch.distributed.tensor as tdt
    import torch.distributed.tensor.parallel as tp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    return init_device_mesh, tp, fully_shard, MixedPrecisionPolicy, tdt.distribute_tensor


def _build(lib, layout):
    """A meta-built model laid out as torchtitan's parallelize does: TP on the "tp" dim of an
    ``_unflatten``-ed world mesh, then fully_shard per block and the root on "dp" (layout "2x2"),
    or FSDP only over the flat world mesh (layout "fsdp4")."""
    init_mesh, tp, fully_shard, MixedPrecisionPolicy, _ = _libs(lib)
    world = init_mesh("cpu", (4,), mesh_dim_names=("world",))
    with torch.device("meta"):
        model = TitanLlama(LlamaConfig()).double()
    if layout == "2x2":
        mesh = world._unflatten(0, (2, 2), ("dp", "tp"))
        parallelize(model, mesh["tp"], tp, local_output=True)
        dp = mesh["dp"]
    else:
        dp = world
    policy = MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float64)
    for block in model.layers:
        fully_shard(block, mesh=dp, mp_policy=policy)
    fully_shard(model, mesh=dp, mp_policy=policy)
    model.to_empty(device="cpu")
    return model, dp


def _step(lib, model, opt, dp, step):
    _, tp, *_ = _libs(lib)
    cfg = model.cfg
    tokens = torch.randint(0, cfg.vocab_size, (8, 9), generator=torch.Generator().manual_seed(100 + step))
    n, me = dp.size(), dp.get_local_rank()
    rows = 8 // n
    x, y = tokens[rows * me:rows * (me + 1), :-1], tokens[rows * me:rows * (me + 1), 1:]
    with tp.loss_parallel():
        logits = model(x)
        loss = F.cross_entropy(logits.double().flatten(0, 1), y.flatten(0, 1))
        loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    opt.zero_grad()
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t
    # the data-parallel mean of the per-rank losses (a plain all_reduce of the scalars)
    value = full(loss).detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size(), full(norm).item()


def _flow(lib, ckpt_dir, init_values):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp

    model, dp = _build(lib, "2x2")
    torch.manual_seed(0)
    model.init_weights(copy_from=None if lib == "dtshard" else _laid_out(lib, model, init_values))
    full = lambda t: t.full_tensor() if hasattr(t, "full_tensor") else t.detach()
    init = {n: full(p) for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    trace = [_step(lib, model, opt, dp, s) for s in range(STEPS_BEFORE)]
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ckpt_dir)

    fresh, dp2 = _build(lib, "fsdp4")  # another layout
    fresh.init_buffers()  # the parameters: whatever to_empty left; the load overwrites them
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=LR)
    msd2, osd2 = get_state_dict(fresh, opt2)
    state = {"model": msd2, "optim": osd2}
    dcp.load(state, checkpoint_id=ckpt_dir)
    set_state_dict(fresh, opt2, model_state_dict=state["model"], optim_state_dict=state["optim"])
    loaded_ok = all(torch.equal(full(p), full(q)) for p, q in zip(fresh.parameters(), model.parameters()))
    trace.append(_step(lib, fresh, opt2, dp2, STEPS_BEFORE))
    params = {n: full(p) for n, p in fresh.named_parameters()}
    layout = {n: str(tuple(p.placements)) for n, p in model.named_parameters()}
    return init, trace, params, loaded_ok, layout


def _laid_out(lib, model, values):
    """values (name -> global tensor) laid out like model's parameters, in parameter order."""
    *_, distribute = _libs(lib)
    names = [n for n, _ in model.named_parameters()]
    return [distribute(values[n].to(p.dtype), p.device_mesh, p.placements)
            for n, p in zip(names, model.parameters())]


def _run_both(base):
    # one process: the reference init
    ref = TitanLlama(LlamaConfig()).double()
    torch.manual_seed(0)
    ref.init_weights()
    want = {n: p.detach() for n, p in ref.named_parameters()}
    out = {}
    for lib in ("dtshard", "torch"):
        out[lib] = _flow(lib, os.path.join(base, f"titan-{lib}"), want)
    ours, theirs = out["dtshard"], out["torch"]
    init_exact = all(torch.equal(ours[0][n], want[n]) for n in want)
    param_err = max((ours[2][n] - theirs[2][n]).abs().max().item() for n in want)
    return init_exact, ours[1], theirs[1], param_err, ours[3], theirs[3], ours[4], theirs[4]


def test_torchtitan_flow_matches_pytorch(tmp_path):
    for rank, (init_exact, ours, theirs, param_err, ours_loaded, theirs_loaded, layout, tlayout) in enumerate(
            run_distributed(_run_both, 4, str(tmp_path), timeout=600)):
        assert init_exact, rank  # init_weights on the 2x2 layout == one process, bit for bit
        assert layout == tlayout, (rank, layout, tlayout)
        assert layout["layers.0.attention.wq.weight"] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", layout
        assert ours_loaded and theirs_loaded, rank  # the other layout loaded the same values
        assert len(ours) == STEPS_BEFORE + 1
        for (loss, norm), (tloss, tnorm) in zip(ours, theirs):
            assert abs(loss - tloss) <= 1e-6 * abs(tloss), (rank, ours, theirs)
            assert abs(norm - tnorm) <= 1e-5 * abs(tnorm), (rank, ours, theirs)
        assert param_err < 1e-6, (rank, param_err)
