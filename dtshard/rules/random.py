"""Random ops (dropout, bernoulli, uniform_/normal_/..., rand_like, multinomial, rrelu, ...).

Design: **every rank draws the FULL-size random tensor from its default generator, and keeps its
slice.**  Consequences:

- a sharded tensor never repeats one mask on every shard: each rank keeps a different slice of
  one draw;
- replicated tensors draw identically on every rank (same generator state, same draw);
- results are reproducible under ``torch.manual_seed`` and equal, bit for bit, to the same op on
  the plain global tensor in one process (same draw, same order), whatever the placements;
- every rank's generator advances by the same amount, so later draws stay in step.

The price is that each rank generates ``numel(global)`` random numbers instead of its share (no
communication, but O(global) work and a transient global-size buffer).  ``dtshard.config.
random_draws = "local"`` opts out for in-place fills and ``rand_like``-style ops of Shard /
Replicate tensors (see :func:`_local_draw`; measured in benchmarks/bench_random.py).  PyTorch's DTensor instead
offsets a Philox counter per shard (CUDA only; on CPU it draws per shard from the same state, so
every shard of a sharded tensor gets the same pattern); an offset-based generator would avoid the
full draw but cannot reproduce the single-process values.

Ops whose result does not depend on ``self``'s values (``bernoulli_(p)``, ``uniform_``, ``normal_``,
``exponential_``, ..., which dropout decomposes into) need no communication at all.  Ops that read
tensor values (``bernoulli(probs)``, ``normal(mean, std)``, ``multinomial``, ``native_dropout``,
``rrelu_with_noise``, ...) first replicate those inputs (all_gather / all_reduce), run the op on the
full tensors and keep the output's slice.  Outputs follow the placements of the first DTensor input
when they have its shape (Partial taken as Replicate), else they are replicated.

Layouts: a draw follows its tensor's memory order (one process's ``native_dropout(x.t())`` is
``native_dropout(x).t()``, ``bernoulli_`` of a transposed tensor fills it column by column), so
every full tensor handed to the op has the DTensor's GLOBAL strides: ``torch.empty_strided`` for
``self`` of a value-free fill, the gathered value copied into that layout for the others
(:func:`_global_value`: gaps of a slice kept, an expanded dim's shared elements written once).
``dropout`` itself decomposes into ``empty_like(x)`` and ``bernoulli_``: ``empty_like`` keeps
``x``'s global layout for that (``rules/tensor_ops.py``).  Checked for every op here, on
transposed, permuted, sliced, expanded and channels_last inputs, by
``tests/promises/test_random_promise.py``.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor.placement_types import Partial, Replicate

from dtshard._config import config
from dtshard.registry import register_handler
from dtshard.rules._common import aten_ops
from dtshard.spec import contiguous_strides, local_region, placement_kind, take_region
from dtshard.tensor import DTensor

aten = torch.ops.aten


# in-place fills whose values do not depend on self: only self's metadata is needed
_VALUE_FREE = aten_ops([
    "bernoulli_.float", "uniform_", "normal_", "exponential_", "cauchy_", "log_normal_", "geometric_",
    "random_", "random_.from", "random_.to",
])
# out-of-place ops that read only self's shape and dtype
_LIKE = aten_ops(["rand_like", "randn_like", "randint_like", "randint_like.low_dtype"])
# everything else: replicate the tensor inputs, run on the full tensors, keep the slice
_VALUE_DEPENDENT = aten_ops([
    "bernoulli", "bernoulli.p", "bernoulli.Tensor", "bernoulli_.Tensor", "native_dropout",
    "uniform", "normal.Tensor_Tensor", "normal.Tensor_float", "normal.float_Tensor", "normal_functional",
    "cauchy", "exponential", "geometric", "log_normal", "random", "random.from", "random.to",
    "multinomial", "poisson", "binomial", "_standard_gamma", "_sample_dirichlet",
    "randint_like.Tensor",
    "rrelu_with_noise", "rrelu_with_noise_", "rrelu_with_noise_functional", "rrelu", "rrelu_",
    "alpha_dropout", "alpha_dropout_", "feature_alpha_dropout", "feature_alpha_dropout_",
    "dropout", "dropout_", "feature_dropout", "feature_dropout_", "_fused_dropout",
])


def _dt_class():
    return DTensor


def _walk(a, fn):
    if isinstance(a, (list, tuple)):
        return type(a)(_walk(b, fn) for b in a)
    return fn(a)


def _follow(p):
    return Replicate() if isinstance(p, Partial) else p


def _from_full(full: torch.Tensor, mesh, placements):
    """A DTensor with the given placements whose global value is ``full`` (the same on every rank):
    wrapped as Replicate, then redistributed (a local slice for Shard; terms for Partial)."""
    DT = _dt_class()
    rep = [Replicate()] * mesh.ndim
    d = DT.from_local(full, mesh, rep, shape=tuple(full.shape), stride=tuple(full.stride()))
    return d.redistribute(mesh, list(placements)) if tuple(placements) != tuple(rep) else d


def _write_full(a, full: torch.Tensor, mesh) -> None:
    """Write the global value ``full`` (the same on every rank) into the DTensor ``a`` in place.
    Shards (strided ones too) and replicas take their region of it by a local copy: no plan, no
    collective (an ``nn.init`` of every parameter of a model on thousands of ranks plans nothing).
    A Partial, a view (its writes reach its base through dispatch's alias handling), a layout
    extension's shard, a rank outside the mesh and traced local tensors go through ``copy_``."""
    coord = mesh.get_coordinate()
    local = a._local_tensor
    if coord is not None and type(local) is torch.Tensor and not a._is_view() and a._spec.extra is None \
            and all(placement_kind(p) in "STR" for p in a.placements):
        region = local_region(tuple(a.shape), tuple(mesh.shape), tuple(a.placements), coord)
        local.copy_(take_region(full, region))
        return
    aten.copy_.default(a, _from_full(full, mesh, a.placements))


def _global_value(value: torch.Tensor, shape: tuple, stride: tuple) -> torch.Tensor:
    """A fresh plain tensor holding ``value`` (the global value, in any layout) laid out with the
    GLOBAL ``stride``: what one process would hand the op.  A random op's draws follow its input's
    memory order (``native_dropout(x.t())`` is ``native_dropout(x).t()``), so a contiguous copy
    would draw the same numbers into other elements.  Strides with gaps (a slice) are kept as
    they are; overlapping ones (an expanded dim) are written through the storage offsets of
    their elements (the elements that share a place hold the same value)."""
    if stride == contiguous_strides(shape):
        return value.clone(memory_format=torch.contiguous_format)
    out = torch.empty_strided(shape, stride, dtype=value.dtype, device=value.device)
    if _overlaps(shape, stride):
        base = out.as_strided((out.untyped_storage().nbytes() // out.element_size(),), (1,))
        where = torch.arange(base.numel(), device=value.device).as_strided(shape, stride)
        base[where.reshape(-1)] = value.reshape(-1)
    else:
        out.copy_(value)
    return out


def _overlaps(shape, stride) -> bool:
    """May two elements of a tensor of ``shape`` and ``stride`` share a place in memory?  False
    when, dims taken by increasing stride, each stride is past the span of the dims below it (every
    layout a view of a non-overlapping tensor makes); True otherwise, which only sends
    :func:`_global_value` down its storage-offset path (right for any layout)."""
    span = 0
    for st, sz in sorted((st, sz) for sz, st in zip(shape, stride) if sz > 1):
        if st <= span:
            return True
        span += st * (sz - 1)
    return False


def _random_handler(op, args, kwargs):
    with torch.no_grad():  # below autograd: the op's own backward formula handles gradients
        return _random_impl(op, args, kwargs)


def _local_draw(op, args, kwargs, DT):
    """``config.random_draws == "local"``: draw only this rank's shard.  Returns the op's result,
    or None where this path does not apply (inputs other than ``self`` that are DTensors, a
    Partial ``self``, or ranks outside the mesh).  The seed is one number drawn from the caller's
    generator (the default one unless the op got ``generator=``): every rank draws it, so every
    rank's generator advances alike whatever its shard; the local generator is seeded by it and
    by the rank's coordinates on the mesh dims that shard ``self`` (replicas agree)."""
    self = args[0]
    if any(isinstance(a, DT) for a in args[1:]) or any(isinstance(v, DT) for v in kwargs.values()):
        return None
    if any(not (p.is_shard() or p.is_replicate()) for p in self.placements):
        return None
    mesh = self.device_mesh
    coord = mesh.get_coordinate()
    if coord is None:
        return None
    seed = int(torch.randint(0, 2**62, (1,), generator=kwargs.get("generator")).item())
    # (a 62-bit draw, mixed with the coordinates below by an affine step: no rank-local data)
    for d, p in enumerate(self.placements):
        if p.is_shard():
            seed = (seed * 1_000_003 + coord[d] + 1) % 2**62
    local = self.to_local()
    if op in _LIKE_SET:  # no generator= argument: draw from the default generator, forked
        devices = [local.device] if local.device.type != "cpu" else []
        with torch.random.fork_rng(devices=devices, device_type=local.device.type):
            torch.manual_seed(seed)
            out = op(local, *args[1:], **kwargs)
    else:
        gen = torch.Generator(device=local.device).manual_seed(seed)
        out = op(local, *args[1:], **{**kwargs, "generator": gen})
    if out is local:  # an in-place fill: self's shard now holds the draw
        return self
    return DT.from_local(out, mesh, self.placements, shape=tuple(self.shape), stride=tuple(self.stride()))


def _random_impl(op, args, kwargs):
    DT = _dt_class()
    dts = []
    _walk((list(args), list(kwargs.values())), lambda a: dts.append(a) if isinstance(a, DT) else None)
    mesh = dts[0].device_mesh
    rep = [Replicate()] * mesh.ndim
    value_free = op in _VALUE_FREE_SET or op in _LIKE_SET
    if value_free and config.random_draws == "local" and isinstance(args[0], DT):
        out = _local_draw(op, args, kwargs, DT)
        if out is not None:
            return out

    def full(a, self_slot=False):
        if not isinstance(a, DT):
            return a
        if value_free and self_slot:
            return torch.empty_strided(tuple(a.shape), tuple(a.stride()), dtype=a.dtype)
        return _global_value(a.redistribute(mesh, rep).to_local(), tuple(a.shape), tuple(a.stride()))

    fargs = [_walk(a, lambda b, k=k: full(b, k == 0)) for k, a in enumerate(args)]
    fkwargs = {k: _walk(v, full) for k, v in kwargs.items()}
    out = op(*fargs, **fkwargs)

    # write mutated DTensor arguments back (self of an in-place op, rrelu's noise, ...)
    schema_args = op._schema.arguments
    for k, a in enumerate(args):
        info = schema_args[k].alias_info if k < len(schema_args) else None
        if isinstance(a, DT) and info is not None and info.is_write:
            _write_full(a, fargs[k], mesh)
    returns = op._schema.returns
    if len(returns) == 1 and returns[0].alias_info is not None and returns[0].alias_info.is_write:
        return args[0]

    ref = dts[0]
    target = [_follow(p) for p in ref.placements]

    def wrap(o):
        if not isinstance(o, torch.Tensor):
            return o
        ps = target if tuple(o.shape) == tuple(ref.shape) else rep
        return _from_full(o, mesh, ps)

    return _walk(out, wrap)


_VALUE_FREE_SET = frozenset(_VALUE_FREE)
_LIKE_SET = frozenset(_LIKE)
# strided shards (FSDP over tensor-parallel weights) are taken as they are: the draw is the full
# tensor either way, and Replicate -> a strided shard is a local slice, so converting them to
# plain shards and back (two exchanges over the whole mesh per parameter) bought nothing
register_handler(_VALUE_FREE + _LIKE + _VALUE_DEPENDENT, keeps_strided=True)(_random_handler)
