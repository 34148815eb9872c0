#!/usr/bin/env python
"""What sharding-invariant random numbers cost: ``dtshard.config.random_draws`` "global" (every
rank draws the full tensor and keeps its slice: the same values as one process on any layout)
against "local" (each rank draws its shard only), side by side in one run, on gloo ranks.

    python benchmarks/bench_random.py                 # 2 and 4 ranks, 64 MiB fp32, 7 reps
    python benchmarks/bench_random.py --ranks 4 --mib 256

Per rank and repetition, in a rotated order with a barrier before each: ``normal_`` and
``kaiming_uniform_`` (what ``init_weights`` calls) on a ``Shard(0)`` DTensor of ``--mib`` MiB
(global) in each mode, and the same fill of a plain tensor of the local shard's size (``floor``).
Reports the median seconds and the median of the per-repetition ratios to the floor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkout import free_port, import_this_checkout  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402



def worker(rank, world, args, port, out_path):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dtshard = import_this_checkout()
    from torch.distributed.tensor import Shard

    mesh = dtshard.init_device_mesh("cpu", (world,))
    n = int((args.mib * 2**20 / 4) ** 0.5)
    t = dtshard.distribute_tensor(torch.zeros(n, n), mesh, [Shard(0)])
    plain = torch.zeros_like(t.to_local())
    fills = {"normal_": lambda x: x.normal_(), "kaiming_uniform_": torch.nn.init.kaiming_uniform_}
    variants = [(f, mode) for f in fills for mode in ("global", "local", "floor")]
    times = {v: [] for v in variants}
    for rep in range(args.reps + 1):  # the first repetition warms up
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        for fill, mode in order:
            dist.barrier()
            dtshard.config.random_draws = "global" if mode == "floor" else mode
            t0 = time.perf_counter()
            fills[fill](plain if mode == "floor" else t)
            if rep:
                times[fill, mode].append(time.perf_counter() - t0)
    dtshard.config.random_draws = "global"
    if rank == 0:
        out = {}
        for fill in fills:
            floor = times[fill, "floor"]
            for mode in ("global", "local", "floor"):
                ts = times[fill, mode]
                out[f"{fill} {mode}"] = (statistics.median(ts), statistics.median(a / b for a, b in zip(ts, floor)))
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--mib", type=float, default=64)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {args.mib} MiB fp32 global, Shard(0), 1 thread per rank, median of {args.reps}")
    for world in (int(w) for w in args.ranks.split(",")):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            mp.spawn(worker, args=(world, args, free_port(), f.name), nprocs=world)
            res = json.load(open(f.name))
        for name, (sec, ratio) in res.items():
            print(f"{world} ranks  {name:<26} {sec * 1e3:8.1f} ms  {ratio:5.2f}x floor")


if __name__ == "__main__":
    main()
