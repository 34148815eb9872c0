"""Context parallelism: attention on sequence-sharded q, k, v (dtshard/rules/attention_cp.py).

Every strategy (ulysses, allgather_kv, ring) x {no mask, causal, causal with q_len != kv_len} x {MHA, GQA 4:1, MQA} x {2 and 4
ranks, a 2x2 mesh with the batch on the other mesh dim} x {sequence divisible by the ranks and
not}: the output and dq/dk/dv in float64 against one process (rel 1e-9) on every rank, the
outputs and gradients laid out like the inputs, and the bytes each rank receives in the forward
against the strategy's formula (all-gather of K/V: K and V once, with their own heads).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

import dtshard
from dtshard import Replicate, Shard
from dtshard.debug import CommCounter
from dtshard.rules import attention_cp
from dtshard.testing import run_distributed

from _cases import mesh

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}  # GQA 4:1; MQA: one key/value head


def _cases(world):
    seqs = (2 * world, 2 * world + 3)  # divisible by the ranks, and not
    for strategy, masking, heads, seq in itertools.product(attention_cp.STRATEGIES, ("none", "causal", "causal_kv"),
                                                          HEADS, seqs):
        yield strategy, masking, heads, seq


def _run(mesh_shape):
    m = mesh(mesh_shape)
    seq_dim_of_mesh = len(mesh_shape) - 1
    placements = [Replicate()] * len(mesh_shape)
    placements[seq_dim_of_mesh] = Shard(2)
    if len(mesh_shape) == 2:
        placements[0] = Shard(0)  # the batch on the other mesh dim
    n = mesh_shape[seq_dim_of_mesh]
    results = []
    for strategy, masking, heads, seq in _cases(n):
        h, hkv = HEADS[heads]
        kv_seq = seq + 2 if masking == "causal_kv" else seq
        g = torch.Generator().manual_seed(seq * 7 + h)
        q = torch.randn(2, h, seq, 8, generator=g, dtype=torch.float64)
        k = torch.randn(2, hkv, kv_seq, 8, generator=g, dtype=torch.float64)
        v = torch.randn(2, hkv, kv_seq, 8, generator=g, dtype=torch.float64)
        go = torch.randn(2, h, seq, 8, generator=g, dtype=torch.float64)
        causal = masking != "none"
        gqa = hkv != h
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=gqa)
        want.backward(go)
        dts = [dtshard.distribute_tensor(t, m, placements).requires_grad_() for t in (q, k, v)]
        dgo = dtshard.distribute_tensor(go, m, placements)
        applies = attention_cp._bytes(strategy, *dts, seq_dim_of_mesh) is not None
        old = dtshard.config.attention_cp
        dtshard.config.attention_cp = strategy
        try:
            with CommCounter() as fwd:
                out = F.scaled_dot_product_attention(*dts, is_causal=causal, enable_gqa=gqa)
            out.backward(dgo)
        except Exception as e:
            raise AssertionError(f"{strategy}, {masking}, {heads}, seq {seq} on mesh {mesh_shape}") from e
        finally:
            dtshard.config.attention_cp = old
        errs = [((a.full_tensor() - b).abs().max() / b.abs().max()).item()
                for a, b in zip([out] + [d.grad for d in dts], [want] + [r.grad for r in ref])]
        layouts = [tuple(t.placements) == tuple(placements) for t in [out] + [d.grad for d in dts]]
        # K and V once (padded to the largest chunk for an uneven all_gather), with their own heads
        kv_once = sum((n - 1) * -(-t.shape[2] // n) * t[0:1].numel() // t.shape[2] * t.shape[0] * 8
                      for t in (k, v)) / (mesh_shape[0] if len(mesh_shape) == 2 else 1)
        kinds = {kind: fwd.count(kind) for kind in fwd.kinds()}
        results.append((strategy, masking, heads, seq, applies, max(errs), all(layouts), fwd.received(), kv_once,
                        kinds))
    return results


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_sequence_sharded_attention_strategies(mesh_shape):
    world = 1
    for s in mesh_shape:
        world *= s
    per_rank = run_distributed(_run, world, mesh_shape)
    ran = set()
    for rank_results in per_rank:
        for strategy, masking, heads, seq, applies, err, laid_out, received, kv_once, kinds in rank_results:
            case = (strategy, masking, heads, seq, mesh_shape)
            assert err < 1e-9, (case, err)
            if applies:  # (else the rule's plan ran, with the layout it chose)
                assert laid_out, case
                ran.add((strategy, heads))
                if strategy == "allgather_kv":  # K and V gathered, nothing else moves
                    assert kinds == {"all_gather": 2}, (case, kinds)
                    assert received <= 1.25 * kv_once + 1, (case, received, kv_once)
                elif strategy == "ring":  # K and V together, one block a step
                    assert kinds == {"all_to_all": mesh_shape[-1] - 1}, (case, kinds)
                    assert received <= 1.25 * kv_once + 1, (case, received, kv_once)
                else:  # q, k, v to heads, the output and its log-sum-exp back
                    assert kinds == {"all_to_all": 5}, (case, kinds)
    # all-gather of K/V and the ring run for every head layout; ulysses where the heads divide
    assert {(s, h) for s in ("allgather_kv", "ring") for h in HEADS} <= ran
    assert ("ulysses", "mha") in ran


def test_the_cost_picks_allgather_for_mqa_and_ulysses_for_mha():
    """Bytes received per rank in the forward, from global shapes (the same on every rank)."""

    class _Spec:
        def __init__(self, n):
            self.mesh_shape = (n,)
            self.placements = (Shard(2),)

    class _T:
        def __init__(self, shape, n):
            self.shape, self._spec = shape, _Spec(n)

        def numel(self):
            out = 1
            for s in self.shape:
                out *= s
            return out

        def dim(self):
            return len(self.shape)

        def element_size(self):
            return 4

    n = 4
    q, kv1, kv4 = _T((1, 8, 4096, 64), n), _T((1, 1, 4096, 64), n), _T((1, 8, 4096, 64), n)
    assert attention_cp._bytes("ulysses", q, kv1, kv1, 0) is None  # 1 key/value head over 4 ranks
    assert attention_cp.choose_strategy(q, kv1, kv1, 0) == "allgather_kv"
    assert attention_cp.choose_strategy(q, kv4, kv4, 0) == "ulysses"
    # MHA: ulysses moves (n-1)/n^2 of q, k, v, out; all-gather (n-1)/n of k and v: n/2 times more
    ratio = attention_cp._bytes("allgather_kv", q, kv4, kv4, 0) / attention_cp._bytes("ulysses", q, kv4, kv4, 0)
    assert ratio == pytest.approx(n / 2)
    # K/V too large to gather whole on one rank: the ring, which receives the same bytes
    old = dtshard.config.attention_cp_gather_bytes
    dtshard.config.attention_cp_gather_bytes = 2**20
    try:
        assert attention_cp.choose_strategy(q, kv1, kv1, 0) == "ring"
    finally:
        dtshard.config.attention_cp_gather_bytes = old
    assert attention_cp._bytes("ring", q, kv1, kv1, 0) == attention_cp._bytes("allgather_kv", q, kv1, kv1, 0)


def _compiled(strategy, hkv):
    """One causal call per strategy under torch.compile(fullgraph=True): no graph break, the same
    values and gradients as one process."""
    m = mesh((2,))
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 7, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, hkv, 7, 8, dtype=torch.float64, generator=g) for _ in range(2))
    gqa = hkv != 4
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=gqa).sum().backward()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    dts = [dtshard.distribute_tensor(t, m, [Shard(2)]).requires_grad_() for t in (q, k, v)]
    fn = torch.compile(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=gqa),
                       backend="aot_eager", fullgraph=True)
    old = dtshard.config.attention_cp
    dtshard.config.attention_cp = strategy
    try:
        out = fn(*dts)
        out.sum().backward()
    finally:
        dtshard.config.attention_cp = old
        torch._dynamo.reset()
    got = [out] + [d.grad for d in dts]
    return max(((a.full_tensor() - b).abs().max() / b.abs().max()).item()
               for a, b in zip(got, [want] + [r.grad for r in ref]))


@pytest.mark.parametrize("strategy,hkv", [("ulysses", 4), ("allgather_kv", 1), ("ring", 1)])
def test_compiled_fullgraph(strategy, hkv):
    assert max(run_distributed(_compiled, 2, strategy, hkv)) < 1e-9
