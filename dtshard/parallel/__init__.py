"""Tensor parallelism on dtshard DTensors: ``torch.distributed.tensor.parallel``'s API.

    from dtshard.parallel import ColwiseParallel, RowwiseParallel, parallelize_module, loss_parallel

Code written for ``torch.distributed.tensor.parallel`` ports by changing that import (placements
and meshes are PyTorch's own classes): the styles distribute parameters with dtshard's
``distribute_tensor`` and annotate inputs/outputs as dtshard DTensors, so every op of the model
then runs through dtshard's rules.
"""

from dtshard.parallel.api import parallelize_module
from dtshard.parallel.loss import loss_parallel
from dtshard.parallel.style import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)

__all__ = [
    "ColwiseParallel",
    "ParallelStyle",
    "PrepareModuleInput",
    "PrepareModuleInputOutput",
    "PrepareModuleOutput",
    "RowwiseParallel",
    "SequenceParallel",
    "parallelize_module",
    "loss_parallel",
]
