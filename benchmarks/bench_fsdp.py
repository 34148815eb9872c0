#!/usr/bin/env python
"""FSDP: dtshard.fsdp.fully_shard vs torch.distributed.fsdp.fully_shard, side by side, same work.

    python benchmarks/bench_fsdp.py                   # every config below (2 and 4 gloo ranks)
    python benchmarks/bench_fsdp.py --configs mlp --steps 10

Each config builds the same model twice from one seed, applies ``fully_shard`` to every block and
then the root with each library, and trains both with AdamW on the same batches, the steps of the
two interleaved (A B A B ...) so machine noise hits both alike.  Per training step (forward + loss
+ backward + optimizer step), medians over ``--steps`` measured steps after 2 warm-up steps:

- wall time and process CPU time (``time.process_time``: every thread of the rank, gloo's
  included), max over ranks of the per-rank medians;
- collectives and bytes sent per step, counted for both libraries the same way: a dispatch mode
  that sees every c10d / functional collective op the rank issues;
- peak memory of a step above the memory in use before it, the median of 5 steps, measured in a
  second run of the same models (so the measurement does not slow the timed steps), by one of
  two methods (``--memory``):

  - ``rss`` (the default): the kernel's resident-memory high-water mark of the rank's process
    (``dtshard.debug.peak_rss_bytes``), the process started with ``MALLOC_MMAP_THRESHOLD_=65536``
    so every tensor of 64 KiB or more is its own mapping, returned to the OS the moment it is
    freed, by whichever thread frees it;
  - ``alloc``: the allocation and free events of ``torch.profiler`` (``profile_memory=True``,
    ``dtshard.debug.peak_alloc_bytes``).  It misses a free made by a thread without the
    profiler's thread-local state: a gloo worker thread that drops the last reference to a
    collective's buffers, which is the usual case for the functional collectives of a compiled
    graph, so it over-counts compiled steps by several MiB, by a different amount each step;
- the loss after the last step (both must agree: same model, same data).

Configs: ``mlp`` (8 residual MLP blocks, 2 ranks, FSDP), ``llama`` (the Llama model of
dtshard.models, 2 ranks, FSDP), ``hsdp`` (the MLP on a 2x2 (replicate, shard) mesh, 4 ranks) and
``fsdp_tp`` (the Llama model, TP on mesh["tp"] then FSDP on mesh["dp"], 2x2, 4 ranks).

``--compile`` adds a third model, dtshard's FSDP model compiled (``torch.compile(model,
fullgraph=True)``, inductor, ``torch._dynamo.config.wrap_top_frame`` so the root's hooks are in
the one forward graph), interleaved with the other two: its step time and peak against eager
dtshard and eager FSDP2, and its compile time (the first step).  Its collectives are not counted
by the dispatch mode (compiled code calls them below it); they are in the graph, where
``tests/fsdp/test_fsdp_compile.py`` counts them: one all_gather per group in forward and one
reduce_scatter per group in backward.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkout import import_this_checkout  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

CONFIGS = {"mlp": 2, "llama": 2, "hsdp": 4, "fsdp_tp": 4}  # name -> ranks


class _Collectives(TorchDispatchMode):
    """Counts the collectives a rank issues and the bytes it sends (its input's bytes)."""

    NAMES = {"allgather_": "all_gather", "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
             "all_gather_into_tensor": "all_gather", "reduce_scatter_": "reduce_scatter",
             "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor_coalesced_": "reduce_scatter",
             "reduce_scatter_tensor": "reduce_scatter", "allreduce_": "all_reduce", "all_reduce": "all_reduce",
             "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "broadcast_": "broadcast",
             "broadcast": "broadcast"}

    def __init__(self):
        super().__init__()
        self.counts: dict[str, int] = {}
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in ("c10d", "_c10d_functional"):
            kind = self.NAMES.get(func._overloadpacket.__name__)
            if kind is not None:
                self.counts[kind] = self.counts.get(kind, 0) + 1
                src = args[1] if func._overloadpacket.__name__ in (
                    "_allgather_base_", "_reduce_scatter_base_", "alltoall_base_") else args[0]
                self.bytes += _nbytes(src)
        return func(*args, **kwargs)


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _peak_bytes(fn, memory: str = "rss") -> int:
    """Peak memory of ``fn()`` by this checkout's ``dtshard.debug.peak_rss_bytes`` (``memory="rss"``:
    the process's resident high-water mark) or ``peak_alloc_bytes`` (``"alloc"``: the profiler's
    allocation events)."""
    from dtshard.debug import peak_alloc_bytes, peak_rss_bytes

    return (peak_rss_bytes if memory == "rss" else peak_alloc_bytes)(fn)


class MLP(nn.Module):
    def __init__(self, d: int = 512, h: int = 1024, n: int = 8):
        super().__init__()
        self.inp = nn.Linear(64, d)
        from dtshard.models import ResidualMLP  # this checkout's (import_this_checkout ran first)

        self.blocks = nn.ModuleList(ResidualMLP(d, h) for _ in range(n))
        self.out = nn.Linear(d, 16)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _build(config: str, lib: str, dtshard):
    """(model, data-parallel index, dp size) for one library ("torch", "dtshard", or
    "compiled": dtshard's, compiled)."""
    if lib == "compiled":
        from torch import _dynamo

        model, dp_index, dp_size = _build(config, "dtshard", dtshard)
        _dynamo.config.wrap_top_frame = True  # read when the module is compiled
        try:
            compiled = torch.compile(model, fullgraph=True, dynamic=False)  # dtshard plans need static shapes
        finally:
            _dynamo.config.wrap_top_frame = False
        return compiled, dp_index, dp_size
    from dtshard.models import LlamaConfig, Transformer, parallelize

    world = dist.get_world_size()
    if lib == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        import torch.distributed.tensor.parallel as tp_mod
    else:
        from dtshard import init_device_mesh
        from dtshard.fsdp import fully_shard
        import dtshard.parallel as tp_mod
    torch.manual_seed(0)
    if config in ("mlp", "hsdp"):
        model = MLP()
        if config == "hsdp":
            mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = init_device_mesh("cpu", (world,))
        blocks, dp_index, dp_size = model.blocks, dist.get_rank(), world
    else:
        cfg = LlamaConfig(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=1024, ffn_hidden=512,
                          max_seq_len=128)
        model = Transformer(cfg)
        if config == "fsdp_tp":
            mesh2 = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
            model = parallelize(model, mesh2["tp"], tp_mod, local_output=True)
            mesh = mesh2["dp"]
            dp_index, dp_size = mesh.get_local_rank(), mesh.size()
        else:
            mesh = init_device_mesh("cpu", (world,))
            dp_index, dp_size = dist.get_rank(), world
        blocks = model.layers
    for b in blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, dp_index, dp_size


def _batch(config: str, step: int, dp_index: int):
    g = torch.Generator().manual_seed(1000 + 31 * step + dp_index)
    if config in ("mlp", "hsdp"):
        return torch.randn(64, 64, generator=g), torch.randn(64, 16, generator=g)
    tokens = torch.randint(0, 1024, (4, 65), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _loss(config, model, x, y, lib, dtshard):
    if config in ("mlp", "hsdp"):
        return ((model(x) - y) ** 2).mean()
    if config == "fsdp_tp":
        tp_mod = __import__("torch.distributed.tensor.parallel", fromlist=["loss_parallel"]) if lib == "torch" \
            else __import__("dtshard.parallel", fromlist=["loss_parallel"])
        with tp_mod.loss_parallel():
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))
            loss.backward()
        return loss
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))


def _step(config, model, opt, x, y, lib, dtshard):
    loss = _loss(config, model, x, y, lib, dtshard)
    if config != "fsdp_tp":  # loss_parallel's backward runs inside its context
        loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def _value(loss) -> float:
    full = getattr(loss, "full_tensor", None)
    return float((full() if full is not None else loss).detach())


def worker(rank, world, configs, steps, port, out_path, compile_too=False, memory=None):
    """One run of ``configs``: timed steps (``memory=None``) or, with ``memory`` "rss" or "alloc",
    only peak-memory steps (two warm-up steps, then 5 measured ones, the libraries interleaved)."""
    import faulthandler

    faulthandler.enable()  # a native crash prints the Python stack of every thread
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300))
    dtshard = import_this_checkout()
    rows = []
    for config in configs:
        libs = {}
        compile_s = None
        for lib in ("torch", "dtshard") + (("compiled",) if compile_too else ()):
            model, dp_index, _ = _build(config, lib, dtshard)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            libs[lib] = (model, opt, dp_index)
            if lib == "compiled":  # compile outside the timed steps: forward + backward compile,
                x, y = _batch(config, 0, dp_index)  # without an optimizer step (same trajectory)
                t0 = time.perf_counter()
                loss = _loss(config, model, x, y, lib, dtshard)
                if config != "fsdp_tp":
                    loss.backward()
                opt.zero_grad()
                compile_s = time.perf_counter() - t0
        times = {k: [] for k in libs}
        cpus = {k: [] for k in libs}
        comm = {}
        peaks = {}
        loss = {}
        for step in range(2 if memory else steps + 2):
            order = list(libs) if step % 2 == 0 else list(reversed(list(libs)))
            for lib in order:
                model, opt, dp_index = libs[lib]
                x, y = _batch(config, step, dp_index)
                dist.barrier()
                if memory:  # warm-up only
                    _step(config, model, opt, x, y, lib, dtshard)
                    continue
                if step == 1:  # counted once (not timed)
                    if lib == "compiled":  # counted in the graph, not by the dispatch mode
                        _step(config, model, opt, x, y, lib, dtshard)
                        continue
                    with _Collectives() as c:
                        _step(config, model, opt, x, y, lib, dtshard)
                    comm[lib] = (dict(c.counts), c.bytes)
                    continue
                t0, c0 = time.perf_counter(), time.process_time()
                loss[lib] = _value(_step(config, model, opt, x, y, lib, dtshard))
                if step >= 2:
                    times[lib].append(time.perf_counter() - t0)
                    cpus[lib].append(time.process_time() - c0)
        # the peak depends on when asynchronous collectives finish (their buffers are freed then),
        # so it moves a little from step to step: the median of 5 measured steps, interleaved
        samples = {k: [] for k in libs}
        for rep in range(5 if memory else 0):
            for lib in (list(libs) if rep % 2 == 0 else list(reversed(list(libs)))):
                model, opt, dp_index = libs[lib]
                x, y = _batch(config, rep, dp_index)
                dist.barrier()
                samples[lib].append(_peak_bytes(lambda: _step(config, model, opt, x, y, lib, dtshard), memory))
        peaks = {k: statistics.median(v) for k, v in samples.items() if v}
        rows.append({"config": config, "world": world,
                     "wall": {k: statistics.median(v) for k, v in times.items() if v},
                     "cpu": {k: statistics.median(v) for k, v in cpus.items() if v},
                     "comm": comm, "peak": peaks, "loss": loss, "compile_s": compile_s})
        del libs
    everyone = [None] * world
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        import json

        with open(out_path, "w") as fh:
            json.dump(everyone, fh)
    dist.barrier()
    # leave without the interpreter's teardown: on this machine the process aborts there now and
    # then ("terminate called without an active exception", no Python frame: a native thread of
    # the profiler or of gloo being destroyed), after the results are written
    sys.stdout.flush()
    os._exit(0)


def _run(world, configs, steps, compile_too=False, memory=None):
    """Spawn ``world`` ranks for one run; returns the per-rank rows.  A memory run with ``"rss"``
    starts its processes with ``MALLOC_MMAP_THRESHOLD_`` (see ``dtshard.debug.peak_rss_bytes``)."""
    import json
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "res.json")
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    if memory == "rss":
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"  # dtshard.debug.RSS_MMAP_THRESHOLD
    try:
        mp.spawn(worker, args=(world, configs, steps, port, out, compile_too, memory), nprocs=world, join=True)
    finally:
        if saved is None:
            os.environ.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    with open(out) as fh:
        return json.load(fh)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated: " + ", ".join(CONFIGS))
    ap.add_argument("--steps", type=int, default=10, help="measured steps per library (after 2 warm-up)")
    ap.add_argument("--compile", action="store_true", help="also dtshard's FSDP model compiled (inductor)")
    ap.add_argument("--memory", default="rss", choices=["rss", "alloc"],
                    help="peak-memory method: the process's resident high-water mark, or the profiler's allocation events")
    args = ap.parse_args()
    configs = [c for c in args.configs.split(",") if c]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown config {c!r}")
    print(f"load average at start: {os.getloadavg()[0]:.1f}")
    results = []
    for world in sorted({CONFIGS[c] for c in configs}):
        group = [c for c in configs if CONFIGS[c] == world]
        timed = _run(world, group, args.steps, args.compile)
        mem = _run(world, group, args.steps, args.compile, memory=args.memory)
        for rank_rows, rank_mem in zip(timed, mem):
            for row, m in zip(rank_rows, rank_mem):
                row["peak"] = m["peak"]
        results += list(zip(*timed))
    print(f"peak memory: {args.memory} ({'resident high-water mark' if args.memory == 'rss' else 'profiler allocation events'})")
    print("| config | ranks | torch ms | dtshard ms | wall dtshard/torch | CPU dtshard/torch | "
          "collectives torch | collectives dtshard | MiB sent torch | MiB sent dtshard | "
          "peak MiB torch | peak MiB dtshard | loss torch | loss dtshard |")
    print("|---|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|---:|")
    for per_rank in results:
        r0 = per_rank[0]
        wall = {k: max(r["wall"][k] for r in per_rank) for k in ("torch", "dtshard")}
        cpu = {k: max(r["cpu"][k] for r in per_rank) for k in ("torch", "dtshard")}
        peak = {k: max(r["peak"][k] for r in per_rank) for k in ("torch", "dtshard")}
        sent = {k: max(r["comm"][k][1] for r in per_rank) for k in ("torch", "dtshard")}

        def counts(lib):
            c = r0["comm"][lib][0]
            return ", ".join(f"{k} {v}" for k, v in sorted(c.items()))

        print(f"| {r0['config']} | {r0['world']} | {wall['torch'] * 1e3:.1f} | {wall['dtshard'] * 1e3:.1f} | "
              f"{wall['dtshard'] / wall['torch']:.2f} | {cpu['dtshard'] / cpu['torch']:.2f} | {counts('torch')} | "
              f"{counts('dtshard')} | {sent['torch'] / 2**20:.2f} | {sent['dtshard'] / 2**20:.2f} | "
              f"{peak['torch'] / 2**20:.1f} | {peak['dtshard'] / 2**20:.1f} | {r0['loss']['torch']:.6f} | "
              f"{r0['loss']['dtshard']:.6f} |")
    if args.compile:
        print()
        print("| config | ranks | torch eager ms | dtshard eager ms | dtshard compiled ms | compiled/torch eager | "
              "compiled/dtshard eager | peak MiB dtshard eager | peak MiB compiled | compile s | loss compiled |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for per_rank in results:
            r0 = per_rank[0]
            wall = {k: max(r["wall"][k] for r in per_rank) for k in ("torch", "dtshard", "compiled")}
            peak = {k: max(r["peak"][k] for r in per_rank) for k in ("dtshard", "compiled")}
            comp = max(r["compile_s"] for r in per_rank)
            print(f"| {r0['config']} | {r0['world']} | {wall['torch'] * 1e3:.1f} | {wall['dtshard'] * 1e3:.1f} | "
                  f"{wall['compiled'] * 1e3:.1f} | {wall['compiled'] / wall['torch']:.2f} | "
                  f"{wall['compiled'] / wall['dtshard']:.2f} | {peak['dtshard'] / 2**20:.1f} | "
                  f"{peak['compiled'] / 2**20:.1f} | {comp:.1f} | {r0['loss']['compiled']:.6f} |")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
