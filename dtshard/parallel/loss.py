"""``loss_parallel()``: cross-entropy over class-sharded logits without gathering them.

Inside the context, ``F.cross_entropy`` / ``nn.CrossEntropyLoss`` on logits sharded on the class
dim (``Shard(-1)`` of ``(N, C)``, the output of a ``ColwiseParallel(use_local_output=False)`` LM
head) runs as:

- ``_log_softmax``: the row max (Partial(max)) and the row sum of exponentials (Partial(sum)) are
  all-reduced, one value per row each; the logits stay sharded;
- ``nll_loss``: each rank picks the target logits of its own classes (a masked pick, zeros
  elsewhere): Partial(sum), exact for every reduction ('mean' divides by the GLOBAL weight);
- backward: ``nll_loss_backward`` writes ``-grad`` at the targets of each rank's classes and
  ``_log_softmax_backward_data`` all-reduces one row sum.

As in PyTorch, a plain ``target`` (and class ``weight``) tensor is accepted inside the context and
taken to be the same full tensor on every rank.  Unlike PyTorch, dtshard's result is exact for any
input layout (uneven shards, N-D meshes, 'mean' on N-D meshes): outside the class-sharded case the
ops simply run on their shards.  The backward may run outside the context (it is then planned by
the general rules, which moves the logits' gradient once; still exact).
"""

from __future__ import annotations

import contextlib

import torch

from dtshard import registry
from dtshard.handlers import MixedTensorError
from dtshard.rules import loss as _loss_rules

__all__ = ["loss_parallel"]

aten = torch.ops.aten

_HANDLERS = {
    aten._log_softmax.default: _loss_rules.loss_parallel_log_softmax,
    aten._log_softmax_backward_data.default: _loss_rules.loss_parallel_log_softmax_backward,
}


def _routed_to_handlers(mapping):
    """Route each op of ``mapping`` to its handler inside the block.

    ``registry.override`` (public) clears the dispatcher's whole plan cache on entry and on exit, so
    every op of the model is planned again at each training step.  That is only needed when a RULE
    changes: the dispatcher consults handlers before its plan cache, so the plans cached for these
    ops stay valid.  ``registry.scoped_handlers`` (proposed to the core, see the report) swaps
    handlers without clearing; it is used when the registry has it.
    """
    scoped = getattr(registry, "scoped_handlers", None)
    if scoped is not None:
        return scoped(mapping)
    stack = contextlib.ExitStack()
    for op, fn in mapping.items():
        stack.enter_context(registry.override(op, fn, kind="handler"))
    return stack


@contextlib.contextmanager
def loss_parallel():
    """Context manager: loss parallelism for cross-entropy over class-sharded logits.

    ``label_smoothing`` works, exactly (PyTorch's ``loss_parallel`` does not support it), with the
    target given as a DTensor (``dtshard.distribute_tensor(target, mesh, [Replicate()])`` when
    every rank holds the same full target): aten's smoothing term mixes the target with the
    logits in ops other than the loss's own, where a plain target is refused with a message that
    says so."""
    with _routed_to_handlers(_HANDLERS):
        _loss_rules._loss_parallel_depth[0] += 1
        try:
            yield
        except MixedTensorError as e:
            raise MixedTensorError(f"{e} {_PLAIN_TARGET_HINT}", e.tensor) from None
        finally:
            _loss_rules._loss_parallel_depth[0] -= 1


_PLAIN_TARGET_HINT = (
    "Inside loss_parallel(), a plain target (and class weight) is accepted by cross_entropy's own "
    "ops only; F.cross_entropy with label_smoothing > 0 also mixes them with the logits elsewhere "
    "(aten's smoothing term). Pass the target (and weight) as DTensors, e.g. "
    "dtshard.distribute_tensor(target, mesh, [Replicate()]) when every rank holds the same full "
    "target: label smoothing then runs exactly, the logits still never gathered.")
