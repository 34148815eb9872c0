"""``--model cnn``: the UNet of :mod:`dtshard.models` with the images sharded on H (halo exchanges)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dtshard import Replicate, Shard, distribute_tensor, init_device_mesh
from dtshard.debug import CommCounter
from dtshard.demo._report import _deviation, _kinds_text, _table
from dtshard.models import train_unet, unet_params, unet_stats


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
        kinds = _kinds_text(rs[0]["kinds"])
        rows.append([str(k + 1), f"{rs[0]['loss']:.7f}", f"{rs[0]['ref']:.7f}", f"{dl:.1e}", f"{dw:.1e}",
                     kinds, f"{rs[0]['bytes']:,}", "ok" if good else "MISMATCH"])
    print(_table(headers, rows, "rrrrrlrl"))
    print(("OK" if ok else "FAILED") + f": {steps} steps on {world} ranks ({elapsed:.1f} s); "
          "A2A are the halo exchanges, AR the batch-norm statistics and the replicated weights' gradients")
    return ok
