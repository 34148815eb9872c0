"""Composite ops whose decomposition can return a tensor that no op on the inputs produced.

A CompositeImplicitAutograd op never reaches ``__torch_dispatch__``: autograd runs its C++
decomposition, and dtshard sees only the ops it calls.  When the decomposition builds its result
with a factory from ``input.options()`` and returns it without passing any DTensor through an op
(``linalg.matrix_rank`` of an empty matrix: ``at::empty`` then ``fill_(0)``), the result is a
plain ``torch.Tensor`` although the input was a DTensor.

For the ops listed here dtshard registers, at the Autograd keys, a kernel that runs the same
decomposition (``OpOverload.decompose``: exactly what PyTorch would run) and, when a DTensor was
among the inputs, promotes a plain tensor result to a Replicate DTensor: it was made from metadata
alone, so it is the same global value on every rank.  Plain-tensor calls run the decomposition
unchanged.  Add an op here only when the OpInfo sweep shows it returning a plain tensor.

A second kind (``READS_VALUES``): a decomposition that reads the *values* of a tensor argument in
C++ (``tensor_split(x, indices_tensor)`` turns the indices into a list of integers with a raw data
pointer).  A DTensor there has no data of its own to read (PyTorch raises "data is not allocated
yet"), so dtshard's kernel first makes that argument the plain global tensor (``full_tensor()``: a
collective every rank enters, its sizes from the argument's metadata) and then runs the same
decomposition.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from dtshard.tensor import DTensor, _promote_plain

aten = torch.ops.aten

#: (packet, overload names) of the functional overloads to cover
COMPOSITES = {
    "linalg_matrix_rank": ("default", "tol_tensor", "atol_rtol_tensor", "atol_rtol_float"),
    # a matrix norm of an empty matrix (OpInfo linalg.norm "subgradients_at_zero": (0, 0) with
    # ord inf, (5, 0) with ord 1, (0, 5) with ord 2) is ``at::zeros`` of the result's shape
    "linalg_matrix_norm": ("default", "str_ord"),
}

#: (packet, overload) -> positions of the arguments whose values the decomposition reads
READS_VALUES = {
    ("tensor_split", "tensor_indices_or_sections"): (1,),
}

_lib = None


def _values_kernel(op, positions):
    def run(*args, **kwargs):
        args = list(args)
        for i in positions:
            if i < len(args) and isinstance(args[i], DTensor):
                args[i] = args[i].full_tensor()
        return op.decompose(*args, **kwargs)

    run.__name__ = f"dtshard_{op._overloadpacket.__name__}_{op._overloadname}"
    return run


def _first_dtensor(args: tuple, kwargs: dict):
    """The first DTensor among the arguments (top level or in a list), or None: a plain-tensor call
    pays a scan of its few arguments, not a pytree walk (these kernels see every call of the op)."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, DTensor):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, DTensor):
                    return b
    return None


def _kernel(op):
    def run(*args, **kwargs):
        out = op.decompose(*args, **kwargs)
        first = _first_dtensor(args, kwargs)
        if first is None:
            return out
        mesh = first._spec.mesh
        return tree_map(lambda t: _promote_plain(t, mesh, what=f"the result of {op}")
                        if isinstance(t, torch.Tensor) and not isinstance(t, DTensor) else t, out)

    run.__name__ = f"dtshard_{op._overloadpacket.__name__}_{op._overloadname}"
    return run


def register() -> None:
    """Install the kernels (once, at ``import dtshard``)."""
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("aten", "IMPL")

    def install(packet, name, make):
        op = getattr(getattr(aten, packet), name)
        for key in ("AutogradCPU", "AutogradCUDA"):
            _lib.impl(packet if name == "default" else f"{packet}.{name}", make(op), key)

    for packet, overloads in COMPOSITES.items():
        for name in overloads:
            install(packet, name, _kernel)
    for (packet, name), positions in READS_VALUES.items():
        install(packet, name, lambda op, positions=positions: _values_kernel(op, positions))
