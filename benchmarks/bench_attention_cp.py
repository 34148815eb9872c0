#!/usr/bin/env python
"""Context parallelism: a causal Llama-style attention layer on a sequence-sharded input, each
strategy of ``dtshard/rules/attention_cp.py`` side by side with one process, in one run.

    python benchmarks/bench_attention_cp.py                          # S = 2K, 4K; 2 and 4 ranks
    python benchmarks/bench_attention_cp.py --seqs 2048,4096,8192,16384 --ranks 2,4
    python benchmarks/bench_attention_cp.py --window 1024 --seqs 4096 --plan-seqs 16384 --ranks 4

Per sequence length and rank count: the forward + backward of ``F.scaled_dot_product_attention``
(causal, float32, B = 1, H = 8 query heads, Hkv = 2 (GQA 4:1) or 8 (MHA), E = 64) on q, k, v
distributed ``Shard(2)``, for each strategy that applies, forced through
``dtshard.config.attention_cp``, and the same layer in ONE process with as many threads as there
are ranks.  Reported: the median step time (wall, after a barrier; each rank runs one thread) and
the bytes the rank that receives most received forward and backward (``CommCounter``), also as
a multiple of K + V.
Peak memory per rank is not measured yet.  Times on a shared machine are noisy: compare the
columns of one run.

``--window W``: the same layer with a causal sliding-window mask instead of ``is_causal`` (row
``i`` sees keys ``(i - W, i]``; an additive float ``(S, S)`` mask, the same tensor every step, so
mask_kv reads it once), where mask_kv applies too.  ``--plan-seqs``: sequence lengths for which
only the forward bytes each rank receives are computed from the plan (``attention_cp._bytes``:
the exact bytes, also for mask_kv, whose table is read from the mask), no step is timed (16K
steps take minutes on a 2-core machine).
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
import torch.nn.functional as F  # noqa: E402


def _inputs(seq, h, hkv, e=64):
    g = torch.Generator().manual_seed(seq)
    return (torch.randn(1, h, seq, e, generator=g), torch.randn(1, hkv, seq, e, generator=g),
            torch.randn(1, hkv, seq, e, generator=g), torch.randn(1, h, seq, e, generator=g))


def _step(q, k, v, go, gqa, mask=None):
    out = F.scaled_dot_product_attention(q, k, v, is_causal=mask is None, attn_mask=mask, enable_gqa=gqa)
    out.backward(go)
    return out


def _window_mask(seq, w):
    """Causal sliding window, additive float: row i sees keys (i - w, i]; built a block of rows at
    a time (a 16K mask is 1 GiB)."""
    m = torch.empty(seq, seq)
    j = torch.arange(seq)
    for r0 in range(0, seq, 2048):
        i = torch.arange(r0, min(seq, r0 + 2048))[:, None]
        m[r0:r0 + 2048] = torch.where((j <= i) & (j > i - w), 0.0, float("-inf"))
    return m


def worker(rank, world, args, port, out_path):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dtshard = import_this_checkout()
    from dtshard import Shard
    from dtshard.debug import CommCounter
    from dtshard.rules import attention_cp

    mesh = dtshard.init_device_mesh("cpu", (world,))
    rows = []
    for seq in args.plan_seqs:  # forward bytes from the plan only
        mask = _window_mask(seq, args.window) if args.window else None
        for name, (h, hkv) in (("gqa", (8, 2)), ("mha", (8, 8))):
            q, k, v, _ = _inputs(seq, h, hkv)
            dts = [dtshard.distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v)]
            for strategy in attention_cp.STRATEGIES:
                b = attention_cp._bytes(strategy, *dts, 0, mask)
                if b is not None:
                    rows.append({"seq": seq, "heads": name, "strategy": strategy, "plan_fwd_bytes": b,
                                 "kv_bytes": (k.numel() + v.numel()) * 4,
                                 "auto": attention_cp.choose_strategy(*dts, 0, mask)})
        del mask
    for seq in args.seqs:
        mask = _window_mask(seq, args.window) if args.window else None
        for name, (h, hkv) in (("gqa", (8, 2)), ("mha", (8, 8))):
            q, k, v, go = _inputs(seq, h, hkv)
            dts = [dtshard.distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v)]
            dgo = dtshard.distribute_tensor(go, mesh, [Shard(2)])
            for strategy in attention_cp.STRATEGIES:
                if attention_cp._bytes(strategy, *dts, 0, mask) is None:
                    continue
                dtshard.config.attention_cp = strategy
                times = []
                for rep in range(args.reps + 1):
                    for d in dts:
                        d.grad = None
                    dist.barrier()
                    t0 = time.perf_counter()
                    with CommCounter() as comm:
                        _step(*dts, dgo, hkv != h, mask)
                    if rep:
                        times.append(time.perf_counter() - t0)
                most = torch.tensor([float(comm.received())], dtype=torch.float64)
                dist.all_reduce(most, op=dist.ReduceOp.MAX)  # the rank that receives most (mask_kv: uneven)
                rows.append({"seq": seq, "heads": name, "strategy": strategy, "s": statistics.median(times),
                             "recv_bytes": int(most.item()), "kv_bytes": (k.numel() + v.numel()) * 4,
                             "plan_fwd_bytes": attention_cp._bytes(strategy, *dts, 0, mask)})
            dtshard.config.attention_cp = "auto"
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def one_process(seqs, threads, reps, window=0):
    torch.set_num_threads(threads)
    out = {}
    for seq in seqs:
        mask = _window_mask(seq, window) if window else None
        for name, (h, hkv) in (("gqa", (8, 2)), ("mha", (8, 8))):
            q, k, v, go = _inputs(seq, h, hkv)
            ts = [t.clone().requires_grad_() for t in (q, k, v)]
            times = []
            for rep in range(reps + 1):
                t0 = time.perf_counter()
                _step(*ts, go, hkv != h, mask)
                if rep:
                    times.append(time.perf_counter() - t0)
            out[seq, name] = statistics.median(times)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seqs", default="2048,4096", type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--ranks", default="2,4", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--window", type=int, default=0, help="sliding-window mask of this many keys (0: is_causal)")
    ap.add_argument("--plan-seqs", default="", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="sequence lengths for forward bytes from the plan only (no step)")
    args = ap.parse_args()
    results = []
    for world in args.ranks:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            mp.spawn(worker, args=(world, args, free_port(), f.name), nprocs=world)
            results.append((world, json.load(open(f.name))))
    if args.plan_seqs:
        print("| ranks | S | heads | strategy | forward received MiB/rank (plan) | / K+V | auto picks |")
        print("|---:|---:|---|---|---:|---:|---|")
        for world, rows in results:
            for r in rows:
                if "s" not in r:
                    b = r["plan_fwd_bytes"]
                    print(f"| {world} | {r['seq']} | {r['heads']} | {r['strategy']} | "
                          f"{b / 2**20:.2f} | {b / r['kv_bytes']:.3f} | {r['auto']} |")
        print()
    print("| ranks | S | heads | strategy | step s | one process s (as many threads) | x one process | "
          "fwd received MiB/rank (plan) | received MiB/rank (fwd+bwd) | / K+V |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for world, rows in results:
        base = one_process(args.seqs, world, args.reps, args.window) if args.seqs else {}
        for r in rows:
            if "s" not in r:
                continue
            b = base[r["seq"], r["heads"]]
            print(f"| {world} | {r['seq']} | {r['heads']} | {r['strategy']} | {r['s']:.3f} | {b:.3f} | "
                  f"{r['s'] / b:.2f} | {r['plan_fwd_bytes'] / 2**20:.2f} | {r['recv_bytes'] / 2**20:.2f} | "
                  f"{r['recv_bytes'] / r['kv_bytes']:.2f} |")


if __name__ == "__main__":
    main()
