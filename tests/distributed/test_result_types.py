"""Every result of an op on DTensors is a DTensor, and so is every gradient that reaches one.

Autograd builds some gradients itself, from metadata alone, so they never pass through
``__torch_dispatch__`` (``zeros``/``_efficientzerotensor`` in derivative formulas, zero-filled
gradients of unused outputs): those must still arrive as DTensors, laid out like the tensor they
belong to, in ``.grad`` and in ``torch.autograd.grad`` alike, and also where they flow on into
other backward formulas.  In-place view ops (``squeeze_``, ``t_``, ...) must change the wrapper's
global shape with the shard's (``F.linear`` of a 1-D input ends in ``squeeze_``).

Each case runs on every rank and compares values, types and local shapes with one process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dtshard
from dtshard import Replicate, Shard
from dtshard.testing import run_distributed


def _check(name, got, want, coord, problems):
    """``got`` must be a DTensor equal to ``want`` whose local shard fits its placements."""
    if not isinstance(got, dtshard.DTensor):
        problems.append(f"{name}: {type(got).__name__}, not a DTensor")
        return
    local = got._local_tensor
    if tuple(local.shape) != got._spec.local_shape(coord) or tuple(got.shape) != tuple(want.shape):
        problems.append(f"{name}: global {tuple(got.shape)} local {tuple(local.shape)} "
                        f"{got.placements} vs reference {tuple(want.shape)}")
        return
    if not torch.allclose(got.full_tensor(), want, atol=1e-6):
        problems.append(f"{name}: wrong values")


def _grads(fn, tensors, placements, mesh, how):
    """(dtshard grads, reference grads) of ``fn(*tensors).sum()`` via .backward() or autograd.grad."""
    ref = [t.clone().requires_grad_() for t in tensors]
    dts = [dtshard.distribute_tensor(t, mesh, [p]).requires_grad_() for t, p in zip(tensors, placements)]
    rg = torch.autograd.grad(fn(*ref).sum(), ref, allow_unused=True)
    out = fn(*dts).sum()
    if how == "backward":
        out.backward()
        dg = [d.grad for d in dts]
    else:
        dg = torch.autograd.grad(out, dts, allow_unused=True)
    rg = [torch.zeros_like(t) if g is None else g for g, t in zip(rg, tensors)]
    return dg, rg


def _zero_gradient_cases():
    mesh = dtshard.init_device_mesh("cpu", (2,))
    coord = tuple(mesh.get_coordinate())
    torch.manual_seed(0)
    x, y = torch.randn(5, 3), torch.randn(5, 3)
    img = torch.randn(2, 3, 6, 6)
    cases = {
        # other's gradient is zeros made by the formula (no DTensor input)
        "copysign": (lambda a, b: torch.copysign(a, b), [x, y]),
        # sgn's gradient for a real input is an _efficientzerotensor
        "sgn": (lambda a: torch.sgn(a), [x]),
        # the zero gradient flows on into mul's backward before it reaches a leaf
        "copysign chained": (lambda a, b: torch.copysign(a, b * 2.0), [x, y]),
        "sign then add": (lambda a, b: torch.sign(a) * 3 + b, [x, y]),
        "repeat": (lambda a: a.repeat(2, 1), [x]),
        "tile": (lambda a: a.tile((1, 2)), [x]),
        # only the first piece is used: the second gets a zero gradient slice
        "cat, unused piece": (lambda a, b: torch.cat([a, b])[:5], [x, y]),
        "max_pool2d": (lambda a: F.max_pool2d(a, 2), [img]),
    }
    problems = []
    for name, (fn, tensors) in cases.items():
        for pl in ([Shard(0)], [Replicate()], [Shard(1)]):
            for how in ("backward", "autograd.grad"):
                placements = [pl[0]] * len(tensors)
                dg, rg = _grads(fn, tensors, placements, mesh, how)
                for k, (g, r) in enumerate(zip(dg, rg)):
                    _check(f"{name} {pl} {how} grad{k}", g, r, coord, problems)
    return problems


def _double_backward_max_pool():
    """The double backward of max_pool2d runs max_pool2d_with_indices_backward's derivative, whose
    gradient for ``self`` is zeros built from metadata."""
    mesh = dtshard.init_device_mesh("cpu", (2,))
    coord = tuple(mesh.get_coordinate())
    torch.manual_seed(0)
    img = torch.randn(2, 4, 6, 6)
    problems = []
    for pl in (Shard(0), Shard(1), Replicate()):
        r = img.clone().requires_grad_()
        (gr,) = torch.autograd.grad((F.max_pool2d(r, 2) ** 2).sum(), r, create_graph=True)
        (rr,) = torch.autograd.grad(gr.sum(), r, allow_unused=True)
        d = dtshard.distribute_tensor(img, mesh, [pl]).requires_grad_()
        (gd,) = torch.autograd.grad((F.max_pool2d(d, 2) ** 2).sum(), d, create_graph=True)
        _check(f"grad {pl}", gd, gr, coord, problems)
        (dd,) = torch.autograd.grad(gd.sum(), d, allow_unused=True)
        _check(f"double grad {pl}", dd, torch.zeros_like(img) if rr is None else rr, coord, problems)
    return problems


def _inplace_views():
    mesh = dtshard.init_device_mesh("cpu", (2,))
    coord = tuple(mesh.get_coordinate())
    torch.manual_seed(0)
    problems = []
    x, w = torch.randn(4), torch.randn(6, 4)
    for px in (Replicate(), Shard(0)):
        for pw in (Replicate(), Shard(0), Shard(1)):
            dx = dtshard.distribute_tensor(x, mesh, [px]).requires_grad_()
            dw = dtshard.distribute_tensor(w, mesh, [pw]).requires_grad_()
            rx, rw = x.clone().requires_grad_(), w.clone().requires_grad_()
            # a 1-D input: linear unsqueezes it, multiplies, and ends in squeeze_
            _check(f"linear 1-D {px} {pw}", F.linear(dx, dw), F.linear(rx, rw), coord, problems)
            F.linear(dx, dw).sum().backward()
            F.linear(rx, rw).sum().backward()
            _check(f"linear 1-D {px} {pw} grad x", dx.grad, rx.grad, coord, problems)
            _check(f"linear 1-D {px} {pw} grad w", dw.grad, rw.grad, coord, problems)
    a = torch.randn(1, 4, 3)
    for pl in (Shard(1), Shard(2), Replicate()):
        for name, fn in {
            "squeeze_(0)": lambda t: t.squeeze_(0),
            "unsqueeze_(1)": lambda t: t.unsqueeze_(1),
            "t_ of squeezed": lambda t: t.squeeze_(0).t_(),
            "transpose_(1, 2)": lambda t: t.transpose_(1, 2),
            "swapdims_(0, 2)": lambda t: t.swapdims_(0, 2),
        }.items():
            d = dtshard.distribute_tensor(a, mesh, [pl])
            got = fn(d)
            want = fn(a.clone())
            if got is not d:
                problems.append(f"{name} {pl}: did not return self")
            _check(f"{name} {pl}", got, want, coord, problems)
            if d.stride() != want.stride():
                problems.append(f"{name} {pl}: stride {d.stride()} vs {want.stride()}")
            _check(f"{name} {pl} then add", d + 1, want + 1, coord, problems)
    # a dim whose SHARD has one row (global 2 on 2 ranks) is not squeezed; the size-1 dim is
    b = torch.arange(6.0).reshape(2, 1, 3)
    for name, fn in {"squeeze_()": lambda t: t.squeeze_(), "squeeze()": lambda t: t.squeeze(),
                     "squeeze_(0)": lambda t: t.squeeze_(0), "squeeze(1)": lambda t: t.squeeze(1)}.items():
        _check(f"{name} of (2, 1, 3) S(0)", fn(dtshard.distribute_tensor(b, mesh, [Shard(0)])), fn(b.clone()),
               coord, problems)
    return problems


def test_autograd_built_zero_gradients_are_dtensors():
    for rank, problems in enumerate(run_distributed(_zero_gradient_cases, 2)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def test_double_backward_of_max_pool_gives_dtensors():
    for rank, problems in enumerate(run_distributed(_double_backward_max_pool, 2)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def test_inplace_view_ops_change_the_global_shape():
    for rank, problems in enumerate(run_distributed(_inplace_views, 2)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def _copied_views():
    """A view op whose plan has to move its input returns a copy: writing into it must raise,
    never silently leave the base unchanged (autograd's as_strided_scatter backward does
    ``grad.new_zeros(...).as_strided(...).copy_(...)``)."""
    mesh = dtshard.init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    problems = []
    x = dtshard.distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
    v = x.as_strided((2, 2), (1, 2), 1)  # as_strided needs the whole tensor: a gathered copy
    w = v[0]  # a view of the copy is a copy of x too
    for name, write in {"zero_": lambda t: t.zero_(), "add_": lambda t: t.add_(1),
                        "copy_": lambda t: t.copy_(torch.ones(())),
                        "view of it": lambda t: w.mul_(2)}.items():
        try:
            write(v)
            problems.append(f"{name}: no error")
        except RuntimeError as e:
            if "is a copy" not in str(e):
                problems.append(f"{name}: unclear error {e}")
    # a true view (no move) stays writable and writes through
    y = dtshard.distribute_tensor(torch.zeros(4, 4), mesh, [Shard(0)])
    y[:, 1].add_(1)  # a column of a row-sharded tensor: a local view
    if not torch.equal(y.full_tensor()[:, 1], torch.ones(4)):
        problems.append("a true view did not write through")
    # the gradient of as_strided_scatter, for every layout of the output gradient: exact, or a
    # clear error (never a wrong value)
    base, src, g = torch.randn(4, 4), torch.randn(2, 2), torch.randn(4, 4)
    rx, rs = base.clone().requires_grad_(), src.clone().requires_grad_()
    rgx, rgs = torch.autograd.grad(torch.as_strided_scatter(rx, rs, (2, 2), (1, 2), 1), [rx, rs], g)
    for pg in (Replicate(), Shard(0), Shard(1)):
        dx = dtshard.distribute_tensor(base, mesh, [Shard(0)]).requires_grad_()
        ds = dtshard.distribute_tensor(src, mesh, [Replicate()]).requires_grad_()
        dy = torch.as_strided_scatter(dx, ds, (2, 2), (1, 2), 1)
        try:
            gx, gs = torch.autograd.grad(dy, [dx, ds], dtshard.distribute_tensor(g, mesh, [pg]))
        except RuntimeError as e:
            if "is a copy" not in str(e):
                problems.append(f"as_strided_scatter grad {pg}: unclear error {e}")
            continue
        if not (torch.allclose(gx.full_tensor(), rgx) and torch.allclose(gs.full_tensor(), rgs)):
            problems.append(f"as_strided_scatter grad {pg}: WRONG values")
    return problems


def test_writes_into_views_that_are_copies_raise():
    for rank, problems in enumerate(run_distributed(_copied_views, 2)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)


def _one_element_tensors():
    """Plain tensors of one element broadcast like scalars (as in PyTorch's DTensor); decompositions
    make them (``linalg.matrix_rank``'s tolerance is a (1,) tensor)."""
    mesh = dtshard.init_device_mesh("cpu", (2,))
    coord = tuple(mesh.get_coordinate())
    torch.manual_seed(0)
    problems = []
    x = torch.randn(4, 3, 3)
    for pl in (Shard(0), Shard(1), Replicate()):
        d = dtshard.distribute_tensor(x, mesh, [pl])
        _check(f"matrix_rank {pl}", torch.linalg.matrix_rank(d), torch.linalg.matrix_rank(x), coord, problems)
        _check(f"* (1,) {pl}", d * torch.tensor([2.0]), x * 2.0, coord, problems)
        _check(f"+ (1, 1) {pl}", torch.tensor([[1.5]]) + d, x + 1.5, coord, problems)
    try:
        dtshard.distribute_tensor(x, mesh, [Shard(0)]) * torch.ones(3)
        problems.append("a plain (3,) tensor was accepted")
    except RuntimeError as e:
        if "plain torch.Tensor of shape (3,)" not in str(e):
            problems.append(f"unclear error: {e}")
    return problems


def test_one_element_plain_tensors_broadcast():
    for rank, problems in enumerate(run_distributed(_one_element_tensors, 2)):
        assert not problems, f"rank {rank}:\n" + "\n".join(problems)
