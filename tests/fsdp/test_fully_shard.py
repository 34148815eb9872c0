"""dtshard.fsdp.fully_shard: PyTorch FSDP2's contract on dtshard DTensors.

Every check runs on every rank of a gloo pool and is compared against the same model trained in
one process (fp32, AdamW), or against PyTorch's own ``torch.distributed.fsdp.fully_shard``
(mixed precision).  The model is a small MLP stack: a root with parameters of its own (an input
and an output Linear) and N residual blocks, each given ``fully_shard``; Linear(5, 7), Linear(7, 9)
and friends make every shard uneven (and some empty on 4 ranks).  Collective counts are exact
(``dtshard.debug.CommCounter``): ONE all_gather and ONE reduce_scatter per group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import dtshard
from dtshard import Replicate, Shard
from dtshard.debug import CommCounter, peak_alloc_bytes
from dtshard.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from dtshard.models import ResidualMLP
from dtshard.testing import run_distributed

N_BLOCKS = 3


Block = ResidualMLP


class Stack(nn.Module):
    """Root parameters (inp, out) around ``n`` blocks."""

    def __init__(self, n: int = N_BLOCKS):
        super().__init__()
        self.inp = nn.Linear(5, 7)
        self.blocks = nn.ModuleList(Block(7, 9) for _ in range(n))
        self.out = nn.Linear(7, 3)

    def forward(self, x):
        x = self.inp(x)
        for b in self.blocks:
            x = b(x)
        return self.out(x)


def _models(seed: int = 0):
    torch.manual_seed(seed)
    model = Stack()
    ref = Stack()
    ref.load_state_dict(model.state_dict())
    return model, ref


def _shard(model, mesh, **kw):
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


def _batch(step: int, n: int):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(4 * n, 5, generator=g), torch.randn(4 * n, 3, generator=g)


def _dp_index(mesh) -> tuple[int, int]:
    """(this rank's data-parallel index, dp size): every rank of the mesh gets its own data."""
    coord = mesh.get_coordinate()
    idx = 0
    for c, n in zip(coord, mesh.shape):
        idx = idx * n + c
    return idx, mesh.size()


def _full_params(model) -> list[torch.Tensor]:
    return [p.full_tensor() for p in model.parameters()]


def _train(mesh_shape, raf, steps: int, offload: bool = False):
    """Train the FSDP model and the one-process reference side by side; per step: (loss of this
    rank's batch, reference loss of the global batch, forward all_gathers, backward all_gathers,
    backward reduce_scatters, backward all_reduces)."""
    mesh = dtshard.init_device_mesh("cpu", mesh_shape)
    model, ref = _models()
    kw = {"reshard_after_forward": raf}
    if offload:
        kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    _shard(model, mesh, **kw)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    me, n = _dp_index(mesh)
    rows = []
    for step in range(steps):
        x, y = _batch(step, n)
        with CommCounter() as fwd:
            loss = ((model(x[4 * me:4 * me + 4]) - y[4 * me:4 * me + 4]) ** 2).mean()
        with CommCounter() as bwd:
            loss.backward()
        grads_ok = all(isinstance(p.grad, dtshard.DTensor) and p.grad.placements == p.placements
                       and p.grad.dtype == torch.float32 for p in model.parameters())
        opt.step()
        opt.zero_grad()
        rloss = ((ref(x) - y) ** 2).mean()
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        # all of it is FSDP's own traffic (no DTensor op redistributes anything)
        grads_ok = grads_ok and {r.op for r in fwd.records + bwd.records} == {"<fsdp>"}
        rows.append((loss.item(), rloss.item(), fwd.count("all_gather"), bwd.count("all_gather"),
                     bwd.count("reduce_scatter"), bwd.count("all_reduce"), grads_ok))
    err = max((a - b.detach()).abs().max().item() for a, b in zip(_full_params(model), ref.parameters()))
    return rows, err


def _layout(mesh_shape):
    """Types, placements, state_dict, the flat shard (the optimizer updates it in place), clip."""
    mesh = dtshard.init_device_mesh("cpu", mesh_shape)
    model, ref = _models()
    _shard(model, mesh)
    want = (Replicate(), Shard(0)) if len(mesh_shape) == 2 else (Shard(0),)
    out = {
        "isinstance": [isinstance(m, FSDPModule) for m in (model, *model.blocks)],
        "class": type(model).__name__,
        "params": all(type(p) is dtshard.DTensor and p.placements == want for p in model.parameters()),
        "sd": all(type(v) is dtshard.DTensor for v in model.state_dict().values()),
        "sd_keys": sorted(model.state_dict()) == sorted(ref.state_dict()),
        "local_shapes": [tuple(p.to_local().shape) for p in model.parameters()],
    }
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    me, n = _dp_index(mesh)
    x, y = _batch(0, n)
    sd_before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref_before = Stack()
    ref_before.load_state_dict(ref.state_dict())
    ((model(x[4 * me:4 * me + 4]) - y[4 * me:4 * me + 4]) ** 2).mean().backward()
    ((ref(x) - y) ** 2).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    out["clip"] = (float(norm.full_tensor() if isinstance(norm, dtshard.DTensor) else norm), float(rnorm))
    out["clipped_grad_err"] = max((p.grad.full_tensor() - q.grad).abs().max().item()
                                  for p, q in zip(model.parameters(), ref.parameters()))
    opt.step()
    # load_state_dict of a sharded state dict (the pre-step values) copies into the shards in place
    saved = {k: v.detach().clone() for k, v in sd_before.items()}
    model.load_state_dict(saved)
    out["loaded"] = max((a.full_tensor() - b.full_tensor()).abs().max().item()
                        for a, b in zip(model.state_dict().values(), saved.values()))
    with torch.no_grad():
        out["loaded_forward"] = (model(x) - ref_before(x)).abs().max().item()
    groups = [m._dtshard_fsdp.group for m in (model, *model.blocks)]
    # the sharded parameters still are views of their group's flat shard after an optimizer step
    # and a load_state_dict
    out["flat_views"] = all(g._is_view_of_flat(p, i) for g in groups for p, i in zip(g.sharded_params, g.infos))
    return out


def _no_sync(mesh_shape, micro: int = 3):
    """Gradient accumulation: set_requires_gradient_sync(False) on all but the last microbatch."""
    mesh = dtshard.init_device_mesh("cpu", mesh_shape)
    model, ref = _models()
    _shard(model, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    me, n = _dp_index(mesh)
    counts = []
    for step in range(2):
        for k in range(micro):
            last = k == micro - 1
            model.set_requires_gradient_sync(last)
            x, y = _batch(10 * step + k, n)
            with CommCounter() as c:
                ((model(x[4 * me:4 * me + 4]) - y[4 * me:4 * me + 4]) ** 2).mean().backward()
            counts.append((c.count("reduce_scatter"), c.count("all_reduce"),
                           all(p.grad is None for p in model.parameters()) if not last else None))
            ((ref(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
        ropt.step()
        ropt.zero_grad()
    err = max((a - b.detach()).abs().max().item() for a, b in zip(_full_params(model), ref.parameters()))
    return counts, err


def _api(_=None):
    """unshard / reshard / async handle / explicit prefetch / set_is_last_backward / containers."""
    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    model, ref = _models()
    _shard(model, mesh)
    out = {}
    x, y = _batch(0, 1)
    with CommCounter() as c:
        h = model.blocks[0].unshard(async_op=True)
        none = model.blocks[1].unshard()  # synchronous: returns None
        h.wait()
        model.blocks[1].reshard()
    out["unshard"] = (type(h).__name__, none, c.count("all_gather"), model.blocks[0]._fsdp_state.group.state,
                      model.blocks[1]._fsdp_state.group.state)
    with CommCounter() as c:
        model(x)  # block 0 is already unsharded: no all_gather for it
    out["fwd_after_unshard"] = c.count("all_gather")
    model.reshard()  # the root keeps its parameters after forward until backward: free them
    out["root_resharded"] = model._fsdp_state.group.state
    model.zero_grad()
    # explicit prefetch lists replace the implicit ones; counts stay one per group
    for i, b in enumerate(model.blocks):
        if i + 1 < len(model.blocks):
            b.set_modules_to_forward_prefetch([model.blocks[i + 1]])
        if i > 0:
            b.set_modules_to_backward_prefetch([model.blocks[i - 1]])
    with CommCounter() as c:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
    out["explicit_prefetch"] = (c.count("all_gather"), c.count("reduce_scatter"))
    rloss = ((ref(x) - y) ** 2).mean()
    rloss.backward()
    out["grad_err"] = max((p.grad.full_tensor() - q.grad).abs().max().item()
                          for p, q in zip(model.parameters(), ref.parameters()))
    # set_is_last_backward(False): the reductions stay in flight past backward; the next backward
    # with True finishes both, and the sum equals two reference backwards
    model.zero_grad()
    ref.zero_grad()
    model.set_is_last_backward(False)
    ((model(x) - y) ** 2).mean().backward()
    pending = len(model._fsdp_state.ctx.pending)
    model.set_is_last_backward(True)
    ((model(x) - y) ** 2).mean().backward()
    for _ in range(2):
        ((ref(x) - y) ** 2).mean().backward()
    out["last_backward"] = (pending, max((p.grad.full_tensor() - q.grad).abs().max().item()
                                         for p, q in zip(model.parameters(), ref.parameters())))
    # set_reshard_after_forward(False): no all_gather in backward
    model.set_reshard_after_forward(False)
    with CommCounter() as f:
        loss = ((model(x) - y) ** 2).mean()
    with CommCounter() as c:
        loss.backward()
    out["no_reshard_bwd"] = (f.count("all_gather"), c.count("all_gather"), c.count("reduce_scatter"))
    # the root keeps its full parameters after a forward whose backward never runs; an optimizer
    # step then changes the shards, and the next forward must gather them again
    model, ref = _models()
    _shard(model, mesh)
    opt, ropt = (torch.optim.AdamW(m.parameters(), lr=1e-1) for m in (model, ref))
    ((model(x) - y) ** 2).mean().backward()
    ((ref(x) - y) ** 2).mean().backward()
    model(x)
    opt.step()
    ropt.step()
    with CommCounter() as c:
        y2 = model(x)
    out["stale_root"] = (c.count("all_gather"), (y2 - ref(x)).abs().max().item())
    # a sharded parameter also used outside the forward (a weight-decay term on the DTensors):
    # autograd's gradient for it and FSDP's reduced one add up
    model, ref = _models()
    _shard(model, mesh)
    reg = sum(p.square().sum().full_tensor() for p in model.parameters())
    (((model(x) - y) ** 2).mean() + 0.1 * reg).backward()
    rreg = sum(p.square().sum() for p in ref.parameters())
    (((ref(x) - y) ** 2).mean() + 0.1 * rreg).backward()
    out["regularizer"] = max((p.grad.full_tensor() - q.grad).abs().max().item()
                             for p, q in zip(model.parameters(), ref.parameters()))
    # a container built from a slice of an FSDP container is a plain module of the original class
    seq = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(seq, mesh=mesh)
    out["slice"] = type(seq[0:1]).__name__
    return out


def _prefetch_states(_=None):
    """While block i computes, block i+1's all_gather is in flight (forward) and block i-1's
    (backward); the first step fixes the order, so prefetch starts at step 2."""
    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    model, _ = _models()
    _shard(model, mesh)
    groups = [b._fsdp_state.group for b in model.blocks]
    seen = {"fwd": [], "bwd": []}

    def fwd_hook(i):
        def hook(mod, args, out):  # runs inside block i's forward (after block.a)
            seen["fwd"].append((i, groups[i + 1].state if i + 1 < len(groups) else None))
            out.register_hook(lambda g: seen["bwd"].append((i, groups[i - 1].state if i > 0 else None)))
        return hook

    for i, b in enumerate(model.blocks):
        b.a.register_forward_hook(fwd_hook(i))
    x, y = _batch(0, 1)
    for step in range(2):
        seen["fwd"].clear()
        seen["bwd"].clear()
        ((model(x) - y) ** 2).mean().backward()
    return seen


class Tied(nn.Module):
    """An embedding and an output head sharing one weight (both in the root's group)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 7)
        self.block = Block(7, 9)
        self.head = nn.Linear(7, 11, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(self.block(self.emb(ids)))


def _frozen_tied_ignored(_=None):
    """A frozen parameter gets no gradient and no traffic of its own; tied weights are one
    parameter bound under both names; ignored parameters stay plain and unreduced."""
    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    torch.manual_seed(0)
    model, ref = Tied(), Tied()
    ref.load_state_dict(model.state_dict())
    model.block.a.weight.requires_grad_(False)
    ref.block.a.weight.requires_grad_(False)
    fully_shard(model.block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    me, n = _dp_index(mesh)
    ids = torch.arange(4 * n).remainder(11).view(n, 4)
    model(ids[me:me + 1]).square().mean().backward()
    ref(ids).square().mean().backward()
    out["tied_names"] = (model.head.weight is model.emb.weight, len(list(model.parameters())))
    out["frozen_grad"] = model.block.a.weight.grad is None
    out["grad_err"] = max((p.grad.full_tensor() - q.grad).abs().max().item()
                          for p, q in zip(model.parameters(), ref.parameters()) if p.requires_grad)
    m = Stack()
    keep = m.out.weight
    for b in m.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(m, mesh=mesh, ignored_params={keep})
    m(torch.randn(2, 5)).sum().backward()
    out["ignored"] = (m.out.weight is keep, type(m.out.weight).__name__, type(m.out.weight.grad).__name__,
                      type(m.out.bias).__name__)
    return out


def _mixed_precision(_=None):
    """param_dtype=bf16, reduce_dtype=fp32 against PyTorch's own FSDP2 with the same policy."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, theirs = _models()
    _shard(model, mesh, mp_policy=mp)
    for b in theirs.blocks:
        torch_fully_shard(b, mesh=mesh, mp_policy=mp)
    torch_fully_shard(theirs, mesh=mesh, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    topt = torch.optim.AdamW(theirs.parameters(), lr=1e-2)
    me, n = _dp_index(mesh)
    rows = []
    for step in range(5):
        x, y = _batch(step, n)
        with CommCounter() as c:
            out = model(x[4 * me:4 * me + 4])
            loss = ((out.float() - y[4 * me:4 * me + 4]) ** 2).mean()
            loss.backward()
        tloss = ((theirs(x[4 * me:4 * me + 4]).float() - y[4 * me:4 * me + 4]) ** 2).mean()
        tloss.backward()
        dtypes = (out.dtype, {p.dtype for p in model.parameters()}, {p.grad.dtype for p in model.parameters()})
        gather_bytes = c.bytes(kind="all_gather")
        opt.step()
        opt.zero_grad()
        topt.step()
        topt.zero_grad()
        rows.append((loss.item(), tloss.item()))
    # what one step's all_gathers put on the wire in bf16: every group forward, the blocks again
    # in backward, (n - 1) copies of the flat shard of 2 bytes per element each time
    s_root = model._dtshard_fsdp.group.S
    s_blocks = sum(b._dtshard_fsdp.group.S for b in model.blocks)
    want_bytes = (n - 1) * 2 * (s_root + 2 * s_blocks)
    err = max((a - b.full_tensor()).abs().max().item() for a, b in zip(_full_params(model), theirs.parameters()))
    return rows, err, str(dtypes), gather_bytes, want_bytes


def _bad_inputs(_=None):
    """Each bad call raises the same clear error on every rank; the process group stays usable."""
    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    msgs = {}

    def catch(key, fn):
        try:
            fn()
            msgs[key] = None
        except Exception as e:  # noqa: BLE001  (the message is what is checked)
            msgs[key] = f"{type(e).__name__}: {e}"

    twice = nn.Linear(3, 3)
    fully_shard(twice, mesh=mesh)
    catch("twice", lambda: fully_shard(twice, mesh=mesh))

    from torch.distributed.tensor import distribute_tensor as torch_distribute

    tmod = nn.Linear(4, 4)
    tmod.weight = nn.Parameter(torch_distribute(tmod.weight.detach(), mesh, [Shard(0)]))
    catch("torch_dtensor", lambda: fully_shard(tmod, mesh=mesh))

    mixed = nn.Linear(4, 4)
    mixed.bias = nn.Parameter(torch.empty(4, device="meta"))
    catch("devices", lambda: fully_shard(mixed, mesh=mesh))
    msgs["devices_untouched"] = not isinstance(mixed, FSDPModule) and type(mixed.weight) is nn.Parameter

    top_down = Stack()
    fully_shard(top_down, mesh=mesh)  # the root first: it takes every parameter
    catch("top_down", lambda: fully_shard(top_down.blocks[0], mesh=mesh))

    empty = nn.Sequential(nn.ReLU())
    catch("empty", lambda: fully_shard(empty, mesh=mesh))
    with CommCounter() as c:
        yy = empty(torch.randn(2, 3))
    msgs["empty_forward"] = (isinstance(empty, FSDPModule), tuple(yy.shape), c.count())
    # the process group still works: a training step with one all_gather and one reduce_scatter
    m = nn.Linear(5, 7)
    fully_shard(m, mesh=mesh)
    with CommCounter() as c:
        m(torch.randn(2, 5)).sum().backward()
    msgs["usable"] = (c.count("all_gather"), c.count("reduce_scatter"), type(m.weight.grad).__name__)
    return msgs


class CheckpointedBlock(Block):
    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=False)


def _checkpoint_and_eval(_=None):
    """Activation checkpointing inside a block (its forward reruns in backward: no extra
    collective, same gradients) and a no-grad forward (every group, the root too, resharded)."""
    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    model, ref = _models()
    model.blocks = nn.ModuleList(CheckpointedBlock(7, 9) for _ in range(N_BLOCKS))
    model.blocks.load_state_dict(ref.blocks.state_dict())
    _shard(model, mesh)
    me, n = _dp_index(mesh)
    out = {}
    for step in range(2):
        x, y = _batch(step, n)
        with CommCounter() as f:
            loss = ((model(x[4 * me:4 * me + 4]) - y[4 * me:4 * me + 4]) ** 2).mean()
        with CommCounter() as b:
            loss.backward()
        ((ref(x) - y) ** 2).mean().backward()
        out[f"ckpt{step}"] = (f.count("all_gather"), b.count("all_gather"), b.count("reduce_scatter"))
    out["ckpt_grad_err"] = max((p.grad.full_tensor() - q.grad).abs().max().item()
                               for p, q in zip(model.parameters(), ref.parameters()))
    with torch.no_grad(), CommCounter() as c:
        y0 = model(x)
    out["eval"] = (c.count("all_gather"), [m._fsdp_state.group.state for m in (model, *model.blocks)],
                   (y0 - ref(x)).abs().max().item())
    return out


def _memory(_=None, n_blocks: int = 6, d: int = 512):
    """Peak forward memory: at most 3 blocks' full parameters plus the root's (+ 1 MB for the
    activations of a 4-row batch) above what was allocated before the forward (the sharded
    parameters, P/W, so this is stricter than ``(3 P_block + P_nonblock + P/W) * itemsize``).
    Measured by :func:`dtshard.debug.peak_alloc_bytes`.  What it sees on gloo: block i's full parameters, block i+1's
    gathered buffer in flight, and gloo's own flat staging copy of that output (NCCL gathers in
    place), so about 3 P_block; without resharding every block's full parameters stay."""
    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    res = {}
    for raf in (None, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, d), *[Block(d, d) for _ in range(n_blocks)], nn.Linear(d, 4))
        p_block = sum(p.numel() for p in model[1].parameters()) * 4
        p_root = sum(p.numel() for m in (model[0], model[-1]) for p in m.parameters()) * 4
        for b in model[1:-1]:
            fully_shard(b, mesh=mesh, reshard_after_forward=raf)
        fully_shard(model, mesh=mesh, reshard_after_forward=raf)
        x = torch.randn(4, 16)
        model(x).sum().backward()  # the first step fixes the forward order (prefetch from step 2)
        model.zero_grad()
        out = []
        res[raf] = (peak_alloc_bytes(lambda: out.append(model(x))), 3 * p_block + p_root + 2**20, p_block)
        out[0].sum().backward()
    return res


# ---------------------------------------------------------------------------------------------
# tests (each batches several checks into one run_distributed call)
# ---------------------------------------------------------------------------------------------


def _fsdp_2_ranks():
    return {
        "train": {raf: _train((2,), raf, 10 if raf is None else 3) for raf in (None, True, False)},
        "offload": _train((2,), None, 3, offload=True),
        "layout": _layout((2,)),
        "no_sync": _no_sync((2,)),
        "memory": _memory(),
    }


def _check_train(rows, err, bwd_gathers, all_reduces=0, n_steps=None):
    N = N_BLOCKS
    if n_steps is not None:
        assert len(rows) == n_steps
    for loss, rloss, fwd_ag, bwd_ag, rs, ar, grads_ok in rows:
        assert (fwd_ag, bwd_ag, rs, ar) == (N + 1, bwd_gathers, N + 1, all_reduces)
        assert grads_ok
    assert err < 1e-5, err


def test_fsdp_two_ranks_numerics_counts_layout_no_sync():
    res = run_distributed(_fsdp_2_ranks, 2, timeout=180)
    N = N_BLOCKS
    for rank_res in res:
        _check_train(*rank_res["train"][None], bwd_gathers=N, n_steps=10)
        _check_train(*rank_res["train"][True], bwd_gathers=N + 1)
        _check_train(*rank_res["train"][False], bwd_gathers=0)
        _check_train(*rank_res["offload"], bwd_gathers=N)
        lay = rank_res["layout"]
        assert lay["isinstance"] == [True] * (N + 1) and lay["class"] == "FSDPStack"
        assert lay["params"] and lay["sd"] and lay["sd_keys"] and lay["flat_views"]
        assert lay["loaded"] == 0 and lay["loaded_forward"] < 1e-6
        assert abs(lay["clip"][0] - lay["clip"][1]) < 1e-5 and lay["clipped_grad_err"] < 1e-6
        counts, err = rank_res["no_sync"]
        assert counts == [(0, 0, True), (0, 0, True), (N + 1, 0, None)] * 2
        assert err < 1e-5, err
        peak, bound, p_block = rank_res["memory"][None]
        assert peak <= bound, (peak, bound)
        peak_kept, _, _ = rank_res["memory"][False]
        assert peak_kept > bound + p_block, (peak_kept, bound)  # the measurement sees full parameters
    # the losses: the mean of the ranks' losses is the global batch's loss
    for raf in (None, True, False):
        for step, rows in enumerate(zip(*(r["train"][raf][0] for r in res))):
            mean = sum(row[0] for row in rows) / len(rows)
            assert abs(mean - rows[0][1]) < 1e-5, (raf, step, mean, rows[0][1])
    # uneven shards: Linear(5, 7).weight is (7, 5): 4 + 3 rows; bias 7: 4 + 3
    assert res[0]["layout"]["local_shapes"][:2] == [(4, 5), (4,)]
    assert res[1]["layout"]["local_shapes"][:2] == [(3, 5), (3,)]


def _hsdp_4_ranks():
    return {"train": _train((2, 2), None, 10), "layout": _layout((2, 2)), "no_sync": _no_sync((2, 2), micro=2),
            "fsdp4": _train((4,), None, 3), "fsdp4_layout": _layout((4,))}


def test_hsdp_2x2_numerics_counts_layout_no_sync():
    res = run_distributed(_hsdp_4_ranks, 4, timeout=240)
    N = N_BLOCKS
    for rank_res in res:
        _check_train(*rank_res["train"], bwd_gathers=N, all_reduces=N + 1, n_steps=10)
        lay = rank_res["layout"]
        assert lay["params"] and lay["sd"] and lay["flat_views"]
        assert abs(lay["clip"][0] - lay["clip"][1]) < 1e-5 and lay["clipped_grad_err"] < 1e-6
        counts, err = rank_res["no_sync"]
        assert counts == [(0, 0, True), (N + 1, N + 1, None)] * 2
        assert err < 1e-5, err
    for step, rows in enumerate(zip(*(r["train"][0] for r in res))):
        assert abs(sum(row[0] for row in rows) / 4 - rows[0][1]) < 1e-5
    # FSDP on 4 ranks: Linear(7, 3).weight has 3 rows, so rank 3's shard is empty
    for rank_res in res:
        _check_train(*rank_res["fsdp4"], bwd_gathers=N, n_steps=3)
        assert rank_res["fsdp4_layout"]["params"] and rank_res["fsdp4_layout"]["flat_views"]
    assert [r["fsdp4_layout"]["local_shapes"][-2] for r in res] == [(1, 7), (1, 7), (1, 7), (0, 7)]
    # shard dim has 2 ranks: coordinate (r, 0) holds 4 rows of the (7, 5) weight, (r, 1) 3 rows
    assert [r["layout"]["local_shapes"][0] for r in res] == [(4, 5), (3, 5), (4, 5), (3, 5)]


def _api_mp_bad():
    return {"api": _api(), "prefetch": _prefetch_states(), "extras": _frozen_tied_ignored(), "mp": _mixed_precision(), "bad": _bad_inputs(), "ckpt": _checkpoint_and_eval()}


def test_api_mixed_precision_and_bad_inputs():
    res = run_distributed(_api_mp_bad, 2, timeout=180)
    N = N_BLOCKS
    for rank_res in res:
        api = rank_res["api"]
        assert api["unshard"] == ("UnshardHandle", None, 2, "unsharded", "sharded")
        assert api["fwd_after_unshard"] == N  # root + blocks 1, 2 (block 0 was unsharded)
        assert api["root_resharded"] == "sharded"
        assert api["explicit_prefetch"] == (N + 1 + N, N + 1)
        assert api["grad_err"] < 1e-6
        pending, err = api["last_backward"]
        assert pending == N + 1 and err < 1e-5
        assert api["no_reshard_bwd"] == (N + 1, 0, N + 1)
        assert api["slice"] == "Sequential"
        assert api["stale_root"][0] == N + 1 and api["stale_root"][1] < 1e-5
        assert api["regularizer"] < 1e-5

        ex = rank_res["extras"]
        assert ex["tied_names"] == (True, 5) and ex["frozen_grad"] and ex["grad_err"] < 1e-6
        assert ex["ignored"] == (True, "Parameter", "Tensor", "DTensor")
        assert rank_res["prefetch"] == {"fwd": [(0, "gathering"), (1, "gathering"), (2, None)],
                                        "bwd": [(2, "gathering"), (1, "gathering"), (0, None)]}

        rows, err, dtypes, gather_bytes, want_bytes = rank_res["mp"]
        assert gather_bytes == want_bytes  # gathered in bf16, not fp32
        assert dtypes == str((torch.bfloat16, {torch.float32}, {torch.float32}))
        for loss, tloss in rows:  # bf16 compute on both sides: equal within bf16 rounding
            assert abs(loss - tloss) <= 4e-3 * max(1.0, abs(tloss)), (loss, tloss)
        assert err < 8e-3, err

        ck = rank_res["ckpt"]
        assert ck["ckpt0"] == ck["ckpt1"] == (N + 1, N, N + 1)
        assert ck["ckpt_grad_err"] < 1e-5
        assert ck["eval"][:2] == (N + 1, ["sharded"] * (N + 1)) and ck["eval"][2] < 1e-5

        bad = rank_res["bad"]
        assert "already applied" in bad["twice"]
        assert "torch.distributed.tensor.DTensor" in bad["torch_dtensor"] and "from_torch" in bad["torch_dtensor"]
        assert bad["devices"].startswith("ValueError") and "different devices" in bad["devices"]
        assert "bias: meta" in bad["devices"] and bad["devices_untouched"]
        assert "bottom-up" in bad["top_down"] and "blocks.0" not in bad["top_down"]
        assert bad["empty"] is None and bad["empty_forward"] == (True, (2, 3), 0)
        assert bad["usable"] == (1, 1, "DTensor")
    # the same message on every rank
    assert res[0]["bad"] == res[1]["bad"]
