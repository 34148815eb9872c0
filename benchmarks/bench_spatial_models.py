#!/usr/bin/env python
"""Third-party CNN architectures on spatially sharded inputs (issue #31 item 4): a training step
on 2 ranks (one intra-op thread each) against the same model and data in one process with 2
threads, side by side in one run.

    python benchmarks/bench_spatial_models.py                          # every config (~5-8 min on 2 cores)
    python benchmarks/bench_spatial_models.py --configs resnet18-224 --reps 5
    python benchmarks/bench_spatial_models.py --configs resnet18-224 --profile 25   # + rank 0's top ops
    python benchmarks/bench_spatial_models.py --configs resnet18-224 --sync 4      # + where it waits

Configs: ``dtshard.models.ResNet18`` (torchvision's resnet18 layout, 1000 classes) on (8, 3, 64,
64) and (8, 3, 224, 224) images sharded on H; ``dtshard.models.MonaiUNet3d`` (MONAI's UNet
structure: residual units with InstanceNorm and PReLU, strided and transposed convolutions) on
(2, 1, 16, 16, 16) and (2, 1, 32, 32, 32) volumes sharded on D.  A step is forward, MSE loss,
backward and an SGD update.

How: both ranks build the model from the same seed; rank 0 also keeps the unsharded copy.  Each
repetition runs the sharded step on both ranks, then the one-process step on rank 0 with 2
threads, then one shard alone on rank 0, while rank 1 waits at a barrier, then the sharded step
with the ranks bound to cores (the order reverses every repetition, so all four see the same
machine noise).  Reported: the median wall time of a
step (rank 0, between barriers), the ratio, the same model's step on one rank's shard of the
input alone in one process with one thread ("one shard alone": the compute floor of a sharded
step, no halo and no collective; the ratio to it is what sharding adds), the sharded step again
with each rank's threads bound to a core of its own ("each on its own core", Linux: what a
launcher binding ranks to cores gives; unbound, the scheduler may queue one rank's gloo thread
behind the other rank's compute for milliseconds), the collectives of one
step by kind and the bytes each rank sends (``CommCounter``), and the peak activation memory of
one forward + backward (``dtshard.debug.peak_alloc_bytes``: the allocator's bytes above what
existed before, gradient buffers already allocated) on each rank (the largest) against one
process, and the loss of the first step on both sides.  ``--profile N``: rank 0's N aten ops with
the most self CPU in one sharded step (torch.profiler).  ``--sync N``: where the sharded step
waits, from every blocking collective of N steps timed on both ranks (``_sync_report``).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from collections import Counter

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _checkout import ALL_CPUS, bind_threads, free_port, import_this_checkout, own_cores  # noqa: E402  (benchmarks/: run as a script)

#: name: (model, input shape, sharded dim)
CONFIGS = {
    "resnet18-64": ("resnet18", (8, 3, 64, 64), 2),
    "resnet18-224": ("resnet18", (8, 3, 224, 224), 2),
    "unet3d-16": ("unet3d", (2, 1, 16, 16, 16), 2),
    "unet3d-32": ("unet3d", (2, 1, 32, 32, 32), 2),
}


def _make(kind: str):
    from dtshard.models import MonaiUNet3d, ResNet18

    torch.manual_seed(0)
    return ResNet18() if kind == "resnet18" else MonaiUNet3d(width=8)


def _target(kind: str, shape, g):
    return torch.randn((shape[0], 1000) if kind == "resnet18" else (shape[0], 2) + tuple(shape[2:]), generator=g)


def _step(model, opt, x, y):
    loss = F.mse_loss(model(x), y)
    opt.zero_grad()  # set to None: the Partial gradients are bucketed (one all_reduce)
    loss.backward()
    opt.step()
    return loss


def _sync_report(name, rank, reps, step, cores) -> None:
    """Where the sharded step waits: every blocking collective of ``reps`` steps timed on both
    ranks (dtshard.collectives' all_to_all, all_gather and all_reduce, wrapped in the module:
    dtshard calls them through it; the gradient buckets' in-flight all_reduce_ is not among
    them), then, per step: each rank's time inside
    them, the arrival skew summed over the collectives (the later rank's arrival minus the
    earlier's: time the earlier one waits for the other's compute), and the time from the later
    arrival to the first rank's return (the collective's own latency).  With the ranks bound to
    cores when the machine allows, as the "own core" column."""
    import dtshard.collectives as C

    log: list = []
    saved = {n: getattr(C, n) for n in ("all_to_all", "all_gather", "all_reduce")}

    def timed(fn, kind):
        def call(*a, **k):
            t0 = time.time()
            out = fn(*a, **k)
            log.append((kind, t0, time.time() - t0))
            return out
        return call

    for n, fn in saved.items():
        setattr(C, n, timed(fn, n))
    if cores:
        bind_threads(cores)
    try:
        for _ in range(reps):
            dist.barrier()
            step()
    finally:
        for n, fn in saved.items():
            setattr(C, n, fn)
        if cores:
            bind_threads(ALL_CPUS)
    logs = [None, None]
    dist.all_gather_object(logs, log)
    if rank != 0:
        return
    a, b = logs
    if len(a) != len(b) or any(x[0] != y[0] for x, y in zip(a, b)):
        print(f"{name}: the ranks' collectives differ ({len(a)} / {len(b)}): no sync report", flush=True)
        return
    skew = [abs(y[1] - x[1]) for x, y in zip(a, b)]
    latency = [max(0.0, min(x[1] + x[2], y[1] + y[2]) - max(x[1], y[1])) for x, y in zip(a, b)]
    per = 1e3 / reps
    kinds = Counter(x[0] for x in a)
    print(f"{name}: where the sharded step waits ({'ranks on own cores, ' if cores else ''}{reps} steps): "
          f"{len(a) // reps} blocking collectives a step ({', '.join(f'{v // reps} {k}' for k, v in kinds.items())}); "
          f"inside them per step: rank 0 {sum(x[2] for x in a) * per:.0f} ms, rank 1 {sum(y[2] for y in b) * per:.0f} ms; "
          f"arrival skew {sum(skew) * per:.0f} ms; latency after both arrive {sum(latency) * per:.0f} ms "
          f"(median {statistics.median(latency) * 1e3:.2f} ms a collective); rank 1 arrives "
          f"{statistics.mean(y[1] - x[1] for x, y in zip(a, b)) * 1e3:+.2f} ms later on average", flush=True)


def _bench(rank, world, args, q):
    import dtshard
    from dtshard import Replicate, Shard
    from dtshard.debug import CommCounter, peak_alloc_bytes

    mesh = dtshard.init_device_mesh("cpu", (world,))
    for name in args.configs:
        kind, shape, dim = CONFIGS[name]
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(shape, generator=g), _target(kind, shape, g)
        ref = _make(kind)
        model = copy.deepcopy(ref)
        dtshard.distribute_module(model, mesh)
        xd = dtshard.distribute_tensor(x, mesh, [Shard(dim)])
        yd = dtshard.distribute_tensor(y, mesh, [Replicate()] if kind == "resnet18" else [Shard(dim)])
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        ropt = torch.optim.SGD(ref.parameters(), lr=1e-3)
        # first step: losses side by side, then the collectives of a step
        loss = _step(model, opt, xd, yd).full_tensor().item()
        torch.set_num_threads(2)
        rloss = _step(ref, ropt, x, y).item() if rank == 0 else float("nan")
        torch.set_num_threads(1)
        dist.barrier()
        with CommCounter() as comm:
            _step(model, opt, xd, yd)
        kinds = dict(Counter(r.kind for r in comm.records))
        sent = comm.bytes()
        ag_ops = sorted({r.op for r in comm.records if r.kind == "all_gather"})
        # the compute floor: the same model on one rank's shard of the input alone (one thread, no
        # halo, no collective), what the sharded step would cost with free communication
        shard = _make(kind)
        sopt = torch.optim.SGD(shard.parameters(), lr=1e-3)
        xs = x.narrow(dim, 0, xd.to_local().shape[dim]).contiguous()
        ys = y if kind == "resnet18" else y.narrow(dim, 0, xs.shape[dim]).contiguous()
        _step(shard, sopt, xs, ys)
        t_dist, t_ref, t_shard, t_pinned = [], [], [], []
        cores = own_cores(rank, world)
        sides = (0, 1, 2, 3) if cores else (0, 1, 2)
        for rep in range(args.reps):
            for side in (sides if rep % 2 == 0 else sides[::-1]):
                dist.barrier()
                if side == 3:
                    bind_threads(cores)
                t0 = time.perf_counter()
                if side in (0, 3):
                    _step(model, opt, xd, yd)
                elif rank == 0 and side == 1:
                    torch.set_num_threads(2)
                    _step(ref, ropt, x, y)
                    torch.set_num_threads(1)
                elif rank == 0:
                    _step(shard, sopt, xs, ys)
                dist.barrier()
                (t_dist, t_ref, t_shard, t_pinned)[side].append(time.perf_counter() - t0)
                if side == 3:
                    bind_threads(ALL_CPUS)
        if args.profile:  # where the sharded step's time goes, by aten op (rank 0 profiles)
            from torch.profiler import ProfilerActivity, profile

            dist.barrier()
            # (torch.profiler.profile takes no ``enabled``: rank 1 runs the step unprofiled)
            with profile(activities=[ProfilerActivity.CPU]) if rank == 0 else contextlib.nullcontext() as prof:
                _step(model, opt, xd, yd)
            if rank == 0:
                print(f"{name}: one sharded step on rank 0 by op (PythonSubclass's self time: dtshard's "
                      "Python and the waits inside its collectives)", flush=True)
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.profile,
                                                max_name_column_width=48), flush=True)
        if args.sync:
            _sync_report(name, rank, args.sync, lambda: _step(model, opt, xd, yd), cores)
        # activation memory of one forward + backward (gradient buffers exist already), and of the
        # forward alone (what it keeps for backward: the activations, without the gradients'
        # accumulation and the gradient bucket that the backward's peak includes)
        peak = peak_alloc_bytes(lambda: F.mse_loss(model(xd), yd).backward())
        kept = []
        fwd = peak_alloc_bytes(lambda: kept.append(F.mse_loss(model(xd), yd)))
        kept.pop().backward()
        peak_ref = fwd_ref = 0
        if rank == 0:
            torch.set_num_threads(2)
            peak_ref = peak_alloc_bytes(lambda: F.mse_loss(ref(x), y).backward())
            fwd_ref = peak_alloc_bytes(lambda: kept.append(F.mse_loss(ref(x), y)))
            kept.pop().backward()
            torch.set_num_threads(1)
        peaks, fwds = [None] * world, [None] * world
        dist.all_gather_object(peaks, peak)
        dist.all_gather_object(fwds, fwd)
        row = dict(name=name, shape=shape, dim=dim, ms=1e3 * statistics.median(t_dist),
                   ms_ref=1e3 * statistics.median(t_ref), ms_shard=1e3 * statistics.median(t_shard),
                   ms_pinned=1e3 * statistics.median(t_pinned) if t_pinned else None,
                   kinds=kinds, sent=sent, ag_ops=ag_ops,
                   peak=max(peaks), peak_ref=peak_ref, fwd=max(fwds), fwd_ref=fwd_ref, loss=loss, rloss=rloss,
                   local=tuple(xd.to_local().shape),
                   load=os.getloadavg()[0])
        if rank == 0:
            q.put(row)  # each config as it is done
        model = ref = opt = ropt = shard = sopt = None  # freed before the next config


def _entry(rank, world, port, args, q):
    import_this_checkout()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        _bench(rank, world, args, q)
    finally:
        dist.destroy_process_group()


def _kinds(k: dict) -> str:
    short = {"all_reduce": "AR", "all_gather": "AG", "all_to_all": "A2A", "reduce_scatter": "RS", "broadcast": "BC"}
    return " ".join(f"{v} {short.get(n, n)}" for n, v in sorted(k.items()))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma separated, of {', '.join(CONFIGS)}")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also print the N aten ops of one sharded step on rank 0 with the most self CPU")
    p.add_argument("--sync", type=int, default=0, metavar="N",
                   help="also time every blocking collective of N sharded steps on both ranks: time inside "
                        "them, arrival skew, latency")
    args = p.parse_args(argv)
    args.configs = args.configs.split(",")
    world = 2
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, args, q)) for r in range(world)]
    for proc in procs:
        proc.start()
    print(f"torch {torch.__version__}, {world} ranks x 1 thread vs 1 process x 2 threads, {args.reps} reps, "
          f"load {os.getloadavg()[0]:.1f} at the start")
    print("| model | input (global) | sharded | step ms, 2 ranks | 1 process | ratio | one shard alone | ratio "
          "| 2 ranks, each on its own core | ratio | collectives / step "
          "| MiB sent / rank | fwd+bwd peak MiB / rank | 1 process | ratio | forward peak MiB / rank | 1 process "
          "| ratio | loss 2 ranks / 1 process | load |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|", flush=True)
    rows = []
    for _ in args.configs:
        r = q.get(timeout=3600)
        rows.append(r)
        where = ("NCDHW" if len(r["shape"]) == 5 else "NCHW")[r["dim"]]
        print(f"| {r['name']} | {'x'.join(map(str, r['shape']))} | {where} "
              f"(local {r['local'][r['dim']]}) | {r['ms']:.0f} | {r['ms_ref']:.0f} | {r['ms'] / r['ms_ref']:.2f} "
              f"| {r['ms_shard']:.0f} | {r['ms'] / r['ms_shard']:.2f} "
              + (f"| {r['ms_pinned']:.0f} | {r['ms_pinned'] / r['ms_ref']:.2f} " if r["ms_pinned"] else "| n/a | n/a ")
              + f"| {_kinds(r['kinds'])} | {r['sent'] / 2**20:.2f} | {r['peak'] / 2**20:.1f} "
              f"| {r['peak_ref'] / 2**20:.1f} "
              f"| {r['peak'] / max(r['peak_ref'], 1):.2f} | {r['fwd'] / 2**20:.1f} | {r['fwd_ref'] / 2**20:.1f} "
              f"| {r['fwd'] / max(r['fwd_ref'], 1):.2f} | {r['loss']:.6f} / {r['rloss']:.6f} | {r['load']:.1f} |",
              flush=True)
    for proc in procs:
        proc.join(60)
    for r in rows:
        print(f"{r['name']}: all_gathers only in {r['ag_ops']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
