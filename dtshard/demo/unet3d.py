"""``--model unet3d``: a 3-D UNet on volumes sharded on D x H (2x2, 4 ranks) or on D."""

from __future__ import annotations

from collections import Counter
import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dtshard import Shard, distribute_module, distribute_tensor, init_device_mesh
from dtshard.debug import CommCounter, peak_alloc_bytes
from dtshard.demo._report import _deviation, _kinds_text, _table
from dtshard.models import UNet3d


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
        other = _kinds_text(rs[0]["other"])
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
