#!/usr/bin/env python
"""dtshard vs torch.distributed.tensor, side by side: per-op dispatch overhead,
redistribute cost, tensor-parallel MLP training step (eager; torch.compile optional).

Runs on CPU with the gloo backend, world size 2, via torch.multiprocessing.spawn
on 127.0.0.1.  From the repository root:

    python benchmarks/bench_dtensor.py            # torch vs dtshard: ops, redist, train (~10 min)
    python benchmarks/bench_dtensor.py --quick    # smoke test (~1-2 min)
    python benchmarks/bench_dtensor.py --sections ops --ops add,view,linear
    python benchmarks/bench_dtensor.py --sections redist --transitions S0-R,P-S1
    python benchmarks/bench_dtensor.py --sections train --compile      # + torch.compile variants
    python benchmarks/bench_dtensor.py --sections train --compile --bind-cores   # ranks bound to cores
    python benchmarks/bench_dtensor.py --impl dtshard --sections profile --profile-ops add \
        --profile-iters 10000                     # cProfile of the cached dispatch path
    python benchmarks/bench_dtensor.py --from-json benchmarks/results/bench_torch_dtshard.json --markdown

``--impl dtshard`` is the built-in adapter ``benchmarks/adapter_dtshard.py`` (this checkout's
dtshard).  Results (JSON) go to ``benchmarks/results/``.

Every timing is a median over many repetitions, and every headline number is a
*ratio measured in the same run* (implementation time / plain local torch time on
the same per-rank shapes, implementation time / raw collective time on the same
bytes, or implementation time / torch.distributed.tensor time).  Baselines and
candidates are measured interleaved (A B C A B C ...; the order is rotated every
repetition) so machine noise hits all of them alike.  Per-op figures are thread
CPU time (robust to other load on the machine); redistribute and train figures
are wall time plus process CPU time.

A cache miss (``clear_caches()`` before one timed call) is timed two ways, interleaved:
"miss" with the heap that existed before frozen (``gc.freeze()``), so the ``gc.collect()``
before the call frees the earlier calls' garbage without walking the whole heap: what planning
an op costs; and "cold miss" after a full ``gc.collect()``, which walks every object of the
process and leaves the CPU caches cold (a plain local ``torch.softmax`` of 64x64 then costs
~250 us instead of ~5), so that column mostly measures how much code and data a call touches.

Adapted from the shared side-by-side harness (bench_dtensor.py, adapter_template.py,
pyspy_top.py).  Changes: dtshard built in and compared by default; per-op shapes are
64x64 per-rank shards; ops x*2.0 and flatten added; full_tensor correctness check
for ops; "x torch" columns; uneven redistribute variants; only mlp-small by default;
compile opt-in (--compile); profile opt-in (--sections profile).

Implementation adapter contract (``--impl``)
-------------------------------------------
``--impl`` takes a comma separated list.  Each entry is ``torch`` (the built-in
adapter around ``torch.distributed.tensor``), a path to a ``.py`` file, or an
importable module name (for ``NAME`` we first try ``NAME.bench_adapter`` and then
``NAME``).  The module (or file) must provide:

    distribute_tensor(tensor, mesh, placements) -> dtensor
    Shard(dim), Replicate(), Partial()          placement constructors
    init_device_mesh(device_type, mesh_shape)   -> mesh   (or DeviceMesh(device_type, ranks))
    redistribute(dtensor, mesh, placements)     -> dtensor

and optionally (defaults in brackets):

    NAME                                 [the --impl string]
    to_local(dt)                         [dt.to_local()]
    from_local(local, mesh, placements)  [DTensor.from_local(local, mesh, placements)]
    full_tensor(dt)                      [dt.full_tensor()]
    wait(x)                              [waits if x is an AsyncCollectiveTensor]
    placements_of(dt)                    [tuple(dt.placements)]
    clear_caches()                       [none -> "cache miss" column is n/a]
    cache_stats() -> (hits, misses)      [none]
    parallelize_module, ColwiseParallel, RowwiseParallel   [none -> TP step skipped]

The mesh/placement objects of one implementation are only ever passed back to the
same implementation, so they need not be torch's classes.
"""
from __future__ import annotations

import argparse
import cProfile
import copy
import datetime
import gc
import importlib
import importlib.util
import io
import json
import math
import os
import platform
import pstats
import socket
import statistics
import sys
import time
import traceback
import types
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.utils import _pytree as pytree

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD_SIZE = 2
PORT_RANGE = range(29700, 29800)

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", message=".*deprecated.*")

perf_ns = time.perf_counter_ns


# --------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------
def _torch_adapter() -> types.SimpleNamespace:
    """Built-in adapter: PyTorch's own DTensor (torch.distributed.tensor)."""
    from torch.distributed.tensor import (
        DTensor,
        DeviceMesh,
        Partial,
        Replicate,
        Shard,
        distribute_tensor,
        init_device_mesh,
    )
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    def redistribute(dt, mesh, placements):
        return dt.redistribute(mesh, placements)

    def from_local(local, mesh, placements):
        return DTensor.from_local(local, mesh, placements, run_check=False)

    def clear_caches():
        # python LRU cache + C++ fast-path cache + tensor-meta cache + redistribute planner
        from torch.distributed.tensor import debug as dtdebug

        dtdebug._clear_sharding_prop_cache()
        sp = DTensor._op_dispatcher.sharding_propagator
        try:
            type(sp)._propagate_tensor_meta_cached.cache_clear()
        except Exception:
            pass
        try:
            from torch.distributed.tensor import _redistribute as _r

            _r.clear_redistribute_planner_cache()
        except Exception:
            pass

    def cache_stats():
        return tuple(torch._C._get_DTensor_sharding_propagator_cache_stats())

    def count_comms(fn):
        from torch.distributed.tensor.debug import CommDebugMode

        cm = CommDebugMode()
        with cm:
            fn()
        return {str(k).split(".")[-1]: v for k, v in cm.get_comm_counts().items()}

    return types.SimpleNamespace(
        NAME="torch",
        VERSION=f"torch.distributed.tensor {torch.__version__}",
        count_comms=count_comms,
        DTensor=DTensor,
        DeviceMesh=DeviceMesh,
        Shard=Shard,
        Replicate=Replicate,
        Partial=Partial,
        distribute_tensor=distribute_tensor,
        init_device_mesh=init_device_mesh,
        redistribute=redistribute,
        from_local=from_local,
        clear_caches=clear_caches,
        cache_stats=cache_stats,
        parallelize_module=parallelize_module,
        ColwiseParallel=ColwiseParallel,
        RowwiseParallel=RowwiseParallel,
    )


REQUIRED = ("distribute_tensor", "Shard", "Replicate", "Partial", "redistribute")


BUILTIN_ADAPTERS = {"dtshard": os.path.join(HERE, "adapter_dtshard.py")}


def load_impl(spec: str) -> types.SimpleNamespace:
    if spec in BUILTIN_ADAPTERS:
        spec = BUILTIN_ADAPTERS[spec]
    if spec == "torch":
        mod = _torch_adapter()
    elif spec.endswith(".py"):
        path = os.path.abspath(spec)
        name = "bench_adapter_" + os.path.splitext(os.path.basename(path))[0]
        s = importlib.util.spec_from_file_location(name, path)
        m = importlib.util.module_from_spec(s)
        sys.modules[name] = m   # importable by name (torch.compile re-imports hook owners)
        s.loader.exec_module(m)
        mod = m
    else:
        try:
            mod = importlib.import_module(spec + ".bench_adapter")
        except ImportError:
            mod = importlib.import_module(spec)
    missing = [n for n in REQUIRED if not hasattr(mod, n)]
    if not (hasattr(mod, "init_device_mesh") or hasattr(mod, "DeviceMesh")):
        missing.append("init_device_mesh/DeviceMesh")
    if missing:
        raise RuntimeError(f"impl {spec!r} lacks required names: {missing}")
    a = types.SimpleNamespace(**{k: getattr(mod, k) for k in dir(mod) if not k.startswith("__")})
    a.NAME = getattr(mod, "NAME", os.path.splitext(os.path.basename(spec))[0])
    if not hasattr(a, "to_local"):
        a.to_local = lambda dt: dt.to_local()
    if not hasattr(a, "from_local"):
        a.from_local = lambda local, mesh, pl: mod.DTensor.from_local(local, mesh, pl)
    if not hasattr(a, "full_tensor"):
        a.full_tensor = lambda dt: dt.full_tensor()
    if not hasattr(a, "placements_of"):
        a.placements_of = lambda dt: tuple(getattr(dt, "placements", ()))
    if not hasattr(a, "wait"):
        a.wait = _default_wait
    if not hasattr(a, "make_mesh"):
        if hasattr(mod, "init_device_mesh"):
            a.make_mesh = lambda: mod.init_device_mesh("cpu", (WORLD_SIZE,))
        else:
            a.make_mesh = lambda: mod.DeviceMesh("cpu", list(range(WORLD_SIZE)))
    return a


def _default_wait(x):
    """Force completion of a (possibly async) collective result."""
    t = x.to_local() if hasattr(x, "to_local") else x
    if type(t).__name__ == "AsyncCollectiveTensor":
        t = t.wait()
    return t


# --------------------------------------------------------------------------------------
# Minimal Python __torch_dispatch__ wrapper subclasses: the floor cost of *any* Python
# __torch_dispatch__ tensor subclass (unwrap, call the op, re-wrap; no sharding logic).
#   PyWrap:       hand-written flat unwrap/rewrap (what a tuned subclass can get to)
#   PyWrapPytree: same via torch.utils._pytree.tree_map (a common, much slower idiom)
# --------------------------------------------------------------------------------------
class PyWrap(torch.Tensor):
    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
            device=elem.device, requires_grad=False,
        )
        r._elem = elem
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            if type(t) is cls:
                return t._elem
            if type(t) in (list, tuple):
                return type(t)(x._elem if type(x) is cls else x for x in t)
            return t

        out = func(*[unwrap(a) for a in args],
                   **({k: unwrap(v) for k, v in kwargs.items()} if kwargs else {}))
        if type(out) is torch.Tensor:
            return cls(out)
        if type(out) in (list, tuple):
            return type(out)(cls(o) if type(o) is torch.Tensor else o for o in out)
        return out


class PyWrapPytree(torch.Tensor):
    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), dtype=elem.dtype,
            device=elem.device, requires_grad=False,
        )
        r._elem = elem
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def unwrap(t):
            return t._elem if isinstance(t, PyWrapPytree) else t

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, PyWrapPytree, out)


def _pywrap_variants(fn_of_wrapper):
    """fn_of_wrapper(W) -> zero-arg callable using wrapper class W."""
    return {"pywrap": fn_of_wrapper(PyWrap), "pywrap_pytree": fn_of_wrapper(PyWrapPytree)}


# --------------------------------------------------------------------------------------
# timing helpers
# --------------------------------------------------------------------------------------
def _median(xs):
    return statistics.median(xs) if xs else float("nan")


def _q(xs, q):
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, int(round(q * (len(s) - 1)))))]


def _block(fn, n, cpu_clock, cpu_clock2=None):
    w0, c0 = perf_ns(), cpu_clock()
    d0 = cpu_clock2() if cpu_clock2 else 0
    for _ in range(n):
        fn()
    d1 = cpu_clock2() if cpu_clock2 else 0
    return (perf_ns() - w0) * 1e-9, (cpu_clock() - c0) * 1e-9, (d1 - d0) * 1e-9


def calibrate(fn, target_s, max_inner=1 << 14, cpu_clock=time.thread_time_ns):
    """Number of calls so that one timed block lasts ~target_s of CPU time.
    Uses the min over 3 trial blocks so a descheduled trial does not skew it."""
    fn()
    n = 1
    while True:
        t = min(_block(fn, n, cpu_clock)[1] for _ in range(3))
        if t >= target_s / 8 or n >= max_inner:
            break
        n *= 4
    per = t / n
    return max(1, min(max_inner, int(target_s / max(per, 1e-9))))


def bench_interleaved(fns: dict, reps: int, target_block_s: float, max_total_s: float,
                      min_reps: int = 7, inner: dict | None = None,
                      cpu_clock=time.thread_time_ns, cpu_clock2=None, warmup: int = 0,
                      out2: dict | None = None):
    """Time every fn in blocks of `inner[name]` calls, interleaved (order rotated per rep).
    Returns ({name: [wall s/call per rep]}, {name: [cpu s/call per rep]}, inner).
    cpu_clock: time.thread_time_ns (per-op, compute on the calling thread) or
    time.process_time_ns (collectives: includes the backend's worker threads).
    cpu_clock2 (optional): a second CPU clock, samples stored into out2[name].
    warmup: untimed calls of every fn before timing (when inner is given, there is no
    calibration run to warm things up). Must be identical on all ranks for collectives."""
    names = list(fns)
    for k in names:
        for _ in range(warmup):
            fns[k]()
    if inner is None:
        inner = {k: calibrate(fns[k], target_block_s, cpu_clock=cpu_clock) for k in names}
    wall = {k: [] for k in names}
    cpu = {k: [] for k in names}
    if out2 is not None:
        out2.update({k: [] for k in names})
    gc.collect()
    t_start = time.perf_counter()
    for r in range(reps):
        order = names[r % len(names):] + names[: r % len(names)]
        for k in order:
            w, c, c2 = _block(fns[k], inner[k], cpu_clock, cpu_clock2)
            wall[k].append(w / inner[k])
            cpu[k].append(c / inner[k])
            if out2 is not None:
                out2[k].append(c2 / inner[k])
        if r + 1 >= min_reps and time.perf_counter() - t_start > max_total_s:
            break
    return wall, cpu, inner


def summarize(wall, cpu=None, base_wall=None, base_cpu=None):
    """median/p10/p90 in us; ratio = median of per-rep ratios vs the baseline."""
    d = {"median_us": _median(wall) * 1e6, "p10_us": _q(wall, 0.1) * 1e6,
         "p90_us": _q(wall, 0.9) * 1e6, "n": len(wall)}
    if base_wall is not None:
        m = min(len(wall), len(base_wall))
        d["ratio"] = _median([wall[i] / base_wall[i] for i in range(m)])
    if cpu is not None:
        d["cpu_median_us"] = _median(cpu) * 1e6
        d["cpu_p10_us"] = _q(cpu, 0.1) * 1e6
        d["cpu_p90_us"] = _q(cpu, 0.9) * 1e6
        if base_cpu is not None:
            m = min(len(cpu), len(base_cpu))
            d["cpu_ratio"] = _median([cpu[i] / max(base_cpu[i], 1e-12) for i in range(m)])
    return d


def time_once(fn, cpu_clock=time.thread_time_ns):
    w0, c0 = perf_ns(), cpu_clock()
    out = fn()
    return (perf_ns() - w0) * 1e-9, (cpu_clock() - c0) * 1e-9, out


# --------------------------------------------------------------------------------------
# Section 1: per-op dispatch overhead
# --------------------------------------------------------------------------------------
DEFAULT_OPS = ("add,mul,mul_scalar,mm,linear,sum_dim0->P,layer_norm,softmax,transpose,view,reshape,"
               "flatten,from_local,to_local")
EXTRA_OPS = "matmul,conv2d"   # run with --ops all (or name them)
SHAPES = {"small": (64, (4, 16, 16, 16)), "medium": (512, (8, 16, 32, 16))}


def op_specs(N, conv):
    """name -> (description, builder). builder(impl, mesh, G) -> (dt_fn, local_fn, mk, global_fn)
    G: dict of global tensors; each impl builds DTensors from them; local_fn runs the
    same torch op on that rank's local shards (same per-rank shapes); mk(W) gives the same op on
    the do-nothing wrapper subclass W; global_fn() is the op on the global tensors (the reference
    for the full_tensor check; None when not applicable).

    Every per-rank shard is N x N: a Shard(0) operand has global shape (WORLD_SIZE*N, N), a
    Replicate operand (N, N)."""
    B, C, H, Co = conv
    M = WORLD_SIZE * N

    def mk_globals():
        g = torch.Generator().manual_seed(1234)
        return {
            "a": torch.randn(M, N, generator=g), "b": torch.randn(M, N, generator=g),
            "w": torch.randn(N, N, generator=g), "xr": torch.randn(N, N, generator=g),
            "wl": torch.randn(M, N, generator=g), "bias": torch.randn(M, generator=g),
            "ln_w": torch.randn(N, generator=g), "ln_b": torch.randn(N, generator=g),
            "x4": torch.randn(WORLD_SIZE * B, C, H, H, generator=g),
            "cw": torch.randn(Co, C, 3, 3, generator=g), "cb": torch.randn(Co, generator=g),
        }

    def S0(I):
        return [I.Shard(0)]

    def R(I):
        return [I.Replicate()]

    def generic(op, argspec):
        """argspec: [(global tensor key, placement fn)]."""
        def build(I, mesh, G):
            dts = [I.distribute_tensor(G[k], mesh, pl(I)) for k, pl in argspec]
            locs = [I.to_local(d) for d in dts]
            globs = [G[k] for k, _ in argspec]

            def mk(W):
                ws = [W(t) for t in locs]
                return lambda: op(*ws)
            return (lambda: op(*dts)), (lambda: op(*locs)), mk, (lambda: op(*globs))
        return build

    def to_local(I, mesh, G):
        a = I.distribute_tensor(G["a"], mesh, S0(I))
        al = I.to_local(a)

        def mk(W):
            w = W(al)
            return lambda: w.detach()
        return (lambda: I.to_local(a)), (lambda: al.detach()), mk, None

    def from_local(I, mesh, G):
        a = I.distribute_tensor(G["a"], mesh, S0(I))
        al = I.to_local(a)
        pl = S0(I)
        return ((lambda: I.from_local(al, mesh, pl)), (lambda: al.detach()),
                (lambda W: (lambda: W(al))), (lambda: G["a"]))

    ab = [("a", S0), ("b", S0)]
    aS = [("a", S0)]
    specs = {
        "add": (f"S0[{M},{N}] + S0", generic(torch.add, ab)),
        "mul": (f"S0[{M},{N}] * S0", generic(torch.mul, ab)),
        "mul_scalar": (f"S0[{M},{N}] * 2.0", generic(lambda t: t * 2.0, aS)),
        "mm": (f"torch.mm S0[{M},{N}] x R[{N},{N}]", generic(torch.mm, [("a", S0), ("w", R)])),
        "linear": (f"F.linear R x[{N},{N}], colwise W S0[{M},{N}], b S0[{M}] -> S1",
                   generic(F.linear, [("xr", R), ("wl", S0), ("bias", S0)])),
        "sum_dim0->P": (f"S0[{M},{N}].sum(0) -> Partial", generic(lambda t: t.sum(0), aS)),
        "layer_norm": (f"F.layer_norm S0[{M},{N}] over last dim, w/b R",
                       generic(lambda t, w, b: F.layer_norm(t, (N,), w, b),
                               [("a", S0), ("ln_w", R), ("ln_b", R)])),
        "softmax": (f"softmax(S0[{M},{N}], -1)", generic(lambda t: torch.softmax(t, -1), aS)),
        "transpose": (f"S0[{M},{N}].transpose(0,1)", generic(lambda t: t.transpose(0, 1), aS)),
        "view": (f"S0[{M},{N}].view(-1,2,{N // 2})", generic(lambda t: t.view(-1, 2, N // 2), aS)),
        "reshape": (f"S0[{M},{N}].reshape(-1)", generic(lambda t: t.reshape(-1), aS)),
        "flatten": (f"S0[{M},{N}].flatten()", generic(lambda t: t.flatten(), aS)),
        "from_local": ("from_local(local, S0)  (local ref: detach; pywrap: construct)", from_local),
        "to_local": (f"S0[{M},{N}].to_local()  (local ref: detach)", to_local),
        "matmul": (f"S0[{M},{N}] @ R[{N},{N}]", generic(torch.matmul, [("a", S0), ("w", R)])),
        "conv2d": (f"conv2d S0[{WORLD_SIZE * B},{C},{H},{H}] * R[{Co},{C},3,3] pad1",
                   generic(lambda x, w, b: F.conv2d(x, w, b, padding=1),
                           [("x4", S0), ("cw", R), ("cb", R)])),
    }
    return mk_globals, specs


def _op_list(args):
    if args.ops == "all":
        return (DEFAULT_OPS + "," + EXTRA_OPS).split(",")
    return (args.ops or DEFAULT_OPS).split(",")


def _ratio(xs, ys):
    """median of per-rep ratios xs[i] / ys[i] (same interleaved repetition)."""
    m = min(len(xs), len(ys))
    return _median([xs[i] / max(ys[i], 1e-12) for i in range(m)]) if m else float("nan")


def _fmt_pl(pl):
    try:
        return "(" + ",".join(str(p) for p in pl) + ")"
    except Exception:
        return str(pl)


def _as_local(I, out):
    return I.to_local(out) if (type(out) is not torch.Tensor and hasattr(out, "to_local")) else out


def section_ops(impls, meshes, args, rank):
    results = []
    shapes = [(name, *SHAPES[name]) for name in args.shapes.split(",")]
    ref_name = impls[0].NAME
    for shape_name, N, conv in shapes:
        mk_globals, specs = op_specs(N, conv)
        G = mk_globals()
        small = N <= 256
        for op_name in _op_list(args):
            if op_name not in specs:
                raise SystemExit(f"unknown op {op_name!r}; known: {', '.join(specs)}")
            desc, build = specs[op_name]
            row = {"op": op_name, "shape": shape_name, "desc": desc, "impls": {}}
            fns = {}
            local_fn = wrap_fns = None
            for I in impls:
                mesh = meshes[I.NAME]
                try:
                    dt_fn, lf, mk, global_fn = build(I, mesh, G)
                except Exception as e:  # noqa: BLE001
                    row["impls"][I.NAME] = {"error": f"build: {type(e).__name__}: {e}"[:300]}
                    continue
                if local_fn is None:
                    local_fn = lf
                    wrap_fns = {"pywrap": mk(PyWrap), "pywrap_pytree": mk(PyWrapPytree)}
                    # local first call (kernel warm-up, allocator) before the impl's first call,
                    # so the impl's first call is not charged for kernel/allocator warm-up
                    w, c, _ = time_once(local_fn)
                    row["local_first_us"] = w * 1e6
                    row["local_first_cpu_us"] = c * 1e6
                rec = {}
                try:
                    st0 = I.cache_stats() if hasattr(I, "cache_stats") else None
                    w, c, out = time_once(dt_fn)
                    st1 = I.cache_stats() if hasattr(I, "cache_stats") else None
                    rec["first_call_us"] = w * 1e6
                    rec["first_call_cpu_us"] = c * 1e6
                    if st0 is not None:
                        rec["first_call_cache_delta_hits_misses"] = [st1[0] - st0[0], st1[1] - st0[1]]
                    is_dt = type(out) is not torch.Tensor and hasattr(out, "to_local")
                    rec["out_placements"] = _fmt_pl(I.placements_of(out)) if is_dt else "plain"
                    # correctness 1: local shard of the result equals the op on the local shards
                    ref = local_fn()
                    ol = _as_local(I, out)
                    rec["local_result_matches"] = bool(
                        ol.shape == ref.shape and torch.allclose(ol, ref, atol=1e-4, rtol=1e-4))
                    # correctness 2: full_tensor() of the result equals the op on the global tensors
                    # (both ranks run the same ops, so the collectives line up)
                    if is_dt and global_fn is not None:
                        full, gref = I.full_tensor(out), global_fn()
                        rec["full_tensor_matches"] = bool(
                            full.shape == gref.shape and torch.allclose(full, gref, atol=1e-4, rtol=1e-4))
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                    row["impls"][I.NAME] = rec
                    continue
                # cache-miss cost: clear the impl's caches before each timed call, two ways
                # (interleaved). "miss": the heap that existed before is frozen (gc.freeze), so the
                # gc.collect() before the call frees the previous calls' garbage without walking the
                # whole heap: the planner's own cost. "cold miss": a full gc.collect() first, which
                # walks every object of the process (165k where only torch is imported) and evicts
                # the CPU caches: a plain local torch.softmax then costs ~250 us instead of ~5
                # (measured), and the more code and data a call touches, the more it pays.
                if hasattr(I, "clear_caches"):
                    times = {"": ([], []), "cold_": ([], [])}
                    try:
                        for _ in range(args.miss_reps if small else max(5, args.miss_reps // 3)):
                            for kind, (mw, mc) in times.items():
                                if not kind:
                                    gc.freeze()
                                I.clear_caches()
                                gc.collect()
                                try:
                                    w, c, _ = time_once(dt_fn)
                                finally:
                                    gc.unfreeze()
                                mw.append(w)
                                mc.append(c)
                        for kind, (mw, mc) in times.items():
                            rec[f"{kind}cache_miss_us"] = _median(mw) * 1e6
                            rec[f"{kind}cache_miss_cpu_us"] = _median(mc) * 1e6
                    except Exception as e:  # noqa: BLE001
                        rec["cache_miss_error"] = f"{type(e).__name__}: {e}"[:300]
                    dt_fn()  # re-populate
                row["impls"][I.NAME] = rec
                fns[I.NAME] = dt_fn
            if local_fn is None:
                results.append(row)
                continue
            fns = {"local": local_fn, **wrap_fns, **fns}
            wall, cpu, inner = bench_interleaved(
                fns, reps=args.reps if small else max(11, args.reps // 2),
                target_block_s=0.002 if small else 0.02,
                max_total_s=args.op_budget_s if small else 2 * args.op_budget_s)
            row["local"] = summarize(wall["local"], cpu["local"])
            row["local"]["inner"] = inner["local"]
            for wname in wrap_fns:
                row[wname] = summarize(wall[wname], cpu[wname], wall["local"], cpu["local"])
            for name in list(row["impls"]):
                if name in wall:
                    r = row["impls"][name]
                    r.update(summarize(wall[name], cpu[name], wall["local"], cpu["local"]))
                    r["overhead_us"] = r["median_us"] - row["local"]["median_us"]
                    r["cpu_overhead_us"] = r["cpu_median_us"] - row["local"]["cpu_median_us"]
                    r["inner"] = inner[name]
                    r["cpu_ratio_vs_pywrap"] = _ratio(cpu[name], cpu["pywrap"])
                    if name != ref_name and ref_name in cpu:
                        r["cpu_ratio_vs_ref"] = _ratio(cpu[name], cpu[ref_name])
                        r["wall_ratio_vs_ref"] = _ratio(wall[name], wall[ref_name])
                        rr = row["impls"][ref_name]
                        for kind in ("", "cold_"):
                            if f"{kind}cache_miss_cpu_us" in r and f"{kind}cache_miss_cpu_us" in rr:
                                r[f"{kind}cache_miss_ratio_vs_ref"] = (r[f"{kind}cache_miss_cpu_us"]
                                                                       / rr[f"{kind}cache_miss_cpu_us"])
            results.append(row)
            if rank == 0 and args.verbose:
                print(f"  op {shape_name:6s} {op_name:12s} done", flush=True)
    return results


# --------------------------------------------------------------------------------------
# Section 2: redistribute
# --------------------------------------------------------------------------------------
def _ag(out, inp):
    if hasattr(dist, "all_gather_single"):
        return dist.all_gather_single(out, inp)
    return dist.all_gather_into_tensor(out, inp)


def _rs(out, inp):
    if hasattr(dist, "reduce_scatter_single"):
        return dist.reduce_scatter_single(out, inp)
    return dist.reduce_scatter_tensor(out, inp)


def _probe_collectives():
    """Which raw collectives does this backend support? (gloo lacked some historically)"""
    sup = {}
    x = torch.ones(4, 2)
    for name, fn in [
        ("all_gather_into_tensor", lambda: _ag(torch.empty(8, 2), x)),
        ("reduce_scatter_tensor", lambda: _rs(torch.empty(2, 2), x)),
        ("all_to_all_single", lambda: dist.all_to_all_single(torch.empty(4, 2), x)),
        ("all_reduce", lambda: dist.all_reduce(x.clone())),
    ]:
        try:
            fn()
            ok = True
        except Exception as e:  # noqa: BLE001
            ok = f"unsupported: {str(e).splitlines()[0][:120]}"
        sup[name] = ok
        dist.barrier()
    return sup


TRANSITIONS = [
    ("S0->R", "S0", "R"),
    ("S1->R", "S1", "R"),
    ("P->R", "P", "R"),
    ("P->S0", "P", "S0"),
    ("P->S1", "P", "S1"),
    ("R->S1", "R", "S1"),
    ("S0->S1", "S0", "S1"),
]


def _pl(I, code):
    return {"S0": [I.Shard(0)], "S1": [I.Shard(1)], "R": [I.Replicate()], "P": [I.Partial()]}[code]


def section_redistribute(impls, meshes, args, rank, support):
    ws = WORLD_SIZE
    sizes = [float(s) for s in args.redist_sizes.split(",")]
    pclock = time.process_time_ns   # includes gloo's worker threads (packing, reductions, copies)
    ref_name = impls[0].NAME
    results = []

    def _norm(t):
        return t.replace("->", "-").replace(":", "-").replace("_", "-").upper()
    wanted = {_norm(t) for t in args.transitions.split(",")} if args.transitions else None
    variants = {"both": (False, True), "none": (False,), "only": (True,)}[args.uneven]
    for mib in sizes:
        numel = int(mib * (1 << 20)) // 4
        n0 = int(round(math.sqrt(numel)))
        n0 -= n0 % ws
        for uneven in variants:
            # uneven: both dims odd, so Shard(0) and Shard(1) chunks differ by one row/column
            n = n0 + 1 if uneven else n0
            shape = (n, n)
            gbytes = n * n * 4
            g = torch.Generator().manual_seed(99)
            G = torch.randn(shape, generator=g)
            Plocal = G * (rank + 1)          # Partial source: rank-dependent contributions
            Pexpected = G * sum(r + 1 for r in range(ws))
            if gbytes <= (1 << 20) + (1 << 16):
                reps, inner = args.redist_reps, 5
            elif gbytes <= (16 << 20) + (1 << 20):
                reps, inner = max(9, (2 * args.redist_reps) // 3), 1
            else:
                reps, inner = max(7, args.redist_reps // 2), 1
            # raw collective buffers (preallocated, contiguous). Uneven shapes: the raw collective
            # moves the rows padded to a multiple of the world size (what a padded collective moves)
            rows = -(-n // ws) * ws
            Gp = torch.zeros(rows, n)
            Gp[:n] = G
            loc0 = Gp.chunk(ws, 0)[rank].contiguous()
            Pp = Gp * (rank + 1)
            ag_out = torch.empty(rows, n)
            ar_buf = torch.zeros(shape)
            rs_out = torch.empty(rows // ws, n)
            a2a_out = torch.empty_like(loc0)
            rs_ok = support.get("reduce_scatter_tensor") is True
            a2a_ok = support.get("all_to_all_single") is True
            raw = {
                "all_gather": lambda: _ag(ag_out, loc0),
                "all_reduce": lambda: dist.all_reduce(ar_buf),
                # emulation when the backend lacks reduce_scatter_tensor: all_reduce + local chunk
                "reduce_scatter": (lambda: _rs(rs_out, Pp)) if rs_ok
                else (lambda: dist.all_reduce(ar_buf)),
                "all_to_all": (lambda: dist.all_to_all_single(a2a_out, loc0)) if a2a_ok
                else (lambda: _ag(ag_out, loc0)),
                "local_chunk_copy": lambda: G.chunk(ws, 1)[rank].contiguous(),
            }
            raw_for = {"S0->R": ["all_gather"], "S1->R": ["all_gather"], "P->R": ["all_reduce"],
                       "P->S0": ["reduce_scatter"], "P->S1": ["reduce_scatter"],
                       "R->S1": ["local_chunk_copy"], "S0->S1": ["all_to_all", "all_gather"]}
            for tname, src, dst in TRANSITIONS:
                if wanted and _norm(tname) not in wanted:
                    continue
                label = tname + (" u" if uneven else "")
                row = {"transition": label, "uneven": uneven, "MiB": gbytes / (1 << 20),
                       "shape": list(shape), "raw_collectives": raw_for[tname], "inner": inner,
                       "impls": {}}
                if not rs_ok and "reduce_scatter" in raw_for[tname]:
                    row["note"] = "backend lacks reduce_scatter_tensor: raw = all_reduce emulation"
                fns = {}
                for I in impls:
                    mesh = meshes[I.NAME]
                    rec = {}
                    try:
                        if src == "P":
                            d = I.from_local(Plocal, mesh, _pl(I, "P"))
                            expected = Pexpected
                        else:
                            d = I.distribute_tensor(G, mesh, _pl(I, src))
                            expected = G
                        dpl = _pl(I, dst)

                        def f(I=I, d=d, mesh=mesh, dpl=dpl):
                            return I.wait(I.redistribute(d, mesh, dpl))

                        dist.barrier()
                        w, c, out = time_once(f, pclock)
                        rec["first_call_ms"] = w * 1e3
                        rec["first_call_cpu_ms"] = c * 1e3
                        out_dt = I.redistribute(d, mesh, dpl)
                        rec["out_placements"] = _fmt_pl(I.placements_of(out_dt))
                        full = I.full_tensor(out_dt)
                        rec["correct"] = bool(full.shape == expected.shape
                                              and torch.allclose(full, expected, atol=1e-4, rtol=1e-4))
                        if not rec["correct"]:
                            rec["mismatch"] = (f"full_tensor shape {tuple(full.shape)} vs {tuple(expected.shape)}"
                                               if full.shape != expected.shape else
                                               f"max abs err {float((full - expected).abs().max()):.3g}")
                        fns[I.NAME] = f
                    except Exception as e:  # noqa: BLE001
                        rec["error"] = f"{type(e).__name__}: {e}"[:300]
                    row["impls"][I.NAME] = rec
                for rn in raw_for[tname]:
                    fns["raw:" + rn] = raw[rn]
                # fixed inner/reps on every rank: the collectives must line up across ranks
                dist.barrier()
                tcpu = {}
                wall, cpu, _ = bench_interleaved(
                    fns, reps=reps, target_block_s=0, max_total_s=1e9, min_reps=reps,
                    inner={k: inner for k in fns}, cpu_clock=pclock,
                    cpu_clock2=time.thread_time_ns, warmup=1 if gbytes > (16 << 20) else 2,
                    out2=tcpu)
                base_key = "raw:" + raw_for[tname][0]
                base = summarize(wall[base_key], cpu[base_key])
                base_t = _median(tcpu[base_key])
                for k in fns:
                    summ = summarize(wall[k], cpu[k], wall[base_key], cpu[base_key])
                    summ["median_ms"] = summ["median_us"] / 1e3
                    summ["cpu_median_ms"] = summ["cpu_median_us"] / 1e3
                    # main-thread CPU only (excludes gloo's worker threads): framework work
                    summ["main_thread_cpu_ms"] = _median(tcpu[k]) * 1e3
                    summ["main_thread_cpu_ovh_ms"] = (_median(tcpu[k]) - base_t) * 1e3
                    summ["GBps"] = gbytes / (summ["median_us"] * 1e-6) / 1e9
                    if k.startswith("raw:"):
                        row[k] = summ
                    else:
                        summ["overhead_ms_vs_raw"] = (summ["median_us"] - base["median_us"]) / 1e3
                        summ["cpu_overhead_ms_vs_raw"] = (summ["cpu_median_us"] - base["cpu_median_us"]) / 1e3
                        if k != ref_name and ref_name in wall:
                            summ["wall_ratio_vs_ref"] = _ratio(wall[k], wall[ref_name])
                            summ["main_thread_cpu_ratio_vs_ref"] = _ratio(tcpu[k], tcpu[ref_name])
                        row["impls"][k].update(summ)
                results.append(row)
                if rank == 0 and args.verbose:
                    print(f"  redist {gbytes / (1 << 20):6.2f} MiB {label} done", flush=True)
            raw = fns = None   # drop references to this size's buffers before the next size
            gc.collect()
    return results


# --------------------------------------------------------------------------------------
# Section 3: tensor-parallel MLP training step
# --------------------------------------------------------------------------------------
class MLP(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.clone()
        dist.all_reduce(y)
        return y

    @staticmethod
    def backward(ctx, g):
        return g


class ManualTPMLP(nn.Module):
    """Hand-written Megatron-style TP with plain tensors + one raw all_reduce (the floor)."""

    def __init__(self, full: MLP, rank, ws):
        super().__init__()
        h = full.fc1.out_features
        sl = slice(rank * h // ws, (rank + 1) * h // ws)
        self.w1 = nn.Parameter(full.fc1.weight.detach()[sl].clone())
        self.b1 = nn.Parameter(full.fc1.bias.detach()[sl].clone())
        self.w2 = nn.Parameter(full.fc2.weight.detach()[:, sl].clone())
        self.b2 = nn.Parameter(full.fc2.bias.detach().clone())

    def forward(self, x):
        y = F.linear(F.relu(F.linear(x, self.w1, self.b1)), self.w2)
        return _AllReduceSum.apply(y) + self.b2


def make_step(model, x, lr=1e-3):
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def step():
        opt.zero_grad(set_to_none=True)
        out = model(x)
        if type(out) is not torch.Tensor and hasattr(out, "to_local"):
            out = out.to_local()  # replicated output DTensor -> local copy
        loss = (out * out).mean()
        loss.backward()
        opt.step()
        return loss

    step.model = model
    return step


def section_train(impls, meshes, args, rank):
    ws = WORLD_SIZE
    all_configs = {"mlp-small": (256, 1024, 32), "mlp-1024": (1024, 4096, 64)}
    configs = [(c, *all_configs[c]) for c in args.train_configs.split(",")]
    results = []
    for cname, d, h, bsz in configs:
        torch.manual_seed(0)
        full = MLP(d, h)
        x = torch.randn(bsz, d, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            ref_loss = float(((full(x)) ** 2).mean())

        def local_equiv():
            torch.manual_seed(0)
            return MLP(d, h // ws)           # same per-rank shapes, no communication

        # factories: each call builds a fresh model (eager and compiled runs get their own)
        factories = {"local_equiv": local_equiv,
                     "manual_tp_raw_allreduce": lambda: ManualTPMLP(full, rank, ws)}
        row = {"config": cname, "d": d, "hidden": h, "batch": bsz, "ref_loss": ref_loss,
               "impls": {}}
        for I in impls:
            if not all(hasattr(I, n) for n in ("parallelize_module", "ColwiseParallel", "RowwiseParallel")):
                row["impls"][I.NAME] = {"skipped": "adapter has no parallelize_module/Colwise/Rowwise"}
                continue

            def tp_factory(I=I):
                return I.parallelize_module(copy.deepcopy(full), meshes[I.NAME],
                                            {"fc1": I.ColwiseParallel(), "fc2": I.RowwiseParallel()})
            factories["tp:" + I.NAME] = tp_factory
            row["impls"][I.NAME] = {}
        steps = {}
        for k, fac in list(factories.items()):
            try:
                steps[k] = make_step(fac(), x)
            except Exception as e:  # noqa: BLE001 (deterministic, so all ranks agree)
                row["impls"][k[3:]] = {"error": f"{type(e).__name__}: {e}"[:300]}
                factories.pop(k)

        def slot(k):
            return row["impls"][k[3:]] if k.startswith("tp:") else row.setdefault(k, {})

        # first step (cold caches) + correctness of the first loss and of the gradients vs the
        # full model. A failing step is reported and dropped (deterministic, so all ranks agree).
        ref_model = copy.deepcopy(full)
        (ref_model(x) ** 2).mean().backward()
        ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}
        pclock = time.process_time_ns
        for k, st in list(steps.items()):
            dist.barrier()
            try:
                w, c, loss = time_once(st, pclock)
            except Exception as e:  # noqa: BLE001
                slot(k).update({"error": f"first step: {type(e).__name__}: {e}"[:300]})
                if rank == 0 and args.verbose:
                    traceback.print_exc()
                steps.pop(k)
                factories.pop(k, None)
                continue
            slot(k)["first_step_ms"] = w * 1e3
            slot(k)["first_step_cpu_ms"] = c * 1e3
            if k != "local_equiv":
                slot(k)["first_loss_abs_err"] = abs(float(loss.detach()) - ref_loss)
            if k.startswith("tp:"):
                I = next(I for I in impls if I.NAME == k[3:])
                try:
                    errs = {}
                    for pn, p in st.model.named_parameters():
                        gfull = I.full_tensor(p.grad) if hasattr(p.grad, "to_local") else p.grad
                        errs[pn] = float((gfull - ref_grads[pn]).abs().max())
                    slot(k)["grad_max_abs_err"] = max(errs.values())
                except Exception as e:  # noqa: BLE001
                    slot(k)["grad_check_error"] = f"{type(e).__name__}: {e}"[:300]
        small = h <= 1024
        reps = args.train_reps if small else max(7, args.train_reps // 2)
        inner = 5 if small else 1
        dist.barrier()
        wall, cpu, _ = bench_interleaved(steps, reps=reps, target_block_s=0, max_total_s=1e9,
                                         min_reps=reps, inner={k: inner for k in steps},
                                         cpu_clock=pclock, warmup=1)
        ref_key = "tp:" + impls[0].NAME
        for k in steps:
            summ = summarize(wall[k], cpu[k], wall["local_equiv"], cpu["local_equiv"])
            summ["median_ms"] = summ["median_us"] / 1e3
            summ["cpu_median_ms"] = summ["cpu_median_us"] / 1e3
            if k.startswith("tp:") and k != ref_key and ref_key in steps:
                summ["wall_ratio_vs_ref"] = _ratio(wall[k], wall[ref_key])
                summ["cpu_ratio_vs_ref"] = _ratio(cpu[k], cpu[ref_key])
            slot(k).update(summ)
        # how many ops per step reach the subclass, and which collectives run
        for k in steps:
            if k.startswith("tp:"):
                I = next(I for I in impls if I.NAME == k[3:])
                # the adapter's own count when it has one (a counting mode changes dtshard's path)
                slot(k)["subclass_ops_per_step"] = (I.count_ops(steps[k]) if hasattr(I, "count_ops")
                                                    else _count_subclass_ops(steps[k]))
                slot(k)["comm_counts_per_step"] = _comm_counts(I, steps[k])
        results.append(row)
        if rank == 0 and args.verbose:
            print(f"  train {cname} eager done", flush=True)
        if args.compile:
            row["compile"] = _compile_variants(factories, x, args, rank, small)
            if rank == 0 and args.verbose:
                print(f"  train {cname} compile done", flush=True)
    return results


def _count_subclass_ops(step):
    """Run one step under a TorchDispatchMode that counts the top-level aten ops whose
    arguments include a tensor subclass instance (i.e. ops the impl has to handle)."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class _Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if any(isinstance(t, torch.Tensor) and type(t) not in (torch.Tensor, nn.Parameter)
                   for t in pytree.tree_leaves((args, kwargs))):
                self.ops[str(func)] += 1
            return func(*args, **kwargs)

    try:
        m = _Count()
        with m:
            step()
        return {"total": sum(m.ops.values()), "by_op": dict(m.ops.most_common())}
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def _comm_counts(I, step):
    """Collectives issued by one step, via the adapter's count_comms(fn) -> {kind: count}."""
    if not hasattr(I, "count_comms"):
        return {"n/a": "adapter has no count_comms"}
    try:
        return I.count_comms(step)
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def _compile_variants(factories, x, args, rank, small):
    import torch._dynamo
    import torch._inductor.config as icfg

    icfg.compile_threads = 1
    out = {k: {} for k in factories}
    # one-time inductor warm-up (C++ toolchain / precompiled header) so that it is not
    # charged to whichever variant happens to compile first
    try:
        torch.compile(lambda t: (t.sin() + 1).sum())(torch.randn(8))
    except Exception:  # noqa: BLE001
        pass
    dist.barrier()
    # 1) graph breaks via explain (each on a fresh model)
    for k, fac in factories.items():
        try:
            torch._dynamo.reset()
            ex = torch._dynamo.explain(fac())(x)
            out[k]["graph_count"] = ex.graph_count
            out[k]["graph_break_count"] = ex.graph_break_count
            out[k]["break_reasons"] = [str(getattr(r, "reason", r))[:200] for r in ex.break_reasons][:5]
        except Exception as e:  # noqa: BLE001
            out[k]["explain_error"] = f"{type(e).__name__}: {e}"[:300]
        dist.barrier()
    torch._dynamo.reset()
    # 2) compile fwd (+AOT bwd) of each variant; SGD step stays eager
    compiled_steps = {}
    for k, fac in factories.items():
        rec = out[k]
        try:
            step = make_step(torch.compile(fac()), x)
            dist.barrier()
            w, c, loss = time_once(step, time.process_time_ns)
            rec["compiles"] = True
            rec["first_step_incl_compile_s"] = w
            rec["first_step_incl_compile_cpu_s"] = c
            rec["first_loss"] = float(loss.detach())
            compiled_steps[k] = step
        except Exception as e:  # noqa: BLE001
            rec["compiles"] = False
            rec["error"] = f"{type(e).__name__}: {str(e)[:400]}"
            if rank == 0 and args.verbose:
                traceback.print_exc()
    # all ranks must agree on which variants to run (collectives inside)
    ok = torch.tensor([1 if k in compiled_steps else 0 for k in factories])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    compiled_steps = {k: compiled_steps[k] for i, k in enumerate(factories)
                      if ok[i] and k in compiled_steps}
    if "local_equiv" in compiled_steps:
        for k, st in compiled_steps.items():
            w, _, _ = time_once(st)      # second call: may still recompile (e.g. grads now exist)
            out[k]["second_step_ms"] = w * 1e3
        dist.barrier()
        reps = args.train_reps if small else max(7, args.train_reps // 2)
        wall, cpu, _ = bench_interleaved(compiled_steps, reps=reps, target_block_s=0, max_total_s=1e9,
                                         min_reps=reps, inner={k: (5 if small else 1) for k in compiled_steps},
                                         cpu_clock=time.process_time_ns)
        # the first TP variant (the reference implementation's) is the yardstick of the others,
        # repetition by repetition (the variants run interleaved: the same machine noise)
        ref_key = next((k for k in compiled_steps if k.startswith("tp:")), None)
        for k in compiled_steps:
            summ = summarize(wall[k], cpu[k], wall["local_equiv"], cpu["local_equiv"])
            summ["median_ms"] = summ["median_us"] / 1e3
            summ["cpu_median_ms"] = summ["cpu_median_us"] / 1e3
            if k.startswith("tp:") and k != ref_key:
                summ["wall_ratio_vs_ref"] = _ratio(wall[k], wall[ref_key])
                summ["cpu_ratio_vs_ref"] = _ratio(cpu[k], cpu[ref_key])
            out[k].update(summ)
    return out


# --------------------------------------------------------------------------------------
# Profiling (cProfile on rank 0)
# --------------------------------------------------------------------------------------
def _pstats_rows(pr, n, k=10, key="tottime"):
    st = pstats.Stats(pr, stream=io.StringIO())
    idx = 2 if key == "tottime" else 3
    rows = []
    tdir = os.path.dirname(torch.__file__)
    for (fn, line, name), (cc, nc, tt, ct, callers) in sorted(
            st.stats.items(), key=lambda kv: -kv[1][idx])[:k]:
        short = fn.replace(tdir, "torch").replace(HERE + "/", "")
        rows.append({"func": f"{short}:{line}({name})", "ncalls_per_iter": nc / n,
                     "tottime_us_per_iter": tt / n * 1e6, "cumtime_us_per_iter": ct / n * 1e6})
    return st.total_tt / n * 1e6, rows


_PROFILE_TIMER = ["wall"]


def _profile(fn, n, rank, setup=None, collective=False):
    """cProfile n calls of fn on rank 0. setup() runs before every call, outside the profiler.
    collective=True: rank 1 runs the same calls (unprofiled) so collectives line up."""
    res = None
    if rank == 0:
        # wall (default, cProfile's own low-overhead clock) or thread CPU time (robust to other load
        # on the machine, but the timer call itself inflates every entry more)
        pr = (cProfile.Profile(time.thread_time_ns, 1e-9) if _PROFILE_TIMER[0] == "cpu"
              else cProfile.Profile())
        for _ in range(n):
            if setup:
                setup()
            pr.enable()
            fn()
            pr.disable()
        total, rows = _pstats_rows(pr, n)
        _, cum = _pstats_rows(pr, n, k=25, key="cumtime")
        res = {"iters": n, "total_us_per_iter_under_cprofile": total, "top10_tottime": rows,
               "top25_cumtime": cum}
    elif collective:
        for _ in range(n):
            if setup:
                setup()
            fn()
    dist.barrier()
    return res


def section_profile(impls, meshes, args, rank):
    _PROFILE_TIMER[0] = args.profile_timer
    out = {"timer": args.profile_timer}
    mk_globals, specs = op_specs(64, (4, 16, 16, 16))
    G = mk_globals()
    for I in impls:
        mesh = meshes[I.NAME]
        # steady-state per op (local compute only: rank 0 alone)
        for op_name in args.profile_ops.split(","):
            dt_fn = specs[op_name][1](I, mesh, G)[0]
            try:
                for _ in range(50):
                    dt_fn()
            except Exception as e:  # noqa: BLE001
                if rank == 0:
                    out[f"{I.NAME}:{op_name}"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                continue
            r = _profile(dt_fn, args.profile_iters, rank)
            if r:
                out[f"{I.NAME}:{op_name}"] = r
        # cache-miss call
        if hasattr(I, "clear_caches"):
            dt_fn = specs["add"][1](I, mesh, G)[0]
            r = _profile(dt_fn, 30, rank, setup=I.clear_caches)
            if r:
                out[f"{I.NAME}:add (cache miss)"] = r
        # redistribute, small tensor (overhead-dominated)
        d = I.distribute_tensor(torch.randn(128, 128), mesh, [I.Shard(0)])
        for tgt, name in ((I.Replicate(), "S0->R"), (I.Shard(1), "S0->S1")):
            def f(d=d, tgt=tgt):
                return I.wait(I.redistribute(d, mesh, [tgt]))
            try:
                for _ in range(5):
                    f()
            except Exception as e:  # noqa: BLE001 (deterministic: every rank fails here)
                if rank == 0:
                    out[f"{I.NAME}:redistribute {name} 64KiB"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                dist.barrier()
                continue
            dist.barrier()
            r = _profile(f, 200, rank, collective=True)
            if r:
                out[f"{I.NAME}:redistribute {name} 64KiB"] = r
        # one TP training step (mlp-small)
        if all(hasattr(I, n) for n in ("parallelize_module", "ColwiseParallel", "RowwiseParallel")):
            torch.manual_seed(0)
            m = I.parallelize_module(MLP(256, 1024), mesh,
                                     {"fc1": I.ColwiseParallel(), "fc2": I.RowwiseParallel()})
            step = make_step(m, torch.randn(32, 256, generator=torch.Generator().manual_seed(1)))
            try:
                for _ in range(5):
                    step()
            except Exception as e:  # noqa: BLE001 (deterministic: every rank fails here)
                if rank == 0:
                    out[f"{I.NAME}:TP train step mlp-small"] = {"error": f"{type(e).__name__}: {e}"[:300]}
                dist.barrier()
                continue
            dist.barrier()
            r = _profile(step, 50, rank, collective=True)
            if r:
                out[f"{I.NAME}:TP train step mlp-small"] = r
    return out


# --------------------------------------------------------------------------------------
# worker / driver
# --------------------------------------------------------------------------------------
def worker(rank, args, port, result_path):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*deprecated.*")
    warnings.filterwarnings("ignore", message="Full backward hook")
    torch.set_num_threads(args.threads)
    if args.bind_cores:  # this rank on its own core(s), before gloo's threads start (they inherit it)
        from _checkout import bind_threads, own_cores

        cores = own_cores(rank, WORLD_SIZE)
        if cores is None:
            raise SystemExit(f"--bind-cores: {os.cpu_count()} cores cannot give {WORLD_SIZE} ranks one each (Linux only)")
        bind_threads(cores)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE,
                            timeout=datetime.timedelta(seconds=args.pg_timeout_s))
    try:
        impls, load_errors = [], []
        for spec in args.impl.split(","):
            try:   # an implementation that fails to import is reported; the others still run
                impls.append(load_impl(spec))
            except Exception as e:  # noqa: BLE001 (deterministic, so all ranks agree)
                load_errors.append(f"{spec}: FAILED TO LOAD: {type(e).__name__}: {e}"[:500])
                if rank == 0:
                    traceback.print_exc()
        if not impls:
            raise RuntimeError("no implementation could be loaded: " + "; ".join(load_errors))
        meshes = {I.NAME: I.make_mesh() for I in impls}
        res = {"rank": rank, "impl_names": [I.NAME for I in impls], "pid": os.getpid(),
               "impl_versions": [f"{I.NAME}: {getattr(I, 'VERSION', '?')}" for I in impls] + load_errors}
        sections = args.sections.split(",")
        if args.spin:
            _spin(impls[0], meshes[impls[0].NAME], args, rank)
            return
        if "ops" in sections:
            res["ops"] = section_ops(impls, meshes, args, rank)
            dist.barrier()
        res["collective_support"] = _probe_collectives()
        if "redist" in sections:
            res["redistribute"] = section_redistribute(impls, meshes, args, rank, res["collective_support"])
            dist.barrier()
        if "train" in sections:
            res["train"] = section_train(impls, meshes, args, rank)
            dist.barrier()
        if "profile" in sections:
            res["profile"] = section_profile(impls, meshes, args, rank)
            dist.barrier()
        gathered = [None] * WORLD_SIZE
        dist.all_gather_object(gathered, res)
        if rank == 0:
            # hand results to the parent through a file (a pipe/queue can deadlock with
            # mp.spawn(join=True) once the payload exceeds the pipe buffer)
            with open(result_path, "w") as f:
                json.dump(gathered, f, default=str)
    except Exception:
        traceback.print_exc()
        raise
    finally:
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _spin(I, mesh, args, rank):
    """Run one op in a loop for --spin-seconds on rank 0 (for external profilers: py-spy)."""
    mk_globals, specs = op_specs(64, (4, 16, 16, 16))
    G = mk_globals()
    dt_fn = specs[args.spin][1](I, mesh, G)[0]
    dist.barrier()
    if rank == 0:
        print(f"spinning {args.spin} pid={os.getpid()}", flush=True)
        t_end = time.time() + args.spin_seconds
        n = 0
        while time.time() < t_end:
            for _ in range(100):
                dt_fn()
            n += 100
        print(f"spin done: {n} calls, {args.spin_seconds / n * 1e6:.1f} us/call", flush=True)
    dist.barrier()


def _git_state():
    """'<short sha>' of the checkout, '+dirty' when dtshard/ or kernels/ have local changes."""
    import subprocess

    root = os.path.dirname(HERE)
    try:
        sha = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", root, "status", "--porcelain", "--", "dtshard", "kernels"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return (sha or "?") + ("+dirty" if dirty else "")
    except Exception:  # noqa: BLE001
        return "?"


def _free_port():
    for p in PORT_RANGE:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 0)
            try:
                s.bind(("127.0.0.1", p))
                return p
            except OSError:
                continue
    raise RuntimeError("no free port in 29700-29799")


# --------------------------------------------------------------------------------------
# reporting
# --------------------------------------------------------------------------------------
def _f(x, fmt="{:.1f}"):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "n/a"
    return fmt.format(x)


def _ok(rec, *keys):
    """y / N / - for correctness flags (N if any present flag is False)."""
    flags = [rec[k] for k in keys if k in rec]
    if not flags:
        return "-"
    return "y" if all(flags) else "N"


def _err(rec, n=70):
    return "ERR " + str(rec.get("error", "?")).replace("\n", " ")[:n]


def _ops_rows(data, rank=0):
    """(header, rows) of the per-op table; rows are lists of cells."""
    r0 = data["ranks"][rank]
    impls = data["meta"]["impls"]
    ref = impls[0]
    hdr = ["shape", "op", "local", "pywrap", "pytree"]
    for n in impls:
        hdr += [f"{n} us", "x local", "x pywrap", "miss us", "cold miss", "1st us", "out", "ok"]
        if n != ref:
            hdr += [f"x {ref}", f"miss x {ref}", f"cold miss x {ref}"]
    rows = []
    for row in r0["ops"]:
        cells = [row["shape"], row["op"]]
        if "local" not in row:
            cells += ["n/a"] * 3
        else:
            cells += [_f(row["local"]["cpu_median_us"]), _f(row["pywrap"]["cpu_median_us"]),
                      _f(row["pywrap_pytree"]["cpu_median_us"])]
        for n in impls:
            rec = row["impls"].get(n, {})
            w = 11 if n != ref else 8
            if "cpu_median_us" not in rec:
                cells += [_err(rec)] + [""] * (w - 1)
                continue
            cells += [_f(rec["cpu_median_us"]), _f(rec.get("cpu_ratio"), "{:.2f}"),
                      _f(rec.get("cpu_ratio_vs_pywrap"), "{:.2f}"), _f(rec.get("cache_miss_cpu_us"), "{:.0f}"),
                      _f(rec.get("cold_cache_miss_cpu_us"), "{:.0f}"),
                      _f(rec.get("first_call_cpu_us"), "{:.0f}"), rec.get("out_placements", ""),
                      _ok(rec, "local_result_matches", "full_tensor_matches")]
            if n != ref:
                cells += [_f(rec.get("cpu_ratio_vs_ref"), "{:.2f}"), _f(rec.get("cache_miss_ratio_vs_ref"), "{:.2f}"),
                          _f(rec.get("cold_cache_miss_ratio_vs_ref"), "{:.2f}")]
        rows.append(cells)
    return hdr, rows


def _redist_rows(data, rank=0):
    r0 = data["ranks"][rank]
    impls = data["meta"]["impls"]
    ref = impls[0]
    hdr = ["MiB", "transition", "raw collective", "raw ms"]
    for n in impls:
        hdr += [f"{n} ms", "x raw", "+ms wall", "+ms main-thr CPU", "1st ms", "out", "ok"]
        if n != ref:
            hdr += [f"x {ref} (wall)", f"x {ref} (main-thr CPU)"]
    rows = []
    for row in r0["redistribute"]:
        raw = row.get("raw:" + row["raw_collectives"][0], {})
        rawdesc = row["raw_collectives"][0]
        if len(row["raw_collectives"]) > 1:
            alt = row.get("raw:" + row["raw_collectives"][1], {})
            rawdesc += f" ({row['raw_collectives'][1]} {_f(alt.get('median_ms'), '{:.2f}')})"
        cells = [f"{row['MiB']:.2f}", row["transition"], rawdesc, _f(raw.get("median_ms"), "{:.3f}")]
        for n in impls:
            rec = row["impls"].get(n, {})
            w = 9 if n != ref else 7
            if "median_ms" not in rec:
                cells += [_err(rec)] + [""] * (w - 1)
                continue
            ok = "y" if rec.get("correct") else ("N " + rec.get("mismatch", ""))
            cells += [_f(rec["median_ms"], "{:.3f}"), _f(rec.get("ratio"), "{:.2f}"),
                      _f(rec.get("overhead_ms_vs_raw"), "{:.3f}"), _f(rec.get("main_thread_cpu_ovh_ms"), "{:.3f}"),
                      _f(rec.get("first_call_ms"), "{:.2f}"), rec.get("out_placements", ""), ok]
            if n != ref:
                cells += [_f(rec.get("wall_ratio_vs_ref"), "{:.2f}"),
                          _f(rec.get("main_thread_cpu_ratio_vs_ref"), "{:.2f}")]
        rows.append(cells)
    return hdr, rows


def _train_rows(data, rank=0):
    r0 = data["ranks"][rank]
    impls = data["meta"]["impls"]
    ref = impls[0]
    hdr = ["config", "variant", "ms/step", "x local", "CPU ms/step", "x local (CPU)", f"x tp:{ref} (wall)",
           f"x tp:{ref} (CPU)", "1st step ms", "loss err", "grad err", "notes"]
    rows = []
    for row in r0["train"]:
        cfg = f"{row['config']} d={row['d']} h={row['hidden']} B={row['batch']}"
        variants = [(k, row.get(k, {})) for k in ("local_equiv", "manual_tp_raw_allreduce")]
        variants += [("tp:" + n, row["impls"].get(n, {})) for n in impls]
        for k, r in variants:
            if "median_ms" not in r:
                rows.append([cfg, k, _err(r, 200) if "error" in r else str(r)[:200]] + [""] * 9)
                continue
            notes = []
            if "subclass_ops_per_step" in r:
                notes.append(f"{r['subclass_ops_per_step'].get('total')} subclass aten ops/step")
            if "comm_counts_per_step" in r:
                notes.append("comms " + ", ".join(f"{a} x{b}" for a, b in r["comm_counts_per_step"].items()))
            if "grad_check_error" in r:
                notes.append("grad check: " + r["grad_check_error"][:80])
            rows.append([cfg, k, _f(r.get("median_ms"), "{:.2f}"), _f(r.get("ratio"), "{:.2f}"),
                         _f(r.get("cpu_median_ms"), "{:.2f}"), _f(r.get("cpu_ratio"), "{:.2f}"),
                         _f(r.get("wall_ratio_vs_ref"), "{:.2f}"), _f(r.get("cpu_ratio_vs_ref"), "{:.2f}"),
                         _f(r.get("first_step_ms"), "{:.1f}"), _f(r.get("first_loss_abs_err"), "{:.1e}"),
                         _f(r.get("grad_max_abs_err"), "{:.1e}"), "; ".join(notes)])
        for k, r in row.get("compile", {}).items():
            gb = f"graphs={r.get('graph_count')} breaks={r.get('graph_break_count')}"
            if r.get("explain_error"):
                gb = "explain failed: " + r["explain_error"][:100]
            if not r.get("compiles"):
                rows.append([cfg, k + " (compile)", "does NOT compile: " + r.get("error", "")[:200]]
                            + [""] * 8 + [gb])
                continue
            rows.append([cfg, k + " (compile)", _f(r.get("median_ms"), "{:.2f}"), _f(r.get("ratio"), "{:.2f}"),
                         _f(r.get("cpu_median_ms"), "{:.2f}"), _f(r.get("cpu_ratio"), "{:.2f}"),
                         _f(r.get("wall_ratio_vs_ref"), "{:.2f}"), _f(r.get("cpu_ratio_vs_ref"), "{:.2f}"),
                         _f(r.get("first_step_incl_compile_s"), "{:.1f}") + " s incl. compile",
                         _f(abs(r["first_loss"] - row["ref_loss"])
                            if r.get("first_loss") is not None and k != "local_equiv" else None, "{:.1e}"),
                         "", gb])
    return hdr, rows


def _text_table(hdr, rows):
    """Aligned plain-text table; an ERR cell swallows the empty cells that follow it."""
    widths = [len(h) for h in hdr]
    for r in rows:
        for i, c in enumerate(r):
            if not str(c).startswith("ERR ") and not str(c).startswith("does NOT"):
                widths[i] = max(widths[i], len(str(c)))
    lines = ["  ".join(h.rjust(widths[i]) for i, h in enumerate(hdr))]
    for r in rows:
        r = [" ".join(str(c).split()) if str(c).startswith(("ERR ", "does NOT")) else c for c in r]
        out, i = [], 0
        while i < len(r):
            c = str(r[i])
            if c.startswith("ERR ") or c.startswith("does NOT"):
                out.append(c)
                i += 1
                while i < len(r) and r[i] == "":
                    i += 1
                continue
            out.append(c.rjust(widths[i]))
            i += 1
        lines.append("  ".join(out))
    return "\n".join(lines)


def _md_table(hdr, rows):
    L = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    for r in rows:
        L.append("| " + " | ".join(" ".join(str(c).split()).replace("|", "/") for c in r) + " |")
    return "\n".join(L)


OPS_LEGEND = ("Per-op eager dispatch, rank 0, per-rank shards 64x64 (small) or 512x512 (medium). Times = median us per call of THREAD CPU "
              "time; local = the same torch op on the local shards; pywrap / pytree = a do-nothing Python "
              "__torch_dispatch__ wrapper (flat / torch.utils._pytree): the floor for any Python subclass; "
              "x local, x pywrap, x <ref> = medians of per-repetition ratios measured interleaved in one run; "
              "miss = one call after clearing the implementation's caches (the heap frozen, young garbage "
              "collected first: the planner's own cost); cold miss = the same after a full gc.collect(), which "
              "evicts the CPU caches; 1st = first call in the process; "
              "ok = local shard equals the op on local shards AND full_tensor() equals the op on global tensors.")
REDIST_LEGEND = ("Redistribute on a 1-D mesh of 2 (gloo), rank 0. ms = median wall per call; x raw = per-rep "
                 "ratio vs the raw collective on the same bytes (uneven ' u' rows: rows padded to a multiple of "
                 "2); +ms wall = impl - raw; +ms main-thr CPU = main-thread CPU beyond the raw collective's "
                 "(framework work: Python, planning, packing copies); ok = full_tensor() equals the source.")
TRAIN_LEGEND = ("TP MLP training step (fc1 colwise, fc2 rowwise; fwd + bwd + SGD), rank 0, eager. x local = "
                "per-rep ratio vs the unsharded model with the same per-rank shapes; CPU = process CPU; "
                "loss err / grad err = |first loss - full model loss| / max |full_tensor(grad) - full model grad|.")


def print_tables(data):
    r0 = data["ranks"][0]
    r1 = data["ranks"][1] if len(data["ranks"]) > 1 else None
    impls = data["meta"]["impls"]
    m = data["meta"]
    out = [f"\n{m.get('date')}  torch {m.get('torch')}  python {m.get('python')}  {m.get('cpu_count')} CPUs  "
           f"world {m.get('world_size')} ({m.get('backend')})  loadavg {m.get('loadavg_start')} -> "
           f"{m.get('loadavg_end')}  wall {m.get('wall_s')} s  git {m.get('git', '?')}"]
    for v in m.get("versions", []):
        out.append("  " + v)
    if "ops" in r0:
        out.append("\n== 1. " + OPS_LEGEND + " ==")
        out.append(_text_table(*_ops_rows(data)))
        if r1 and "ops" in r1:
            out.append("  rank-1 x local (CPU): " + ", ".join(
                f"{row['op']}=" + "/".join(_f(row['impls'].get(n, {}).get('cpu_ratio'), '{:.1f}') for n in impls)
                for row in r1["ops"] if "local" in row))
    if "redistribute" in r0:
        out.append("\n== 2. " + REDIST_LEGEND + " ==")
        out.append("   backend support: " + json.dumps(r0.get("collective_support")))
        out.append(_text_table(*_redist_rows(data)))
    if "train" in r0:
        out.append("\n== 3. " + TRAIN_LEGEND + " ==")
        out.append(_text_table(*_train_rows(data)))
    if "profile" in r0:
        out.append(f"\n== cProfile (rank 0, timer = {r0['profile'].get('timer', 'wall')}), top 10 by tottime "
                   "(self time), us per iteration; cProfile inflates Python-level time; C++ work shows up inside "
                   "the builtin that called it ==")
        for k, p in r0["profile"].items():
            if k == "timer":
                continue
            if "error" in p:
                out.append(f"  {k}: ERR {p['error']}")
                continue
            out.append(f"  {k}: {p['total_us_per_iter_under_cprofile']:.1f} us/iter under cProfile "
                       f"({p['iters']} iters)")
            for r in p["top10_tottime"]:
                out.append(f"    {r['tottime_us_per_iter']:8.2f} us  {r['ncalls_per_iter']:6.1f}x  {r['func']}")
            out.append("    top cumulative:")
            for r in p["top25_cumtime"][:12]:
                out.append(f"    {r['cumtime_us_per_iter']:8.2f} us  {r['ncalls_per_iter']:6.1f}x  {r['func']}")
    print("\n".join(out), flush=True)


def markdown_tables(data, rank=0):
    """GitHub-markdown version of the headline tables (for READMEs)."""
    r0 = data["ranks"][rank]
    L = []
    if "ops" in r0:
        L += [OPS_LEGEND, "", _md_table(*_ops_rows(data, rank)), ""]
    if "redistribute" in r0:
        L += [REDIST_LEGEND, "", _md_table(*_redist_rows(data, rank)), ""]
    if "train" in r0:
        L += [TRAIN_LEGEND, "", _md_table(*_train_rows(data, rank)), ""]
    return "\n".join(L)


def write_png(data: dict, path: str) -> None:
    """Bar charts of the dtshard / torch ratios (cached per-op CPU time, redistribute main-thread
    CPU beyond the raw collective): below 1 means dtshard is cheaper. Needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit(f"--png needs matplotlib (pip install 'dtshard[plot]'): {e}")
    r0 = data["ranks"][0]
    names = r0["impl_names"]
    if "torch" not in names or len(names) < 2:
        raise SystemExit("--png compares an implementation with 'torch': run with --impl torch,dtshard")
    other = [n for n in names if n != "torch"][0]

    def ratio(entry, key):
        a, b = entry["impls"].get(other, {}), entry["impls"].get("torch", {})
        if isinstance(a, dict) and isinstance(b, dict) and a.get(key) and b.get(key):
            return a[key] / b[key]
        return None

    panels = []
    ops = [(e["op"], ratio(e, "cpu_median_us")) for e in r0.get("ops", [])]
    panels.append(("cached op CPU time", [(n, v) for n, v in ops if v is not None]))
    red = []
    for e in r0.get("redistribute", []):
        v = ratio(e, "main_thread_cpu_ovh_ms")
        if v is not None:
            red.append((f"{e['transition']}{' u' if e.get('uneven') else ''} {e['MiB']:g}MiB", v))
    panels.append(("redistribute CPU beyond the raw collective", red))
    panels = [p for p in panels if p[1]]
    fig, axes = plt.subplots(len(panels), 1, figsize=(10, 3.2 * len(panels)), squeeze=False)
    for ax, (title, rows) in zip(axes[:, 0], panels):
        labels, values = zip(*rows)
        colors = ["tab:green" if v <= 1 else "tab:red" for v in values]
        ax.bar(range(len(values)), values, color=colors)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(values)))
        ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
        ax.set_ylabel(f"{other} / torch")
        ax.set_title(f"{title} ({other} / torch.distributed.tensor, lower is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    print(f"wrote {path}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--impl", default="torch,dtshard",
                    help="comma list: torch, dtshard (benchmarks/adapter_dtshard.py), a module name, or an "
                         "adapter .py path; the first one is the reference of the 'x torch' columns")
    ap.add_argument("--sections", default="ops,redist,train",
                    help="comma list of ops, redist, train, profile")
    ap.add_argument("--ops", default="", help=f"comma list of op names (default {DEFAULT_OPS}; "
                                               f"'all' adds {EXTRA_OPS})")
    ap.add_argument("--shapes", default="small", help="comma list of small (64x64 shards), medium (512x512)")
    ap.add_argument("--transitions", default="",
                    help="comma list, e.g. S0-R,P-S1 (also S0:R; quote '->' in a shell)")
    ap.add_argument("--uneven", default="both", choices=("both", "none", "only"),
                    help="redistribute: even shapes, uneven shapes (both dims odd), or both")
    ap.add_argument("--redist-sizes", default="0.0625,1,16", help="global tensor sizes in MiB")
    ap.add_argument("--reps", type=int, default=41, help="per-op repetitions (small shapes)")
    ap.add_argument("--miss-reps", type=int, default=21)
    ap.add_argument("--bind-cores", action="store_true",
                    help="bind each rank to its own core(s) (Linux), as a launcher would with taskset/numactl: "
                         "an unbound gloo rank can wait milliseconds for the scheduler after compute")
    ap.add_argument("--op-budget-s", type=float, default=4.0, help="max seconds per op timing")
    ap.add_argument("--redist-reps", type=int, default=21)
    ap.add_argument("--train-reps", type=int, default=21)
    ap.add_argument("--train-configs", default="mlp-small", help="comma list of mlp-small, mlp-1024")
    ap.add_argument("--compile", action="store_true",
                    help="train: also torch.compile each variant (failures are reported, not fatal)")
    ap.add_argument("--warm-inductor-cache", action="store_true",
                    help="use the default (shared, possibly warm) inductor cache dir")
    ap.add_argument("--profile-ops", default="add,linear,view")
    ap.add_argument("--profile-iters", type=int, default=2000)
    ap.add_argument("--profile-timer", default="wall", choices=("wall", "cpu"),
                    help="cProfile clock: wall (cProfile's default) or thread CPU time (for a loaded machine)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    ap.add_argument("--quick", action="store_true", help="fewer reps / sizes (smoke test)")
    ap.add_argument("--spin", default="", help="(for py-spy) run this op on rank 0 in a loop and exit")
    ap.add_argument("--spin-seconds", type=float, default=15.0)
    ap.add_argument("--json", default="", help="result file (default benchmarks/results/bench_<impls>.json)")
    ap.add_argument("--pg-timeout-s", type=int, default=300)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--from-json", default="", help="only print the tables of a saved result file")
    ap.add_argument("--markdown", action="store_true", help="with --from-json: emit markdown tables")
    ap.add_argument("--png", default="", help="also draw the dtshard/torch ratios as a PNG chart here")
    args = ap.parse_args()
    if args.from_json:
        with open(args.from_json) as f:
            data = json.load(f)
        print(markdown_tables(data) if args.markdown else "", end="")
        if not args.markdown:
            print_tables(data)
        if args.png:
            write_png(data, args.png)
        return
    if args.quick:
        args.reps, args.miss_reps, args.redist_reps, args.train_reps = 11, 7, 7, 7
        args.redist_sizes = "0.0625,1"
        args.profile_iters = 300
        args.op_budget_s = 1.0
    impls = args.impl.split(",")
    if not args.json:
        os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
        tag = "_".join(os.path.basename(i).replace(".py", "").replace("adapter_", "") for i in impls)
        args.json = os.path.join(HERE, "results", f"bench_{tag}.json")
        if args.quick or args.spin:
            args.json = args.json.replace(".json", "_quick.json")
        elif args.sections != "ops,redist,train":
            args.json = args.json.replace(".json", "_" + args.sections.replace(",", "_") + ".json")

    scratch_cache = None
    if "train" in args.sections and args.compile and not args.warm_inductor_cache:
        # private, empty inductor cache: compile times are cold-graph times, not cache hits
        import shutil
        import tempfile
        scratch_cache = tempfile.mkdtemp(prefix="bench_dtensor_inductor_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = scratch_cache
    load_start = os.getloadavg()
    git_at_start = _git_state()   # the tree the workers import (others may edit it meanwhile)
    port = _free_port()
    import tempfile
    fd, result_path = tempfile.mkstemp(prefix="bench_dtensor_", suffix=".json")
    os.close(fd)
    t0 = time.time()
    try:
        mp.spawn(worker, args=(args, port, result_path), nprocs=WORLD_SIZE, join=True)
        if args.spin:
            return
        with open(result_path) as f:
            gathered = json.load(f)
    finally:
        os.unlink(result_path)
        if scratch_cache:
            shutil.rmtree(scratch_cache, ignore_errors=True)
    if not gathered:
        sys.exit("benchmark failed")
    data = {
        "meta": {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "cpu_count": os.cpu_count(),
            "world_size": WORLD_SIZE, "backend": "gloo", "threads_per_rank": args.threads,
            "impls": gathered[0]["impl_names"],
            "versions": gathered[0].get("impl_versions", []),
            "args": {k: v for k, v in vars(args).items()},
            "wall_s": None,
            "loadavg_start": load_start, "loadavg_end": os.getloadavg(),
            "notes": ("times are per-rank medians over interleaved repetitions; ratios are medians of "
                      "per-repetition ratios measured in the same run; GB/s = global tensor bytes / time"),
        },
        "ranks": gathered,
    }
    data["meta"]["wall_s"] = round(time.time() - t0, 1)
    data["meta"]["git"] = git_at_start
    print_tables(data)
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(f"\nwrote {args.json}  (wall {data['meta']['wall_s']} s)")
    if args.png:
        write_png(data, args.png)


if __name__ == "__main__":
    main()
