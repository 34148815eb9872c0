"""Strided shards (torch's ``_StridedShard``) in dtshard's layout arithmetic: pure metadata.

Every rank's region (``dtshard.spec.local_region``) must be exactly the shard torch's own placement
code cuts (``Shard._split_tensor`` / ``_StridedShard._split_tensor``, applied mesh dim by mesh dim as
``distribute_tensor`` does), uneven and empty shards included.
"""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

from dtshard.spec import (local_region, local_shape, local_shape_and_offset, normalize_placements, placement_str,
                          take_region)


def torch_local(full, mesh_shape, placements, coord):
    """The shard torch cuts for ``coord``: each placement splits what the earlier ones left."""
    t = full
    for i, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            t = p._split_tensor(t, mesh_shape[i], with_padding=False)[0][coord[i]]
    return t


def _random_case(rng):
    nd = rng.choice([1, 2, 3])
    shape = [rng.randint(0, 13) for _ in range(nd)]
    mesh = [rng.randint(1, 4) for _ in range(rng.choice([1, 2, 3]))]
    pls = []
    for _ in mesh:
        r, d = rng.random(), rng.randrange(nd)
        pls.append(Replicate() if r < 0.2 else Shard(d) if r < 0.5 else
                   _StridedShard(d, split_factor=rng.randint(2, 5)))
    return shape, mesh, pls


def test_regions_are_torchs_shards():
    rng = random.Random(0)
    for _ in range(1500):
        shape, mesh, pls = _random_case(rng)
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        for coord in itertools.product(*map(range, mesh)):
            want = torch_local(full, mesh, pls, coord)
            region = local_region(shape, mesh, pls, coord)
            got = take_region(full, region)
            assert torch.equal(got, want), (shape, mesh, pls, coord, region)
            assert local_shape(shape, mesh, pls, coord) == tuple(want.shape)
            # intervals are sorted, disjoint and merged
            for ivs in region:
                assert all(a < b for a, b in ivs)
                assert all(ivs[k][1] < ivs[k + 1][0] for k in range(len(ivs) - 1))


def test_fsdp_times_tp_shard_is_one_block():
    # (_S(0, 2), S(0)) on a (dp=2, tp=2) mesh: tp splits first, then dp splits each tp chunk; every
    # rank's shard is one block of rows, so it has an offset (DCP saves it as one chunk)
    pls = [_StridedShard(0, split_factor=2), Shard(0)]
    rows = {c: local_shape_and_offset((8, 8), (2, 2), pls, c) for c in itertools.product(range(2), range(2))}
    assert rows == {(0, 0): ((2, 8), (0, 0)), (0, 1): ((2, 8), (4, 0)),
                    (1, 0): ((2, 8), (2, 0)), (1, 1): ((2, 8), (6, 0))}


def test_a_region_that_is_not_a_block_has_no_offset():
    # (b, h) = (3, 4) with h sharded, viewed as 12 rows: rank 0 holds rows 0-1, 4-5, 8-9
    pls = [_StridedShard(0, split_factor=3)]
    assert local_region((12, 5), (2,), pls, (0,)) == (((0, 2), (4, 6), (8, 10)), ((0, 5),))
    assert local_shape((12, 5), (2,), pls, (0,)) == (6, 5)
    with pytest.raises(ValueError, match="not one block"):
        local_shape_and_offset((12, 5), (2,), pls, (0,))


def test_normalize_placements():
    assert normalize_placements([_StridedShard(-1, split_factor=2)], 2, 1, what="t") == (
        _StridedShard(1, split_factor=2),)
    # split factor 1 is a plain shard: one spelling per layout
    assert normalize_placements([_StridedShard(0, split_factor=1)], 2, 1, what="t") == (Shard(0),)
    with pytest.raises(ValueError, match="out of range"):
        normalize_placements([_StridedShard(2, split_factor=2)], 2, 1, what="t")
    assert placement_str(_StridedShard(1, split_factor=4)) == "_S(1, 4)"
    assert normalize_placements([Partial(), _StridedShard(0, split_factor=3)], 1, 2, what="t")[1] == \
        _StridedShard(0, split_factor=3)
