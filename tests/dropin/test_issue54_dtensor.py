"""Issue #54, the DTensor items: code written for ``torch.distributed.tensor`` that PyTorch runs and
dtshard refused or got wrong.

- item 1 (core): two meshes built separately with one layout are ONE mesh (PyTorch's
  ``DeviceMesh.__eq__``: same ranks in the same layout, same dim names, same device type), for
  ops, gradients and ``clip_grad_norm_``; meshes that differ in rank order or names still raise;
  plans stay per set of process groups (a mesh of other ranks never borrows another's plan); a
  mesh whose rank table does not ascend row-major gets its blocks where its layout says.
- item 10: every spelling of a reduce op PyTorch's ``Partial`` takes (``"prod"``, any case).
- item 11: ``Partial("max")`` / ``("min")`` through pointwise ops reduced to a shard; on a backend
  whose reduce_scatter lacks the op (PyTorch's threaded process group) an all_reduce runs instead.
- item 12: PyTorch's own ``CommDebugMode`` counts every collective dtshard issues inside an op.
- item 13: ``linalg.norm`` of an empty matrix on a DTensor is a DTensor.
- item 14: ``from_local`` with ``shape=`` alone on uneven shards (dtshard: correct, kept),
  ``stride=`` alone (raises, as PyTorch); ``embedding(max_norm=)`` on a column-sharded weight
  (dtshard: correct, kept; PyTorch raises NotImplementedError).

Each check runs on real ranks against one process, and against PyTorch's DTensor where it runs the
same code.  Two distributed runs on a 2x2 mesh.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.tensor as tdt
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.debug import CommDebugMode

import dtshard
import dtshard.collectives as C
from dtshard import Partial, Replicate, Shard
from dtshard.debug import CommCounter
from dtshard.spec import local_shape_and_offset
from dtshard.testing import run_distributed

LIBS = (("torch", tdt), ("dtshard", dtshard))
funcol = torch.ops.c10d_functional


def _close(a, b, what, atol=1e-5):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=atol, msg=lambda m: f"{what} (rank {dist.get_rank()}): {m}")


def _mesh(names=("dp", "tp")):
    return dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)


def _raises(fn, *types):
    try:
        fn()
    except types as e:
        return e
    raise AssertionError(f"{fn} did not raise {types}")


# ---------------------------------------------------------------------------------------------
# Run 1: items 1, 10, 11
# ---------------------------------------------------------------------------------------------

def _meshes_partials():
    rank = dist.get_rank()
    m1, m2 = _mesh(), _mesh()  # two calls, one layout: new process groups each time
    assert m1 == m2 and m1._dim_group_names != m2._dim_group_names
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(6, 5, generator=g), torch.randn(6, 5, generator=g)
    W1, W2 = torch.randn(5, 4, generator=g), torch.randn(4, 3, generator=g)

    # -- item 1: ops, stack, backward and clip_grad_norm_ across the two meshes -----------------
    clipped = {}
    for name, lib in LIBS:
        a = lib.distribute_tensor(X, m1, [Shard(0), Replicate()])
        b = lib.distribute_tensor(Y, m2, [Replicate(), Shard(1)])
        _close((a + b).full_tensor(), X + Y, f"{name} a + b")
        _close(torch.stack([a, b]).full_tensor(), torch.stack([X, Y]), f"{name} stack")
        _close(torch.stack([b, a], 1).full_tensor(), torch.stack([Y, X], 1), f"{name} stack dim 1")
        # a model whose two weights were laid out on the two meshes, trained with clipping
        w1 = lib.distribute_tensor(W1, m1, [Replicate(), Shard(1)]).requires_grad_()
        w2 = lib.distribute_tensor(W2, m2, [Replicate(), Shard(0)]).requires_grad_()
        x = lib.distribute_tensor(X, m1, [Shard(0), Replicate()])
        (torch.relu(x @ w1) @ w2).pow(2).sum().backward()
        for foreach in (True, False):
            g1, g2 = w1.grad.clone(), w2.grad.clone()
            p1 = torch.nn.Parameter(w1.detach().clone())
            p2 = torch.nn.Parameter(w2.detach().clone())
            p1.grad, p2.grad = g1, g2
            total = torch.nn.utils.clip_grad_norm_([p1, p2], 1.0, foreach=foreach)
            clipped[name, foreach] = (total.full_tensor(), p1.grad.full_tensor(), p2.grad.full_tensor())
    ref_w1, ref_w2 = W1.clone().requires_grad_(), W2.clone().requires_grad_()
    (torch.relu(X @ ref_w1) @ ref_w2).pow(2).sum().backward()
    total = torch.nn.utils.clip_grad_norm_([ref_w1, ref_w2], 1.0)
    for key, (t, c1, c2) in clipped.items():
        _close(t, total, f"{key} clip_grad_norm_ total")
        _close(c1, ref_w1.grad, f"{key} clipped grad 1")
        _close(c2, ref_w2.grad, f"{key} clipped grad 2")

    # FSDP2's recipe with each fully_shard on a mesh of its own (equal meshes, other groups), then
    # clip_grad_norm_ over all parameters: dtshard's and PyTorch's fully_shard, against one process
    import torch.distributed.fsdp as torch_fsdp
    import torch.nn as nn

    import dtshard.fsdp as our_fsdp

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    inp = torch.randn(6, 8, generator=torch.Generator().manual_seed(4))
    norms = {}
    for name, fsdp in (("torch", torch_fsdp), ("dtshard", our_fsdp)):
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
        model.load_state_dict(ref.state_dict())
        for sub in (model[0], model[2], model):
            fsdp.fully_shard(sub, mesh=dtshard.init_device_mesh("cpu", (4,)))
        model(inp).pow(2).sum().backward()
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norms[name] = (total.full_tensor(), [p.grad.full_tensor() for p in model.parameters()])
    ref(inp).pow(2).sum().backward()
    total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    for name, (t, grads) in norms.items():
        _close(t, total, f"{name} fully_shard on separate meshes: clip_grad_norm_")
        for gd, p in zip(grads, ref.parameters()):
            _close(gd, p.grad, f"{name} fully_shard on separate meshes: clipped grad")

    # a cached plan belongs to one set of process groups: the same op on m2's tensors after m1's
    # runs on m2 (its output on m2 itself, not on a mesh a cached plan remembered)
    s1 = dtshard.distribute_tensor(X, m1, [Shard(0), Shard(1)])
    s2 = dtshard.distribute_tensor(X, m2, [Shard(0), Shard(1)])
    out1, out2 = s1 + s1, s2 + s2
    assert out1.device_mesh is m1 and out2.device_mesh is m2, (out1.device_mesh, out2.device_mesh)
    _close(out2.full_tensor(), 2 * X, "m2 after m1's plan")

    # meshes that are NOT one: other rank order, other names; PyTorch raises too.  (The ranks
    # transposed, [[0, 2], [1, 3]]: each group's ranks ascend along its mesh dim, as the process
    # groups order them; a descending layout gets wrong results from PyTorch's DTensor too.)
    flipped = DeviceMesh("cpu", torch.arange(4).view(2, 2).t(), mesh_dim_names=("dp", "tp"))
    renamed = _mesh(("x", "y"))
    assert flipped != m1 and renamed != m1
    for other, what in ((flipped, "ranks"), (renamed, "names")):
        for name, lib in LIBS:
            a = lib.distribute_tensor(X, m1, [Shard(0), Replicate()])
            c = lib.distribute_tensor(Y, other, [Shard(0), Replicate()])
            e = _raises(lambda: a + c, ValueError, RuntimeError, NotImplementedError)
            if name == "dtshard":
                assert isinstance(e, ValueError) and "different meshes" in str(e), e
                assert ("ranks [0, 2, 1, 3]" if what == "ranks" else "('x', 'y')") in str(e), str(e)
    # ... and a mesh of other ranks computes with its own plans, right after m1's were cached
    f1 = dtshard.distribute_tensor(X, flipped, [Shard(0), Shard(1)])
    f2 = dtshard.distribute_tensor(Y, flipped, [Shard(0), Shard(1)])
    _close((f1 + f2).full_tensor(), X + Y, "flipped mesh")
    _close(f1.redistribute(flipped, [Shard(1), Replicate()]).full_tensor(), X, "flipped redistribute")
    at = [0, 2, 1, 3].index(rank)
    _close(f1.to_local(), X.chunk(2, 0)[at // 2].chunk(2, 1)[at % 2], "flipped local shard")
    t1 = tdt.distribute_tensor(X, flipped, [Shard(0), Shard(1)])
    _close(f1.to_local(), t1.to_local(), "flipped local shard vs PyTorch")

    # rank tables that do not ascend row-major: process groups number their members by ascending
    # rank, dtshard by mesh coordinate; the collectives put every block where the layout says
    # (flattened groups of the transposed table; every group of the descending one, which PyTorch's
    # DTensor gets wrong). Local shards against the layout's own arithmetic, every transition kind.
    for table in ([[0, 2], [1, 3]], [[3, 2], [1, 0]]):
        tm = DeviceMesh("cpu", torch.tensor(table))
        c = tm.get_coordinate()
        Z = torch.randn(7, 6, generator=torch.Generator().manual_seed(3))

        def expect(placements):
            shape, off = local_shape_and_offset(Z.shape, (2, 2), placements, c)
            return Z[off[0]:off[0] + shape[0], off[1]:off[1] + shape[1]]

        pairs = [([Shard(0), Shard(0)], [Shard(1), Shard(1)]), ([Shard(0), Shard(0)], [Replicate(), Replicate()]),
                 ([Shard(0), Shard(1)], [Shard(1), Shard(0)]), ([Shard(1), Shard(1)], [Shard(0), Replicate()]),
                 ([Replicate(), Replicate()], [Shard(0), Shard(0)])]
        for src, dst in pairs:
            d = dtshard.distribute_tensor(Z, tm, src)
            _close(d.to_local(), expect(src), f"{table} distribute {src}")
            with CommCounter() as cc:
                e = d.redistribute(tm, dst)
            _close(e.to_local(), expect(dst), f"{table} {src} -> {dst} ({cc.kinds()})")
            _close(e.full_tensor(), Z, f"{table} {src} -> {dst} full_tensor")
        terms = dtshard.DTensor.from_local(Z if c == [0, 0] or tuple(c) == (0, 0) else torch.zeros_like(Z), tm,
                                           [Partial(), Partial()])
        for dst in ([Shard(0), Shard(0)], [Shard(1), Replicate()], [Replicate(), Replicate()]):
            _close(terms.redistribute(tm, dst).to_local(), expect(dst), f"{table} P,P -> {dst}")
        if table == [[0, 2], [1, 3]]:  # PyTorch's DTensor: the same shards (each dim ascends)
            for src, dst in pairs:
                t = tdt.distribute_tensor(Z, tm, src).redistribute(tm, dst)
                _close(t.to_local(), expect(dst), f"PyTorch {table} {src} -> {dst}")

    # -- item 10: Partial("prod") and the other spellings -----------------------------------------
    terms = [torch.randint(1, 3, (4, 6), generator=torch.Generator().manual_seed(10 + r)).float() for r in range(4)]
    mine = terms[rank]
    coord = m1.get_coordinate()
    # PyTorch's test_redistribute_to_partial: ([S(0), P(prod)] -> [R, P(prod)]) is allowed
    got = {}
    for name, lib in LIBS:
        dt = lib.DTensor.from_local(mine, m1, [Shard(0), Partial("prod")])
        out = dt.redistribute(m1, [Replicate(), Partial("prod")])
        got[name] = (out.to_local(), out.placements)
    _close(got["dtshard"][0], got["torch"][0], "S0,P(prod) -> R,P(prod) local")
    assert got["torch"][1] == (Replicate(), Partial("prod")), got["torch"][1]
    assert got["dtshard"][1] == (Replicate(), Partial("product")), got["dtshard"][1]  # the canonical name
    # reduced: PyTorch fails ("Unrecognized reduce_op: prod"), dtshard multiplies
    # [Replicate(), Partial(op)]: the term of mesh-dim-1 coordinate j, the same down mesh dim 0
    term, col = terms[coord[1]], terms[:2]
    e = _raises(lambda: tdt.DTensor.from_local(term, m1, [Replicate(), Partial("prod")]).full_tensor(), RuntimeError)
    assert "prod" in str(e), e
    for spelling, op in (("prod", "prod"), ("PRODUCT", "prod"), ("Product", "prod"), ("SUM", "sum"),
                         ("Max", "max"), ("MIN", "min"), ("AVG", "avg")):
        ref = {"prod": col[0] * col[1], "sum": col[0] + col[1], "max": torch.maximum(*col),
               "min": torch.minimum(*col), "avg": (col[0] + col[1]) / 2}[op]
        d = dtshard.DTensor.from_local(term, m1, [Replicate(), Partial(spelling)])
        for target in ([Replicate(), Replicate()], [Replicate(), Shard(0)], [Replicate(), Shard(1)]):
            _close(d.redistribute(m1, target).full_tensor(), ref, f"P({spelling}) -> {target}")
        try:  # where PyTorch takes the spelling, the same values
            theirs = tdt.DTensor.from_local(term, m1, [Replicate(), Partial(spelling)]).full_tensor()
        except RuntimeError:
            assert spelling in ("prod", "Product"), spelling
        else:
            _close(theirs, ref, f"PyTorch P({spelling})")
    # to it: R -> P(prod) keeps the value (dtshard: one rank's value, ones elsewhere; PyTorch refuses)
    r = dtshard.distribute_tensor(X, m1, [Replicate(), Replicate()])
    _close(r.redistribute(m1, [Replicate(), Partial("prod")]).full_tensor(), X, "R -> P(prod) -> R")
    _raises(lambda: tdt.distribute_tensor(X, m1, [Replicate(), Replicate()]).redistribute(
        m1, [Replicate(), Partial("prod")]), RuntimeError)
    # bitwise partials: not supported, said so
    e = _raises(lambda: dtshard.DTensor.from_local(mine.long(), m1, [Replicate(), Partial("band")]), ValueError)
    assert "'band'" in str(e) and "all_reduce" in str(e), e

    # -- item 11: Partial(max/min) through pointwise ops, reduced to a shard ------------------------
    fns = {"relu": torch.relu, "neg": torch.neg, "add": lambda t: t + 1, "id": lambda t: t}

    def run_max_min(libs=LIBS):
        res = {}
        for op in ("max", "min"):
            ref_in = torch.maximum(*col) if op == "max" else torch.minimum(*col)
            for fname, fn in fns.items():
                for target in ([Replicate(), Shard(0)], [Replicate(), Shard(1)], [Shard(1), Shard(0)]):
                    for name, lib in libs:
                        d = lib.DTensor.from_local(term, m1, [Replicate(), Partial(op)])
                        with CommCounter() as cc:
                            out = fn(d).redistribute(m1, target)
                        _close(out.full_tensor(), fn(ref_in), f"{name} P({op}) {fname} -> {target}")
                        res[name, op, fname, str(target)] = (out.to_local(), cc.kinds())
        for key, (local, _) in res.items():
            if key[0] == "dtshard" and len(libs) > 1:
                _close(local, res[("torch",) + key[1:]][0], f"{key} local vs PyTorch")
        return res

    run_max_min()
    # a backend whose reduce_scatter lacks MAX/MIN (PyTorch's threaded process group): gloo here,
    # listed as such, so that the fallback runs on real ranks
    saved = dict(C.REDUCE_SCATTER_LACKS)
    C.REDUCE_SCATTER_LACKS["gloo"] = frozenset({"max", "min", "product"})
    try:
        res = run_max_min(LIBS[1:])  # dtshard only (the values against one process)
        for key, (_, kinds) in res.items():
            if key[0] == "dtshard":  # values checked in run_max_min; no reduce_scatter was issued
                assert "reduce_scatter" not in kinds and kinds, (key, kinds)
        # the collectives' own entry points: values, and what the counter sees
        n = 2
        x = torch.arange(8.0).view(4, 2) * (1 + rank)
        # (a raw collective over mesh dim 1: my row's ranks)
        full_max = torch.stack([torch.arange(8.0).view(4, 2) * (1 + r) for r in range(4) if r // 2 == coord[0]]).amax(0)
        mine_max = full_max.chunk(n)[coord[1]]
        with CommCounter() as cc:
            _close(C.reduce_scatter(x, "max", m1, 1), mine_max, "reduce_scatter max (fallback)")
        assert cc.kinds() == ["all_reduce"], cc.kinds()
        out = torch.empty(2, 2)
        with CommCounter() as cc:
            C.reduce_scatter_into(out, x.clone(), "max", m1, 1)
        _close(out, mine_max, "reduce_scatter_into max (fallback)")
        assert cc.kinds() == ["all_reduce"], cc.kinds()
        out = torch.empty(2, 2)
        C.start_reduce_scatter(out, x, "max", m1, 1).wait()
        _close(out, mine_max, "start_reduce_scatter max (fallback)")
        with CommDebugMode() as cdm:  # the functional path (a dispatch mode is on)
            _close(C.reduce_scatter(x, "max", m1, 1), mine_max, "reduce_scatter max under a mode")
        assert cdm.get_comm_counts()[funcol.all_reduce] == 1 and cdm.get_total_counts() == 1
        # sum keeps the backend's reduce_scatter
        with CommCounter() as cc:
            C.reduce_scatter(x, "sum", m1, 1)
        assert cc.kinds() == ["reduce_scatter"], cc.kinds()
    finally:
        C.REDUCE_SCATTER_LACKS.clear()
        C.REDUCE_SCATTER_LACKS.update(saved)
    return True


def test_equal_meshes_partial_spellings_and_max_min_reduce_scatter():
    assert run_distributed(_meshes_partials, 4, timeout=300) == [True] * 4


# ---------------------------------------------------------------------------------------------
# Run 2: items 12, 13, 14
# ---------------------------------------------------------------------------------------------

def _debug_norm_from_local_embedding():
    rank = dist.get_rank()
    mesh = _mesh()
    tp = mesh["tp"]
    g = torch.Generator().manual_seed(1)
    X, A, B = torch.randn(8, 6, generator=g), torch.randn(6, 4, generator=g), torch.randn(4, 4, generator=g)

    # -- item 12: PyTorch's CommDebugMode sees what dtshard's CommCounter sees -------------------
    assert dtshard.DTensor == tdt.DTensor and tdt.DTensor == dtshard.DTensor  # what the modes test
    assert dtshard.DTensor is not tdt.DTensor and not issubclass(dtshard.DTensor, tdt.DTensor)
    assert not (dtshard.DTensor != tdt.DTensor) and dtshard.DTensor != torch.Tensor
    s0 = dtshard.distribute_tensor(X, mesh, [Replicate(), Shard(0)]).requires_grad_()
    a = dtshard.distribute_tensor(A, mesh, [Shard(1), Shard(1)])
    b = dtshard.distribute_tensor(B, mesh, [Replicate(), Shard(1)])
    programs = {
        "cumsum": lambda: torch.cumsum(s0, 0),  # one all_to_all on CPU (gloo)
        "cumsum backward": lambda: torch.cumsum(s0, 0).sum().backward(),
        "mm": lambda: s0 @ a,
        "mm add": lambda: (s0 @ a) @ b + 1,
        "sum": lambda: s0.sum().full_tensor(),
        "logsumexp": lambda: torch.logsumexp(s0, 0),
        "P -> S": lambda: dtshard.DTensor.from_local(X, mesh, [Partial(), Partial()]).redistribute(
            mesh, [Shard(0), Shard(1)]),
        "setup": lambda: dtshard.distribute_tensor(X, mesh, [Shard(0), Replicate()]),
    }
    for prog, fn in programs.items():
        with CommDebugMode() as cdm, CommCounter() as cc:
            fn()
        counted = {k: v for k, v in cdm.get_comm_counts().items() if v}
        assert counted == {k: v for k, v in cc.get_comm_counts().items() if v}, (prog, counted, cc.records)
        assert cdm.get_total_counts() == cc.get_total_counts() >= 1, (prog, cdm.get_total_counts(), cc.records)
        if prog == "cumsum":
            assert counted == {funcol.all_to_all_single: 1}, counted
    # the ops themselves still run under the mode with dtshard's values
    with CommDebugMode():
        _close(torch.cumsum(s0, 0).full_tensor(), X.cumsum(0), "cumsum under CommDebugMode")

    # -- item 13: linalg.norm of an empty matrix (OpInfo linalg.norm "subgradients_at_zero") ------
    from torch.testing._internal.opinfo.definitions.linalg import sample_inputs_linalg_norm

    n = 0
    for s in sample_inputs_linalg_norm(None, "cpu", torch.float32, False, variant="subgradient_at_zero"):
        ref = torch.linalg.norm(s.input, *s.args, **s.kwargs)
        for placements in ([Replicate(), Replicate()], [Shard(0), Replicate()]):
            d = dtshard.distribute_tensor(s.input, mesh, placements)
            out = torch.linalg.norm(d, *s.args, **s.kwargs)
            assert isinstance(out, dtshard.DTensor), (tuple(s.input.shape), s.args, s.kwargs, type(out))
            assert out.shape == ref.shape and out.dtype == ref.dtype, (out.shape, ref.shape)
            _close(out.full_tensor(), ref, f"linalg.norm {tuple(s.input.shape)} {s.args} {s.kwargs}")
            n += 1
        # PyTorch's DTensor runs the same call: same values (its result is a plain tensor there)
        theirs = torch.linalg.norm(tdt.distribute_tensor(s.input, mesh, [Replicate(), Replicate()]), *s.args, **s.kwargs)
        _close(theirs.full_tensor() if isinstance(theirs, tdt.DTensor) else theirs, ref, "PyTorch linalg.norm")
    assert n >= 20, n
    # matrix_norm's other overload, on empty and non-empty inputs, with a gradient
    for shape, ord_ in (((0, 3), "fro"), ((0, 0), "nuc"), ((4, 3), "nuc"), ((4, 3), 1)):
        x0 = torch.randn(shape, generator=g).requires_grad_()
        ref = torch.linalg.matrix_norm(x0, ord_)
        xd = dtshard.distribute_tensor(x0.detach(), mesh, [Replicate(), Replicate()]).requires_grad_()
        out = torch.linalg.matrix_norm(xd, ord_)
        assert isinstance(out, dtshard.DTensor), (shape, ord_, type(out))
        _close(out.full_tensor(), ref, f"matrix_norm {shape} {ord_}")
        if ref.requires_grad:
            ref.backward()
            out.backward()
            _close(xd.grad.full_tensor(), x0.grad, f"matrix_norm {shape} {ord_} grad")

    # -- item 14a: from_local with shape= alone on uneven shards ---------------------------------
    G = torch.randn(3, 4, generator=g)
    local = G.chunk(2)[tp.get_local_rank()]
    for run_check in (True, False):
        d = dtshard.DTensor.from_local(local, tp, [Shard(0)], shape=G.shape, run_check=run_check)
        assert d.shape == G.shape and d.stride() == G.stride(), (d.shape, d.stride())
        _close(d.full_tensor(), G, f"from_local shape= alone (run_check={run_check})")
        _close((d * 2).sum(0).full_tensor(), (G * 2).sum(0), "an op on it")
        # PyTorch asks for both
        e = _raises(lambda: tdt.DTensor.from_local(local, tp, [Shard(0)], shape=G.shape, run_check=run_check), RuntimeError)
        assert "both shape and stride" in str(e), e
        # stride= alone: both raise (the shape would be guessed from even shards)
        for lib in (tdt, dtshard):
            e = _raises(lambda: lib.DTensor.from_local(local, tp, [Shard(0)], stride=G.stride(), run_check=run_check),
                        RuntimeError)
            assert "both shape and stride" in str(e), e
    # both given: the same tensor on both libraries
    d = dtshard.DTensor.from_local(local, tp, [Shard(0)], shape=G.shape, stride=G.stride(), run_check=True)
    t = tdt.DTensor.from_local(local, tp, [Shard(0)], shape=G.shape, stride=G.stride(), run_check=True)
    _close(d.full_tensor(), t.full_tensor(), "from_local shape and stride")
    # a shape the shards do not form: run_check raises on every rank (PyTorch takes it)
    other = G.chunk(2)[1 - tp.get_local_rank()]
    e = _raises(lambda: dtshard.DTensor.from_local(other, tp, [Shard(0)], shape=G.shape, run_check=True), ValueError)
    assert "do not form" in str(e), e

    # -- item 14b: embedding(max_norm=) on a column-sharded weight --------------------------------
    W = torch.randn(10, 6, generator=g) * 3
    ids = torch.tensor([[1, 2, 4], [4, 3, 9]])
    ref_w = W.clone().requires_grad_()
    ref = F.embedding(ids, ref_w, max_norm=1.0)
    ref.pow(2).sum().backward()
    for placements in ([Replicate(), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(1)]):
        w = dtshard.distribute_tensor(W, mesh, placements).requires_grad_()
        i = dtshard.distribute_tensor(ids, mesh, [Replicate(), Replicate()])
        out = F.embedding(i, w, max_norm=1.0)
        _close(out.full_tensor(), ref, f"embedding max_norm {placements}")
        _close(w.detach().full_tensor(), ref_w.detach(), f"renormed weight {placements}")  # rows renormed in place
        assert w.placements == tuple(placements)
        out.pow(2).sum().backward()
        _close(w.grad.full_tensor(), ref_w.grad, f"embedding max_norm grad {placements}")
        # PyTorch's DTensor has no strategy for embedding_renorm_
        tw = tdt.distribute_tensor(W, mesh, placements)
        _raises(lambda: F.embedding(tdt.distribute_tensor(ids, mesh, [Replicate(), Replicate()]), tw, max_norm=1.0),
                NotImplementedError)
    return rank


def test_comm_debug_mode_linalg_norm_from_local_and_embedding_max_norm():
    assert run_distributed(_debug_norm_from_local_embedding, 4, timeout=300) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------
# Item 11 on the backend it came from: PyTorch's threaded process group (ranks as threads of this
# process, what PyTorch's own DTensor tests run on), whose reduce_scatter has SUM and AVG only
# ---------------------------------------------------------------------------------------------

def _threaded_rank(rank, world, store, out):
    dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
    try:
        assert dist.get_backend() == "threaded"
        mesh = dtshard.init_device_mesh("cpu", (world,))
        g = torch.Generator().manual_seed(5)
        for shape in ((4, 6), (5, 3)):  # even (a reduce_scatter) and uneven (an all_to_all) pieces
            terms = [torch.randn(shape, generator=g) for _ in range(world)]
            for op, red in (("max", torch.amax), ("min", torch.amin)):
                want = red(torch.stack(terms), 0)
                for target in ([Shard(0)], [Shard(1)], [Replicate()]):
                    for fname, fn in (("relu", torch.relu), ("neg", torch.neg)):
                        d = dtshard.DTensor.from_local(terms[rank], mesh, [Partial(op)])
                        with CommCounter() as cc:
                            y = fn(d).redistribute(mesh, target)
                        out[rank, op, fname, str(target), shape] = (
                            (y.full_tensor() - fn(want)).abs().max().item(), cc.kinds())
                    try:  # PyTorch's DTensor, the same program
                        t = tdt.DTensor.from_local(terms[rank], mesh, [Partial(op)])
                        out[rank, op, "torch", str(target), shape] = (
                            torch.relu(t).redistribute(mesh, target).full_tensor() - torch.relu(want)).abs().max().item()
                    except NotImplementedError as e:
                        out[rank, op, "torch", str(target), shape] = str(e)
    except BaseException as e:  # noqa: BLE001 - reported by the test
        out[rank, "error"] = repr(e)
    finally:
        dist.destroy_process_group()


def test_max_min_to_shard_on_pytorchs_threaded_process_group():
    import threading

    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

    assert not dist.is_initialized()  # the test process itself (ranks of other tests are workers)
    world, out = 2, {}
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        store = dist.HashStore()
        threads = [threading.Thread(target=_threaded_rank, args=(r, world, store, out), daemon=True)
                   for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "a rank thread did not finish in 60 s"
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    assert not any(k[1] == "error" for k in out), {k: v for k, v in out.items() if k[1] == "error"}
    for key, value in out.items():
        if key[2] == "torch":
            # PyTorch's own DTensor cannot reduce-scatter P(max/min) on this backend
            assert value == 0.0 if key[3] == str([Replicate()]) else "ReduceScatter does not support" in value, (key, value)
        else:
            err, kinds = value
            assert err == 0.0, (key, value)
            assert "reduce_scatter" not in kinds, (key, kinds)  # an all_reduce, each rank keeping its block
    # the even pieces did need the fallback (an all_reduce where gloo would reduce-scatter)
    assert any("all_reduce" in v[1] for k, v in out.items() if k[2] != "torch" and k[4] == (4, 6)), out
