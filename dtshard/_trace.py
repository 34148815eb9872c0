"""Observer hooks shared by collectives, redistribute and dispatch (read by dtshard.debug).

Kept in a leaf module so the hot paths pay one truthiness check on a list when nobody listens.
"""

from __future__ import annotations

from typing import Callable

# callback(kind, mesh_dim, nbytes_sent, group_size, nbytes_received) for every collective
# (mesh_dim is a tuple of mesh dims for a collective over their flattened group)
comm_observers: list[Callable[..., None]] = []
# callback(kind, mesh_dim, group_size) for a collective this rank takes part in without sending or
# receiving anything, so comm_observers are not told (the source rank of a broadcast): lets
# CommCounter.get_total_counts count calls on every rank, as PyTorch's CommDebugMode does
source_observers: list[Callable[..., None]] = []
# callback(kind, nbytes) for every local copy pass made by redistribute / halo code
copy_observers: list[Callable[[str, int], None]] = []
# callback(op_name, plan_text) for every dispatch (cache hit or miss)
plan_observers: list[Callable[[str, object], None]] = []

# The op being dispatched right now (a name), so counters can attribute traffic to ops.
current_op: list[str] = ["<redistribute>"]


class op_context:
    """Attribute the collectives issued inside to ``op`` (an aten op, or a name such as
    ``"<fsdp>"``): what ``CommCounter`` records as ``CommRecord.op``."""

    _names: dict = {}

    def __init__(self, op) -> None:
        name = self._names.get(op)
        if name is None:
            name = self._names[op] = str(op)
        self.name = name

    def __enter__(self):
        self.prev = current_op[0]
        current_op[0] = self.name

    def __exit__(self, *exc):
        current_op[0] = self.prev
        return False


def note_copy(kind: str, nbytes: int) -> None:
    for observer in copy_observers:
        observer(kind, nbytes)
