"""Sharding rules, one file per op family. Importing this package registers them all.

To add a rule see CONTRIBUTING.md: pick the family file, write a function of an OpCall that returns
``(output_placements, input_placements)`` pairs for ONE mesh dim, and decorate it with
``@register_rule(aten.op.overload)``.
"""

from dtshard.rules import (  # noqa: F401  (imported for their registrations)
    attention,
    conv,
    embedding,
    loss,
    matmul,
    norm,
    norm_extra,
    pool,
    pointwise,
    reduction,
    tensor_ops,
    view,
)
