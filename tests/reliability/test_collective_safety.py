"""No rank may run a different collective, or a local op that fails, while the others go on.

Every collective's sizes must follow from metadata all ranks share, and a plan must never run a
local op that is invalid on some rank's shard (empty shards included).  When that goes wrong one
rank raises while the others wait in a collective, or the ranks issue collectives of different
sizes and gloo aborts the whole process ("Received data size doesn't match expected size").

The cases here are the ones that did that:

* group norm's double-backward formula (autograd uses it when the mean/rstd outputs get a
  gradient too, as in the OpInfo sample ``native_group_norm`` of x (1, 3) with a sharded weight)
  calls ``unsqueeze_``.  An in-place view used to keep the DTensor's old global shape over a
  reshaped local shard, so every later plan was built from a shape that no longer described the
  data, and the ranks' local ops disagreed (dtshard/rules/view.py, in-place views);
* a full reduction ``max()`` / ``min()`` of a tensor with fewer rows than ranks was planned as a
  local ``max()`` on every shard, which raises on the rank holding an empty shard (meta kernels
  accept empty inputs the real kernels reject; dtshard/propagate.py, ``_runs_on_empty``).

Values are compared with single-process PyTorch on every rank, gradients included.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import dtshard
from dtshard import Partial, Replicate, Shard
from dtshard.testing import run_distributed

_MESH: dict = {}


def _mesh():
    """One 1-D mesh over the whole world per process."""
    if "m" not in _MESH:
        _MESH["m"] = dtshard.init_device_mesh("cpu", (dist.get_world_size(),))
    return _MESH["m"]


def _placement(token: str):
    return {"R": Replicate(), "P": Partial("sum")}.get(token) or Shard(int(token[1:]))


def _dist(t: torch.Tensor, token: str):
    """``t`` distributed with placement ``token``; "P" makes rank 0 hold t and the others zeros."""
    mesh = _mesh()
    if token == "P":
        local = t.clone() if dist.get_rank() == 0 else torch.zeros_like(t)
        return dtshard.DTensor.from_local(local, mesh, [Partial("sum")])
    return dtshard.distribute_tensor(t, mesh, [_placement(token)], src_data_rank=None)


def _close(got, want, what: str) -> list[str]:
    got = got.full_tensor() if isinstance(got, dtshard.DTensor) else got
    if tuple(got.shape) != tuple(want.shape):
        return [f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}"]
    if not torch.allclose(got, want, atol=1e-5, rtol=1e-4, equal_nan=True):
        return [f"{what}: max error {(got - want).abs().max().item():.3g}"]
    return []


# ---------------------------------------------------------------------------------------------
# group norm, forward and backward through all three outputs (OpInfo samples of native_group_norm)
# ---------------------------------------------------------------------------------------------

#: (x shape, groups, eps) of the OpInfo samples of native_group_norm (weight and bias of C)
GN_SAMPLES = {"x(1,3) G1": ((1, 3), 1, 1e-5), "x(2,6,3) G2": ((2, 6, 3), 2, 0.5), "x(5,5,5) G1": ((5, 5, 5), 1, 0.5)}


def _group_norm_case(sample: str, x_tok: str, w_tok: str) -> list[str]:
    shape, group, eps = GN_SAMPLES[sample]
    n, c = shape[0], shape[1]
    hxw = 1
    for s in shape[2:]:
        hxw *= s
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(shape, generator=g), torch.randn(c, generator=g), torch.randn(c, generator=g)
    ref_in = [t.clone().requires_grad_() for t in (x, w, b)]
    dt_in = [_dist(x, x_tok).requires_grad_(), _dist(w, w_tok).requires_grad_(), _dist(b, "R").requires_grad_()]
    ref = torch.ops.aten.native_group_norm(*ref_in, n, c, hxw, group, eps)
    out = torch.ops.aten.native_group_norm(*dt_in, n, c, hxw, group, eps)
    bad = []
    for k, (o, r) in enumerate(zip(out, ref)):
        bad += _close(o, r.detach(), f"out{k}")
    # a gradient for every output (out, mean, rstd): autograd then uses group norm's
    # double-backward formula, which calls unsqueeze_ on DTensors
    grads = [torch.randn(r.shape, generator=g) for r in ref]
    want = torch.autograd.grad(ref, ref_in, grads)
    dgrads = [_dist(gr, "R").redistribute(_mesh(), [p if isinstance(p, Shard) else Replicate() for p in o.placements])
              for gr, o in zip(grads, out)]
    got = torch.autograd.grad(out, dt_in, dgrads)
    for name, gv, wv in zip(("grad_input", "grad_weight", "grad_bias"), got, want):
        bad += _close(gv, wv, name)
    return bad


GN_CASES = [
    # (sample, x placement, weight placement, world): the first is the OpInfo case that aborted
    ("x(1,3) G1", "R", "S0", 2),
    ("x(1,3) G1", "R", "S0", 4),  # weight shards of 1, 1, 1 and 0 channels
    ("x(1,3) G1", "S1", "R", 4),
    ("x(1,3) G1", "P", "R", 2),
    ("x(2,6,3) G2", "S0", "R", 4),  # two ranks hold an empty batch shard
    ("x(2,6,3) G2", "S1", "S0", 2),
    ("x(2,6,3) G2", "S2", "R", 4),
    ("x(5,5,5) G1", "S2", "R", 4),
    ("x(5,5,5) G1", "R", "R", 2),
]


@pytest.mark.parametrize("sample,x_tok,w_tok,world", GN_CASES)
def test_group_norm_forward_and_backward_through_every_output(sample, x_tok, w_tok, world):
    results = run_distributed(_group_norm_case, world, sample, x_tok, w_tok)
    for rank, bad in enumerate(results):
        assert not bad, f"rank {rank}: {bad}"


# ---------------------------------------------------------------------------------------------
# in-place views keep the global metadata in step with the local shard
# ---------------------------------------------------------------------------------------------

INPLACE_VIEWS = {
    "unsqueeze_(0) R": ("R", lambda t: t.unsqueeze_(0)),
    "unsqueeze_(-1) S0": ("S0", lambda t: t.unsqueeze_(-1)),
    "unsqueeze_(0) S1": ("S1", lambda t: t.unsqueeze_(0)),
    "t_() S0": ("S0", lambda t: t.t_()),
    "transpose_(0, 1) S1": ("S1", lambda t: t.transpose_(0, 1)),
    "unsqueeze_(1) P": ("P", lambda t: t.unsqueeze_(1)),
    # rank 1's shard of dim 1 has size 1: only GLOBAL size-1 dims may be squeezed
    "unsqueeze_(-1).squeeze_() S1": ("S1", lambda t: t.unsqueeze_(-1).squeeze_()),
}


def _inplace_view_case(name: str) -> list[str]:
    tok, fn = INPLACE_VIEWS[name]
    x = torch.arange(12.0).view(4, 3)
    d = _dist(x.clone(), tok)
    local_before = d._local_tensor
    r = fn(d)
    want = fn(x.clone())
    bad = []
    if r is not d:
        bad.append("the in-place op did not return self")
    if tuple(d.shape) != tuple(want.shape) or tuple(d._spec.shape) != tuple(want.shape):
        bad.append(f"global shape {tuple(d.shape)} / spec {tuple(d._spec.shape)}, expected {tuple(want.shape)}")
    coord = tuple(d.device_mesh.get_coordinate())
    if tuple(d._local_tensor.shape) != d._spec.local_shape(coord):
        bad.append(f"local shape {tuple(d._local_tensor.shape)} vs {d._spec.local_shape(coord)} of the spec")
    if d._local_tensor is not local_before:
        bad.append("the local shard was replaced, not changed in place")
    bad += _close(d, want, "values")
    bad += _close(d * 2 + 1, want * 2 + 1, "an op after the view")
    return bad


@pytest.mark.parametrize("name", list(INPLACE_VIEWS))
def test_inplace_view_updates_global_shape(name):
    results = run_distributed(_inplace_view_case, 2, name)
    for rank, bad in enumerate(results):
        assert not bad, f"{name}, rank {rank}: {bad}"


# ---------------------------------------------------------------------------------------------
# reductions over empty shards: torch.rand(3) on 4 ranks (shards of 1, 1, 1, 0 elements)
# ---------------------------------------------------------------------------------------------

#: name -> (global shape, placement, fn): every op whose real kernel rejects an empty input
REDUCTIONS = {
    "max()": ((3,), "S0", lambda t: t.max()),
    "min()": ((3,), "S0", lambda t: t.min()),
    "max() of (3, 2) S0": ((3, 2), "S0", lambda t: t.max()),
    "min() of (2, 3) S1": ((2, 3), "S1", lambda t: t.min()),
    "amax()": ((3,), "S0", lambda t: t.amax()),
    "amin(0)": ((3, 2), "S0", lambda t: t.amin(0)),
    "argmax()": ((3,), "S0", lambda t: t.argmax()),
    "argmin(0)": ((3, 2), "S0", lambda t: t.argmin(0)),
    "aminmax()": ((3,), "S0", lambda t: torch.stack(torch.aminmax(t))),
    "max(dim=0)": ((3, 2), "S0", lambda t: torch.stack([t.max(0)[0], t.max(0)[1].float()])),
    "median()": ((3,), "S0", lambda t: t.median()),
    "median(dim=0)": ((3, 2), "S0", lambda t: t.median(0)[0]),
    "kthvalue(2)": ((3,), "S0", lambda t: t.kthvalue(2)[0]),
    "mode(0)": ((3, 2), "S0", lambda t: t.mode(0)[0]),
    "topk(2)": ((3,), "S0", lambda t: t.topk(2)[0]),
    "inf-norm": ((3,), "S0", lambda t: torch.linalg.vector_norm(t, float("inf"))),
}


def _reduction_case(names) -> list[str]:
    bad = []
    for name in names:
        shape, tok, fn = REDUCTIONS[name]
        x = torch.rand(shape, generator=torch.Generator().manual_seed(1))
        try:
            bad += _close(fn(_dist(x, tok)), fn(x), name)
        except Exception as e:  # noqa: BLE001 - reported per op
            bad.append(f"{name}: {type(e).__name__}: {e}")
    return bad


@pytest.mark.parametrize("name", ["max()", "min()", "max() of (3, 2) S0", "min() of (2, 3) S1"])
def test_full_reduction_with_an_empty_shard(name):
    # before the fix: the rank with the empty shard raised, the others died in gloo
    results = run_distributed(_reduction_case, 4, [name])
    for rank, bad in enumerate(results):
        assert not bad, f"rank {rank}: {bad}"


def test_every_reduction_that_rejects_empty_input_is_right_with_empty_shards():
    results = run_distributed(_reduction_case, 4, list(REDUCTIONS))
    for rank, bad in enumerate(results):
        assert not bad, f"rank {rank}: {bad}"


def _empty_tensor_max():
    """A max() that is invalid for every rank (the global tensor is empty) still raises the same
    error on every rank, and the process group stays usable."""
    ok = _reduction_case(["max()"])  # valid input first: the plan cache holds the good plan
    d = _dist(torch.rand(0), "S0")
    try:
        d.max()
    except RuntimeError as e:
        msg = str(e)
    else:
        msg = "no error"
    t = torch.ones(1)
    dist.all_reduce(t)
    return ok, msg, t.item()


def test_max_of_an_empty_tensor_raises_the_same_error_on_every_rank():
    results = run_distributed(_empty_tensor_max, 4)
    assert all(not ok for ok, _, _ in results), [ok for ok, _, _ in results]
    msgs = {msg for _, msg, _ in results}
    assert len(msgs) == 1, msgs
    msg = msgs.pop()
    for phrase in ("aten.max.default", "(0,) (S(0))", "mesh (4,)", "numel() == 0"):  # torch's error, with the context
        assert phrase in msg, f"{phrase!r} not in {msg!r}"
    assert all(after == 4.0 for _, _, after in results)
