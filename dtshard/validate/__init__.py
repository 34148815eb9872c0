"""The rule validator: proves every strategy a sharding rule claims, in one process.

``python -m dtshard.validate --op aten.add.Tensor`` (or ``--all``) takes each registered rule,
asks the planner for every choice it would consider on a mesh (the rule's single-mesh-dim
strategies expanded over N-D meshes, and with ``--strided`` the variants it carries over to strided
shards), and runs each one on simulated ranks: the global inputs are cut into each rank's local
tensors with the shard-layout arithmetic of :mod:`dtshard.spec` (uneven and strided shards
included, Partial inputs split into uneven, sign-varying terms), the op runs on every rank's
locals, and the global result is rebuilt from the claimed output placements and compared with the
op on the global inputs.  No process group is involved.

Modules:

- :mod:`~dtshard.validate.simulate`: the simulated ranks (local inputs, runs, reassembly);
- :mod:`~dtshard.validate.samples`: the inputs (OpInfo samples captured at the aten level,
  forward and backward; the ops' own sample functions);
- :mod:`~dtshard.validate.check`: one op's validation (claimed, correct, incorrect, rejected,
  skipped, missing);
- :mod:`~dtshard.validate.report`: report lines, totals and reproductions;
- :mod:`~dtshard.validate.ranks`: handler-served ops on real ranks (``--ranks``);
- ``__main__``: the command line.

Where ops run: rule-served ops on simulated ranks (no process group).  Handler-served ops
(convolution, pooling, norms, losses, attention, foreach, ...) run their own code with
collectives, so they run as DTensors on the test harness's gloo worker pools with ``--ranks``,
and are listed as not validated without it.
"""

from dtshard.validate.check import Finding, OpReport, simulate_op, validate_op
from dtshard.validate.report import repro, summary
from dtshard.validate.samples import Sample, SampleSource

__all__ = ["Finding", "OpReport", "Sample", "SampleSource", "repro", "simulate_op", "summary", "validate_op"]
