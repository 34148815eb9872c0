#!/usr/bin/env python
"""dtshard vs torch.distributed.tensor at scale: ONE rank of a world of W simulated with PyTorch's
fake process group (issue #53, item 5).

    python benchmarks/bench_scale.py --ws 8,64 --timeout 60                 # both libraries
    python benchmarks/bench_scale.py --ws 512 --timeout 20 --no-model
    python benchmarks/bench_scale.py --ws 8,64,512,4096,32768 --json benchmarks/results/scale.json
    python benchmarks/bench_scale.py --lib dtshard --ws 4096 --transitions S0S1-RR,PP-RR
    python benchmarks/bench_scale.py --from-json benchmarks/results/scale.json   # the tables again

How: ``dist.init_process_group("fake", store=FakeStore(), rank=RANK, world_size=W)``.  Collectives
return tensors of the right shapes whose values mean nothing, so only what the calling rank does
counts: planning, bookkeeping, process groups, memory.  Network time and the real cost of the
collectives are NOT in these numbers (see benchmarks/README.md).

Meshes: 2-D ``a x b`` with ``a * b = W`` and ``a`` the largest power of two <= sqrt(W)
(8 = 2x4, 64 = 8x8, 512 = 16x32, 4096 = 64x64, 32768 = 128x256) and, for W >= 512, 3-D
``W/64 x 8 x 8``.  Shapes: ``even`` 1024x1024 and ``uneven`` 1000x1001 float32 (global).

Cells: every (library, W, mesh, shape, transition) runs in its OWN process, forked from a parent
that has imported torch, torch.distributed.tensor, FSDP2, TP and dtshard (so no cell pays for the
imports, and one cell's caches and groups never help another).  The parent kills a cell that runs
longer than ``--timeout`` seconds ("timeout") or whose resident memory passes ``--mem-limit`` MiB
("oom"); a cell that raises reports its error ("ERR ...").  Cells run one at a time, the two
libraries' cells of one transition back to back (order alternating), so both see the same load.

Per transition cell (times are process CPU time, ``time.process_time``, of the one forked process):
  first  the very first redistribute of the process (planner caches empty, code paths cold);
  miss   the median of up to 2 more calls, each right after clearing every planner cache of the
         library (dtshard: its dispatch cache, plan cache and the layout / planning module caches;
         torch: sharding-propagation caches, the redistribute planner cache,
         ``_gen_transform_infos``); when the first call already took more than a tenth of the
         time limit, no more are made and ``miss`` = ``first`` (marked ``*`` in the table);
  hit    the median of ``--reps`` repeated calls with the caches warm;
  PGs    process groups the cell created (``len(_world.pg_map)`` minus the default group):
         ``mesh + redistribute`` (dtshard creates flattened groups on demand);
  RSS    the peak growth of resident memory (``VmHWM`` reset through ``/proc/self/clear_refs``)
         over the redistribute calls (first, misses, hits), MiB;
  a2a    how many times the fake-PG all_to_all workaround fired (below).

Model cell (``--model``): a small Llama (``dtshard.models.Transformer``: dim 256, 2 layers, 8 heads,
8 kv heads, SwiGLU hidden 512, vocab 1024, 64 tokens) on a ``(W/8, 8)`` mesh ("dp", "tp"): the
tensor-parallel plan of ``dtshard.models.tp_plan`` (attention and MLP colwise / rowwise, the norms
sequence-parallel, the vocab-sharded embedding and LM head), then ``fully_shard`` of each block and
of the root on ``mesh["dp"]``, all built on the meta device; then ``to_empty(device="cpu")``, then
``init_weights`` (``torch.manual_seed(0)``; ``normal_(std=0.02)`` of every matrix, ``ones_`` of the
norms, on the DTensor parameters themselves: each library's own sharding-invariant random numbers
where it has them), then two forward + backward passes on 2 sequences of 64 tokens (loss
``logits.float().square().mean()``, so that no library-specific vocab-parallel loss is needed).
PyTorch: ``torch.distributed.tensor.parallel`` + ``torch.distributed.fsdp.fully_shard``; dtshard:
``dtshard.parallel`` + ``dtshard.fsdp.fully_shard``.

The fake process group's all_to_all: torch 2.13's C++ ``FakeProcessGroup::alltoall_base`` raises
``alltoall_base: inputBuffer is empty but outputSplitSizes[0] > 0`` when this rank sends nothing
but receives something (legal on every real backend; it happens in uneven re-shardings where some
ranks hold empty shards).  Both libraries get the same workaround, installed in every cell: the
two Python entry points of an all_to_all, ``ProcessGroup.alltoall_base`` (``dist.all_to_all_single``
and dtshard's eager path) and ``torch.ops._c10d_functional.all_to_all_single`` (functional
collectives: dtshard's traced path, torch's funcol), are wrapped; when the input is empty and the
output splits are not all zero, the fake group is called with all-zero splits (so a fake
collective is still issued and waited on) and an output of the right shape is returned.  Each use
is counted (column ``a2a``).  Calls made from C++ (compiled graphs) are not covered; none happen here.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import logging
import math
import os
import platform
import select
import signal
import statistics
import subprocess
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkout import import_this_checkout  # noqa: E402

warnings.filterwarnings("ignore")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

# ---------------------------------------------------------------------------------------------
# what is measured
# ---------------------------------------------------------------------------------------------
SHAPES = {"even": (1024, 1024), "uneven": (1000, 1001)}

# name -> (mesh kind, src, dst); placements: S<d> Shard(d), R Replicate, P Partial (sum)
TRANSITIONS = {
    "S0S1-RR": ("2d", "S0,S1", "R,R"),
    "S0R-RR": ("2d", "S0,R", "R,R"),
    "PP-RR": ("2d", "P,P", "R,R"),
    "S0S1-S1S0": ("2d", "S0,S1", "S1,S0"),
    "PR-S0S0": ("2d", "P,R", "S0,S0"),
    "RP-S0S1": ("2d", "R,P", "S0,S1"),
    "S0S0-RR": ("2d", "S0,S0", "R,R"),
    "PS0-S0R": ("2d", "P,S0", "S0,R"),
    "S0S1-S0R": ("2d", "S0,S1", "S0,R"),
    "PP-S0S1": ("2d", "P,P", "S0,S1"),
    "RR-S0S1": ("2d", "R,R", "S0,S1"),
    "S0S1R-S0RS1": ("3d", "S0,S1,R", "S0,R,S1"),
    "S0S1S1-RRR": ("3d", "S0,S1,S1", "R,R,R"),
    "PPP-RRR": ("3d", "P,P,P", "R,R,R"),
    "S0S1S1-S1S0S0": ("3d", "S0,S1,S1", "S1,S0,S0"),
    "RPS0-S0S1R": ("3d", "R,P,S0", "S0,S1,R"),
    "S0RR-RRS0": ("3d", "S0,R,R", "R,R,S0"),
    "PRR-S0S0S0": ("3d", "P,R,R", "S0,S0,S0"),
}


def mesh_shape(w: int, kind: str) -> tuple[int, ...] | None:
    if kind == "2d":
        a = 1 << (int(math.log2(w)) // 2)  # the largest power of two <= sqrt(W)
        while w % a:
            a -= 1
        return (a, w // a)
    if kind == "3d":
        return (w // 64, 8, 8) if w >= 512 and w % 64 == 0 else None
    raise ValueError(kind)


def fmt_mesh(shape) -> str:
    return "x".join(map(str, shape))


# ---------------------------------------------------------------------------------------------
# in a cell (a forked process)
# ---------------------------------------------------------------------------------------------
def _rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


A2A_FIXES = [0]
_PROGRESS_FD = [None]


def progress(**info) -> None:
    """Tell the parent how far the cell got (kept if the cell is then killed)."""
    if _PROGRESS_FD[0] is not None:
        os.write(_PROGRESS_FD[0], (json.dumps({"progress": info}, default=str) + "\n").encode())


def install_a2a_workaround() -> None:
    """See the module docstring: an all_to_all whose input is empty but whose output is not is
    sent to the fake group with all-zero splits, and a right-shaped output returned; counted."""
    PG = dist.ProcessGroup
    orig_base = PG.alltoall_base

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, *args, **kwargs):
        if input.numel() == 0 and output.numel() != 0:
            A2A_FIXES[0] += 1
            n = len(output_split_sizes) or len(input_split_sizes) or self.size()
            return orig_base(self, output.narrow(0, 0, 0), input, [0] * n, [0] * n, *args, **kwargs)
        return orig_base(self, output, input, output_split_sizes, input_split_sizes, *args, **kwargs)

    PG.alltoall_base = alltoall_base

    ns = torch.ops._c10d_functional
    orig_fc = ns.all_to_all_single

    def all_to_all_single(input, output_split_sizes, input_split_sizes, group_name):
        if input.numel() == 0 and sum(output_split_sizes) != 0:
            A2A_FIXES[0] += 1
            n = len(output_split_sizes)
            ns.wait_tensor(orig_fc(input, [0] * n, [0] * n, group_name))
            return input.new_empty((sum(output_split_sizes),) + tuple(input.shape[1:]))
        return orig_fc(input, output_split_sizes, input_split_sizes, group_name)

    ns.all_to_all_single = all_to_all_single


def _lib_api(lib: str):
    """(init_device_mesh, Shard, Replicate, Partial, distribute_tensor, from_local, clear_caches)."""
    if lib == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

        def distribute(full, mesh, pls):
            return distribute_tensor(full, mesh, pls, src_data_rank=None)

        def from_local(local, mesh, pls, shape, stride):
            return DTensor.from_local(local, mesh, pls, run_check=False, shape=shape, stride=stride)

        return init_device_mesh, Shard, Replicate, Partial, distribute, from_local, clear_torch_caches
    from dtshard import DTensor, Partial, Replicate, Shard, distribute_tensor, init_device_mesh

    def distribute(full, mesh, pls):
        return distribute_tensor(full, mesh, pls, src_data_rank=None)

    def from_local(local, mesh, pls, shape, stride):
        return DTensor.from_local(local, mesh, pls, run_check=False, shape=shape, stride=stride)

    return init_device_mesh, Shard, Replicate, Partial, distribute, from_local, clear_dtshard_caches


def _clear_module_caches(mod) -> None:
    """Every module-level ``*_cache`` dict and every functools cache of ``mod``."""
    for name, v in list(vars(mod).items()):
        if isinstance(v, dict) and name.endswith("_cache"):
            v.clear()
        elif callable(getattr(v, "cache_clear", None)) and getattr(v, "__module__", None) == mod.__name__:
            v.cache_clear()


def clear_dtshard_caches() -> None:
    import importlib

    import dtshard.dispatch
    import dtshard.redistribute

    dtshard.dispatch.clear_cache()
    dtshard.redistribute.clear_plan_cache()
    # the planner's helpers (the modules another engineer is rewriting: names may change)
    for name in ("dtshard.layout", "dtshard.spec", "dtshard.redistribute.planning",
                 "dtshard.redistribute.running", "dtshard.redistribute.pipelining"):
        try:
            _clear_module_caches(importlib.import_module(name))
        except ImportError:
            pass


def clear_torch_caches() -> None:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor import _redistribute as r
    from torch.distributed.tensor import debug as dtdebug

    dtdebug._clear_sharding_prop_cache()
    sp = DTensor._op_dispatcher.sharding_propagator
    try:
        type(sp)._propagate_tensor_meta_cached.cache_clear()
    except Exception:
        pass
    r.clear_redistribute_planner_cache()
    r._gen_transform_infos.cache_clear()
    for name in ("torch.distributed.tensor._utils", "torch.distributed.tensor._collective_utils"):
        try:
            import importlib

            _clear_module_caches(importlib.import_module(name))
        except ImportError:
            pass


def _placements(text: str, Shard, Replicate, Partial):
    out = []
    for p in text.split(","):
        out.append(Replicate() if p == "R" else Partial() if p == "P" else Shard(int(p[1:])))
    return out


def _n_pgs() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _init_fake(w: int, rank: int) -> None:
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers "fake")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=w)


def cell_transition(lib: str, w: int, mesh_kind: str, shape_name: str, tname: str, rank: int,
                    reps: int, budget_s: float) -> dict:
    _, src_s, dst_s = TRANSITIONS[tname]
    shape = SHAPES[shape_name]
    ms = mesh_shape(w, mesh_kind)
    t_start = time.monotonic()
    init_mesh, Shard, Replicate, Partial, distribute, from_local, clear = _lib_api(lib)
    install_a2a_workaround()
    _init_fake(w, rank)
    pg0 = _n_pgs()
    c0 = time.process_time()
    mesh = init_mesh("cpu", ms)
    mesh_s = time.process_time() - c0
    pg_mesh = _n_pgs() - pg0
    progress(stage="mesh created", mesh_create_s=mesh_s, pgs_mesh=pg_mesh)
    src = _placements(src_s, Shard, Replicate, Partial)
    dst = _placements(dst_s, Shard, Replicate, Partial)
    full = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    base = distribute(full, mesh, [Replicate() if isinstance(p, Partial) else p for p in src])
    dt = from_local(base.to_local(), mesh, src, full.shape, full.stride())
    del base, full
    clear()
    gc.collect()
    rss0 = _rss_kib()
    hwm_ok = _reset_hwm()
    a2a0 = A2A_FIXES[0]

    c0 = time.process_time()
    out = dt.redistribute(mesh, dst)
    first = time.process_time() - c0
    a2a_first = A2A_FIXES[0] - a2a0
    local_shape = tuple(out.to_local().shape)
    progress(stage="first call done", first_s=first)
    del out
    misses = []
    while len(misses) < 2 and first < budget_s / 10 and time.monotonic() - t_start < budget_s / 3:
        clear()
        c0 = time.process_time()
        dt.redistribute(mesh, dst)
        misses.append(time.process_time() - c0)
    hits = []
    t_hits = time.monotonic()
    for _ in range(reps):
        c0 = time.process_time()
        dt.redistribute(mesh, dst)
        hits.append(time.process_time() - c0)
        if time.monotonic() - t_hits > budget_s / 4:
            break
    peak = _rss_kib("VmHWM") if hwm_ok else _rss_kib()
    rss_after = max(0, _rss_kib() - rss0) / 1024
    cache_kib = _cache_kib(lambda: dt.redistribute(mesh, dst), clear)
    res = {
        "first_s": first,
        "miss_s": statistics.median(misses) if misses else first,
        "miss_is_first": not misses,
        "misses_s": misses,
        "hit_s": statistics.median(hits),
        "hits_n": len(hits),
        "mesh_create_s": mesh_s,
        "pgs_mesh": pg_mesh,
        "pgs_redist": _n_pgs() - pg0 - pg_mesh,
        "rss_peak_mib": max(0, peak - rss0) / 1024,
        "rss_after_mib": rss_after,
        "cache_kib": cache_kib,
        "a2a_fixes": A2A_FIXES[0],
        "a2a_fixes_first": a2a_first,
        "calls": 1 + len(misses) + len(hits),
        "local_shape": local_shape,
    }
    return res


def _cache_kib(call, clear) -> float:
    """What the library's caches keep of one transition: after clearing every planner cache, one
    miss and two hits with the result dropped, the Python heap retained (tracemalloc: plans,
    specs) plus the storage of every tensor that is alive now and was not before (index tables).
    RSS also counts the allocator's retention of freed tensor buffers (glibc keeps a freed 4 MiB
    block in its heap for the next one), which this leaves out.  Measured after the timed calls
    (tracemalloc slows every allocation)."""
    import tracemalloc

    def tensors():
        return {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor)}

    clear()
    gc.collect()
    before = set(tensors())
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(3):
            out = call()
            del out
        gc.collect()
        heap = max(0, tracemalloc.get_traced_memory()[0] - base)
    finally:
        tracemalloc.stop()
    storages = {}
    for k, t in tensors().items():
        if k not in before and t.device.type != "meta":
            st = t.untyped_storage()
            storages[st.data_ptr()] = st.nbytes()
    return (heap + sum(storages.values())) / 1024


def cell_model(lib: str, w: int, rank: int, budget_s: float) -> dict:
    from dtshard.models import LlamaConfig, Transformer, parallelize, rope_tables

    if lib == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        import torch.distributed.tensor.parallel as tp_mod
    else:
        from dtshard import init_device_mesh
        from dtshard.fsdp import fully_shard
        import dtshard.parallel as tp_mod

    class MetaLlama(Transformer):
        def _init_weights(self) -> None:  # built on meta: the weights are set by init_weights
            pass

        @torch.no_grad()
        def init_weights(self) -> None:
            for name, p in self.named_parameters():
                if p.dim() >= 2:
                    torch.nn.init.normal_(p, mean=0.0, std=0.02)
                else:
                    torch.nn.init.ones_(p)
            cos, sin = rope_tables(self.cfg.head_dim, self.cfg.max_seq_len, self.cfg.rope_theta)
            self.rope_cos.copy_(cos)
            self.rope_sin.copy_(sin)

    install_a2a_workaround()
    _init_fake(w, rank)
    torch.manual_seed(0)
    pg0 = _n_pgs()
    rss0 = _rss_kib()
    phases = {}

    def timed(name, fn):
        c0 = time.process_time()
        r = fn()
        phases[name] = time.process_time() - c0
        progress(stage=name, **phases)
        return r

    mesh = timed("mesh_s", lambda: init_device_mesh("cpu", (w // 8, 8), mesh_dim_names=("dp", "tp")))
    cfg = LlamaConfig(dim=256, n_layers=2, n_heads=8, n_kv_heads=8, vocab_size=1024, ffn_hidden=512,
                      max_seq_len=64)

    def build():
        with torch.device("meta"):
            return MetaLlama(cfg)

    model = timed("build_meta_s", build)

    def par():
        m = parallelize(model, mesh["tp"], tp_mod, local_output=True)
        for b in m.layers:
            fully_shard(b, mesh=mesh["dp"])
        fully_shard(m, mesh=mesh["dp"])
        return m

    model = timed("parallelize_s", par)
    timed("to_empty_s", lambda: model.to_empty(device="cpu"))
    timed("init_s", model.init_weights)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.max_seq_len), generator=torch.Generator().manual_seed(1))

    def step():
        out = model(tokens)
        loss = out.float().square().mean()
        loss.backward()
        return loss

    timed("step1_s", step)
    timed("step2_s", step)
    return dict(phases, pgs=_n_pgs() - pg0, rss_mib=max(0, _rss_kib("VmHWM") - rss0) / 1024,
                a2a_fixes=A2A_FIXES[0])


# ---------------------------------------------------------------------------------------------
# the parent: one forked process per cell, with a time and a memory limit
# ---------------------------------------------------------------------------------------------
def _child_rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def run_cell(fn, args: tuple, timeout: float, mem_limit_mib: float) -> dict:
    rfd, wfd = os.pipe()
    t0 = time.monotonic()
    pid = os.fork()
    if pid == 0:  # the cell
        os.close(rfd)
        _PROGRESS_FD[0] = wfd
        code = 0
        try:
            torch.set_num_threads(1)
            for name in ("torch", "torch.distributed", "torch.distributed.tensor", "torch._logging"):
                logging.getLogger(name).setLevel(logging.ERROR)  # torch's advice on 2-step all_reduces etc.
            res = fn(*args)
        except BaseException as e:  # noqa: BLE001
            res = {"status": "error", "error": f"{type(e).__name__}: {e}"[:400],
                   "traceback": traceback.format_exc()[-2000:]}
            code = 1
        try:
            data = (json.dumps(res, default=str) + "\n").encode()
            with os.fdopen(wfd, "wb") as f:
                f.write(data)
        finally:
            os._exit(code)
    os.close(wfd)
    chunks: list[bytes] = []
    status, peak = None, 0.0
    with os.fdopen(rfd, "rb", buffering=0) as f:
        while True:
            ready, _, _ = select.select([f], [], [], 0.05)
            if ready:
                b = f.read(1 << 16)
                if not b:
                    break
                chunks.append(b)
                continue
            rss = _child_rss_mib(pid)
            peak = max(peak, rss)
            if time.monotonic() - t0 > timeout:
                status = "timeout"
            elif rss > mem_limit_mib:
                status = "oom"
            if status:
                os.kill(pid, signal.SIGKILL)
                break
    _, wstatus = os.waitpid(pid, 0)
    wall = time.monotonic() - t0
    res, prog = None, {}
    for line in b"".join(chunks).decode(errors="replace").splitlines():
        try:
            msg = json.loads(line)
        except ValueError:
            continue
        if "progress" in msg:
            prog = msg["progress"]
        else:
            res = msg
    if status:
        return {"status": status, "wall_s": wall, "limit_s": timeout, "child_rss_peak_mib": peak, "progress": prog}
    if res is None:
        return {"status": "error", "error": f"cell died (wait status {wstatus})", "wall_s": wall, "progress": prog}
    res.setdefault("status", "ok")
    res["wall_s"] = wall
    return res


DTSHARD_ROOT = [None]


def import_dtshard():
    """This checkout's dtshard, or the one under ``--dtshard-root`` (e.g. an export of an older
    commit: ``git archive acf9d5f dtshard dtshard_kernels | tar -x -C /tmp/base``; from a commit after
    #56 moved the kernels: ``git archive <commit> dtshard kernels``)."""
    root = DTSHARD_ROOT[0]
    if root is None:
        return import_this_checkout()
    for path in (os.path.join(os.path.abspath(root), "kernels"), os.path.abspath(root)):
        sys.path.insert(0, path)  # an export from before #56 has dtshard_kernels/ at its top level
    import dtshard

    where = os.path.dirname(os.path.dirname(os.path.abspath(dtshard.__file__)))
    if where != os.path.abspath(root):
        raise SystemExit(f"--dtshard-root {root}: imported dtshard from {where} instead")
    return dtshard


def _git_state(root: str) -> str:
    """'commit abc1234' (+ a digest of uncommitted changes under dtshard/), or '?'."""
    import hashlib

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                                text=True, check=True).stdout.strip()
        diff = subprocess.run(["git", "diff", "HEAD", "--", "dtshard", "kernels"], cwd=root,
                              capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "no git"
    if diff:
        return f"commit {commit} + uncommitted dtshard/ changes (diff sha1 {hashlib.sha1(diff).hexdigest()[:8]})"
    return f"commit {commit} (clean dtshard/)"


def warm_imports() -> None:
    """What every cell would otherwise import itself (the cells are forked from this process)."""
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torch.distributed.tensor.debug  # noqa: F401
    import torch.distributed.tensor.parallel  # noqa: F401
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    import_dtshard()
    import dtshard.fsdp  # noqa: F401
    import dtshard.models  # noqa: F401
    import dtshard.parallel  # noqa: F401
    import dtshard.redistribute  # noqa: F401


# ---------------------------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------------------------
def _t(r: dict | None, key: str) -> str:
    if r is None:
        return "-"
    if r.get("status") != "ok":
        if r.get("status") == "timeout" and key == "miss_s" and "limit_s" in r:
            return f"timeout (> {r['limit_s']:g} s)"
        return "ERR" if r.get("status") == "error" else r.get("status", "?")
    v = r[key]
    s = f"{v * 1e3:.2f}" if v < 10 else f"{v * 1e3:.0f}"
    return s + ("*" if key == "miss_s" and r.get("miss_is_first") else "")


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or a.get("status") != "ok" or b.get("status") != "ok" or a[key] <= 0:
        return "-"
    return f"{b[key] / a[key]:.2f}"


def _pair(a, b, fn) -> str:
    def one(r):
        if r is None:
            return "-"
        if fn is _pgs and _pgs_any(r):
            return _pgs_any(r)
        if r.get("status") != "ok":
            return "ERR" if r.get("status") == "error" else r.get("status", "?")
        return fn(r)

    return f"{one(a)} / {one(b)}"


def _pgs(r):
    return f"{r['pgs_mesh']}+{r['pgs_redist']}"


def _pgs_any(r):
    """PGs of a cell that did not finish: the mesh's, when it got that far."""
    if r and r.get("status") not in (None, "ok") and "pgs_mesh" in r.get("progress", {}):
        return f"{r['progress']['pgs_mesh']}+?"
    return None


def _rss(r):
    return f"{r['rss_peak_mib']:.1f}"


def _cache(r):
    return f"{r['cache_kib']:.0f}" if "cache_kib" in r else "-"


def _a2a(r):
    return str(r.get("a2a_fixes_first", r["a2a_fixes"]))


def transition_table(rows: list[dict]) -> str:
    out = ["| W | mesh | shape | transition | torch miss ms | dtshard miss ms | miss d/t | torch hit ms | "
           "dtshard hit ms | hit d/t | PGs torch / dtshard (mesh+redist) | RSS MiB torch / dtshard | "
           "cache KiB torch / dtshard | a2a fixes per call torch / dtshard |",
           "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---|---|---|---|"]
    for row in rows:
        t, d = row.get("torch"), row.get("dtshard")
        out.append(
            f"| {row['w']} | {row['mesh']} | {row['shape']} | {row['transition']} | {_t(t, 'miss_s')} | "
            f"{_t(d, 'miss_s')} | {_ratio(t, d, 'miss_s')} | {_t(t, 'hit_s')} | {_t(d, 'hit_s')} | "
            f"{_ratio(t, d, 'hit_s')} | {_pair(t, d, _pgs)} | "
            f"{_pair(t, d, _rss)} | {_pair(t, d, _cache)} | {_pair(t, d, _a2a)} |")
    return "\n".join(out)


def model_table(rows: list[dict]) -> str:
    keys = ["parallelize_s", "to_empty_s", "init_s", "step1_s", "step2_s"]
    out = ["| W | mesh | lib | parallelize ms | to_empty ms | init ms | 1st fwd+bwd ms | 2nd fwd+bwd ms | "
           "PGs | RSS MiB | a2a fixes | status |", "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in rows:
        for lib in ("torch", "dtshard"):
            r = row.get(lib)
            if r is None:
                continue
            if r.get("status") == "ok":
                vals = [f"{r[k] * 1e3:.0f}" for k in keys] + [str(r["pgs"]), f"{r['rss_mib']:.0f}", str(r["a2a_fixes"]), "ok"]
            else:
                st = r.get("status")
                prog = r.get("progress", {})
                vals = [f"{prog[k] * 1e3:.0f}" if k in prog else "-" for k in keys] + ["-"] * 3
                vals.append(st if st != "error" else "ERR: " + r.get("error", "")[:120].replace("|", "/"))
            out.append(f"| {row['w']} | {row['mesh']} | {lib} | " + " | ".join(vals) + " |")
    return "\n".join(out)


def errors_text(rows: list[dict]) -> str:
    lines = []
    for row in rows:
        for lib in ("torch", "dtshard"):
            r = row.get(lib)
            if r and r.get("status") == "error":
                what = row.get("transition", "model")
                lines.append(f"- {lib}, W={row['w']}, {row['mesh']}, {row.get('shape', '')} {what}: {r['error']}")
            elif r and r.get("status") == "ok" and "local_shape" in r:
                o = row.get("dtshard" if lib == "torch" else "torch")
                if lib == "torch" and o and o.get("status") == "ok" and list(o["local_shape"]) != list(r["local_shape"]):
                    lines.append(f"- local shapes differ at W={row['w']} {row['mesh']} {row['shape']} "
                                 f"{row['transition']}: torch {r['local_shape']}, dtshard {o['local_shape']}")
    return "\n".join(lines)


def print_report(doc: dict) -> None:
    print(f"\n## bench_scale: {doc['header']}\n")
    if doc["transitions"]:
        print(transition_table(doc["transitions"]))
        print("\nms = process CPU time of the one rank; d/t = dtshard / torch; * = miss is the first call "
              "(no time left for more); timeout / oom: the cell was killed at the limit.")
    if doc["model"]:
        print()
        print(model_table(doc["model"]))
    err = errors_text(doc["transitions"] + doc["model"])
    if err:
        print("\nErrors and mismatches:\n" + err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ws", default="8,64,512,4096,32768", help="world sizes (comma separated)")
    ap.add_argument("--meshes", default="2d,3d", help="2d, 3d (3-D meshes only for W >= 512)")
    ap.add_argument("--shapes", default="even,uneven", help="even (1024x1024), uneven (1000x1001)")
    ap.add_argument("--transitions", default="all", help="names, comma separated: " + ",".join(TRANSITIONS))
    ap.add_argument("--lib", default="both", choices=["both", "torch", "dtshard"])
    ap.add_argument("--model", dest="model", action="store_true", default=True)
    ap.add_argument("--no-model", dest="model", action="store_false")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds per transition cell")
    ap.add_argument("--model-timeout", type=float, default=None, help="seconds per model cell (default 3x --timeout)")
    ap.add_argument("--mem-limit", type=float, default=6144.0, help="MiB of resident memory per cell (the whole forked process, the imported libraries included)")
    ap.add_argument("--reps", type=int, default=10, help="repeated (cache-hit) calls per cell")
    ap.add_argument("--rank", type=int, default=3, help="the simulated rank")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--dtshard-root", default=None, help="import dtshard from this directory instead of this checkout")
    ap.add_argument("--label", default="", help="a note for the header (e.g. which commit --dtshard-root holds)")
    ap.add_argument("--from-json", default=None, help="print the tables of earlier runs (files, comma separated)")
    args = ap.parse_args()
    if args.from_json:  # several files (comma separated): one table of all their rows
        docs = []
        for path in args.from_json.split(","):
            with open(path) as f:
                docs.append(json.load(f))
        print_report({"header": " | ".join(dict.fromkeys(d["header"] for d in docs)),
                      "transitions": [r for d in docs for r in d["transitions"]],
                      "model": [r for d in docs for r in d["model"]]})
        return
    ws = [int(x) for x in args.ws.split(",") if x]
    names = list(TRANSITIONS) if args.transitions == "all" else args.transitions.split(",")
    unknown = [n for n in names if n not in TRANSITIONS]
    if unknown:
        ap.error(f"unknown transitions {unknown}; known: {', '.join(TRANSITIONS)}")
    libs = ["torch", "dtshard"] if args.lib == "both" else [args.lib]
    model_timeout = args.model_timeout or 3 * args.timeout

    DTSHARD_ROOT[0] = args.dtshard_root
    warm_imports()
    import dtshard

    where = os.path.dirname(os.path.dirname(os.path.abspath(dtshard.__file__)))
    state = _git_state(where) if args.dtshard_root is None else f"dtshard from {where}"
    header = (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {state}"
              f"{', ' + args.label if args.label else ''}, torch {torch.__version__}, "
              f"python {platform.python_version()}, {os.cpu_count()} CPUs, rank {args.rank} of W, "
              f"timeout {args.timeout:g} s (model {model_timeout:g} s), mem limit {args.mem_limit:g} MiB, "
              f"load {os.getloadavg()[0]:.1f}")
    print(f"# {header}", flush=True)
    doc = {"header": header, "args": vars(args), "transitions": [], "model": []}
    flip = 0
    for w in ws:
        for kind in args.meshes.split(","):
            ms = mesh_shape(w, kind)
            if ms is None:
                continue
            for shape_name in args.shapes.split(","):
                for tname in names:
                    if TRANSITIONS[tname][0] != kind:
                        continue
                    row = {"w": w, "mesh": fmt_mesh(ms), "shape": "x".join(map(str, SHAPES[shape_name])),
                           "transition": tname}
                    order = libs if flip % 2 == 0 else libs[::-1]
                    flip += 1
                    for lib in order:
                        row[lib] = run_cell(cell_transition, (lib, w, kind, shape_name, tname, args.rank, args.reps,
                                                              args.timeout), args.timeout, args.mem_limit)
                    doc["transitions"].append(row)
                    print(transition_table([row]).splitlines()[-1], flush=True)
        if args.model and w % 8 == 0:
            row = {"w": w, "mesh": fmt_mesh((w // 8, 8))}
            for lib in libs:
                row[lib] = run_cell(cell_model, (lib, w, args.rank, model_timeout), model_timeout, args.mem_limit)
            doc["model"].append(row)
            print(model_table([row]).split("\n", 2)[-1], flush=True)
        if args.json:
            _write(args.json, doc)
    if args.json:
        _write(args.json, doc)
    print_report(doc)


def _write(path: str, doc: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


if __name__ == "__main__":
    main()
