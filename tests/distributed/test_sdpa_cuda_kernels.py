"""The CUDA fused attention kernels on DTensors: what ``F.scaled_dot_product_attention`` runs on a
GPU (``_scaled_dot_product_flash_attention``, ``_efficient_attention``, ``_cudnn_attention`` and
their backwards), through dtshard's rules (batch / heads / query rows, rules/attention.py) and
the context-parallel strategies (rules/attention_cp.py).

These ops have only CUDA kernels, so the CPU suite runs them on CPU stand-ins with the CUDA
kernels' contracts (``dtshard/testing/sdpa_cuda_on_cpu.py``; checked here against
``F.scaled_dot_product_attention`` first).  Each case calls the op on DTensors and on plain
tensors in one process (the same stand-in) and compares the output, the log-sum-exp and dq/dk/dv
on every rank, the layouts of the results (every tensor output a DTensor, out and grads laid out
like q), and for the context-parallel strategies the collectives they issue.  ``benchmarks/gpu_check.sh`` runs the real
kernels when a GPU is lent.  The log-sum-exp the kernels return is float32 (their contract), so a
merge of blocks agrees with one call to float32's precision, not float64's.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import dtshard
from dtshard import Shard
from torch.distributed.tensor.placement_types import _StridedShard
from dtshard.debug import CommCounter
from dtshard.testing import run_distributed
from dtshard.testing.sdpa_cuda_on_cpu import install

from _cases import forced_cp, mesh
from test_context_parallel import _compiled_error

aten = torch.ops.aten
KERNELS = ("flash", "efficient", "cudnn")
TOL = 2e-6  # float32 log-sum-exp (the kernels' contract); float64 everything else


def _call(kernel, q, k, v, causal, bias=None):
    """The kernel's forward as ``F.scaled_dot_product_attention`` calls it: ``(out, lse rows, all outputs)``."""
    if kernel == "flash":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)
    elif kernel == "efficient":
        res = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal)
    else:
        res = aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, causal)
    lse = res[1]
    lse = lse[..., :q.shape[-2]] if kernel == "efficient" else lse.squeeze(-1) if kernel == "cudnn" else lse
    return res[0], lse, res


def test_cpu_stand_ins_match_sdpa():
    """The stand-ins against F.scaled_dot_product_attention (math) in float64, forward and backward,
    causal and not, a bias, grouped-query attention; the log-sum-exp against torch.logsumexp."""
    install()
    g = torch.Generator().manual_seed(0)
    for kernel, causal, (h, hkv), with_bias in itertools.product(KERNELS, (False, True), ((4, 4), (4, 1)),
                                                                  (False, True)):
        if with_bias and kernel == "flash":
            continue
        q = torch.randn(2, h, 40, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(2, hkv, 40, 8, generator=g, dtype=torch.float64) for _ in range(2))
        bias = torch.randn(40, 40, generator=g, dtype=torch.float64) if with_bias else None
        go = torch.randn(2, h, 40, 8, generator=g, dtype=torch.float64)
        a = [t.clone().requires_grad_() for t in (q, k, v)]
        b = [t.clone().requires_grad_() for t in (q, k, v)]
        out, lse, _ = _call(kernel, *a, causal, bias)
        out.backward(go)
        want = F.scaled_dot_product_attention(*b, attn_mask=bias, is_causal=causal, enable_gqa=h != hkv)
        want.backward(go)
        scores = q @ k.repeat_interleave(h // hkv, 1).transpose(-1, -2) / 8 ** 0.5
        if causal:
            scores = scores.masked_fill(~torch.ones(40, 40, dtype=torch.bool).tril(), float("-inf"))
        if bias is not None:
            scores = scores + bias
        case = (kernel, causal, h, hkv, with_bias)
        assert lse.dtype == torch.float32, case
        torch.testing.assert_close(lse.double(), torch.logsumexp(scores, -1), rtol=1e-6, atol=1e-6, msg=str(case))
        for x, y in zip([out] + [t.grad for t in a], [want] + [t.grad for t in b]):
            torch.testing.assert_close(x, y, rtol=TOL, atol=TOL, msg=str(case))


def test_kernel_adapter_keeps_causal_blocks_square():
    """The adapters through which the strategies call a CUDA kernel on blocks: a causal block with
    more query rows than keys (top-left aligned: row i sees keys 0..i) goes to the kernel as a
    square causal call and a call of the remaining rows against every key (a CUDA kernel's
    alignment of a non-square causal block differs between versions), forward and backward, equal
    to one top-left causal call; and the efficient kernel's log-sum-exp comes back unpadded."""
    from dtshard.rules.attention_cp import _FAMILIES

    install()
    calls = []
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, 20, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 4, 12, 8, generator=g, dtype=torch.float64) for _ in range(2))
    go = torch.randn(2, 4, 20, 8, generator=g, dtype=torch.float64)
    for kernel, op in (("flash", aten._scaled_dot_product_flash_attention.default),
                       ("efficient", aten._scaled_dot_product_efficient_attention.default),
                       ("cudnn", aten._scaled_dot_product_cudnn_attention.default)):
        kern = _FAMILIES[op].kernel
        want, want_lse, _ = _call(kernel, q, k, v, True)
        wq, wk, wv = kern.backward(go, q, k, v, want, want_lse, 0.0, True)  # (square split inside too)
        real = kern.fwd_op
        try:
            def recording(*a, **kw):  # (query rows, keys, is_causal) of each kernel call
                calls.append((a[0].shape[-2], a[1].shape[-2], a[4 if kernel == "flash" else 6]))
                return real(*a, **kw)

            kern.fwd_op = recording
            out, lse = kern(q, k, v, 0.0, True)
        finally:
            kern.fwd_op = real
        assert calls == [(12, 12, True), (8, 12, False)], (kernel, calls)
        calls.clear()
        assert lse.shape == (2, 4, 20), (kernel, lse.shape)
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        F.scaled_dot_product_attention(*ref, is_causal=True).backward(go)
        for x, y in zip((wq, wk, wv), (t.grad for t in ref)):
            torch.testing.assert_close(x, y, rtol=TOL, atol=TOL)


# (name, mesh shape, q/k/v placements, forced context-parallel strategy or None: the rule's path)
LAYOUTS = {
    "heads": ((2,), [Shard(1)], None),
    "batch": ((2,), [Shard(0)], None),
    "rows": ((2,), [Shard(2)], "none"),  # no strategy applies: the rule's plan (query rows)
    "allgather_kv": ((2,), [Shard(2)], "allgather_kv"),
    "ring": ((2,), [Shard(2)], "ring"),
    "ulysses": ((2,), [Shard(2)], "ulysses"),
    "ring_4": ((4,), [Shard(2)], "ring"),
    "balanced_4": ((4,), [Shard(2)], "balanced"),  # (causal only: the busy ranks' last rows moved)
    "ulysses_x_ring": ((2, 2), [Shard(2), Shard(2)], "auto"),
    "batch_x_ring": ((2, 2), [Shard(0), Shard(2)], "ring"),
    # the striped layout (tokens in blocks of 4, alternating ranks): causal blocks with more rows
    # than keys, which the kernel adapter splits into square causal calls
    "striped": ((2,), [_StridedShard(2, split_factor=8)], "allgather_kv"),
}


def _window(n, w, dtype):
    """An additive sliding-window mask of ``w`` keys (each row its own key and w - 1 before)."""
    i = torch.arange(n)
    keep = (i[:, None] >= i[None, :]) & (i[:, None] - i[None, :] < w)
    return torch.zeros(n, n, dtype=dtype).masked_fill(~keep, float("-inf"))


def _cases():
    """``(kernel, layout, causal, q length, (heads, kv heads), windowed bias, kv length)``."""
    for kernel, layout, causal in itertools.product(KERNELS, LAYOUTS, (False, True)):
        if (layout == "rows" and causal) or (layout in ("heads", "batch", "balanced_4") and not causal):
            continue  # rows: the rule shards query rows only without a causal mask
        heads = (8, 2) if kernel == "flash" and layout in ("allgather_kv", "ring", "ring_4") else (4, 4)
        if layout == "rows":
            heads = (3, 3)  # Ulysses forced but 3 heads over 2 ranks: no strategy applies
        yield kernel, layout, causal, 64, heads, False, 64
    # uneven chunks on 4 ranks (11, 11, 10, 10); efficient's padded log-sum-exp: the rule's path
    yield "flash", "ring_4", True, 42, (8, 2), False, 42
    yield "efficient", "allgather_kv", True, 42, (4, 4), False, 42
    # more queries than keys (causal, top-left aligned)
    yield "flash", "ring", True, 64, (8, 2), False, 48
    yield "cudnn", "allgather_kv", True, 64, (4, 4), False, 48
    for layout in ("allgather_kv", "ring", "ulysses", "mask_kv"):  # a sliding-window bias
        yield "efficient", layout, False, 64, (4, 4), True, 64
    yield "cudnn", "mask_kv", False, 64, (4, 4), True, 64
    # grouped-query heads: 8 over 2 line up on 2 ranks (no communication); 12 over 3 do not (6 + 6
    # query heads over 2 + 1 k/v heads: the rule's local_ok refuses). Flash and cuDNN: PyTorch's
    # meta kernel of the efficient backward assumes equal head counts (sdpa never sends it GQA)
    for kernel in ("flash", "cudnn"):
        yield kernel, "heads", True, 64, (8, 2), False, 64
        yield kernel, "heads", True, 64, (12, 3), False, 64


def _run(world):
    install()
    results = []
    for kernel, layout, causal, seq, (h, hkv), windowed, kv_seq in _cases():
        if layout == "mask_kv":
            mesh_shape, placements, forced = (2,), [Shard(2)], "mask_kv"
        else:
            mesh_shape, placements, forced = LAYOUTS[layout]
        if len(mesh_shape) == 1 and mesh_shape[0] != world or len(mesh_shape) == 2 and world != 4:
            continue
        m = mesh(mesh_shape)
        g = torch.Generator().manual_seed(seq * 13 + h)
        q = torch.randn(2, h, seq, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(2, hkv, kv_seq, 8, generator=g, dtype=torch.float64) for _ in range(2))
        go = torch.randn(2, h, seq, 8, generator=g, dtype=torch.float64)
        bias = _window(seq, 12, torch.float64) if windowed else None
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want, want_lse, _ = _call(kernel, *ref, causal, bias)
        want.backward(go)
        dts = [dtshard.distribute_tensor(t, m, placements).requires_grad_() for t in (q, k, v)]
        dgo = dtshard.distribute_tensor(go, m, placements)
        try:
            with forced_cp({None: "auto", "none": "ulysses"}.get(forced, forced)):  # backward too
                with CommCounter() as fwd:
                    out, lse, res = _call(kernel, *dts, causal, bias)
                out.backward(dgo)
        except Exception as e:
            raise AssertionError(f"{kernel} {layout} causal={causal} seq={seq}/{kv_seq} heads={h}/{hkv}") from e
        errs = [((a.full_tensor() - b).abs().max() / b.abs().max()).item()
                for a, b in zip([out, lse] + [d.grad for d in dts], [want, want_lse] + [r.grad for r in ref])]
        plain = [type(t).__name__ for t in res if isinstance(t, torch.Tensor) and not isinstance(t, dtshard.DTensor)]
        laid_out = [tuple(t.placements) for t in [out] + [d.grad for d in dts]]
        kinds = {kind: fwd.count(kind) for kind in fwd.kinds()}
        results.append(((kernel, layout, causal, seq, h, hkv, windowed, kv_seq), max(errs), plain, laid_out,
                        tuple(placements), kinds))
    return results


@pytest.mark.parametrize("world", [2, 4])
def test_cuda_kernels_on_sharded_dtensors(world):
    per_rank = run_distributed(_run, world, world, timeout=300)
    seen = set()
    for rank_results in per_rank:
        for case, err, plain, laid_out, placements, kinds in rank_results:
            kernel, layout, causal, seq = case[:4]
            seen.add((kernel, layout))
            assert err < TOL, (case, err)
            assert not plain, (case, "plain tensors among the outputs", plain)
            if kernel == "efficient" and seq % 32 and layout not in ("heads", "batch"):
                continue  # its padded log-sum-exp does not line up with the rows: the rule's path
            if layout == "heads" and case[4:6] == (12, 3):  # misaligned heads: another plan, exact
                assert kinds, (case, "heads kept although they do not line up")
                continue
            if layout != "rows":
                assert all(p == placements for p in laid_out), (case, laid_out)
            if layout in ("ring", "ring_4", "batch_x_ring"):  # K and V together, one block a step
                n = 4 if layout == "ring_4" else 2
                assert kinds == {"all_to_all": n - 1}, (case, kinds)
            elif layout in ("allgather_kv", "striped"):
                assert kinds == {"all_gather": 2}, (case, kinds)
            elif layout == "balanced_4":  # K and V gathered; rows to the partner, results back
                assert kinds == {"all_gather": 2, "all_to_all": 2}, (case, kinds)
            elif layout == "ulysses":  # q, k, v to heads, the output and its log-sum-exp back
                assert kinds == {"all_to_all": 5}, (case, kinds)
            elif layout == "mask_kv":  # one exchange of the window's rows
                assert kinds == {"all_to_all": 1}, (case, kinds)
            elif layout in ("heads", "batch"):
                assert not kinds, (case, kinds)
    want = {(kn, lay) for kn in KERNELS for lay, (shape, _, _) in LAYOUTS.items()
            if (len(shape) == 2 and world == 4) or (len(shape) == 1 and shape[0] == world)}
    if world == 2:
        want |= {("efficient", "mask_kv"), ("cudnn", "mask_kv")}
    assert want <= seen, want - seen


def test_gpu_checks_block_calls_run_on_the_stand_ins():
    """``benchmarks/gpu_check.py``'s section 6 (the CUDA kernels called block by block as the
    strategies call them, against one call) runs its CPU path on the stand-ins, so the GPU run
    that checks the real kernels' conventions is itself tested code."""
    import importlib.util
    import os

    import sys

    install()
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks")
    spec = importlib.util.spec_from_file_location("gpu_check_for_test", os.path.join(here, "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)
    sys.path.insert(0, here)  # its helper module (_checkout)
    try:
        spec.loader.exec_module(gpu_check)
    finally:
        sys.path.remove(here)
    rows = gpu_check._attention_block_rows("cpu", L=128)
    assert len(rows) == 5 and all(r["result"] == "PASS" for r in rows), rows


def _compiled(kernel, strategy):
    """One causal call of ``kernel`` on sequence-sharded DTensors, forward and backward, under
    torch.compile(fullgraph=True) (aot_eager: the graph's ops run on the stand-ins)."""
    install()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 64, 8, dtype=torch.float64, generator=g) for _ in range(3))
    return _compiled_error(q, k, v, mesh((2,)), [Shard(2)], strategy, lambda a, b, c: _call(kernel, a, b, c, True)[0])


def test_compiled_fullgraph():
    """The ring over the flash kernel and Ulysses over the efficient one, compiled."""
    for kernel, strategy in (("flash", "ring"), ("efficient", "ulysses")):
        assert max(run_distributed(_compiled, 2, kernel, strategy)) < TOL, (kernel, strategy)
