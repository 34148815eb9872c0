"""``dtshard.experimental``: the counterpart of ``torch.distributed.tensor.experimental``."""

from __future__ import annotations

import contextlib
from typing import Iterator

from dtshard import dispatch as _dispatch

__all__ = ["implicit_replication"]


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Inside this block a plain ``torch.Tensor`` that meets a DTensor in an op is treated as a
    ``Replicate()`` DTensor on that DTensor's mesh (PyTorch's ``implicit_replication()``; its own
    context works with dtshard too).  The caller vouches that the tensor holds the same value on
    every rank; nothing checks it.  Outside, mixing raises (only one-element tensors broadcast
    like scalars)."""
    _dispatch._implicit[0] += 1
    try:
        yield
    finally:
        _dispatch._implicit[0] -= 1
