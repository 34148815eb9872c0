#!/usr/bin/env python
"""Peak EXTRA host memory of dtshard's redistribute and spatially sharded conv2d, per rank, on
gloo CPU ranks, next to ``torch.distributed.tensor`` and the bare collectives.  One command, from
the repository root (no install needed: this checkout's ``dtshard/`` and ``kernels/dtshard_kernels/`` are used):

    python benchmarks/bench_memory.py                       # 16 and 64 MiB tensors, 2 ranks (~2-3 min)
    python benchmarks/bench_memory.py --sizes 16 --conv-shapes 2,16,256,256
    python benchmarks/bench_memory.py --world 4             # 1-D mesh of 4 + a 2x2 mesh
    python benchmarks/bench_memory.py --sections redist --transitions S0-R,P-S1

What is measured
----------------
For every case, on every rank: ``extra = peak RSS while the operation runs - RSS just before it``,
with the operation's inputs already built and its result kept alive until the peak is read.  So
``extra`` is everything the operation allocates and touches: its output plus every temporary,
including the ones inside gloo.  Each case runs ``--reps`` (3) times and the median is reported;
before its first size it also runs once unmeasured (``--warmup``) to fill plan caches and make the
first-call allocations (later sizes of the same case run the same code: the median would drop a
one-off first sample anyway; ``--warmup-all`` warms every size).  ``P->R u`` is not run: it is the
same all_reduce as ``P->R``.

Method: peak RSS of the process (``/proc/self/status``).  Before each run: ``gc.collect()``, build
the inputs, ``dist.barrier()``, reset the kernel's high-water mark with ``echo 5 >
/proc/self/clear_refs`` (Linux >= 4.0), read the baseline ``VmRSS``; run the operation; read
``VmHWM``.  The script checks at start that the reset works (allocate, free, reset, allocate less:
the high-water mark must follow); where it does not, it falls back to the maximum of ``VmRSS``
sampled every 0.5 ms by a background thread (which can miss a short peak) and says so in the
header.

Why ``MALLOC_MMAP_THRESHOLD_=65536``: glibc serves large blocks from its heap arenas by default
and raises the mmap threshold dynamically (up to 32 MiB on 64-bit) after a large block is freed,
so a freed 16 MiB temporary often stays mapped (RSS does not drop) and a later allocation reuses
it (RSS does not rise).  Then RSS is a history of past peaks, not of live bytes.  Setting the
threshold (in the environment, before the rank processes start, because glibc reads it at its
first malloc) makes every allocation of 64 KiB or more its own ``mmap``, returned to the kernel by
``free``; it also disables the dynamic adjustment.  RSS then tracks the bytes of live tensors
(pages are counted when first touched, so an ``empty`` buffer that is never written costs nothing,
which is the truth for RSS too).  torch's CPU allocator does not cache, so tensors map straight
onto malloc/free.

What "no hidden full-size temporaries" means, per transition (1-D mesh of n ranks, T = bytes of
the global tensor, L = T/n a shard; a Partial input is full size, T, on every rank):

=============  ============================  ==================================================
transition     collective                    the operation needs (extra)
=============  ============================  ==================================================
S0 -> R        all_gather                    its output, T; nothing else when even (the gather
                                             lands in the output).  Uneven: + the padded copy
                                             of the short chunk (<= L).
S1 -> R        all_gather + unpack           a gathered (n, rows, cols/n) buffer T AND the
                                             unpacked output T (the column interleave cannot be
                                             done in place): 2T.
P -> R         all_reduce                    its output T (functional all_reduce clones, then
                                             reduces in place; the input is not mutated).
P -> S0        reduce_scatter                its output L (uneven: + a padded copy of the
                                             input, T, as the collective needs equal blocks).
P -> S1        pack + reduce_scatter         the packed (n, rows, cols/n) send buffer T + L.
S0 -> S1,      all_to_all                    2L: a send buffer and a receive buffer.  One of
S1 -> S0                                     the two copies is free: S1 -> S0's input already
                                             is its send buffer (pieces along dim 0), S0 ->
                                             S1's receive buffer already is its output; and the
                                             pack buffer is dead once the collective is done.
R -> S1        local slice copy              its output L (dim-0 slices are views: 0).
conv2d fwd+bwd halo exchange (all_to_all)    the plain conv's memory on the local shard (the
  (S(2))                                     floor: output, grad buffers, saved activations)
                                             plus the halo window (the local shard + k//2 rows,
                                             ~ L) and its gradient (~ L).
=============  ============================  ==================================================

A case is flagged ``OVER`` when ``extra > 1.1 * (input + output) + 1 MiB`` (local bytes on that
rank): a coarse screen for a full-size copy nobody asked for.  It is not a verdict by itself:
gloo has its own temporaries, which the ``raw`` column shows (the bare collective on the same
bytes, with a preallocated output: ``all_gather_into_tensor``, out-of-place ``all_reduce``,
``reduce_scatter_tensor``, ``all_to_all_single``; uneven shapes padded as the frameworks pad).
gloo 2.13 on CPU stages ``all_gather_into_tensor`` in a flat buffer of the output's size and
copies it into the output (so the bare even all_gather already costs ~2T), and runs
``reduce_scatter_tensor`` as a clone of the whole input + all_reduce + copy of one chunk (T + L).
``dt - raw`` is what dtshard adds on top of the bare collective.  Where the operation itself
waits matters: a temporary still referenced while the main thread waits for the collective is
alive at the moment the output is written (torch's ``funcol`` drops its packed buffer before it
waits; code that calls ``wait`` inside the function that owns the buffer does not).

Columns: ``in`` / ``out`` = this rank's local input / output bytes; ``raw``, ``torch``,
``dtshard`` = median extra peak; ``x out`` = dtshard extra / output; ``x(in+out)`` = dtshard
extra / (input + output); ``dt/torch`` = dtshard extra / torch extra.  Each row shows the worst
rank (largest dtshard ``x(in+out)``; the numbers of every rank are in the JSON).  Conv rows:
``in`` = x shard + weight, ``out`` = y shard + grad_x + grad_w (kept alive), ``local`` = the same
conv fwd+bwd on the rank's shard as a plain tensor (padding 1 on H too, so no halo: the
unsharded-per-rank floor), ``x local`` = dtshard / local, ``(dt-local)/x`` = dtshard's extra
beyond the floor in units of the x shard (the halo budget above: <= ~2).  The literal OVER rule
flags the floor itself for conv (backward needs grad_out, grad buffers and saved activations
beyond in + out), so for conv rows read ``(dt-local)/x``.

Results go to stdout and ``benchmarks/results/bench_memory.json`` (git-ignored).  Each rank runs
one intra-op thread.  RSS is per process and not disturbed by other load, so unlike the timing
benchmarks the numbers are reproducible (samples of a case agree to ~0.1 MiB, a few to ~2 MiB).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
import traceback
import warnings
from datetime import timedelta

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _path in (os.path.join(_ROOT, "kernels"), _ROOT):  # this checkout's dtshard_kernels and dtshard
    if _path not in sys.path:
        sys.path.insert(0, _path)

MMAP_THRESHOLD = "65536"
MiB = 1 << 20

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _checkout import free_port  # noqa: E402  (benchmarks/: run as a script)



def _import_dtshard():
    """This checkout's dtshard (benchmarks/_checkout.py)."""
    from _checkout import import_this_checkout

    return import_this_checkout()


# ---------------------------------------------------------------------------------------------
# peak-RSS probes
# ---------------------------------------------------------------------------------------------


def _status_kib(*keys: str) -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0])
    return out


def _rss() -> int:
    return _status_kib("VmRSS")["VmRSS"] * 1024


def _hwm() -> int:
    return _status_kib("VmHWM")["VmHWM"] * 1024


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def check_clear_refs() -> tuple[bool, str]:
    """Whether writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS here, and
    whether freed tensors give their pages back (the MALLOC_MMAP_THRESHOLD_ setting works)."""
    try:
        gc.collect()
        x = torch.ones(32 * MiB // 4)  # 32 MiB, touched
        hwm_hi = _hwm()
        del x
        after_free = _rss()
        _reset_hwm()
        reset_to = _hwm()
        base = _rss()
        y = torch.ones(8 * MiB // 4)
        hwm_8 = _hwm()
        del y
    except OSError as e:
        return False, f"clear_refs unusable ({e})"
    freed = hwm_hi - after_free >= 30 * MiB
    ok = reset_to <= base + MiB and hwm_hi - reset_to >= 30 * MiB and 7 * MiB <= hwm_8 - base <= 10 * MiB
    note = (f"clear_refs check: HWM after a 32 MiB tensor {hwm_hi / MiB:.1f} MiB, after free + reset "
            f"{reset_to / MiB:.1f} MiB, +8 MiB tensor -> +{(hwm_8 - base) / MiB:.1f} MiB: "
            f"{'ok' if ok else 'NOT working'}; freed memory returned to the OS: {'yes' if freed else 'NO'}")
    return ok, note


class Probe:
    """start() / stop() -> extra peak bytes since start()."""

    def __init__(self, use_clear_refs: bool):
        self.use_clear_refs = use_clear_refs
        self._thread = None

    def start(self) -> None:
        if self.use_clear_refs:
            _reset_hwm()
            self.base = _rss()
            return
        self.base = _rss()
        self.peak = self.base
        self._stop = threading.Event()

        def sample():
            while not self._stop.is_set():
                v = _rss()
                if v > self.peak:
                    self.peak = v
                time.sleep(0.0005)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()

    def stop(self) -> int:
        if self.use_clear_refs:
            return _hwm() - self.base
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss()) - self.base


# ---------------------------------------------------------------------------------------------
# cases
# ---------------------------------------------------------------------------------------------

TRANSITIONS_1D = ["S0-R", "S1-R", "P-R", "P-S0", "P-S1", "S0-S1", "S1-S0", "R-S1"]
CASES_2D = [("S0,S1", "R,R", False), ("S0,S1", "S1,S0", False), ("P,P", "R,R", False), ("P,P", "S0,S1", False),
            ("S0,S0", "R,R", False), ("S0,S1", "R,R", True), ("S0,S1", "S1,S0", True)]


def _placement(s: str):
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    s = s.strip()
    if s == "R":
        return Replicate()
    if s == "P":
        return Partial()
    if s.startswith("S"):
        return Shard(int(s[1:]))
    raise ValueError(f"unknown placement {s!r} (R, P, S<dim>)")


def _shape_for(mib: float, uneven: bool) -> tuple[int, int]:
    """A 2-D float32 shape of ``mib`` MiB, rows a power of two; uneven: both dims odd."""
    numel = int(mib * MiB) // 4
    rows = 1
    while rows * rows * 4 <= numel:
        rows *= 2
    cols = numel // rows
    if uneven:
        return (rows - 1, cols + 1) if rows % 2 == 0 else (rows, cols + (cols % 2 == 0))
    return rows, cols


def _nbytes(t) -> int:
    return t.numel() * t.element_size() if t is not None else 0


def _contig_stride(shape):
    st, acc = [], 1
    for v in reversed(shape):
        st.append(acc)
        acc *= v
    return tuple(reversed(st))


class Measurer:
    def __init__(self, probe: Probe, reps: int, warmup: int):
        self.probe, self.reps, self.warmup = probe, reps, warmup

    def run(self, build, op, sizes, warmup: bool = True):
        """build() -> state (inputs); op(state) -> result (kept alive); sizes(state, result) ->
        (in_bytes, out_bytes).  Returns {'extra': median, 'samples': [...], 'in':, 'out':}."""
        samples, io = [], None
        nwarm = self.warmup if warmup else 0
        for r in range(nwarm + self.reps):
            gc.collect()
            state = build()
            dist.barrier()
            self.probe.start()
            res = op(state)
            extra = self.probe.stop()
            if io is None:
                io = sizes(state, res)
            del res, state
            gc.collect()
            if r >= nwarm:
                samples.append(extra)
        return {"extra": statistics.median(samples), "samples": samples, "in": io[0], "out": io[1]}


def _agree_ok(ok: bool) -> bool:
    """All ranks agree whether a case succeeded (so nobody waits in a collective for a rank that
    gave up)."""
    t = torch.tensor([0 if ok else 1])
    dist.all_reduce(t)
    return int(t) == 0


# --- redistribute ---------------------------------------------------------------------------------


def _redist_case(m: Measurer, impl: str, mesh, shape, src, dst, coord, warmup: bool):
    from dtshard.spec import local_shape_and_offset

    lshape, _ = local_shape_and_offset(shape, tuple(mesh.shape), src, coord)
    fill = float(dist.get_rank() + 1)

    if impl == "dtshard":
        from dtshard import DTensor as DT

        def mk(local):
            return DT.from_local(local, mesh, src, shape=shape)
    else:
        from torch.distributed.tensor import DTensor as TDT

        def mk(local):
            return TDT.from_local(local, mesh, src, run_check=False, shape=torch.Size(shape),
                                  stride=_contig_stride(shape))

    def build():
        return mk(torch.full(lshape, fill))

    def op(dt):
        out = dt.redistribute(mesh, dst)
        loc = out.to_local()
        if hasattr(loc, "wait"):  # torch's AsyncCollectiveTensor: the peak includes finishing it
            loc.wait()
        return out

    def sizes(dt, out):
        a, b = dt.to_local(), out.to_local()
        shared = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        return _nbytes(a), (0 if shared else _nbytes(b))

    return m.run(build, op, sizes, warmup)


def _raw_case(m: Measurer, mesh, shape, src, dst, coord, warmup: bool):
    """The bare collective a 1-D transition needs, on the (padded) bytes the frameworks move."""
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

    from dtshard.spec import chunk_range, chunk_sizes, local_shape_and_offset

    n = mesh.size(0)
    group = mesh.get_group(0)
    s, d = src[0], dst[0]
    numel = shape[0] * shape[1]
    lshape, _ = local_shape_and_offset(shape, tuple(mesh.shape), src, (0,))  # the largest shard
    if isinstance(s, Shard) and isinstance(d, Replicate):
        block = chunk_sizes(shape[s.dim], n)[0]
        inp_shape = (block * numel // shape[s.dim],)

        def op(x):
            out = x.new_empty(n * x.numel())
            dist.all_gather_into_tensor(out, x, group=group)
            return out
    elif isinstance(s, Partial) and isinstance(d, Replicate):
        inp_shape = (numel,)

        def op(x):
            out = x.clone()
            dist.all_reduce(out, group=group)
            return out
    elif isinstance(s, Partial) and isinstance(d, Shard):
        block = chunk_sizes(shape[d.dim], n)[0]
        inp_shape = (n * block * numel // shape[d.dim],)

        def op(x):
            out = x.new_empty(x.numel() // n)
            dist.reduce_scatter_tensor(out, x, group=group)
            return out
    elif isinstance(s, Shard) and isinstance(d, Shard):
        per = -(-(lshape[0] * lshape[1]) // n)
        inp_shape = (per * n,)

        def op(x):
            out = torch.empty_like(x)
            dist.all_to_all_single(out, x, group=group)
            return out
    elif isinstance(s, Replicate) and isinstance(d, Shard):
        inp_shape = tuple(shape)
        start, length = chunk_range(shape[d.dim], n, coord[0])

        def op(x):
            return x.narrow(d.dim, start, length).contiguous()  # dim 0: a view, no copy
    else:
        return None
    fill = float(dist.get_rank() + 1)
    return m.run(lambda: torch.full(inp_shape, fill), op,
                 lambda x, out: (_nbytes(x), 0 if out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
                                 else _nbytes(out)), warmup)


def run_redistribute(args, m: Measurer, dtshard, rank: int) -> list[dict]:
    results = []
    cases = []
    mesh1 = dtshard.init_device_mesh("cpu", (args.world,))
    wanted = None if args.transitions == "all" else set(args.transitions.split(","))
    for mib in args.sizes:
        for uneven in (False, True):
            if args.uneven == "no" and uneven or args.uneven == "only" and not uneven:
                continue
            shape = _shape_for(mib, uneven)
            for t in TRANSITIONS_1D:
                if wanted is not None and t not in wanted or uneven and t == "P-R":
                    continue  # P->R u: the same all_reduce as P->R (the shape does not matter)
                a, b = t.split("-")
                cases.append((mesh1, f"{a}->{b}" + (" u" if uneven else ""), mib, shape, [_placement(a)],
                              [_placement(b)]))
    if args.world == 4 and not args.no_2d:
        mesh2 = dtshard.init_device_mesh("cpu", (2, 2))
        for mib in args.sizes:
            for a, b, uneven in CASES_2D:
                if args.uneven == "no" and uneven or args.uneven == "only" and not uneven:
                    continue
                shape = _shape_for(mib, uneven)
                cases.append((mesh2, f"({a})->({b})" + (" u" if uneven else ""), mib, shape,
                              [_placement(p) for p in a.split(",")], [_placement(p) for p in b.split(",")]))
    impls = [i for i in args.impl.split(",") if i]
    warmed = set()
    for mesh, name, mib, shape, src, dst in cases:
        coord = tuple(mesh.get_coordinate())
        t_case = time.perf_counter()
        row = {"case": name, "mib": mib, "shape": list(shape), "mesh": list(mesh.shape), "rank": rank}
        for impl in (["raw"] if mesh.ndim == 1 else []) + impls:
            res, err = None, None
            warm = args.warmup_all or (impl, name) not in warmed  # the first size of each case
            warmed.add((impl, name))
            try:
                if impl == "raw":
                    res = _raw_case(m, mesh, shape, src, dst, coord, warm)
                else:
                    res = _redist_case(m, impl, mesh, shape, src, dst, coord, warm)
            except Exception as e:  # noqa: BLE001  (reported in its cell)
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                if args.verbose:
                    traceback.print_exc()
            if not _agree_ok(err is None):
                err = err or "failed on another rank"
            row[impl] = res if err is None else {"error": err}
        results.append(row)
        if rank == 0 and args.verbose:
            print(f"  done {name} {mib} MiB ({time.perf_counter() - t_case:.1f} s)", flush=True)
    return results


# --- conv2d --------------------------------------------------------------------------------------


def run_conv(args, m: Measurer, dtshard, rank: int) -> list[dict]:
    from dtshard import DTensor as DT
    from dtshard import Replicate, Shard

    mesh = dtshard.init_device_mesh("cpu", (args.world,))
    coord = tuple(mesh.get_coordinate())
    results = []
    from dtshard.spec import local_shape_and_offset

    for shape in args.conv_shapes:
        n, c, h, w = shape
        lshape, _ = local_shape_and_offset(shape, (args.world,), [Shard(2)], coord)
        gen = torch.Generator().manual_seed(rank)

        def inputs():
            return torch.randn(lshape, generator=gen), torch.randn(c, c, 3, 3, generator=gen) / (9 * c) ** 0.5

        def sizes(state, res):
            return (sum(_nbytes(t) for t in state[:2]), sum(_nbytes(t) for t in res))

        def build_local():
            x, wt = inputs()
            return x.requires_grad_(), wt.requires_grad_()

        def op_local(state):
            x, wt = state
            y = F.conv2d(x, wt, padding=1)
            y.sum().backward()
            return y.detach(), x.grad, wt.grad

        def build_dt():
            x, wt = inputs()
            xd = DT.from_local(x, mesh, [Shard(2)], shape=tuple(shape)).requires_grad_()
            wd = DT.from_local(wt, mesh, [Replicate()]).requires_grad_()
            return x, wt, xd, wd

        def op_dt(state):
            _, _, xd, wd = state
            y = F.conv2d(xd, wd, padding=1)
            y.sum().backward()
            return y.detach().to_local(), xd.grad.to_local(), wd.grad.to_local()

        t_case = time.perf_counter()
        row = {"case": f"conv2d {n}x{c}x{h}x{w} S(2)", "shape": list(shape), "rank": rank}
        for name, b, o in (("local", build_local, op_local), ("dtshard", build_dt, op_dt)):
            err = None
            try:
                res = m.run(b, o, sizes)
                res["x_bytes"] = 4 * lshape[0] * lshape[1] * lshape[2] * lshape[3]
            except Exception as e:  # noqa: BLE001
                err = f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}"
                if args.verbose:
                    traceback.print_exc()
            if not _agree_ok(err is None):
                err = err or "failed on another rank"
            row[name] = res if err is None else {"error": err}
        results.append(row)
        if rank == 0 and args.verbose:
            print(f"  done {row['case']} ({time.perf_counter() - t_case:.1f} s)", flush=True)
    return results


# ---------------------------------------------------------------------------------------------
# worker / main
# ---------------------------------------------------------------------------------------------


def _worker(rank: int, args, port: int, out_path: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=args.world, timeout=timedelta(seconds=args.timeout))
    try:
        dtshard = _import_dtshard()
        import torch.distributed.tensor as _torch_dtensor  # noqa: F401  (imported before the freeze)
        # gc.collect() walks every tracked object: ~0.2 s with torch and dtshard loaded.  Freeze the
        # survivors of the imports (moved to a permanent generation) so each collect before a
        # measurement only scans what the benchmark created.
        gc.collect()
        gc.freeze()
        ok, note = check_clear_refs()
        oks = [None] * args.world
        dist.all_gather_object(oks, ok)
        use = all(oks)
        probe = Probe(use)
        m = Measurer(probe, args.reps, args.warmup)
        out = {"rank": rank, "clear_refs": use, "check": note,
               "mmap_threshold_env": os.environ.get("MALLOC_MMAP_THRESHOLD_")}
        sections = args.sections.split(",")
        if "redist" in sections:
            out["redist"] = run_redistribute(args, m, dtshard, rank)
        if "conv" in sections:
            out["conv"] = run_conv(args, m, dtshard, rank)
        everything = [None] * args.world
        dist.all_gather_object(everything, out)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump({"args": vars(args), "ranks": everything}, f, indent=1)
    finally:
        dist.destroy_process_group()


def _mib(b) -> str:
    return "n/a" if b is None else f"{b / MiB:.1f}"


def _over(extra, inp, out) -> bool:
    return extra > 1.1 * (inp + out) + MiB


def _ratio(a, b) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    w = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    fmt = lambda cells: "| " + " | ".join(c.rjust(w[i]) if i else c.ljust(w[i]) for i, c in enumerate(cells)) + " |"  # noqa: E731
    return [fmt(header), "|" + "|".join("-" * (x + 2) for x in w) + "|", *(fmt(r) for r in rows)]


def report(data: dict) -> str:
    a = data["args"]
    ranks = data["ranks"]
    lines = []
    r0 = ranks[0]
    meth = ("peak = VmHWM after resetting it via /proc/self/clear_refs" if r0["clear_refs"] else
            "clear_refs does NOT work here: peak = max VmRSS sampled every 0.5 ms by a thread (can miss short peaks)")
    lines.append(f"{a['world']} gloo ranks x 1 thread, MALLOC_MMAP_THRESHOLD_={r0['mmap_threshold_env']}; {meth}; "
                 f"median of {a['reps']} (+{a['warmup']} warm-up per case); MiB = 2^20 bytes, local to the rank")
    for r in ranks:
        lines.append(f"  rank {r['rank']}: {r['check']}")
    over_cases = []
    if "redist" in r0:
        lines.append("")
        lines.append("== redistribute: extra peak MiB per rank (worst rank shown); OVER = extra > 1.1 (in+out) + 1 MiB ==")
        hdr = ["case", "mesh", "MiB", "shape", "in", "out", "raw", "torch", "torch x(in+out)", "dtshard", "x out",
               "x(in+out)", "dt - raw", "dt/torch", "flag"]
        rows = []
        for i, row0 in enumerate(r0["redist"]):
            per = [r["redist"][i] for r in ranks]

            def get(rw, impl):
                v = rw.get(impl)
                return None if v is None or "error" in v else v

            # the worst rank: largest dtshard extra / (in + out)
            def key(rw):
                d = get(rw, "dtshard")
                return d["extra"] / max(d["in"] + d["out"], 1) if d else -1
            rw = max(per, key=key)
            d, t, raw = get(rw, "dtshard"), get(rw, "torch"), get(rw, "raw")
            errs = [f"{impl}: {rw[impl]['error']}" for impl in ("raw", "torch", "dtshard")
                    if isinstance(rw.get(impl), dict) and "error" in rw[impl]]
            flags = []
            for impl in ("dtshard", "torch"):
                overs = [r["rank"] for r in per if get(r, impl) and _over(get(r, impl)["extra"], get(r, impl)["in"],
                                                                            get(r, impl)["out"])]
                if overs:
                    flags.append(("OVER" if impl == "dtshard" else "torch:OVER") + f" (rank {','.join(map(str, overs))})")
                    if impl == "dtshard":
                        over_cases.append(f"{row0['case']} {row0['mib']} MiB")
            if raw and _over(raw["extra"], raw["in"], raw["out"]):
                flags.append("raw:OVER")
            ref = d or t
            rows.append([row0["case"], "x".join(map(str, row0["mesh"])), f"{row0['mib']:g}",
                         "x".join(map(str, row0["shape"])),
                         _mib(ref["in"]) if ref else "ERR", _mib(ref["out"]) if ref else "ERR",
                         _mib(raw["extra"]) if raw else "n/a", _mib(t["extra"]) if t else ("ERR" if "torch" in rw else "n/a"),
                         _ratio(t["extra"], t["in"] + t["out"]) if t else "",
                         _mib(d["extra"]) if d else ("ERR" if "dtshard" in rw else "n/a"),
                         _ratio(d["extra"], d["out"]) if d else "", _ratio(d["extra"], d["in"] + d["out"]) if d else "",
                         _mib(d["extra"] - raw["extra"]) if d and raw else "n/a",
                         _ratio(d["extra"], t["extra"]) if d and t else "",
                         " ".join(flags + errs)])
        lines += _table(hdr, rows)
    if "conv" in r0:
        lines.append("")
        lines.append("== conv2d 3x3 pad 1, fwd + sum + bwd (grad x, grad w), input sharded on H; local = the same on "
                     "the rank's shard as a plain tensor (the floor); extra peak MiB, worst rank ==")
        hdr = ["case", "in", "out", "local", "local x(in+out)", "dtshard", "x(in+out)", "dt - local", "x local",
               "(dt-local)/x", "flag"]
        rows = []
        for i, row0 in enumerate(r0["conv"]):
            per = [r["conv"][i] for r in ranks]

            def ok(rw, impl):
                v = rw.get(impl)
                return None if v is None or "error" in v else v
            rw = max(per, key=lambda r: ok(r, "dtshard")["extra"] if ok(r, "dtshard") else -1)
            d, loc = ok(rw, "dtshard"), ok(rw, "local")
            flags = []
            for impl in ("dtshard", "local"):
                overs = [r["rank"] for r in per if ok(r, impl) and _over(ok(r, impl)["extra"], ok(r, impl)["in"],
                                                                          ok(r, impl)["out"])]
                if overs:
                    flags.append(("OVER" if impl == "dtshard" else "local:OVER") + f" (rank {','.join(map(str, overs))})")
                    if impl == "dtshard":
                        over_cases.append(row0["case"])
            errs = [f"{impl}: {rw[impl]['error']}" for impl in ("local", "dtshard")
                    if isinstance(rw.get(impl), dict) and "error" in rw[impl]]
            ref = d or loc
            rows.append([row0["case"], _mib(ref["in"]) if ref else "ERR", _mib(ref["out"]) if ref else "ERR",
                         _mib(loc["extra"]) if loc else "ERR",
                         _ratio(loc["extra"], loc["in"] + loc["out"]) if loc else "",
                         _mib(d["extra"]) if d else "ERR", _ratio(d["extra"], d["in"] + d["out"]) if d else "",
                         _mib(d["extra"] - loc["extra"]) if d and loc else "",
                         _ratio(d["extra"], loc["extra"]) if d and loc else "",
                         _ratio(d["extra"] - loc["extra"], d["x_bytes"]) if d and loc else "",
                         " ".join(flags + errs)])
        lines += _table(hdr, rows)
    lines.append("")
    lines.append("dtshard OVER: " + (", ".join(over_cases) if over_cases else "none"))
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="16,64", help="global tensor sizes, MiB of float32 (default 16,64)")
    p.add_argument("--world", type=int, default=2, choices=(2, 4), help="ranks (4: also a 2x2 mesh)")
    p.add_argument("--conv-shapes", default="4,32,512,512;8,64,256,256",
                   help="N,C,H,W[;N,C,H,W...] global conv inputs, sharded on H (default 4,32,512,512;8,64,256,256)")
    p.add_argument("--sections", default="redist,conv", help="redist,conv")
    p.add_argument("--transitions", default="all", help=f"1-D transitions, of {','.join(TRANSITIONS_1D)}")
    p.add_argument("--uneven", default="yes", choices=("yes", "no", "only"))
    p.add_argument("--impl", default="torch,dtshard", help="torch,dtshard (raw always runs on 1-D meshes)")
    p.add_argument("--no-2d", action="store_true", help="with --world 4: skip the 2x2 mesh cases")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1,
                   help="warm-up runs (not counted) before the first size of each redistribute case and each conv")
    p.add_argument("--warmup-all", action="store_true", help="warm up every size of every redistribute case")
    p.add_argument("--timeout", type=int, default=300, help="process group timeout, s")
    p.add_argument("--json", default=os.path.join(_ROOT, "benchmarks", "results", "bench_memory.json"))
    p.add_argument("--from-json", default=None, help="only print the report of an earlier run")
    p.add_argument("--verbose", action="store_true")
    args = p.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            print(report(json.load(f)))
        return 0
    args.sizes = [float(s) for s in args.sizes.split(",") if s]
    args.sizes = [int(s) if s == int(s) else s for s in args.sizes]
    args.conv_shapes = [[int(v) for v in s.split(",")] for s in args.conv_shapes.split(";") if s]
    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
    # glibc reads this at its first malloc: it must be in the environment the rank processes
    # start with (mp.spawn starts fresh interpreters that inherit os.environ)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    t0 = time.time()
    load0 = os.getloadavg()
    mp.spawn(_worker, args=(args, free_port(), args.json), nprocs=args.world, join=True)
    wall = time.time() - t0
    with open(args.json) as f:
        data = json.load(f)
    data["meta"] = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count(),
                    "wall_s": wall, "loadavg": [load0, os.getloadavg()], "date": time.strftime("%Y-%m-%dT%H:%M:%S")}
    with open(args.json, "w") as f:
        json.dump(data, f, indent=1)
    print(f"{data['meta']['date']}  torch {torch.__version__}  python {platform.python_version()}  "
          f"{os.cpu_count()} CPUs  loadavg {load0[0]:.1f} -> {os.getloadavg()[0]:.1f}")
    print(report(data))
    print(f"\nwrote {args.json}  (wall {wall:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
