"""Where the validator's inputs come from.

1. **OpInfo samples, captured at the aten level.**  Each OpInfo of PyTorch's ``op_db`` runs a few
   of its small samples under a dispatch mode that records every aten call with its arguments:
   the forward, and with ``backward=True`` the backward pass too (``torch.autograd.grad`` with
   fixed output gradients), so the ops only the backward runs (``*_backward``, and the forward ops
   it reuses with the gradients' shapes) get samples of the shapes training gives them.  Samples
   are generated under a seed derived from the OpInfo's name: every run sees the same tensors.
2. **The op's own sample function**, for ops no OpInfo reaches at the aten level (composite ops
   such as ``matmul`` decompose before dispatch; bitwise ops have integer samples only):
   :data:`OWN_SAMPLES`, else one built from the op's schema for pointwise-shaped signatures
   (tensors of one shape, scalars, defaults).

An op with neither is reported "no sample", never counted as validated.
"""

from __future__ import annotations

import itertools
import random
import zlib
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from dtshard.testing import sdpa_cuda_on_cpu

__all__ = ["OWN_SAMPLES", "Sample", "SampleSource"]

aten = torch.ops.aten

#: a sample's tensors hold at most this many elements together (keeps every run small)
MAX_NUMEL = 2048


@dataclass
class Sample:
    """One call of one aten op: its arguments (global tensors) and where it came from."""

    args: tuple
    kwargs: dict
    source: str

    def signature(self) -> str:
        """Shapes, dtypes and non-tensor arguments: two samples with one signature are one case."""
        leaves, _ = tree_flatten((self.args, self.kwargs))
        return repr([(tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a for a in leaves])


def _numel(tree) -> int:
    return sum(t.numel() for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor))


def _frozen(a):
    return a.detach().clone(memory_format=torch.contiguous_format) if isinstance(a, torch.Tensor) else a


class _Capture(TorchDispatchMode):
    """Records every aten call (arguments copied as they were at the call)."""

    def __init__(self, source: str, sink: Callable[[object, Sample], None]) -> None:
        super().__init__()
        self.source, self.sink = source, sink
        self.in_backward = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "aten" and _numel((args, kwargs)) <= MAX_NUMEL:
            frozen_args, frozen_kwargs = tree_map(_frozen, (tuple(args), dict(kwargs)))
            where = self.source + (" (backward)" if self.in_backward else "")
            self.sink(func, Sample(frozen_args, frozen_kwargs, where))
        return func(*args, **kwargs)


def _seed(name: str) -> None:
    seed = zlib.crc32(name.encode()) & 0x7FFFFFFF
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np  # some sample functions draw from numpy's generator

        np.random.seed(seed)
    except ImportError:
        pass


def _pick(samples, k: int, scan: int = 8) -> list:
    """Up to ``k`` small samples among the first ``scan`` (sample functions are generators: the
    rest is never built), differing in the ranks of their tensors where possible."""
    small = [s for s in itertools.islice(samples, scan) if _numel((s.input, s.args, s.kwargs)) <= MAX_NUMEL]
    chosen, ranks = [], set()
    for s in small:
        r = tuple(t.ndim for t in tree_flatten((s.input, s.args, s.kwargs))[0] if isinstance(t, torch.Tensor))
        if r not in ranks:
            chosen.append(s)
            ranks.add(r)
        if len(chosen) >= k:
            return chosen
    return chosen + [s for s in small if s not in chosen][:k - len(chosen)]


def _run_opinfo(opinfo, dtype, k: int, backward: bool, sink) -> None:
    """Capture the aten calls of up to ``k`` samples of one OpInfo."""
    name = opinfo.name + ("." + opinfo.variant_test_name if opinfo.variant_test_name else "")
    _seed(name)
    grad = backward and opinfo.supports_autograd and (dtype.is_floating_point or dtype.is_complex)
    try:
        samples = _pick(iter(opinfo.sample_inputs_func(opinfo, "cpu", dtype, grad)), k)
    except Exception:  # noqa: BLE001 - a sample function that fails here gives no samples
        return
    for s in samples:
        cap = _Capture(f"OpInfo {name}", sink)
        with cap:
            try:
                out = opinfo.op(s.input, *s.args, **s.kwargs)
                outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
                ins = [t for t in tree_flatten((s.input, s.args, s.kwargs))[0]
                       if isinstance(t, torch.Tensor) and t.requires_grad]
                if grad and outs and ins:
                    cap.in_backward = True
                    gen = torch.Generator().manual_seed(0)
                    gouts = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in outs]
                    torch.autograd.grad(outs, ins, gouts, allow_unused=True)
            except Exception:  # noqa: BLE001 - the calls made before the error are still samples
                pass


@dataclass
class SampleSource:
    """Samples per aten op, captured lazily: ``samples(op)`` captures the OpInfos whose names
    look like the op's first, and all of them only when those did not reach it."""

    dtype: torch.dtype = torch.float32
    per_op: int = 2
    backward: bool = True
    found: dict = field(default_factory=dict)
    _done: set = field(default_factory=set)

    def _sink(self, op, sample: Sample) -> None:
        if not self.backward and sample.source.endswith("(backward)"):
            return
        have = self.found.setdefault(op, [])
        if len(have) < self.per_op and all(h.signature() != sample.signature() for h in have):
            have.append(sample)

    def _opinfos(self):
        from torch.testing._internal.common_methods_invocations import op_db

        for o in op_db:
            dtypes = o.supported_dtypes("cpu")
            dtype = self.dtype if self.dtype in dtypes else next(
                (d for d in (torch.float32, torch.int64, torch.bool) if d in dtypes), None)
            if dtype is not None:
                yield o, dtype

    def capture(self, name_filter: Callable[[str], bool] | None = None) -> None:
        """Run PyTorch's OpInfo samples (those whose name passes ``name_filter``) under a dispatch mode and keep each aten call they make (and, with ``backward``, the calls of their backward) as samples of that op."""
        for o, dtype in self._opinfos():
            key = (o.name, o.variant_test_name)
            if key in self._done or (name_filter is not None and not name_filter(o.name)):
                continue
            self._done.add(key)
            _run_opinfo(o, dtype, self.per_op, self.backward, self._sink)

    def samples(self, op) -> list[Sample]:
        """The samples of ``op``: captured OpInfo calls, else ``OWN_SAMPLES``, else ones built from its schema (at most ``per_op``)."""
        stem = op._overloadpacket.__name__.strip("_").removesuffix("_backward").removeprefix("special_")
        if op not in self.found and op.namespace == "aten":  # OpInfos run aten ops only
            self.capture(lambda name: stem in name.replace(".", "_"))
            if op not in self.found:
                self.capture()
        got = list(self.found.get(op, []))
        if len(got) < self.per_op:
            got += own_samples(op, self.dtype)[:self.per_op - len(got)]
        return got


# ---------------------------------------------------------------------------------------------
# the ops' own sample functions
# ---------------------------------------------------------------------------------------------


def _t(*shape, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed + len(shape))
    if dtype.is_floating_point:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(-8, 9, shape, generator=gen).to(dtype)


def _spd(n):
    a = _t(n, n)
    return a @ a.T + n * torch.eye(n)


#: op -> ``fn(dtype) -> [(args, kwargs), ...]`` for ops that no OpInfo reaches at the aten level
OWN_SAMPLES: dict = {
    aten.matmul.default: lambda dt: [((_t(5, 4), _t(4, 3)), {}), ((_t(2, 5, 4), _t(4, 3)), {})],
    aten.linear.default: lambda dt: [((_t(5, 4), _t(3, 4), _t(3)), {})],
    aten.bilinear.default: lambda dt: [((_t(5, 4), _t(5, 3), _t(2, 4, 3), _t(2)), {})],
    aten.clamp.default: lambda dt: [((_t(5, 4), -0.5, 0.5), {})],
    aten.clamp_max.default: lambda dt: [((_t(5, 4), 0.3), {})],
    aten.clip.default: lambda dt: [((_t(5, 4), -0.5, 0.5), {})],
    aten.clip.Tensor: lambda dt: [((_t(5, 4), _t(5, 4, seed=1) - 1, _t(5, 4, seed=2) + 1), {})],
    aten.square.default: lambda dt: [((_t(5, 4),), {})],
    aten.true_divide.Tensor: lambda dt: [((_t(5, 4), _t(5, 4, seed=1)), {})],
    aten.lerp.Tensor: lambda dt: [((_t(5, 4), _t(5, 4, seed=1), _t(5, 4, seed=2)), {})],
    aten.max.other: lambda dt: [((_t(5, 4), _t(5, 4, seed=1)), {})],
    aten.min.other: lambda dt: [((_t(5, 4), _t(5, 4, seed=1)), {})],
    aten.any.dims: lambda dt: [((_t(5, 4, 3) > 0, [0, 2]), {})],
    aten.all.dims: lambda dt: [((_t(5, 4, 3) > 0, [0, 2]), {})],
    aten.count_nonzero.dim_IntList: lambda dt: [((_t(5, 4, 3) > 0, [1]), {})],
    aten._logcumsumexp.default: lambda dt: [((_t(5, 4), 1), {})],
    aten.copy.default: lambda dt: [((_t(5, 4), _t(5, 4, seed=1)), {})],
    aten.zero.default: lambda dt: [((_t(5, 4),), {})],
    aten.detach_copy.default: lambda dt: [((_t(5, 4),), {})],
    aten.lift_fresh_copy.default: lambda dt: [((_t(5, 4),), {})],
    aten._neg_view.default: lambda dt: [((_t(5, 4),), {})],
    aten.slice_copy.Tensor: lambda dt: [((_t(7, 4), 0, 1, 6, 2), {})],
    aten.select_copy.int: lambda dt: [((_t(7, 4), 1, 2), {})],
    aten.squeeze_copy.dims: lambda dt: [((_t(5, 1, 4, 1), [1, 3]), {})],
    aten.split_copy.Tensor: lambda dt: [((_t(7, 4), 3, 0), {})],
    aten.unsafe_split_with_sizes.default: lambda dt: [((_t(7, 4), [2, 5], 0), {})],
    aten.slice_scatter.default: lambda dt: [((_t(7, 4), _t(2, 4), 0, 1, 5, 2), {})],
    aten.cross.default: lambda dt: [((_t(5, 3), _t(5, 3, seed=1), 1), {})],
    aten.kron.default: lambda dt: [((_t(3, 2), _t(2, 3)), {})],
    aten.tensordot.default: lambda dt: [((_t(5, 4, 3), _t(4, 3, 2), [1, 2], [0, 1]), {})],
    aten.linalg_inv.default: lambda dt: [((_spd(4),), {})],
    aten.inverse.default: lambda dt: [((_spd(4),), {})],
    aten.linalg_matrix_power.default: lambda dt: [((_t(4, 4), 3), {})],
    aten.linalg_vander.default: lambda dt: [((_t(5),), {"N": 4})],
    aten.linalg_matrix_norm.default: lambda dt: [((_t(5, 4), "fro"), {})],
    aten.trapezoid.x: lambda dt: [((_t(5, 4), _t(5, 4, seed=1)), {"dim": 1})],
    aten.trapezoid.dx: lambda dt: [((_t(5, 4),), {"dx": 0.5, "dim": 0})],
    aten.linalg_multi_dot.default: lambda dt: [(([_t(5, 4), _t(4, 3), _t(3, 2)],), {})],
    aten.kl_div.default: lambda dt: [((_t(5, 4), _t(5, 4, seed=1).softmax(1)), {})],
    aten.poisson_nll_loss.default: lambda dt: [((_t(5, 4), _t(5, 4, seed=1).abs(), True, False, 1e-8, 1), {})],
    aten.native_channel_shuffle.default: lambda dt: [((_t(2, 6, 3), 3), {})],
    aten._pad_circular.default: lambda dt: [((_t(2, 3, 5), [1, 2]), {})],
    aten.cummaxmin_backward.default: lambda dt: [((_t(5, 4), _t(5, 4, seed=1), torch.randint(0, 5, (5, 4)), 0), {})],
    aten._fused_rms_norm.default: lambda dt: [((_t(5, 4), [4], _t(4), 1e-5), {})],
    aten._weight_norm_interface.default: lambda dt: [((_t(5, 4), _t(5, 1).abs() + 0.5, 0), {})],
    aten.conj_physical.default: lambda dt: [((_t(5, 4),), {})],
    aten.positive.default: lambda dt: [((_t(5, 4),), {})],
    aten.isfinite.default: lambda dt: [((_t(5, 4) / (_t(5, 4, seed=1) > 0),), {})],
    aten._unsafe_index.Tensor: lambda dt: [((_t(5, 4), [torch.tensor([0, 2, 4, 1])]), {})],
    aten.div.Scalar_mode: lambda dt: [((_t(5, 4), 0.75), {"rounding_mode": "floor"})],
    aten.prod.dim_int: lambda dt: [((_t(5, 4), 1), {})],
    aten.all.dim: lambda dt: [((_t(5, 4) > 0, 1), {})],
    aten.median.dim: lambda dt: [((_t(5, 4), 1), {})],
    aten.sort.stable: lambda dt: [((_t(5, 4),), {"stable": True, "dim": 0})],
    aten._linalg_eigvals.default: lambda dt: [((torch.stack([_spd(3), _spd(3) + 1]),), {})],
    aten.linalg_tensorinv.default: lambda dt: [((_t(6, 2, 3), 1), {})],
    aten.linalg_matrix_norm.default: lambda dt: [((_t(5, 4), 1), {})],
    aten._upsample_bilinear2d_aa.default: lambda dt: [((_t(2, 3, 5, 6), [3, 4], False), {})],
    aten._upsample_bilinear2d_aa_backward.default: lambda dt: [((_t(2, 3, 3, 4), [3, 4], [2, 3, 5, 6], False), {})],
    aten.cumprod_backward.default: lambda dt: [((_t(5, 4, seed=1), _t(5, 4), 1, _t(5, 4).cumprod(1)), {})],
    # whole slices (the identity: a shard of the sliced dim stays), beside OpInfo's partial ones
    aten.slice.Tensor: lambda dt: [((_t(6, 4), 0, 0, 2 ** 63 - 1), {}), ((_t(5, 4), 0, -5, None), {})],
    aten.slice_backward.default: lambda dt: [((_t(6, 4), [6, 4], 0, 0, 6, 1), {})],
    aten._scaled_dot_product_flash_attention_for_cpu.default: lambda dt: [
        (tuple(_t(1, 2, 5, 4, seed=s) for s in range(3)), {})],
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: lambda dt: [_flash_backward()],
    # the CUDA kernels (on CPU: dtshard.testing.sdpa_cuda_on_cpu's stand-ins, installed when asked)
    aten._scaled_dot_product_flash_attention.default: lambda dt: _cuda_attention("flash", False),
    aten._scaled_dot_product_flash_attention_backward.default: lambda dt: _cuda_attention("flash", True),
    aten._scaled_dot_product_efficient_attention.default: lambda dt: _cuda_attention("efficient", False),
    aten._scaled_dot_product_efficient_attention_backward.default: lambda dt: _cuda_attention("efficient", True),
    aten._scaled_dot_product_cudnn_attention.default: lambda dt: _cuda_attention("cudnn", False),
    aten._scaled_dot_product_cudnn_attention_backward.default: lambda dt: _cuda_attention("cudnn", True),
}


def _cuda_attention(kind: str, backward: bool) -> list:
    """Samples of a CUDA fused attention kernel, forward or backward (no mask and a bias; causal
    and not): CPU tensors, run by the stand-ins of dtshard.testing.sdpa_cuda_on_cpu (registered
    here: the validator's process runs the ops on CPU)."""
    sdpa_cuda_on_cpu.install()
    out = []
    for causal, with_bias in ((False, False), (True, False), (False, True)):
        if with_bias and kind == "flash":
            continue
        q, k, v = (_t(2, 2, 5, 4, seed=s) for s in range(3))
        bias = _t(5, 5, seed=4) if with_bias else None
        if kind == "flash":
            fwd = ((q, k, v, 0.0, causal), {})
        else:
            fwd = ((q, k, v, bias, True, 0.0, causal), {})
        op = getattr(aten, f"_scaled_dot_product_{kind}_attention").default
        if not backward:
            out.append(fwd)
            continue
        res = op(*fwd[0])
        g = _t(2, 2, 5, 4, seed=5)
        if kind == "flash":
            out.append(((g, q, k, v, res[0], res[1], None, None, 5, 5, 0.0, causal, res[6], res[7]), {}))
        elif kind == "efficient":
            out.append(((g, q, k, v, bias, res[0], res[1], res[2], res[3], 0.0, [True, True, True, False],
                         causal), {}))
        else:
            out.append(((g, q, k, v, res[0], res[1], res[6], res[7], bias, None, None, 5, 5, 0.0, causal), {}))
    return out


def _flash_backward():
    q, k, v = (_t(1, 2, 5, 4, seed=s) for s in range(3))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu.default(q, k, v)
    return (_t(1, 2, 5, 4, seed=3), q, k, v, out, lse, 0.0, False), {}

_INT_OPS = ("bitwise", "shift", "xor", "gcd", "lcm", "__and__", "__or__")


def _schema_sample(op, dtype) -> list:
    """A pointwise-shaped call built from the schema: every Tensor argument a (5, 4) tensor, every
    Scalar a number, every other argument its default; [] when the schema has anything else."""
    name = op._overloadpacket.__name__
    dt = torch.int64 if any(s in name for s in _INT_OPS) else dtype
    args = []
    for k, a in enumerate(op._schema.arguments):
        ty = str(a.type)
        if ty == "Tensor":
            value = _t(5, 4, dtype=dt, seed=k).abs() + (1 if dt == torch.int64 else 0) \
                if "shift" in name else _t(5, 4, dtype=dt, seed=k)
        elif ty in ("Scalar", "number"):
            value = 2 if dt == torch.int64 else 0.75
        elif a.has_default_value():
            value = a.default_value
        else:
            return []
        if a.kwarg_only and a.has_default_value():
            continue
        args.append(value)
    try:
        op(*args)
    except Exception:  # noqa: BLE001 - the guess does not fit this op
        return []
    return [(tuple(args), {})]


def own_samples(op, dtype) -> list[Sample]:
    fn = OWN_SAMPLES.get(op)
    calls = fn(dtype) if fn is not None else _schema_sample(op, dtype)
    where = "own sample" if fn is not None else "sample from the schema"
    return [Sample(tuple(a), dict(kw), where) for a, kw in calls]
