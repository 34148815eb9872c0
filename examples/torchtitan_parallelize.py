"""torchtitan's own Llama 3 parallelize code, run on dtshard.

torchtitan (https://github.com/pytorch/torchtitan) applies tensor parallelism and FSDP2 to its
Llama 3 in ``torchtitan/models/llama3/infra/parallelize.py`` (``apply_tp``, ``apply_fsdp``), with
names it imports from ``torch.distributed.tensor``, ``torch.distributed.tensor.parallel`` and
``torch.distributed.fsdp``.  This script points exactly those names of torchtitan's module at
dtshard's (``use_dtshard`` below: the change a user makes to their imports) and then runs
torchtitan's own code, unchanged:

1. the 2x2 mesh from torchtitan's ``ParallelDims`` (``init_device_mesh`` + ``_flatten``:
   ``dp_shard`` x ``tp``, and the flattened ``dp_shard_cp`` mesh FSDP shards over);
2. torchtitan's ``Transformer`` built on ``meta``;
3. torchtitan's ``apply_tp`` (embedding, sequence-parallel norms, column/row-wise attention and
   feed-forward, loss-parallel output) and ``apply_fsdp`` (each block, ``[norm, output]`` as one
   group, the embedding, the root; a mixed-precision policy);
4. ``to_empty`` and torchtitan's ``init_weights`` (dtshard's random numbers do not depend on the
   sharding, so the sharded model starts bit for bit where one process does);
5. AdamW steps with ``clip_grad_norm_`` and torchtitan's cross-entropy under ``loss_parallel``.

It checks the losses and final parameters against one process training torchtitan's model with
the same seed and data, and prints both.

Needs torchtitan (not a dependency of dtshard or of its tests); torchtitan 0.2.0 is the version
this was written against:

    python -m venv tt && . tt/bin/activate
    pip install torch==2.13.0 && pip install . torchtitan==0.2.0
    python examples/torchtitan_parallelize.py             # spawns 4 CPU processes (gloo)
    torchrun --nproc-per-node 4 examples/torchtitan_parallelize.py
"""

from __future__ import annotations

import os
import sys

import torch

STEPS, LR, MAX_NORM = 4, 1e-3, 1.0
BATCH, SEQ = 4, 16  # per step: BATCH sequences, split over the 2 dp ranks


def model_args():
    from torchtitan.models.llama3 import TransformerModelArgs

    # small enough for a CPU; heads, kv heads, vocab and the sequence divide by tp = 2
    return TransformerModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256,
                                multiple_of=32, max_seq_len=SEQ)


def use_dtshard(module) -> None:
    """Point the torch.distributed names ``module`` imported at dtshard's (its import lines,
    changed).  Placements are PyTorch's own classes in dtshard too; they are set for clarity."""
    import dtshard
    import dtshard.fsdp
    import dtshard.parallel

    for name, value in {
        "Replicate": dtshard.Replicate, "Shard": dtshard.Shard,
        "parallelize_module": dtshard.parallel.parallelize_module,
        "ColwiseParallel": dtshard.parallel.ColwiseParallel,
        "RowwiseParallel": dtshard.parallel.RowwiseParallel,
        "SequenceParallel": dtshard.parallel.SequenceParallel,
        "PrepareModuleInput": dtshard.parallel.PrepareModuleInput,
        "fully_shard": dtshard.fsdp.fully_shard,
        "MixedPrecisionPolicy": dtshard.fsdp.MixedPrecisionPolicy,
        "CPUOffloadPolicy": dtshard.fsdp.CPUOffloadPolicy,
    }.items():
        assert hasattr(module, name), f"torchtitan's {module.__name__} no longer imports {name}"
        setattr(module, name, value)


def batches():
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(0, model_args().vocab_size, (BATCH, SEQ + 1), generator=g) for _ in range(STEPS)]


def one_process():
    """torchtitan's model and loss in one process: the reference."""
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.models.llama3 import Transformer

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(model_args())
    model.to_empty(device="cpu")
    model.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    losses = []
    for tokens in batches():
        loss = cross_entropy_loss(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, init, {n: p.detach().clone() for n, p in model.named_parameters()}


def train_on_dtshard():
    import torch.distributed as dist

    import dtshard.parallel
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer
    from torchtitan.models.llama3.infra import parallelize as titan

    use_dtshard(titan)
    # torchtitan assumes an accelerator (its device_type is "cuda" when it finds none); these
    # ranks are CPU processes on gloo
    from torchtitan.distributed import parallel_dims
    parallel_dims.device_type = "cpu"
    dims = ParallelDims(dp_replicate=1, dp_shard=2, cp=1, tp=2, pp=1, ep=1, etp=1,
                        world_size=dist.get_world_size())
    mesh = dims.world_mesh  # ("dp_shard", "tp"), and the flattened "dp_shard_cp"

    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(model_args())
    # torchtitan's own functions, as its parallelize_llama calls them
    titan.apply_tp(model, mesh["tp"], loss_parallel=True, enable_float8_tensorwise_tp=False)
    titan.apply_fsdp(model, mesh["dp_shard_cp"], param_dtype=torch.float32,
                     reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights()
    init = {n: p.full_tensor() for n, p in model.named_parameters()}
    layouts = {n: str(p.placements) for n, p in model.named_parameters()}

    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    dp = mesh["dp_shard_cp"].get_local_rank()
    mine = slice(dp * BATCH // 2, (dp + 1) * BATCH // 2)
    losses = []
    for tokens in batches():
        with dtshard.parallel.loss_parallel():
            loss = cross_entropy_loss(model(tokens[mine, :-1]), tokens[mine, 1:])
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        # each dp rank's loss is the mean over its own sequences; their mean is the global loss
        mean = loss.full_tensor().detach().clone()
        dist.all_reduce(mean, group=mesh["dp_shard_cp"].get_group())
        losses.append(mean.item() / mesh["dp_shard_cp"].size())
    final = {n: p.full_tensor() for n, p in model.named_parameters()}
    return losses, init, final, layouts


def _main() -> int:
    from dtshard.testing import launch

    ref_losses, ref_init, ref_params = one_process()

    results = launch(train_on_dtshard, 4)
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun: rank 0 reports
        return 0
    ok = True
    losses, init, final, layouts = results[0]
    print("torchtitan's Llama 3, apply_tp + apply_fsdp on dtshard, 2 (dp_shard) x 2 (tp) gloo ranks")
    for n in list(layouts)[:4] + ["output.weight"]:
        print(f"  {n:40s} {layouts[n]}")
    init_equal = all(torch.equal(init[n], ref_init[n]) for n in ref_init)
    print(f"init_weights equal to one process's, bit for bit: {init_equal}")
    ok &= init_equal
    print(f"{'step':>4} {'dtshard loss':>14} {'one process':>14}")
    for i, (a, b) in enumerate(zip(losses, ref_losses)):
        print(f"{i:>4} {a:14.8f} {b:14.8f}")
    loss_err = max(abs(a - b) for a, b in zip(losses, ref_losses))
    param_err = max((final[n] - ref_params[n]).abs().max().item() for n in ref_params)
    print(f"largest loss difference {loss_err:.2e}, largest parameter difference {param_err:.2e}")
    ok &= loss_err < 1e-4 and param_err < 1e-4
    ok &= all(r[0] == losses for r in results)  # every rank saw the same global losses
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(_main())
