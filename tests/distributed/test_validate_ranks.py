"""``python -m dtshard.validate --ranks``: handler-served ops as DTensors on real ranks.

The simulation cannot run a handler (it calls collectives), so ``dtshard.validate.ranks`` runs
each sample on the worker pools under a few input layouts (replicated, sharded on each dim with
uneven chunks, Partial(sum) with sign-varying terms) and compares every output's ``full_tensor()``
with the op on the global inputs.
"""

import torch

import dtshard  # noqa: F401  (registers the handlers)
from dtshard.validate import Sample
from dtshard.validate.ranks import validate_handler

aten = torch.ops.aten


def _sample(*shape):
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def test_a_handler_is_validated_on_real_ranks_under_uneven_and_partial_layouts():
    # mean over an uneven shard needs the handler's global count: 5 rows on 2 ranks, 2x2 too
    samples = [Sample((_sample(5, 4), [0]), {}, "test"), Sample((_sample(3, 5), [1], True), {}, "test")]
    report = validate_handler(aten.mean.dim, samples, [(2,), (2, 2)])
    assert report.incorrect == [], [f.text() for f in report.incorrect]
    # per sample and mesh: replicated, each dim sharded, Partial(sum)
    assert report.claimed == 2 * 2 * 4 and report.correct == report.claimed


def test_ops_that_write_their_inputs_are_reported_as_not_validated():
    report = validate_handler(aten.fill_.Scalar, [Sample((_sample(4), 1.0), {}, "test")], [(2,)])
    assert report.note.startswith("handler: not validated here") and report.claimed == 0
