"""dtshard: distributed tensors for PyTorch.

A drop-in for ``torch.distributed.tensor``: the same placements (``Shard``, ``Replicate``,
``Partial``), meshes (``DeviceMesh``, ``init_device_mesh``) and API, implemented as a
``__torch_dispatch__`` subclass whose every op goes through a sharding-rule registry.
"""

from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.placement_types import Partial, Placement, Replicate, Shard

from dtshard import rules as _rules  # noqa: F401  (registers the built-in rules)
from dtshard import debug  # noqa: F401  (dtshard.debug.*)
from dtshard import experimental  # noqa: F401  (dtshard.experimental.implicit_replication)
from dtshard import composites as _composites
from dtshard import grad_buckets as _grad_buckets  # noqa: F401  (plugs in through dtshard.hooks: gradient buckets)

from dtshard.collectives import init_device_mesh
from dtshard.factories import empty, full, ones, rand, randn, zeros
from dtshard.propagate import NoMetaKernelError, NoRuleError, RuleError, config
from dtshard.registry import OpCall, override, register_handler, register_rule
from dtshard.spec import DTensorSpec, TensorMeta
from dtshard.distribute import distribute_module, distribute_tensor
from dtshard.tensor import DTensor

__all__ = [
    "DTensor",
    "DTensorSpec",
    "DeviceMesh",
    "NoMetaKernelError",
    "NoRuleError",
    "OpCall",
    "Partial",
    "Placement",
    "Replicate",
    "RuleError",
    "Shard",
    "TensorMeta",
    "config",
    "debug",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "experimental",
    "full",
    "init_device_mesh",
    "ones",
    "rand",
    "randn",
    "override",
    "register_handler",
    "register_rule",
    "replicate_fallback",
    "zeros",
]

__version__ = "0.1.0"

_composites.register()


class replicate_fallback:
    """Context manager (or call ``dtshard.config.fallback_to_replicate = True``): ops without a
    rule run on Replicate inputs instead of raising; each such op warns once."""

    def __enter__(self):
        self._old = config.fallback_to_replicate
        config.fallback_to_replicate = True
        return self

    def __exit__(self, *exc):
        config.fallback_to_replicate = self._old
        return False
