"""Spatial parallelism: halos as part of a spatial shard's layout.

A tensor sharded on a spatial dim (``Shard(2)`` of an ``(N, C, H, W)`` activation) may carry a
halo: rows of its neighbours' shards, kept in its local tensor next to its own (the spec's
``halo``; see :mod:`dtshard.spatial.halo_layout`).  Pointwise ops, activations and group norm compute
on those rows too; a stride-1 "same" convolution consumes ``p`` of them per side; one exchange
fetches enough rows for :func:`halo_depth` layers.  So a chain of L 3x3 convolutions with norms
and activations between them exchanges once per side in forward (and once in backward) instead
of L times, for ``r (L - 1) / w`` extra compute (``w`` the local width).

The package holds the whole windowed-op family: ``halo.py`` (the window arithmetic of HALO.md
and the exchange), the handlers and rules of convolution (``conv.py``), pooling (``pool.py``,
``adaptive_pool.py``) and interpolation and padding (``upsample.py``), and the halo layout
(``halo_layout.py``, ``halo_ops.py``, ``conv_halo.py``).

Public API:

- :class:`halo_depth` (``with dtshard.spatial.halo_depth(4): ...``) and :func:`get_halo_depth`:
  the depth policy (``"auto"`` by default: :func:`auto_depth`'s latency/compute model, whose
  constants are :class:`model`);
- :func:`halo_of`: a DTensor's halo widths; :func:`drop_halo`: the same tensor without its halo.
"""

from dtshard.spatial import halo_ops as _halo_ops  # noqa: F401  (registers the halo layout extension)
from dtshard.spatial.halo_layout import auto_depth, get_halo_depth, halo_depth, halo_partial, halos, model

__all__ = ["halo_depth", "get_halo_depth", "auto_depth", "model", "halo_of", "drop_halo"]


def halo_of(t) -> dict:
    """``{tensor dim: (lo, hi)}`` of the halo ``t`` carries (empty when none), plus
    ``"partial": True`` for a gradient's partial halo."""
    spec = t._spec
    out = {h.dim: (h.lo, h.hi) for h in halos(spec)}
    if halos(spec) and halo_partial(spec):
        out["partial"] = True
    return out


def drop_halo(t):
    """``t`` without its halo (differentiable; ``t`` itself when it has none).  Never needed for
    correctness: every op that does not use a halo drops it on its own."""
    if not halos(t._spec):
        return t
    return t.view_as(t)
