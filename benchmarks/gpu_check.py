"""GPU-ready checks of dtshard in one run (driver of ``benchmarks/gpu_check.sh``).

On a machine with one CUDA GPU this runs, in under 8 minutes (``--budget``, default 480 s, bounds
the whole run; every section also has its own cap), and prints ONE table at the end:

1. ``1-kernels-gpu``: ``tests/kernels/test_triton_interpret.py`` with the Triton kernels COMPILED for
   the GPU on CUDA tensors (``DTSHARD_KERNEL_TEST_DEVICE=cuda``, ``TRITON_INTERPRET=0``): every op
   bit-for-bit equal to the reference over the same cases as the interpreter run; the tests are
   split over a few parallel pytest processes (the kernel compilations dominate).
2. ``2-bw-<op>``: achieved bandwidth of each ``dtshard_kernels`` op (the cases of
   ``bench_kernels.py``: pack, unpack, a2a_pack, a2a_unpack, halo_cat, halo_split, slice_copy, plus
   ``uneven_pad``, the pad of a short chunk before an uneven all_gather) as a fraction of a
   device-to-device ``copy_`` of the same output bytes, on 64 MiB and 1 GiB fp32 and 1 GiB bf16
   inputs.  Each op's output is first checked equal to the reference.  Target: >= 85 % at 1 GiB
   (fp32 and bf16; the 64 MiB figure is reported, since launch overhead shows there).
   Timing: CUDA events around 10 back-to-back calls, median of 7.
3. ``3-compile-tp-gpu`` / ``3-compile-unet-gpu``: the Llama model of ``dtshard.models`` under
   ``dtshard.parallel``'s tensor + sequence parallel plan, and the H-sharded UNet, on a 1-rank
   NCCL mesh, ``torch.compile(fullgraph=True, backend="inductor")`` vs the same model in eager
   dtshard: 5 training steps, losses and weights agree (fp32, TF32 off), one frame compiled, no
   graph break.
4. ``4-triton-e2e-gpu``: ``DTSHARD_KERNELS=triton`` against ``DTSHARD_KERNELS=reference`` through
   dtshard itself on CUDA tensors (1-rank NCCL mesh): redistributes and an H-sharded convolution
   (its halo exchange pads with ``halo_cat``) forward and backward; results equal, and the Triton
   ops were really called.  One GPU allows only world size 1 (NCCL refuses two ranks on one GPU),
   where a redistribute moves nothing, so the multi-rank packing paths run in ``4-triton-e2e-interp``.
5. ``5-attention-cp``: ``bench_attention_cp.py`` (``CP_ARGS``: S = 4K and 8K, 4 ranks, MHA) on the
   machine's CPU cores: every context-parallel strategy's step, bytes and peak memory per rank
   against one process (CPU tensors on gloo: one GPU cannot hold several NCCL ranks).  It runs
   only where CUDA is (sized for a GPU host's cores; on the 2-core development machine run the
   script itself); it runs after every other section, on the budget they leave, and is skipped
   (not failed) when none is left (``--only 5-`` runs it alone).
6. ``6-attention-cuda``: the CUDA fused attention kernels (flash, efficient, cuDNN) that SDPA runs
   on a GPU, called as the context-parallel strategies call them (4x4 blocks through the kernel
   adapters of ``rules/attention_cp.py``, merged by log-sum-exp; each block's backward with the
   whole output and log-sum-exp) against one call of the same kernel, and SDPA on sequence- and
   head-sharded DTensors of a 1-rank NCCL mesh against plain tensors.  The CPU suite runs the same
   paths on CPU stand-ins of these kernels (``tests/distributed/test_sdpa_cuda_kernels.py``).

Always run (any machine): ``2-bench-cli`` (``bench_kernels.py --quick`` as a smoke run, on the GPU
if there is one) and ``4-triton-e2e-interp`` (the workload of 4 on 2 gloo ranks, CPU tensors,
Triton's interpreter: every redistribute packing path and a real halo exchange).

Without CUDA the GPU sections print ``SKIP (no CUDA device: torch.cuda.is_available() is False)``
and their CPU stand-ins run: ``1-kernels-interp`` (the kernel tests in the interpreter),
``3-compile-tp-cpu`` / ``3-compile-unet-cpu`` (gloo, world size 1, ``aot_eager`` by default:
``--cpu-compile-backend inductor`` for the real compiler).  On a GPU machine the stand-ins print
SKIP unless ``--with-cpu``.

Every section runs in its own process (Triton's interpreter is chosen per process; a hung or
crashed section cannot take the others down) with a timeout; the table has one row per check:
section, result (PASS / FAIL / SKIP (reason)), numbers, target, met?.  Exit status: 0 all ran
sections passed and met their targets, 1 a section failed, timed out or was not reached within
the budget, 2 none failed but a performance target was missed.

    bash benchmarks/gpu_check.sh                       # everything (from any directory)
    bash benchmarks/gpu_check.sh --only 2-bw,2-bench   # sections whose name starts with these
    bash benchmarks/gpu_check.sh --budget 300 --with-cpu --json /tmp/gpu_check.json

This checkout's ``dtshard`` and ``dtshard_kernels`` (its root and ``kernels/`` first on ``PYTHONPATH``) are used,
installed or not.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from _checkout import free_port  # noqa: E402  (benchmarks/: run as a script)


HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
KERNEL_TESTS = "tests/kernels/test_triton_interpret.py"
BW_TARGET = 0.85
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False"
OPS = ("pack", "unpack", "a2a_pack", "a2a_unpack", "slice_copy", "halo_cat", "halo_split")


def _row(section, result, numbers="", target="", met=None) -> dict:
    return {"section": section, "result": result, "numbers": numbers, "target": target, "met": met}


# =============================================================================================
# helpers used inside section processes
# =============================================================================================


def _init_world_of_one(backend: str) -> None:
    """A 1-rank default process group on a TCP store on 127.0.0.1 (NCCL on the GPU, gloo on CPU)."""
    import torch

    from dtshard import collectives as C

    if backend == "nccl":
        torch.cuda.set_device(0)
    C.init_process_group(backend, timeout_s=120, init_method=f"tcp://127.0.0.1:{free_port()}",
                         rank=0, world_size=1)


def _strict_fp32() -> None:
    """fp32 everywhere (no TF32 in matmuls or cuDNN convolutions), deterministic cuDNN: eager and
    compiled (or reference and Triton) runs are then comparable to fp32 rounding."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def _scaled_dev(a, b) -> float:
    """max |a - b| / max |b| over pairs of (D)tensors."""
    worst = 0.0
    for p, q in zip(a, b):
        p, q = (t.detach().full_tensor() if hasattr(t, "full_tensor") else t.detach() for t in (p, q))
        worst = max(worst, ((p - q).abs().max() / q.abs().max().clamp_min(1e-12)).item())
    return worst


def _graph_breaks() -> dict:
    from torch._dynamo.utils import counters

    return {str(k): v for k, v in counters["graph_break"].items()}


# =============================================================================================
# sections 1: the kernel tests (pytest, in parallel shards)
# =============================================================================================


class _ShardPlugin:
    """pytest plugin: keep the k-th of n contiguous slices of the collected tests (neighbouring
    cases share kernel specialisations, so contiguous slices compile fewer kernels twice)."""

    def __init__(self, k: int, n: int):
        self.k, self.n = k, n

    def pytest_collection_modifyitems(self, session, config, items):
        total = len(items)
        lo, hi = self.k * total // self.n, (self.k + 1) * total // self.n
        keep, drop = items[lo:hi], items[:lo] + items[hi:]
        items[:] = keep
        if drop:
            config.hook.pytest_deselected(items=drop)
        self.line = f"gpu_check shard {self.k}/{self.n}: {len(keep)} of {total} tests"

    def pytest_terminal_summary(self, terminalreporter):
        terminalreporter.write_line(getattr(self, "line", "gpu_check shard: nothing collected"))


def _pytest_shard_main(spec: str, args: list[str]) -> int:
    import pytest

    k, n = (int(v) for v in spec.split("/"))
    return int(pytest.main(args, plugins=[_ShardPlugin(k, n)]))


def _run_pytest_shards(name: str, env_update: dict, n: int, deadline: float) -> list[dict]:
    """Run the kernel test module in ``n`` parallel pytest processes; one summary row."""
    env = dict(os.environ, **env_update)
    logdir = tempfile.mkdtemp(prefix="pytest_", dir=os.environ.get("GPU_CHECK_TMP"))
    procs = []
    t0 = time.time()
    for k in range(n):
        log = open(os.path.join(logdir, f"shard{k}.log"), "w+")
        cmd = [sys.executable, os.path.abspath(__file__), "--pytest-shard", f"{k}/{n}", "--",
               "-q", "-rfEs", "-p", "no:cacheprovider", KERNEL_TESTS]
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    timed_out = []
    for k, (p, _) in enumerate(procs):
        try:
            p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            timed_out.append(k)
    wall = time.time() - t0
    counts = {"passed": 0, "failed": 0, "skipped": 0, "error": 0}
    collected, bad = 0, []
    for k, (p, log) in enumerate(procs):
        log.seek(0)
        text = log.read()
        log.close()
        m = re.search(r"gpu_check shard \d+/\d+: (\d+) of (\d+) tests", text)
        if m:
            collected = int(m.group(2))
        # pytest's final line: "N passed, M skipped, K deselected in 12.3s"
        stats = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)\b.* in [\d.]+s", ln)]
        for key in counts:
            mm = re.search(rf"(\d+) {key}", stats[-1] if stats else "")
            if mm:
                counts[key] += int(mm.group(1))
        if p.returncode != 0:
            bad.append(k)
            print(f"---- {name}: shard {k}/{n} exited {p.returncode}"
                  f"{' (killed: time budget)' if k in timed_out else ''}; last lines of its log:")
            print("\n".join(text.strip().splitlines()[-40:]))
    ran = counts["passed"] + counts["failed"] + counts["skipped"]
    ok = not bad and counts["passed"] > 0 and ran == collected
    numbers = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['error']} errors, "
               f"{counts['skipped']} skipped of {collected} ({n} shard{'s' if n > 1 else ''}, {wall:.0f} s)")
    if timed_out:
        numbers += f"; shards {timed_out} killed at the time budget"
    return [_row(name, "PASS" if ok else "FAIL", numbers, "all == reference, bitwise", ok)]


def _shards(default: int) -> int:
    return int(os.environ.get("GPU_CHECK_SHARDS") or default)


def section_kernels_gpu(deadline: float) -> list[dict]:
    # The time goes into Triton compilations (CPU-bound, one per kernel specialisation: about 800
    # distinct launch signatures in this module), so the shards use most cores.
    n = _shards(max(1, min(12, (os.cpu_count() or 2) - 2)))
    return _run_pytest_shards("1-kernels-gpu", {"DTSHARD_KERNEL_TEST_DEVICE": "cuda", "TRITON_INTERPRET": "0"},
                              n, deadline)


def section_kernels_interp(deadline: float) -> list[dict]:
    n = _shards(max(1, min(4, (os.cpu_count() or 2) // 4)))
    return _run_pytest_shards("1-kernels-interp", {"DTSHARD_KERNEL_TEST_DEVICE": "cpu", "TRITON_INTERPRET": "1"},
                              n, deadline)


# =============================================================================================
# section 2: bandwidth vs a device-to-device copy
# =============================================================================================


def _bits(t):
    from dtshard_kernels.triton.copy_kernels import int_view_dtype

    return t.view(int_view_dtype(t.dtype))


def _same(a, b) -> bool:
    import torch

    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b))
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(_bits(a.contiguous()), _bits(b.contiguous()))


def _gpu_seconds(fn, iters: int = 10, reps: int = 7) -> float:
    """Median over ``reps`` of the GPU time of ``iters`` back-to-back calls, per call (the host
    runs ahead, so launch overhead is hidden whenever a call's GPU time exceeds it)."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / iters)
    return statistics.median(times)


def _bw_cases(x, backend):
    """bench_kernels' cases plus ``uneven_pad``: (name, fn, bytes moved, output bytes)."""
    import bench_kernels as B
    import dtshard_kernels as K

    dim, n = 1, 4
    out = [(name, kern, moved, out_bytes) for name, kern, _, moved, out_bytes in B.make_cases(x, dim, n, backend)]
    # redistribute's uneven all_gather pads the short chunk to the block length: one pack of 1 block
    length = x.shape[dim]
    block = length + 3
    out_bytes = x.numel() // length * block * x.element_size()
    out.append(("uneven_pad", lambda: K.pack(x, dim, [length], block, backend=backend),
                x.numel() * x.element_size() + out_bytes, out_bytes))
    return out


def section_bandwidth_gpu(deadline: float) -> list[dict]:
    import torch

    import dtshard_kernels.triton as KT  # compiled kernels: TRITON_INTERPRET is off in this process

    if KT.INTERPRETED:
        raise RuntimeError("dtshard_kernels.triton was built for the interpreter (TRITON_INTERPRET=1)")
    dev = torch.device("cuda")
    configs = [("fp32", torch.float32, 64), ("fp32", torch.float32, 1024), ("bf16", torch.bfloat16, 1024)]
    results: dict[str, list] = {}
    wrong: dict[str, str] = {}
    for label, dtype, mib in configs:
        numel = mib * 2**20 // torch.empty(0, dtype=dtype).element_size()
        length = numel // (16 * 64) - 1  # uneven over 4 blocks, as in bench_kernels.py
        x = torch.randn(16, length, 64, device=dev).to(dtype)
        cases = _bw_cases(x, "triton")
        refs = _bw_cases(x, "reference")
        for (name, kern, moved, out_bytes), (_, ref, _, _) in zip(cases, refs):
            if not _same(kern(), ref()):
                wrong[name] = f"{label} {mib} MiB output != reference"
            src = torch.empty(out_bytes, dtype=torch.uint8, device=dev)
            dst = torch.empty_like(src)
            t_k = _gpu_seconds(kern)
            t_c = _gpu_seconds(lambda: dst.copy_(src))
            k_gbs, c_gbs = moved / t_k / 1e9, 2 * out_bytes / t_c / 1e9
            results.setdefault(name, []).append((label, mib, k_gbs, c_gbs, k_gbs / c_gbs))
            print(f"  {name:<11} {label} {mib:>5} MiB  kernel {k_gbs:8.1f} GB/s  copy_ {c_gbs:8.1f} GB/s  "
                  f"{100 * k_gbs / c_gbs:5.1f} %", flush=True)
            del src, dst
        del x, cases, refs
        torch.cuda.empty_cache()
        if time.time() > deadline - 5:
            break
    rows = []
    for name, vals in results.items():
        big = [r for _, mib, _, _, r in vals if mib == max(m for _, _, m in configs)]
        numbers = ", ".join(f"{label} {mib} MiB {100 * r:.0f}% ({k:.0f}/{c:.0f} GB/s)"
                            for label, mib, k, c, r in vals)
        if name == "slice_copy":  # not among the targeted ops: reported only
            target, met = "(info)", None
        else:
            target = f">= {100 * BW_TARGET:.0f}% of copy_ at 1 GiB"
            met = bool(big) and min(big) >= BW_TARGET
        ok = name not in wrong
        rows.append(_row(f"2-bw-{name}", "PASS" if ok else "FAIL",
                         numbers + ("" if ok else f"; {wrong[name]}"), target, met if ok else False))
    return rows


def section_bench_cli(deadline: float) -> list[dict]:
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cmd = [sys.executable, os.path.join(HERE, "bench_kernels.py"), "--quick", "--device", dev]
    if dev == "cpu":
        cmd += ["--threads", "1"]
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, deadline - time.time()))
    print(p.stdout + p.stderr, flush=True)
    ratios = {}
    for line in p.stdout.splitlines():
        f = line.split()
        if f and f[0] in OPS and len(f) == 9:
            ratios[f[0]] = float(f[6])  # kernel/copy_
    ok = p.returncode == 0 and set(ratios) == set(OPS)
    backend = re.search(r"-> (\w+)", p.stdout)
    numbers = (f"{len(ratios)}/{len(OPS)} ops on {dev} ({backend.group(1) if backend else '?'}), 1 MiB: "
               f"kernel/copy_ {min(ratios.values(), default=0):.2f}-{max(ratios.values(), default=0):.2f}, "
               f"{time.time() - t0:.0f} s")
    if p.returncode:
        numbers += f"; exit {p.returncode}"
    return [_row("2-bench-cli", "PASS" if ok else "FAIL", numbers, "runs (smoke)", ok)]


# =============================================================================================
# section 3: compiled training steps on a 1-rank mesh vs eager dtshard
# =============================================================================================

_STEPS = 5
# inductor's fused kernels round differently from eager, and AdamW's normalised update turns
# rounding differences of small gradients into larger ones of the weights (CPU inductor: loss
# 7e-8, weights 2.4e-6 after 5 steps); a wrong sharding is off by O(1)
_LOSS_RTOL = {"cuda": 1e-4, "cpu": 1e-5}
_DEV_TOL = {"cuda": 1e-3, "cpu": 1e-5}


def _compile_tp(device: str, backend: str) -> list[dict]:
    import copy

    import torch
    import torch.nn.functional as F
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    import dtshard
    import dtshard.parallel
    from dtshard.models import LlamaConfig, Transformer, parallelize

    _init_world_of_one("nccl" if device == "cuda" else "gloo")
    _strict_fp32()
    torch._dynamo.reset()
    counters.clear()
    mesh = dtshard.init_device_mesh(device, (1,))
    ref = Transformer(LlamaConfig(n_layers=2)).to(device)
    eager = parallelize(copy.deepcopy(ref), mesh, dtshard.parallel)
    compiled = parallelize(copy.deepcopy(ref), mesh, dtshard.parallel)
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, ref.cfg.vocab_size, (4, 16), generator=g).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    plain_loss = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten(0, 1)).item()
    opt_e = torch.optim.AdamW(eager.parameters(), lr=2e-3, foreach=False)
    opt_c = torch.optim.AdamW(compiled.parameters(), lr=2e-3, foreach=False)
    cnt = CompileCounterWithBackend(backend)
    cmodel = torch.compile(compiled, backend=cnt, fullgraph=True)

    def fwd_bwd(model):
        loss = F.cross_entropy(model(inputs).flatten(0, 1), labels.flatten(0, 1))
        loss.backward()
        return loss.detach()

    losses, times = [], []
    for _ in range(_STEPS):
        with dtshard.parallel.loss_parallel():
            le = fwd_bwd(eager)
            t0 = time.time()
            lc = fwd_bwd(cmodel)
            if device == "cuda":
                torch.cuda.synchronize()
            times.append(time.time() - t0)
        opt_e.step()
        opt_c.step()
        opt_e.zero_grad()
        opt_c.zero_grad()
        losses.append((le.full_tensor().item(), lc.full_tensor().item()))
    return [_train_row(f"3-compile-tp-{'gpu' if device == 'cuda' else 'cpu'}", device, backend, losses, times,
                       cnt.frame_count, _graph_breaks(), _scaled_dev(compiled.parameters(), eager.parameters()),
                       plain_loss)]


def _train_row(name, device, backend, losses, times, frames, breaks, dev, plain_loss) -> dict:
    import torch

    eager = [a for a, _ in losses]
    comp = [b for _, b in losses]
    rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in losses)
    problems = []
    try:
        torch.testing.assert_close(comp, eager, rtol=_LOSS_RTOL[device], atol=1e-6)
    except AssertionError:
        problems.append(f"losses differ (max rel {rel:.1e})")
    if abs(eager[0] - plain_loss) > 1e-5 * max(1.0, abs(plain_loss)):
        problems.append(f"eager dtshard loss {eager[0]:.6f} != plain torch {plain_loss:.6f}")
    if not eager[-1] < eager[0]:
        problems.append("did not train")
    if breaks:
        problems.append(f"graph breaks {breaks}")
    if frames != 1:
        problems.append(f"{frames} frames compiled")
    if dev > _DEV_TOL[device]:
        problems.append(f"weights deviate {dev:.1e}")
    numbers = (f"{backend}, {len(losses)} steps, loss {eager[0]:.4f}->{eager[-1]:.4f}, max loss rel diff "
               f"{rel:.1e}, weight dev {dev:.1e}, {frames} frame, {sum(breaks.values()) if breaks else 0} breaks, "
               f"1st compiled step {times[0]:.1f} s, later {statistics.median(times[1:]) * 1e3:.1f} ms")
    if problems:
        numbers += "; " + "; ".join(problems)
    target = f"== eager (loss rtol {_LOSS_RTOL[device]:.0e}, weights {_DEV_TOL[device]:.0e}), 1 frame, 0 breaks"
    return _row(name, "FAIL" if problems else "PASS", numbers, target, not problems)


def _compile_unet(device: str, backend: str) -> list[dict]:
    import torch
    import torch.nn.functional as F
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    import dtshard
    from dtshard import Replicate, Shard
    from dtshard.spatial.halo import mesh_id
    from dtshard.models import unet, unet_params, unet_stats

    _init_world_of_one("nccl" if device == "cuda" else "gloo")
    _strict_fp32()
    torch._dynamo.reset()
    counters.clear()
    mesh = dtshard.init_device_mesh(device, (1,))
    mesh_id(mesh)  # register the mesh outside the traced code (see dtshard/spatial/halo.py)
    g = torch.Generator().manual_seed(1)
    h, w, up, lr = 16, 12, "x2", 0.05
    x_full = torch.randn(2, 3, h, w, generator=g).to(device)
    y_full = torch.randn(2, 2, h, w, generator=g).to(device)
    x = dtshard.distribute_tensor(x_full, mesh, [Shard(2)])
    y = dtshard.distribute_tensor(y_full, mesh, [Shard(2)])
    plain_p = {k: v.to(device).requires_grad_() for k, v in unet_params().items()}
    plain_loss = F.mse_loss(unet(x_full, plain_p, {k: v.to(device) for k, v in unet_stats().items()}, up),
                            y_full).item()

    def model():
        params = {k: dtshard.distribute_tensor(v.to(device), mesh, [Replicate()]).requires_grad_()
                  for k, v in unet_params().items()}
        return params, {k: dtshard.distribute_tensor(v.to(device), mesh, [Replicate()]) for k, v in unet_stats().items()}

    (p_e, s_e), (p_c, s_c) = model(), model()
    cnt = CompileCounterWithBackend(backend)
    cunet = torch.compile(unet, backend=cnt, fullgraph=True)

    def fwd_bwd(net, p, s):
        loss = F.mse_loss(net(x, p, s, up), y)
        loss.backward()
        return loss.detach()

    def sgd(p):
        with torch.no_grad():
            for t in p.values():
                t.sub_(lr * t.grad)
                t.grad.zero_()

    for p in list(p_e.values()) + list(p_c.values()):
        p.grad = torch.zeros_like(p)  # zeroed, never freed: every call sees the same guards
    losses, times = [], []
    for _ in range(_STEPS):
        le = fwd_bwd(unet, p_e, s_e)
        t0 = time.time()
        lc = fwd_bwd(cunet, p_c, s_c)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.time() - t0)
        sgd(p_e)
        sgd(p_c)
        losses.append((le.full_tensor().item(), lc.full_tensor().item()))
    dev = _scaled_dev(list(p_c.values()) + list(s_c.values()), list(p_e.values()) + list(s_e.values()))
    return [_train_row(f"3-compile-unet-{'gpu' if device == 'cuda' else 'cpu'}", device, backend, losses, times,
                       cnt.frame_count, _graph_breaks(), dev, plain_loss)]


def section_compile_tp_gpu(deadline):
    return _compile_tp("cuda", "inductor")


def section_compile_unet_gpu(deadline):
    return _compile_unet("cuda", "inductor")


def section_compile_tp_cpu(deadline):
    return _compile_tp("cpu", os.environ.get("GPU_CHECK_CPU_COMPILE_BACKEND", "aot_eager"))


def section_compile_unet_cpu(deadline):
    return _compile_unet("cpu", os.environ.get("GPU_CHECK_CPU_COMPILE_BACKEND", "aot_eager"))


# =============================================================================================
# section 4: DTSHARD_KERNELS=triton through dtshard vs DTSHARD_KERNELS=reference
# =============================================================================================


def _count_triton_calls(counts: dict) -> None:
    """Count calls of each dtshard_kernels.triton op (the public functions look them up on the
    module at every call, so wrapping the module attributes sees every use)."""
    import dtshard_kernels.triton as KT

    for name in OPS:
        real = getattr(KT, name)
        if getattr(real, "_gpu_check_wrapped", False):
            continue

        def wrapper(*args, _real=real, _name=name, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _real(*args, **kwargs)

        wrapper._gpu_check_wrapped = True
        setattr(KT, name, wrapper)


def _e2e_workload(mesh, device: str) -> dict:
    """Redistributes that pack (uneven all_gather on dim 1, all_to_all both ways, slice, uneven and
    even reduce_scatter on dim 1), the backward of one, and an H-sharded 3x3 convolution forward
    and backward (halo exchange).  Returns this rank's local results (CPU copies) and, for a
    sanity check against single-process torch, the full tensors of two of them."""
    import torch
    import torch.nn.functional as F

    from dtshard import DTensor, Partial, Replicate, Shard, distribute_tensor

    rank = mesh.get_coordinate()[0]
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 7, 3, generator=g).to(device)  # dim 1 uneven over 2 ranks
    b = torch.randn(5, 8, 3, generator=g).to(device)  # dim 1 even
    img = torch.randn(2, 3, 9, 6, generator=g).to(device)
    wgt = torch.randn(4, 3, 3, 3, generator=g).to(device)
    out = {}
    out["S1->R"] = distribute_tensor(a, mesh, [Shard(1)]).redistribute(mesh, [Replicate()])
    out["S0->S1"] = distribute_tensor(a, mesh, [Shard(0)]).redistribute(mesh, [Shard(1)])
    out["S1->S0"] = distribute_tensor(a, mesh, [Shard(1)]).redistribute(mesh, [Shard(0)])
    out["R->S1"] = distribute_tensor(a, mesh, [Replicate()]).redistribute(mesh, [Shard(1)])
    out["P->S1 uneven"] = DTensor.from_local(a * (rank + 1), mesh, [Partial()]).redistribute(mesh, [Shard(1)])
    out["P->S1 even"] = DTensor.from_local(b * (rank + 1), mesh, [Partial()]).redistribute(mesh, [Shard(1)])
    xs = distribute_tensor(a, mesh, [Shard(1)]).requires_grad_()
    (xs.redistribute(mesh, [Replicate()]) * distribute_tensor(a, mesh, [Replicate()])).sum().backward()
    out["grad S1->R"] = xs.grad
    xi = distribute_tensor(img, mesh, [Shard(2)]).requires_grad_()
    wi = distribute_tensor(wgt, mesh, [Replicate()]).requires_grad_()
    y = F.conv2d(xi, wi, padding=1)
    (y * y).sum().backward()
    out["conv"], out["conv grad x"], out["conv grad w"] = y, xi.grad, wi.grad
    local = {k: v.to_local().detach().cpu().clone() for k, v in out.items()}
    full = {"S1->R": out["S1->R"].full_tensor().cpu(), "conv": out["conv"].full_tensor().detach().cpu()}
    want = {"S1->R": a.cpu(), "conv": F.conv2d(img, wgt, padding=1).cpu()}
    return {"local": local, "full": full, "want": want}


def _e2e_compare(runs: dict) -> tuple[list[str], str]:
    """``runs``: backend -> list of workload results (two reference runs, one triton run).  Returns
    (problems, how the values matched)."""
    import torch

    problems, how = [], "bitwise"
    ref1, ref2 = runs["reference"]
    (tri,) = runs["triton"]
    for key, r in ref1["local"].items():
        t = tri["local"][key]
        if r.shape != t.shape or r.dtype != t.dtype:
            problems.append(f"{key}: {tuple(t.shape)} {t.dtype} vs {tuple(r.shape)} {r.dtype}")
        elif not torch.equal(r, t):
            if torch.equal(r, ref2["local"][key]):  # the reference is reproducible: so must triton be
                problems.append(f"{key}: triton != reference (max diff {(r - t).abs().max().item():.1e})")
            elif torch.allclose(r, t, rtol=1e-5, atol=1e-6):
                how = "bitwise where the reference reproduces itself, else rtol 1e-5"
            else:
                problems.append(f"{key}: triton != reference beyond rtol 1e-5")
    for key, want in ref1["want"].items():
        if not torch.allclose(ref1["full"][key], want, rtol=1e-5, atol=1e-5):
            problems.append(f"{key}: the reference run != single-process torch")
    return problems, how


def _e2e_rank(device: str) -> dict:
    """One rank of section 4: the workload with the reference (twice) and with DTSHARD_KERNELS=triton."""
    import torch.distributed as dist

    import dtshard

    mesh = dtshard.init_device_mesh(device, (dist.get_world_size(),))
    counts: dict = {}
    _count_triton_calls(counts)
    runs, calls = {}, {}
    try:
        for backend in ("reference", "reference", "triton"):
            os.environ["DTSHARD_KERNELS"] = backend  # read by dtshard_kernels at every call
            counts.clear()
            runs.setdefault(backend, []).append(_e2e_workload(mesh, device))
            calls.setdefault(backend, {}).update(counts)
    finally:
        os.environ.pop("DTSHARD_KERNELS", None)
    problems, how = _e2e_compare(runs)
    return {"problems": problems, "how": how, "calls": calls, "keys": len(runs["triton"][0]["local"])}


def _e2e_row(name: str, per_rank: list[dict], expected_ops: set, wall: float) -> dict:
    problems = []
    for r, res in enumerate(per_rank):
        problems += [f"rank {r}: {p}" for p in res["problems"]]
        if res["calls"].get("reference"):
            problems.append(f"rank {r}: triton ops called with DTSHARD_KERNELS=reference: {res['calls']['reference']}")
        missing = expected_ops - set(res["calls"].get("triton", {}))
        if missing:
            problems.append(f"rank {r}: triton ops never called: {sorted(missing)}")
    calls = per_rank[0]["calls"].get("triton", {})
    numbers = (f"{len(per_rank)} rank(s), {per_rank[0]['keys']} results per rank {per_rank[0]['how']}; "
               f"triton calls on rank 0: {', '.join(f'{k} {v}' for k, v in sorted(calls.items())) or 'none'}; "
               f"{wall:.0f} s")
    if problems:
        numbers += "; " + "; ".join(problems[:6])
    return _row(name, "FAIL" if problems else "PASS", numbers, "triton == reference; triton ops used", not problems)


def section_e2e_gpu(deadline):
    import dtshard_kernels.triton as KT

    if KT.INTERPRETED:
        raise RuntimeError("dtshard_kernels.triton was built for the interpreter (TRITON_INTERPRET=1)")
    t0 = time.time()
    _init_world_of_one("nccl")
    _strict_fp32()
    res = _e2e_rank("cuda")
    # one rank: every redistribute is the identity; the convolution's halo_exchange still pads
    # the window with halo_cat (forward and backward)
    return [_e2e_row("4-triton-e2e-gpu", [res], {"halo_cat"}, time.time() - t0)]


def _e2e_interp_worker():
    return _e2e_rank("cpu")


def section_e2e_interp(deadline):
    import gpu_check  # this file as a module: the harness pickles the worker function by reference
    from dtshard.testing import run_distributed

    t0 = time.time()
    per_rank = run_distributed(gpu_check._e2e_interp_worker, 2, timeout=max(10.0, deadline - time.time() - 5))
    return [_e2e_row("4-triton-e2e-interp", per_rank, set(OPS) - {"halo_split"}, time.time() - t0)]


# =============================================================================================
# section 5: context-parallel attention (bench_attention_cp.py) on the GPU machine's CPU cores
# =============================================================================================

# S = 4K and 8K on 4 gloo ranks, MHA (every strategy applies): a configuration the 2-core
# development machine cannot time, a minute or two on 16 cores
CP_ARGS = ["--seqs", "4096,8192", "--ranks", "4", "--reps", "1", "--heads", "mha"]


def _sdpa_ops_on_cuda() -> list[str]:
    """The aten ops ``F.scaled_dot_product_attention`` dispatches to on CUDA tensors (a tiny causal
    call under a dispatch mode, forward and backward)."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode

    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "attention" in func.name():
                seen.append(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    q, k, v = (torch.randn(1, 8, 256, 64, device="cuda", requires_grad=True) for _ in range(3))
    with Ops():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    return sorted(set(seen))


def section_attention_cp(deadline: float) -> list[dict]:
    """bench_attention_cp.py at CP_ARGS (CPU tensors, gloo)."""
    cmd = [sys.executable, os.path.join(HERE, "bench_attention_cp.py")] + CP_ARGS
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=max(1.0, deadline - time.time()))
    print(p.stdout + p.stderr[-4000:], flush=True)
    rows = [line for line in p.stdout.splitlines() if re.match(r"\| \d+ \| \d+ \|", line)]
    peaks = []
    for line in rows:
        f = [c.strip() for c in line.strip("|").split("|")]
        if len(f) >= 13 and f[12] not in ("-", ""):
            peaks.append(float(f[12]))  # peak / one process
    ok = p.returncode == 0 and bool(rows)
    numbers = (f"{len(rows)} strategy rows ({' '.join(CP_ARGS)}) on CPU gloo ranks, {time.time() - t0:.0f} s"
               + (f"; peak/rank / one process {min(peaks):.2f}-{max(peaks):.2f}" if peaks else ""))
    if p.returncode:
        numbers += f"; exit {p.returncode}"
    return [_row("5-attention-cp", "PASS" if ok else "FAIL", numbers, "runs (CPU tensors)", ok)]


# =============================================================================================
# section 6: the CUDA attention kernels as context parallelism calls them
# =============================================================================================


def _attention_block_rows(device: str, L: int = 512) -> list[dict]:
    """Section 6's block checks (on ``device``: "cpu" runs them on the CPU suite's stand-ins)."""
    import torch

    from dtshard.rules import attention_cp as A

    rows_out = []
    g = torch.Generator(device=device).manual_seed(0)
    B, H, E, n = 2, 8, 64, 4
    for kind, dtype, causal, windowed in [("flash", torch.bfloat16, False, False),
                                          ("flash", torch.bfloat16, True, False),
                                          ("efficient", torch.float32, True, False),
                                          ("efficient", torch.float32, False, True),
                                          ("cudnn", torch.bfloat16, True, False)]:
        fwd = {"flash": torch.ops.aten._scaled_dot_product_flash_attention.default,
               "efficient": torch.ops.aten._scaled_dot_product_efficient_attention.default,
               "cudnn": torch.ops.aten._scaled_dot_product_cudnn_attention.default}[kind]
        kern = A._FAMILIES[fwd].kernel
        q, k, v, go = (torch.randn(B, H, L, E, device=device, dtype=dtype, generator=g) for _ in range(4))
        mask = None
        if windowed:
            i = torch.arange(L, device=device)
            keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < L // 5)
            mask = torch.zeros(L, L, device=device, dtype=dtype).masked_fill(~keep, float("-inf"))
        name = f"{kind} {str(dtype)[6:]}{' causal' if causal else ''}{' window' if windowed else ''}"
        try:
            want, want_lse = kern(q, k, v, 0.0, causal, attn_mask=mask)
            wq, wk, wv = kern.backward(go, q, k, v, want, want_lse, 0.0, causal, attn_mask=mask)
            chunk = L // n
            outs, lses = [], []
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            for r in range(n):
                rows = ((r * chunk, (r + 1) * chunk),)
                ql = q[..., r * chunk:(r + 1) * chunk, :]
                merge = A._Merge(ql, E, torch.float32)
                for c in range(n):
                    keys = ((c * chunk, (c + 1) * chunk),)
                    kb, vb = k[..., c * chunk:(c + 1) * chunk, :], v[..., c * chunk:(c + 1) * chunk, :]
                    # (the whole mask: _forward_block slices it by global positions)
                    A._forward_block(kern, merge, ql, kb, vb, rows, keys, causal, None, mask)
                o, lse = merge.result()
                outs.append(o)
                lses.append(lse)
            out, lse = torch.cat(outs, -2), torch.cat(lses, -1)
            for r in range(n):
                sl = slice(r * chunk, (r + 1) * chunk)
                rows = ((r * chunk, (r + 1) * chunk),)
                for c in range(n):
                    keys = ((c * chunk, (c + 1) * chunk),)
                    cs = slice(c * chunk, (c + 1) * chunk)
                    A._backward_block(kern.backward, (dq[..., sl, :], dk[..., cs, :], dv[..., cs, :]), go[..., sl, :],
                                      q[..., sl, :], k[..., cs, :], v[..., cs, :], want[..., sl, :],
                                      want_lse[..., sl], rows, keys, causal, None, mask)
            errs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                    for a, b in ((out, want), (lse, want_lse), (dq, wq), (dk, wk), (dv, wv))]
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
            ok = max(errs) < tol
            rows_out.append(_row("6-attention-cuda", "PASS" if ok else "FAIL",
                                 f"{name}: 4x4 blocks vs one call, max rel err out/lse/dq/dk/dv "
                                 + " ".join(f"{e:.1e}" for e in errs), f"< {tol:g}", ok))
        except Exception as e:  # noqa: BLE001 - reported in the table
            traceback.print_exc()
            rows_out.append(_row("6-attention-cuda", "FAIL", f"{name}: {type(e).__name__}: {str(e)[:200]}",
                                 "runs", False))
    return rows_out


def section_attention_cuda(deadline: float) -> list[dict]:
    """The CUDA fused kernels (flash, efficient, cuDNN) called as ``rules/attention_cp.py``'s
    strategies call them: q's rows and the keys cut into 4 chunks, every (row chunk, key chunk)
    block through the kernel adapter (causal blocks square, the efficient kernel's padded
    log-sum-exp, an aligned bias) merged through the log-sum-exps, and the backward of each block
    with the whole output and log-sum-exp: against one call of the same kernel (bf16; fp32 for
    efficient).  Then ``F.scaled_dot_product_attention`` on sequence-sharded DTensors of a 1-rank
    NCCL mesh (the handlers and rules of those ops, forward and backward) against plain tensors."""
    import torch
    import torch.nn.functional as F

    import dtshard

    t0 = time.time()
    rows_out = _attention_block_rows("cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    # SDPA on DTensors of a 1-rank NCCL mesh: the CUDA ops' handlers and rules end to end
    try:
        _init_world_of_one("nccl")
        mesh = dtshard.init_device_mesh("cuda", (1,))
        q, k, v, go = (torch.randn(2, 8, 256, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*ref, is_causal=True)
        want.backward(go)
        errs = []
        for placements in ([dtshard.Shard(2)], [dtshard.Shard(1)]):
            dts = [dtshard.distribute_tensor(t, mesh, placements).requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*dts, is_causal=True)
            out.backward(dtshard.distribute_tensor(go, mesh, placements))
            for a, b in zip([out] + [d.grad for d in dts], [want] + [r.grad for r in ref]):
                errs.append(((a.full_tensor().float() - b.float()).abs().max() / b.float().abs().max()).item())
        ok = max(errs) < 1e-2
        rows_out.append(_row("6-attention-cuda", "PASS" if ok else "FAIL",
                             f"SDPA on DTensors (1-rank NCCL mesh, S(2) and S(1)), ops {', '.join(_sdpa_ops_on_cuda())}: "
                             f"max rel err {max(errs):.1e}", "< 0.01", ok))
    except Exception as e:  # noqa: BLE001
        traceback.print_exc()
        rows_out.append(_row("6-attention-cuda", "FAIL", f"SDPA on DTensors: {type(e).__name__}: {str(e)[:200]}",
                             "runs", False))
    print(f"6-attention-cuda: {time.time() - t0:.0f} s", flush=True)
    return rows_out


# =============================================================================================
# the driver
# =============================================================================================

# name, kind ("cuda": needs a GPU; "cpu": stand-in run only without one, or with --with-cpu;
# "any": always), cap in seconds, environment updates, function
_INTERP = {"TRITON_INTERPRET": "1"}
_COMPILED = {"TRITON_INTERPRET": None}
SECTIONS = [
    ("1-kernels-gpu", "cuda", 300, _COMPILED, section_kernels_gpu),  # runs last: gets what is left
    ("1-kernels-interp", "cpu", 120, _INTERP, section_kernels_interp),
    ("2-bw", "cuda", 90, _COMPILED, section_bandwidth_gpu),
    ("2-bench-cli", "any", 60, _COMPILED, section_bench_cli),
    ("3-compile-tp-gpu", "cuda", 150, _COMPILED, section_compile_tp_gpu),
    ("3-compile-unet-gpu", "cuda", 120, _COMPILED, section_compile_unet_gpu),
    ("3-compile-tp-cpu", "cpu", 120, _COMPILED, section_compile_tp_cpu),
    ("3-compile-unet-cpu", "cpu", 90, _COMPILED, section_compile_unet_cpu),
    ("4-triton-e2e-gpu", "cuda", 90, _COMPILED, section_e2e_gpu),
    ("4-triton-e2e-interp", "any", 120, _INTERP, section_e2e_interp),
    ("5-attention-cp", "cuda", 180, _COMPILED, section_attention_cp),  # CPU work; sized for a GPU host's cores
    ("6-attention-cuda", "cuda", 90, _COMPILED, section_attention_cuda),
]
_BY_NAME = {s[0]: s for s in SECTIONS}
OPTIONAL = {"5-attention-cp"}  # skipped, not failed, when the budget does not reach it
# Run order (the table keeps the order above): the kernel tests, whose time depends most on the
# machine (one Triton compilation per kernel specialisation), go last, so that a slow compile
# cannot starve the other sections of the time budget.
# 5-attention-cp (CPU work, added last) runs after them, on what is left: it cannot starve the others.
RUN_ORDER = ([s[0] for s in SECTIONS if s[0][:2] not in ("1-", "5-")] + [s[0] for s in SECTIONS if s[0].startswith("1-")]
             + [s[0] for s in SECTIONS if s[0].startswith("5-")])


def _run_section_here(name: str, deadline: float, result_path: str) -> int:
    """Inside the section's own process: run it, write its rows as JSON."""
    fn = _BY_NAME[name][4]
    try:
        rows = fn(deadline)
    except BaseException as e:  # noqa: BLE001 - reported in the table
        traceback.print_exc()
        rows = [_row(name, "FAIL", f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", "", False)]
    with open(result_path, "w") as f:
        json.dump(rows, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown (process groups, worker pools): the rows are written


def _print_table(rows: list[dict]) -> None:
    def met(v):
        return "-" if v is None else ("yes" if v else "NO")

    cols = [("section", lambda r: r["section"]), ("result", lambda r: r["result"]),
            ("numbers", lambda r: r["numbers"]), ("target", lambda r: r["target"]), ("met?", lambda r: met(r["met"]))]
    # the numbers go last on the line so that long ones do not push the other columns around
    order = [0, 1, 4, 3, 2]
    widths = {i: max([len(cols[i][0])] + [len(cols[i][1](r)) for r in rows]) for i in order[:-1]}
    head = "  ".join(cols[i][0].ljust(widths[i]) for i in order[:-1]) + "  " + cols[2][0]
    print("\n" + "=" * 30 + " gpu_check summary " + "=" * 30)
    print(head)
    print("-" * min(160, max(len(head), 100)))
    for r in rows:
        print("  ".join(cols[i][1](r).ljust(widths[i]) for i in order[:-1]) + "  " + r["numbers"])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--budget", type=float, default=480.0, help="seconds for the whole run (default 480)")
    p.add_argument("--only", default="", help="comma-separated prefixes of section names to run")
    p.add_argument("--with-cpu", action="store_true", help="also run the CPU stand-ins on a GPU machine")
    p.add_argument("--cpu-compile-backend", default="aot_eager", choices=["aot_eager", "inductor"],
                   help="backend of the CPU stand-ins of section 3 (default aot_eager)")
    p.add_argument("--shards", type=int, default=0,
                   help="parallel pytest processes for the kernel tests (default: GPU run cores-2 up to 12, CPU cores/4)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    # internal: run one section / one pytest shard in this process
    p.add_argument("--section", default=None, help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    p.add_argument("--pytest-shard", default=None, help=argparse.SUPPRESS)
    p.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.pytest_shard:
        return _pytest_shard_main(args.pytest_shard, [a for a in args.rest if a != "--"])
    if args.section:
        return _run_section_here(args.section, args.deadline, args.result)
    if args.rest:
        p.error(f"unrecognized arguments: {' '.join(args.rest)}")

    t_start = time.time()
    deadline = t_start + args.budget
    import torch  # only for the header and the CUDA probe; the sections run in their own processes

    cuda = torch.cuda.is_available()
    try:
        import triton

        triton_v = triton.__version__
    except Exception as e:  # noqa: BLE001
        triton_v = f"not importable ({type(e).__name__})"
    print(f"gpu_check  {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}  host {platform.node()}  "
          f"python {platform.python_version()}  torch {torch.__version__}  triton {triton_v}")
    print(f"  checkout {ROOT}; device: {torch.cuda.get_device_name(0) if cuda else 'no CUDA device'}; "
          f"budget {args.budget:.0f} s")

    tmp = tempfile.mkdtemp(prefix="gpu_check_")
    base_env = dict(os.environ)
    base_env["PYTHONPATH"] = os.pathsep.join([ROOT, os.path.join(ROOT, "kernels"), HERE] + [v for v in [os.environ.get("PYTHONPATH")] if v])
    base_env.pop("DTSHARD_KERNELS", None)  # section 4 sets it; the others use the default (auto)
    base_env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    base_env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    base_env["GPU_CHECK_CPU_COMPILE_BACKEND"] = args.cpu_compile_backend
    base_env["GPU_CHECK_SHARDS"] = str(args.shards or "")
    base_env["PYTHONUNBUFFERED"] = "1"
    base_env["GPU_CHECK_TMP"] = tmp  # removed at the end, with the logs of the pytest shards
    try:
        return _run_sections(args, cuda, deadline, t_start, tmp, base_env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run_sections(args, cuda: bool, deadline: float, t_start: float, tmp: str, base_env: dict) -> int:
    only = [s.strip() for s in args.only.split(",") if s.strip()]

    rows: list[dict] = []
    unrun: list[str] = []  # sections the time budget did not reach
    for name in RUN_ORDER:
        _, kind, cap, env_update, _ = _BY_NAME[name]
        if only and not any(name.startswith(o) for o in only):
            continue
        if kind == "cuda" and not cuda:
            print(f"\n== {name}: SKIP ({NO_CUDA})")
            rows.append(_row(name, f"SKIP ({NO_CUDA})"))
            continue
        if kind == "cpu" and cuda and not args.with_cpu:
            reason = "CPU stand-in: its GPU section runs instead; --with-cpu runs both"
            print(f"\n== {name}: SKIP ({reason})")
            rows.append(_row(name, f"SKIP ({reason})"))
            continue
        left = deadline - time.time()
        if left < 15:
            reason = f"time budget of {args.budget:.0f} s spent"
            print(f"\n== {name}: SKIP ({reason})")
            if name in OPTIONAL:  # runs on what the others leave: not reaching it is no failure
                rows.append(_row(name, f"SKIP ({reason}; --only {name} runs it alone)"))
                continue
            rows.append(_row(name, f"SKIP ({reason})", "", "", False))
            unrun.append(name)
            continue
        timeout = min(cap, left - 3)
        print(f"\n== {name} (limit {timeout:.0f} s)", flush=True)
        env = dict(base_env)
        for k, v in env_update.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        result = os.path.join(tmp, f"{name}.json")
        t0 = time.time()
        cmd = [sys.executable, os.path.abspath(__file__), "--section", name, "--deadline", str(t0 + timeout - 2),
               "--result", result]
        # its own session: on a timeout the whole process group (pytest shards, harness workers)
        # is killed
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        dt = time.time() - t0
        if os.path.exists(result):
            with open(result) as f:
                got = json.load(f)
        elif rc is None:
            got = [_row(name, "FAIL", f"timed out after {dt:.0f} s (limit {timeout:.0f} s)", "", False)]
        else:
            got = [_row(name, "FAIL", f"section process exited {rc} without a result", "", False)]
        for r in got:
            print(f"   {r['section']}: {r['result']}  {r['numbers']}")
        rows += got
        try:  # leftovers of the section (its own session, so only processes this run started)
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    rank = {name: k for k, (name, *_) in enumerate(SECTIONS)}
    rows.sort(key=lambda r: rank.get(r["section"], rank.get("2-bw") if r["section"].startswith("2-bw") else len(rank)))
    _print_table(rows)
    total = time.time() - t_start
    failed = [r["section"] for r in rows if r["result"] == "FAIL"]
    missed = [r["section"] for r in rows if r["result"] == "PASS" and r["met"] is False]
    print(f"\n{len(rows)} checks in {total:.0f} s: {sum(r['result'] == 'PASS' for r in rows)} passed, "
          f"{len(failed)} failed{(': ' + ', '.join(failed)) if failed else ''}, "
          f"{sum(r['result'].startswith('SKIP') for r in rows)} skipped"
          + (f"; targets missed: {', '.join(missed)}" if missed else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "seconds": total, "cuda": cuda}, f, indent=1)
    if unrun:
        print(f"not reached within the time budget: {', '.join(unrun)}")
    return 1 if failed or unrun else (2 if missed else 0)


if __name__ == "__main__":
    sys.exit(main())
