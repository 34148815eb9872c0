#!/usr/bin/env python
"""Pipelined packing (``dtshard.config.pipeline_chunk_bytes``) against one collective and against
the raw dim-0 collective on the same bytes, side by side in one run (2 gloo ranks by default).

    python benchmarks/bench_pipeline.py                   # 16 MiB, S1->R, P->S1, S0->S1, 15 reps
    python benchmarks/bench_pipeline.py --mib 4 --reps 9 --pieces 2,4

For each transition of a square fp32 tensor of ``--mib`` MiB (global), every variant runs the same
redistribute: ``one`` (pipelining off: one collective with its packing / unpacking copy), ``kN``
(forced on, cut into N pieces: ``pipeline_chunk_bytes`` = the transfer's bytes / N), and ``raw``:
the bare ProcessGroup collective of the same bytes along dim 0 (all_gather of a rank's
contiguous half, reduce_scatter of the whole, all_to_all_single of a rank's half), which needs no
copy at all: the floor.  Values are checked against the global tensor first.  Timing: wall per
call, every variant once per repetition in a rotated order, a barrier before each call; medians
over ``--reps`` repetitions; ``x raw`` and ``x one`` = medians of the per-repetition ratios to
``raw`` and to ``one``.
Main-thread CPU (``cpu``) excludes gloo's worker threads.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkout import import_this_checkout  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

TRANSITIONS = [("S1->R", "S1", "R"), ("P->S1", "P", "S1"), ("S0->S1", "S0", "S1")]


def _placement(dtshard, code):
    return {"S0": dtshard.Shard(0), "S1": dtshard.Shard(1), "R": dtshard.Replicate(), "P": dtshard.Partial()}[code]


def worker(rank, args, port, out_path):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    warnings.filterwarnings("ignore", category=FutureWarning)  # the dist.*_tensor spellings
    torch.set_num_threads(1)
    ws = args.world
    dist.init_process_group("gloo", rank=rank, world_size=ws, timeout=datetime.timedelta(seconds=300))
    dtshard = import_this_checkout()
    cfg = dtshard.config
    mesh = dtshard.init_device_mesh("cpu", (ws,))
    n = int(round(math.sqrt(args.mib * (1 << 20) / 4)))
    n -= n % ws
    G = torch.randn(n, n, generator=torch.Generator().manual_seed(5))
    half = G.chunk(ws, 0)[rank].contiguous()  # a rank's contiguous share of the same bytes
    ag_out, rs_out, a2a_out = torch.empty(n, n), torch.empty_like(half), torch.empty_like(half)
    rs_in = G * (rank + 1)
    raw = {
        "S1->R": lambda: dist.all_gather_into_tensor(ag_out, half),
        "P->S1": lambda: dist.reduce_scatter_tensor(rs_out, rs_in),
        "S0->S1": lambda: dist.all_to_all_single(a2a_out, half),
    }
    pieces = [int(p) for p in args.pieces.split(",")]
    rows = []
    for name, src, dst in TRANSITIONS:
        if src == "P":
            x = dtshard.DTensor.from_local(G * (rank + 1), mesh, [dtshard.Partial()])
            want = G * sum(r + 1 for r in range(ws))
        else:
            x = dtshard.distribute_tensor(G, mesh, [_placement(dtshard, src)])
            want = G
        target = [_placement(dtshard, dst)]
        # the transfer's bytes as the pipelining sees them: the largest local tensor either side
        nbytes = max(x.to_local().numel(), x.redistribute(mesh, target).to_local().numel()) * 4

        def variant(chunk):
            def f():
                saved = (cfg.pipeline_chunk_bytes, cfg.pipeline_device_types, cfg.pipeline_max_chunks)
                cfg.pipeline_chunk_bytes, cfg.pipeline_device_types, cfg.pipeline_max_chunks = chunk, ("cpu",), 64
                try:
                    return x.redistribute(mesh, target)
                finally:
                    cfg.pipeline_chunk_bytes, cfg.pipeline_device_types, cfg.pipeline_max_chunks = saved
            return f

        fns = {"raw": raw[name], "one": variant(0)}
        for k in pieces:
            fns[f"k{k}"] = variant(nbytes // k)
        ok = {}
        for label, f in fns.items():
            if label != "raw":
                ok[label] = bool(torch.allclose(f().full_tensor(), want, rtol=1e-5, atol=1e-4))
        walls = {k: [] for k in fns}
        cpus = {k: [] for k in fns}
        names = list(fns)
        for rep in range(args.reps + 1):
            order = names[rep % len(names):] + names[:rep % len(names)]
            for label in order:
                dist.barrier()
                t0, c0 = time.perf_counter(), time.thread_time()
                fns[label]()
                w, c = time.perf_counter() - t0, time.thread_time() - c0
                if rep:  # the first repetition warms up
                    walls[label].append(w)
                    cpus[label].append(c)
        rows.append({"transition": name, "MiB": n * n * 4 / (1 << 20), "ok": ok, "walls": walls, "cpus": cpus})
    everyone = [None] * ws
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        with open(out_path, "w") as fh:
            json.dump(everyone, fh)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=float, default=16.0, help="global tensor size in MiB")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--pieces", default="2,4,8", help="piece counts to force")
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "res.json")
    load0 = os.getloadavg()[0]
    mp.spawn(worker, args=(args, port, out), nprocs=args.world, join=True)
    load1 = os.getloadavg()[0]
    with open(out) as fh:
        per_rank = json.load(fh)
    rows = per_rank[0]  # rank 0's clock (the collectives line the ranks up)
    labels = list(rows[0]["walls"])
    print(f"# {args.world} gloo ranks, {rows[0]['MiB']:.0f} MiB fp32, {args.reps} reps, torch {torch.__version__}, "
          f"load average {load0:.1f} -> {load1:.1f}")
    head = {"raw": "raw ms", "one": "one ms (x raw)"}
    print("| transition | " + " | ".join(head.get(k, f"{k} ms (x raw, x one)") for k in labels)
          + " | main-thread CPU ms "
          + " / ".join(labels) + " | correct |")
    print("|---|" + "---:|" * len(labels) + "---|---|")
    for t, row in enumerate(rows):
        w = row["walls"]
        cells = []
        for k in labels:
            med = statistics.median(w[k]) * 1e3
            if k == "raw":
                cells.append(f"{med:.2f}")
            else:
                ratio = statistics.median(a / b for a, b in zip(w[k], w["raw"]))
                vs_one = "" if k == "one" else \
                    f", {statistics.median(a / b for a, b in zip(w[k], w['one'])):.2f}"
                cells.append(f"{med:.2f} ({ratio:.2f}{vs_one})")
        cpu = " / ".join(f"{statistics.median(row['cpus'][k]) * 1e3:.1f}" for k in labels)
        oks = [r[t]["ok"] for r in per_rank]
        correct = "all" if all(all(ok.values()) for ok in oks) else json.dumps(oks)
        print(f"| {row['transition']} | " + " | ".join(cells) + f" | {cpu} | {correct} |")


if __name__ == "__main__":
    main()
