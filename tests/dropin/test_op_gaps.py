"""Drop-in gaps (issue #17): code written for ``torch.distributed.tensor`` must run on dtshard by
changing only its import.

Each worker runs the SAME code on both packages where PyTorch's DTensor runs it (``_LIBS``: the
placements and the mesh are PyTorch's own classes, so only the module differs), compares both with
single-process PyTorch on every rank, forward and backward, and then checks what dtshard adds
(uneven shards, traffic, aliasing).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor.placement_types import Partial, Replicate, Shard

import dtshard
import dtshard.parallel
from dtshard.debug import CommCounter
from dtshard.testing import run_distributed

_meshes: dict = {}


def _mesh(shape):
    """One mesh per shape per worker process (both packages use PyTorch's DeviceMesh)."""
    m = _meshes.get(shape)
    if m is None:
        m = _meshes[shape] = dtshard.init_device_mesh("cpu", shape)
    return m


def _libs():
    """(name, DTensor package, tensor-parallel package): PyTorch's first, then dtshard."""
    import torch.distributed.tensor as torch_dt
    import torch.distributed.tensor.parallel as torch_tp

    return [("torch", torch_dt, torch_tp), ("dtshard", dtshard, dtshard.parallel)]


def _partial_terms(full: torch.Tensor, rank: int, n: int, op: str) -> torch.Tensor:
    """This rank's term of a ``Partial(op)`` of ``full`` (terms differ across ranks)."""
    g = torch.Generator().manual_seed(77)
    z = torch.randint(1, 4, full.shape, generator=g).to(full.dtype)
    if op == "sum":
        return full - (n - 1) * z if rank == 0 else z
    if op == "avg":
        return full * n - (n - 1) * z if rank == 0 else z
    if op in ("prod", "product"):
        return full / z ** (n - 1) if rank == 0 else z
    if op == "max":
        return full - rank * z
    if op == "min":
        return full + rank * z
    raise ValueError(op)


def _close(got, want, what):
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=lambda s: f"{what}: {s}")


# ---------------------------------------------------------------------------------------------
# Item 1: torch.inference_mode()
# ---------------------------------------------------------------------------------------------

def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))


def _composite_cases():
    """(name, fn, shapes, placements per input, runs on PyTorch's DTensor): CompositeImplicitAutograd
    ops that reach __torch_dispatch__ undecomposed under inference_mode.  Uneven shards only on
    dtshard (PyTorch's DTensor aborts in gloo on some of them under inference_mode)."""
    S0, S1, S2, Rp, Ps = Shard(0), Shard(1), Shard(2), Replicate(), Partial("sum")
    return [
        ("matmul 2d", torch.matmul, [(4, 6), (6, 4)], [S0, Rp], True),
        ("matmul 2d k", torch.matmul, [(4, 6), (6, 4)], [S1, Shard(0)], True),
        ("matmul 3d@2d", torch.matmul, [(2, 4, 6), (6, 4)], [S1, Rp], True),
        ("matmul bcast", torch.matmul, [(2, 1, 4, 6), (3, 6, 4)], [S0, S0], True),
        ("matmul 1d@3d", torch.matmul, [(6,), (2, 6, 4)], [Rp, S2], True),
        ("matmul 3d@1d", torch.matmul, [(2, 4, 6), (6,)], [S2, S0], True),
        ("matmul dot", torch.matmul, [(6,), (6,)], [S0, S0], True),
        ("matmul partial", torch.matmul, [(4, 6), (6, 4)], [Ps, Rp], True),
        ("linear", F.linear, [(2, 4, 6), (4, 6), (4,)], [S1, Rp, Rp], True),
        ("linear colwise", F.linear, [(4, 6), (4, 6), (4,)], [Rp, S0, S0], True),
        ("linear rowwise", F.linear, [(4, 6), (4, 6), (4,)], [S1, S1, Rp], True),
        ("linear partial", F.linear, [(4, 6), (4, 6), (4,)], [Ps, Rp, Rp], True),
        ("linear nobias", F.linear, [(4, 6), (4, 6)], [S0, Rp], True),
        ("einsum", lambda a, b: torch.einsum("bij,jk->bik", a, b), [(2, 4, 6), (6, 4)], [S0, Rp], True),
        ("softmax", lambda a: torch.softmax(a, -1), [(4, 6)], [S0], True),
        ("log_softmax", lambda a: F.log_softmax(a, 0), [(4, 6)], [S0], True),
        ("layer_norm", lambda a: F.layer_norm(a, (6,)), [(4, 6)], [S0], True),
        ("flatten", lambda a: a.flatten(), [(4, 6)], [S0], True),
        ("reshape", lambda a: a.reshape(2, 12), [(4, 6)], [S0], True),
        ("std", lambda a: a.std(0), [(4, 6)], [S0], True),
        ("cosine_similarity", lambda a, b: F.cosine_similarity(a, b, dim=0), [(4, 6), (4, 6)], [S0, S0], True),
        # uneven (dtshard only)
        ("matmul uneven", torch.matmul, [(5, 7), (7, 3)], [S0, Rp], False),
        ("matmul uneven k", torch.matmul, [(5, 7), (7, 3)], [S1, S0], False),
        ("linear uneven", F.linear, [(3, 5, 7), (5, 7), (5,)], [S1, S0, S0], False),
        ("softmax uneven", lambda a: torch.softmax(a, 0), [(5, 7)], [S0], False),
        ("flatten uneven", lambda a: a.flatten(0, 1), [(5, 3, 2)], [S1], False),
    ]


def _inference_mode_worker(world):
    m = _mesh((world,))
    rank = m.get_coordinate()[0]
    x = torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        want_mlp = _mlp()(x)
    report = {}
    for name, dt, tp in _libs():
        # a Colwise -> Rowwise MLP (nn.Linear through the package's parallel styles)
        mlp = tp.parallelize_module(_mlp(), m, {"0": tp.ColwiseParallel(), "2": tp.RowwiseParallel()})
        with CommCounter() as cc, torch.inference_mode():
            y = mlp(x)
        _close(y, want_mlp, f"{name} TP MLP")
        if name == "dtshard":
            assert cc.kinds() == ["all_reduce"] and cc.count() == 1, cc.summary()  # Rowwise's output
        # composite ops, one by one
        for case, fn, shapes, placements, on_torch in _composite_cases():
            if name == "torch" and not on_torch:
                continue
            fulls = [torch.randint(-4, 5, s, generator=torch.Generator().manual_seed(k)).float()
                     for k, s in enumerate(shapes)]
            args = []
            for full, p in zip(fulls, placements):
                if isinstance(p, Partial):
                    args.append(dt.DTensor.from_local(_partial_terms(full, rank, world, p.reduce_op), m, [p]))
                else:
                    args.append(dt.distribute_tensor(full, m, [p]))
            with torch.inference_mode():
                got = fn(*args)
                want = fn(*fulls)
                _close(got.full_tensor(), want, f"{name} {case}")
            report[(name, case)] = str(got.placements)
    return report


def test_inference_mode_composites():
    """Under inference_mode, CompositeImplicitAutograd ops (linear, matmul, softmax, reshape, ...)
    reach __torch_dispatch__ undecomposed: a TP MLP and each op give the single-process result on
    every rank, on PyTorch's DTensor and on dtshard."""
    for report in run_distributed(_inference_mode_worker, 2, 2):
        assert report[("dtshard", "linear colwise")] == "(Shard(dim=1),)"
        assert report[("dtshard", "matmul 2d k")] == "(Partial(sum),)"


def _inference_plans_worker(world):
    """linear and matmul have rules (one dispatch, no decomposition); an op without one runs its
    decomposition; a rule registered later takes precedence over the decomposition."""
    m = _mesh((world,))
    x = dtshard.distribute_tensor(torch.randn(4, 6), m, [Shard(0)])
    w = dtshard.distribute_tensor(torch.randn(3, 6), m, [Replicate()])
    seen = []
    with dtshard.debug.plan_log() as log, torch.inference_mode():
        F.linear(x, w)
        torch.matmul(x, w.t())
        seen.append(list(log))
    with dtshard.debug.plan_log() as log, torch.inference_mode():
        x.flatten()
        seen.append(list(log))
    # as on plain tensors: a view of a normal tensor made in inference mode is a normal tensor
    # (PyTorch's DTensor raises "Cannot set version_counter for inference tensor" here)
    wp = torch.randn(3, 6)
    with torch.inference_mode():
        wt, y = w.t(), x * 2
        seen.append((wt.is_inference(), y.is_inference(), wp.t().is_inference(), (wp * 2).is_inference()))
        _close(wt.full_tensor(), w.full_tensor().t(), "w.t() in inference mode")
    return seen


def test_inference_mode_linear_matmul_are_single_dispatches():
    for seen in run_distributed(_inference_plans_worker, 2, 2):
        linear_matmul, flatten, inference = seen
        assert inference == (False, True, False, True), inference
        assert [s.split()[0] for s in linear_matmul] == ["aten.linear.default", "aten.t.default",
                                                         "aten.matmul.default"], linear_matmul
        assert "aten.flatten.using_ints" not in " ".join(flatten) and flatten, flatten


# ---------------------------------------------------------------------------------------------
# Item 4: complex tensors
# ---------------------------------------------------------------------------------------------

def _real(t):
    """A real view of a result for comparing and for the loss (complex -> (..., 2) pairs)."""
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj())
    return t.resolve_neg()


def _complex_cases():
    """(name, fn, [(shape, dtype)], placement schemes (one placement per input), runs on PyTorch's
    DTensor).  Complex leaves are complex64; the pair dim of a view_as_complex input is its last."""
    S0, S1, S2, Rp, Ps = Shard(0), Shard(1), Shard(2), Replicate(), Partial("sum")
    f, c = torch.float32, torch.complex64
    return [
        ("view_as_complex", torch.view_as_complex, [((4, 6, 2), f)], [[S0], [S1], [S2], [Rp], [Ps]], True),
        ("view_as_real", torch.view_as_real, [((4, 6), c)], [[S0], [S1], [Rp], [Ps]], True),
        ("conj", lambda a: a.conj(), [((4, 6), c)], [[S0], [S1], [Rp], [Ps]], True),
        # S(1) inputs are left out here and for polar: their backward moves a complex gradient
        # S(1) -> S(0) by all_to_all (the loss's expanded gradient is planned S(0)), which gloo
        # rejects for complex dtypes ("Invalid scalar type"); collectives.all_to_all must send
        # complex tensors as real pairs (outside this change: see docs_dropin_ops.md)
        ("conj mul", lambda a, b: a.conj() * b, [((4, 6), c), ((4, 6), c)], [[S0, S0], [S0, Rp], [Rp, Rp]], True),
        ("resolve_conj", lambda a: a.conj().resolve_conj() + 0, [((4, 6), c)], [[S0], [S1], [Rp]], True),
        ("conj_physical", torch.conj_physical, [((4, 6), c)], [[S0], [Rp]], False),  # no rule in PyTorch
        ("imag of conj", lambda a: a.conj().imag, [((4, 6), c)], [[S0], [S1], [Rp]], False),  # PyTorch: no _neg_view rule
        ("real imag", lambda a: a.real * 2 + a.imag, [((4, 6), c)], [[S0], [S1], [Rp]], True),
        # PyTorch's DTensor: polar's backward raises "unhashable type: complex"
        ("polar", torch.polar, [((4, 6), f), ((4, 6), f)], [[S0, S0], [S0, Rp], [Rp, Rp]], False),
        ("complex", torch.complex, [((4, 6), f), ((4, 6), f)], [[S0, S0], [Rp, S1], [Ps, Ps]], True),
        # its backward is _to_copy(grad.real, dtype=float32, device="cpu"): planned on meta tensors
        ("to complex128", lambda a: a.to(torch.complex128), [((4, 6), f)], [[S0], [Rp], [Ps]], True),
        ("complex roundtrip", lambda x: torch.view_as_real(torch.view_as_complex(x) * torch.view_as_complex(x).conj()),
         [((4, 6, 2), f)], [[S0], [Rp]], False),  # PyTorch's DTensor: wrong values for S(0)
        # uneven (dtshard only): 5 rows on 2 ranks
        ("view_as_complex uneven", torch.view_as_complex, [((5, 3, 2), f)], [[S0], [S1], [S2]], False),
        ("conj mul uneven", lambda a, b: a.conj() * b, [((5, 3), c), ((5, 3), c)], [[S0, S0], [S0, Rp]], False),
        # gathering a conj view whose chunks are uneven: only the short chunk is copied into a
        # padded buffer, so the conj bit must be resolved before any collective (a hang before)
        ("conj uneven", lambda a: a.conj(), [((5, 3), c)], [[S0], [S1]], False),
        ("ihfft", torch.fft.ihfft, [((5, 6, 7), f)], [[S0], [S1], [Rp]], False),
    ]


def _leaf(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    re = torch.randint(-4, 5, shape, generator=g).float()
    if dtype.is_complex:
        return torch.complex(re, torch.randint(-4, 5, shape, generator=g).float())
    return re


def _make(dt, full, m, p, rank, world):
    if isinstance(p, Partial):
        if full.is_complex():  # complex terms: split the real and imaginary parts alike
            t = torch.complex(_partial_terms(full.real, rank, world, "sum"), _partial_terms(full.imag, rank, world, "sum"))
        else:
            t = _partial_terms(full, rank, world, "sum")
        return dt.DTensor.from_local(t, m, [p])
    return dt.distribute_tensor(full, m, [p])


def _complex_worker(world):
    m = _mesh((world,))
    rank = m.get_coordinate()[0]
    report = {}
    for name, dt, _ in _libs():
        for case, fn, inputs, schemes, on_torch in _complex_cases():
            if name == "torch" and not on_torch:
                continue
            fulls = [_leaf(s, d, k) for k, (s, d) in enumerate(inputs)]
            leaves = [t.clone().requires_grad_() for t in fulls]
            want = fn(*leaves)
            (_real(want) ** 2).sum().backward()
            for placements in schemes:
                what = f"{name} {case} {placements}"
                args = [_make(dt, t, m, p, rank, world).requires_grad_() for t, p in zip(fulls, placements)]
                try:
                    got = fn(*args)
                    assert got.is_conj() == want.is_conj() and got.is_neg() == want.is_neg(), what
                    _close(_real(got).full_tensor(), _real(want).detach(), what)
                    # gathering a conj / neg view gathers its values
                    _close(_real(got.full_tensor()), _real(want).detach(), what + " full_tensor")
                    (_real(got) ** 2).sum().backward()
                except Exception as e:
                    raise AssertionError(what) from e
                for a, leaf in zip(args, leaves):
                    _close(a.grad.full_tensor(), leaf.grad, what + " grad")
                report[(name, case, str(placements))] = str(got.placements)
    return report


def test_complex_views_and_conj():
    """view_as_complex / view_as_real / conj / resolve_conj / conj_physical / real / imag / polar /
    complex on sharded, replicated and Partial inputs: values, the conj and neg bits and gradients
    as in one process; the pair dim of view_as_complex is never left sharded."""
    for report in run_distributed(_complex_worker, 2, 2):
        for key, placements in report.items():
            if key[1].startswith("view_as_complex") and "dim=2" in key[2]:
                assert "Shard(dim=2)" not in placements, (key, placements)
        assert report[("dtshard", "view_as_real", str([Shard(1)]))] == "(Shard(dim=1),)"
        assert report[("dtshard", "view_as_complex", str([Partial("sum")]))] == "(Partial(sum),)"
        assert report[("dtshard", "conj", str([Shard(0)]))] == "(Shard(dim=0),)"


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    """Llama's rotary frequencies (as in the reference implementation)."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end).float(), freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, freqs_cis):
    """Llama's apply_rotary_emb, verbatim but for one of its two inputs."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    shape = [d if i == 1 or i == xq_.ndim - 1 else 1 for i, d in enumerate(xq_.shape)]
    xq_out = torch.view_as_real(xq_ * freqs_cis.view(*shape)).flatten(3)
    return xq_out.type_as(xq)


def _rope_worker(world, shape, libs, placements=(Shard(0), Shard(1), Shard(2), Shard(3), Replicate())):
    m = _mesh((world,))
    B, S, H, D = shape
    g = torch.Generator().manual_seed(0)
    X, W = torch.randn(B, S, H, D, generator=g), torch.randn(B, S, H, D, generator=g)
    fc = precompute_freqs_cis(D, S)
    x0 = X.clone().requires_grad_()
    y0 = apply_rotary_emb(x0, fc)
    (y0 * W).sum().backward()
    out = {}
    for name, dt, _ in _libs():
        if name not in libs:
            continue
        for p in placements:
            x = dt.distribute_tensor(X, m, [p]).requires_grad_()
            w = dt.distribute_tensor(W, m, [p])
            # the frequencies follow the sequence shards; computed with torch.polar on DTensors
            fp = Shard(0) if p == Shard(1) else Replicate()
            angles = torch.outer(torch.arange(S).float(), 1.0 / (10000.0 ** (torch.arange(0, D, 2).float() / D)))
            freqs = torch.polar(dt.distribute_tensor(torch.ones(S, D // 2), m, [fp]),
                                dt.distribute_tensor(angles, m, [fp]))
            y = apply_rotary_emb(x, freqs)
            (y * w).sum().backward()
            what = f"{name} RoPE {p}"
            _close(freqs.full_tensor(), fc, what + " freqs")
            _close(y.full_tensor(), y0.detach(), what)
            _close(x.grad.full_tensor(), x0.grad, what + " grad")
            out[(name, str(p))] = str(y.placements)
    return out


def test_llama_rotary_embedding():
    """Llama's complex RoPE (polar, view_as_complex of pairs, multiply, view_as_real, flatten) on
    x sharded on batch, sequence, heads or head_dim, or replicated: forward and backward as in
    one process, on PyTorch's DTensor and dtshard (2 ranks), and on dtshard with uneven and empty
    shards (4 ranks)."""
    for out in run_distributed(_rope_worker, 2, 2, (2, 4, 4, 8), ("torch", "dtshard")):
        for p in ("S(0)", "S(1)", "S(2)", "S(3)"):
            assert out[("dtshard", p)] == out[("torch", p)], (p, out)
    for out in run_distributed(_rope_worker, 4, 4, (2, 6, 3, 8), ("dtshard",), (Shard(0), Shard(1), Shard(3))):
        assert out[("dtshard", "S(1)")] == "(Shard(dim=1),)", out


def test_view_as_complex_never_offers_a_sharded_pair_dim():
    """The rule (pure metadata, one process): the trailing pair dim is never a sharded input."""
    from dtshard.registry import OpCall, get_entry
    from dtshard.spec import TensorMeta

    op = torch.ops.aten.view_as_complex.default
    for shape in [(2,), (5, 2), (3, 4, 2)]:
        x = TensorMeta(shape, dtshard.spec.contiguous_strides(shape), torch.float32)
        strategies = get_entry(op).fn(OpCall(op, (x,), {}, (x,)))
        ins = [s[1][0] for s in strategies]
        assert Shard(len(shape) - 1) not in ins, (shape, strategies)
        assert [Shard(d) for d in range(len(shape) - 1)] == [p for p in ins if isinstance(p, Shard)]


# ---------------------------------------------------------------------------------------------
# Item 5: Partial("product")
# ---------------------------------------------------------------------------------------------

def _product_worker(world):
    m = _mesh((world,))
    rank = m.get_coordinate()[0]
    g = torch.Generator().manual_seed(3)
    # terms whose product is exact in float32: small powers of two with signs
    terms = [torch.randint(-2, 3, (8, 5), generator=g).float().clamp(min=0.5) * torch.randint(0, 2, (8, 5), generator=g).float().mul(2).sub(1)
             for _ in range(world)]
    want = torch.stack(terms).prod(0)
    X = torch.randint(1, 4, (8, 6), generator=g).float()
    out = {}
    for name, dt, _ in _libs():
        p = dt.DTensor.from_local(terms[rank], m, [Partial("product")])
        assert p.placements == (Partial("product"),)
        _close(p.full_tensor(), want, f"{name} P(product) -> R")
        for d in (0, 1):
            s = p.redistribute(m, [Shard(d)])
            _close(s.full_tensor(), want, f"{name} P(product) -> S({d})")
        # prod over a sharded dim leaves partial products
        for f, fname in ((lambda t: t.prod(0), "prod(0)"), (lambda t: t.prod(), "prod()")):
            x = dt.distribute_tensor(X, m, [Shard(0)]).requires_grad_()
            x0 = X.clone().requires_grad_()
            y, y0 = f(x), f(x0)
            out[(name, fname)] = str(y.placements)
            _close(y.full_tensor(), y0, f"{name} {fname}")
            if name == "dtshard":  # PyTorch's DTensor: prod's backward raises (mixed Tensor in cat)
                y.sum().backward()
                y0.sum().backward()
                _close(x.grad.full_tensor(), x0.grad, f"{name} {fname} grad")
        # the spelling "prod": PyTorch's Partial takes it and fails to reduce it; dtshard reads it
        # as "product" (issue #54 item 10; tests/dropin/test_issue54_dtensor.py has the rest)
        try:
            full = dt.DTensor.from_local(terms[rank], m, [Partial("prod")]).full_tensor()
            _close(full, want, f"{name} P(prod) -> R")
            out[(name, "prod spelling")] = "accepted"
        except (ValueError, RuntimeError) as e:
            out[(name, "prod spelling")] = str(e)

    # dtshard: R -> P(product) keeps the value on one rank and ones elsewhere (exact), both ways
    r = dtshard.distribute_tensor(want, m, [Replicate()])
    pr = r.redistribute(m, [Partial("product")])
    _close(pr.to_local(), want if rank == 0 else torch.ones_like(want), "R -> P(product) terms")
    _close(pr.full_tensor(), want, "R -> P(product) -> R")
    _close(dtshard.distribute_tensor(want, m, [Partial("product")]).full_tensor(), want, "distribute P(product)")
    p = dtshard.DTensor.from_local(terms[rank], m, [Partial("product")])
    with CommCounter() as cc:
        p.redistribute(m, [Replicate()])
    assert cc.kinds() == ["all_reduce"], cc.summary()
    with CommCounter() as cc:
        p.redistribute(m, [Shard(0)])  # 8 rows split evenly
    assert cc.kinds() == ["reduce_scatter"], cc.summary()
    # uneven rows (5 on 4 ranks: 2, 2, 1, 0): exact pieces by all_to_all, multiplied locally
    q = dtshard.DTensor.from_local(terms[rank][:5], m, [Partial("product")])
    _close(q.redistribute(m, [Shard(0)]).full_tensor(), want[:5], "uneven P(product) -> S(0)")
    # integers: exact
    ip = dtshard.DTensor.from_local(torch.full((3,), rank + 2, dtype=torch.int64), m, [Partial("product")])
    assert ip.full_tensor().tolist() == [torch.arange(2, world + 2).prod().item()] * 3
    # ops that do not commute with a product reduce first (mul by a scalar would give 2**n * x)
    placements = {}
    for fname, f in (("mul scalar", lambda t: t * 2), ("add", lambda t: t + 1), ("neg", lambda t: -t),
                     ("div", lambda t: t / 2), ("sum", lambda t: t.sum()), ("pow", lambda t: t ** 2),
                     ("mm", lambda t: t @ t.t()), ("mul P(product)", lambda t: t * t),
                     ("clone", lambda t: t.clone()), ("t", lambda t: t.t()), ("view", lambda t: t.view(-1)),
                     ("prod(1)", lambda t: t.prod(1))):
        got = f(p)
        _close(got.full_tensor(), f(want), f"P(product) {fname}")
        placements[fname] = str(got.placements)
    out["ops"] = placements
    return out


def _product_2d_worker(world):
    m = _mesh((2, world // 2))
    c = m.get_coordinate()
    g = torch.Generator().manual_seed(4)
    terms = torch.randint(1, 3, (2, world // 2, 4, 6), generator=g).float()
    want = terms.prod(0).prod(0)
    p = dtshard.DTensor.from_local(terms[c[0], c[1]], m, [Partial("product"), Partial("product")])
    for dst in ([Replicate(), Replicate()], [Shard(0), Shard(1)], [Shard(1), Replicate()], [Partial("product"), Replicate()]):
        _close(p.redistribute(m, dst).full_tensor(), want, f"2-D P(product) -> {dst}")
    with CommCounter() as cc:
        p.redistribute(m, [Replicate(), Replicate()])
    # mixed with a sum: the value would depend on the reduction order (PyTorch rejects mixed
    # Partial types): refused, on every rank, with what to do
    try:
        dtshard.DTensor.from_local(terms[c[0], c[1]], m, [Partial("product"), Partial("sum")])
    except ValueError as e:
        assert "mix Partial('product') with ['sum']" in str(e) and "redistribute" in str(e), e
    else:
        raise AssertionError("mixed (P(product), P(sum)) accepted")
    return cc.kinds()


def test_partial_product():
    """Partial("product") (PyTorch's name) in from_local, redistribute (all_reduce / reduce_scatter
    with PRODUCT; R -> P(product): ones on the other ranks) and from prod over a sharded dim, on
    PyTorch's DTensor and dtshard; ops that do not commute with a product reduce first."""
    for out in run_distributed(_product_worker, 4, 4):
        for lib in ("torch", "dtshard"):
            assert out[(lib, "prod(0)")] == out[(lib, "prod()")] == "(Partial(product),)", out
        assert out[("torch", "prod spelling")] != "accepted"
        assert out[("dtshard", "prod spelling")] == "accepted", out[("dtshard", "prod spelling")]
        ops = out["ops"]
        for fname in ("mul scalar", "add", "neg", "div", "sum", "pow", "mm"):
            assert "product" not in ops[fname], (fname, ops[fname])
        for fname in ("clone", "t", "view", "prod(1)"):
            assert ops[fname] == "(Partial(product),)", (fname, ops[fname])
    for kinds in run_distributed(_product_2d_worker, 4, 4):
        assert kinds == ["all_reduce"], kinds  # one all_reduce over the flattened 2x2 group


# ---------------------------------------------------------------------------------------------
# Item 11: in-place ops on Partial
# ---------------------------------------------------------------------------------------------

def _inplace_partial_worker(world):
    m = _mesh((world,))
    rank = m.get_coordinate()[0]
    g = torch.Generator().manual_seed(5)
    A = torch.randint(-4, 5, (3, 4), generator=g).float()
    B = torch.randint(-4, 5, (4,), generator=g).float()
    W = torch.randint(-4, 5, (3, 4), generator=g).float()
    out = {}
    for name, dt, _ in _libs():
        # copy_ of a broadcasting Partial source into a Partial destination, forward and backward
        for op in ("sum", "avg", "max", "min"):
            src_local = _partial_terms(B, rank, world, op).requires_grad_()
            src = dt.DTensor.from_local(src_local, m, [Partial(op)])
            dst = dt.DTensor.from_local(_partial_terms(A, rank, world, op), m, [Partial(op)])
            dst.copy_(src)
            assert dst.placements == (Partial(op),), (name, op, dst.placements)
            _close(dst.full_tensor(), B.expand(3, 4), f"{name} copy_ P({op}) <- P({op}) broadcast")
            if op == "sum":
                (dst.full_tensor() * W).sum().backward()
                _close(src_local.grad, W.sum(0), f"{name} copy_ P(sum) grad")
        # a replicated source into a Partial(sum) destination
        dst = dt.DTensor.from_local(_partial_terms(A, rank, world, "sum"), m, [Partial("sum")])
        dst.copy_(dt.distribute_tensor(B, m, [Replicate()]))
        _close(dst.full_tensor(), B.expand(3, 4), f"{name} copy_ P(sum) <- R")
        if name == "dtshard":  # exact: the source whole on rank 0, zeros elsewhere (PyTorch: B / n)
            _close(dst.to_local(), B.expand(3, 4) * (rank == 0), "copy_ P(sum) <- R terms")
        # fill_: avg, max and min hold the value on every rank in both packages
        for op in ("avg", "max", "min"):
            x = dt.DTensor.from_local(_partial_terms(A, rank, world, op), m, [Partial(op)])
            x.fill_(3.0)
            assert x.placements == (Partial(op),)
            _close(x.full_tensor(), torch.full((3, 4), 3.0), f"{name} fill_ P({op})")
        # fill_ of Partial(sum): PyTorch's DTensor fills every rank, so the value becomes n * 3
        x = dt.DTensor.from_local(_partial_terms(A, rank, world, "sum"), m, [Partial("sum")])
        x.fill_(3.0)
        out[(name, "fill_ P(sum)")] = (str(x.placements), x.full_tensor()[0, 0].item())
    # dtshard: exact fills of sum and product partials (value on one rank, zeros / ones elsewhere)
    for op, value in (("sum", 3.0), ("product", -2.0), ("sum", torch.tensor(1.5))):
        x = dtshard.DTensor.from_local(_partial_terms(A, rank, world, op), m, [Partial(op)])
        with CommCounter() as cc:
            x.fill_(value)
        assert cc.count() == 0, cc.summary()
        assert x.placements == (Partial(op),)
        _close(x.full_tensor(), torch.full((3, 4), float(value)), f"fill_ P({op}) {value}")
    for p in (Shard(0), Replicate()):  # other layouts: unchanged (planned fill_)
        x = dtshard.distribute_tensor(A, m, [p])
        x.fill_(2.0)
        assert x.placements == (p,)
        _close(x.full_tensor(), torch.full((3, 4), 2.0), f"fill_ {p}")
    # a conversion that does not commute with the sum (float terms 0.75 + 0.75 -> int) is never
    # applied term by term: refused (what to do is in the message) or exact, never int(0.75) * 2
    # between floating types a narrowing copy_ keeps the Partial (each term rounds: a rounding-level
    # difference, as torch.Tensor.copy_ of the reduced value would round it)
    dst = dtshard.DTensor.from_local(torch.zeros(3, 4, dtype=torch.bfloat16), m, [Partial("sum")])
    dst.copy_(dtshard.DTensor.from_local(_partial_terms(A, rank, world, "sum"), m, [Partial("sum")]))
    assert dst.placements == (Partial("sum"),) and dst.dtype == torch.bfloat16
    _close(dst.full_tensor().float(), A, "copy_ float32 P(sum) -> bfloat16 P(sum)")
    dst = dtshard.DTensor.from_local(torch.zeros(4, dtype=torch.int64), m, [Partial("sum")])
    src = dtshard.DTensor.from_local(torch.full((4,), 1.5 / world), m, [Partial("sum")])
    try:
        dst.copy_(src)
        assert dst.full_tensor().tolist() == [1] * 4, dst.full_tensor()
        out["int copy_"] = "exact"
    except RuntimeError as e:
        assert "Redistribute the tensor first" in str(e), e
        out["int copy_"] = "refused"
    return out


def test_inplace_on_partial():
    """copy_ of a broadcasting (or replicated) source into a Partial destination, as in PyTorch's
    DTensor, forward and backward; fill_ on Partial(avg/max/min) as in PyTorch; fill_ on
    Partial(sum/product) exact (PyTorch's DTensor gives n * value for sum)."""
    for out in run_distributed(_inplace_partial_worker, 2, 2):
        assert out[("dtshard", "fill_ P(sum)")] == ("(Partial(sum),)", 3.0), out
        assert out["int copy_"] == "refused", out


# ---------------------------------------------------------------------------------------------
# Item 15: views of a dim smaller than the mesh
# ---------------------------------------------------------------------------------------------

def _view_cases():
    """Views of x (1, 4, 6) Shard(0) on 4 ranks (one rank holds the row, three hold empty shards)
    that keep the size-1 dim as a dim of the view; PyTorch's DTensor runs each as a view."""
    return [
        ("view(1, 24)", lambda x: x.view(1, 24)),
        ("view(1, 2, 2, 6)", lambda x: x.view(1, 2, 2, 6)),
        ("view(1, 1, 24)", lambda x: x.view(1, 1, 24)),
        ("view(1, 24, 1)", lambda x: x.view(1, 24, 1)),
        ("reshape(1, 3, 8)", lambda x: x.reshape(1, 3, 8)),
        ("reshape(1, -1)", lambda x: x.reshape(1, -1)),
        ("flatten(1)", lambda x: x.flatten(1)),
        ("flatten(-2)", lambda x: x.flatten(-2)),
        ("unsqueeze(0)", lambda x: x.unsqueeze(0)),
        ("unsqueeze(1)", lambda x: x.unsqueeze(1)),
        ("unsqueeze(-1)", lambda x: x.unsqueeze(-1)),
        ("transpose(0, 2)", lambda x: x.transpose(0, 2)),
        ("view_as_complex of a pair view", lambda x: torch.view_as_complex(x.view(1, 4, 3, 2))),
    ]


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() == sb.data_ptr() and sa._cdata == sb._cdata  # one storage object, not a copy


def _small_dim_views_worker(world):
    m = _mesh((world,))
    g = torch.Generator().manual_seed(6)
    X = torch.randn(1, 4, 6, generator=g)
    out = {}
    for name, dt, _ in _libs():
        for case, f in _view_cases():
            x = dt.distribute_tensor(X, m, [Shard(0)]).requires_grad_()
            x0 = X.clone().requires_grad_()
            with CommCounter() as cc:
                y = f(x)
            y0 = f(x0)
            what = f"{name} {case}"
            aliases = _same_storage(y._local_tensor, x._local_tensor)
            if name == "dtshard":
                assert aliases, what + ": the local result is a copy"
                assert cc.count() == 0, what + ": " + cc.summary()
            _close(_real(y).full_tensor(), _real(y0).detach(), what)
            w = torch.randn(_real(y0).shape, generator=g)
            (_real(y) * dt.distribute_tensor(w, m, [Replicate()])).sum().backward()
            (_real(y0) * w).sum().backward()
            _close(x.grad.full_tensor(), x0.grad, what + " grad")
            out[(name, case)] = (str(y.placements), aliases)
        # writes through the view reach the base (it is a view, not a copy)
        x = dt.distribute_tensor(X, m, [Shard(0)])
        x.view(1, 24).mul_(2)
        _close(x.full_tensor(), X * 2, f"{name} write through view(1, 24)")
    return out


def test_views_of_a_dim_smaller_than_the_mesh():
    """Shard(0) of size 1 on 4 ranks: view / reshape / flatten / unsqueeze / transpose that keep
    the size-1 dim stay views (no collective, the local result shares the shard's storage, writes
    reach the base), with PyTorch's DTensor's placements, forward and backward."""
    for out in run_distributed(_small_dim_views_worker, 4, 4):
        for case, _ in _view_cases():
            if case.startswith("view_as_complex"):
                # PyTorch's DTensor gathers here (Replicate, a copy); dtshard keeps the view
                assert out[("dtshard", case)] == ("(Shard(dim=0),)", True), out[("dtshard", case)]
                continue
            assert out[("dtshard", case)] == out[("torch", case)], (case, out[("dtshard", case)], out[("torch", case)])
