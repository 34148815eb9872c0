"""dtshard.parallel (PyTorch's tensor-parallel API) and the rules it relies on: embedding,
scaled_dot_product_attention, the losses (nll/cross_entropy, smooth_l1, huber, bce_with_logits,
l1) and rms_norm, against single-process PyTorch on every rank; loss_parallel; and the same
model-parallelizing code run with ``torch.distributed.tensor.parallel`` and with ``dtshard.parallel``.

The op cases run on 2 ranks and on 4 (where most shapes are uneven, with empty shards).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import dtshard
import dtshard.parallel
from dtshard import Partial, Replicate, Shard
from dtshard.debug import CommCounter
from dtshard.testing import run_distributed

from _cases import Ps, global_tensor, make_dtensor, mesh

aten = torch.ops.aten

# ---------------------------------------------------------------------------------------------
# a generic checker: inputs of several kinds, outputs and gradients against plain PyTorch
# ---------------------------------------------------------------------------------------------
# input kinds: "f" float (gets a gradient), "c" float constant, "p" probabilities in [0, 1)
# (constant), ("i", high) integers in [0, high) (constant)


def _make_full(kind, shape, seed):
    g = torch.Generator().manual_seed(100 + seed)
    if kind == "f" or kind == "c":
        return global_tensor(shape, seed) / 4
    if kind == "r":  # random normal (attention: values far from ties)
        return torch.randn(shape, generator=g)
    if kind == "p":
        return torch.rand(shape, generator=g)
    if isinstance(kind, tuple) and kind[0] == "i":
        return torch.randint(0, kind[1], shape, generator=g)
    raise ValueError(kind)


def _check_fn(fn_name, inputs, placements, mesh_shape):
    fn = _FNS[fn_name]
    m = mesh(mesh_shape)
    fulls = [_make_full(kind, shape, k) for k, (kind, shape) in enumerate(inputs)]
    grads = [kind in ("f", "r") for kind, _ in inputs]
    plain = [f.clone().requires_grad_(g) for f, g in zip(fulls, grads)]
    dts = [make_dtensor(f, m, Ps(p)).detach().requires_grad_(g) for f, p, g in zip(fulls, placements, grads)]
    ref = fn(*plain)
    out = fn(*dts)
    refs = ref if isinstance(ref, (tuple, list)) else [ref]
    outs = out if isinstance(out, (tuple, list)) else [out]
    coord = m.get_coordinate()
    for r, o in zip(refs, outs):
        assert isinstance(o, dtshard.DTensor), f"{fn_name}: output is {type(o)}"
        assert tuple(o.to_local().shape) == o._spec.local_shape(coord), (
            f"{fn_name}: local shape {tuple(o.to_local().shape)} does not match {o.placements} of {tuple(o.shape)}")
        torch.testing.assert_close(o.full_tensor(), r, msg=lambda s: f"{fn_name} {placements}: {s}")
    if any(grads):
        w = [torch.randn(r.shape, generator=torch.Generator().manual_seed(99)) for r in refs]
        sum((r * wi).sum() for r, wi in zip(refs, w)).backward()
        total = None
        for o, wi in zip(outs, w):
            term = (o * dtshard.distribute_tensor(wi, m, [Replicate()] * m.ndim, src_data_rank=None)).sum()
            total = term if total is None else total + term
        total.backward()
        for k, (p, d) in enumerate(zip(plain, dts)):
            if not grads[k]:
                continue
            assert d.grad is not None, f"{fn_name}: no gradient for input {k}"
            torch.testing.assert_close(d.grad.full_tensor(), p.grad, msg=lambda s: f"{fn_name} grad{k} {placements}: {s}")
    return [tuple(map(str, o.placements)) for o in outs]


def _in_loss_parallel(fn, *args):
    with dtshard.parallel.loss_parallel():
        return fn(*args)


def _sdpa(**kw):
    return lambda q, k, v, *mask: F.scaled_dot_product_attention(q, k, v, *mask, **kw)


_FNS = {
    "embedding": lambda w, ids: F.embedding(ids, w),
    "embedding_pad_freq": lambda w, ids: F.embedding(ids, w, padding_idx=2, scale_grad_by_freq=True),
    "sdpa_causal": _sdpa(is_causal=True),
    "sdpa": _sdpa(),
    "sdpa_scale": _sdpa(scale=0.3),
    "sdpa_gqa": _sdpa(is_causal=True, enable_gqa=True),
    "ce": lambda x, t: F.cross_entropy(x, t),
    "ce_sum": lambda x, t: F.cross_entropy(x, t, reduction="sum"),
    "ce_none": lambda x, t: F.cross_entropy(x, t, reduction="none"),
    # ignore_index inside the class range, and class weights
    "ce_weight_ignore": lambda x, t, w: F.cross_entropy(x, t, weight=w, ignore_index=3),
    "ce_weight_none": lambda x, t, w: F.cross_entropy(x, t, weight=w, ignore_index=3, reduction="none"),
    "ce_1d": lambda x, t: F.cross_entropy(x, t[0]),
    "nll_2d": lambda x, t: F.nll_loss(F.log_softmax(x, dim=1), t),
    "nll_2d_none": lambda x, t: F.nll_loss(x, t, reduction="none", ignore_index=1),
    "l1": lambda a, b: F.l1_loss(a, b),
    "smooth_l1": lambda a, b: F.smooth_l1_loss(a, b, beta=0.5),
    "smooth_l1_sum": lambda a, b: F.smooth_l1_loss(a, b, beta=0.5, reduction="sum"),
    "smooth_l1_none": lambda a, b: F.smooth_l1_loss(a, b, beta=0.5, reduction="none"),
    "smooth_l1_beta0": lambda a, b: F.smooth_l1_loss(a, b, beta=0.0),
    "huber": lambda a, b: F.huber_loss(a, b, delta=0.7),
    "huber_sum": lambda a, b: F.huber_loss(a, b, delta=0.7, reduction="sum"),
    "huber_none": lambda a, b: F.huber_loss(a, b, delta=0.7, reduction="none"),
    "bce": lambda x, y: F.binary_cross_entropy_with_logits(x, y),
    "bce_w_pw_sum": lambda x, y, w, pw: F.binary_cross_entropy_with_logits(x, y, weight=w, pos_weight=pw, reduction="sum"),
    "bce_none": lambda x, y, w: F.binary_cross_entropy_with_logits(x, y, pos_weight=w, reduction="none"),
    "nll": lambda x, t: F.nll_loss(x, t, ignore_index=0),
    "ce_loss_parallel": lambda x, t: _in_loss_parallel(F.cross_entropy, x, t),
    "rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6),
    "fused_rms_norm": lambda x, w: aten._fused_rms_norm(x, [x.shape[-1]], w, 1e-6),
}

F_, C_, P_, R_ = "f", "c", "p", "r"
_QKV = [(R_, (2, 4, 6, 8))] * 3
_CASES = [
    ("embedding", [(F_, (7, 5)), (("i", 7), (3, 4))],
     [("S0",), ("R",)], [("S1",), ("R",)], [("R",), ("S0",)], [("R",), ("S1",)], [("S0",), ("S0",)], [("Psum",), ("R",)]),
    ("embedding_pad_freq", [(F_, (7, 5)), (("i", 7), (3, 4))], [("S0",), ("R",)], [("R",), ("S0",)], [("S1",), ("R",)]),
    ("sdpa_causal", _QKV, [("S0",)] * 3, [("S1",)] * 3, [("S1",), ("S0",), ("S0",)]),
    ("sdpa", _QKV, [("S2",), ("R",), ("R",)], [("S1",)] * 3),
    ("sdpa_scale", _QKV + [(C_, (2, 1, 6, 6))], [("S1",)] * 3 + [("R",)], [("S2",), ("R",), ("R",), ("S2",)],
     [("S0",)] * 3 + [("S0",)]),
    ("sdpa_gqa", [(R_, (2, 4, 6, 8)), (R_, (2, 2, 6, 8)), (R_, (2, 2, 6, 8))], [("S1",)] * 3, [("S0",)] * 3),
    ("ce", [(F_, (6, 7)), (("i", 7), (6,))], [("S1",), ("R",)], [("S0",), ("S0",)], [("Psum",), ("R",)], [("R",), ("S0",)]),
    ("ce_sum", [(F_, (6, 7)), (("i", 7), (6,))], [("S1",), ("R",)], [("S0",), ("R",)]),
    ("ce_none", [(F_, (6, 7)), (("i", 7), (6,))], [("S1",), ("R",)], [("S0",), ("S0",)]),
    ("ce_weight_ignore", [(F_, (6, 7)), (("i", 7), (6,)), (P_, (7,))], [("S1",), ("R",), ("S0",)], [("S0",), ("S0",), ("R",)]),
    ("ce_weight_none", [(F_, (6, 7)), (("i", 7), (6,)), (P_, (7,))], [("S1",), ("R",), ("R",)]),
    ("ce_1d", [(F_, (7,)), (("i", 7), (1,))], [("S0",), ("R",)]),
    ("nll", [(F_, (6, 7)), (("i", 7), (6,))], [("Psum",), ("R",)], [("S1",), ("S0",)]),
    ("ce_loss_parallel", [(F_, (6, 7)), (("i", 7), (6,))], [("S1",), ("R",)], [("S0",), ("S0",)]),
    ("nll_2d", [(F_, (2, 5, 3, 3)), (("i", 5), (2, 3, 3))], [("S1",), ("R",)], [("S2",), ("S1",)]),
    ("nll_2d_none", [(F_, (2, 5, 3, 3)), (("i", 5), (2, 3, 3))], [("S1",), ("R",)], [("S0",), ("S0",)]),
    ("l1", [(F_, (7, 3)), (F_, (7, 3))], [("S0",), ("S0",)], [("S1",), ("R",)]),
    ("smooth_l1", [(F_, (7, 3)), (F_, (7, 3))], [("S0",), ("S0",)], [("S1",), ("R",)], [("Psum",), ("R",)]),
    ("smooth_l1_sum", [(F_, (7, 3)), (F_, (7, 3))], [("S0",), ("S0",)]),
    ("smooth_l1_none", [(F_, (7, 3)), (F_, (7, 3))], [("S1",), ("S1",)]),
    ("smooth_l1_beta0", [(F_, (7, 3)), (F_, (7, 3))], [("S0",), ("R",)]),
    ("huber", [(F_, (7, 3)), (F_, (7, 3))], [("S0",), ("S0",)], [("S1",), ("R",)]),
    ("huber_sum", [(F_, (7, 3)), (F_, (7, 3))], [("S1",), ("S1",)]),
    ("huber_none", [(F_, (7, 3)), (F_, (7, 3))], [("S0",), ("R",)]),
    ("bce", [(F_, (7, 3)), (P_, (7, 3))], [("S0",), ("S0",)], [("S1",), ("R",)]),
    ("bce_w_pw_sum", [(F_, (7, 3)), (P_, (7, 3)), (P_, (3,)), (P_, (3,))], [("S0",), ("S0",), ("R",), ("R",)],
     [("S1",), ("S1",), ("S0",), ("R",)]),
    ("bce_none", [(F_, (7, 3)), (P_, (7, 3)), (P_, (3,))], [("S0",), ("R",), ("R",)]),
    # (sharding the normalised dim fails with a clear error: the decomposition's mean is Partial and
    # it adds eps IN PLACE; see the report on in-place ops over Partial tensors)
    ("rms_norm", [(F_, (2, 6, 5)), (F_, (5,))], [("S1",), ("R",)], [("S0",), ("R",)]),
    ("fused_rms_norm", [(C_, (2, 6, 5)), (C_, (5,))], [("S1",), ("R",)], [("S0",), ("R",)], [("Psum",), ("R",)]),
]

_PARAMS = [(name, inputs, scheme) for name, inputs, *schemes in _CASES for scheme in schemes]


def _check_many(items, mesh_shape):
    failures = []
    for name, inputs, scheme in items:
        try:
            _check_fn(name, inputs, scheme, mesh_shape)
        except Exception as e:  # collect: one call covers many cases
            failures.append(f"{name} {scheme}: {type(e).__name__}: {str(e)[:500]}")
    return failures


@pytest.mark.parametrize("world", [2, 4])
def test_rules_match_single_process(world):
    """embedding, sdpa, losses, rms_norm: every placement scheme, forward and backward, on 2 and
    4 ranks (4 makes most shapes uneven, with empty shards)."""
    results = run_distributed(_check_many, world, _PARAMS, (world,), timeout=300)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


_PARAMS_2X2 = [
    # embedding: vocab x dim; batch (dp) x vocab (tp); vocab split over both mesh dims
    ("embedding", [(F_, (7, 5)), (("i", 7), (3, 4))], (("S0", "S1"), ("R", "R"))),
    ("embedding", [(F_, (7, 5)), (("i", 7), (3, 4))], (("R", "S0"), ("S0", "R"))),
    ("embedding", [(F_, (7, 5)), (("i", 7), (3, 4))], (("S0", "S0"), ("R", "R"))),
    ("embedding_pad_freq", [(F_, (7, 5)), (("i", 7), (3, 4))], (("R", "S0"), ("S0", "R"))),
    ("sdpa_causal", _QKV, (("S0", "S1"),) * 3),
    ("sdpa", _QKV, (("S1", "S2"), ("S1", "R"), ("S1", "R"))),
    # dp x tp cross-entropy; 'mean' over a batch-sharded dim is exact here (global weight)
    ("ce", [(F_, (6, 7)), (("i", 7), (6,))], (("S0", "S1"), ("S0", "R"))),
    ("ce_loss_parallel", [(F_, (6, 7)), (("i", 7), (6,))], (("S0", "S1"), ("S0", "R"))),
    ("ce_weight_ignore", [(F_, (6, 7)), (("i", 7), (6,)), (P_, (7,))], (("S1", "S1"), ("R", "R"), ("R", "S0"))),
    ("nll_2d", [(F_, (2, 5, 3, 3)), (("i", 5), (2, 3, 3))], (("S0", "S1"), ("S0", "R"))),
    ("smooth_l1", [(F_, (7, 3)), (F_, (7, 3))], (("S0", "S1"), ("S0", "S1"))),
    ("bce", [(F_, (7, 3)), (P_, (7, 3))], (("S1", "S0"), ("R", "S0"))),
]


def test_rules_on_2x2_mesh():
    results = run_distributed(_check_many, 4, _PARAMS_2X2, (2, 2), timeout=300)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# placements and traffic of the new rules; ops called directly
# ---------------------------------------------------------------------------------------------


def _embedding_layouts():
    m = mesh((2,))
    g = torch.Generator().manual_seed(6)  # the same tensors on every rank
    W, ids = torch.randn(9, 4, generator=g), torch.randint(0, 9, (2, 5), generator=g)
    out = {}
    for name, wp in (("rowwise", Shard(0)), ("colwise", Shard(1))):
        w = dtshard.distribute_tensor(W, m, [wp]).requires_grad_()
        i = dtshard.distribute_tensor(ids, m, [Replicate()])
        with CommCounter() as comm:
            y = F.embedding(i, w)
        # rowwise: a replicated output gradient (as after the Partial -> Replicate reduce);
        # colwise: one sharded like the output
        g = dtshard.distribute_tensor(torch.ones(2, 5, 4), m, [Replicate() if name == "rowwise" else Shard(2)])
        y.backward(g)
        ref = W.clone().requires_grad_()
        F.embedding(ids, ref).backward(torch.ones(2, 5, 4))
        torch.testing.assert_close(y.full_tensor(), F.embedding(ids, W))
        torch.testing.assert_close(w.grad.full_tensor(), ref.grad)
        out[name] = (str(y.placements), str(w.grad.placements), comm.count())
    return out


def test_embedding_rowwise_is_partial_and_grad_stays_sharded():
    for out in run_distributed(_embedding_layouts, 2):
        assert out["rowwise"] == ("(Partial(sum),)", "(Shard(dim=0),)", 0)
        assert out["colwise"] == ("(Shard(dim=2),)", "(Shard(dim=1),)", 0)


def _embedding_max_norm():
    """``F.embedding(..., max_norm=...)`` renormalises the rows the batch names, in place, before
    the lookup: every weight layout (rows of 7 uneven over 2 ranks, columns, replicated) with the
    ids replicated or batch-sharded, norms 2 and 1, against one process: the weight after it, the
    output, the weight's gradient."""
    m = mesh((2,))
    g = torch.Generator().manual_seed(8)
    W = torch.randn(7, 4, generator=g) * 2  # most rows' norms above max_norm
    ids = torch.tensor([[1, 5, 5, 0], [6, 1, 3, 3]])  # rows 2 and 4 never named
    failures = []
    for wp in (Shard(0), Shard(1), Replicate()):
        for ip in (Replicate(), Shard(0)):
            for norm_type in (2.0, 1.0):
                ref = W.clone().requires_grad_()
                want = F.embedding(ids, ref, max_norm=1.5, norm_type=norm_type)
                want.sum().backward()
                w = dtshard.distribute_tensor(W, m, [wp]).requires_grad_()
                i = dtshard.distribute_tensor(ids, m, [ip])
                y = F.embedding(i, w, max_norm=1.5, norm_type=norm_type)
                y.sum().backward()
                what = f"weight {wp}, ids {ip}, norm {norm_type}"
                if w.placements != (wp,):
                    failures.append(f"{what}: the weight became {w.placements}")
                for name, got, exp in (("weight", w.detach().full_tensor(), ref.detach()),
                                       ("output", y.full_tensor(), want.detach()),
                                       ("grad", w.grad.full_tensor(), ref.grad)):
                    if not torch.allclose(got, exp, rtol=1e-6, atol=1e-6):
                        failures.append(f"{what}: {name} differs by {(got - exp).abs().max().item():.3g}")
    return failures


def test_embedding_max_norm_renormalises_the_named_rows_in_every_layout():
    for rank, failures in enumerate(run_distributed(_embedding_max_norm, 2)):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def _sdpa_heads_no_comm():
    m = mesh((2,))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 5, 8, generator=g) for _ in range(3))
    dq, dk, dv = (dtshard.distribute_tensor(t, m, [Shard(1)]).requires_grad_() for t in (q, k, v))
    grad = dtshard.distribute_tensor(torch.ones(2, 4, 5, 8), m, [Shard(1)])
    with CommCounter() as comm:
        o = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
        o.backward(grad)
    return str(o.placements), str(dq.grad.placements), comm.count()


def test_sdpa_with_heads_sharded_needs_no_communication():
    for o, g, n in run_distributed(_sdpa_heads_no_comm, 2):
        assert o == g == "(Shard(dim=1),)" and n == 0


def _sdpa_gqa_heads(world, cases):
    """Grouped-query attention with q, k, v sharded on the heads: where every rank's query heads
    are the groups of its own k/v heads the op runs with no communication and keeps the heads
    sharded; where they do not line up (the kernel would accept the local shapes and compute the
    wrong groups), the planner must take another plan. Values and gradients against one process."""
    m = mesh((world,))
    out = []
    for hq, hkv in cases:
        g = torch.Generator().manual_seed(hq * 10 + hkv)
        q = torch.randn(2, hq, 5, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(2, hkv, 5, 8, generator=g, dtype=torch.float64) for _ in range(2))
        go = torch.randn(2, hq, 5, 8, generator=g, dtype=torch.float64)
        plain = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*plain, is_causal=True, enable_gqa=True).backward(go)
        dq, dk, dv = (dtshard.distribute_tensor(t, m, [Shard(1)]).requires_grad_() for t in (q, k, v))
        with CommCounter() as comm:
            o = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True, enable_gqa=True)
        dgo = dtshard.distribute_tensor(go, m, o.placements, src_data_rank=None)
        with CommCounter() as comm_bwd:
            o.backward(dgo)
        torch.testing.assert_close(o.full_tensor(), F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                   enable_gqa=True))
        for d, p in zip((dq, dk, dv), plain):
            torch.testing.assert_close(d.grad.full_tensor(), p.grad)
        out.append((hq, hkv, str(o.placements), comm.count() + comm_bwd.count()))
    return out


def test_gqa_attention_keeps_heads_sharded_where_they_line_up():
    # 2 ranks: 4 over 2 heads line up (2 query heads on each k/v head); 12 over 3 do not (query
    # heads 6 + 6, k/v heads 2 + 1: rank 0's 6 query heads would be read as 3 groups of 2)
    for rank_out in run_distributed(_sdpa_gqa_heads, 2, 2, [(4, 2), (12, 3)]):
        (_, _, aligned, n_aligned), (_, _, misaligned, n_misaligned) = rank_out
        assert aligned == "(Shard(dim=1),)" and n_aligned == 0, rank_out
        assert n_misaligned > 0, rank_out
    # 4 ranks: 8 over 4 line up; 4 over 2 do not (k/v heads 1, 1, 0, 0)
    for rank_out in run_distributed(_sdpa_gqa_heads, 4, 4, [(8, 4), (4, 2)]):
        (_, _, aligned, n_aligned), (_, _, _, n_misaligned) = rank_out
        assert aligned == "(Shard(dim=1),)" and n_aligned == 0, rank_out
        assert n_misaligned > 0, rank_out


def _sdpa_backward_partial_grad(world):
    """The backward is linear in grad_out: a Partial grad_out gives Partial gradients."""
    m = mesh((world,))
    g = torch.Generator().manual_seed(1)
    q, k, v, go = (torch.randn(2, 3, 5, 4, generator=g) for _ in range(4))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    want = aten._scaled_dot_product_flash_attention_for_cpu_backward(go, q, k, v, out, lse, 0.0, True)
    R = [Replicate()]
    dgo = make_dtensor(go, m, [Partial()])
    args = [dtshard.distribute_tensor(t, m, R) for t in (q, k, v, out, lse)]
    with CommCounter() as comm:
        got = aten._scaled_dot_product_flash_attention_for_cpu_backward(dgo, *args, 0.0, True)
    for a, b in zip(got, want):
        assert a.placements == (Partial(),)
        torch.testing.assert_close(a.full_tensor(), b)
    return comm.count()


def test_sdpa_backward_passes_partial_grad_through():
    assert run_distributed(_sdpa_backward_partial_grad, 4, 4) == [0] * 4


def _fused_rms_norm_backward(world):
    """_fused_rms_norm_backward has no CPU kernel in torch 2.13: give it a reference one for this
    check of the rule (dtshard only plans; the values come from the kernel)."""
    lib = torch.library.Library("aten", "IMPL")

    def ref_backward(grad, x, normalized_shape, rstd, weight, output_mask):
        dims = list(range(x.dim() - len(normalized_shape), x.dim()))
        xhat = x * rstd
        gw = grad * weight if weight is not None else grad
        n = 1
        for d in normalized_shape:
            n *= d
        gx = rstd * (gw - xhat * (gw * xhat).sum(dims, keepdim=True) / n)
        gwt = (grad * xhat).sum(list(range(x.dim() - len(normalized_shape)))) if weight is not None else None
        return gx, gwt

    lib.impl("_fused_rms_norm_backward", ref_backward, "CPU")
    try:
        m = mesh((world,))
        g = torch.Generator().manual_seed(2)
        x, w, go = torch.randn(2, 6, 5, generator=g), torch.randn(5, generator=g), torch.randn(2, 6, 5, generator=g)
        _, rstd = aten._fused_rms_norm(x, [5], w, 1e-6)
        want = ref_backward(go, x, [5], rstd, w, [True, True])
        out = []
        for scheme in (("S1", "S1", "S1", "R"), ("S0", "S0", "S0", "R"), ("Psum", "R", "R", "R")):
            ts = [make_dtensor(t, m, Ps([p])) for t, p in zip((go, x, rstd, w), scheme)]
            got = aten._fused_rms_norm_backward(ts[0], ts[1], [5], ts[2], ts[3], [True, True])
            for a, b in zip(got, want):
                torch.testing.assert_close(a.full_tensor(), b)
            out.append(tuple(str(a.placements) for a in got))
        return out
    finally:
        lib._destroy()


def test_fused_rms_norm_backward_rule():
    for out in run_distributed(_fused_rms_norm_backward, 4, 4):
        assert out[0] == ("(Shard(dim=1),)", "(Partial(sum),)")
        assert out[2] == ("(Partial(sum),)", "(Partial(sum),)")


def _target_out_of_bounds():
    m = mesh((2,))
    x = dtshard.distribute_tensor(torch.randn(4, 5), m, [Shard(1)])
    t = dtshard.distribute_tensor(torch.tensor([0, 5, 1, 2]), m, [Replicate()])
    try:
        F.cross_entropy(x, t)
    except IndexError as e:
        return str(e)
    return "no error"


def test_out_of_bounds_target_raises_on_every_rank():
    for msg in run_distributed(_target_out_of_bounds, 2):
        assert "Target 5 is out of bounds" in msg


# ---------------------------------------------------------------------------------------------
# loss_parallel
# ---------------------------------------------------------------------------------------------


def _loss_parallel(world):
    m = mesh((world,))
    g = torch.Generator().manual_seed(3)
    results = []
    for shape, reduction, dtype in (((2, 5, 11), "mean", torch.float32), ((6, 10), "sum", torch.float32),
                                    ((6, 10), "none", torch.float32), ((6, 10), "mean", torch.bfloat16)):
        logits = torch.randn(shape, generator=g).to(dtype)
        target = torch.randint(0, shape[-1], shape[:-1], generator=g)
        target.view(-1)[1] = -100  # ignored
        ref = logits.clone().requires_grad_()
        want = F.cross_entropy(ref.flatten(0, -2), target.flatten(), reduction=reduction)
        want.backward(torch.ones_like(want))
        x = dtshard.distribute_tensor(logits, m, [Shard(-1)]).requires_grad_()
        with CommCounter() as comm, dtshard.parallel.loss_parallel():
            loss = F.cross_entropy(x.flatten(0, -2), target.flatten(), reduction=reduction)  # plain target
            loss.backward(torch.ones_like(loss))
        # bf16: the log-probabilities are rounded to bf16 (an ulp is 1.6e-2 near -3), so the gradient
        # exp(logp) - onehot can differ by a few bf16 ulps of the probabilities
        tol = {} if dtype == torch.float32 else dict(atol=1e-3, rtol=2e-2)
        torch.testing.assert_close(loss.full_tensor(), want, **tol)
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad, **tol)
        assert x.grad.placements == (Shard(len(shape) - 1),) and x.grad.dtype == dtype
        results.append(sorted(set(comm.kinds())))
    # outside the context a plain target is refused, as for any other op
    try:
        F.cross_entropy(x.flatten(0, -2), target.flatten())
    except RuntimeError as e:
        results.append("plain torch.Tensor" in str(e))
    # label smoothing (which PyTorch's loss_parallel does not support): exact with the target and
    # the class weights as DTensors, every reduction, an ignored target, the logits never gathered
    logits = torch.randn(6, 10, generator=g, dtype=torch.float64)
    weight = torch.rand(10, generator=g, dtype=torch.float64) + 0.5
    dt_target = dtshard.distribute_tensor(target.flatten()[:6], m, [Replicate()])
    dt_weight = dtshard.distribute_tensor(weight, m, [Replicate()])
    kinds = set()
    for reduction, w in (("mean", None), ("mean", weight), ("sum", weight), ("none", None)):
        kw = dict(reduction=reduction, label_smoothing=0.1)
        ref = logits.clone().requires_grad_()
        want = F.cross_entropy(ref, target.flatten()[:6], weight=w, **kw)
        want.backward(torch.ones_like(want))
        x = dtshard.distribute_tensor(logits, m, [Shard(1)]).requires_grad_()
        with CommCounter() as comm, dtshard.parallel.loss_parallel():
            loss = F.cross_entropy(x, dt_target, weight=None if w is None else dt_weight, **kw)
            loss.backward(torch.ones_like(loss))
        torch.testing.assert_close(loss.full_tensor(), want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(x.grad.full_tensor(), ref.grad, rtol=1e-12, atol=1e-12)
        assert x.grad.placements == (Shard(1),)
        kinds |= set(comm.kinds())
    results.append(sorted(kinds))
    # with a plain target, the smoothing term's ops refuse it and the error says what to do
    try:
        with dtshard.parallel.loss_parallel():
            F.cross_entropy(x, target.flatten()[:6], label_smoothing=0.1)
        results.append("no error")
    except RuntimeError as e:
        results.append("label_smoothing > 0" in str(e) and "distribute_tensor(target" in str(e))
    return results


def test_loss_parallel_cross_entropy_never_gathers_the_logits():
    """(2, 5, 11) over 4 ranks: 3 classes per rank, the last one 2; only all_reduces move (the row
    max, the row sum of exponentials, the row sum of the gradient)."""
    for world in (2, 4):
        for res in run_distributed(_loss_parallel, world, world):
            assert res[:4] == [["all_reduce"]] * 4, res
            assert res[4] is True
            assert res[5] == ["all_reduce"], res  # label smoothing: no gather either
            assert res[6] is True, res


# ---------------------------------------------------------------------------------------------
# parallel styles: the same code with torch.distributed.tensor.parallel and dtshard.parallel
# ---------------------------------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.norm = nn.LayerNorm(8)
        self.up = nn.Linear(8, 12)
        self.down = nn.Linear(12, 8)
        self.head = nn.Linear(8, 10, bias=False)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + self.down(F.relu(self.up(self.norm(h))))
        return self.head(h)


def _net_plan(tp, emb_style):
    """A plan written once against the module ``tp`` (PyTorch's or dtshard's)."""
    return {
        "emb": getattr(tp, emb_style)(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": tp.SequenceParallel(),
        "up": tp.ColwiseParallel(input_layouts=Shard(1)),
        "down": tp.RowwiseParallel(output_layouts=Shard(1)),
        "head": tp.ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def _run_net(tp, m, ids, labels, emb_style):
    torch.manual_seed(0)
    net = _Net()
    net = tp.parallelize_module(net, m, _net_plan(tp, emb_style))
    with tp.loss_parallel():
        logits = net(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        loss.backward()
    grads = {n: p.grad.full_tensor() for n, p in net.named_parameters()}
    return loss.full_tensor(), logits.full_tensor(), grads, type(logits).__module__


def _same_code_both_imports(world):
    import torch.distributed.tensor.parallel as torch_tp

    m = mesh((world,))
    g = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 10, (2, 4), generator=g)
    labels = torch.randint(0, 10, (2, 4), generator=g)
    torch.manual_seed(0)
    ref = _Net()
    ref_logits = ref(ids)
    ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), labels.flatten())
    ref_loss.backward()
    out = []
    for emb_style in ("RowwiseParallel", "ColwiseParallel"):
        t_loss, t_logits, t_grads, t_mod = _run_net(torch_tp, m, ids, labels, emb_style)
        d_loss, d_logits, d_grads, d_mod = _run_net(dtshard.parallel, m, ids, labels, emb_style)
        assert t_mod.startswith("torch.distributed.tensor") and d_mod == "dtshard.tensor", (t_mod, d_mod)
        for a in (t_loss, d_loss):
            torch.testing.assert_close(a, ref_loss)
        for a in (t_logits, d_logits):
            torch.testing.assert_close(a, ref_logits)
        for n, p in ref.named_parameters():
            torch.testing.assert_close(d_grads[n], p.grad, msg=lambda s: f"{emb_style} {n}: {s}")
            torch.testing.assert_close(t_grads[n], p.grad, msg=lambda s: f"torch {emb_style} {n}: {s}")
        out.append((emb_style, (d_loss - t_loss).abs().item()))
    return out


def test_same_plan_code_runs_on_torch_and_dtshard():
    """The plan (embedding row- or column-wise, SequenceParallel LayerNorm, Colwise -> Rowwise MLP,
    Colwise LM head with loss_parallel) written once, applied with each package's
    parallelize_module: same loss, logits and gradients as each other and as one process."""
    for res in run_distributed(_same_code_both_imports, 2, 2):
        assert [r[0] for r in res] == ["RowwiseParallel", "ColwiseParallel"]


def _styles_match_torch(world):
    """Each style alone, torch vs dtshard: output type (local or DTensor), placements, values."""
    import torch.distributed.tensor.parallel as torch_tp

    m = mesh((world,))
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 4, 8, generator=g)
    seq_local = x.chunk(world, dim=1)[m.get_coordinate()[0]]

    def cases(tp):
        return [
            ("colwise", lambda: nn.Linear(8, 6), tp.ColwiseParallel(), x),
            ("colwise_dt", lambda: nn.Linear(8, 6), tp.ColwiseParallel(use_local_output=False), x),
            ("colwise_out_R", lambda: nn.Linear(8, 6), tp.ColwiseParallel(output_layouts=Replicate()), x),
            ("rowwise_in_S1", lambda: nn.Linear(8, 6), tp.RowwiseParallel(input_layouts=Shard(1),
                                                                         use_local_output=False), seq_local),
            ("seq_norm", lambda: nn.LayerNorm(8), tp.SequenceParallel(), seq_local),
            ("seq_norm_local", lambda: nn.RMSNorm(8), tp.SequenceParallel(use_local_output=True), seq_local),
            ("prep_in", lambda: nn.Identity(), tp.PrepareModuleInput(input_layouts=Shard(1),
                                                                     desired_input_layouts=Replicate()), seq_local),
            ("prep_out", lambda: nn.Identity(), tp.PrepareModuleOutput(output_layouts=Shard(1),
                                                                       desired_output_layouts=Replicate()), seq_local),
            ("prep_in_out", lambda: nn.Identity(), tp.PrepareModuleInputOutput(
                input_layouts=Shard(1), desired_input_layouts=Replicate(), output_layouts=Replicate(),
                desired_output_layouts=Shard(0), use_local_output=False), seq_local),
        ]

    res = {}
    for tp in (torch_tp, dtshard.parallel):
        for name, make, style, inp in cases(tp):
            torch.manual_seed(0)
            mod = tp.parallelize_module(make(), m, style)
            y = mod(inp.clone())
            is_dt = hasattr(y, "placements")
            res.setdefault(name, []).append((is_dt, tuple(map(str, y.placements)) if is_dt else None,
                                             y.full_tensor() if is_dt else y))
    for name, ((a_dt, a_pl, a_val), (b_dt, b_pl, b_val)) in res.items():
        assert (a_dt, a_pl) == (b_dt, b_pl), f"{name}: torch {a_dt, a_pl} vs dtshard {b_dt, b_pl}"
        torch.testing.assert_close(b_val, a_val, msg=lambda s: f"{name}: {s}")
    return sorted(res)


def test_each_style_matches_torch():
    assert all(run_distributed(_styles_match_torch, 2, 2))


def _plan_paths_and_errors():
    import torch.distributed.tensor.parallel as torch_tp

    m = mesh((2,))
    net = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Sequential(nn.Linear(4, 4)))
    tp = dtshard.parallel
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tp.parallelize_module(net, m, {"*.0": tp.ColwiseParallel(), "nothere": tp.ColwiseParallel()})
    placements = [str(net[0][0].weight.placements), str(net[1][0].weight.placements)]
    untouched = type(net[0][1].weight).__name__
    msgs = [str(x.message) for x in w]
    try:
        tp.parallelize_module(nn.Linear(2, 2), m, {"": torch_tp.ColwiseParallel()})
    except TypeError as e:
        err = str(e)
    else:
        err = "no error"
    try:
        tp.parallelize_module(nn.Conv1d(2, 2, 1), m, tp.ColwiseParallel())
    except NotImplementedError as e:
        err2 = str(e)
    else:
        err2 = "no error"
    return placements, untouched, msgs, err, err2


def test_plan_paths_warnings_and_errors():
    for placements, untouched, msgs, err, err2 in run_distributed(_plan_paths_and_errors, 2):
        assert placements == ["(Shard(dim=0),)"] * 2 and untouched == "Parameter"
        assert any("'nothere' could not be resolved" in x for x in msgs)
        assert "dtshard.parallel" in err
        assert "only support nn.Linear and nn.Embedding" in err2


# ---------------------------------------------------------------------------------------------
# Partial gradients of leaf DTensors are reduced once, after accumulation
# ---------------------------------------------------------------------------------------------


def _settled_grads(settle: bool):
    from dtshard.propagate import config

    old = config.settle_partial_grads
    config.settle_partial_grads = settle
    try:
        m = mesh((torch.distributed.get_world_size(),))
        torch.manual_seed(0)
        full_w, full_v, full_x = torch.randn(6, 4), torch.randn(4, 5), torch.randn(8, 6)
        # w replicated, v column-sharded; x batch-sharded: both gradients come out Partial(sum)
        w = nn.Parameter(dtshard.distribute_tensor(full_w, m, [Replicate()]))
        v = nn.Parameter(dtshard.distribute_tensor(full_v, m, [Shard(1)]))
        x = dtshard.distribute_tensor(full_x, m, [Shard(0)])
        opt = torch.optim.SGD([w, v], lr=0.1, momentum=0.9)
        for _ in range(2):  # the second backward accumulates into existing gradients
            ((x @ w) @ v.redistribute(m, [Replicate()])).sum().backward()
        with CommCounter() as cc:
            opt.step()
        ref_w = full_w.clone().requires_grad_()
        ref_v = full_v.clone().requires_grad_()
        for _ in range(2):
            ((full_x @ ref_w) @ ref_v).sum().backward()
        return {
            "w_grad": tuple(w.grad.placements), "v_grad": tuple(v.grad.placements),
            "w_ok": torch.allclose(w.grad.full_tensor(), ref_w.grad, atol=1e-5),
            "v_ok": torch.allclose(v.grad.full_tensor(), ref_v.grad, atol=1e-5),
            "optimizer_collectives": len(cc.kinds()),
        }
    finally:
        config.settle_partial_grads = old


@pytest.mark.parametrize("world", [2, 3])
def test_partial_gradients_are_reduced_once_after_accumulation(world):
    for r in run_distributed(_settled_grads, world, True):
        assert r["w_grad"] == (Replicate(),) and r["v_grad"] == (Shard(1),), r
        assert r["w_ok"] and r["v_ok"], r
        assert r["optimizer_collectives"] == 0, r  # the optimizer reads settled gradients
    for r in run_distributed(_settled_grads, world, False):  # switched off: Partial stays
        assert r["w_ok"] and r["v_ok"], r
        assert r["optimizer_collectives"] > 0, r
