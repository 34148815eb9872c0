"""FSDP2 code as people write it (issue #54), on dtshard.fsdp and on PyTorch's own FSDP2 in the same run.

Each check runs on both ranks of the 2-rank gloo pool and compares dtshard.fsdp with one process
and, where PyTorch's ``torch.distributed.fsdp.fully_shard`` runs the same code, with it:

- the most common recipe: blocks then the root, WITHOUT ``mesh=`` (and with one), then
  ``clip_grad_norm_``, foreach and fused Adam, and a DCP save / load;
- tied weights: in two groups raises like FSDP2; in one multi-module group the tie is kept;
- a parameter re-assigned after ``fully_shard`` (meta init) is picked up by lazy init;
- ``shard_placement_fn`` returning ``Shard(d)`` for d > 0 (even, and uneven, which PyTorch refuses):
  gradients, reshard, mixed precision, DCP into another layout;
- a module of a multi-module group called on its own (torchtitan's chunked loss);
- what is registered as parameters between forward and reshard (a documented difference);
- world size 1 issues no collective; ``share_comm_ctx``, the 0-dim and 3-D mesh errors;
- two threads converting two models' dtypes at once;
- FSDP2 behaviours users rely on: lazy init and the root, ``reshard_after_forward``,
  gradient accumulation with ``set_requires_gradient_sync`` / ``set_is_last_backward``, explicit
  prefetching, against PyTorch's FSDP2.
"""

from __future__ import annotations

import inspect
import threading

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import dtshard
from dtshard import Shard
from dtshard.debug import CommCounter
from dtshard.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from dtshard.testing import run_distributed


class Block(nn.Module):
    def __init__(self, d: int = 8):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self, n: int = 2, d: int = 8):
        super().__init__()
        self.inp = nn.Linear(5, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.out = nn.Linear(d, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _rank():
    return dist.get_rank(), dist.get_world_size()


def _data(step: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(2 * world, 5, generator=g), torch.randn(2 * world, 3, generator=g)


def _err(ours, theirs) -> float:
    """Max abs difference; each side a list of tensors (DTensors of either library: full values)."""
    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t
    return max((full(a).detach() - full(b).detach()).abs().max().item() for a, b in zip(ours, theirs))


def _shard_recipe(model, shard, mesh):
    """The recipe as written in tutorials: each block, then the root, mesh= only when given."""
    kw = {} if mesh is None else {"mesh": mesh}
    for b in model.blocks:
        shard(b, **kw)
    shard(model, **kw)
    return model


# ---- item 1: the common recipe, default and explicit mesh, clip, foreach / fused, DCP ------------


def _recipe(path: str):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    import torch.distributed.checkpoint as dcp

    rank, world = _rank()
    out = {}
    fused_ok = True
    try:  # fused Adam on CPU (PyTorch 2.13 has a CPU kernel); the check below says which ran
        torch.optim.Adam([nn.Parameter(torch.zeros(1))], fused=True)
    except RuntimeError:
        fused_ok = False
    out["fused_ok"] = fused_ok
    explicit = dtshard.init_device_mesh("cpu", (world,))
    for mesh_kind in ("default", "explicit"):
        for opt_kind in ("foreach", "fused"):
            mesh = None if mesh_kind == "default" else explicit
            torch.manual_seed(0)
            ref = Net()
            ours, theirs = Net(), Net()
            ours.load_state_dict(ref.state_dict())
            theirs.load_state_dict(ref.state_dict())
            _shard_recipe(ours, fully_shard, mesh)
            _shard_recipe(theirs, torch_fully_shard, mesh)
            kw = {"foreach": True} if opt_kind == "foreach" else {"fused": True}
            opts = [torch.optim.Adam(m.parameters(), lr=1e-2, **kw) for m in (ours, theirs, ref)]
            rows = []
            for step in range(2):
                x, y = _data(step, world)
                mine = slice(2 * rank, 2 * rank + 2)
                losses, norms = [], []
                for m, opt, xs, ys in ((ours, opts[0], x[mine], y[mine]), (theirs, opts[1], x[mine], y[mine]),
                                       (ref, opts[2], x, y)):
                    loss = F.mse_loss(m(xs), ys)
                    loss.backward()
                    norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)
                    opt.step()
                    opt.zero_grad()
                    losses.append(loss.item())
                    norms.append(float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm))
                rows.append((losses, norms))
            meshes = {id(p.device_mesh) for p in ours.parameters()}
            out[mesh_kind, opt_kind] = {
                "rows": rows,
                "one_mesh": len(meshes) == 1,
                "sum_of_blocks": _err([ours.blocks[0].a.weight + ours.blocks[1].a.weight],
                                      [ref.blocks[0].a.weight + ref.blocks[1].a.weight]),
                "vs_ref": _err(list(ours.parameters()), list(ref.parameters())),
                "vs_torch": _err(list(ours.parameters()), list(theirs.parameters())),
                "types": {type(p).__name__ for p in ours.parameters()},
            }
            if (mesh_kind, opt_kind) != ("default", "foreach"):
                continue
            # DCP: save model and optimizer, load into a fresh model sharded the same way, and the
            # next step is the same on both
            ckpt = f"{path}/recipe"
            dcp.save({"model": ours.state_dict(), "optim": opts[0].state_dict()}, checkpoint_id=ckpt)
            torch.manual_seed(5)
            fresh = _shard_recipe(Net(), fully_shard, None)
            fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2, foreach=True)
            F.mse_loss(fresh(x[mine]), y[mine]).backward()
            fopt.step()  # optimizer state of the right layout to load into
            fopt.zero_grad()
            state = {"model": fresh.state_dict(), "optim": fopt.state_dict()}
            dcp.load(state, checkpoint_id=ckpt)
            fresh.load_state_dict(state["model"])
            fopt.load_state_dict(state["optim"])
            loaded = _err(list(fresh.parameters()), list(ours.parameters()))
            x, y = _data(7, world)
            after = []
            for m, opt in ((ours, opts[0]), (fresh, fopt)):
                F.mse_loss(m(x[mine]), y[mine]).backward()
                opt.step()
                opt.zero_grad()
            out["dcp"] = (loaded, _err(list(fresh.parameters()), list(ours.parameters())))
    return out


# ---- item 5: tied weights ----------------------------------------------------------------------


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(12, 6)
        self.block = Block(6)
        self.output = nn.Linear(6, 12, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids):
        return self.output(self.block(self.tok_embeddings(ids)))


def _tied():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = _rank()
    out = {}

    def separate(shard):
        m = Tied()
        shard(m.tok_embeddings)
        shard(m.output)
        shard(m)
        m(torch.arange(4).view(1, 4))  # PyTorch checks at lazy init (the first forward)

    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        try:
            separate(shard)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    # the tie kept: both modules in ONE group (multi-module fully_shard), trained against one process
    torch.manual_seed(0)
    ref = Tied()
    ours, theirs = Tied(), Tied()
    ours.load_state_dict(ref.state_dict())
    theirs.load_state_dict(ref.state_dict())
    for m, shard in ((ours, fully_shard), (theirs, torch_fully_shard)):
        shard(m.block)
        shard([m.tok_embeddings, m.output])
        shard(m)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs, ref)]
    ids = torch.arange(4 * world).remainder(12).view(world, 4)
    for step in range(2):
        for m, opt, x in ((ours, opts[0], ids[rank:rank + 1]), (theirs, opts[1], ids[rank:rank + 1]), (ref, opts[2], ids)):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    out["kept"] = (ours.output.weight is ours.tok_embeddings.weight, len(list(ours.parameters())),
                   len(list(theirs.parameters())))
    out["kept_err"] = (_err(list(ours.parameters()), list(ref.parameters())),
                       _err(list(ours.parameters()), list(theirs.parameters())))
    return out


# ---- item 6: a parameter re-assigned after fully_shard (PyTorch's test_reset_sharded_param_in_lazy_init)


class WeightNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def forward(self, inp):
        return self.layer2(self.layer1(inp)).sum() + (self.weight_norm * 2).sum()


def _reassigned():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    inp = torch.arange(9.0).view(3, 3) / 10
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        with torch.device("meta"):
            model = WeightNorm()
        shard(model.layer1)
        shard(model.layer2)
        shard(model)
        model.layer1.to_empty(device="cpu")
        model.layer2.to_empty(device="cpu")
        with torch.no_grad():  # the same values on every rank, written into the shards
            for k, lin in enumerate((model.layer1, model.layer2)):
                full = torch.arange(9.0).view(3, 3) / (k + 3)
                lin.weight.to_local().copy_(full[_rows(lin.weight)])
            # PyTorch's recipe: computed from the sharded weights, a DTensor in the same layout
            weight_norm = torch.linalg.norm(model.layer1.weight, dim=1) + torch.linalg.norm(model.layer2.weight, dim=1)
        model.weight_norm = nn.Parameter(weight_norm)
        loss = model(inp)
        loss.backward()
        out[name] = (loss.item(), [p.grad.full_tensor() for p in model.parameters()],
                     [p.full_tensor() for p in model.parameters()], type(model.weight_norm.grad).__name__)
    # dtshard also takes a plain tensor of the full shape (the same on every rank): this rank's shard
    with torch.device("meta"):
        model = WeightNorm()
    fully_shard(model.layer1)
    fully_shard(model.layer2)
    fully_shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().fill_(0.5)
    model.weight_norm = nn.Parameter(torch.tensor([1.0, 2.0, 3.0]))
    loss = model(inp)
    loss.backward()
    out["plain"] = (type(model.weight_norm).__name__, model.weight_norm.full_tensor().tolist(),
                    model.weight_norm.grad.full_tensor().tolist(), loss.item())
    return out


def _rows(p):
    """This rank's rows of a Shard(0) DTensor (torch.chunk layout)."""
    n, world, rank = p.shape[0], dist.get_world_size(), dist.get_rank()
    c = -(-n // world)
    return slice(min(rank * c, n), min(rank * c + c, n))


# ---- item 2: shard_placement_fn with Shard(d), d > 0 --------------------------------------------


class Wide(nn.Module):
    """Parameters whose largest dim is not dim 0: (4, 6) and a 3-D (2, 3, 8); even on 2 ranks."""

    def __init__(self, uneven: bool = False):
        super().__init__()
        self.lin = nn.Linear(5 if uneven else 6, 4)  # weight (4, 6): Shard(1); uneven: (4, 5)
        self.mix = nn.Parameter(torch.randn(2, 3, 8) / 4)  # Shard(2)
        self.head = nn.Linear(4, 6)  # weight (6, 4): Shard(0)

    def forward(self, x):
        h = torch.tanh(self.lin(x))  # (B, 4)
        h = h + torch.einsum("bi,ijk->bk", h[:, :2], self.mix)[:, :4]
        return self.head(h)


def _largest_dim(p):
    return Shard(max(range(p.dim()), key=lambda d: (p.shape[d], -d)))


def _shard_dims():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    import torch.distributed.checkpoint as dcp

    rank, world = _rank()
    mesh = dtshard.init_device_mesh("cpu", (world,))
    out = {}
    for uneven in (False, True):
        for mp in (None, MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)):
            torch.manual_seed(0)
            ref = Wide(uneven)
            ours = Wide(uneven)
            ours.load_state_dict(ref.state_dict())
            kw = {"mesh": mesh, "shard_placement_fn": _largest_dim, "reshard_after_forward": True}
            if mp is not None:
                kw["mp_policy"] = mp
            fully_shard(ours.head, **kw)
            fully_shard(ours, **kw)
            theirs = None
            if not uneven:
                theirs = Wide(uneven)
                theirs.load_state_dict(ref.state_dict())
                torch_fully_shard(theirs.head, **kw)
                torch_fully_shard(theirs, **kw)
            models = [m for m in (ours, theirs, ref) if m is not None]
            opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
            n_in = 5 if uneven else 6
            rows = []
            for step in range(2):
                g = torch.Generator().manual_seed(step)
                x = torch.randn(2 * world, n_in, generator=g)
                grads = []
                for m, opt in zip(models, opts):
                    xs = x if m is ref else x[2 * rank:2 * rank + 2]
                    with CommCounter() as c:
                        loss = m(xs).float().square().mean()
                        loss.backward()
                    grads.append([p.grad for p in m.parameters()])
                    if m is ours:
                        counts = (c.count("all_gather"), c.count("reduce_scatter"))
                    opt.step()
                    opt.zero_grad()
                rows.append((loss.item(), _err(grads[0], grads[-1]), _err(grads[0], grads[1]) if theirs else None,
                             counts))
            res = {
                "placements": [tuple(p.placements) for p in ours.parameters()],
                "local_shapes": [tuple(p.to_local().shape) for p in ours.parameters()],
                "contiguous": all(p.to_local().is_contiguous() for p in ours.parameters()),
                "rows": rows,
                "vs_ref": _err(list(ours.parameters()), list(ref.parameters())),
                "vs_torch": _err(list(ours.parameters()), list(theirs.parameters())) if theirs else None,
                "states": [m._fsdp_state.group.state for m in (ours, ours.head)],
            }
            if theirs is not None:
                res["torch_placements"] = [tuple(p.placements) for p in theirs.parameters()]
                res["torch_local_shapes"] = [tuple(p.to_local().shape) for p in theirs.parameters()]
            out[uneven, mp is not None] = res
        if uneven:  # PyTorch refuses an uneven Shard(d > 0); dtshard computes it (checked above)
            try:
                torch_fully_shard(Wide(True), mesh=mesh, shard_placement_fn=_largest_dim)
                out["torch_uneven"] = None
            except NotImplementedError as e:
                out["torch_uneven"] = str(e)
    # DCP: saved with Shard(1) / Shard(2), loaded into the default Shard(0) layout
    torch.manual_seed(0)
    src = Wide()
    fully_shard(src.head, mesh=mesh, shard_placement_fn=_largest_dim)
    fully_shard(src, mesh=mesh, shard_placement_fn=_largest_dim)
    ckpt = f"{_PATH[0]}/shard_dims"
    dcp.save({"model": src.state_dict()}, checkpoint_id=ckpt)
    torch.manual_seed(9)
    dst = Wide()
    fully_shard(dst.head, mesh=mesh)
    fully_shard(dst, mesh=mesh)
    state = {"model": dst.state_dict()}
    dcp.load(state, checkpoint_id=ckpt)
    dst.load_state_dict(state["model"])
    x = torch.randn(3, 6)
    with torch.no_grad():
        out["dcp"] = (_err(list(dst.parameters()), list(src.parameters())), (dst(x) - src(x)).abs().max().item(),
                      [tuple(p.placements) for p in dst.parameters()])
    return out


_PATH: list = []


def _compiled_shard_dims():
    """The same Shard(d) groups under torch.compile (the traced gather).  Uneven only: its
    gather joins whole pieces and the short one, so it covers the even layout's path too."""
    import torch._dynamo

    rank, world = _rank()
    mesh = dtshard.init_device_mesh("cpu", (world,))
    out = {}
    for uneven in (True,):
        torch.manual_seed(0)
        ref, ours = Wide(uneven), Wide(uneven)
        ours.load_state_dict(ref.state_dict())
        fully_shard(ours.head, mesh=mesh, shard_placement_fn=_largest_dim)
        fully_shard(ours, mesh=mesh, shard_placement_fn=_largest_dim)
        torch._dynamo.reset()
        compiled = torch.compile(ours, backend="aot_eager", fullgraph=True)
        x = torch.randn(2 * world, 5 if uneven else 6, generator=torch.Generator().manual_seed(1))
        loss = compiled(x[2 * rank:2 * rank + 2]).square().mean()
        loss.backward()
        ref(x).square().mean().backward()
        out[uneven] = _err([p.grad for p in ours.parameters()], [p.grad for p in ref.parameters()])
    torch._dynamo.reset()
    return out


# ---- item 3: a module of a multi-module group called on its own (chunked loss) ------------------


class Chunked(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Linear(5, 8)
        self.block = Block(8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 7)

    def forward(self, x):  # skips the head: the loss runs it chunk by chunk
        return self.norm(self.block(self.emb(x)))


def _chunked_loss(model, x, target, chunks: int = 3):
    h = model(x)
    total = 0.0
    for hc, tc in zip(h.chunk(chunks), target.chunk(chunks)):
        total = total + F.cross_entropy(model.head(hc), tc, reduction="sum")
    return total / x.shape[0]


def _chunked():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = _rank()
    mesh = dtshard.init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    ref = Chunked()
    ours, theirs = Chunked(), Chunked()
    ours.load_state_dict(ref.state_dict())
    theirs.load_state_dict(ref.state_dict())
    for m, shard in ((ours, fully_shard), (theirs, torch_fully_shard)):
        shard(m.block, mesh=mesh)
        shard([m.norm, m.head], mesh=mesh)
        shard(m, mesh=mesh)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs, ref)]
    rows = []
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, t = torch.randn(6 * world, 5, generator=g), torch.randint(0, 7, (6 * world,), generator=g)
        mine = slice(6 * rank, 6 * rank + 6)
        grads = []
        for m, opt in zip((ours, theirs, ref), opts):
            xs, ts = (x, t) if m is ref else (x[mine], t[mine])
            with CommCounter() as c:
                loss = _chunked_loss(m, xs, ts)
                loss.backward()
            if m is ours:
                counts = (c.count("reduce_scatter"), ours.head._fsdp_state.group.state)
            grads.append([p.grad for p in m.parameters()])
            opt.step()
            opt.zero_grad()
        rows.append((_err(grads[0], grads[2]), _err(grads[0], grads[1]), counts))
    return {"rows": rows, "vs_ref": _err(list(ours.parameters()), list(ref.parameters())),
            "vs_torch": _err(list(ours.parameters()), list(theirs.parameters()))}


# ---- item 4: what is registered between forward and reshard -------------------------------------


class Seen(nn.Module):
    """Records the type of the weight the forward computed with."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append((type(self.lin.weight).__name__, self.lin.weight.detach().clone()))
        return self.lin(x)


def _registered():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    out = {}
    x = torch.ones(2, 4)
    for raf in (True, False, None):
        res = {}
        for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
            torch.manual_seed(0)
            m = Seen()
            ref = [p.detach().clone() for p in m.parameters()]
            shard(m, reshard_after_forward=raf)  # root only
            before = list(m.parameters())
            m(x)
            after = list(m.parameters())
            res[name] = {
                "same_objects": all(a is b for a, b in zip(before, after)),
                "types": [type(p).__name__ for p in after],
                "values": _err(after, ref),
                "in_forward": (m.seen[0][0], (m.seen[0][1] - ref[0]).abs().max().item()),
            }
            if name == "ours":
                res[name]["state"] = m._fsdp_state.group.state
            m.reshard()
            res[name]["after_reshard"] = [type(p).__name__ for p in m.parameters()]
        out[raf] = res
    return out


# ---- item 7: world size 1 -----------------------------------------------------------------------


def _world_one():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.debug import CommDebugMode

    # a 1-rank group on each rank: the inner dim of a (2, 1) mesh
    one = dtshard.init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("rep", "one"))["one"]
    torch.manual_seed(0)
    ref = Net()
    ours, theirs = Net(), Net()
    ours.load_state_dict(ref.state_dict())
    theirs.load_state_dict(ref.state_dict())
    _shard_recipe(ours, fully_shard, one)
    _shard_recipe(theirs, torch_fully_shard, one)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ours, theirs, ref)]
    x, y = _data(0, 1)
    counts = []
    for step in range(2):
        for m, opt in zip((ours, theirs, ref), opts):
            with CommCounter() as c, CommDebugMode() as cd:
                F.mse_loss(m(x), y).backward()
            opt.step()
            opt.zero_grad()
            counts.append((c.count(), cd.get_total_counts()))
    return {"counts": counts, "vs_ref": _err(list(ours.parameters()), list(ref.parameters())),
            "vs_torch": _err(list(ours.parameters()), list(theirs.parameters())),
            "local": [tuple(p.to_local().shape) == tuple(p.shape) for p in ours.parameters()]}


# ---- item 8: share_comm_ctx and argument errors --------------------------------------------------


def _api_errors():
    import torch.distributed.fsdp as tfsdp
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import dtshard.fsdp as ofsdp

    out = {"signature": (str(inspect.signature(ofsdp.share_comm_ctx)), str(inspect.signature(tfsdp.share_comm_ctx)))}

    def catch(fn):
        try:
            fn()
            return None
        except Exception as e:  # noqa: BLE001 - the type and message are what is compared
            return type(e).__name__, str(e)

    world = dist.get_world_size()
    for name, lib, shard in (("ours", ofsdp, fully_shard), ("torch", tfsdp, torch_fully_shard)):
        a, b = shard(nn.Linear(2, 2)), shard(nn.Linear(2, 2))
        res = {"share_ok": catch(lambda: lib.share_comm_ctx([a, b])),
               "share_empty": catch(lambda: lib.share_comm_ctx([])),
               "share_bad": catch(lambda: lib.share_comm_ctx([a, nn.Linear(2, 2)]))}
        scalar = nn.Module()
        scalar.p = nn.Parameter(torch.tensor(1.0))
        res["scalar"] = catch(lambda: shard(scalar))
        mesh3 = dtshard.init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("a", "b", "c"))
        res["mesh3"] = catch(lambda: shard(nn.Linear(2, 2), mesh=mesh3))
        res["invalid_placement"] = catch(lambda: shard(nn.Linear(2, 2), shard_placement_fn=lambda p: "row"))
        out[name] = res
    # after share_comm_ctx both roots still train
    a, b = fully_shard(nn.Linear(3, 3)), fully_shard(nn.Linear(3, 3))
    ofsdp.share_comm_ctx([a, b])
    b(a(torch.ones(1, 3))).sum().backward()
    out["trains"] = [type(p.grad).__name__ for p in (*a.parameters(), *b.parameters())]
    return out


# ---- item 9: two threads converting two models at once --------------------------------------------


def _threads(iters: int = 60):
    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    models = []
    for k in range(2):
        torch.manual_seed(k)
        models.append(_shard_recipe(Net(n=3, d=16), fully_shard, mesh))
    x = torch.randn(4, 5)
    with torch.no_grad():
        want = [m(x).double() for m in models]
    bad, errors = [], []
    start = threading.Barrier(2)

    def convert(k):
        m = models[k]
        try:
            start.wait()
            for i in range(iters):
                for dtype in (torch.float64, torch.float32):
                    m.to(dtype)
                    groups = [s.group for s in m._fsdp_states(True)]
                    ok = all(g.orig_dtype == dtype and g.flat_shard.dtype == dtype and g.state == "sharded"
                             and all(g._is_view_of_flat(p, info) for p, info in zip(g.sharded_params, g.infos))
                             for g in groups) and all(p.dtype == dtype for p in m.parameters())
                    if not ok:
                        bad.append((k, i, str(dtype)))
        except Exception as e:  # noqa: BLE001 - reported to the test
            errors.append(f"{type(e).__name__}: {e}")

    threads = [threading.Thread(target=convert, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    with torch.no_grad():
        got = [m(x).double() for m in models]
    return {"bad": bad[:5], "n_bad": len(bad), "errors": errors[:3],
            "values": max((a - b).abs().max().item() for a, b in zip(got, want))}


# ---- pins: FSDP2 behaviours users rely on, against PyTorch's FSDP2 -------------------------------


def _pins():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = _rank()
    mesh = dtshard.init_device_mesh("cpu", (world,))
    out = {}
    # lazy init: a block's forward run before the root's makes the block a root of its own; the
    # real root's forward then raises (PyTorch: RuntimeError) instead of silently mis-grouping
    for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
        m = _shard_recipe(Net(), shard, mesh)
        m.blocks[0](torch.ones(1, 8))
        try:
            m(torch.ones(1, 5))
            out["lazy", name] = None
        except RuntimeError as e:
            out["lazy", name] = type(e).__name__
    # the root and its groups: which groups hold their full parameters after forward, for
    # reshard_after_forward None / True / False / an int (2 on 2 ranks: as True)
    x, y = _data(0, world)
    mine = slice(2 * rank, 2 * rank + 2)
    for raf in (None, True, False, 2):
        states = {}
        for name, shard in (("ours", fully_shard), ("torch", torch_fully_shard)):
            torch.manual_seed(0)
            m = Net()
            for b in m.blocks:
                shard(b, mesh=mesh, reshard_after_forward=raf)
            shard(m, mesh=mesh, reshard_after_forward=raf)
            loss = F.mse_loss(m(x[mine]), y[mine])
            if name == "ours":
                states[name] = [s.group.state == "unsharded" for s in (m._fsdp_state, *(b._fsdp_state for b in m.blocks))]
            else:
                states[name] = [_torch_unsharded(s) for s in (m, *m.blocks)]
            loss.backward()
        out["raf", raf] = states
    # gradient accumulation: no sync on the first micro-batches, set_is_last_backward(False) on
    # one, explicit prefetch lists; every model ends with the same parameters as one process
    torch.manual_seed(0)
    ref = Net()
    ours, theirs = Net(), Net()
    ours.load_state_dict(ref.state_dict())
    theirs.load_state_dict(ref.state_dict())
    _shard_recipe(ours, fully_shard, mesh)
    _shard_recipe(theirs, torch_fully_shard, mesh)
    for m in (ours, theirs):
        m.blocks[0].set_modules_to_forward_prefetch([m.blocks[1]])
        m.blocks[1].set_modules_to_backward_prefetch([m.blocks[0]])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs, ref)]
    counts = []
    for step in range(2):
        for micro in range(3):
            x, y = _data(10 * step + micro, world)
            for m in (ours, theirs):
                m.set_requires_gradient_sync(micro == 2)
                m.set_is_last_backward(micro != 1)
                with CommCounter() as c:
                    F.mse_loss(m(x[mine]), y[mine]).backward()
                if m is ours:
                    counts.append((c.count("all_gather"), c.count("reduce_scatter"),
                                   all(p.grad is None for p in m.parameters())))
            F.mse_loss(ref(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out["accumulate"] = (counts, _err(list(ours.parameters()), list(ref.parameters())),
                         _err(list(ours.parameters()), list(theirs.parameters())))
    # unshard() / reshard() by hand: the next forward gathers nothing for an unsharded group
    for name, m in (("ours", ours), ("torch", theirs)):
        m.unshard()
        for b in m.blocks:
            b.unshard()
        with CommCounter() as c:
            out_ = m(x[mine])
        out["manual", name] = (c.count("all_gather") if name == "ours" else None, out_.detach())
        out_.sum().backward()
        for b in m.blocks:
            b.reshard()
        m.reshard()
        ours.zero_grad(), theirs.zero_grad()
    return out


def _torch_unsharded(module) -> bool:
    group = module._get_fsdp_state()._fsdp_param_group
    return bool(group.is_unsharded)


# ---------------------------------------------------------------------------------------------
# the tests: two runs on the 2-rank pool
# ---------------------------------------------------------------------------------------------


def _run_a(path: str):
    _PATH[:] = [path]
    return {"recipe": _recipe(path), "tied": _tied(), "reassigned": _reassigned(), "shard_dims": _shard_dims(),
            "compiled_shard_dims": _compiled_shard_dims()}


def _run_b():
    return {"chunked": _chunked(), "registered": _registered(), "world_one": _world_one(),
            "api": _api_errors(), "threads": _threads(), "pins": _pins()}


def test_recipe_tied_reassigned_and_shard_dims(tmp_path):
    res = run_distributed(_run_a, 2, str(tmp_path), timeout=240)
    for r in res:
        rec = r["recipe"]
        assert rec["fused_ok"], "torch's fused Adam must run on CPU in torch 2.13"
        for key in (("default", "foreach"), ("default", "fused"), ("explicit", "foreach"), ("explicit", "fused")):
            case = rec[key]
            assert case["one_mesh"] and case["types"] == {"DTensor"}, (key, case)
            for losses, norms in case["rows"]:
                assert abs(norms[0] - norms[2]) < 1e-5 and abs(norms[0] - norms[1]) < 1e-5, (key, norms)
                assert abs(losses[0] - losses[1]) < 1e-6, (key, losses)
            assert case["vs_ref"] < 1e-5 and case["vs_torch"] < 1e-6 and case["sum_of_blocks"] < 1e-5, (key, case)
        assert rec["dcp"][0] == 0 and rec["dcp"][1] < 1e-7, rec["dcp"]

        tied = r["tied"]
        for name in ("ours", "torch"):  # both refuse the two-group tie with the same words
            assert tied[name] is not None and "already managed by another" in tied[name], (name, tied[name])
        # the parameter and both modules are named (fully_shard sees the module it is given, not its parent)
        assert tied["ours"].startswith("fully_shard(Linear): parameter 'weight'") and "fully_shard(Embedding)" in tied["ours"]
        assert tied["kept"][0] and tied["kept"][1] == tied["kept"][2] == 5, tied["kept"]
        assert tied["kept_err"][0] < 1e-5 and tied["kept_err"][1] < 1e-6, tied["kept_err"]

        ra = r["reassigned"]
        ours, theirs = ra["ours"], ra["torch"]
        assert ours[3] == "DTensor" and abs(ours[0] - theirs[0]) < 1e-6
        assert _close(ours[1], theirs[1]) and _close(ours[2], theirs[2])
        kind, value, grad, loss = ra["plain"]
        assert kind == "DTensor" and value == [1.0, 2.0, 3.0] and grad == [2.0, 2.0, 2.0]

        sd = r["shard_dims"]
        assert "uneven" in sd["torch_uneven"]
        for (uneven, mp), case in ((k, v) for k, v in sd.items() if isinstance(k, tuple)):
            # mix (2, 3, 8): Shard(2); lin.weight (4, 6|5): Shard(1); the rest Shard(0)
            assert case["placements"] == [(Shard(2),), (Shard(1),), (Shard(0),), (Shard(0),), (Shard(0),)], case
            assert case["contiguous"] and case["states"] == ["sharded", "sharded"]
            tol = 2e-2 if mp else 1e-5
            for loss, g_ref, g_torch, counts in case["rows"]:
                assert counts == (4, 2), counts  # reshard_after_forward=True: 2 groups, twice
                assert g_ref < tol, (uneven, mp, g_ref)
                if not uneven:
                    assert g_torch < (1e-2 if mp else 1e-6), (uneven, mp, g_torch)
            assert case["vs_ref"] < tol
            if not uneven:
                assert case["vs_torch"] < (1e-2 if mp else 1e-6), case["vs_torch"]
                assert case["placements"] == case["torch_placements"]
                assert case["local_shapes"] == case["torch_local_shapes"]
        dcp_err, fwd_err, placements = sd["dcp"]
        assert dcp_err == 0 and fwd_err < 1e-6 and all(pl == (Shard(0),) for pl in placements)
        assert r["compiled_shard_dims"][True] < 1e-6, r["compiled_shard_dims"]
    # uneven Shard(1): the (4, 5) weight's columns 3 + 2
    assert res[0]["shard_dims"][True, False]["local_shapes"][:2] == [(2, 3, 4), (4, 3)]
    assert res[1]["shard_dims"][True, False]["local_shapes"][:2] == [(2, 3, 4), (4, 2)]


def _close(a, b, tol=1e-5):
    return all((x - y).abs().max().item() < tol for x, y in zip(a, b))


def test_chunked_loss_registered_world_one_api_threads_and_pins():
    res = run_distributed(_run_b, 2, timeout=240)
    for r in res:
        ch = r["chunked"]
        for g_ref, g_torch, (rs, head_state) in ch["rows"]:
            assert g_ref < 1e-5 and g_torch < 1e-6, (g_ref, g_torch)
            assert rs == 3 and head_state == "sharded", (rs, head_state)  # one reduce_scatter per group
        assert ch["vs_ref"] < 1e-5 and ch["vs_torch"] < 1e-6

        reg = r["registered"]
        for raf, res_raf in reg.items():
            ours, theirs = res_raf["ours"], res_raf["torch"]
            # inside forward both compute with the full plain tensor (FSDP2's is a registered
            # Parameter, dtshard's the gathered tensor bound to the attribute for the call)
            assert (ours["in_forward"][0], theirs["in_forward"][0]) == ("Tensor", "Parameter")
            assert ours["in_forward"][1] == theirs["in_forward"][1] == 0
            assert ours["values"] == 0 and theirs["values"] == 0
            # documented difference: dtshard keeps the sharded DTensors registered (the same objects)
            assert ours["same_objects"] and ours["types"] == ["DTensor", "DTensor"], ours
            assert ours["after_reshard"] == theirs["after_reshard"] == ["DTensor", "DTensor"]
            kept = raf is False or raf is None  # the root keeps its full parameters after forward
            assert ours["state"] == ("unsharded" if kept else "sharded")
            assert theirs["types"] == (["Parameter", "Parameter"] if kept else ["DTensor", "DTensor"]), (raf, theirs)

        one = r["world_one"]
        for ours_c, theirs_c, ref_c in zip(*[iter(one["counts"])] * 3):
            assert ours_c == (0, 0) and theirs_c[1] == 0, one["counts"]
        assert one["vs_ref"] < 1e-5 and one["vs_torch"] < 1e-6 and all(one["local"])

        api = r["api"]
        assert api["signature"][0] == api["signature"][1]
        ours, theirs = api["ours"], api["torch"]
        assert ours["share_ok"] is None and ours["share_empty"] is None
        assert ours["share_bad"][0] == theirs["share_bad"][0] == "ValueError"
        assert ours["share_bad"][1].startswith("Expects list of FSDPModules but got")
        assert ours["scalar"][0] == theirs["scalar"][0] == "ValueError"
        assert ours["scalar"][1].startswith(theirs["scalar"][1]), (ours["scalar"], theirs["scalar"])
        assert ours["mesh3"][0] == theirs["mesh3"][0] == "ValueError"
        assert ours["mesh3"][1].startswith(theirs["mesh3"][1].split(" but got")[0] + " but got")
        assert ours["invalid_placement"][0] == theirs["invalid_placement"][0] == "ValueError"
        assert ours["invalid_placement"][1].startswith(theirs["invalid_placement"][1])
        assert api["trains"] == ["DTensor"] * 4

        th = r["threads"]
        assert th["errors"] == [] and th["n_bad"] == 0, th
        assert th["values"] < 1e-6

        pins = r["pins"]
        assert pins["lazy", "ours"] == pins["lazy", "torch"] == "RuntimeError"
        for raf in (None, True, False, 2):
            assert pins["raf", raf]["ours"] == pins["raf", raf]["torch"], (raf, pins["raf", raf])
        counts, err_ref, err_torch = pins["accumulate"]
        # micro 0: no sync; micro 1: no sync; micro 2: one reduce_scatter per group; explicit
        # prefetch keeps one all_gather per group in forward and per block in backward
        assert counts == [(5, 0, True), (5, 0, True), (5, 3, False)] * 2, counts
        assert err_ref < 1e-5 and err_torch < 1e-6, (err_ref, err_torch)
        assert pins["manual", "ours"][0] == 0
        assert (pins["manual", "ours"][1] - pins["manual", "torch"][1]).abs().max().item() < 1e-6


def _shard_dims_4():
    """Shard(d) on 4 ranks: HSDP (2, 2) against PyTorch's FSDP2 and one process; FSDP over 4 with
    an uneven dim that leaves rank 3 an empty shard and reshard_after_forward=2 (backward
    gathers over pairs), against one process."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    rank, world = _rank()
    out = {}
    hsdp = dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    flat = dtshard.init_device_mesh("cpu", (world,))
    for name, mesh, uneven, raf in (("hsdp", hsdp, False, True), ("fsdp4", flat, True, 2)):
        torch.manual_seed(0)
        ref, ours = Wide(uneven), Wide(uneven)
        ours.load_state_dict(ref.state_dict())
        kw = {"mesh": mesh, "shard_placement_fn": _largest_dim, "reshard_after_forward": raf}
        fully_shard(ours.head, **kw)
        fully_shard(ours, **kw)
        models = [ours, ref]
        if name == "hsdp":
            theirs = Wide(uneven)
            theirs.load_state_dict(ref.state_dict())
            torch_fully_shard(theirs.head, **kw)
            torch_fully_shard(theirs, **kw)
            models.insert(1, theirs)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
        grad_errs = []
        for step in range(2):
            x = torch.randn(2 * world, 5 if uneven else 6, generator=torch.Generator().manual_seed(step))
            grads = []
            for m, opt in zip(models, opts):
                xs = x if m is ref else x[2 * rank:2 * rank + 2]
                with CommCounter() as c:
                    m(xs).square().mean().backward()
                if m is ours:
                    counts = (c.count("all_gather"), c.count("reduce_scatter"), c.count("all_reduce"))
                grads.append([p.grad for p in m.parameters()])
                opt.step()
                opt.zero_grad()
            grad_errs.append([_err(grads[0], g) for g in grads[1:]])
        out[name] = {"grad_errs": grad_errs, "counts": counts,
                     "errs": [_err(list(ours.parameters()), list(m.parameters())) for m in models[1:]],
                     "placements": [tuple(p.placements) for p in ours.parameters()],
                     "local_shapes": [tuple(p.to_local().shape) for p in ours.parameters()]}
        if name == "hsdp":
            out[name]["torch_placements"] = [tuple(p.placements) for p in theirs.parameters()]
    return out


def test_shard_dims_on_four_ranks_hsdp_and_reshard_to_pairs():
    from dtshard import Replicate

    res = run_distributed(_shard_dims_4, 4, timeout=180)
    for r in res:
        h, f = r["hsdp"], r["fsdp4"]
        assert h["placements"] == h["torch_placements"] == [
            (Replicate(), Shard(2)), (Replicate(), Shard(1)), (Replicate(), Shard(0)), (Replicate(), Shard(0)),
            (Replicate(), Shard(0))]
        for errs in h["grad_errs"]:
            assert errs[0] < 1e-6 and errs[1] < 1e-5, errs  # vs PyTorch's FSDP2, vs one process
        assert h["errs"][0] < 1e-6 and h["errs"][1] < 1e-5, h["errs"]
        assert h["counts"] == (4, 2, 2), h["counts"]
        for errs in f["grad_errs"]:
            assert errs[0] < 1e-5, errs
        assert f["errs"][0] < 1e-5 and f["counts"] == (4, 2, 0), f
    # 4 ranks on the (4, 5) weight's 5 columns: 2, 2, 1, 0 (rank 3's shard is empty)
    assert [r["fsdp4"]["local_shapes"][1] for r in res] == [(4, 2), (4, 2), (4, 1), (4, 0)]
