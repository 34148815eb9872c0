"""Tensor-parallel training demo: dtshard vs the same model in one process.

    python -m dtshard.demo                       # spawns 2 CPU processes (gloo)
    python -m dtshard.demo --steps 10 --world-size 4
    python -m dtshard.demo --model llama         # the Llama-style model of dtshard.models, AdamW
    python -m dtshard.demo --model llama --fsdp  # the same with FSDP (dtshard.fsdp.fully_shard), 2 ranks
    python -m dtshard.demo --dp 2 --tp 2         # FSDP x TP on a 2x2 (dp, tp) mesh, 4 ranks
    python -m dtshard.demo --model cnn           # the UNet of dtshard.models, images sharded on H
    python -m dtshard.demo --model unet3d        # a 3-D UNet, volumes sharded on D x H (2x2, 4 ranks)
    python -m dtshard.demo --model unet3d --world-size 2   # ... sharded on D over 2 ranks
    torchrun --nproc-per-node 2 -m dtshard.demo  # or let torchrun start the ranks

The default model (``--model block``): a transformer block (layer_norm -> multi-head self-attention
with heads sharded -> residual -> layer_norm -> MLP -> residual) is written once, as ordinary
``torch.nn`` code.  Every rank builds it from the same seed twice: once as a plain single-process
model (the reference) and once with its parameters turned into dtshard DTensors the Megatron way:

- column-parallel (``Shard(0)`` weight and bias): attention q/k/v projections, MLP fc1;
- row-parallel (``Shard(1)`` weight, replicated bias): attention output projection, MLP fc2;
- replicated: layer_norm weights and biases.

Both models train for a few SGD steps on an mse_loss against a fixed target.  Each step prints both
losses, the largest deviation of the loss and of every weight (``full_tensor()`` of each DTensor
parameter against the plain parameter, on every rank) and the collectives dtshard issued (counted by
``dtshard.debug.CommCounter``).  The exit status is non-zero when a deviation exceeds the tolerance
or anything fails.

The model code uses only ``torch`` and the public dtshard API that mirrors
``torch.distributed.tensor`` (``distribute_tensor``, ``distribute_module``, ``Shard``,
``Replicate``, ``init_device_mesh``): replace ``dtshard`` by ``torch.distributed.tensor`` in the
imports of :func:`shard_block` and it runs on PyTorch's DTensor.

``--model llama``: the Llama-style decoder of :mod:`dtshard.models` (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU, an untied LM head) parallelized with torchtitan's tensor +
sequence parallel plan through ``dtshard.parallel`` (PyTorch's ``parallelize_module`` API), trained
with ``torch.optim.AdamW`` on a next-token cross-entropy computed under ``loss_parallel()`` (the
logits stay sharded on the vocabulary).  When the k/v heads divide by the number of ranks the
projections hand local shards to the attention body (torchtitan's plan); otherwise (4 ranks, 2 k/v
heads) the plan keeps DTensors throughout and attention runs on DTensors.

``--model cnn``: the UNet of :mod:`dtshard.models` trained with plain SGD, with the images sharded
on H (convolutions and pooling exchange halos with their neighbours).

``--model unet3d``: :class:`dtshard.models.UNet3d` (conv3d, GroupNorm, SiLU, strided-conv
downsampling, transposed-conv upsampling, skip concatenation) trained with SGD on volumes sharded
on D x H over a 2x2 mesh (4 ranks, the default for this model) or on D (any other world size),
parameters replicated; per step the halo exchanges and their bytes, and at the end each rank's
peak activation memory of one forward + backward against one process's.

One module per demo (``block``, ``llama``, ``cnn``, ``unet3d``); ``cli`` is the command line and
``_report`` the report code they share.
"""

from dtshard.demo.block import MLP, Block, Config, SelfAttention, shard_block, train_worker  # noqa: F401
from dtshard.demo.cli import main  # noqa: F401
from dtshard.demo.cnn import train_cnn_worker  # noqa: F401
from dtshard.demo.llama import _llama_step_ok, train_llama_worker  # noqa: F401
from dtshard.demo.unet3d import train_unet3d_worker  # noqa: F401

#: the demos' workers (``python -m dtshard.demo`` launches them by name) and the block demo's model,
#: which the compile tests reuse
__all__ = ["Block", "Config", "MLP", "SelfAttention", "main", "shard_block", "train_worker", "train_cnn_worker",
           "train_unet3d_worker", "train_llama_worker"]
