"""``dtshard.fsdp``: fully sharded data parallelism with PyTorch 2.13's FSDP2 API.

For example::

    from dtshard.fsdp import fully_shard, MixedPrecisionPolicy
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)

User code written for ``torch.distributed.fsdp.fully_shard`` changes only its import.  The policy
classes are PyTorch's own.  See :func:`fully_shard` and ``dtshard/fsdp/_group.py`` (layout).
"""

from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

try:  # PyTorch 2.13's SPMD form of fully_shard (dp_mesh_dims); older versions lack it
    from torch.distributed.fsdp import DataParallelMeshDims
except ImportError:  # pragma: no cover
    DataParallelMeshDims = None

from dtshard.fsdp._api import (FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method,
                               share_comm_ctx)

__all__ = ["CPUOffloadPolicy", "DataParallelMeshDims", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy",
           "UnshardHandle", "fully_shard", "register_fsdp_forward_method", "share_comm_ctx"]
