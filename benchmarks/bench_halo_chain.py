#!/usr/bin/env python
"""Halos kept across layers: a chain of stride-1 3x3 convs with GroupNorm + SiLU, H-sharded,
one training step (forward + backward) per halo depth, side by side on gloo CPU ranks.

    python benchmarks/bench_halo_chain.py                       # 2 and 4 ranks, two shapes (~2 min)
    python benchmarks/bench_halo_chain.py --world 2 --depths 1,2,4,auto --layers 4 --reps 9
    python benchmarks/bench_halo_chain.py --model               # measure the "auto" model's constants

Per world size and shape, every variant (``halo_depth(n)``) runs the same model on the same
input, interleaved (A B C A B C ..., order rotated each repetition, after a barrier), one
intra-op thread per rank; reported: median wall ms of a step on rank 0, its ratio to depth 1,
the halo all_to_alls per step (CommCounter), the halo bytes each rank sends, and the extra rows
the convolutions compute over the owned ones (the ``r (L - 1) / w`` of the design).  Every
variant's loss is checked against depth 1 (fp64 would be exact; fp32 within 1e-5).

``--model`` measures the two constants of ``dtshard.spatial.model``: the fixed cost of one halo
exchange (an all_to_all of one row each way, with its packing and assembly, median of many) and
a 3x3 convolution's local throughput (FLOP/s), on this machine, and prints them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from _checkout import free_port  # noqa: E402  (benchmarks/: run as a script)


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(_ROOT, "kernels"), _ROOT):  # this checkout's dtshard_kernels and dtshard
    if _path not in sys.path:
        sys.path.insert(0, _path)


def _chain(c: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(2, c), nn.SiLU()]
    return nn.Sequential(*mods)


def _step(model, x):
    y = model(x)
    loss = (y * y).mean()
    loss.backward()
    return loss


def _bench(rank, world, args, q):
    import copy

    import dtshard
    from dtshard import Shard
    from dtshard.debug import CommCounter

    mesh = dtshard.init_device_mesh("cpu", (world,))
    rows = []
    for shape in args.shapes:
        n, c, h, w = shape
        ref = _chain(c, args.layers)
        torch.manual_seed(1)
        x = torch.randn(n, c, h, w)
        variants = []
        for depth in args.depths:
            model = copy.deepcopy(ref)
            dtshard.distribute_module(model, mesh)
            variants.append((depth, model))
        xd = dtshard.distribute_tensor(x, mesh, [Shard(2)])
        info = {}
        for depth, model in variants:  # warm-up, counts, extra rows, loss
            local_rows = []
            hooks = [m.register_forward_hook(lambda m, a, o: local_rows.append(o._local_tensor.shape[2]))
                     for m in model.modules() if isinstance(m, nn.Conv2d)]
            with dtshard.spatial.halo_depth(depth):
                _step(model, xd)
                with CommCounter() as comm:
                    loss = _step(model, xd).full_tensor().item()
            for hk in hooks:
                hk.remove()
            halo = [r for r in comm.records if r.kind == "all_to_all"]
            owned = xd.to_local().shape[2]
            extra = sum(local_rows[-args.layers:]) / (args.layers * owned) - 1 if owned else 0.0
            info[depth] = dict(a2a=len(halo), bytes=sum(r.nbytes for r in halo), extra=extra, loss=loss)
            model.zero_grad(set_to_none=True)
        times = {d: [] for d, _ in variants}
        for rep in range(args.reps):
            order = variants[rep % len(variants):] + variants[:rep % len(variants)]
            for depth, model in order:
                dist.barrier()
                t0 = time.perf_counter()
                with dtshard.spatial.halo_depth(depth):
                    _step(model, xd)
                dist.barrier()
                times[depth].append(time.perf_counter() - t0)
                model.zero_grad(set_to_none=True)
        for depth, _ in variants:
            rows.append(dict(world=world, shape=tuple(shape), depth=depth, ms=1e3 * statistics.median(times[depth]),
                             **info[depth]))
    if rank == 0:
        q.put(rows)


def _model(rank, world, args, q):
    import dtshard
    from dtshard.spatial import halo as H
    from dtshard.spatial import halo_layout as L

    mesh = dtshard.init_device_mesh("cpu", (world,))
    me = mesh.get_coordinate()[0]
    lat = []
    x = torch.randn(1, 8, 64, 32)
    plan = L.grow_plan(64 * world, world, me, 1, 1)
    for _ in range(300):
        dist.barrier()
        t0 = time.perf_counter()
        H.exchange(x, plan, 2, mesh, 0)
        lat.append(time.perf_counter() - t0)
    conv = nn.Conv2d(32, 32, 3, padding=1)
    xs = torch.randn(2, 32, 64, 64, requires_grad=True)
    for _ in range(3):
        conv(xs).sum().backward()
    ts = []
    for _ in range(15):  # forward + backward (3x the forward's FLOPs), as in training
        dist.barrier()
        t0 = time.perf_counter()
        conv(xs).sum().backward()
        ts.append(time.perf_counter() - t0)
    dt = statistics.median(ts)
    flops = 3 * 2 * 2 * 32 * 32 * 9 * 64 * 64
    if rank == 0:
        q.put(dict(latency_s=statistics.median(lat[50:]), flops_per_s=flops / dt))


def _entry(rank, world, port, fn, args, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        fn(rank, world, args, q)
    finally:
        dist.destroy_process_group()


def _spawn(world, fn, args):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    out = q.get(timeout=1800)
    for p in procs:
        p.join(60)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", default="2,4", help="rank counts (default 2,4)")
    p.add_argument("--depths", default="1,2,4,auto")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--shapes", default="2x8x64x32,2x32x64x64",
                   help="N x C x (local H) x W per shape, comma separated; H is multiplied by the ranks")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--model", action="store_true", help="measure the auto depth model's constants")
    args = p.parse_args(argv)
    worlds = [int(v) for v in args.world.split(",")]
    if args.model:
        for world in worlds:
            print(f"world {world}:", _spawn(world, _model, args))
        return 0
    args.depths = [d if d == "auto" else int(d) for d in args.depths.split(",")]
    print(f"{'ranks':>5} {'shape (global)':>18} {'depth':>5} {'ms/step':>8} {'x depth1':>8} {'halo a2a':>8} "
          f"{'KiB sent':>8} {'extra rows':>10} {'|d loss|':>9}")
    for world in worlds:
        shapes = []
        for s in args.shapes.split(","):
            n, c, h, w = (int(v) for v in s.split("x"))
            shapes.append((n, c, h * world, w))
        a = argparse.Namespace(**vars(args))
        a.shapes = shapes
        rows = _spawn(world, _bench, a)
        base = {r["shape"]: r for r in rows if r["depth"] == 1}
        for r in rows:
            b = base.get(r["shape"], r)
            print(f"{world:>5} {'x'.join(map(str, r['shape'])):>18} {str(r['depth']):>5} {r['ms']:8.2f} "
                  f"{r['ms'] / b['ms']:8.2f} {r['a2a']:8d} {r['bytes'] / 1024:8.1f} {100 * r['extra']:9.1f}% "
                  f"{abs(r['loss'] - b['loss']):9.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
