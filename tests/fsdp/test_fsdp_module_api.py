"""``FSDPModule``'s whole API (PyTorch 2.13's): every public method, each run against PyTorch's
own FSDP2 on the same model and data where PyTorch runs it on gloo.

The model: a root with an embedding and a head around two blocks, each block and the root given
``fully_shard``; float64, so dtshard and PyTorch agree to rounding (1e-12).  2 ranks for FSDP,
4 ranks (2 x 2) for the HSDP-only methods.  One ``run_distributed`` call per world size.
"""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from dtshard.testing import run_distributed

TOL = 1e-12


class _Block(nn.Module):
    def __init__(self, d: int = 6):
        super().__init__()
        self.fc = nn.Linear(d, d)
        self.gate = nn.Linear(d, d, bias=False)  # used only on odd ranks when ``rank_branch``
        self.rank_branch = False

    def forward(self, x):
        y = torch.tanh(self.fc(x))
        if self.rank_branch and dist.get_rank() % 2:
            y = y + self.gate(x)
        return x + y


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(6, 3)

    def forward(self, idx):
        x = self.emb(idx)
        for b in self.blocks:
            x = b(x)
        return self.head(x.reshape(-1, x.shape[-1]))

    def generate(self, idx):
        """Not ``forward``: reads the parameters directly (register_fsdp_forward_method)."""
        return self.head.weight.sum() + self.head.bias.sum() + idx.float().sum()


def _base():
    torch.manual_seed(0)
    return _Net().double()


def _shard(fs, model, mesh, **kw):
    """Four groups: the embedding, each block, the root (the head)."""
    fs(model.emb, mesh=mesh, **kw)
    for b in model.blocks:
        fs(b, mesh=mesh, **kw)
    fs(model, mesh=mesh, **kw)
    return model


def _pair(mesh_shape=None, **kw):
    """(dtshard model, PyTorch model), both fully sharded from the same initial weights."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fs

    import dtshard
    from dtshard.fsdp import fully_shard

    shape = mesh_shape or (dist.get_world_size(),)
    names = ("replicate", "shard")[-len(shape):]
    ours = _shard(fully_shard, copy.deepcopy(_base()), dtshard.init_device_mesh("cpu", shape, mesh_dim_names=names), **kw)
    theirs = _shard(torch_fs, copy.deepcopy(_base()), init_device_mesh("cpu", shape, mesh_dim_names=names), **kw)
    return ours, theirs


def _data(step: int):
    g = torch.Generator().manual_seed(100 + step)
    idx = torch.randint(0, 11, (2 * dist.get_world_size(), 5), generator=g)
    r = dist.get_rank()
    return idx[2 * r:2 * r + 2]


def _loss(model, step: int):
    return model(_data(step)).pow(2).sum()


def _fsdp_modules(model) -> list:
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from dtshard.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, (FSDPModule, TorchFSDPModule))]


def _grads(model):
    return [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]


def _err(a, b) -> float:
    worst = 0.0
    for x, y in zip(a, b):
        if (x is None) != (y is None):
            return float("inf")
        if x is not None:
            worst = max(worst, (x - y).abs().max().item())
    return worst


def _step_both(ours, theirs, step: int = 0):
    for m in (ours, theirs):
        _loss(m, step).backward()
    return _err(_grads(ours), _grads(theirs))


class _CountingComm:
    """A user comm for ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` (PyTorch's
    ``AllGather`` / ``ReduceScatter`` protocol): plain torch.distributed calls, counted, and the
    number of its works not yet waited on when each call is issued."""

    def __init__(self):
        self.calls = 0
        self.allocs = 0
        self.outstanding_at_call: list = []
        self._open = 0

    def allocate(self, size, *, dtype, device):
        self.allocs += 1
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op=False):
        self.calls += 1
        self.outstanding_at_call.append(self._open)
        if op is None:
            work = dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)
        else:
            work = dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)
        if not async_op:
            return None
        self._open += 1
        comm = self

        class _Work:
            def wait(self_inner):
                work.wait()
                comm._open -= 1
                return True

        return _Work()


def _divide_factor_and_hook():
    out = {}
    # a custom divide factor (PyTorch's needs sums forced on gloo: PREMUL_SUM is NCCL's), and
    # what an all-reduce hook sees with and without forced sums
    for force in (True, False):
        ours, theirs = _pair()
        seen = {"ours": [], "theirs": []}
        for m, key in ((ours, "ours"), (theirs, "theirs")):
            m.set_force_sum_reduction_for_comms(force)
            if force:
                m.set_gradient_divide_factor(3.0)
            m.set_all_reduce_hook(lambda t, key=key: seen[key].append(t.clone()))
        err = _step_both(ours, theirs)
        hook_err = max((a - b).abs().max().item() for a, b in zip(seen["ours"], seen["theirs"]))
        out[f"force={force}"] = (err, len(seen["ours"]), len(seen["theirs"]), hook_err)
    # the factor really divides: factor 1 doubles the default average on 2 ranks
    ours, _ = _pair()
    ref, _ = _pair()
    ours.set_gradient_divide_factor(1.0)
    for m in (ours, ref):
        _loss(m, 0).backward()
    out["factor_1_vs_avg"] = (_err([g for g in _grads(ours)[-2:]], [2 * g for g in _grads(ref)[-2:]]))
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ours.set_reduce_scatter_divide_factor(2.0)
    out["deprecated"] = ([type(x.message).__name__ for x in w], ours._dtshard_fsdp.group.gradient_divide_factor)
    return out


def _custom_comms():
    out = {}
    ours, theirs = _pair()
    comms = {}
    for m, key in ((ours, "ours"), (theirs, "theirs")):
        ag, rs = _CountingComm(), _CountingComm()
        for mod in _fsdp_modules(m):
            mod.set_custom_all_gather(ag)
            mod.set_custom_reduce_scatter(rs)
        comms[key] = (ag, rs)
    err = _step_both(ours, theirs)
    out["values"] = err
    out["calls"] = {k: (ag.calls, rs.calls) for k, (ag, rs) in comms.items()}
    # the reduce_scatter input cap: with the user's comm the inputs are held until waited, so a
    # cap of 1 waits for the previous reduction before the next is issued; a cap of 3 does not
    capped = {}
    for cap in (1, 3):
        m, _ = _pair()
        rs = _CountingComm()
        for mod in _fsdp_modules(m):
            mod.set_custom_reduce_scatter(rs)
        m.set_reduce_scatter_max_input_buffers(cap)
        _loss(m, 0).backward()
        capped[cap] = max(rs.outstanding_at_call)
    out["cap"] = capped
    bad = []
    for v in (True, 0, 1.5):
        try:
            m.set_reduce_scatter_max_input_buffers(v)
        except (TypeError, ValueError) as e:
            bad.append(type(e).__name__)
    out["cap_bad"] = bad
    # buffers from the process group's allocator (gloo has none: plain buffers, same values)
    ours, theirs = _pair()
    for m in _fsdp_modules(ours) + _fsdp_modules(theirs):
        m.set_allocate_memory_from_process_group_for_comm(True)
    out["pg_alloc"] = _step_both(ours, theirs)
    m, _ = _pair()
    m.set_custom_all_gather(_CountingComm())
    try:
        m.set_allocate_memory_from_process_group_for_comm(True)
        out["pg_alloc_custom"] = "no error"
    except ValueError as e:
        out["pg_alloc_custom"] = str(e)
    try:
        m.set_symm_mem_for_comm()
        out["symm_mem"] = "no error"
    except NotImplementedError as e:
        out["symm_mem"] = str(e)
    # a separate process group for the reduce_scatter: same values, another communicator
    ours, theirs = _pair()
    ours.set_separate_reduce_scatter_group()
    theirs.set_separate_reduce_scatter_group()
    out["separate"] = _step_both(ours, theirs)
    g = ours._dtshard_fsdp.group
    rs_pg = g.rs_mesh[0].get_group(0)
    out["separate_pg"] = (rs_pg is not g.mesh.get_group(0), dist.get_process_group_ranks(rs_pg))
    return out


def _unused_unshard_event():
    from dtshard.debug import CommCounter

    out = {}
    # a parameter only odd ranks use: with reduce_scatter_unused_params every rank gets the
    # same reduced .grad (PyTorch needs the flag, or its reduce_scatters differ in size)
    ours, theirs = _pair()
    for m in (ours, theirs):
        for b in m.blocks:
            b.rank_branch = True
        m.set_reduce_scatter_unused_params(True)
    out["unused"] = _step_both(ours, theirs)
    out["unused_grad_set"] = all(p.grad is not None for p in ours.parameters())
    # the embedding's group is not gathered for backward (its gradient needs no weights): one
    # all_gather fewer, the same gradients
    ours, _ = _pair()
    ref, _ = _pair()
    ours.emb.set_unshard_in_backward(False)
    counts = []
    for m in (ours, ref):
        with CommCounter() as c:
            _loss(m, 0)
        fwd = c.count("all_gather")
        loss = _loss(m, 1)
        with CommCounter() as c:
            loss.backward()
        counts.append((fwd, c.count("all_gather")))
    out["no_unshard_bwd"] = counts
    out["no_unshard_bwd_err"] = _err(_grads(ours), _grads(ref))
    # the post-optimizer event: waited on once, before the root's first all_gather
    ours, _ = _pair()
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    _loss(ours, 0).backward()
    opt.step()

    class _Event:
        waits = []

        def __init__(self, counter):
            self.counter = counter

        def wait(self, stream=None):
            _Event.waits.append(self.counter.count("all_gather"))

    with CommCounter() as c:
        ours.set_post_optim_event(_Event(c))
        _loss(ours, 1)
        _loss(ours, 2)  # the event was dropped after its wait
    out["event"] = (_Event.waits, c.count("all_gather") > 0)
    return out


def _reset_and_forward_method():
    out = {}

    class Boom(Exception):
        pass

    def fail_once(module, args):
        if getattr(module, "fail", False):
            module.fail = False
            raise Boom()

    losses = {}
    finals = {}
    for key, m in zip(("ours", "theirs"), _pair()):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        m.blocks[1].register_forward_pre_hook(fail_once)
        got = []
        for step in range(3):
            if step == 1:
                m.blocks[1].fail = True
                try:
                    _loss(m, 99)
                except Boom:
                    m.reset_iter_state()
            loss = _loss(m, step)
            loss.backward()
            opt.step()
            opt.zero_grad()
            got.append(loss.item())
        losses[key] = got
        finals[key] = [p.full_tensor() for p in m.parameters()]
        try:
            m.blocks[0].reset_iter_state()
            out[f"non_root_{key}"] = "no error"
        except RuntimeError:
            out[f"non_root_{key}"] = "RuntimeError"
    out["reset_losses"] = max(abs(a - b) for a, b in zip(losses["ours"], losses["theirs"]))
    out["reset_params"] = _err(finals["ours"], finals["theirs"])
    # a method other than forward, registered: the parameters are gathered for it
    from torch.distributed.fsdp import register_fsdp_forward_method as torch_register

    from dtshard.fsdp import register_fsdp_forward_method

    ours, theirs = _pair()
    register_fsdp_forward_method(ours, "generate")
    torch_register(theirs, "generate")
    idx = _data(0)
    want = _base().generate(idx)
    out["generate"] = (abs(ours.generate(idx).item() - want.item()), abs(theirs.generate(idx).item() - want.item()),
                       ours._dtshard_fsdp.group.state)
    register_fsdp_forward_method(nn.Linear(2, 2), "forward")  # not an FSDP module: left alone
    try:
        register_fsdp_forward_method(ours, "no_such_method")
        out["bad_name"] = "no error"
    except ValueError as e:
        out["bad_name"] = str(e)
    return out


def _two_ranks():
    return {"divide": _divide_factor_and_hook(), "comms": _custom_comms(), "unused": _unused_unshard_event(),
            "reset": _reset_and_forward_method()}


def _hsdp_requires_all_reduce():
    """HSDP 2 x 2: two micro-batches reduce-scattered only, the third all-reduces the sum."""
    from dtshard.debug import CommCounter

    ours, theirs = _pair((2, 2))
    counts = []
    for key, m in (("ours", ours), ("theirs", theirs)):
        for step in range(3):
            m.set_requires_all_reduce(step == 2)
            if m is ours:
                with CommCounter() as c:
                    _loss(m, step).backward()
                counts.append((c.count("reduce_scatter"), c.count("all_reduce"),
                               all(p.grad is None for p in m.parameters())))
            else:
                _loss(m, step).backward()
    # the hook sees the all-reduced output under HSDP; a stream with HSDP is refused
    try:
        ours.set_all_reduce_hook(lambda t: None, stream=object())
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    return counts, _err(_grads(ours), _grads(theirs)), refused


def test_fsdp_module_has_every_public_method_of_pytorchs():
    import torch.distributed.fsdp as torch_fsdp

    import dtshard.fsdp as ours

    theirs = {n for n in dir(torch_fsdp.FSDPModule) if not n.startswith("_")}
    mine = {n for n in dir(ours.FSDPModule) if not n.startswith("_")}
    assert theirs - mine == set(), sorted(theirs - mine)
    assert hasattr(ours, "register_fsdp_forward_method") and hasattr(torch_fsdp, "register_fsdp_forward_method")


def test_fsdp_module_methods_match_pytorch_on_two_ranks():
    res = run_distributed(_two_ranks, 2, timeout=240)
    for rank, r in enumerate(res):
        d = r["divide"]
        for force in (True, False):
            err, n_ours, n_theirs, hook_err = d[f"force={force}"]
            assert err < TOL and n_ours == n_theirs == 1 and hook_err < TOL, (rank, force, d)  # the root's group
        assert d["factor_1_vs_avg"] < TOL, d
        assert d["deprecated"] == (["FutureWarning"], 2.0), d

        c = r["comms"]
        assert c["values"] < TOL, c
        # 4 groups: forward gathers each once, backward all but the root again (the root is kept)
        assert c["calls"]["ours"] == c["calls"]["theirs"] == (7, 4), c["calls"]
        assert c["cap"] == {1: 0, 3: 2}, c["cap"]
        assert c["cap_bad"] == ["TypeError", "ValueError", "TypeError"], c["cap_bad"]
        assert c["pg_alloc"] < TOL
        assert "custom comm" in c["pg_alloc_custom"]
        assert "NCCL on CUDA" in c["symm_mem"] and "not support" in c["symm_mem"]
        assert c["separate"] < TOL and c["separate_pg"] == (True, [0, 1]), c

        u = r["unused"]
        assert u["unused"] < TOL and u["unused_grad_set"], u
        # forward gathers 4 groups; backward: the 2 blocks, not the embedding (nor the root)
        assert u["no_unshard_bwd"] == [(4, 2), (4, 3)], u["no_unshard_bwd"]
        assert u["no_unshard_bwd_err"] < TOL
        assert u["event"] == ([0], True), u["event"]

        s = r["reset"]
        assert s["reset_losses"] < TOL and s["reset_params"] < TOL, s
        assert s["non_root_ours"] == s["non_root_theirs"] == "RuntimeError"
        ours_err, theirs_err, state = s["generate"]
        assert ours_err < 1e-9 and theirs_err < 1e-9 and state == "unsharded", s["generate"]
        assert "no_such_method" in s["bad_name"]


def test_hsdp_requires_all_reduce_matches_pytorch():
    res = run_distributed(_hsdp_requires_all_reduce, 4, timeout=240)
    for counts, err, refused in res:
        # 4 groups: two micro-batches reduce-scatter only (no .grad yet), the third all-reduces
        assert counts == [(4, 0, True), (4, 0, True), (4, 4, False)], counts
        assert err < TOL, err
        assert "HSDP" in refused
