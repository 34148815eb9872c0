#!/usr/bin/env python
"""Peak memory of an FSDP step's phases (forward, backward, optimizer step), eager vs compiled.

    python benchmarks/fsdp_phase_peaks.py                    # mlp config, dtshard eager and compiled
    python benchmarks/fsdp_phase_peaks.py --config llama --libs torch,dtshard,compiled

2 gloo ranks; each library's model from ``bench_fsdp._build`` trains 3 warm-up steps, then 4
steps whose phases are measured separately with ``bench_fsdp._peak_bytes`` (``--memory rss``,
the default: the process's resident high-water mark above the start of the phase, the ranks
started with ``MALLOC_MMAP_THRESHOLD_=65536``; ``--memory alloc``: the profiler's allocation
events, which miss the frees made by gloo's threads).  Prints rank 0's peaks in MiB per step.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_fsdp as B  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


def worker(rank, port, config, lib, memory):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=300))
    dtshard = B.import_this_checkout()
    model, dpi, _ = B._build(config, lib, dtshard)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for s in range(3):
        x, y = B._batch(config, s, dpi)
        B._step(config, model, opt, x, y, lib, dtshard)
    rows = []
    for rep in range(4):
        x, y = B._batch(config, 5 + rep, dpi)
        held = {}
        f = B._peak_bytes(lambda: held.setdefault("loss", B._loss(config, model, x, y, lib, dtshard)), memory)
        b = B._peak_bytes(lambda: held["loss"].backward(), memory) if config != "fsdp_tp" else 0
        o = B._peak_bytes(lambda: (opt.step(), opt.zero_grad()), memory)
        rows.append(tuple(round(v / 2**20, 1) for v in (f, b, o)))
    if rank == 0:
        print(f"{config} {lib}: (forward, backward, optimizer) peak MiB per step: {rows}", flush=True)
    dist.barrier()
    os._exit(0)  # see bench_fsdp.worker: skip the interpreter's teardown


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="mlp", choices=["mlp", "llama"])
    ap.add_argument("--libs", default="dtshard,compiled", help="comma-separated: torch, dtshard, compiled")
    ap.add_argument("--memory", default="rss", choices=["rss", "alloc"], help="see bench_fsdp.py --memory")
    args = ap.parse_args()
    if args.memory == "rss":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # dtshard.debug.RSS_MMAP_THRESHOLD, read at process start
    for lib in args.libs.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(port, args.config, lib, args.memory), nprocs=2, join=True)


if __name__ == "__main__":
    main()
