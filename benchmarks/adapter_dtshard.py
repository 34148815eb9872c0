"""bench_dtensor.py adapter for dtshard (the built-in ``--impl dtshard``).

Maps the harness's adapter contract (see the docstring of ``bench_dtensor.py``) onto dtshard's
public API.  The dtshard imported is THIS checkout's (the repository root is put first on
``sys.path``), so the benchmark measures the tree it ships with, installed or not.

Tensor parallelism comes from ``dtshard.parallel`` (``ColwiseParallel``, ``RowwiseParallel``,
``parallelize_module``: PyTorch's TP styles, the same defaults). The minimal Megatron-style
versions below, built only from dtshard's public API (``distribute_tensor``,
``DTensor.from_local``, ``.to_local()``, ``.redistribute()``), are used only with
``DTSHARD_BENCH_ADAPTER_TP=1`` (or on a checkout without ``dtshard.parallel``), to compare the
styles' own overhead; ``VERSION`` says which ran.
"""
from __future__ import annotations

import os
import sys

NAME = "dtshard"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _checkout import ROOT as _ROOT, import_this_checkout as _import_this_checkout  # noqa: E402

dtshard = _import_this_checkout()

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import dtshard.dispatch  # noqa: E402
import dtshard.redistribute  # noqa: E402
from dtshard import (  # noqa: E402
    DTensor,
    DeviceMesh,
    Partial,
    Replicate,
    Shard,
    distribute_tensor,
    init_device_mesh,
)

_TP_SOURCE = "benchmarks/adapter_dtshard.py (minimal Colwise/Rowwise)"


# --- required -------------------------------------------------------------------------
def redistribute(dt, mesh, placements):
    return dt.redistribute(mesh, placements)


# --- optional -------------------------------------------------------------------------
def from_local(local, mesh, placements):
    return DTensor.from_local(local, mesh, placements)


def to_local(dt):
    return dt.to_local()


def full_tensor(dt):
    return dt.full_tensor()


def clear_caches():
    """Forget every cached dispatch plan and every cached redistribute plan (the torch adapter
    likewise clears its sharding-propagation caches and its redistribute planner cache)."""
    dtshard.dispatch.clear_cache()
    dtshard.redistribute.clear_plan_cache()


def cache_stats():
    info = dtshard.dispatch.cache_info()
    return info["hits"], info["misses"]


def count_comms(fn):
    """Run fn() once under dtshard.debug.CommCounter: {kind: count}."""
    from dtshard.debug import CommCounter

    with CommCounter() as cc:
        fn()
    out: dict[str, int] = {}
    for k in cc.kinds():
        out[k] = out.get(k, 0) + 1
    return out


def count_ops(fn):
    """Run fn() once, counting the aten ops that reach DTensor.__torch_dispatch__ (a dispatch
    mode would count them too, but dtshard's tensor-parallel linears step aside under any mode,
    so the count would be of another program): {"total": n, "by_op": {op: n}}."""
    from collections import Counter

    counts: Counter = Counter()
    orig = dtshard.DTensor.__dict__["__torch_dispatch__"]

    def counting(cls, func, types, args=(), kwargs=None):
        counts[str(func)] += 1
        return orig.__func__(cls, func, types, args, kwargs)

    dtshard.DTensor.__torch_dispatch__ = classmethod(counting)
    try:
        fn()
    finally:
        dtshard.DTensor.__torch_dispatch__ = orig
    return {"total": sum(counts.values()), "by_op": dict(counts.most_common())}


# --- minimal tensor parallelism (torch.distributed.tensor.parallel semantics) -----------------
class ColwiseParallel:
    """nn.Linear: weight Shard(0), bias Shard(0); input a plain tensor taken as Replicate;
    output: this rank's columns as a plain tensor (torch: output_layouts=Shard(-1),
    use_local_output=True)."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        _shard_params(module, mesh, {"weight": [Shard(0)], "bias": [Shard(0)]})
        module.register_forward_pre_hook(
            lambda m, inputs: (_as_dtensor(inputs[0], mesh, [Replicate()]), *inputs[1:]))
        module.register_forward_hook(lambda m, inputs, out: out.to_local())
        return module


class RowwiseParallel:
    """nn.Linear: weight Shard(1), bias Replicate; input a plain tensor taken as Shard(-1);
    output reduced to Replicate, returned as a plain tensor (torch's defaults)."""

    def _apply(self, module: nn.Module, mesh) -> nn.Module:
        _shard_params(module, mesh, {"weight": [Shard(1)], "bias": [Replicate()]})
        module.register_forward_pre_hook(
            lambda m, inputs: (_as_dtensor(inputs[0], mesh, [Shard(-1)]), *inputs[1:]))
        module.register_forward_hook(
            lambda m, inputs, out: out.redistribute(mesh, [Replicate()]).to_local())
        return module


def parallelize_module(module: nn.Module, mesh, plan: dict) -> nn.Module:
    for name, style in plan.items():
        style._apply(module.get_submodule(name), mesh)
    return module


def _shard_params(module: nn.Module, mesh, placements: dict) -> None:
    for key, pl in placements.items():
        p = getattr(module, key, None)
        if p is None:
            continue
        module.register_parameter(
            key, nn.Parameter(distribute_tensor(p.data, mesh, pl), requires_grad=p.requires_grad))


def _as_dtensor(x, mesh, placements):
    if isinstance(x, DTensor):
        return x if tuple(x.placements) == tuple(placements) else x.redistribute(mesh, placements)
    return DTensor.from_local(x, mesh, placements)


# dtshard's own tensor parallelism, when this checkout has it, replaces the minimal one above
# (set DTSHARD_BENCH_ADAPTER_TP=1 to keep the adapter's)
if os.environ.get("DTSHARD_BENCH_ADAPTER_TP") != "1":
    try:
        from dtshard.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: F811

        _TP_SOURCE = "dtshard.parallel"
    except ImportError:
        pass

VERSION = (f"dtshard {getattr(dtshard, '__version__', '?')} ({os.path.dirname(dtshard.__file__)}); "
           f"TP styles: {_TP_SOURCE}")

__all__ = [
    "NAME", "VERSION", "DTensor", "DeviceMesh", "Partial", "Replicate", "Shard",
    "distribute_tensor", "init_device_mesh", "redistribute", "from_local", "to_local",
    "full_tensor", "clear_caches", "cache_stats", "count_comms", "count_ops",
    "ColwiseParallel", "RowwiseParallel", "parallelize_module",
]
