#!/usr/bin/env python
"""Context parallelism: a causal Llama-style attention layer on a sequence-sharded input, each
strategy of ``dtshard/rules/attention_cp.py`` side by side with one process, in one run: step
time, bytes received and peak memory per rank.

    python benchmarks/bench_attention_cp.py                          # S = 2K, 4K; 2 and 4 ranks
    python benchmarks/bench_attention_cp.py --seqs 8192 --ranks 2 --reps 0   # 8K: memory + bytes only
    python benchmarks/bench_attention_cp.py --seqs "" --plan-seqs 16384 --ranks 2,4   # plan bytes only
    python benchmarks/bench_attention_cp.py --window 1024 --seqs 4096 --plan-seqs 16384 --ranks 4

Per sequence length and rank count: the forward + backward of ``F.scaled_dot_product_attention``
(causal, float32, B = 1, H = 8 query heads, Hkv = 2 (``gqa``, 4:1) or 8 (``mha``), E = 64) on q, k,
v distributed ``Shard(2)``, for each strategy that applies, forced through
``dtshard.config.attention_cp``, and the same layer in ONE process with as many threads as there
are ranks (its own spawned process, after the ranks').  Reported:

- the median of ``--reps`` step times (wall, after a barrier and one warm-up step; each rank runs
  one thread).  ``--reps 0``: no step is timed, only the memory step runs (then it is the first
  call of that strategy in the process);
- the bytes the rank that receives most received forward and backward (``CommCounter``), also as
  a multiple of K + V, and the forward's bytes from the plan (``attention_cp._bytes``);
- **peak memory per rank** (the most over the ranks) of one more step, untimed, and of the
  one-process step, measured two ways (CPU torch has no allocator statistics:
  ``torch.cuda.max_memory_allocated`` has no CPU counterpart, and ``tracemalloc`` does not see
  torch's allocator):

  * ``peak`` (tensor bytes): ``torch.profiler.profile(profile_memory=True)`` around the step
    records one ``[memory]`` event per allocation (+bytes) and free (-bytes) of torch's CPU
    allocator; replayed in time order (``prof.profiler.kineto_results.events()``, the raw events:
    ``prof.events()`` folds them into per-op totals), the running sum's maximum is the peak of
    tensor bytes live during forward + backward above what was live before the step (the inputs,
    their shards and the mask are not counted; the output and the gradients, alive at the end,
    are).  The profiler records the events of the thread that runs it only (checked: a Python
    thread's allocations are not recorded): that is the thread that runs dtshard's handlers, the
    kernels (1 thread per rank; in one process the kernel's scratch buffer is allocated by the
    calling thread) and the CPU autograd backward, but not gloo's worker threads, whose staging
    buffers are missed, a tensor freed there counts as live to the end, and one allocated there
    (a received buffer) is not counted.  The column ``replay error`` measures what this loses:
    the largest ``|live bytes at the end by the replay - the output's and the gradients'|`` over
    the ranks (what must be live then is known exactly); the peak is uncertain by about that.
  * ``RSS extra``: ``VmHWM`` after the step minus ``VmRSS`` before it, the high-water mark reset
    with ``/proc/self/clear_refs`` (as ``bench_memory.py``), every thread's every touched page
    (gloo's buffers included; a buffer never written costs nothing).  For RSS to follow live
    bytes the processes run with ``MALLOC_MMAP_THRESHOLD_=65536`` (each block >= 64 KiB its own
    mmap, returned on free; see ``bench_memory.py``), which applies to the timed steps of every
    column alike; ``--no-rss`` leaves glibc's default and drops the column.

  What to expect (derived from the strategies, not measured): one process holds ``out``, ``dq``,
  ``dk``, ``dv`` and the kernel's buffers; a rank holds ``1/n`` of those plus the strategy's K/V
  working set: allgather_kv the whole K and V (and in backward whole-size ``dK``, ``dV`` before
  the reduce_scatter), the ring two blocks (and their accumulators), Ulysses whole sequences of
  ``H/n`` heads of q, k, v, out (and the gradients), mask_kv the rows its mask needs.

Times on a shared machine are noisy: compare the columns of one run.

``--choice``: the strategy ``auto`` picks (by the slowest rank's estimated step time) against every
strategy forced, causal, ``--heads mha,gqa,mqa``: the step's wall time, each rank's process CPU
time of the step (the most over the ranks is what the slowest rank costs on a core of its own)
and the (query, key) pairs each rank's kernel calls evaluate.  ``--calibrate``: measures the three
costs the estimate uses (``dtshard.config.attention_cp_pair_seconds``, ``_byte_seconds``,
``_collective_seconds``) on this machine.

``--window W``: the same layer with a causal sliding-window mask instead of ``is_causal`` (row
``i`` sees keys ``(i - W, i]``; an additive float ``(S, S)`` mask, the same tensor every step, so
mask_kv reads it once), where mask_kv applies too.  ``--plan-seqs``: sequence lengths for which
only the forward bytes each rank receives are computed from the plan (``attention_cp._bytes``:
the exact bytes, also for mask_kv, whose table is read from the mask), no step is run (16K
steps take minutes on a 2-core machine).  ``--heads`` and ``--strategies`` pick a subset.
"""

from __future__ import annotations

import argparse
import gc
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


MiB = 2**20
STRATEGIES = ("ulysses", "allgather_kv", "ring", "mask_kv", "balanced")  # attention_cp.STRATEGIES (checked in worker)
HEADS = {"gqa": (8, 2), "mha": (8, 8), "mqa": (8, 1)}  # (query heads, key/value heads)
MMAP_THRESHOLD = "65536"


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


def _rss_kib(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _peak_live(prof) -> tuple[int, int]:
    """Peak live bytes of torch's CPU allocator during ``prof``'s window, relative to its start,
    and the bytes still live at its end: the profiler's raw ``[memory]`` events (one per
    allocation, +bytes, and per free, -bytes), replayed in time order, the running sum's maximum
    and last value.  (``prof.events()`` folds them into the ops' totals, which loses the order,
    hence the raw kineto events.)"""
    evs = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    cur = peak = 0
    for e in sorted(evs, key=lambda e: e.start_ns()):
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak, cur


def _local_bytes(ts) -> int:
    return sum((getattr(t, "_local_tensor", t)).untyped_storage().nbytes() for t in ts)


def _measured_step(step, leaves, rss: bool):
    """One step under the memory profiler: (peak live tensor bytes, RSS extra bytes or None,
    replay error).  RSS extra: VmHWM after the step - VmRSS before it, the high-water mark reset
    with ``/proc/self/clear_refs`` inside the profiled window (the profiler's own event buffers
    count too).  Replay error: the profiler's live bytes at the end minus what must be live then
    (the output and ``leaves``' gradients): positive, tensors freed on a thread the profiler
    does not record (gloo's workers), which the replay counts as live to the end; negative, ones
    allocated there and still live.  The peak is uncertain by about that much."""
    from torch.profiler import ProfilerActivity, profile

    gc.collect()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        if rss:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            base = _rss_kib("VmRSS")
        out = step()
        extra = (_rss_kib("VmHWM") - base) * 1024 if rss else None
    held = _local_bytes([out] + [t.grad for t in leaves])
    del out
    peak, end = _peak_live(prof)
    return peak, extra, end - held


def worker(rank, world, args, port, out_path):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dtshard = import_this_checkout()
    from dtshard import Shard
    from dtshard.debug import CommCounter
    from dtshard.rules import attention_cp

    def most(x):  # the most over the ranks (mask_kv's and the ring's ranks differ)
        t = torch.tensor([float(x)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    assert attention_cp.STRATEGIES == STRATEGIES, attention_cp.STRATEGIES
    mesh = dtshard.init_device_mesh("cpu", (world,))
    rows = []
    for seq in args.plan_seqs:  # forward bytes from the plan only
        mask = _window_mask(seq, args.window) if args.window else None
        for name, (h, hkv) in ((n, HEADS[n]) for n in args.heads):
            q, k, v, _ = _inputs(seq, h, hkv)
            dts = [dtshard.distribute_tensor(t, mesh, [Shard(2)]) for t in (q, k, v)]
            for strategy in attention_cp.STRATEGIES:
                b = attention_cp._bytes(strategy, *dts, 0, mask, mask is None)
                if b is not None:
                    rows.append({"seq": seq, "heads": name, "strategy": strategy, "plan_fwd_bytes": b,
                                 "kv_bytes": (k.numel() + v.numel()) * 4,
                                 "auto": attention_cp.choose_strategy(*dts, 0, mask, mask is None)})
        del mask
    for seq in args.seqs:
        mask = _window_mask(seq, args.window) if args.window else None
        for name, (h, hkv) in ((n, HEADS[n]) for n in args.heads):
            q, k, v, go = _inputs(seq, h, hkv)
            dts = [dtshard.distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v)]
            dgo = dtshard.distribute_tensor(go, mesh, [Shard(2)])
            del q, k, v, go
            for strategy in args.strategies:
                if attention_cp._bytes(strategy, *dts, 0, mask, mask is None) is None:
                    continue
                dtshard.config.attention_cp = strategy
                times = []
                for rep in range(args.reps + 1 if args.reps else 0):  # the first one is a warm-up
                    for d in dts:
                        d.grad = None
                    dist.barrier()
                    t0 = time.perf_counter()
                    with CommCounter() as comm:
                        _step(*dts, dgo, hkv != h, mask)
                    if rep:
                        times.append(time.perf_counter() - t0)
                row = {"seq": seq, "heads": name, "strategy": strategy,
                       "s": statistics.median(times) if times else None,
                       "kv_bytes": dts[1].numel() * 4 * 2,
                       "plan_fwd_bytes": attention_cp._bytes(strategy, *dts, 0, mask, mask is None)}
                if args.memory or not times:  # one more step, untimed, under the memory profiler
                    for d in dts:
                        d.grad = None
                    dist.barrier()
                    with CommCounter() as comm:
                        peak, extra, unseen = _measured_step(lambda: _step(*dts, dgo, hkv != h, mask), dts, args.rss)
                    row["peak_bytes"] = most(peak)
                    row["rss_extra_bytes"] = most(extra) if args.rss else None
                    row["unseen_free_bytes"] = most(abs(unseen))
                row["recv_bytes"] = most(comm.received())
                rows.append(row)
            dtshard.config.attention_cp = "auto"
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def choice_worker(rank, world, args, port, out_path):
    """``--choice``: per sequence length and head layout, what ``auto`` picks (and its estimates),
    then every strategy that applies forced: the step's wall time (median of ``--reps`` after
    ``--warmup`` steps), each rank's process CPU time of the step (the most over the ranks: what
    the slowest rank costs when it has a core of its own, which 4 ranks on 2 shared cores do not
    have) and the (query, key) pairs each rank's kernel calls evaluate (``work_stats``)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dtshard = import_this_checkout()
    from dtshard import Shard
    from dtshard.rules import attention_cp

    def gather(x):
        out = [None] * world
        dist.all_gather_object(out, x)
        return out

    mesh = dtshard.init_device_mesh("cpu", (world,))
    rows = []
    for seq in args.seqs:
        for name in args.heads:
            h, hkv = HEADS[name]
            q, k, v, go = _inputs(seq, h, hkv)
            dts = [dtshard.distribute_tensor(t, mesh, [Shard(2)]).requires_grad_() for t in (q, k, v)]
            dgo = dtshard.distribute_tensor(go, mesh, [Shard(2)])
            del q, k, v, go
            dtshard.config.attention_cp = "auto"
            auto = attention_cp.choose_strategy(*dts, 0, None, True)
            ests = {s: e for s in attention_cp.STRATEGIES
                    if (e := attention_cp.estimate(s, *dts, 0, None, True)) is not None}
            for strategy in args.strategies:
                if strategy not in ests:
                    continue
                dtshard.config.attention_cp = strategy
                walls, cpus = [], []
                for rep in range(args.warmup + args.reps):
                    for d in dts:
                        d.grad = None
                    dist.barrier()
                    attention_cp.work_stats["pairs"] = 0
                    t0, c0 = time.perf_counter(), time.process_time()
                    out = F.scaled_dot_product_attention(*dts, is_causal=True, enable_gqa=hkv != h)
                    pairs = attention_cp.work_stats["pairs"]
                    out.backward(dgo)
                    c1 = time.process_time() - c0
                    dist.barrier()
                    w = time.perf_counter() - t0
                    if rep >= args.warmup:
                        walls.append(w)
                        cpus.append(c1)
                    del out
                cpu = statistics.median(cpus)
                all_cpu, all_pairs = gather(cpu), gather(pairs)
                e = ests[strategy]
                rows.append({"seq": seq, "heads": name, "strategy": strategy, "auto": auto,
                             "wall": statistics.median(walls), "cpu_max": max(all_cpu),
                             "cpu_ranks": all_cpu, "pairs": all_pairs, "est": e.seconds,
                             "est_compute": e.compute, "est_comm": e.comm})
            dtshard.config.attention_cp = "auto"
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def choice_table(world, rows) -> None:
    print(f"| S | heads | strategy | auto picks | est. s (slowest rank) | step wall s | slowest rank CPU s | "
          f"/ fastest forced (CPU) | CPU s per rank | pairs max / mean |")
    print("|---:|---|---|---|---:|---:|---:|---:|---|---:|")
    for key in dict.fromkeys((r["seq"], r["heads"]) for r in rows):
        group = [r for r in rows if (r["seq"], r["heads"]) == key]
        best = min(r["cpu_max"] for r in group)
        for r in group:
            mark = "**" if r["strategy"] == r["auto"] else ""
            pairs = r["pairs"]
            print(f"| {r['seq']} | {r['heads']} {HEADS[r['heads']][0]}:{HEADS[r['heads']][1]} | "
                  f"{mark}{r['strategy']}{mark} | {r['auto']} | {r['est']:.3f} | {r['wall']:.3f} | "
                  f"{r['cpu_max']:.3f} | {r['cpu_max'] / best:.2f} | "
                  f"{' '.join(f'{c:.2f}' for c in r['cpu_ranks'])} | {_balance_text(pairs)} |")


def _balance_text(pairs) -> str:
    """Per-rank work: max / mean of the pairs the kernel calls evaluate (ulysses calls the kernel on
    whole sequences of H/n heads, which ``work_stats`` does not count: equal by construction)."""
    if not sum(pairs):
        return "1.00 (H/n heads each)"
    return f"{max(pairs) / (sum(pairs) / len(pairs)):.2f}"


def calibrate_worker(rank, world, args, port, out_path):
    """``--calibrate``: the three costs ``auto`` estimates with, measured here.  Rank 0 first times
    the fused CPU kernel alone on one thread (forward + backward, 8 heads of 64, 2K tokens, whole
    and causal; the least process CPU time of 3): seconds per (query, key) pair, head and element
    of E + Ev.  Then every rank: gloo all_gathers of 8 bytes (the least wall time of 10: the
    per-collective latency) and of 4 MiB a rank (per byte received, the latency taken off)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    out = {}
    if rank == 0:
        s, h, e = 2048, 8, 64
        q, k, v, go = (torch.randn(1, h, s, e) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        for causal in (False, True):
            best = float("inf")
            for _ in range(3):
                c0 = time.process_time()
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(go)
                best = min(best, time.process_time() - c0)
            pairs = s * (s + 1) // 2 if causal else s * s
            out["pair_causal" if causal else "pair"] = best / (pairs * h * 2 * e)
    dist.barrier()
    for nbytes, key in ((8, "latency"), (4 * MiB, "big")):
        x = torch.zeros(nbytes // 4)
        bufs = [torch.zeros_like(x) for _ in range(world)]
        best = float("inf")
        for _ in range(10):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_gather(bufs, x)
            best = min(best, time.perf_counter() - t0)
        out[key] = best
    if rank == 0:
        out["byte"] = max(out["big"] - out["latency"], 0.0) / ((world - 1) * 4 * MiB)
        with open(out_path, "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


def _llama(seq):
    """A small Llama (2 layers, hidden 256, 8 query heads of 32 over 2 KV heads, SDPA attention):
    at 8K-16K tokens its step is dominated by causal attention, where context parallelism acts."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=seq,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def llama_worker(rank, world, args, port, out_path):
    """``--llama``: the Hugging Face Llama above trained on ONE sequence sharded over the ranks
    (``Shard(1)`` of the token ids, the parameters replicated, ``auto`` strategy): per length the
    loss, step wall time (median of ``--reps`` after ``--warmup``), the slowest rank's process CPU
    time, the strategy ``auto`` ran, and the peak of one more step (as the attention rows)."""
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dtshard = import_this_checkout()
    from dtshard import Shard

    mesh = dtshard.init_device_mesh("cpu", (world,))
    rows = []
    for seq in args.seqs:
        model = _llama(seq)
        dtshard.distribute_module(model, mesh)
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        dids = dtshard.distribute_tensor(ids, mesh, [Shard(1)])
        params = list(model.parameters())

        def step():
            with dtshard.experimental.implicit_replication():
                loss = model(input_ids=dids, labels=dids, use_cache=False).loss
            loss.backward()
            return loss

        walls, cpus, picked = [], [], []
        for rep in range(args.warmup + args.reps):
            model.zero_grad(set_to_none=True)
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            if rep == 0:
                text = dtshard.debug.explain(step)
                picked = sorted({line.split(": context parallelism: ")[1].split(" ")[0]
                                 for line in text.splitlines() if ": context parallelism: " in line})
            else:
                step()
            c1 = time.process_time() - c0
            dist.barrier()
            if rep >= args.warmup:
                walls.append(time.perf_counter() - t0)
                cpus.append(c1)
        model.zero_grad(set_to_none=True)
        dist.barrier()
        peak, extra, unseen = _measured_step(step, params, args.rss)
        cpu = [None] * world
        dist.all_gather_object(cpu, statistics.median(cpus) if cpus else None)
        most = [None] * world
        dist.all_gather_object(most, (peak, extra, abs(unseen)))
        loss = step().full_tensor().item()
        rows.append({"seq": seq, "wall": statistics.median(walls) if walls else None, "cpu": cpu,
                     "peak": max(m[0] for m in most), "rss": max(m[1] or 0 for m in most) if args.rss else None,
                     "unseen": max(m[2] for m in most), "strategies": picked, "loss": loss})
        del model, dids
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(rows, f)
    dist.destroy_process_group()


def llama_one_process(_rank, args, threads, out_path):
    torch.set_num_threads(threads)
    rows = []
    for seq in args.seqs:
        model = _llama(seq)
        ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        params = list(model.parameters())

        def step():
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            return loss

        walls, cpus = [], []
        for rep in range(args.warmup + args.reps):
            model.zero_grad(set_to_none=True)
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            if rep >= args.warmup:
                walls.append(time.perf_counter() - t0)
                cpus.append(time.process_time() - c0)
        model.zero_grad(set_to_none=True)
        peak, extra, unseen = _measured_step(step, params, args.rss)
        loss = step().item()
        rows.append({"seq": seq, "wall": statistics.median(walls) if walls else None,
                     "cpu": statistics.median(cpus) if cpus else None, "peak": peak, "rss": extra,
                     "unseen": abs(unseen), "loss": loss})
    with open(out_path, "w") as f:
        json.dump(rows, f)


def one_process(_rank, args, threads, out_path):
    """The same layer on whole tensors in one process with ``threads`` threads: median step time
    (after one warm-up) and, with ``--memory``, the peak of one more step, as the ranks measure."""
    torch.set_num_threads(threads)
    rows = []
    for seq in args.seqs:
        mask = _window_mask(seq, args.window) if args.window else None
        for name, (h, hkv) in ((n, HEADS[n]) for n in args.heads):
            q, k, v, go = _inputs(seq, h, hkv)
            ts = [t.requires_grad_() for t in (q, k, v)]
            times = []
            for rep in range(args.reps + 1 if args.reps else 0):
                for t in ts:
                    t.grad = None
                t0 = time.perf_counter()
                _step(*ts, go, hkv != h, mask)
                if rep:
                    times.append(time.perf_counter() - t0)
            row = {"seq": seq, "heads": name, "s": statistics.median(times) if times else None}
            if args.memory or not times:
                for t in ts:
                    t.grad = None
                row["peak_bytes"], row["rss_extra_bytes"], unseen = _measured_step(
                    lambda: _step(*ts, go, hkv != h, mask), ts, args.rss)
                row["unseen_free_bytes"] = abs(unseen)
            rows.append(row)
    with open(out_path, "w") as f:
        json.dump(rows, f)


def _spawn(fn, nprocs, *args):
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.spawn(fn, args=(*args, f.name), nprocs=nprocs)
        return json.load(open(f.name))


def _mib(b):
    return "-" if b is None else f"{b / MiB:.2f}"


def main():
    ap = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    ap.add_argument("--seqs", default="2048,4096", type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--ranks", default="2,4", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--reps", type=int, default=3,
                    help="timed steps after one warm-up (0: no timing, only the memory step)")
    ap.add_argument("--no-memory", dest="memory", action="store_false",
                    help="skip the extra untimed step under the memory profiler")
    ap.add_argument("--no-rss", dest="rss", action="store_false",
                    help=f"no RSS column, and no MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD} in the spawned "
                         "processes (which the RSS column needs: blocks >= 64 KiB are mmapped and unmapped "
                         "on free, every column alike)")
    ap.add_argument("--heads", default="gqa,mha", type=lambda s: s.split(","),
                    help="head layouts: gqa (8 query : 2 KV heads), mha (8 : 8), mqa (8 : 1)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), type=lambda s: s.split(","),
                    help="the strategies to force (those that apply)")
    ap.add_argument("--window", type=int, default=0, help="sliding-window mask of this many keys (0: is_causal)")
    ap.add_argument("--plan-seqs", default="", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="sequence lengths for forward bytes from the plan only (no step)")
    ap.add_argument("--choice", action="store_true",
                    help="the strategy choice: what auto picks against every strategy forced (causal, "
                         "--heads mha,gqa,mqa), slowest rank's CPU time and per-rank work; no memory step")
    ap.add_argument("--warmup", type=int, default=1, help="--choice: untimed steps first")
    ap.add_argument("--calibrate", action="store_true",
                    help="measure dtshard.config.attention_cp_pair/byte/collective_seconds on this machine")
    ap.add_argument("--llama", action="store_true",
                    help="a small Hugging Face Llama trained on one sequence sharded over the ranks (auto), "
                         "against one process: step time, slowest rank's CPU, peak memory per rank")
    args = ap.parse_args()
    if args.llama:
        if args.rss:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
        for world in args.ranks:
            print(f"load average before: {os.getloadavg()}")
            rows = _spawn(llama_worker, world, world, args, free_port())
            base = {b["seq"]: b for b in _spawn(llama_one_process, 1, args, 1)}
            print(f"{world} ranks (load average after: {os.getloadavg()}); one process on 1 thread\n")
            rss = " | RSS extra MiB/rank | one process RSS MiB" if args.rss else ""
            print("| S | strategies auto ran | loss (ranks / one process) | step wall s | one process wall s | "
                  "slowest rank CPU s | one process CPU s | CPU per rank s | peak MiB/rank | one process peak MiB | "
                  "peak / one process | replay error MiB" + rss + " |")
            print("|---:|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:" + ("|---:|---:" if args.rss else "") + "|")
            for r in rows:
                b = base[r["seq"]]
                line = (f"| {r['seq']} | {', '.join(r['strategies'])} | {r['loss']:.6f} / {b['loss']:.6f} | "
                        f"{r['wall']:.2f} | {b['wall']:.2f} | {max(r['cpu']):.2f} | {b['cpu']:.2f} | "
                        f"{' '.join(f'{c:.2f}' for c in r['cpu'])} | {_mib(r['peak'])} | {_mib(b['peak'])} | "
                        f"{r['peak'] / b['peak']:.2f} | {_mib(max(r['unseen'], b['unseen']))}")
                if args.rss:
                    line += f" | {_mib(r['rss'])} | {_mib(b['rss'])}"
                print(line + " |")
        return
    if args.calibrate:
        for world in args.ranks:
            print(f"load average before: {os.getloadavg()}")
            c = _spawn(calibrate_worker, world, world, args, free_port())
            print(f"{world} ranks: attention_cp_pair_seconds = {c['pair']:.3g}  (causal: {c['pair_causal']:.3g} "
                  f"per pair of the triangle)\n         attention_cp_byte_seconds = {c['byte']:.3g}\n"
                  f"         attention_cp_collective_seconds = {c['latency']:.3g}  "
                  f"(load average after: {os.getloadavg()})")
        return
    if args.choice:
        print(f"load average before: {os.getloadavg()}")
        for world in args.ranks:
            rows = _spawn(choice_worker, world, world, args, free_port())
            print(f"\n{world} ranks (load average after: {os.getloadavg()})\n")
            choice_table(world, rows)
        return
    if args.rss:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD  # read by the spawned processes' glibc
    results = []
    for world in args.ranks:
        rows = _spawn(worker, world, world, args, free_port())
        base = _spawn(one_process, 1, args, world) if args.seqs else []
        results.append((world, rows, {(b["seq"], b["heads"]): b for b in base}))
    if args.plan_seqs:
        print("| ranks | S | heads | strategy | forward received MiB/rank (plan) | / K+V | auto picks |")
        print("|---:|---:|---|---|---:|---:|---|")
        for world, rows, _ in results:
            for r in rows:
                if "auto" in r:
                    b = r["plan_fwd_bytes"]
                    print(f"| {world} | {r['seq']} | {r['heads']} | {r['strategy']} | "
                          f"{b / MiB:.2f} | {b / r['kv_bytes']:.3f} | {r['auto']} |")
        print()
    if not args.seqs:
        return
    rss = " | RSS extra MiB/rank | one process RSS extra MiB" if args.rss else ""
    print("| ranks | S | heads | strategy | step s | one process s (as many threads) | x one process | "
          "fwd received MiB/rank (plan) | received MiB/rank (fwd+bwd) | / K+V | "
          "peak MiB/rank | one process peak MiB | peak / one process | replay error MiB/rank" + rss + " |")
    print("|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:" + ("|---:|---:" if args.rss else "") + "|")
    for world, rows, base in results:
        for r in rows:
            if "auto" in r:
                continue
            b = base[r["seq"], r["heads"]]
            ratio = f"{r['s'] / b['s']:.2f}" if r["s"] and b["s"] else "-"
            t = f"{r['s']:.3f}" if r["s"] else "-"
            tb = f"{b['s']:.3f}" if b["s"] else "-"
            pk = r.get("peak_bytes")
            line = (f"| {world} | {r['seq']} | {r['heads']} | {r['strategy']} | {t} | {tb} | {ratio} | "
                    f"{r['plan_fwd_bytes'] / MiB:.2f} | {r['recv_bytes'] / MiB:.2f} | "
                    f"{r['recv_bytes'] / r['kv_bytes']:.2f} | {_mib(pk)} | {_mib(b.get('peak_bytes'))} | "
                    + (f"{pk / b['peak_bytes']:.2f}" if pk and b.get("peak_bytes") else "-")
                    + f" | {_mib(r.get('unseen_free_bytes'))}")
            if args.rss:
                line += f" | {_mib(r.get('rss_extra_bytes'))} | {_mib(b.get('rss_extra_bytes'))}"
            print(line + " |")


if __name__ == "__main__":
    main()
