"""Bucketed reduction of Partial gradients (DDP's design), for tensor-parallel models.

A replicated parameter used with sharded activations (a norm weight under sequence parallelism, a
row-parallel bias) gets a ``Partial`` gradient: each rank holds a term.  dtshard settles it to the
parameter's layout once, right after autograd accumulated it (``tensor._settle_grad``).  Instead of
one all_reduce per parameter, the gradients whose settling is a plain all_reduce over the same
mesh dims (same mesh, placements, dtype and device) are collected in a bucket; when the bucket
holds ``config.grad_bucket_bytes`` (25 MiB, DDP's default) its gradients are concatenated and
reduced by ONE asynchronous all_reduce over the flattened group of the Partial mesh dims, which
overlaps the rest of the backward; the end of the backward (an engine callback) issues the last,
partly filled buckets, waits for all of them, and sets each ``.grad`` to its reduced part.  So
``.grad`` is settled when ``backward()`` returns, and collectives per step = buckets.

The mechanism is FSDP's (``dtshard.fsdp``): a flat buffer per group of gradients, one async
collective from ``collectives.py`` (``all_reduce_``), and the engine's end-of-backward callback
that waits before the optimizer reads anything.  A gradient that autograd accumulates AGAIN after
its bucket was issued (a parameter used twice in one graph, its two contributions arriving on
either side of the issue) is noticed by its version counter and settled on its own instead.

Gradient accumulation (several ``backward()`` calls before the optimizer step, no ``zero_grad``):
the second backward's Partial gradient meets a ``.grad`` already settled to Replicate, and
AccumulateGrad would add it in place, which would reduce it at once, one all_reduce per parameter.
Instead the leaf's tensor hook (``tensor._reopen_settled_grad``, before AccumulateGrad) makes
``.grad`` a NEW Partial tensor holding the settled value as its terms (no traffic: the first rank
of each Partial mesh dim keeps it, the others hold zeros), AccumulateGrad adds the new terms
locally, and the post-accumulate hook buckets the sum like the first backward's: one all_reduce
per bucket per backward.  The settled tensor itself is never changed until its bucket is reduced;
then the sum is written into it in place and it is ``.grad`` again (``tensor._store_settled``), so
every alias of the old ``.grad`` (a ``detach()``, ``to_local()`` or view kept by the caller) reads
the accumulated gradient on every rank, as in one process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate
from torch.utils._python_dispatch import _get_current_dispatch_mode

from dtshard import _trace
from dtshard import collectives as C
from dtshard import hooks
from dtshard._config import config
from dtshard.spec import mesh_identity
from dtshard.tensor import DTensor, _grad_placements, _store_settled, reduce_partial_grad

__all__ = ["bucket_gradient", "flush"]


@dataclass
class _Bucket:
    key: tuple
    mesh: object
    dims: tuple  # the Partial mesh dims the all_reduce runs over (flattened)
    target: tuple  # the settled placements
    items: list = field(default_factory=list)  # (param, grad) pairs
    nbytes: int = 0
    flat: torch.Tensor | None = None
    work: object = None
    versions: list = field(default_factory=list)


_open: dict = {}  # key -> _Bucket being filled
_issued: list = []  # buckets whose all_reduce is in flight
_callback = [None]  # the graph task whose end-of-backward callback is queued


def _settled_by_all_reduce(grad, param):
    """The settled placements and the Partial mesh dims when settling ``grad`` to ``param``'s
    layout is one plain all_reduce of sums (every other mesh dim already the parameter's); else
    None."""
    gp, want = grad._spec.placements, _grad_placements(param._spec.placements)
    if len(gp) != len(want):
        return None
    dims = []
    for i, (g, w) in enumerate(zip(gp, want)):
        if isinstance(g, Partial):
            if g.reduce_op != "sum" or not isinstance(w, Replicate):
                return None
            dims.append(i)
        elif g != w:
            return None
    if not dims:
        return None
    return want, tuple(dims)


@hooks.grad_settler
def bucket_gradient(param, grad) -> bool:
    """Put ``param``'s Partial gradient in a bucket; False when it cannot be bucketed (the caller
    settles it alone).  Only inside a backward pass (the end-of-backward callback finishes it)."""
    cap = config.grad_bucket_bytes
    task = torch._C._current_graph_task_id()
    if not cap or task == -1 or torch.compiler.is_compiling():
        return False
    if type(grad._local_tensor) is not torch.Tensor or _get_current_dispatch_mode() is not None:
        return False  # traced (compiled autograd, a fake or proxy mode): the graph reduces it itself
    if any(p is param for b in _open.values() for p, _ in b.items):
        return True  # accumulated again before its bucket was issued: the bucket reads it then
    if grad._local_tensor.is_conj() or grad._local_tensor.is_neg():
        return False
    settled = _settled_by_all_reduce(grad, param)
    if settled is None:
        return False
    target, dims = settled
    spec = grad._spec
    key = (mesh_identity(spec.mesh), spec.placements, spec.dtype, grad._local_tensor.device)
    bucket = _open.get(key)
    if bucket is None:
        bucket = _open[key] = _Bucket(key, spec.mesh, dims, target)
    bucket.items.append((param, grad))
    bucket.nbytes += grad._local_tensor.numel() * grad._local_tensor.element_size()
    if _callback[0] != task:
        if _callback[0] is not None:
            # a backward that raised never ran its callback: finish its buckets first
            leftovers = [b for b in _open.values() if b is not bucket]
            for b in leftovers:
                _open.pop(b.key)
                _issue(b)
            _finish_issued()
        _callback[0] = task
        torch.autograd.Variable._execution_engine.queue_callback(flush)
    if bucket.nbytes >= cap:
        _issue(_open.pop(key))
    return True


def _issue(bucket: _Bucket) -> None:
    locals_ = [g._local_tensor.reshape(-1) for _, g in bucket.items]
    bucket.flat = torch.cat(locals_) if len(locals_) > 1 else locals_[0].clone()
    bucket.versions = [g._version for _, g in bucket.items]
    with _trace.op_context("<grad bucket>"):  # CommCounter attributes the traffic to the buckets
        bucket.work = C.all_reduce_(bucket.flat, "sum", bucket.mesh, bucket.dims, async_op=True)
    _issued.append(bucket)


def flush() -> None:
    """End of backward: issue the buckets still filling, wait for every one, set the gradients."""
    _callback[0] = None
    for key in list(_open):
        _issue(_open.pop(key))
    _finish_issued()


def _finish_issued() -> None:
    done = list(_issued)
    _issued.clear()
    for bucket in done:
        bucket.work.wait()
        off = 0
        for (param, grad), version in zip(bucket.items, bucket.versions):
            n = grad._local_tensor.numel()
            if param.grad is not grad or grad._version != version:
                # accumulated again after the bucket was issued: settle what it holds now
                reduce_partial_grad(param)
            else:
                local = bucket.flat[off:off + n].view(grad._local_tensor.shape)
                settled = DTensor(local, grad._spec.with_placements(bucket.target), requires_grad=False)
                _store_settled(param, grad, settled)  # into the .grad it was reopened from, if it was
            off += n


hooks.runtime_entry_points(flush)  # the autograd engine's end-of-backward callback
