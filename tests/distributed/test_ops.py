"""Ops on DTensors against single-process PyTorch: values on every rank, placements, backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import dtshard
from dtshard import Partial, Replicate, Shard
from dtshard.debug import CommCounter
from dtshard.testing import run_distributed

from _cases import Ps, global_tensor, make_dtensor, mesh

# ---------------------------------------------------------------------------------------------
# a generic checker: run `fn` on plain tensors and on DTensors with given placements
# ---------------------------------------------------------------------------------------------


def _check_fn(fn_name, shapes, placements, mesh_shape, grad=True, seed=0):
    """Compare FN(*tensors) (plain) with FN(*dtensors): every output's full_tensor, its local
    shape against its placements, and the gradients of every input."""
    fn = _FNS[fn_name]
    m = mesh(mesh_shape)
    fulls = [global_tensor(s, seed + k).float() / 4 for k, s in enumerate(shapes)]
    plain = [f.clone().requires_grad_(grad) for f in fulls]
    dts = [make_dtensor(f, m, Ps(p)).detach().requires_grad_(grad) for f, p in zip(fulls, placements)]
    ref = fn(*plain)
    out = fn(*dts)
    refs = ref if isinstance(ref, (tuple, list)) else [ref]
    outs = out if isinstance(out, (tuple, list)) else [out]
    coord = m.get_coordinate()
    for r, o in zip(refs, outs):
        assert isinstance(o, dtshard.DTensor), f"{fn_name}: output is {type(o)}"
        assert tuple(o.to_local().shape) == o._spec.local_shape(coord), (
            f"{fn_name}: local shape {tuple(o.to_local().shape)} does not match placements "
            f"{o.placements} of global {tuple(o.shape)}"
        )
        torch.testing.assert_close(o.full_tensor(), r, msg=lambda s: f"{fn_name} {placements}: {s}")
    if grad:
        w = [torch.randn(r.shape, generator=torch.Generator().manual_seed(99)) for r in refs]
        sum((r * wi).sum() for r, wi in zip(refs, w)).backward()
        total = None
        for o, wi in zip(outs, w):
            wd = dtshard.distribute_tensor(wi, m, [Replicate()] * m.ndim, src_data_rank=None)
            term = (o * wd).sum()
            total = term if total is None else total + term
        total.backward()
        for k, (p, d) in enumerate(zip(plain, dts)):
            if p.grad is None:
                assert d.grad is None or torch.count_nonzero(d.grad.full_tensor()) == 0
                continue
            assert d.grad is not None, f"{fn_name}: no gradient for input {k}"
            torch.testing.assert_close(d.grad.full_tensor(), p.grad, msg=lambda s: f"{fn_name} grad{k}: {s}")
    return [tuple(map(str, o.placements)) for o in outs]


def _mlp(x, w1, b1, w2, b2):
    return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)


def _attention(x, wq, wk, wv, wo):
    b, s, d = x.shape
    h = 2
    q = F.linear(x, wq).view(b, s, h, d // h).transpose(1, 2)
    k = F.linear(x, wk).view(b, s, h, d // h).transpose(1, 2)
    v = F.linear(x, wv).view(b, s, h, d // h).transpose(1, 2)
    att = torch.softmax(q @ k.transpose(-2, -1) / (d // h) ** 0.5, dim=-1)
    o = (att @ v).transpose(1, 2).reshape(b, s, d)
    return F.linear(o, wo)


_FNS = {
    "add": lambda a, b: a + b,
    "mul_bcast": lambda a, b: a * b,
    "sub_scalar": lambda a: 2.0 - a * 3,
    "relu_tanh": lambda a: torch.tanh(torch.relu(a)) + F.silu(a),
    "where": lambda a, b: torch.where(a > 0, a, b),
    "mm": lambda a, b: a @ b,
    "bmm": lambda a, b: torch.bmm(a, b),
    "addmm": lambda c, a, b: torch.addmm(c, a, b),
    "baddbmm": lambda c, a, b: torch.baddbmm(c, a, b),
    "linear3d": lambda x, w, b: F.linear(x, w, b),
    "sum_all": lambda a: a.sum(),
    "sum_dim": lambda a: a.sum(1),
    "sum_keep": lambda a: a.sum(dim=(0,), keepdim=True),
    "mean_all": lambda a: a.mean(),
    "mean_dim": lambda a: a.mean(dim=0),
    "amax": lambda a: a.amax(dim=1),
    "view_flat": lambda a: a.reshape(-1, a.shape[-1]),
    "view_split": lambda a: a.view(a.shape[0], 2, -1),
    "flatten_all": lambda a: a.flatten(),
    "transpose": lambda a: a.transpose(0, 1).contiguous(),
    "permute": lambda a: a.permute(2, 0, 1),
    "unsqueeze_squeeze": lambda a: a.unsqueeze(1).squeeze(1) * 2,
    "expand": lambda a: a.unsqueeze(0).expand(3, *a.shape) * 1.5,
    "softmax": lambda a: torch.softmax(a, dim=-1),
    "log_softmax": lambda a: torch.log_softmax(a, dim=0),
    "layer_norm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b),
    "mse": lambda a, b: F.mse_loss(a, b),
    "mse_sum": lambda a, b: F.mse_loss(a, b, reduction="sum"),
    "mlp": _mlp,
    "attention": _attention,
    # every output of split is used: autograd fills unused ones with plain zeros (see README limits)
    "split_cat": lambda a: torch.cat([t * (k + 1) for k, t in enumerate(a.split(2, dim=1))], dim=1),
    "stack_unbind": lambda a: torch.stack([t * (k + 1) for k, t in enumerate(a.unbind(0))], dim=1),
    "select": lambda a: a.select(1, 0) + a[:, 1],
    "clone_detach": lambda a: a.clone() + a.detach(),
    "whole_slice": lambda a: a[:, : a.shape[1] + 3] * 2 + a[-a.shape[0]:, 0:],
}

# (fn, shapes, placement schemes...) run on a 1-D mesh of each world size
_CASES = [
    ("add", [(6, 5), (6, 5)], [("S0",), ("S0",)], [("S1",), ("R",)], [("Psum",), ("Psum",)], [("S0",), ("S1",)]),
    ("mul_bcast", [(6, 5), (5,)], [("S0",), ("R",)], [("S1",), ("S0",)], [("Psum",), ("R",)]),
    ("sub_scalar", [(7, 3)], [("S0",)], [("Psum",)], [("S1",)]),
    ("relu_tanh", [(7, 3)], [("S0",)], [("S1",)]),
    ("where", [(5, 4), (5, 4)], [("S0",), ("S0",)], [("S1",), ("R",)]),
    ("mm", [(6, 4), (4, 5)], [("S0",), ("R",)], [("R",), ("S1",)], [("S1",), ("S0",)], [("S0",), ("S1",)], [("Psum",), ("R",)]),
    ("bmm", [(3, 4, 5), (3, 5, 2)], [("S0",), ("S0",)], [("S2",), ("S1",)], [("S1",), ("R",)]),
    ("addmm", [(5,), (6, 4), (4, 5)], [("R",), ("S0",), ("R",)], [("R",), ("S1",), ("S0",)], [("S0",), ("R",), ("S1",)]),
    ("baddbmm", [(3, 4, 2), (3, 4, 5), (3, 5, 2)], [("R",), ("S0",), ("S0",)], [("R",), ("S2",), ("S1",)]),
    ("linear3d", [(2, 5, 4), (6, 4), (6,)], [("R",), ("S0",), ("S0",)], [("S0",), ("R",), ("R",)], [("S1",), ("R",), ("R",)], [("S2",), ("S1",), ("R",)]),
    ("sum_all", [(7, 3)], [("S0",)], [("S1",)], [("Psum",)]),
    ("sum_dim", [(7, 5)], [("S0",)], [("S1",)]),
    ("sum_keep", [(7, 5)], [("S0",)], [("S1",)]),
    ("mean_all", [(7, 3)], [("S0",)], [("R",)], [("Psum",)]),
    ("mean_dim", [(7, 5)], [("S0",)], [("S1",)]),
    ("amax", [(5, 7)], [("S1",)], [("S0",)]),
    ("view_flat", [(4, 3, 5)], [("S0",)], [("S1",)], [("S2",)]),
    ("view_split", [(5, 8)], [("S0",)], [("S1",)]),
    ("flatten_all", [(5, 3)], [("S0",)], [("S1",)]),
    ("transpose", [(5, 3)], [("S0",)], [("S1",)]),
    ("permute", [(3, 4, 5)], [("S0",)], [("S2",)]),
    ("unsqueeze_squeeze", [(5, 3)], [("S0",)], [("S1",)]),
    ("expand", [(5, 3)], [("S0",)], [("S1",)]),
    ("softmax", [(5, 6)], [("S0",)], [("S1",)]),
    ("log_softmax", [(5, 6)], [("S0",)], [("S1",)]),
    ("layer_norm", [(5, 6), (6,), (6,)], [("S0",), ("R",), ("R",)], [("S1",), ("R",), ("R",)]),
    ("mse", [(7, 3), (7, 3)], [("S0",), ("S0",)], [("S1",), ("R",)]),
    ("mse_sum", [(7, 3), (7, 3)], [("S0",), ("S0",)]),
    ("mlp", [(4, 6), (8, 6), (8,), (6, 8), (6,)], [("R",), ("S0",), ("S0",), ("S1",), ("R",)], [("S0",), ("R",), ("R",), ("R",), ("R",)]),
    ("attention", [(2, 3, 8), (8, 8), (8, 8), (8, 8), (8, 8)], [("R",), ("S0",), ("S0",), ("S0",), ("S1",)], [("S1",), ("R",), ("R",), ("R",), ("R",)]),
    ("split_cat", [(5, 6)], [("S0",)], [("S1",)]),
    ("select", [(5, 6)], [("S0",)], [("S1",)]),
    ("stack_unbind", [(3, 5)], [("S1",)], [("Psum",)]),
    ("clone_detach", [(5, 6)], [("S0",)], [("Psum",)]),
    ("whole_slice", [(5, 7)], [("S0",)], [("S1",)]),
]

_PARAMS = [
    pytest.param(name, shapes, scheme, id=f"{name}-{'-'.join(p for s in scheme for p in s)}")
    for name, shapes, *schemes in _CASES
    for scheme in schemes
]


def _check_many(items, mesh_shape):
    failures = []
    for name, shapes, scheme in items:
        try:
            _check_fn(name, shapes, scheme, mesh_shape)
        except Exception as e:  # collect: one call covers many cases
            failures.append(f"{name} {scheme}: {type(e).__name__}: {str(e)[:400]}")
    return failures


@pytest.mark.parametrize("world", [2, 3])
def test_ops_match_single_process(world):
    """Every case on 2 and 3 ranks (3 makes most shapes uneven): forward, placements, backward."""
    items = [p.values for p in _PARAMS]
    results = run_distributed(_check_many, world, items, (world,), timeout=300)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


def test_ops_on_2x2_mesh():
    items = [
        ("mm", [(6, 4), (4, 6)], (("S0", "S1"), ("R", "R"))),
        ("mm", [(6, 4), (4, 6)], (("S0", "R"), ("R", "S1"))),
        ("mlp", [(4, 6), (8, 6), (8,), (6, 8), (6,)], (("S0", "R"), ("R", "S0"), ("R", "S0"), ("R", "S1"), ("R", "R"))),
        ("sum_dim", [(7, 5)], (("S0", "S1"),)),
        ("softmax", [(5, 6)], (("S0", "S0"),)),
        ("view_flat", [(4, 3, 5)], (("S0", "S1"),)),
        ("add", [(6, 5), (6, 5)], (("S0", "Psum"), ("S0", "Psum"))),
        ("layer_norm", [(5, 6), (6,), (6,)], (("S0", "R"), ("R", "R"), ("R", "R"))),
    ]
    results = run_distributed(_check_many, 4, items, (2, 2), timeout=300)
    for rank, failures in enumerate(results):
        assert not failures, f"rank {rank}:\n" + "\n".join(failures)


# ---------------------------------------------------------------------------------------------
# placements chosen (traffic), in-place, out=, mixing, errors
# ---------------------------------------------------------------------------------------------


def _tp_mlp_traffic():
    m = mesh((2,))
    torch.manual_seed(0)
    x = dtshard.distribute_tensor(torch.randn(4, 8), m, [Replicate()])
    w1 = dtshard.distribute_tensor(torch.randn(16, 8), m, [Shard(0)])
    w2 = dtshard.distribute_tensor(torch.randn(8, 16), m, [Shard(1)])
    with CommCounter() as comm:
        h = F.relu(F.linear(x, w1))
        o = F.linear(h, w2)
    return str(h.placements), str(o.placements), comm.count()


def test_tp_mlp_forward_needs_no_communication():
    """Megatron-style colwise -> rowwise MLP: h is S(1), o is Partial, no collective at all."""
    for h, o, n in run_distributed(_tp_mlp_traffic, 2):
        assert h == "(Shard(dim=1),)" and o == "(Partial(sum),)" and n == 0


def _whole_slice_traffic():
    m = mesh((2,))
    x = dtshard.distribute_tensor(torch.arange(15.0).view(3, 5), m, [Shard(1)])
    with CommCounter() as comm:
        y = x[:, :5]  # the whole dim (models trim a cache or a mask to the length it has)
        z = x[:, -5:]
    return str(y.placements), str(z.placements), comm.count(), torch.equal(y.full_tensor(), z.full_tensor())


def test_whole_slice_keeps_the_shard():
    """Slicing a sharded dim whole is the identity: the shard stays, nothing moves (it used to
    move the shard to another dim and back: two all_to_alls per use)."""
    for y, z, n, same in run_distributed(_whole_slice_traffic, 2):
        assert y == z == "(Shard(dim=1),)" and n == 0 and same


def _inplace_and_out():
    m = mesh((2,))
    a = dtshard.distribute_tensor(torch.arange(12.0).view(4, 3), m, [Shard(0)])
    b = dtshard.distribute_tensor(torch.ones(4, 3), m, [Replicate()])
    a.add_(b)  # keeps a's placement, b is sliced locally
    assert a.placements == (Shard(0),)
    torch.testing.assert_close(a.full_tensor(), torch.arange(12.0).view(4, 3) + 1)
    out = dtshard.distribute_tensor(torch.zeros(4, 3), m, [Shard(0)])
    torch.mul(a, 2, out=out)
    torch.testing.assert_close(out.full_tensor(), (torch.arange(12.0).view(4, 3) + 1) * 2)
    c = dtshard.distribute_tensor(torch.ones(4, 3), m, [Replicate()])
    try:
        c.add_(a)  # c is Replicate; a is Shard(0): would need c to change placement? No: a is gathered
    except Exception as e:
        return f"unexpected: {e}"
    torch.testing.assert_close(c.full_tensor(), torch.arange(12.0).view(4, 3) + 2)
    p = dtshard.DTensor.from_local(torch.ones(2, 3), m, [Partial()])
    try:
        p.relu_()
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_inplace_keeps_placement_and_out_variant():
    for msg in run_distributed(_inplace_and_out, 2):
        assert "in-place op would change the placement" in msg and "aten.relu_.default" in msg, msg


def _mixing_error():
    m = mesh((2,))
    a = dtshard.distribute_tensor(torch.ones(4, 3), m, [Shard(0)])
    ok = (a + torch.tensor(2.0)).full_tensor()  # 0-d plain tensors broadcast
    assert torch.equal(ok, torch.full((4, 3), 3.0))
    try:
        a + torch.ones(4, 3)
    except RuntimeError as e:
        return str(e)
    return "no error"


def test_mixing_plain_tensor_error_says_how_to_convert():
    for msg in run_distributed(_mixing_error, 2):
        assert "plain torch.Tensor of shape (4, 3)" in msg and "distribute_tensor" in msg and "from_local" in msg


def _missing_rule():
    m = mesh((2,))
    full = torch.randn(4, 3, generator=torch.Generator().manual_seed(0))  # the same on every rank
    a = dtshard.distribute_tensor(full, m, [Shard(0)])
    try:
        torch.ops.aten.unfold_copy(a, 1, 2, 1)  # an op without a rule
    except NotImplementedError as e:
        msg = str(e)
    else:
        return "no error", None
    import warnings

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        with dtshard.replicate_fallback():
            r1 = torch.ops.aten.unfold_copy(a, 1, 2, 1)
            r2 = torch.ops.aten.unfold_copy(a, 1, 2, 1)
    # against plain PyTorch on the global tensor (not dtshard's own full_tensor of the input)
    torch.testing.assert_close(r1.full_tensor(), full.unfold(1, 2, 1), rtol=0, atol=0)
    assert r2.placements == (Replicate(),)
    return msg, sum("no sharding rule for aten.unfold_copy.default" in str(x.message) for x in w)


def test_missing_rule_error_and_fallback_warns_once():
    for msg, n_warnings in run_distributed(_missing_rule, 2):
        assert "aten.unfold_copy.default" in msg and "(4, 3) (S(0))" in msg and "mesh (2,)" in msg
        assert "dtshard/rules/" in msg and "replicate_fallback" in msg
        assert n_warnings == 1


def _uneven_view_fallback():
    """(5, 4) sharded on 2 ranks -> view (10, 2): the split of dim 0 cannot keep Shard(0)."""
    m = mesh((2,))
    full = torch.arange(20.0).view(5, 4)
    a = dtshard.distribute_tensor(full, m, [Shard(1)])
    v = a.view(10, 2)
    torch.testing.assert_close(v.full_tensor(), full.view(10, 2))
    b = dtshard.distribute_tensor(full, m, [Shard(0)])
    w = b.view(20)
    assert tuple(w.to_local().shape) == w._spec.local_shape(m.get_coordinate())
    torch.testing.assert_close(w.full_tensor(), full.view(20))
    return str(v.placements), str(w.placements)


def test_uneven_views_are_never_mislabelled():
    for v, w in run_distributed(_uneven_view_fallback, 2):
        # (5,4) S(0) on 2 ranks holds rows 3+2: flattening gives 12+8, not the chunk layout 10+10;
        # so the view moves the data first (to Replicate, or to S(1), whose view is a strided
        # shard), and the worker checks values and local shapes of whatever it chose
        assert w in ("(Replicate(),)", "(Shard(dim=0),)", "(_StridedShard(dim=0, sf=5),)")


def _interop():
    from torch.distributed.tensor import DTensor as TorchDTensor
    from torch.distributed.tensor import distribute_tensor as torch_distribute

    m = mesh((2,))
    full = torch.arange(15.0).view(5, 3)
    t = torch_distribute(full, m, [Shard(0)])
    d = dtshard.DTensor.from_torch(t)
    assert torch.equal(d.to_local(), t.to_local())  # same local shard: no data moved
    assert d.placements == t.placements and d.shape == t.shape
    back = (d * 2).to_torch()
    assert isinstance(back, TorchDTensor)
    torch.testing.assert_close(back.full_tensor(), full * 2)
    return True


def test_interop_with_torch_dtensor():
    assert all(run_distributed(_interop, 2))


def _distribute_module():
    m = mesh((2,))
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    ref.load_state_dict(net.state_dict())

    def shard_first(name, mod, mesh_):
        if name == "0":
            mod.weight = torch.nn.Parameter(dtshard.distribute_tensor(mod.weight.data, mesh_, [Shard(0)]))

    dtshard.distribute_module(net, m, shard_first,
                              input_fn=lambda mod, inp, mesh_: tuple(
                                  dtshard.distribute_tensor(i, mesh_, [Replicate()]) for i in inp))
    x = torch.randn(3, 4)
    out = net(x)
    out.full_tensor().sum().backward()
    ref(x).sum().backward()
    assert net[0].weight.placements == (Shard(0),)
    torch.testing.assert_close(out.full_tensor(), ref(x))
    torch.testing.assert_close(net[0].weight.grad.full_tensor(), ref[0].weight.grad)
    torch.testing.assert_close(net[2].bias.grad.full_tensor(), ref[2].bias.grad)
    return True


def test_distribute_module():
    assert all(run_distributed(_distribute_module, 2))


def _from_local_checks():
    m = mesh((2,))
    r = torch.distributed.get_rank()
    # uneven: rank 0 holds 3 rows, rank 1 holds 2
    local = torch.full((3 if r == 0 else 2, 4), float(r))
    d = dtshard.DTensor.from_local(local, m, [Shard(0)], shape=(5, 4), run_check=True)
    assert torch.equal(d.full_tensor()[:, 0], torch.tensor([0.0, 0, 0, 1, 1]))
    try:
        dtshard.DTensor.from_local(torch.ones(2 if r == 0 else 3, 4), m, [Shard(0)], shape=(5, 4), run_check=True)
    except ValueError as e:
        return str(e)
    return "no error"


def test_from_local_run_check_reports_every_rank():
    msgs = run_distributed(_from_local_checks, 2)
    assert msgs[0] == msgs[1]  # the same message on every rank
    assert "rank 0" in msgs[0] and "rank 1" in msgs[0] and "(5, 4)" in msgs[0]


# ---------------------------------------------------------------------------------------------
# explain(): the plan text of each op, checked inline
# ---------------------------------------------------------------------------------------------


def _explain_tp():
    m = mesh((2,))
    x = dtshard.distribute_tensor(torch.randn(4, 8), m, [Shard(0)])
    w = dtshard.distribute_tensor(torch.randn(6, 8), m, [Shard(0)])
    return dtshard.debug.explain(lambda: torch.mm(x, w.t()).sum(1))


import expecttest  # noqa: E402


class TestExplain(expecttest.TestCase):
    def test_explain_shows_plans_costs_and_alternatives(self):
        text = run_distributed(_explain_tp, 2)[0]
        self.assertExpectedInline(text, """\
aten.t.default  cost=0B
  in0: (S(0)) (kept)
  out0: (S(1)) shape=(8, 6)
  considered:
    ok  0B  (S(0)) -> (S(1))
aten.mm.default  cost=64B
  in0: (S(0)) -> (R):
  in0: mesh dim 0: S(0) -> R all_gather
  in1: (S(1)) (kept)
  out0: (S(1)) shape=(4, 6)
  considered:
    ok  64B  (R) (S(1)) -> (S(1))
aten.sum.dim_IntList  cost=0B
  in0: (S(1)) (kept)
  out0: (P(sum)) shape=(4,)
  considered:
    ok  0B  (S(1)) -> (P(sum))""")
