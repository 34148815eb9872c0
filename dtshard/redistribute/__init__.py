"""Redistribute: move a DTensor's data between placements with minimum traffic.

Three modules, one concern each:

- :mod:`~dtshard.redistribute.planning`: pure metadata.  A transition from placements ``src`` to
  ``dst`` on an N-D mesh is a sequence of steps, each changing the placement of ONE mesh dim with
  one collective over that mesh dim's process group (or a local slice / zeroing), or one
  collective over a flattened group of mesh dims; steps are chosen by a shortest-path search over
  placement states, priced in bytes each rank receives (ARCHITECTURE.md's table), so e.g. a 2x2
  ``(S0, S1) -> (S1, S0)`` goes through all_gather + all_to_all + slice and never gathers the
  full tensor.
- :mod:`~dtshard.redistribute.running`: runs a plan on this rank's local tensor
  (:func:`redistribute_local`), packing and unpacking around the collectives through
  ``dtshard_kernels`` (:mod:`~dtshard.redistribute.packing`), so each collective costs at most one
  packing and one unpacking pass.
- :mod:`~dtshard.redistribute.pipelining`: a large transfer cut into pieces whose collectives run
  while the next piece is packed and the previous one unpacked (``config.pipeline_chunk_bytes``):
  the same plan, the same bytes, still one copy each way.

The differentiable entry point lives in tensor.py (``DTensor.redistribute``); its backward
redistributes the gradient back to the source placements (the dual collective).
"""

from dtshard.redistribute.planning import (GroupStep, Step, clear_plan_cache, plan, plan_text, transition_cost,
                                          transition_lower_bound)
from dtshard.redistribute.running import redistribute_local

__all__ = ["Step", "GroupStep", "clear_plan_cache", "plan", "plan_text", "redistribute_local", "transition_cost",
           "transition_lower_bound"]
