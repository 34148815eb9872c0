"""Drop-in gaps (issue #17): code written for ``torch.distributed.tensor`` runs on dtshard after
changing only its import.

Each check runs the SAME code on both libraries (``LIBS``: the module that provides ``DTensor``,
``distribute_tensor``, ``zeros``, ...), first on ``torch.distributed.tensor``, then on dtshard, and
compares what they report (placements, shapes, strides, local shards, values), plus dtshard's own
guarantees (no communication where none is needed, random values equal to the single-process
draw).  Checks are batched into few ``run_distributed`` calls to keep the file fast.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
import torch.nn as nn

import dtshard
from dtshard import Partial, Replicate, Shard
from dtshard.testing import run_distributed

LIBS = {"torch": tdt, "dtshard": dtshard}


def _mesh_2x2():
    return dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _same(ours, theirs, what: str) -> None:
    """dtshard's DTensor ``ours`` reports what PyTorch's ``theirs`` does: placements, global shape,
    stride, contiguity, dtype, requires_grad, leaf-ness, and the same local shard."""
    assert isinstance(ours, dtshard.DTensor) and isinstance(theirs, tdt.DTensor), (what, type(ours), type(theirs))
    assert tuple(ours.placements) == tuple(theirs.placements), (what, ours.placements, theirs.placements)
    assert tuple(ours.shape) == tuple(theirs.shape), (what, ours.shape, theirs.shape)
    assert ours.stride() == theirs.stride(), (what, ours.stride(), theirs.stride())
    assert ours.is_contiguous() == theirs.is_contiguous(), what
    assert ours.dtype == theirs.dtype, (what, ours.dtype, theirs.dtype)
    assert ours.requires_grad == theirs.requires_grad and ours.is_leaf == theirs.is_leaf, what
    assert ours.device_mesh == theirs.device_mesh, what
    a, b = ours.to_local(), theirs.to_local()
    assert a.shape == b.shape and a.stride() == b.stride(), (what, a.shape, b.shape, a.stride(), b.stride())


# ----------------------------------------------------------------------------------------------
# Item 2: factories.  Item 8: the `with mesh:` context.
# ----------------------------------------------------------------------------------------------

_SIZES = [((5, 3), {}), (((5, 3),), {}), (([5, 3],), {}), ((torch.Size([5, 3]),), {})]


def _factory_checks():
    rank = dist.get_rank()
    mesh = _mesh_2x2()
    cases = [
        (mesh, None), (mesh, [Shard(0), Replicate()]), (mesh, [Shard(1), Shard(0)]), (mesh, [Shard(0), Shard(0)]),
        (mesh["tp"], [Shard(0)]), (mesh["tp"], None), (mesh["dp"], [Shard(1)]),
    ]
    made = {}
    for name, lib in LIBS.items():
        for ci, (m, placements) in enumerate(cases):
            for si, (size, _) in enumerate(_SIZES):
                kw = dict(device_mesh=m, placements=placements)
                made[name, ci, si, "zeros"] = lib.zeros(*size, **kw)
                made[name, ci, si, "ones"] = lib.ones(*size, dtype=torch.float64, **kw)
                made[name, ci, si, "empty"] = lib.empty(*size, requires_grad=True, **kw)
                made[name, ci, si, "full"] = lib.full(size[0] if len(size) == 1 else size, 7, **kw)
                made[name, ci, si, "fullf"] = lib.full(size[0] if len(size) == 1 else size, 2.5,
                                                       requires_grad=True, **kw)
    for (name, ci, si, kind), t in made.items():
        if name != "dtshard":
            continue
        theirs = made["torch", ci, si, kind]
        what = f"{kind} case {ci} size form {si} (rank {rank})"
        _same(t, theirs, what)
        if kind != "empty":
            torch.testing.assert_close(t.to_local(), theirs.to_local(), rtol=0, atol=0, msg=what)
        local = t.to_local()
        # only the local shard was allocated, never the global tensor
        assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), what

    # no communication at all (dtshard's counter sees every collective dtshard issues)
    with dtshard.debug.CommCounter() as comm:
        dtshard.zeros(8, 4, device_mesh=mesh, placements=[Shard(0), Shard(1)])
        dtshard.full((8, 4), 3.0, device_mesh=mesh["tp"], placements=[Shard(1)])
        dtshard.rand(8, 4, device_mesh=mesh, placements=[Shard(1), Shard(0)])
        dtshard.randn(8, 4, device_mesh=mesh["dp"], placements=[Shard(0)])
    assert comm.count() == 0, comm.records

    # Partial: dtshard holds the documented value (PyTorch's reduces to n times it, see factories.py)
    p = dtshard.ones(4, 2, device_mesh=mesh, placements=[Partial(), Shard(0)])
    torch.testing.assert_close(p.full_tensor(), torch.ones(4, 2))

    # rand/randn: the single-process draw under the same seed, on any placements and sub-mesh,
    # and the generator stays in step with the single-process one.  (PyTorch's own rand/randn
    # raise on a CPU mesh: its offset-based RNG tracker needs CUDA; on CUDA it draws per shard.)
    for fn, ref_fn in ((dtshard.rand, torch.rand), (dtshard.randn, torch.randn)):
        for m, placements in cases:
            torch.manual_seed(1234)
            want, after = ref_fn(6, 5), ref_fn(3)
            torch.manual_seed(1234)
            got = fn(6, 5, device_mesh=m, placements=placements, requires_grad=True)
            torch.testing.assert_close(ref_fn(3), after, rtol=0, atol=0)
            assert got.is_leaf and got.requires_grad and type(got) is dtshard.DTensor
            expect = tdt.distribute_tensor(want, m, placements, src_data_rank=None)
            torch.testing.assert_close(got.to_local(), expect.to_local(), rtol=0, atol=0,
                                       msg=f"{fn.__name__} {placements} (rank {rank})")
            got.sum().backward()  # a leaf that takes gradients like any other
            assert type(got.grad) is dtshard.DTensor
            torch.testing.assert_close(got.grad.full_tensor(), torch.ones(6, 5))
    return True


def _mesh_context_checks():
    rank = dist.get_rank()
    mesh = _mesh_2x2()
    x = torch.arange(32.0).reshape(8, 4)
    got = {}
    for name, lib in LIBS.items():
        with mesh:
            d = lib.distribute_tensor(x, placements=[Shard(0), Replicate()])
            got[name, "distribute"] = d
            got[name, "from_local"] = lib.DTensor.from_local(x[:2] + rank, placements=[Shard(0), Shard(1)])
            got[name, "from_local_default"] = lib.DTensor.from_local(x + 1)
            got[name, "redistribute"] = d.redistribute(placements=[Replicate(), Shard(1)])
            got[name, "zeros"] = lib.zeros(8, 4, placements=[Shard(1), Replicate()])
            torch.manual_seed(0)
            module = lib.distribute_module(nn.Linear(4, 3))
            got[name, "module"] = module.weight
            with mesh["tp"]:  # nested: the innermost mesh wins
                got[name, "inner"] = lib.distribute_tensor(x, placements=[Shard(1)])
            got[name, "outer_again"] = lib.distribute_tensor(x)
        # outside every `with`: no mesh to fall back to, an error (not some stale mesh)
        try:
            lib.distribute_tensor(x)
            got[name, "error"] = None
        except (RuntimeError, ValueError) as e:
            got[name, "error"] = str(e)
    for key in ("distribute", "from_local", "from_local_default", "redistribute", "zeros", "module",
                "inner", "outer_again"):
        ours, theirs = got["dtshard", key], got["torch", key]
        _same(ours, theirs, f"{key} (rank {rank})")
        torch.testing.assert_close(ours.full_tensor(), theirs.full_tensor(), rtol=0, atol=0)
    assert got["dtshard", "inner"].device_mesh.ndim == 1 and got["dtshard", "outer_again"].device_mesh.ndim == 2
    assert got["torch", "error"] is not None
    return got["dtshard", "error"]


# ----------------------------------------------------------------------------------------------
# Item 12: distribute_module's deprecated two-argument input_fn / output_fn
# ----------------------------------------------------------------------------------------------


def _distribute_module_checks():
    import warnings

    mesh = _mesh_2x2()["tp"]
    x = torch.arange(12.0).reshape(3, 4)
    got = {}
    for name, lib in LIBS.items():
        def input_fn(inputs, device_mesh):  # the old form: no module argument
            assert device_mesh is mesh
            return tuple(lib.DTensor.from_local(t, device_mesh, [Replicate()]) for t in inputs)

        def output_fn(outputs, device_mesh):
            assert device_mesh is mesh
            return outputs.redistribute(device_mesh, [Replicate()]).to_local() * 2

        def partition_fn(sub_name, sub, device_mesh):
            if isinstance(sub, nn.Linear):
                sub.register_parameter("weight", nn.Parameter(lib.distribute_tensor(sub.weight, device_mesh, [Shard(0)])))

        torch.manual_seed(0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = lib.distribute_module(nn.Linear(4, 6), mesh, partition_fn, input_fn=input_fn, output_fn=output_fn)
        got[name, "warnings"] = sorted(str(w.message) for w in caught if issubclass(w.category, FutureWarning))
        y = module(x)
        y.sum().backward()
        got[name, "out"] = (type(y), y, module.weight.grad.full_tensor())

        # the current three-argument form: no warning; other argument counts raise
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            lib.distribute_module(nn.Linear(4, 6), mesh, input_fn=lambda m, inputs, device_mesh: None,
                                  output_fn=lambda m, outputs, device_mesh: None)
        got[name, "new_form_warnings"] = [w for w in caught if issubclass(w.category, FutureWarning)]
        try:
            lib.distribute_module(nn.Linear(4, 6), mesh, input_fn=lambda inputs: None)
            got[name, "bad"] = None
        except ValueError as e:
            got[name, "bad"] = str(e)
    for name in LIBS:
        assert len(got[name, "warnings"]) == 2 and all("Deprecating" in w for w in got[name, "warnings"]), got
        assert got[name, "new_form_warnings"] == [], got
        assert got[name, "bad"] is not None and "3 arguments" in got[name, "bad"], got
    (t_ours, y_ours, g_ours), (t_theirs, y_theirs, g_theirs) = got["dtshard", "out"], got["torch", "out"]
    assert t_ours is torch.Tensor and t_theirs is torch.Tensor
    torch.testing.assert_close(y_ours, y_theirs)
    torch.testing.assert_close(g_ours, g_theirs)
    torch.manual_seed(0)
    ref = nn.Linear(4, 6)
    torch.testing.assert_close(y_ours, ref(x) * 2)
    return True


# ----------------------------------------------------------------------------------------------
# Item 7: serialization (torch.save / torch.load with weights_only=True, pickle, deepcopy)
# ----------------------------------------------------------------------------------------------


def _roundtrip(t, how: str):
    import copy
    import io
    import pickle

    if how == "save":
        buf = io.BytesIO()
        torch.save(t, buf)
        buf.seek(0)
        return torch.load(buf)  # the default weights_only=True
    if how == "pickle":
        return pickle.loads(pickle.dumps(t))
    return copy.deepcopy(t)


def _grad_of_param(w, mesh):
    """The gradient a Replicate weight gets from a batch-sharded input: Partial before the leaf
    hook settles it (so a loaded leaf without dtshard's hooks would keep a Partial gradient)."""
    x = dtshard.distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [Shard(0)]) if isinstance(w, dtshard.DTensor) \
        else tdt.distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [Shard(0)])
    (x @ w).sum().backward()
    return w.grad


def _serialization_checks():
    import warnings

    rank = dist.get_rank()
    mesh = _mesh_2x2()
    base = torch.arange(24.0).reshape(4, 6)
    out = {}
    for name, lib in LIBS.items():
        cases = {
            "shard2d": lambda: lib.distribute_tensor(base, mesh, [Shard(0), Shard(1)]),
            "submesh": lambda: lib.distribute_tensor(base, mesh["tp"], [Shard(1)]),
            "uneven": lambda: lib.distribute_tensor(base[:3], mesh, [Shard(0), Replicate()]),
            "partial": lambda: lib.DTensor.from_local(base + rank, mesh, [Partial(), Replicate()]),
            "int": lambda: lib.distribute_tensor(torch.arange(8).reshape(2, 4), mesh, [Replicate(), Shard(1)]),
            "leaf": lambda: lib.distribute_tensor(base.clone().requires_grad_(), mesh, [Shard(0), Replicate()]),
            "param": lambda: nn.Parameter(lib.distribute_tensor(torch.arange(12.0).reshape(4, 3), mesh["tp"],
                                                                [Replicate()])),
        }
        for cname, make in cases.items():
            for how in ("save", "pickle", "deepcopy"):
                orig = make()
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    loaded = _roundtrip(orig, how)
                what = f"{name} {cname} {how} (rank {rank})"
                assert type(loaded) is type(orig), what
                assert tuple(loaded.placements) == tuple(orig.placements), what
                assert loaded.device_mesh == orig.device_mesh, what
                assert loaded.shape == orig.shape and loaded.stride() == orig.stride(), what
                assert loaded.requires_grad == orig.requires_grad and loaded.is_leaf == orig.is_leaf, what
                torch.testing.assert_close(loaded.to_local(), orig.to_local(), rtol=0, atol=0, msg=what)
                assert [str(w.message) for w in caught] == [], (what, [str(w.message) for w in caught])
                # the loaded tensor computes with the original (same mesh, same process groups)
                with torch.no_grad():
                    torch.testing.assert_close((loaded + orig).full_tensor(), 2 * orig.full_tensor(), msg=what)
                if cname == "param":  # and trains like the original: the same gradient layout
                    g_loaded, g_orig = _grad_of_param(loaded, mesh["tp"]), _grad_of_param(orig, mesh["tp"])
                    assert type(g_loaded) is type(orig), what
                    assert tuple(g_loaded.placements) == tuple(g_orig.placements), (what, g_loaded.placements)
                    torch.testing.assert_close(g_loaded.full_tensor(), g_orig.full_tensor(), msg=what)
                out[name, cname, how] = True

        # a module's state_dict: save, load (weights_only), load_state_dict into a fresh module
        torch.manual_seed(0)
        model = lib.distribute_module(nn.Linear(6, 4), mesh, lambda n, m, dm: None)
        sd = _roundtrip(model.state_dict(), "save")
        torch.manual_seed(1)
        fresh = lib.distribute_module(nn.Linear(6, 4), mesh)
        fresh.load_state_dict(sd)
        torch.testing.assert_close(fresh.weight.full_tensor(), model.weight.full_tensor(), rtol=0, atol=0)
    return True


# ----------------------------------------------------------------------------------------------
# Item 10: from_local keeps the local layout (strides); run_check compares requires_grad/strides
# ----------------------------------------------------------------------------------------------


def _from_local_stride_checks():
    rank = dist.get_rank()
    mesh = _mesh_2x2()
    def data(seed):
        return torch.randn(4, 6, 2, generator=torch.Generator().manual_seed(seed))

    # ranks [[0, 1], [2, 3]]: replicated along a mesh dim, the data must agree along it
    base, same_along_dp, same_along_tp = data(rank), data(10 + rank % 2), data(20 + rank // 2)
    cases = {  # name: (local tensor, mesh, placements)
        "transposed 2x2": (base[:, :, 0].t(), mesh, [Shard(0), Shard(1)]),
        "transposed S0 S0": (base[:, :, 0].t(), mesh, [Shard(0), Shard(0)]),
        "transposed replicate": (same_along_dp[:, :, 0].t(), mesh, [Replicate(), Shard(1)]),
        "permuted 3-D": (base.permute(2, 0, 1), mesh, [Shard(1), Shard(2)]),
        "sliced": (same_along_tp[:, :4, 0], mesh, [Shard(1), Replicate()]),
        "submesh transposed": (base[:, :, 1].t(), mesh["tp"], [Shard(1)]),
        "contiguous": (base[:, :, 0].contiguous(), mesh, [Shard(0), Shard(1)]),
    }
    for what, (local, m, placements) in cases.items():
        ours = dtshard.DTensor.from_local(local, m, placements)
        theirs = tdt.DTensor.from_local(local, m, placements)
        _same(ours, theirs, f"{what} (rank {rank})")
        assert ours.to_local().data_ptr() == local.data_ptr()  # a view, as in PyTorch
        full = theirs.full_tensor()
        # values through ops that read the layout at the wrapper (reshape, contiguous) or not
        for op_name, op in (("full", lambda t: t), ("add", lambda t: t * 2 + 1), ("reshape", lambda t: t.reshape(-1)),
                            ("contiguous", lambda t: t.contiguous()), ("t", lambda t: t.transpose(0, 1)),
                            ("sum", lambda t: t.sum(0)), ("view", lambda t: t.contiguous().view(-1))):
            want = op(full)
            got = op(ours).full_tensor()
            exact = {} if op_name == "sum" else {"rtol": 0, "atol": 0}  # a sharded sum adds in another order
            torch.testing.assert_close(got, want, **exact, msg=f"{what} {op_name} (rank {rank})")
        c = ours.contiguous()
        assert c.is_contiguous() and c.to_local().is_contiguous(), what
        # backward: the gradient reaches the local tensor in its own layout's values
        leaf = local.detach().clone().requires_grad_()  # clone keeps a dense layout's strides
        w = torch.arange(float(full.numel())).reshape(full.shape)
        (dtshard.DTensor.from_local(leaf, m, placements) * dtshard.distribute_tensor(w, m, placements)).sum().backward()
        theirs_leaf = leaf.detach().clone().requires_grad_()
        (tdt.DTensor.from_local(theirs_leaf, m, placements) * tdt.distribute_tensor(w, m, placements)).sum().backward()
        torch.testing.assert_close(leaf.grad, theirs_leaf.grad, rtol=0, atol=0, msg=what)
    # explicit shape and stride win (as in PyTorch)
    ours = dtshard.DTensor.from_local(base[:, :, 0].t(), mesh, [Shard(0), Shard(1)], shape=(12, 8), stride=(8, 1))
    theirs = tdt.DTensor.from_local(base[:, :, 0].t(), mesh, [Shard(0), Shard(1)], shape=(12, 8), stride=(8, 1))
    _same(ours, theirs, "explicit stride")

    # run_check=True: ranks whose requires_grad or layout disagree are rejected on every rank
    # (PyTorch raises too: "Inconsistent tensor metadata"), with the same message everywhere
    errors = {}
    good = torch.ones(6, 4)
    bad_inputs = {
        "requires_grad": good.clone().requires_grad_(rank == 2),
        "stride": good.t().contiguous().t() if rank == 1 else good.clone(),
    }
    for what, local in bad_inputs.items():
        for name, lib in LIBS.items():
            try:
                lib.DTensor.from_local(local, mesh, [Shard(0), Shard(1)], run_check=True)
                errors[name, what] = None
            except ValueError as e:
                errors[name, what] = str(e)
    # the group is still usable, and agreeing ranks pass
    ok = dtshard.DTensor.from_local(good.t().contiguous().t(), mesh, [Shard(0), Shard(1)], run_check=True)
    assert ok.stride() == (1, 12)
    torch.testing.assert_close(ok.full_tensor(), torch.ones(12, 8))
    return {k: v for k, v in errors.items() if k[0] == "dtshard"}, [k for k, v in errors.items() if v is None]


# ----------------------------------------------------------------------------------------------
# Item 13: CommDebugMode
# ----------------------------------------------------------------------------------------------


class _MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(8, 16)
        self.net2 = nn.Linear(16, 8)

    def forward(self, x):
        return self.net2(torch.relu(self.net1(x)))


def _comm_debug_checks():
    """PyTorch's CommDebugMode counts the collectives its own DTensor issues; ``dtshard.debug.
    CommDebugMode`` also records dtshard's parameters' sharding (PyTorch's own mode counts dtshard's
    collectives too since issue #54 item 12: tests/dropin/test_issue54_dtensor.py; see
    dtshard/debug.py).  dtshard.debug.CommCounter answers the same queries."""
    import torch.distributed.tensor.parallel as tp_torch
    from torch.distributed.tensor.debug import CommDebugMode as TorchCommDebugMode

    import dtshard.parallel as tp_ours

    rank = dist.get_rank()
    mesh = _mesh_2x2()["tp"]
    # x needs a gradient, so ColwiseParallel's backward reduces it (a collective in backward)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    results = {}
    for name, lib, tp, modes in (
        ("torch", tdt, tp_torch, [TorchCommDebugMode]),
        ("dtshard", dtshard, tp_ours, [dtshard.debug.CommDebugMode, dtshard.debug.CommCounter]),
    ):
        torch.manual_seed(0)
        model = tp.parallelize_module(_MLP(), mesh, {"net1": tp.ColwiseParallel(), "net2": tp.RowwiseParallel()})
        a = lib.distribute_tensor(torch.randn(4, 6), mesh, [Shard(1)])
        b = lib.distribute_tensor(torch.randn(6, 4), mesh, [Shard(1)])
        c = lib.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
        programs = {
            "mlp": lambda: model(x).sum().backward(),  # the all_reduce of RowwiseParallel's output
            "sum": lambda: c.sum().full_tensor(),  # all_reduce
            "gather": lambda: c.redistribute(mesh, [Replicate()]),  # all_gather
            "mm": lambda: a @ b,  # collectives issued INSIDE the op's dispatch
            "add": lambda: (a @ b) + c,
            "setup": lambda: lib.distribute_tensor(torch.ones(4, 4), mesh, [Replicate()]),  # broadcast (dtshard)
        }
        # ops whose plan issues collectives inside their dispatch, forward and backward (PyTorch's
        # DTensor counts 1 all_gather forward for each; dtshard plans its own, counted all the same)
        g = torch.randn(8, 4, generator=torch.Generator().manual_seed(1))
        s0 = lib.distribute_tensor(g, mesh, [Shard(0)]).requires_grad_(True)
        programs.update({
            "cumsum": lambda: torch.cumsum(s0, 0).sum().backward(),
            "logsumexp": lambda: torch.logsumexp(s0, 0).sum().backward(),
            "topk": lambda: torch.topk(s0, 2, dim=0).values.sum().backward(),
        })
        for prog, fn in programs.items():
            for mode in modes:
                with mode() as cm:
                    fn()
                results[prog, name, mode.__name__] = (
                    cm.get_total_counts(), dict(cm.get_comm_counts()), dict(cm.get_sharding_info()))
                if mode is not dtshard.debug.CommCounter:  # per module, forward and backward
                    results[prog, name, "modules"] = {
                        mod: {way: dict(c) for way, c in counts.items()}
                        for mod, counts in cm.comm_module_counts.items()}
                if mode is dtshard.debug.CommDebugMode and prog == "mm":
                    ops = [op for entry in cm.comm_module_operation_counts.values()
                           for op in entry["operations_list"]]
                    mm = [op for op in ops if op["name"] == torch.ops.aten.mm.default]
                    assert mm and mm[0]["input_sharding"] == [(Shard(1),), (Shard(1),)], ops
                    assert "all_to_all" in cm.generate_comm_debug_tracing_table(noise_level=3)
                if prog == "gather":  # a defaultdict, as PyTorch's: a kind that never ran counts 0
                    assert cm.get_comm_counts()[torch.ops.c10d_functional.all_reduce] == 0
                if mode is dtshard.debug.CommCounter and prog == "setup":
                    # CommCounter's own accounting is unchanged: the broadcast's source sends
                    # nothing and has no record, but it took part in one call
                    assert cm.count("broadcast") == (0 if rank in (0, 2) else 1), (rank, cm.records)

    funcol = torch.ops.c10d_functional
    for prog in ("mlp", "sum", "gather", "mm", "add", "setup", "cumsum", "logsumexp", "topk"):
        ours, counter = results[prog, "dtshard", "CommDebugMode"], results[prog, "dtshard", "CommCounter"]
        assert ours == counter, (prog, ours, counter)  # the mode and dtshard's counter agree
        if prog in ("mlp", "sum", "gather"):  # both libraries pick the same collectives here
            assert ours == results[prog, "torch", "CommDebugMode"], (prog, ours, results[prog, "torch", "CommDebugMode"])
            # ... and attribute them to the same modules, forward and backward
            assert results[prog, "dtshard", "modules"] == results[prog, "torch", "modules"], (
                prog, results[prog, "dtshard", "modules"], results[prog, "torch", "modules"])
    for prog in ("cumsum", "logsumexp", "topk"):  # op-internal collectives are seen, as PyTorch's are
        assert results[prog, "torch", "CommDebugMode"][0] >= 1, results[prog, "torch", "CommDebugMode"]
        assert results[prog, "dtshard", "CommDebugMode"][0] >= 1, (prog, results[prog, "dtshard", "CommDebugMode"])
    mlp_modules = results["mlp", "dtshard", "modules"]
    assert mlp_modules["_MLP.net2"]["forward"] == {funcol.all_reduce: 1}, mlp_modules
    assert mlp_modules["_MLP.net1"]["backward"] == {funcol.all_reduce: 1}, mlp_modules
    assert results["mm", "dtshard", "CommDebugMode"][:2] == (1, {funcol.all_to_all_single: 1})
    assert results["setup", "dtshard", "CommDebugMode"][:2] == (1, {funcol.broadcast: 1})
    sharding = results["mlp", "dtshard", "CommDebugMode"][2]
    assert sharding == {"_MLP.net1.weight": (Shard(0),), "_MLP.net1.bias": (Shard(0),),
                        "_MLP.net2.weight": (Shard(1),), "_MLP.net2.bias": (Replicate(),)}, sharding
    return True


# ----------------------------------------------------------------------------------------------


def _timed(name):
    """Run one check on a rank; return (result, seconds) so slow checks show."""
    import time

    t0 = time.perf_counter()
    return globals()[name](), time.perf_counter() - t0


def _run(name):
    results = run_distributed(_timed, 4, name)
    return [r for r, _ in results]


def test_factories_match_torch():  # item 2
    assert _run("_factory_checks") == [True] * 4


def test_mesh_context_manager():  # item 8
    for msg in _run("_mesh_context_checks"):
        assert msg is not None and "distribute_tensor" in msg and "with mesh" in msg, msg


def test_distribute_module_two_argument_hooks():  # item 12
    assert _run("_distribute_module_checks") == [True] * 4


def test_serialization():  # item 7
    assert _run("_serialization_checks") == [True] * 4


def test_from_local_keeps_strides_and_run_check():  # item 10
    errors, accepted = zip(*_run("_from_local_stride_checks"))
    assert all(not a for a in accepted), accepted  # both libraries reject both bad inputs
    assert all(e == errors[0] for e in errors), errors  # the same message on every rank
    msg_grad, msg_stride = errors[0]["dtshard", "requires_grad"], errors[0]["dtshard", "stride"]
    assert "requires_grad=True but needs requires_grad=False" in msg_grad and "rank 2" in msg_grad, msg_grad
    assert "global stride" in msg_stride and "rank 1" in msg_stride and ".contiguous()" in msg_stride, msg_stride


def test_comm_debug_mode():  # item 13
    assert _run("_comm_debug_checks") == [True] * 4


def _implicit_replication_and_dtype_casts():
    """Items 9 and 6: implicit replication (dtshard's context and PyTorch's own), and
    ``redistribute(forward_dtype=, backward_dtype=)``, the same code on both libraries."""
    from torch.distributed.tensor.experimental import implicit_replication as torch_implicit

    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    full, plain = torch.randn(4, 6), torch.randn(4, 6)
    out = {}
    for name, lib in LIBS.items():
        x = lib.distribute_tensor(full, mesh, [Shard(0)])
        contexts = [torch_implicit] + ([dtshard.experimental.implicit_replication] if name == "dtshard" else [])
        for ctx in contexts:
            with ctx():
                y = x * plain + plain
            assert isinstance(y, lib.DTensor) and torch.allclose(y.full_tensor(), full * plain + plain), name
        try:  # outside the context, mixing raises
            x * plain
            raised = False
        except Exception:  # noqa: BLE001
            raised = True
        assert raised, name
        # forward_dtype: the transition runs in bf16 and returns bf16; backward_dtype: the gradient
        # travels in float16 and comes back in the input's dtype
        leaf = lib.distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        rep = leaf.redistribute(mesh, [Replicate()], forward_dtype=torch.bfloat16, backward_dtype=torch.float16)
        (rep.float() * 3).sum().backward()
        out[name] = (rep, leaf.grad)
    (r_ours, g_ours), (r_theirs, g_theirs) = out["dtshard"], out["torch"]
    _same(r_ours, r_theirs, "redistribute forward_dtype")
    _same(g_ours, g_theirs, "redistribute backward_dtype gradient")
    assert r_ours.dtype == torch.bfloat16 and g_ours.dtype == torch.float32
    # the bytes on the wire are bf16's
    x = dtshard.distribute_tensor(full, mesh, [Shard(0)])
    with dtshard.debug.CommCounter() as c:
        x.redistribute(mesh, [Replicate()], forward_dtype=torch.bfloat16)
    assert c.bytes() == (dist.get_world_size() - 1) * full.numel() // dist.get_world_size() * 2, c.bytes()
    return True


def test_implicit_replication_and_redistribute_dtypes():  # items 9 and 6
    assert all(run_distributed(_implicit_replication_and_dtype_casts, 2))


def _placement_choices():
    """Item 14: where dtshard's output placement differs from PyTorch's, it is the cheaper correct
    one (documented in the README); the values agree with PyTorch's and with one process."""
    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    full = torch.randn(4, 6)
    got = {}
    for name, lib in LIBS.items():
        x = lib.distribute_tensor(full, mesh, [Shard(1)])
        with dtshard.debug.CommCounter() as c:
            sm = torch.softmax(x, dim=1)
        d = torch.dist(x, x * 2)
        got[name] = (str(sm.placements), sm.full_tensor(), str(d.placements), d.full_tensor(), c.bytes())
    ours, theirs = got["dtshard"], got["torch"]
    # softmax over the sharded dim: dtshard re-shards rows with one all_to_all ((n-1)/n^2 of the
    # tensor) and keeps the output sharded; PyTorch all-gathers ((n-1)/n) and replicates it
    assert ours[0] == "(Shard(dim=0),)" and theirs[0] == "(Replicate(),)"
    assert torch.allclose(ours[1], theirs[1]) and torch.allclose(ours[1], torch.softmax(full, 1))
    n = dist.get_world_size()
    assert ours[4] == (n - 1) * full.numel() * 4 // n ** 2, ours[4]
    # torch.dist: a scalar; dtshard reduces it (one all_reduce of one element), PyTorch leaves a
    # pending _NormPartial
    assert ours[2] == "(Replicate(),)" and "Partial" in theirs[2]
    assert torch.allclose(ours[3], theirs[3]) and torch.allclose(ours[3], torch.dist(full, full * 2))
    # the backward of a Partial(sum) -> Partial(avg) redistribute: PyTorch raises, dtshard gives
    # the gradient (Replicate: every term's gradient is the whole gradient)
    p = dtshard.DTensor.from_local(torch.ones(4, 6), mesh, [Partial("sum")]).detach().requires_grad_()
    p.redistribute(mesh, [Partial("avg")]).to_local().sum().backward()
    assert p.grad.placements == (Replicate(),)
    return True


def test_placement_choices_documented():  # item 14
    assert all(run_distributed(_placement_choices, 2))


def _async_redistribute():
    """Item 6: ``redistribute(async_op=True)`` returns while the last collective is in flight
    (the local shard is PyTorch's AsyncCollectiveTensor, waited on first use), as PyTorch does;
    values and gradients are the synchronous ones."""
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    full = torch.randn(8, 6)
    out = {}
    for name, lib in LIBS.items():
        x = lib.distribute_tensor(full, mesh, [Shard(0)]).requires_grad_()
        y = x.redistribute(mesh, [Replicate()], async_op=True)
        in_flight = isinstance(y._local_tensor, AsyncCollectiveTensor)
        z = (y * 2 + 1).sum()  # first use: waits
        z.backward()
        out[name] = (in_flight, z.full_tensor() if hasattr(z, "full_tensor") else z, x.grad.full_tensor())
        nograd = lib.distribute_tensor(full, mesh, [Shard(1)]).redistribute(mesh, [Shard(0)], async_op=True)
        out[name] += (isinstance(nograd._local_tensor, AsyncCollectiveTensor), nograd.full_tensor())
    (i0, z0, g0, j0, f0), (i1, z1, g1, j1, f1) = out["dtshard"], out["torch"]
    assert i0 and i1, (i0, i1)  # S(0) -> R: one all_gather, still in flight
    del j0, j1  # S(1) -> S(0) ends with local copies in both libraries (waited there)
    assert torch.allclose(z0, z1) and torch.allclose(g0, g1) and torch.equal(f0, full) and torch.equal(f1, full)
    return True


def test_async_redistribute():  # item 6
    assert all(run_distributed(_async_redistribute, 2))


def _tensor_hooks_on_outputs():
    """``register_hook`` on the DTensor that ``from_local``, ``redistribute`` (with and without a
    dtype cast) return is called in backward with the DTensor gradient, as in PyTorch (dtshard
    built those outputs as leaves requiring grad inside the autograd Function: the hooks went into
    a dict no node read, and were silently never called)."""
    mesh = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    torch.manual_seed(0)
    full = torch.randn(4, 6)
    out = {}
    for name, lib in LIBS.items():
        w = full.clone().requires_grad_()
        seen = []
        d = lib.DTensor.from_local(w * 1, mesh, [Replicate()])
        r = d.redistribute(mesh, [Shard(0)])
        c = r.redistribute(mesh, [Shard(1)], forward_dtype=torch.float64)
        for what, t in (("from_local", d), ("redistribute", r), ("cast", c)):
            t.register_hook(lambda g, what=what: seen.append((what, type(g).__name__, tuple(g.placements))))
        (c * 2).sum().backward()
        out[name] = (sorted(seen), w.grad)
    assert out["dtshard"][0] == out["torch"][0] and len(out["dtshard"][0]) == 3, out
    assert torch.equal(out["dtshard"][1], out["torch"][1])
    return True


def test_tensor_hooks_on_from_local_and_redistribute_outputs():
    assert all(run_distributed(_tensor_hooks_on_outputs, 2))


def _data_assignment():
    """``x.data = new`` on DTensors (PyTorch's DTensor leaves the shard unchanged: the assignment
    silently does nothing there, so this is checked against one process, not against it)."""
    import torch.nn.functional as F

    from dtshard.fsdp import fully_shard

    mesh = dtshard.init_device_mesh("cpu", (2,))
    g = torch.Generator().manual_seed(5)
    layouts = [((5, 3), [Shard(0)]), ((4, 7), [Shard(1)]), ((3,), [Replicate()])]
    ws = [torch.randn(s, generator=g) for s, _ in layouts]
    ps = [nn.Parameter(dtshard.distribute_tensor(w.clone(), mesh, pl)) for w, (_, pl) in zip(ws, layouts)]
    ref = [nn.Parameter(w.clone()) for w in ws]
    out = {}
    # nn.utils.vector_to_parameters: each parameter takes its slice of a replicated vector
    vec = torch.randn(sum(w.numel() for w in ws), generator=g)
    nn.utils.vector_to_parameters(dtshard.distribute_tensor(vec, mesh, [Replicate()]), ps)
    nn.utils.vector_to_parameters(vec.clone(), ref)
    out["v2p"] = [(tuple(p.placements) == tuple(pl), torch.equal(p.full_tensor(), r.detach()))
                  for p, r, (_, pl) in zip(ps, ref, layouts)]
    # then a training step: the gradient hooks and the optimizer see the new shards
    opt, ropt = torch.optim.SGD(ps, lr=0.1), torch.optim.SGD(ref, lr=0.1)
    for params, o in ((ps, opt), (ref, ropt)):
        sum((p * p).sum() for p in params).backward()
        o.step()
    out["step"] = [torch.allclose(p.full_tensor(), r.detach()) and isinstance(p.grad, dtshard.DTensor)
                   for p, r in zip(ps, ref)]
    # a dtype cast by assignment, and .data still aliasing the shard
    p = ps[0]
    p.data = p.data.to(torch.bfloat16)
    p.data.mul_(2)
    out["cast"] = (p.dtype, p.to_local().dtype, tuple(p.placements),
                   torch.equal(p.full_tensor(), (ref[0].detach() * 2).to(torch.bfloat16)))
    # errors, the same on every rank
    errors = []
    for bad in (torch.zeros(5, 3), dtshard.distribute_tensor(torch.zeros(3, 5), mesh, [Shard(0)])):
        try:
            ps[1].data = bad
        except (TypeError, ValueError) as e:
            errors.append(type(e).__name__ + (": plain" if "plain" in str(e) else ": shape" if "shape" in str(e) else ""))
    out["errors"] = errors
    # a parameter of a fully_shard module: the next forward's all_gather reads the new shard
    torch.manual_seed(0)
    lin = nn.Linear(3, 5)
    fully_shard(lin, mesh=mesh)
    new_w = torch.randn(5, 3, generator=g)
    lin.weight.data = dtshard.distribute_tensor(new_w, mesh, [Shard(0)])
    x = torch.randn(2, 3, generator=g)
    want = F.linear(x, new_w, lin.bias.full_tensor())
    out["fsdp"] = torch.allclose(lin(x), want)
    return out


def _format_scalars():
    """``f"{loss:.4f}"`` on 0-d DTensors: a replicated one formats its value (as a 0-d tensor), a
    Partial one raises (its value needs a collective), without a spec it keeps its repr."""
    mesh = dtshard.init_device_mesh("cpu", (2,))
    x = dtshard.distribute_tensor(torch.arange(6.0), mesh, [Shard(0)])
    partial = x.sum()
    replicated = partial.redistribute(mesh, [Replicate()])
    out = [f"{replicated:.2f}", f"{replicated}", f"{torch.tensor(15.0)}", f"{partial}".startswith("dtshard.DTensor")]
    try:
        f"{partial:.2f}"
    except ValueError as e:
        out.append("reduction over ranks" in str(e))
    return out


def test_format_of_a_scalar_dtensor():
    for out in run_distributed(_format_scalars, 2):
        assert out == ["15.00", "15.0", "15.0", True, True], out


def test_data_assignment_takes_the_new_values_and_keeps_the_layout():
    for rank, out in enumerate(run_distributed(_data_assignment, 2)):
        assert out["v2p"] == [(True, True)] * 3, (rank, out)
        assert out["step"] == [True] * 3, (rank, out)
        assert out["cast"] == (torch.bfloat16, torch.bfloat16, (Shard(0),), True), (rank, out)
        assert out["errors"] == ["TypeError: plain", "ValueError: shape"], (rank, out)
        assert out["fsdp"] is True, (rank, out)
