"""The Llama tensor-parallel training step, dtshard vs torch.distributed.tensor, side by side.

    python benchmarks/bench_llama_step.py                      # demo config + a wider one, eager
    python benchmarks/bench_llama_step.py --compile            # + torch.compile(model) variants
    python benchmarks/bench_llama_step.py --profile 15         # + cProfile top frames (rank 0, dtshard)
    python benchmarks/bench_llama_step.py --no-fast-linear     # dtshard without the one-node TP linear

The model is ``dtshard.models.Transformer`` with ``dtshard.models.parallelize`` (tensor + sequence
parallel, torchtitan's plan), built once with ``dtshard.parallel`` and once with
``torch.distributed.tensor.parallel`` from the same weights, on 2 gloo ranks (1 intra-op thread
each).  One step: forward, cross entropy under ``loss_parallel``, backward, AdamW (foreach=False,
as the demo), zero_grad.  The variants run interleaved (A B A B ..., order swapped every
repetition) so both see the same machine noise; the table gives medians of per-repetition
ratios of rank 0's thread CPU and wall time.  Every variant's first loss is checked against the
unsharded model, and the collectives of one step are counted (dtshard: ``CommCounter``; torch:
``CommDebugMode``).
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import os
import pstats
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "kernels"))  # this checkout's dtshard_kernels
sys.path.insert(0, os.path.dirname(HERE))  # this checkout's dtshard

CONFIGS = {
    "demo": dict(),  # LlamaConfig() of `python -m dtshard.demo --model llama`
    "wide": dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=1024, ffn_hidden=512, max_seq_len=64),
}
BATCH = {"demo": (2, 8), "wide": (4, 32)}


def _build(name, cfg_kw, mesh_dt, mesh_torch, fast_linear, compile_):
    import torch.distributed.tensor.parallel as torch_tp

    import dtshard
    import dtshard.parallel
    from dtshard.models import LlamaConfig, Transformer, parallelize

    dtshard.config.tp_linear_fast_path = fast_linear
    cfg = LlamaConfig(**cfg_kw)
    torch.manual_seed(0)
    base = Transformer(cfg)
    b, s = BATCH[name]
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
    x, y = tokens[:, :-1], tokens[:, 1:]
    with torch.no_grad():
        ref_loss = F.cross_entropy(base(x).flatten(0, 1), y.flatten(0, 1)).item()
    steps = {}
    for impl, tp, mesh in (("torch", torch_tp, mesh_torch), ("dtshard", dtshard.parallel, mesh_dt)):
        model = parallelize(copy.deepcopy(base), mesh, tp, local_output=True)
        if compile_:
            model = torch.compile(model, dynamic=False)  # two models of one class: no automatic dynamic shapes on the second
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)

        def step(model=model, opt=opt, tp=tp):
            with tp.loss_parallel():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(0, 1))
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        steps[impl] = step
    return steps, ref_loss


def _count_comms(impl, step):
    if impl == "dtshard":
        from dtshard.debug import CommCounter

        with CommCounter() as cc:
            step()
        out = {}
        for k in cc.kinds():
            out[k] = out.get(k, 0) + 1
        return out
    from torch.distributed.tensor.debug import CommDebugMode

    with CommDebugMode() as cd:
        step()
    return {str(k).split(".")[-1]: v for k, v in cd.get_comm_counts().items()}


def _worker(rank, world, args, port, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    import dtshard

    mesh_dt = dtshard.init_device_mesh("cpu", (world,))
    mesh_torch = torch_mesh("cpu", (world,))
    results = []
    for name in args.configs.split(","):
        steps, ref_loss = _build(name, CONFIGS[name], mesh_dt, mesh_torch, not args.no_fast_linear, args.compile)
        row = {"config": name}
        for impl, st in steps.items():  # first step (compiles, fills caches), its loss
            t0 = time.perf_counter()
            loss = st()
            row[impl + " first s"] = time.perf_counter() - t0
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            row[impl + " loss err"] = abs(float(loss) - ref_loss)
        for impl, st in steps.items():
            for _ in range(3):
                st()
            # compiled: the collectives are in the graphs (a counter's hooks would be traced)
            row[impl + " comms"] = "in graph" if args.compile else _count_comms(impl, st)
        cpu = {k: [] for k in steps}
        wall = {k: [] for k in steps}
        order = list(steps)
        for rep in range(args.reps):
            for impl in (order if rep % 2 == 0 else order[::-1]):
                dist.barrier()
                c0, w0 = time.thread_time(), time.perf_counter()
                for _ in range(args.inner):
                    steps[impl]()
                cpu[impl].append((time.thread_time() - c0) / args.inner)
                wall[impl].append((time.perf_counter() - w0) / args.inner)
        for impl in steps:
            row[impl + " cpu ms"] = 1e3 * statistics.median(cpu[impl])
            row[impl + " wall ms"] = 1e3 * statistics.median(wall[impl])
        row["cpu x torch"] = statistics.median(a / b for a, b in zip(cpu["dtshard"], cpu["torch"]))
        row["wall x torch"] = statistics.median(a / b for a, b in zip(wall["dtshard"], wall["torch"]))
        if args.profile and rank == 0:
            pr = cProfile.Profile()
            pr.enable()
            for _ in range(args.inner * 5):
                steps["dtshard"]()
            pr.disable()
            s = io.StringIO()
            pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(args.profile)
            row["profile"] = s.getvalue()
        elif args.profile:
            for _ in range(args.inner * 5):
                steps["dtshard"]()
        results.append(row)
    if rank == 0:
        q.put(results)
    dist.barrier()
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default="demo,wide")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--inner", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="torch.compile(model) for both (forward + AOT backward)")
    ap.add_argument("--no-fast-linear", action="store_true", help="dtshard.config.tp_linear_fast_path = False")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="print the top N cProfile frames of dtshard")
    args = ap.parse_args()
    world = 2
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    port = 29600 + os.getpid() % 90
    load0 = os.getloadavg()
    mp.spawn(_worker, args=(world, args, port, q), nprocs=world)
    results = q.get()
    print(f"Llama TP step, 2 gloo ranks x 1 thread, {'torch.compile' if args.compile else 'eager'}, "
          f"fast linear {'off' if args.no_fast_linear else 'on'}; loadavg {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    cols = ["config", "torch cpu ms", "dtshard cpu ms", "cpu x torch", "torch wall ms", "dtshard wall ms",
            "wall x torch", "torch first s", "dtshard first s", "torch loss err", "dtshard loss err",
            "torch comms", "dtshard comms"]
    print(" | ".join(cols))
    for r in results:
        print(" | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols))
    for r in results:
        if "profile" in r:
            print(f"\n--- cProfile, dtshard, {r['config']} (rank 0, tottime) ---")
            print(r["profile"])


if __name__ == "__main__":
    main()
