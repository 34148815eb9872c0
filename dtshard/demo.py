"""Tensor-parallel training demo: dtshard vs the same model in one process.

    python -m dtshard.demo                       # spawns 2 CPU processes (gloo)
    python -m dtshard.demo --steps 10 --world-size 4
    python -m dtshard.demo --model llama         # the Llama-style model of dtshard.models, AdamW
    python -m dtshard.demo --model llama --fsdp  # the same with FSDP (dtshard.fsdp.fully_shard), 2 ranks
    python -m dtshard.demo --dp 2 --tp 2         # FSDP x TP on a 2x2 (dp, tp) mesh, 4 ranks
    python -m dtshard.demo --model cnn           # the UNet of dtshard.models, images sharded on H
    python -m dtshard.demo --model unet3d        # a 3-D UNet, volumes sharded on D x H (2x2, 4 ranks)
    python -m dtshard.demo --model unet3d --world-size 2   # ... sharded on D over 2 ranks
    torchrun --nproc-per-node 2 -m dtshard.demo  # or let torchrun start the ranks

The default model (``--model block``): a transformer block (layer_norm -> multi-head self-attention
with heads sharded -> residual -> layer_norm -> MLP -> residual) is written once, as ordinary
``torch.nn`` code.  Every rank builds it from the same seed twice: once as a plain single-process
model (the reference) and once with its parameters turned into dtshard DTensors the Megatron way:

- column-parallel (``Shard(0)`` weight and bias): attention q/k/v projections, MLP fc1;
- row-parallel (``Shard(1)`` weight, replicated bias): attention output projection, MLP fc2;
- replicated: layer_norm weights and biases.

Both models train for a few SGD steps on an mse_loss against a fixed target.  Each step prints both
losses, the largest deviation of the loss and of every weight (``full_tensor()`` of each DTensor
parameter against the plain parameter, on every rank) and the collectives dtshard issued (counted by
``dtshard.debug.CommCounter``).  The exit status is non-zero when a deviation exceeds the tolerance
or anything fails.

The model code uses only ``torch`` and the public dtshard API that mirrors
``torch.distributed.tensor`` (``distribute_tensor``, ``distribute_module``, ``Shard``,
``Replicate``, ``init_device_mesh``): replace ``dtshard`` by ``torch.distributed.tensor`` in the
imports of :func:`shard_block` and it runs on PyTorch's DTensor.

``--model llama``: the Llama-style decoder of :mod:`dtshard.models` (RMSNorm, rotary embeddings,
grouped-query attention, SwiGLU, an untied LM head) parallelized with torchtitan's tensor +
sequence parallel plan through ``dtshard.parallel`` (PyTorch's ``parallelize_module`` API), trained
with ``torch.optim.AdamW`` on a next-token cross-entropy computed under ``loss_parallel()`` (the
logits stay sharded on the vocabulary).  When the k/v heads divide by the number of ranks the
projections hand local shards to the attention body (torchtitan's plan); otherwise (4 ranks, 2 k/v
heads) the plan keeps DTensors throughout and attention runs on DTensors.

``--model cnn``: the UNet of :mod:`dtshard.models` trained with plain SGD, with the images sharded
on H (convolutions and pooling exchange halos with their neighbours).

``--model unet3d``: :class:`dtshard.models.UNet3d` (conv3d, GroupNorm, SiLU, strided-conv
downsampling, transposed-conv upsampling, skip concatenation) trained with SGD on volumes sharded
on D x H over a 2x2 mesh (4 ranks, the default for this model) or on D (any other world size),
parameters replicated; per step the halo exchanges and their bytes, and at the end each rank's
peak activation memory of one forward + backward against one process's.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dtshard
from dtshard import Replicate, Shard, distribute_module, distribute_tensor, init_device_mesh
from dtshard.debug import CommCounter, peak_alloc_bytes
from dtshard.spec import placements_str
from dtshard.models import train_unet, unet_params, unet_stats
from dtshard.models import UNet3d
import dtshard.parallel
from dtshard.fsdp import fully_shard
from dtshard.models import LlamaConfig, Transformer, parallelize
from dtshard.testing import DistributedTestError, launch

# Tolerance of the comparison with the single-process model (float32): |a - b| <= ATOL + RTOL * |b|
RTOL = 1e-5
ATOL = 1e-6


@dataclass(frozen=True)
class Config:
    batch: int = 2
    seq: int = 8
    dim: int = 16
    heads: int = 4
    hidden: int = 64
    lr: float = 0.1
    momentum: float = 0.9
    seed: int = 0


# ---------------------------------------------------------------------------------------------
# The model: plain torch.nn code, nothing dtshard-specific
# ---------------------------------------------------------------------------------------------


class SelfAttention(nn.Module):
    """Causal multi-head self-attention written with plain ops (no sdpa)."""

    def __init__(self, dim: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.register_buffer("causal", torch.ones(seq, seq).tril())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        hd = d // self.heads
        # (b, t, d) -> (b, heads, t, hd): with q/k/v column-parallel, each rank holds its heads
        q = self.q(x).view(b, t, self.heads, hd).transpose(1, 2)
        k = self.k(x).view(b, t, self.heads, hd).transpose(1, 2)
        v = self.v(x).view(b, t, self.heads, hd).transpose(1, 2)
        scores = q @ k.transpose(-2, -1) / math.sqrt(hd)
        scores = scores.masked_fill(self.causal[:t, :t] == 0, float("-inf"))
        attn = torch.softmax(scores, dim=-1)
        y = (attn @ v).transpose(1, 2).reshape(b, t, d)
        return self.o(y)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.attn = SelfAttention(cfg.dim, cfg.heads, cfg.seq)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.mlp = MLP(cfg.dim, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


COLWISE = ("attn.q", "attn.k", "attn.v", "mlp.fc1")
ROWWISE = ("attn.o", "mlp.fc2")


def shard_block(block: Block, mesh) -> Block:
    """Megatron-style tensor parallelism with the torch.distributed.tensor API."""

    def partition(name: str, module: nn.Module, mesh) -> None:
        if name in COLWISE:  # output features split: weight rows and bias
            module.weight = nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(0)]))
            module.bias = nn.Parameter(distribute_tensor(module.bias, mesh, [Shard(0)]))
        elif name in ROWWISE:  # input features split: weight columns; the bias is added once
            module.weight = nn.Parameter(distribute_tensor(module.weight, mesh, [Shard(1)]))
            module.bias = nn.Parameter(distribute_tensor(module.bias, mesh, [Replicate()]))
        # everything else (layer norms, the causal mask buffer) is replicated by distribute_module

    return distribute_module(block, mesh, partition)


# ---------------------------------------------------------------------------------------------
# One rank's work
# ---------------------------------------------------------------------------------------------


# column order and short names of the collective kinds in the step table
_KINDS = {"all_reduce": "AR", "all_gather": "AG", "reduce_scatter": "RS", "all_to_all": "A2A",
          "broadcast": "BC"}


def _deviation(rs: list) -> tuple:
    """One step's ``(|d loss|, max |d W|, within tolerance)`` over every rank's row (the spatial
    demos' check against one process)."""
    dl = max(abs(r["loss"] - r["ref"]) for r in rs)
    dw = max(r["dev_w"] for r in rs)
    return dl, dw, dl <= 1e-6 + 1e-5 * abs(rs[0]["ref"]) and dw <= 1e-5


def _max_dev(got: torch.Tensor, want: torch.Tensor) -> tuple[float, float]:
    """(max |got - want|, max |got - want| / (ATOL + RTOL |want|)): the second is <= 1 when ok."""
    diff = (got.detach().double() - want.detach().double()).abs()
    if diff.numel() == 0:
        return 0.0, 0.0
    ratio = diff / (ATOL + RTOL * want.detach().double().abs())
    return diff.max().item(), ratio.max().item()


def _params_summary(ref: nn.Module, model: nn.Module) -> list[tuple]:
    rows = []
    for (name, p), (_, dp) in zip(ref.named_parameters(), model.named_parameters()):
        rows.append((name, tuple(p.shape), dtshard_placements(dp), tuple(dp.to_local().shape)))
    return rows


def dtshard_placements(t) -> str:
    return placements_str(t.placements)


def train_worker(cfg: Config, steps: int) -> dict:
    """Train the plain and the sharded model side by side on this rank; return the records."""
    world = dist.get_world_size()
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (world,))

    torch.manual_seed(cfg.seed)
    ref = Block(cfg)  # identical on every rank: same seed
    x = torch.randn(cfg.batch, cfg.seq, cfg.dim)
    target = torch.randn(cfg.batch, cfg.seq, cfg.dim)

    model = shard_block(copy.deepcopy(ref), mesh)
    dx = distribute_tensor(x, mesh, [Replicate()])
    dtarget = distribute_tensor(target, mesh, [Replicate()])

    opt_ref = torch.optim.SGD(ref.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    names = [n for n, _ in ref.named_parameters()]

    rows = []
    breakdown = None
    for step in range(1, steps + 1):
        # single process
        opt_ref.zero_grad(set_to_none=True)
        loss_ref = F.mse_loss(ref(x), target)
        loss_ref.backward()
        opt_ref.step()

        # tensor parallel (the same lines, on DTensors)
        opt.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with CommCounter() as c_fwd:
            loss = F.mse_loss(model(dx), dtarget)
        with CommCounter() as c_bwd:
            loss.backward()
        with CommCounter() as c_opt:
            opt.step()
        step_s = time.perf_counter() - t0

        # compare (outside the counters: full_tensor() gathers)
        loss_val = loss.full_tensor().item()
        loss_abs, loss_ratio = _max_dev(torch.tensor(loss_val), loss_ref.detach())
        w_abs, w_ratio, worst = 0.0, 0.0, ""
        g_abs = 0.0
        for name, p, dp in zip(names, ref.parameters(), model.parameters()):
            a, r = _max_dev(dp.full_tensor(), p)
            if r > w_ratio:
                worst = name
            w_abs, w_ratio = max(w_abs, a), max(w_ratio, r)
            if p.grad is not None or dp.grad is not None:
                g_abs = max(g_abs, _max_dev(dp.grad.full_tensor(), p.grad)[0])
        phases = (("fwd", c_fwd), ("bwd", c_bwd), ("opt", c_opt))
        counts = {phase: dict(Counter(counter.kinds())) for phase, counter in phases}
        nbytes = {phase: counter.bytes() for phase, counter in phases}
        if step == 1:
            breakdown = {phase: counter.summary() for phase, counter in
                         (("forward", c_fwd), ("backward", c_bwd), ("optimizer", c_opt))}
        rows.append({
            "step": step, "loss": loss_val, "loss_ref": loss_ref.item(),
            "loss_abs": loss_abs, "loss_ratio": loss_ratio,
            "w_abs": w_abs, "w_ratio": w_ratio, "worst": worst, "g_abs": g_abs,
            "counts": counts, "bytes": nbytes, "step_s": step_s,
        })

    result = {
        "rank": rank,
        "world": world,
        "rows": rows,
        "breakdown": breakdown,
        "params": _params_summary(ref, model),
        "optimizer": type(opt).__name__,
    }
    # every rank reports every rank (so rank 0 can print the whole picture under torchrun too)
    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    return {"ranks": everyone}


# ---------------------------------------------------------------------------------------------
# Printing
# ---------------------------------------------------------------------------------------------


def _step_ok(per_rank: list[dict]) -> bool:
    """One step's verdict: every rank within tolerance, and all ranks report the same loss."""
    within = all(max(r["loss_ratio"], r["w_ratio"]) <= 1.0 for r in per_rank)
    return within and len({r["loss"] for r in per_rank}) == 1


def _table(headers: list[str], rows: list[list[str]], align: str) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]

    def line(cells):
        out = []
        for cell, w, a in zip(cells, widths, align):
            out.append(cell.rjust(w) if a == "r" else cell.ljust(w))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":" if a == "r" else "-" * (w + 2)) for w, a in zip(widths, align)) + "|"
    return "\n".join([line(headers), sep] + [line(r) for r in rows])


def report(cfg: Config, steps: int, ranks: list[dict], elapsed: float) -> bool:
    """Print the tables; return True when every rank matched the single-process model."""
    r0 = ranks[0]
    world = r0["world"]
    print(f"dtshard {dtshard.__version__} demo: tensor-parallel transformer block on {world} CPU "
          f"rank{'s' if world > 1 else ''} (gloo), torch {torch.__version__}")
    print(f"model: batch={cfg.batch} seq={cfg.seq} dim={cfg.dim} heads={cfg.heads} "
          f"hidden={cfg.hidden}; {r0['optimizer']}(lr={cfg.lr}, momentum={cfg.momentum}); "
          f"mse_loss; float32; tolerance |d| <= {ATOL:g} + {RTOL:g}*|ref|")
    print()
    print("parameters (rank 0's shard):")
    print(_table(["name", "global shape", "placements", "local shape"],
                 [[n, str(s), p, str(ls)] for n, s, p, ls in r0["params"]], "llll"))
    print()

    used = {kind for r in ranks for row in r["rows"] for counts in row["counts"].values() for kind in counts}
    kinds = [k for k in _KINDS if k in used] + sorted(used - set(_KINDS))
    ok = True
    rows = []
    for k in range(steps):
        per_rank = [r["rows"][k] for r in ranks]
        row = per_rank[0]
        loss_abs = max(r["loss_abs"] for r in per_rank)
        w_abs = max(r["w_abs"] for r in per_rank)
        g_abs = max(r["g_abs"] for r in per_rank)
        good = _step_ok(per_rank)
        ok &= good
        per_kind = Counter()
        for counts in row["counts"].values():
            per_kind.update(counts)
        total_bytes = sum(row["bytes"].values())
        rows.append(
            [str(row["step"]), f"{row['loss']:.7f}", f"{row['loss_ref']:.7f}", f"{loss_abs:.1e}",
             f"{w_abs:.1e}", f"{g_abs:.1e}"]
            + [str(per_kind.get(kind, 0)) for kind in kinds]
            + [f"{total_bytes:,}", f"{row['step_s'] * 1e3:.0f}", "ok" if good else "FAIL"]
        )
    short = [_KINDS.get(kind, kind) for kind in kinds]
    print("training: deviations from the single-process model are the max over all ranks; "
          "collectives per step\n(forward + backward + optimizer) are counted by dtshard.debug.CommCounter, "
          "bytes = bytes this rank sent")
    print(_table(["step", "loss dtshard", "loss torch", "|d loss|", "max|d W|", "max|d grad|"]
                 + short + ["bytes", "ms", ""],
                 rows, "rrrrrr" + "r" * len(kinds) + "rrl"))
    if kinds:
        print("(" + ", ".join(f"{s} = {k}" for s, k in zip(short, kinds) if s != k) + ")")
    print()
    print("step 1 collectives by op (rank 0):")
    for phase, text in r0["breakdown"].items():
        for i, line in enumerate(text.splitlines()):
            print(f"  {phase if i == 0 else '':<9}  {line}")
    print()

    if not ok:
        for k in range(steps):
            for r in ranks:
                row = r["rows"][k]
                if max(row["loss_ratio"], row["w_ratio"]) > 1.0:
                    print(f"FAIL: step {row['step']} rank {r['rank']}: loss |d|={row['loss_abs']:.3e}, "
                          f"weights |d|={row['w_abs']:.3e} (worst: {row['worst'] or '-'}), above "
                          f"{ATOL:g} + {RTOL:g}*|ref|")
            if len({r["rows"][k]["loss"] for r in ranks}) != 1:
                print(f"FAIL: step {k + 1}: the ranks disagree on the loss: "
                      + ", ".join(f"rank {r['rank']}: {r['rows'][k]['loss']!r}" for r in ranks))
        print(f"FAILED: dtshard deviates from the single-process model ({elapsed:.1f} s)")
    else:
        print(f"OK: {steps} steps on {world} ranks match the single-process model within "
              f"{ATOL:g} + {RTOL:g}*|ref| on every rank ({elapsed:.1f} s)")
    return ok


# ---------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------


def train_cnn_worker(steps: int, height: int = 14, width: int = 12) -> dict:
    """The UNet of dtshard.models with the images sharded on H (a spatial dim: convolutions and
    pooling exchange halos with their neighbours), next to the same model in one process."""
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, height, width, generator=g)
    y = torch.randn(2, 2, height, width, generator=g)
    ref_p = {k: v.clone().requires_grad_() for k, v in unet_params().items()}
    ref_s = unet_stats()
    rep = [Replicate()]
    xd = distribute_tensor(x, mesh, [Shard(2)])
    yd = distribute_tensor(y, mesh, [Shard(2)])
    dp = {k: distribute_tensor(v, mesh, rep).requires_grad_() for k, v in unet_params().items()}
    ds = {k: distribute_tensor(v, mesh, rep) for k, v in unet_stats().items()}
    rows = []
    for _ in range(steps):
        (loss_ref,) = train_unet(x, y, ref_p, ref_s, "size", 1)
        with CommCounter() as comm:
            (loss,) = train_unet(xd, yd, dp, ds, "size", 1)
        got = loss.full_tensor().item()
        dev_w = max(float((dp[k].detach().full_tensor() - ref_p[k].detach()).abs().max()) for k in ref_p)
        kinds = {}
        for r in comm.records:
            kinds[r.kind] = kinds.get(r.kind, 0) + 1
        rows.append({"loss": got, "ref": loss_ref.item(), "dev_w": dev_w, "kinds": kinds, "bytes": comm.bytes(),
                     "local_h": tuple(xd.to_local().shape)[2]})
    return {"rows": rows}


def report_cnn(steps: int, world: int, ranks: list[dict], elapsed: float, height: int) -> bool:
    print(f"UNet (conv3x3 + batch_norm + relu, max_pool, nearest upsampling, skip concat) on images "
          f"(2, 3, {height}, 12) sharded on H over {world} ranks (local H: "
          f"{', '.join(str(r['rows'][0]['local_h']) for r in ranks)}), vs the same model in one process")
    headers = ["step", "loss dtshard", "loss torch", "|d loss|", "max|d W|", "collectives", "bytes", ""]
    rows, ok = [], True
    for k in range(steps):
        rs = [r["rows"][k] for r in ranks]
        dl, dw, good = _deviation(rs)
        ok = ok and good
        kinds = ", ".join(f"{_KINDS.get(kd, kd)} x{n}" for kd, n in sorted(rs[0]["kinds"].items()))
        rows.append([str(k + 1), f"{rs[0]['loss']:.7f}", f"{rs[0]['ref']:.7f}", f"{dl:.1e}", f"{dw:.1e}",
                     kinds, f"{rs[0]['bytes']:,}", "ok" if good else "MISMATCH"])
    print(_table(headers, rows, "rrrrrlrl"))
    print(("OK" if ok else "FAILED") + f": {steps} steps on {world} ranks ({elapsed:.1f} s); "
          "A2A are the halo exchanges, AR the batch-norm statistics and the replicated weights' gradients")
    return ok


#: the ops whose all_to_all are halo exchanges (forward and backward)
_HALO_OPS = ("convolution", "upsample", "pool", "constant_pad")


def train_unet3d_worker(steps: int, size: tuple = (16, 16, 8), mem_size: tuple = (32, 32, 16)) -> dict:
    """:class:`dtshard.models.UNet3d` on volumes sharded on D x H (2x2 mesh, 4 ranks) or on D,
    next to the same model in one process (SGD, the same batches)."""
    world = dist.get_world_size()
    if world == 4:
        mesh, dims = init_device_mesh("cpu", (2, 2)), (2, 3)
    else:
        mesh, dims = init_device_mesh("cpu", (world,)), (2,)
    placements = [Shard(d) for d in dims]
    torch.manual_seed(0)
    ref = UNet3d()
    model = copy.deepcopy(ref)
    distribute_module(model, mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(steps):
        x = torch.randn(2, 1, *size, generator=g)
        y = torch.randn(2, 2, *size, generator=g)
        rloss = F.mse_loss(ref(x), y)
        ropt.zero_grad()
        rloss.backward()
        ropt.step()
        xd, yd = distribute_tensor(x, mesh, placements), distribute_tensor(y, mesh, placements)
        with CommCounter() as comm:
            loss = F.mse_loss(model(xd), yd)
            opt.zero_grad()
            loss.backward()
        opt.step()
        dev_w = max(float((p.detach().full_tensor() - q.detach()).abs().max())
                    for p, q in zip(model.parameters(), ref.parameters()))
        halo = [r for r in comm.records if r.kind == "all_to_all" and any(k in r.op for k in _HALO_OPS)]
        other = [r for r in comm.records if r not in halo]
        kinds = Counter(r.kind for r in other)
        rows.append({"loss": loss.full_tensor().item(), "ref": rloss.item(), "dev_w": dev_w,
                     "halo": len(halo), "halo_bytes": sum(r.nbytes for r in halo), "other": dict(kinds),
                     "other_bytes": sum(r.nbytes for r in other), "local": tuple(xd.to_local().shape[2:])})
    # activation memory: one forward + backward on a larger volume, this rank vs one process
    x = torch.randn(1, 1, *mem_size, generator=g)
    y = torch.randn(1, 2, *mem_size, generator=g)
    xd, yd = distribute_tensor(x, mesh, placements), distribute_tensor(y, mesh, placements)
    for m in (model, ref):
        m.zero_grad(set_to_none=False)  # gradient buffers exist already: not counted as activations
    peak_ref = peak_alloc_bytes(lambda: F.mse_loss(ref(x), y).backward())
    peak = peak_alloc_bytes(lambda: F.mse_loss(model(xd), yd).backward())
    return {"rows": rows, "peak": peak, "peak_ref": peak_ref, "mesh": tuple(mesh.shape), "dims": dims,
            "mem_local": tuple(xd.to_local().shape[2:])}


def report_unet3d(steps: int, world: int, ranks: list[dict], elapsed: float, size: tuple, mem_size: tuple) -> bool:
    r0 = ranks[0]
    where = " x ".join("DHW"[d - 2] for d in r0["dims"])
    print(f"3-D UNet (conv3d + GroupNorm + SiLU, strided-conv down, transposed-conv up, skip concat) on "
          f"volumes (2, 1, {', '.join(map(str, size))}) sharded on {where} over a mesh {r0['mesh']} "
          f"(local D, H, W: {', '.join(str(r['rows'][0]['local']) for r in ranks)}), vs one process, SGD")
    headers = ["step", "loss dtshard", "loss torch", "|d loss|", "max|d W|", "halo A2A", "halo bytes",
               "other collectives", "other bytes", ""]
    rows, ok = [], True
    for k in range(steps):
        rs = [r["rows"][k] for r in ranks]
        dl, dw, good = _deviation(rs)
        ok = ok and good
        other = ", ".join(f"{_KINDS.get(kd, kd)} x{n}" for kd, n in sorted(rs[0]["other"].items()))
        rows.append([str(k + 1), f"{rs[0]['loss']:.7f}", f"{rs[0]['ref']:.7f}", f"{dl:.1e}", f"{dw:.1e}",
                     str(rs[0]["halo"]), f"{max(r['halo_bytes'] for r in rs):,}", other,
                     f"{rs[0]['other_bytes']:,}", "ok" if good else "MISMATCH"])
    print(_table(headers, rows, "rrrrrrrlrl"))
    peak = max(r["peak"] for r in ranks)
    ref = r0["peak_ref"]
    print(f"peak activation memory of one forward + backward on (1, 1, {', '.join(map(str, mem_size))}): "
          f"{peak / 2**20:.2f} MiB per rank (largest; local {r0['mem_local']}) vs {ref / 2**20:.2f} MiB in one "
          f"process: {peak / ref:.2f}x")
    print(("OK" if ok else "FAILED") + f": {steps} steps on {world} ranks ({elapsed:.1f} s); halo A2A are the "
          "convolutions' halo exchanges (forward and backward, one per sharded dim); other: GroupNorm "
          "statistics and the bucketed weight gradients")
    return ok


# ---------------------------------------------------------------------------------------------
# --model llama: the Llama-style model of dtshard.models, tensor + sequence parallel, AdamW
# ---------------------------------------------------------------------------------------------

LLAMA_LR = 2e-3
# |d loss| <= LLAMA_RTOL |loss|, and per weight tensor max|d W| <= LLAMA_RTOL max|W| (AdamW divides
# by the root of the squared gradients, so an element whose gradient nearly cancels amplifies
# rounding noise; the per-tensor scale is the meaningful one, as in tests/distributed/test_llama.py)
LLAMA_RTOL = 1e-5


def _llama_mesh(world: int, dp: int):
    """(dp mesh or None, tp mesh or None) for ``--dp``: 1-D TP (dp = 1), 1-D FSDP (dp = world),
    or a 2-D ``("dp", "tp")`` mesh for FSDP x TP."""
    if dp <= 1:
        return None, init_device_mesh("cpu", (world,))
    if dp == world:
        return init_device_mesh("cpu", (world,), mesh_dim_names=("dp",)), None
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"], mesh["tp"]


def train_llama_worker(steps: int, dp: int = 1) -> dict:
    """Train the single-process Llama model and its parallel copy side by side on this rank:
    tensor + sequence parallel (``dp=1``), FSDP (``dp`` = world), or FSDP x TP on a
    ``(dp, world // dp)`` mesh.  With FSDP each data-parallel rank trains on its own 2 sequences
    and the reference on all of them (the global batch)."""
    world = dist.get_world_size()
    dp_mesh, tp_mesh = _llama_mesh(world, dp)
    tp = tp_mesh.size() if tp_mesh is not None else 1
    cfg = LlamaConfig()
    local_output = cfg.n_kv_heads % tp == 0  # torchtitan's plan needs whole k/v heads per rank
    ref = Transformer(cfg)  # deterministic init: identical on every rank
    model = copy.deepcopy(ref)
    if tp_mesh is not None:
        model = parallelize(model, tp_mesh, dtshard.parallel, local_output=local_output)
    if dp_mesh is not None:
        for layer in model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LLAMA_LR, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LLAMA_LR, foreach=False)
    g = torch.Generator().manual_seed(7)
    n_dp = dp_mesh.size() if dp_mesh is not None else 1
    me = dp_mesh.get_local_rank() if dp_mesh is not None else 0
    tokens = torch.randint(0, cfg.vocab_size, (2 * n_dp, 9), generator=g)  # 2 sequences of 8 (+1) per dp rank
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mine = slice(2 * me, 2 * me + 2)
    ref_params = dict(ref.named_parameters())

    def global_loss(loss):
        """The mean of the data-parallel ranks' losses (each over its own sequences)."""
        if isinstance(loss, dtshard.DTensor):
            loss = loss.full_tensor()
        if dp_mesh is None:
            return loss.item()
        return dtshard.DTensor.from_local(loss.detach().reshape(1), dp_mesh, [Shard(0)]).full_tensor().mean().item()

    rows = []
    for step in range(1, steps + 1):
        loss_ref = F.cross_entropy(ref(inputs).flatten(0, 1), labels.flatten(0, 1))
        loss_ref.backward()

        t0 = time.perf_counter()
        with CommCounter() as comm:
            with dtshard.parallel.loss_parallel():
                loss = F.cross_entropy(model(inputs[mine]).flatten(0, 1), labels[mine].flatten(0, 1))
                loss.backward()
            fwd_bwd = comm.bytes()
            opt.step()
        step_s = time.perf_counter() - t0

        # compare (outside the counter: full_tensor() gathers); gradients before the updates
        g_abs = max(_max_dev(p.grad.full_tensor(), ref_params[n].grad)[0] for n, p in model.named_parameters())
        opt_ref.step()
        opt_ref.zero_grad()
        opt.zero_grad()
        w_abs, w_scaled, worst = 0.0, 0.0, ""
        for n, p in model.named_parameters():
            want = ref_params[n].detach()
            d = (p.full_tensor() - want).abs().max().item()
            scaled = d / want.abs().max().item()
            if scaled > w_scaled:
                worst = n
            w_abs, w_scaled = max(w_abs, d), max(w_scaled, scaled)
        loss_val = global_loss(loss)
        rows.append({
            "step": step, "loss": loss_val, "loss_ref": loss_ref.item(),
            "loss_abs": abs(loss_val - loss_ref.item()), "w_abs": w_abs, "w_scaled": w_scaled,
            "worst": worst, "g_abs": g_abs, "kinds": dict(Counter(comm.kinds())), "bytes": comm.bytes(),
            "opt_bytes": comm.bytes() - fwd_bwd, "step_s": step_s,
        })
    params = [(n, tuple(ref_params[n].shape), dtshard_placements(p), tuple(p.to_local().shape))
              for n, p in model.named_parameters() if not n.startswith("layers.") or n.startswith("layers.0.")]
    result = {"rank": dist.get_rank(), "world": world, "rows": rows, "params": params,
              "local_output": local_output, "cfg": cfg, "dp": n_dp, "tp": tp}
    everyone = [None] * world  # every rank gets every rank's records (torchrun: rank 0 prints them)
    dist.all_gather_object(everyone, result)
    return {"ranks": everyone}


def _llama_step_ok(per_rank: list[dict]) -> bool:
    within = all(r["loss_abs"] <= LLAMA_RTOL * abs(r["loss_ref"]) and r["w_scaled"] <= LLAMA_RTOL
                 for r in per_rank)
    return within and len({r["loss"] for r in per_rank}) == 1


def report_llama(steps: int, ranks: list[dict], elapsed: float) -> bool:
    """Print the tables of ``--model llama``; return True when every rank matched one process."""
    r0 = ranks[0]
    world, cfg = r0["world"], r0["cfg"]
    dp, tp = r0.get("dp", 1), r0.get("tp", world)
    how = ("tensor + sequence parallel" if dp == 1 else "FSDP (dtshard.fsdp.fully_shard per layer and root)"
           if tp == 1 else f"FSDP x TP on a ({dp}, {tp}) (dp, tp) mesh")
    print(f"dtshard {dtshard.__version__} demo: Llama-style model (dtshard.models.Transformer), {how} on "
          f"{world} CPU rank{'s' if world > 1 else ''} (gloo), torch {torch.__version__}")
    print(f"model: dim={cfg.dim} layers={cfg.n_layers} heads={cfg.n_heads} kv_heads={cfg.n_kv_heads} "
          f"ffn={cfg.ffn_hidden} vocab={cfg.vocab_size}; tokens ({2 * dp}, 8), 2 sequences per data-parallel "
          f"rank; AdamW(lr={LLAMA_LR}); cross_entropy under loss_parallel(); float32")
    if tp > 1:
        plan = ("torchtitan's: the projections hand local shards to attention/MLP" if r0["local_output"] else
                f"DTensors throughout ({cfg.n_kv_heads} k/v heads do not split over {tp} ranks)")
        print(f"plan: dtshard.models.tp_plan via dtshard.parallel.parallelize_module; {plan}")
    if dp > 1:
        print(f"data parallel: {dp} ranks; the loss shown is the mean of their losses (= the global batch's)")
    print(f"tolerance: |d loss| <= {LLAMA_RTOL:g}*|loss|, each weight max|d W| <= {LLAMA_RTOL:g}*max|W|")
    print()
    print("parameters (rank 0's shard; the other layers as layers.0):")
    print(_table(["name", "global shape", "placements", "local shape"],
                 [[n, str(s), p, str(ls)] for n, s, p, ls in r0["params"]], "llll"))
    print()
    used = {k for r in ranks for row in r["rows"] for k in row["kinds"]}
    kinds = [k for k in _KINDS if k in used] + sorted(used - set(_KINDS))
    short = [_KINDS.get(k, k) for k in kinds]
    ok, rows = True, []
    for k in range(steps):
        per_rank = [r["rows"][k] for r in ranks]
        row = per_rank[0]
        good = _llama_step_ok(per_rank)
        ok &= good
        rows.append(
            [str(row["step"]), f"{row['loss']:.7f}", f"{row['loss_ref']:.7f}",
             f"{max(r['loss_abs'] for r in per_rank):.1e}", f"{max(r['w_abs'] for r in per_rank):.1e}",
             f"{max(r['w_scaled'] for r in per_rank):.1e}", f"{max(r['g_abs'] for r in per_rank):.1e}"]
            + [str(row["kinds"].get(kind, 0)) for kind in kinds]
            + [f"{row['bytes']:,}", f"{row['step_s'] * 1e3:.0f}", "ok" if good else "FAIL"])
    print("training: deviations from the single-process model are the max over all ranks; collectives per "
          "step\n(forward + loss + backward + AdamW) counted by dtshard.debug.CommCounter, bytes = bytes "
          "this rank sent")
    print(_table(["step", "loss dtshard", "loss torch", "|d loss|", "max|d W|", "max|dW|/max|W|", "max|d grad|"]
                 + short + ["bytes", "ms", ""], rows, "rrrrrrr" + "r" * len(kinds) + "rrl"))
    if kinds:
        print("(" + ", ".join(f"{s} = {k}" for s, k in zip(short, kinds) if s != k) + "; of the bytes, "
              f"{r0['rows'][0]['opt_bytes']:,} per step are the optimizer's reads of Partial gradients)")
    print()
    if not ok:
        for k in range(steps):
            for r in ranks:
                row = r["rows"][k]
                if not _llama_step_ok([row]):
                    print(f"FAIL: step {row['step']} rank {r['rank']}: loss |d|={row['loss_abs']:.3e}, "
                          f"weights max|d W|/max|W|={row['w_scaled']:.3e} (worst: {row['worst'] or '-'})")
            if len({r["rows"][k]["loss"] for r in ranks}) != 1:
                print(f"FAIL: step {k + 1}: the ranks disagree on the loss: "
                      + ", ".join(f"rank {r['rank']}: {r['rows'][k]['loss']!r}" for r in ranks))
        print(f"FAILED: dtshard deviates from the single-process model ({elapsed:.1f} s)")
    else:
        print(f"OK: {steps} AdamW steps on {world} rank{'s' if world > 1 else ''} match the single-process "
              f"model on every rank ({elapsed:.1f} s)")
    return ok


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtshard.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="CPU processes to spawn (default 2, 4 for --model unet3d; ignored under torchrun)")
    parser.add_argument("--model", choices=("block", "llama", "cnn", "unet3d"), default="block",
                        help="block: the tensor-parallel transformer block (default); llama: the "
                             "Llama-style model with tensor + sequence parallelism and AdamW; cnn: a "
                             "UNet with the images sharded on H (spatial halo exchange); unet3d: a 3-D "
                             "UNet with volumes sharded on D x H (4 ranks) or D")
    parser.add_argument("--fsdp", action="store_true",
                        help="with --model llama: FSDP (fully_shard) over every rank instead of TP")
    parser.add_argument("--dp", type=int, default=None,
                        help="with --model llama: data-parallel (FSDP) size; with --tp, FSDP x TP on a 2-D mesh")
    parser.add_argument("--tp", type=int, default=None, help="with --model llama and --dp: tensor-parallel size")
    args = parser.parse_args(argv)
    if args.world_size is None:
        args.world_size = 4 if args.model == "unet3d" else 2
    if args.steps < 1 or args.world_size < 1:
        parser.error("--steps and --world-size must be >= 1")
    if (args.fsdp or args.dp or args.tp) and args.model != "llama":
        args.model = "llama"  # FSDP and FSDP x TP train the Llama model
    if args.dp is not None or args.tp is not None:
        dp, tp = (1 if args.dp is None else args.dp), (1 if args.tp is None else args.tp)
        if dp < 1 or tp < 1:
            parser.error("--dp and --tp must be >= 1")
        if not _under_torchrun():
            args.world_size = dp * tp
        elif dp * tp != int(os.environ["WORLD_SIZE"]):
            parser.error(f"--dp {dp} x --tp {tp} != WORLD_SIZE {os.environ['WORLD_SIZE']}")
        args.dp = dp
    elif args.fsdp:
        args.dp = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else args.world_size
    else:
        args.dp = 1
    if args.model == "cnn":
        return _main_cnn(args)
    if args.model == "unet3d":
        return _launch_and_report(
            "train_unet3d_worker", (args.steps,), args,
            ok=lambda results: all(abs(r["loss"] - r["ref"]) <= 1e-6 + 1e-5 * abs(r["ref"]) and r["dev_w"] <= 1e-5
                                   for r in results[0]["rows"]) if results else True,
            report_fn=lambda results, elapsed, world: report_unet3d(args.steps, world, results, elapsed,
                                                                     (16, 16, 8), (32, 32, 16)))
    if args.model == "llama":
        return _main_llama(args)

    cfg = Config()
    return _launch_and_report(
        "train_worker", (cfg, args.steps), args,
        ok=lambda results: _all_ok(results[0]["ranks"]),
        report_fn=lambda results, elapsed, world: report(cfg, args.steps, results[0]["ranks"], elapsed))


def _launch_and_report(worker_name: str, worker_args: tuple, args, *, ok, report_fn) -> int:
    """Run ``dtshard.demo.<worker_name>(*worker_args)`` on every rank (spawned, or this process
    under torchrun), then print the report on rank 0; the exit code says whether every step
    matched one process."""
    import importlib

    # by module name (not this module's globals, which are __main__'s under `python -m`), so that
    # spawned ranks can import the worker
    worker = getattr(importlib.import_module("dtshard.demo"), worker_name)

    torchrun = _under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    start = time.perf_counter()
    try:
        results = launch(worker, world, *worker_args, timeout=300.0)
    except DistributedTestError as e:
        print(f"FAILED: the demo raised on some rank:\n{e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - torchrun: this rank raised
        import traceback

        traceback.print_exc()
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    if torchrun and int(os.environ["RANK"]) != 0:
        return 0 if ok(results) else 1
    return 0 if report_fn(results, elapsed, world) else 1


def _main_cnn(args) -> int:
    return _launch_and_report(
        "train_cnn_worker", (args.steps,), args, ok=lambda results: True,
        report_fn=lambda results, elapsed, world: report_cnn(args.steps, world, results, elapsed, 14))


def _main_llama(args) -> int:
    return _launch_and_report(
        "train_llama_worker", (args.steps, args.dp), args,
        ok=lambda results: all(_llama_step_ok([r["rows"][k] for r in results[0]["ranks"]])
                               for k in range(args.steps)),
        report_fn=lambda results, elapsed, world: report_llama(args.steps, results[0]["ranks"], elapsed))


def _all_ok(ranks: list[dict]) -> bool:
    return all(_step_ok([r["rows"][k] for r in ranks]) for k in range(len(ranks[0]["rows"])))


if __name__ == "__main__":
    sys.exit(main())
