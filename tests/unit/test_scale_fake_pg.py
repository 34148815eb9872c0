"""One rank of 32,768, simulated with PyTorch's fake process group (issue #53): every transition
of the scale benchmark (``benchmarks/bench_scale.py``) on a 128x256 and a 512x8x8 mesh, even and
uneven shapes, and a small Llama with tensor parallelism and FSDP on a (4096, 8) mesh: built on
the meta device, ``to_empty``, initialised, one forward and backward.  PyTorch's DTensor runs the
same transitions on the same fake world, and its local shards must have dtshard's shapes.

The fake group's collectives return tensors of the right shapes whose values mean nothing, so
this checks what one rank does: its plans, the shapes of its shards, that nothing walks the
ranks of the mesh (with the planner of before this test, which priced every rank, the first
transition alone ran for minutes).  No time is asserted (benchmarks measure); a forked child with
a time limit runs it (the fake group needs a process of its own; the child inherits this
process's imports, so it starts in milliseconds), so a regression fails instead of hanging.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_scale as B  # noqa: E402


def _transitions(lib: str, problems: list) -> int:
    """Every benchmark transition, both shapes, on ``lib``'s 128x256 and 512x8x8 meshes: the
    result's placements and local shape against the layout's arithmetic (dtshard's ``local_shape``,
    the same for PyTorch's DTensor: both lay shards out like ``torch.chunk``)."""
    import torch

    from dtshard import Partial, Replicate, Shard
    from dtshard.spec import local_shape

    if lib == "dtshard":
        from dtshard import DTensor, init_device_mesh
        extra = {}
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor
        extra = {"run_check": False}
    meshes = {"2d": init_device_mesh("cpu", (128, 256)), "3d": init_device_mesh("cpu", (512, 8, 8))}
    done = 0
    for name, (kind, src_s, dst_s) in B.TRANSITIONS.items():
        mesh = meshes[kind]
        src = B._placements(src_s, Shard, Replicate, Partial)
        dst = B._placements(dst_s, Shard, Replicate, Partial)
        for shape in B.SHAPES.values():
            coord = mesh.get_coordinate()
            x = DTensor.from_local(torch.zeros(local_shape(shape, tuple(mesh.shape), src, coord)), mesh, src,
                                   shape=torch.Size(shape), stride=torch.empty(shape).stride(), **extra)
            y = x.redistribute(mesh, dst)
            got = (tuple(y.placements), tuple(y.to_local().shape))
            want = (tuple(dst), local_shape(shape, tuple(mesh.shape), dst, coord))
            if got != want:
                problems.append(f"{lib}: {name} {shape}: {got}, want {want}")
            done += 1
    return done


def _one_rank_of_32768() -> dict:
    import torch.distributed as dist

    B.install_a2a_workaround()
    if dist.is_initialized():  # (a group this process inherited: the child's own world replaces it)
        dist.destroy_process_group()
    B._init_fake(32768, 3)
    problems: list = []
    done = _transitions("dtshard", problems)
    _transitions("torch", problems)  # PyTorch's DTensor on the same fake world: the same shards
    dist.destroy_process_group()  # the model case starts its own world
    model = B.cell_model("dtshard", 32768, 3, 300.0)
    return {"problems": problems, "transitions": done, "model": sorted(k for k in model if k.endswith("_s"))}


def test_one_rank_of_32768_ranks_plans_and_trains():
    res = B.run_cell(_one_rank_of_32768, (), timeout=600.0, mem_limit_mib=8192)
    assert res.get("status", "ok") == "ok", res
    assert res["problems"] == [], res["problems"]
    assert res["transitions"] == 2 * len(B.TRANSITIONS)
    assert {"to_empty_s", "init_s", "step1_s", "step2_s"} <= set(res["model"]), res
