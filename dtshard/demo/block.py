"""``--model block`` (the default): the tensor-parallel transformer block, written as plain ``torch.nn`` code,
sharded the Megatron way, trained next to the same block in one process."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
import copy
import math
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from dtshard import Replicate, Shard, distribute_module, distribute_tensor, init_device_mesh
from dtshard.debug import CommCounter
from dtshard.demo._report import ATOL, RTOL, _KINDS, _max_dev, _params_summary, _report_disagreement, _table
import dtshard
import dtshard.parallel


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
# The report
# ---------------------------------------------------------------------------------------------


def _step_ok(per_rank: list[dict]) -> bool:
    """One step's verdict: every rank within tolerance, and all ranks report the same loss."""
    within = all(max(r["loss_ratio"], r["w_ratio"]) <= 1.0 for r in per_rank)
    return within and len({r["loss"] for r in per_rank}) == 1


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
            _report_disagreement(ranks, k)
        print(f"FAILED: dtshard deviates from the single-process model ({elapsed:.1f} s)")
    else:
        print(f"OK: {steps} steps on {world} ranks match the single-process model within "
              f"{ATOL:g} + {RTOL:g}*|ref| on every rank ({elapsed:.1f} s)")
    return ok


def _all_ok(ranks: list[dict]) -> bool:
    return all(_step_ok([r["rows"][k] for r in ranks]) for k in range(len(ranks[0]["rows"])))
