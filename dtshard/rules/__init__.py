"""Sharding rules, one file per op family. Importing this package registers them all.

To add a rule see CONTRIBUTING.md: pick the family file, write a function of an OpCall that returns
``(output_placements, input_placements)`` pairs for ONE mesh dim, and decorate it with
``@register_rule(aten.op.overload)``.
"""

from dtshard.rules import (  # noqa: F401  (imported for their registrations)
    adaptive_pool,  # adaptive average pooling on spatial shards (before misc: it has the real rules)
    attention,
    conv, pool,  # spatial sharding through halo exchange (dtshard/halo.py)
    embedding,
    foreach,
    indexing,
    loss,
    matmul,
    norm,
    norm_extra,
    pointwise,
    random,
    reduction,
    tensor_ops,
    upsample,  # interpolation and reflect/replicate padding on spatial shards
    view,
)
from dtshard.rules import misc  # noqa: F401,E402  (last: replicate-only fallbacks where no family has a rule)
