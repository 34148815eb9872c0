"""``--model llama`` (and ``--fsdp``, ``--dp``/``--tp``): the Llama-style model with tensor + sequence
parallelism, FSDP, or FSDP x TP, trained with AdamW next to one process."""

from __future__ import annotations

from collections import Counter
import copy
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtshard import Shard, init_device_mesh
from dtshard.debug import CommCounter
from dtshard.demo._report import _KINDS, _max_dev, _report_disagreement, _table, dtshard_placements
from dtshard.fsdp import fully_shard
from dtshard.models import LlamaConfig, Transformer, parallelize
import dtshard
import dtshard.parallel


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
            _report_disagreement(ranks, k)
        print(f"FAILED: dtshard deviates from the single-process model ({elapsed:.1f} s)")
    else:
        print(f"OK: {steps} AdamW steps on {world} rank{'s' if world > 1 else ''} match the single-process "
              f"model on every rank ({elapsed:.1f} s)")
    return ok
