"""Rules' ``meta`` functions (output metadata without a meta-kernel run) against the meta kernels.

Propagation trusts a rule's ``meta`` function instead of running the op's meta kernel (the main
cost of a dispatch-cache miss), so each one must give exactly the kernel's shapes, strides and
dtypes, and raise where the kernel raises.  The OpInfo sweep checks them on every float32 sample
(``config.verify_meta``); here: dtype promotion, broadcasting, 0-d operands, mismatches, and the
verification switch itself.
"""

from __future__ import annotations

import pytest
import torch

import dtshard  # noqa: F401  (registers the rules)
from dtshard import propagate as P
from dtshard.dispatch import _Slot
from dtshard.registry import get_entry

aten = torch.ops.aten


def _metas(op, args, shapes, dtypes, use_fn):
    entry = get_entry(op)
    assert entry is not None and entry.meta is not None, f"{op} has no meta function"
    return P._out_metas(op, args, {}, shapes, dtypes, (), entry.meta if use_fn else None, strides=True)


def _view(ms):
    return [None if m is None else (m.shape, m.stride, m.dtype) for m in ms]


f32, f64, i64, i32, b, bf16 = torch.float32, torch.float64, torch.int64, torch.int32, torch.bool, torch.bfloat16

CASES = [
    # (op, args with _Slot(k) for tensor k, shapes, dtypes)
    (aten.add.Tensor, (_Slot(0), _Slot(1)), [(4, 3), (4, 3)], [f32, f32]),
    (aten.add.Tensor, (_Slot(0), _Slot(1)), [(4, 1), (1, 3)], [f32, f64]),
    (aten.add.Tensor, (_Slot(0), _Slot(1)), [(2, 4, 3), (3,)], [i64, f32]),
    (aten.add.Tensor, (_Slot(0), _Slot(1)), [(4, 3), ()], [i32, f64]),  # 0-d: a scalar for promotion
    (aten.add.Tensor, (_Slot(0), _Slot(1)), [(0, 3), (1, 3)], [f32, f32]),
    (aten.mul.Tensor, (_Slot(0), _Slot(1)), [(5,), (5,)], [b, i32]),
    (aten.mul.Scalar, (_Slot(0), 2.5), [(3, 2)], [i64]),
    (aten.div.Tensor, (_Slot(0), _Slot(1)), [(3, 2), (3, 2)], [i64, i64]),
    (aten.eq.Tensor, (_Slot(0), _Slot(1)), [(3, 2), (2,)], [f32, f32]),
    (aten.where.self, (_Slot(0), _Slot(1), _Slot(2)), [(3, 1), (1, 4), (3, 4)], [b, f32, f64]),
    (aten.sigmoid.default, (_Slot(0),), [(2, 3, 4)], [bf16]),
    (aten.sigmoid.default, (_Slot(0),), [(2, 3)], [i64]),
    (aten.pow.Tensor_Scalar, (_Slot(0), 2), [(7,)], [i32]),
    (aten.mm.default, (_Slot(0), _Slot(1)), [(4, 5), (5, 3)], [f32, f32]),
    (aten.mm.default, (_Slot(0), _Slot(1)), [(0, 5), (5, 3)], [f32, f32]),
    (aten.mm.default, (_Slot(0), _Slot(1)), [(4, 5), (5, 3)], [f32, f64]),  # the meta kernel allows it
    (aten.bmm.default, (_Slot(0), _Slot(1)), [(2, 4, 5), (2, 5, 3)], [f64, f64]),
    (aten.addmm.default, (_Slot(0), _Slot(1), _Slot(2)), [(3,), (4, 5), (5, 3)], [f32, f32, f32]),
    (aten.addmm.default, (_Slot(0), _Slot(1), _Slot(2)), [(4, 1), (4, 5), (5, 3)], [f32, f32, f32]),
    (aten.baddbmm.default, (_Slot(0), _Slot(1), _Slot(2)), [(1, 4, 3), (2, 4, 5), (2, 5, 3)], [f32, f32, f32]),
    (aten.native_layer_norm.default, (_Slot(0), [8], _Slot(1), _Slot(2), 1e-5), [(2, 3, 8), (8,), (8,)], [f32] * 3),
    (aten.native_layer_norm.default, (_Slot(0), [3, 8], None, None, 1e-5), [(2, 3, 8)], [bf16]),
    (aten.native_layer_norm.default, (_Slot(0), [8], None, None, 1e-5), [(0, 8)], [f64]),
    (aten.sum.default, (_Slot(0),), [(3, 4)], [i32]),
    (aten.sum.default, (_Slot(0),), [(3, 4)], [b]),
    (aten.sum.dim_IntList, (_Slot(0), [1], True), [(3, 4, 5)], [f32]),
    (aten.sum.dim_IntList, (_Slot(0), [0, -1]), [(3, 4, 5)], [bf16]),
    (aten.sum.dim_IntList, (_Slot(0), []), [(3, 4)], [f32]),
    (aten.sum.dim_IntList, (_Slot(0), None, True), [(3, 0, 2)], [i64]),
    (aten._softmax.default, (_Slot(0), -1, False), [(3, 4)], [f32]),
    (aten._log_softmax.default, (_Slot(0), 0, False), [(3, 4, 2)], [bf16]),
    (aten._safe_softmax.default, (_Slot(0), 1), [(3, 4)], [f32]),
    (aten._safe_softmax.default, (_Slot(0), 1, torch.float64), [(3, 4)], [f32]),
]

REJECTED = [
    (aten.add.Tensor, (_Slot(0), _Slot(1)), [(4, 3), (2, 3)], [f32, f32]),
    (aten.mm.default, (_Slot(0), _Slot(1)), [(4, 5), (4, 3)], [f32, f32]),
    (aten.bmm.default, (_Slot(0), _Slot(1)), [(2, 4, 5), (2, 5, 3)], [f32, f64]),
    (aten.bmm.default, (_Slot(0), _Slot(1)), [(2, 4, 5), (3, 5, 3)], [f32, f32]),
    (aten.addmm.default, (_Slot(0), _Slot(1), _Slot(2)), [(2,), (4, 5), (5, 3)], [f32, f32, f32]),
    (aten.native_layer_norm.default, (_Slot(0), [4], None, None, 1e-5), [(2, 3, 8)], [f32]),
    (aten.native_layer_norm.default, (_Slot(0), [8], _Slot(1), None, 1e-5), [(2, 8), (4,)], [f32, f32]),
    (aten.sum.dim_IntList, (_Slot(0), [2]), [(3, 4)], [f32]),
    (aten.sum.dim_IntList, (_Slot(0), [1, -1]), [(3, 4)], [f32]),
]


@pytest.mark.parametrize("op,args,shapes,dtypes", CASES, ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else None)
def test_meta_function_equals_meta_kernel(op, args, shapes, dtypes):
    assert _view(_metas(op, args, shapes, dtypes, True)) == _view(_metas(op, args, shapes, dtypes, False))


@pytest.mark.parametrize("op,args,shapes,dtypes", REJECTED, ids=lambda v: str(v) if isinstance(v, torch._ops.OpOverload) else None)
def test_meta_function_rejects_what_the_kernel_rejects(op, args, shapes, dtypes):
    with pytest.raises(Exception):
        _metas(op, args, shapes, dtypes, False)
    with pytest.raises(Exception):
        _metas(op, args, shapes, dtypes, True)


def test_verify_meta_catches_a_wrong_meta_function(monkeypatch):
    from dtshard.spec import TensorMeta

    def wrong(call):  # right shape, wrong dtype
        t = call.tensors[0]
        return [TensorMeta(t.shape, t.stride, torch.float64)]

    monkeypatch.setattr(P.config, "verify_meta", True)
    args, shapes, dtypes = (_Slot(0), _Slot(1)), [(4, 3), (4, 3)], [f32, f32]
    with pytest.raises(P.RuleError, match="disagrees with its meta kernel"):
        P._out_metas(aten.add.Tensor, args, {}, shapes, dtypes, (), wrong, strides=True)

    def too_strict(call):
        raise RuntimeError("no")

    with pytest.raises(P.RuleError, match="which its meta kernel accepts"):
        P._out_metas(aten.add.Tensor, args, {}, shapes, dtypes, (), too_strict, strides=True)


def test_inplace_uses_the_functional_meta_and_declines_bad_casts():
    entry = get_entry(aten.add.Tensor)
    from dtshard.registry import OpCall
    from dtshard.spec import TensorMeta

    a = TensorMeta((4, 3), (3, 1), torch.int64)
    c = TensorMeta((4, 3), (3, 1), torch.float32)
    ok = P._inplace_meta(entry.meta, aten.add.Tensor, OpCall(aten.add_.Tensor, (c, a), {}, (c, a)))
    assert ok == [c]
    # int64 += float32 cannot cast back: declined, so the kernel raises the op's own error
    assert P._inplace_meta(entry.meta, aten.add.Tensor, OpCall(aten.add_.Tensor, (a, c), {}, (a, c))) is None
