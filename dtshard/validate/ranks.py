"""Handler-served ops on real ranks (``python -m dtshard.validate --ranks``).

A handler (convolution with halos, pooling, norms, losses, attention, the foreach ops, ...) runs
its own code with collectives, so it cannot be simulated from a rule's placements: it claims no
strategies, it just has to give the right result for whatever layouts its inputs have.  Here each
sample runs as DTensors on the worker pools of :mod:`dtshard.testing` (gloo, one process per
rank), with the same local inputs the simulation builds (:func:`~dtshard.validate.simulate.
local_input`: uneven shards, sign-varying Partial terms), under a few input layouts per mesh:
every input replicated, the first input and the inputs of its shape sharded on each of their dims,
the first floating input Partial(sum).  Every output's ``full_tensor()`` is compared on every rank
with the op on the global inputs; a float32 miss counts only if the float64 run misses too.

A layout the handler rejects with an error is counted as ``raised`` (a clear error is no silent
bug); ops that write their inputs (in-place, ``out=``) and random ops are reported as not
validated here.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

from dtshard.collectives import init_device_mesh
from dtshard.propagate import flatten_outputs
from dtshard.tensor import DTensor
from dtshard.testing import run_distributed
from dtshard.validate.check import Finding, OpReport, compare, float64_sample, sample_tensors
from dtshard.validate.samples import Sample
from dtshard.validate.simulate import local_input

__all__ = ["validate_handler"]

_meshes: dict = {}


def _mesh(shape):
    """One mesh per shape per worker process (created once: meshes own process groups)."""
    if shape not in _meshes:
        _meshes[shape] = init_device_mesh("cpu", shape)
    return _meshes[shape]


def _layouts(tensors, ndim: int) -> list[tuple]:
    """The input layouts tried on a mesh of ``ndim`` dims (see the module doc)."""
    rep = (Replicate(),) * ndim
    first = next((t for t in tensors if t.ndim > 0), None)
    out = [tuple(rep for _ in tensors)]
    if first is not None:
        for d in range(first.ndim):
            out.append(tuple((Shard(d),) * ndim if t.shape == first.shape else rep for t in tensors))
    floating = next((k for k, t in enumerate(tensors) if t.is_floating_point()), None)
    if floating is not None:
        out.append(tuple((Partial("sum"),) * ndim if k == floating else rep for k in range(len(tensors))))
    return out


def _as_dtensors(sample: Sample, layout, mesh):
    coord = tuple(mesh.get_coordinate())
    counter = iter(range(len(layout)))

    def conv(a):
        if isinstance(a, torch.Tensor):
            k = next(counter)
            local = local_input(a, layout[k], tuple(mesh.shape), coord, salt=k)
            return DTensor.from_local(local, mesh, layout[k], shape=a.shape, stride=a.stride())
        if isinstance(a, (list, tuple)):
            return type(a)(conv(b) for b in a)
        return a

    return [conv(a) for a in sample.args], {k: conv(v) for k, v in sample.kwargs.items()}


def _run_layout(op, sample: Sample, layout, mesh) -> str:
    """"" when the op's outputs on DTensors equal the op's on the global inputs, "raised: ..."
    when the handler raises, else why they differ."""
    with torch.no_grad():
        ref = flatten_outputs(op(*sample.args, **sample.kwargs))
        args, kwargs = _as_dtensors(sample, layout, mesh)
        try:
            got = flatten_outputs(op(*args, **kwargs))
        except Exception as e:  # noqa: BLE001 - a clear error is reported apart
            return f"raised: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
        for k, (g, r) in enumerate(zip(got, ref)):
            if not isinstance(r, torch.Tensor):
                continue
            if not isinstance(g, DTensor):
                return f"output {k} is a {type(g).__name__}, not a DTensor"
            why = compare(g.full_tensor(), r)
            if why:
                return f"output {k} ({' '.join(map(str, g.placements))}): {why}"
    return ""


def _worker(op_name: str, samples: list, mesh_shape: tuple) -> list:
    """On every rank: ``[(sample index, layout, verdict)]`` for every sample and layout."""
    packet, overload = op_name.rsplit(".", 1)
    op = getattr(getattr(torch.ops.aten, packet), overload)
    mesh = _mesh(mesh_shape)
    out = []
    for i, sample in enumerate(samples):
        for layout in _layouts(sample_tensors(sample), len(mesh_shape)):
            verdict = _run_layout(op, sample, layout, mesh)
            if verdict and not verdict.startswith("raised"):
                wide = float64_sample(sample)
                if wide is not None and not _run_layout(op, wide, layout, mesh):
                    verdict = ""  # float32 rounding: equal in float64
            out.append((i, layout, verdict))
    dist.barrier()
    return out


def validate_handler(op, samples: list[Sample], meshes) -> OpReport:
    """Run a handler-served op on real ranks for every sample, mesh and layout."""
    report = OpReport(op, "handler", samples=len(samples))
    schema = op._schema
    if schema.is_mutable or torch.Tag.nondeterministic_seeded in op.tags:
        report.note = "handler: not validated here (writes its inputs, or random)"
        return report
    if not samples:
        report.note = "handler: no sample"
        return report
    name = f"{op._overloadpacket.__name__}.{op._overloadname}"
    start = time.perf_counter()
    for mesh_shape in meshes:
        world = int(torch.Size(mesh_shape).numel())
        per_rank = run_distributed(_worker, world, name, samples, tuple(mesh_shape), timeout=300)
        for results in zip(*per_rank):  # the same (sample, layout) on every rank
            (i, layout, _), verdicts = results[0], [v for _, _, v in results]
            report.claimed += 1
            bad = next((v for v in verdicts if v and not v.startswith("raised")), None)
            if bad:
                report.incorrect.append(Finding(op, tuple(mesh_shape), layout, (), bad, samples[i]))
            elif any(verdicts):
                report.skipped += 1  # the handler raised a clear error for this layout
            else:
                report.correct += 1
    report.seconds = time.perf_counter() - start
    return report
