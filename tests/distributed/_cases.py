"""Helpers shared by the distributed tests: build DTensors with known local contents.

Placements travel between processes as short strings ("S0", "R", "Psum") so test parameters stay
readable in pytest ids and pickle trivially.
"""

from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import dtshard
from dtshard.spec import DTensorSpec, contiguous_strides

_meshes: dict = {}


def mesh(shape) -> "dtshard.DeviceMesh":
    """The (cached) mesh of this shape over the world; one mesh object per shape per process."""
    shape = tuple(shape)
    m = _meshes.get(shape)
    if m is None:
        m = _meshes[shape] = dtshard.init_device_mesh("cpu", shape)
    return m


def P(s: str):
    """Parse one placement string: S<d>, R, P<op>."""
    if s == "R":
        return Replicate()
    if s.startswith("S"):
        return Shard(int(s[1:]))
    if s.startswith("P"):
        return Partial(s[1:] or "sum")
    raise ValueError(s)


@contextlib.contextmanager
def forced_cp(strategy: str):
    """``dtshard.config.attention_cp`` set to ``strategy`` inside the block (context parallelism's
    strategy forced), restored after it."""
    old = dtshard.config.attention_cp
    dtshard.config.attention_cp = strategy
    try:
        yield
    finally:
        dtshard.config.attention_cp = old


def plans_made_once(mesh_shape, shape, dtype, transitions) -> dict:
    """The redistribute plans of ``transitions`` (pairs of placement tuples) for a tensor of
    ``shape`` and ``dtype`` on a mesh of ``mesh_shape``, made once, here in the test's process,
    for :func:`use_plans` on the ranks.

    A plan is a pure function of this metadata (``dtshard.redistribute.planning.plan``: no mesh,
    no rank), so every rank would make the same one; in the tests that run thousands of
    transitions on 4-8 ranks sharing 2 cores, planning on every rank was most of their time.
    What each rank then receives, holds and computes is still checked on every rank."""
    from dtshard.redistribute import planning
    from dtshard.validate.simulate import SimMesh

    sim = SimMesh(mesh_shape)
    planning.clear_plan_cache()
    for src, dst in transitions:
        planning.plan(DTensorSpec(sim, tuple(src), tuple(shape), contiguous_strides(shape), dtype), tuple(dst))
    return dict(planning._plan_cache)


def use_plans(plans: dict) -> None:
    """On a rank: take the plans of :func:`plans_made_once` as this process's planned transitions."""
    from dtshard.redistribute import planning

    planning._plan_cache.update(plans)


def Ps(strs) -> list:
    return [P(s) for s in strs]


def global_tensor(shape, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    """The same small-integer-valued tensor on every rank (exact in float32)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, tuple(shape), generator=g).to(dtype)


def local_part(full: torch.Tensor, m, placements, coord) -> torch.Tensor:
    """What the rank at ``coord`` must hold: its shard slice, and for each Partial mesh dim a
    nontrivial partial term (terms differ across the group and reduce to the value)."""
    placements = list(placements)
    # the shard by PyTorch's own arithmetic, not dtshard's: torch.chunk per Shard mesh dim, left
    # to right (ranks past the last chunk hold an empty piece), checked against PyTorch's
    # DTensor helper for the local shape
    x = full
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            chunks = torch.chunk(x, m.size(i), dim=p.dim)
            c = coord[i]
            x = chunks[c] if c < len(chunks) else x.narrow(p.dim, x.shape[p.dim], 0)
    if tuple(coord) == tuple(m.get_coordinate()):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        want = tuple(compute_local_shape_and_global_offset(full.shape, m, placements)[0])
        assert tuple(x.shape) == want, (tuple(full.shape), placements, tuple(x.shape), want)
    x = x.clone()
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            n, c = m.size(i), coord[i]
            g = torch.Generator().manual_seed(1000 + i)
            z = torch.randint(0, 5, tuple(x.shape), generator=g).to(x.dtype)
            if p.reduce_op == "sum":
                # n*x terms: x/n would round; integers: term_0 = x - (n-1)*z, others z
                x = x - (n - 1) * z if c == 0 else z
            elif p.reduce_op == "avg":
                x = x * n - (n - 1) * z if c == 0 else z
            elif p.reduce_op == "max":
                x = x - c * (z + 1)
            elif p.reduce_op == "min":
                x = x + c * (z + 1)
    return x


def make_dtensor(full: torch.Tensor, m, placements) -> "dtshard.DTensor":
    coord = m.get_coordinate()
    local = local_part(full, m, placements, coord)
    return dtshard.DTensor.from_local(local, m, placements, shape=full.shape)


def expected_local(full, m, placements) -> torch.Tensor:
    return local_part(full, m, placements, m.get_coordinate())


def all_coords(mesh_shape):
    return itertools.product(*(range(n) for n in mesh_shape))


def rank() -> int:
    return dist.get_rank()
