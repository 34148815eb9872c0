#!/usr/bin/env python
"""Spatially sharded conv2d (dtshard's halo exchange) vs the unsharded conv, and vs
torch.distributed.tensor, forward + backward, on 2 gloo CPU ranks.  One command:

    python benchmarks/bench_conv.py                 # 4x32x256x256, conv 3x3 32->32 (~40 s)
    python benchmarks/bench_conv.py --big           # 8x64x512x512, conv 3x3 64->64 (~7 min, ~20 GB RAM for both ranks)
    python benchmarks/bench_conv.py --shape 2,16,128,128 --cout 16 --k 5 --reps 5
    python benchmarks/bench_conv.py --variants dtshard:S2,torch:S3

Each rank runs one intra-op thread (2 ranks on 2 cores).  Per variant and rank it measures one
training step of the layer: ``y = conv2d(x, w, b, padding=k//2); y.backward(g)`` with ``g`` laid
out like ``y`` (so no redistribution of the gradient is timed), median over ``--reps``
repetitions, all variants interleaved (A B C A B C ..., order rotated each repetition) after a
barrier, so machine noise hits all alike.

- ``unsharded``: the plain conv on the whole image (every rank runs it at the same time, so the
  cores are as busy as in the sharded runs).  The headline baseline is ``unsharded / 2``: perfect
  scaling.  ``x ideal`` = variant time / (unsharded time / 2): 1.0 is perfect, > 1 is overhead.
- ``dtshard S(2)`` / ``S(3)``: the image sharded on H / W, halo exchange (one all_to_all per
  direction; the halo bytes each rank SENDS, forward + backward, come from ``CommCounter``),
  grad_weight / grad_bias Partial (not reduced: same as the plain local step; reducing them is
  the optimizer's all-reduce, identical for every variant).
- ``dtshard S(0)``: batch sharding (no halo).
- ``torch S(0)``: torch.distributed.tensor with batch sharding.  ``torch S(3)``: its tensor
  parallel conv (``_tp_conv``: ring halo exchange on the LAST dim, stride 1 and odd kernels only).
  ``torch S(2)``: H sharding, which torch's conv does not support as such: its result is checked
  and the cell is marked ``WRONG`` when it differs.

Every variant's output, grad_input, grad_weight and grad_bias are compared with the unsharded
conv once (outside the timing); a wrong or failing variant is reported, not timed (``ERR``) or
timed and marked ``WRONG``.  Times: ``cpu`` is the calling thread's CPU time (the compute and
packing dtshard does on the rank; gloo's transfers run on its own threads), ``wall`` is elapsed
time (includes waiting for the other rank and the transfers).  Only ratios are meaningful on a
shared machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from _checkout import free_port  # noqa: E402  (benchmarks/: run as a script)


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(_ROOT, "kernels"), _ROOT):  # this checkout's dtshard_kernels and dtshard
    if _path not in sys.path:
        sys.path.insert(0, _path)

WORLD = 2
DEFAULT_VARIANTS = "dtshard:S2,dtshard:S3,dtshard:S0,torch:S0,torch:S3,torch:S2"


def _import_dtshard():
    from _checkout import import_this_checkout

    return import_this_checkout()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-30))


def _claimed_chunk(full: torch.Tensor, placements):
    """The chunk of ``full`` rank ``dist.get_rank()`` holds under 1-D ``placements`` (None for Partial)."""
    p = placements[0]
    if p.is_replicate():
        return full
    if p.is_shard():
        return full.chunk(WORLD, dim=p.dim)[dist.get_rank()]
    return None


class _Variant:
    """One implementation + input placement: builds its DTensors once, runs steps."""

    def __init__(self, impl: str, place: str, x, w, b, g, padding: int):
        # dtshard: config.halo_overlap off; dtshard+bwd: backward only; dtshard+overlap: both;
        # a "+compiled" suffix: the conv (forward + AOT backward) under torch.compile(fullgraph)
        self.compiled = impl.endswith("+compiled")
        impl = impl[: -len("+compiled")] if self.compiled else impl
        self.overlap = {"dtshard": (False, False), "dtshard+bwd": (True, False), "dtshard+overlap": (True, True)}.get(impl)
        impl = "dtshard" if self.overlap is not None else impl
        self.impl, self.place, self.padding = impl, place, padding
        dim = int(place[1:])
        if impl == "dtshard":
            dtshard = _import_dtshard()
            from dtshard import Replicate, Shard

            self.mod = dtshard
            self.mesh = dtshard.init_device_mesh("cpu", (WORLD,))
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.tensor import Replicate, Shard, distribute_tensor

            self.mesh = init_device_mesh("cpu", (WORLD,))
            self.mod = None
        dist_fn = self.mod.distribute_tensor if impl == "dtshard" else distribute_tensor
        self.x = dist_fn(x, self.mesh, [Shard(dim)]).requires_grad_()
        self.w = dist_fn(w, self.mesh, [Replicate()]).requires_grad_()
        self.b = dist_fn(b, self.mesh, [Replicate()]).requires_grad_()
        with torch.no_grad():
            y = F.conv2d(self.x, self.w, self.b, padding=padding)
        self.placements = tuple(y.placements)
        self.fn = F.conv2d
        if self.compiled:  # compiled at the first step, under this variant's overlap settings
            self.fn = torch.compile(lambda x, w, b, padding: F.conv2d(x, w, b, padding=padding),
                                    fullgraph=True, dynamic=False)
        self.g = dist_fn(g, self.mesh, list(self.placements))

    def step(self, keep: bool = False):
        self.x.grad = self.w.grad = self.b.grad = None
        if self.impl == "dtshard":
            from dtshard.propagate import config

            config.halo_overlap, config.halo_overlap_forward = self.overlap
            config.halo_overlap_compiled = self.compiled and self.overlap[0]
        y = self.fn(self.x, self.w, self.b, padding=self.padding)
        y.backward(self.g)
        if not keep:  # timing: drop the step's tensors (memory of the --big run)
            self.x.grad = self.w.grad = self.b.grad = None
            return None
        return y

    def check(self, ref) -> dict:
        y = self.step(keep=True)
        out = {"out_placements": str(self.placements)}
        errs = {}
        for name, t, r in (("out", y, ref[0]), ("grad_input", self.x.grad, ref[1]),
                           ("grad_weight", self.w.grad, ref[2]), ("grad_bias", self.b.grad, ref[3])):
            try:
                errs[name] = _rel(t.full_tensor().detach(), r)
            except Exception as e:  # noqa: BLE001  (a mislabelled result cannot even be gathered)
                errs[name] = float("inf")
                out.setdefault("why", f"{name}.full_tensor() raised {type(e).__name__}: {str(e)[:100]}")
        local = y.to_local().detach()
        claimed = _claimed_chunk(ref[0], self.placements)
        if claimed is None or tuple(local.shape) != tuple(claimed.shape):
            out.setdefault("why", f"local output {tuple(local.shape)} is not the {self.placements} chunk "
                                  f"{None if claimed is None else tuple(claimed.shape)}")
            errs["out_local"] = float("inf")
        else:
            errs["out_local"] = _rel(local, claimed)
        out["errors"] = errs
        out["ok"] = max(errs.values()) < 1e-4
        return out

    def comm_bytes(self) -> dict | None:
        if self.impl != "dtshard":
            return None
        from dtshard.debug import CommCounter

        with CommCounter() as c:
            self.step()
        by_op: dict = {}
        for r in c.records:
            by_op.setdefault(r.op or "?", [0, []])
            by_op[r.op or "?"][0] += r.nbytes
            by_op[r.op or "?"][1].append(r.kind)
        return {"total": c.bytes(), "by_op": {k: {"bytes": v[0], "kinds": v[1]} for k, v in by_op.items()}}


def _worker(rank: int, args, port: int, out_path: str):
    global WORLD
    WORLD = args.world
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        _run(rank, args, out_path)
    finally:
        dist.destroy_process_group()


def _run(rank: int, args, out_path: str):
    n, c, h, wd = args.shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, c, h, wd, generator=gen)
    w = torch.randn(args.cout, c, args.k, args.k, generator=gen) / (c * args.k * args.k) ** 0.5
    b = torch.randn(args.cout, generator=gen)
    pad = args.k // 2
    g = torch.randn(n, args.cout, h + 2 * pad - args.k + 1, wd + 2 * pad - args.k + 1, generator=gen)

    # the unsharded layer (every rank): reference values and the baseline time
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))

    def unsharded(keep: bool = False):
        xr.grad = wr.grad = br.grad = None
        y = F.conv2d(xr, wr, br, padding=pad)
        y.backward(g)
        if not keep:
            xr.grad = wr.grad = br.grad = None
            return None
        return y

    y = unsharded(keep=True)
    ref = (y.detach(), xr.grad, wr.grad, br.grad)
    del y
    xr.grad = wr.grad = br.grad = None

    variants, results = {}, {}
    for spec in args.variants.split(","):
        impl, place = spec.split(":")
        name = f"{impl} {place[0]}({place[1:]})"
        try:
            v = _Variant(impl, place, x, w, b, g, pad)
            res = v.check(ref)
            res["comm"] = v.comm_bytes()
            variants[name] = v
        except Exception as e:  # noqa: BLE001  (reported in its cell)
            res = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}",
                   "trace": traceback.format_exc(limit=3)}
        # every rank must agree on who gets timed (collectives inside the steps)
        flags = [None] * WORLD
        dist.all_gather_object(flags, "error" in res)
        if any(flags) and name in variants:
            del variants[name]
            res.setdefault("error", "failed on another rank")
        results[name] = res
    del ref

    fns = {"unsharded": unsharded, **{k: v.step for k, v in variants.items()}}
    for f in fns.values():  # warm-up
        f()
    samples = {k: {"wall": [], "cpu": []} for k in fns}
    names = list(fns)
    for r in range(args.reps):
        order = names[r % len(names):] + names[: r % len(names)]
        for k in order:
            dist.barrier()
            w0, c0 = time.perf_counter(), time.thread_time()
            fns[k]()
            c1 = time.thread_time()
            dist.barrier()  # the step is done when both ranks are done
            w1 = time.perf_counter()
            samples[k]["wall"].append(w1 - w0)
            samples[k]["cpu"].append(c1 - c0)
    mine = {k: {"wall": statistics.median(s["wall"]), "cpu": statistics.median(s["cpu"])} for k, s in samples.items()}
    everything = [None] * WORLD
    dist.all_gather_object(everything, {"times": mine, "results": results})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"args": vars(args), "ranks": everything}, f, indent=1)


def _fmt_bytes(nb) -> str:
    if nb is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nb < 1024 or unit == "GiB":
            return f"{nb:.0f} {unit}" if unit == "B" else f"{nb:.2f} {unit}"
        nb /= 1024
    return str(nb)


def report(data: dict) -> str:
    a = data["args"]
    ranks = data["ranks"]
    lines = []
    n, c, h, w = a["shape"]
    lines.append(f"conv2d {n}x{c}x{h}x{w} -> {a['cout']} channels, kernel {a['k']}, padding {a['k'] // 2}, "
                 f"forward + backward, {WORLD} gloo ranks x {a['threads']} thread, median of {a['reps']}")
    base = ranks[0]["times"]["unsharded"]
    base_cpu = max(r["times"]["unsharded"]["cpu"] for r in ranks)
    base_wall = base["wall"]
    lines.append(f"unsharded (whole image, every rank): cpu {base_cpu * 1e3:.1f} ms, wall {base_wall * 1e3:.1f} ms;"
                 f" ideal per rank = /{WORLD}: cpu {base_cpu / WORLD * 1e3:.1f} ms")
    lines.append("")
    hdr = (f"{'variant':<26} {'out':<14} {'cpu r0 ms':>10} {'cpu r1 ms':>10} {'x ideal cpu':>11} "
           f"{'wall ms':>9} {'x ideal wall':>12} {'sent/rank fwd+bwd':>18}  result")
    lines.append(hdr)
    lines.append("-" * len(hdr))
    names = [k for k in ranks[0]["results"]]
    for name in names:
        res = [r["results"][name] for r in ranks]
        if any("error" in x for x in res):
            err = next(x["error"] for x in res if "error" in x)
            lines.append(f"{name:<26} {'':<14} {'ERR':>10} {'':>10} {'':>11} {'':>9} {'':>12} {'':>18}  ERR {err}")
            continue
        t = [r["times"].get(name) for r in ranks]
        cpu = [x["cpu"] for x in t]
        wall = max(x["wall"] for x in t)
        ok = all(x["ok"] for x in res)
        worst = max(max(x["errors"].values()) for x in res)
        comm = res[0]["comm"]
        sent = _fmt_bytes(max(x["comm"]["total"] for x in res)) if comm is not None else "n/a"
        why = next((x["why"] for x in res if "why" in x), "")
        verdict = f"ok (max rel err {worst:.1e})" if ok else f"WRONG (max rel err {worst:.2g}) {why}"
        lines.append(f"{name:<26} {res[0]['out_placements']:<14} {cpu[0] * 1e3:>10.1f} {cpu[1] * 1e3:>10.1f} "
                     f"{max(cpu) / (base_cpu / WORLD):>11.2f} {wall * 1e3:>9.1f} {wall / (base_wall / WORLD):>12.2f} "
                     f"{sent:>18}  {verdict}")
    lines.append("")
    for name in names:
        r0 = ranks[0]["results"][name]
        if r0.get("comm"):
            per = ", ".join(f"{op.split('.')[1] if '.' in op else op}: {_fmt_bytes(v['bytes'])} "
                            f"({'+'.join(v['kinds'])})" for op, v in r0["comm"]["by_op"].items())
            lines.append(f"{name} rank 0 sends: {per or 'nothing'}")
    halo_row = a["shape"][0] * a["shape"][1] * 4
    k2 = a["k"] // 2
    lines.append(f"(one halo row of x = {_fmt_bytes(halo_row * a['shape'][3])} for S(2), one column = "
                 f"{_fmt_bytes(halo_row * a['shape'][2])} for S(3); each rank needs {k2} from its one neighbour)")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--big", action="store_true", help="8x64x512x512, conv 64->64")
    p.add_argument("--shape", type=lambda s: [int(v) for v in s.split(",")], default=None, help="N,C,H,W")
    p.add_argument("--cout", type=int, default=None)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"impl:S<dim>,... (default {DEFAULT_VARIANTS}); "
                   "dtshard: config.halo_overlap off, dtshard+bwd: backward only, dtshard+overlap: forward and backward; "
                   "append +compiled for the conv under torch.compile (inductor, fullgraph), e.g. dtshard+bwd+compiled:S2")
    p.add_argument("--world", type=int, default=2, help="gloo ranks (default 2)")
    p.add_argument("--json", default=os.path.join(_ROOT, "benchmarks", "results", "bench_conv.json"))
    args = p.parse_args(argv)
    global WORLD
    WORLD = args.world
    if args.shape is None:
        args.shape = [8, 64, 512, 512] if args.big else [4, 32, 256, 256]
    if args.cout is None:
        args.cout = args.shape[1]
    if args.reps is None:
        args.reps = 3 if args.big else 7
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    t0 = time.time()
    mp.spawn(_worker, args=(args, free_port(), args.json), nprocs=WORLD, join=True)
    with open(args.json) as f:
        data = json.load(f)
    print(report(data))
    print(f"\n({time.time() - t0:.0f} s; raw numbers in {os.path.relpath(args.json, _ROOT)})")


if __name__ == "__main__":
    main()
