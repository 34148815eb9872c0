#!/usr/bin/env python
"""Peak memory of an FSDP step's phases (forward, backward, optimizer step), eager vs compiled.

    python benchmarks/fsdp_phase_peaks.py                    # mlp config, dtshard eager and compiled
    python benchmarks/fsdp_phase_peaks.py --config llama --libs torch,dtshard,compiled

2 gloo ranks; each library's model from ``bench_fsdp._build`` trains 3 warm-up steps, then 4
steps whose phases are profiled separately with ``bench_fsdp._peak_bytes`` (peak of the CPU
allocator's events above the start of the phase).  Prints rank 0's peaks in MiB per step: a
peak that moves between identical steps points to buffers freed by another thread.
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


def worker(rank, port, config, lib):
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
        f = B._peak_bytes(lambda: held.setdefault("loss", B._loss(config, model, x, y, lib, dtshard)))
        b = B._peak_bytes(lambda: held["loss"].backward()) if config != "fsdp_tp" else 0
        o = B._peak_bytes(lambda: (opt.step(), opt.zero_grad()))
        rows.append(tuple(round(v / 2**20, 1) for v in (f, b, o)))
    if rank == 0:
        print(f"{config} {lib}: (forward, backward, optimizer) peak MiB per step: {rows}", flush=True)
    dist.barrier()
    os._exit(0)  # see bench_fsdp.worker: skip the interpreter's teardown


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="mlp", choices=["mlp", "llama"])
    ap.add_argument("--libs", default="dtshard,compiled", help="comma-separated: torch, dtshard, compiled")
    args = ap.parse_args()
    for lib in args.libs.split(","):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(port, args.config, lib), nprocs=2, join=True)


if __name__ == "__main__":
    main()
