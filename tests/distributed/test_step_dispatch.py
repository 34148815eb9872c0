"""What a training step dispatches: the plan cache's keys, and the gradients' layout.

- Pointwise ops key their number arguments by TYPE (``register_rule(scalar_values=False)``): an
  optimizer whose learning rate or bias corrections change every step plans its ops once, not
  every step, and the results are still exact.  The number's type still counts (an int and a
  float scalar promote differently), and ``masked_fill.Scalar``, whose rule reads the fill value
  (zero keeps a Partial(sum) input Partial, anything else does not), still keys it by value.
- ``loss_parallel()`` swaps two handlers on entry and exit without dropping any cached plan.
- A gradient that arrives transposed (``x @ w.t()``'s weight gradient) is copied into the
  leaf's layout once by the leaf's hook, not by AccumulateGrad's three dispatched ops; a second
  accumulation adds into the existing gradient; values equal single-process PyTorch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import dtshard
import dtshard.parallel
from dtshard import Partial, Replicate, Shard
from dtshard import dispatch
from dtshard.testing import run_distributed


def _misses():
    return dispatch.cache_info()["misses"]


def _scalar_keys():
    mesh = dtshard.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7
    dx = dtshard.distribute_tensor(x, mesh, [Shard(0)])
    out = {}
    dx * 0.5, dx.div(2.0)  # plan once
    m0 = _misses()
    vals = []
    for lr in (0.1, 0.01, 1e-3, 3.7):  # a new value each "step": no new plan
        y = dx * lr
        z = dx.div(1 - 0.9 ** (lr * 10))
        vals.append(bool(torch.equal(y.full_tensor(), x * lr)) and bool(torch.equal(z.full_tensor(), x.div(1 - 0.9 ** (lr * 10)))))
    out["float_misses"] = _misses() - m0
    out["float_values"] = all(vals)
    # an int number promotes an int tensor differently from a float one: its own plan, right dtype
    di = dtshard.distribute_tensor(torch.arange(8).reshape(2, 4), mesh, [Shard(1)])
    a, b = di * 3, di * 2.5
    out["dtypes"] = (a.dtype, b.dtype, bool(torch.equal(b.full_tensor(), torch.arange(8).reshape(2, 4) * 2.5)))
    # masked_fill reads its value: a Partial(sum) input stays Partial only for a zero fill
    p = dtshard.DTensor.from_local(torch.ones(2, 3), mesh, [Partial()])
    mask = dtshard.distribute_tensor(torch.tensor([[True, False, True], [False, False, True]]), mesh, [Replicate()])
    n = torch.distributed.get_world_size()
    zero = p.masked_fill(mask, 0.0)
    five = p.masked_fill(mask, 5.0)
    out["masked_fill"] = (
        tuple(zero.placements), tuple(five.placements),
        bool(torch.equal(zero.full_tensor(), torch.full((2, 3), float(n)).masked_fill(mask.full_tensor(), 0.0))),
        bool(torch.equal(five.full_tensor(), torch.full((2, 3), float(n)).masked_fill(mask.full_tensor(), 5.0))),
    )
    # loss_parallel(): nothing is planned again on later steps
    w = dtshard.distribute_tensor(torch.randn(6, 8), mesh, [Shard(1)]).requires_grad_()
    target = torch.tensor([1, 7, 3, 0])

    def step():
        with dtshard.parallel.loss_parallel():
            loss = F.cross_entropy(dx.redistribute(mesh, [Replicate()]) @ w, target)
            loss.backward()
        return loss.full_tensor()

    step()
    step()  # the first accumulation into w.grad
    m0, size0 = _misses(), dispatch.cache_info()["size"]
    step()
    out["loss_parallel"] = (_misses() - m0, dispatch.cache_info()["size"] >= size0)
    return out


def test_number_arguments_key_by_type_where_the_rule_reads_no_value():
    for res in run_distributed(_scalar_keys, 2, timeout=120):
        assert res["float_misses"] == 0 and res["float_values"], res
        assert res["dtypes"] == (torch.int64, torch.float32, True), res
        zero_pl, five_pl, zero_ok, five_ok = res["masked_fill"]
        assert zero_pl == (Partial(),) and five_pl != (Partial(),) and zero_ok and five_ok, res
        assert res["loss_parallel"] == (0, True), res


def _grad_layout():
    from collections import Counter

    mesh = dtshard.init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    torch.manual_seed(0)
    w_full = torch.randn(6, 4)
    x = torch.randn(3, 4)
    w = dtshard.distribute_tensor(w_full, mesh, [Shard(0)]).requires_grad_()
    seen = Counter()
    orig = dtshard.DTensor.__dict__["__torch_dispatch__"]

    def counting(cls, func, types, args=(), kwargs=None):
        seen[str(func)] += 1
        return orig.__func__(cls, func, types, args, kwargs)

    dx = dtshard.distribute_tensor(x, mesh, [Replicate()])
    c = torch.randn(3, 6)
    dc = dtshard.distribute_tensor(c, mesh, [Shard(1)])  # the output's gradient, column-sharded
    dtshard.DTensor.__torch_dispatch__ = classmethod(counting)
    try:
        (dx @ w.t()).backward(dc)  # the weight's gradient is mm(x.t(), g).t(): Shard(0), transposed
    finally:
        dtshard.DTensor.__torch_dispatch__ = orig
    first = (w.grad.stride(), w.grad._local_tensor.is_contiguous(), w.grad.full_tensor().clone(),
             tuple(w.grad.placements))
    (dx @ w.t()).backward(dc * 2)  # accumulates into the existing gradient
    wr = w_full.clone().requires_grad_()
    (x @ wr.t()).backward(c)
    g1 = wr.grad.clone()
    (x @ wr.t()).backward(c * 2)
    return {"stride": first[0], "contiguous": first[1], "first": torch.allclose(first[2], g1), "placements": first[3],
            "copies": seen["aten.new_empty_strided.default"] + seen["aten.copy_.default"],
            "second": torch.allclose(w.grad.full_tensor(), wr.grad)}


def test_transposed_gradient_is_laid_out_once_by_the_leaf_hook():
    for res in run_distributed(_grad_layout, 2, timeout=120):
        assert res["stride"] == (4, 1) and res["contiguous"] and res["placements"] == (Shard(0),), res
        assert res["copies"] == 0, res
        assert res["first"] and res["second"], res
