#!/usr/bin/env python
"""N-D redistribute: dtshard vs torch.distributed.tensor on a 2x2 mesh (4 gloo ranks), side by side.

    python benchmarks/bench_redistribute_nd.py                 # 1 and 16 MiB, the issue's transitions
    python benchmarks/bench_redistribute_nd.py --sizes 1 --reps 11

For each transition (the ones that move more than they need when planned one mesh dim at a time)
and size, both implementations run the same redistribute on the same global tensor:

- bytes received per rank (max over ranks), counted the same way for both: a dispatch mode that
  sees every functional collective (``_c10d_functional.*``; dtshard uses them whenever a mode is
  active) and adds what the calling rank receives;
- the minimum (the elements a rank's target shard lacks, plus one reduction of Partial inputs);
- wall time and main-thread CPU per call: medians over ``--reps`` calls, the two implementations
  interleaved (A B A B ...) so machine noise hits both alike; ratios dtshard / torch.

Values are checked against the global tensor first (a wrong result is reported, never timed).
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkout import import_this_checkout  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

WORLD = 4
MESH = (2, 2)
# (name, source, target): codes per mesh dim
TRANSITIONS = [
    ("(S0,S1)->(S1,S0)", ("S0", "S1"), ("S1", "S0")),
    ("(P,P)->(R,R)", ("P", "P"), ("R", "R")),
    ("(P,S0)->(S0,R)", ("P", "S0"), ("S0", "R")),
    ("(P,S0)->(S0,S0)", ("P", "S0"), ("S0", "S0")),
    ("(R,S0)->(S0,S0)", ("R", "S0"), ("S0", "S0")),
    ("(S0,S0)->(R,R)", ("S0", "S0"), ("R", "R")),
    # strided shards (T0 = _StridedShard(0, split_factor=2)): FSDP x TP's layout of a TP Shard(0)
    # weight on a (dp, tp) mesh, gathered to the TP shard (FSDP's unshard), to the full tensor,
    # re-laid as plain nested shards, and cut from the TP shard (no traffic)
    ("(T0,S0)->(R,S0)", ("T0", "S0"), ("R", "S0")),
    ("(T0,S0)->(R,R)", ("T0", "S0"), ("R", "R")),
    ("(T0,S0)->(S0,S0)", ("T0", "S0"), ("S0", "S0")),
    ("(R,S0)->(T0,S0)", ("R", "S0"), ("T0", "S0")),
]


class _ReceivedBytes(TorchDispatchMode):
    """Adds up the bytes this rank receives in every functional collective it issues."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._overloadpacket.__name__
        if func.namespace == "_c10d_functional" and name in (
                "all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single"):
            x = args[0]
            nb = x.numel() * x.element_size() if isinstance(x, torch.Tensor) else 0
            n = dist.get_world_size(_group_of(args[-1]))
            if name == "all_gather_into_tensor":
                self.bytes += (n - 1) * nb
            elif name == "reduce_scatter_tensor":
                self.bytes += (n - 1) * nb // n
            elif name == "all_reduce":
                self.bytes += 2 * (n - 1) * nb // n
            elif name == "all_to_all_single":
                out_splits = args[1]
                me = dist.get_rank(_group_of(args[-1]))
                row = x.element_size() * (math.prod(x.shape[1:]) if x.dim() else 1)
                self.bytes += (sum(out_splits) - out_splits[me]) * row
        return out


def _group_of(name):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def _placements(mod, codes):
    from torch.distributed.tensor.placement_types import _StridedShard  # the same class in both libraries

    return [{"S0": mod.Shard(0), "S1": mod.Shard(1), "R": mod.Replicate(), "P": mod.Partial(),
             "T0": _StridedShard(0, split_factor=2)}[c] for c in codes]


def _source(mod, mesh, G, codes):
    """A DTensor with placements ``codes`` whose value is G (a Partial's terms: G on coordinate 0
    of each Partial mesh dim, zeros elsewhere), built without communication."""
    coord = mesh.get_coordinate()
    d = mod.DTensor.from_local(_terms(G, codes, coord), mesh,
                               [mod.Partial() if c == "P" else mod.Replicate() for c in codes])
    return d.redistribute(mesh, _placements(mod, codes))


def _terms(G, codes, coord):
    keep = all(coord[i] == 0 for i, c in enumerate(codes) if c == "P")
    return G.clone() if keep else torch.zeros_like(G)


def _minimum_bytes(shape, src, dst, itemsize):
    """The minimum of tests/distributed/test_redistribute_bound.py, for these codes."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "distributed"))
    from test_redistribute_bound import minimum_received
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    if "T0" in src + dst:  # the minimum of tests/distributed/test_strided.py (from torch's own shards)
        from test_strided import _min_received
        from torch.distributed.tensor.placement_types import _StridedShard

        conv = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "T0": _StridedShard(0, split_factor=2)}
        return _min_received(shape, MESH, tuple(conv[c] for c in src), tuple(conv[c] for c in dst)) * itemsize
    conv = {"S0": Shard(0), "S1": Shard(1), "R": Replicate(), "P": Partial()}
    return minimum_received(shape, MESH, tuple(conv[c] for c in src), tuple(conv[c] for c in dst)) * itemsize


def worker(rank, args, port, out_path):
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=300))
    dtshard = import_this_checkout()
    import torch.distributed.tensor as tdt

    impls = {"torch": (tdt, tdt.init_device_mesh("cpu", MESH) if hasattr(tdt, "init_device_mesh")
                       else torch.distributed.device_mesh.init_device_mesh("cpu", MESH)),
             "dtshard": (dtshard, dtshard.init_device_mesh("cpu", MESH))}
    rows = []
    for mib in [float(s) for s in args.sizes.split(",")]:
        n = int(round(math.sqrt(mib * (1 << 20) / 4)))
        n -= n % 4
        shape = (n, n)
        G = torch.randn(shape, generator=torch.Generator().manual_seed(7))
        for name, src, dst in TRANSITIONS:
            row = {"transition": name, "MiB": n * n * 4 / (1 << 20)}
            fns = {}
            for label, (mod, mesh) in impls.items():
                try:
                    d = _source(mod, mesh, G, src)
                    tgt = _placements(mod, dst)
                    with _ReceivedBytes() as counter:
                        y = d.redistribute(mesh, tgt)
                        if hasattr(y, "wait"):
                            y = y.wait()
                    ok = torch.allclose(y.full_tensor(), G, atol=1e-5)
                except Exception as e:  # noqa: BLE001 - the same error on every rank (metadata)
                    row[label] = {"recv_bytes": 0, "correct": f"raises {type(e).__name__}",
                                  "wall_ms": float("nan"), "cpu_ms": float("nan")}
                    continue
                row[label] = {"recv_bytes": counter.bytes, "correct": ok}

                def f(d=d, mesh=mesh, tgt=tgt):
                    out = d.redistribute(mesh, tgt)
                    return out.wait() if hasattr(out, "wait") else out

                fns[label] = f
            dist.barrier()
            walls = {k: [] for k in fns}
            cpus = {k: [] for k in fns}
            for rep in range(args.reps + 2):
                order = list(fns) if rep % 2 == 0 else list(reversed(list(fns)))
                for k in order:
                    dist.barrier()
                    t0, c0 = time.perf_counter(), time.thread_time()
                    fns[k]()
                    w, c = time.perf_counter() - t0, time.thread_time() - c0
                    if rep >= 2:  # warm-up
                        walls[k].append(w)
                        cpus[k].append(c)
            for k in fns:
                row[k]["wall_ms"] = statistics.median(walls[k]) * 1e3
                row[k]["cpu_ms"] = statistics.median(cpus[k]) * 1e3
            rows.append(row)
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        import json

        with open(out_path, "w") as fh:
            json.dump(everyone, fh)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,16", help="global tensor sizes in MiB")
    ap.add_argument("--reps", type=int, default=21)
    args = ap.parse_args()
    import json
    import socket
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "res.json")
    mp.spawn(worker, args=(args, port, out), nprocs=WORLD, join=True)
    with open(out) as fh:
        per_rank = json.load(fh)
    print("| transition | MiB | min recv KiB | torch recv KiB | dtshard recv KiB | torch ms | dtshard ms | "
          "wall dtshard/torch | main-thread CPU dtshard/torch | correct |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for k, row in enumerate(per_rank[0]):
        name = row["transition"]
        src, dst = next((s, d) for n, s, d in TRANSITIONS if n == name)
        n = int(round(math.sqrt(row["MiB"] * (1 << 20) / 4)))
        mn = _minimum_bytes((n, n), src, dst, 4)
        rt = max(r[k]["torch"]["recv_bytes"] for r in per_rank)
        rd = max(r[k]["dtshard"]["recv_bytes"] for r in per_rank)
        wt = statistics.median(r[k]["torch"]["wall_ms"] for r in per_rank)
        wd = statistics.median(r[k]["dtshard"]["wall_ms"] for r in per_rank)
        ct = statistics.median(r[k]["torch"]["cpu_ms"] for r in per_rank)
        cd = statistics.median(r[k]["dtshard"]["cpu_ms"] for r in per_rank)
        def verdict(lib):
            vals = [r[k][lib]["correct"] for r in per_rank]
            if any(isinstance(v, str) for v in vals):
                return next(v for v in vals if isinstance(v, str))
            return "ok" if all(vals) else "WRONG"

        print(f"| {name} | {row['MiB']:.0f} | {mn / 1024:.0f} | {rt / 1024:.0f} | {rd / 1024:.0f} | {wt:.2f} | "
              f"{wd:.2f} | {wd / wt:.2f} | {cd / ct:.2f} | torch {verdict('torch')}, dtshard {verdict('dtshard')} |")


if __name__ == "__main__":
    main()
