"""Sharding rules, one file per op family. Importing this package registers them all.

To add a rule see CONTRIBUTING.md: pick the family file, write a function of an OpCall that returns
``(output_placements, input_placements)`` pairs for ONE mesh dim, and decorate it with
``@register_rule(aten.op.overload)``.
"""

# the windowed-op family (halo exchange, convolution, pooling, interpolation) lives in
# dtshard/spatial/; it registers its rules and handlers here, in this order, like the others
from dtshard.spatial import adaptive_pool  # noqa: F401,I001  (before misc: it has the real rules)
from dtshard.rules import attention  # noqa: F401
from dtshard.rules import attention_cp  # noqa: F401  (context parallelism: handlers before the attention rules)
from dtshard.rules import flex_attention_cp  # noqa: F401  (the flex_attention HOP on DTensors)
from dtshard.spatial import conv, pool  # noqa: F401  (spatial sharding through halo exchange)
from dtshard.rules import (  # noqa: F401  (imported for their registrations)
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
)
from dtshard.spatial import upsample  # noqa: F401  (interpolation, reflect/replicate padding on spatial shards)
from dtshard.rules import view  # noqa: F401
from dtshard.rules import misc  # noqa: F401,E402  (last: replicate-only fallbacks where no family has a rule)
