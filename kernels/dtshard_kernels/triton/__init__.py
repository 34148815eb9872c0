"""Triton backend of :mod:`dtshard_kernels` (imported lazily: importing it imports triton).

Importing this package registers the ops ``torch.ops.dtshard.{pack, unpack, a2a_pack,
a2a_unpack, slice_copy, halo_cat, halo_split}`` (``torch.library.triton_op``; traceable by
``torch.compile``) and exposes Python wrappers with the public signatures (less ``backend``).
Kernels run on CUDA tensors, or on CPU tensors in Triton's interpreter when ``TRITON_INTERPRET=1``
was set before this package was first imported.
"""

from .copy_kernels import INTERPRETED, interpreting
from .ops import OP_NAMES, a2a_pack, a2a_unpack, halo_cat, halo_split, pack, slice_copy, unpack

__all__ = ["INTERPRETED", "OP_NAMES", "interpreting", "pack", "unpack", "a2a_pack", "a2a_unpack", "slice_copy",
           "halo_cat", "halo_split"]

from .. import _set_triton_backend  # noqa: E402  (lets the parent find us without an import)

_set_triton_backend(__import__("sys").modules[__name__])
