"""Issue #55: context parallelism's plan does not change when someone watches, multi-query
attention on two mesh dims moves its one KV head once, and the strategy is chosen by the slowest
rank's estimated time (with a balanced causal plan on a contiguous layout).

Every check compares values (and gradients) against one process, on every rank, in float64.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import dtshard
from dtshard import Replicate, Shard
from dtshard.debug import CommCounter
from dtshard.rules import attention_cp
from dtshard.testing import run_distributed

from _cases import forced_cp, mesh


class _DeferringCounter(TorchDispatchMode):
    """A counting mode that defers to tensor subclasses (returns NotImplemented for them, as a FLOP
    or memory counter may): it stays active inside dtshard's dispatch."""

    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(t is not torch.Tensor for t in types):
            return NotImplemented
        self.ops += 1
        return func(*args, **(kwargs or {}))


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _watched():
    """The same sliding-window call (4 ranks, S = 64, window 8, a replicated boolean mask; auto)
    with no mode, under dtshard's CommDebugMode, PyTorch's FlopCounterMode and a deferring counting
    mode, and with k and v on an equal mesh built separately: its collectives (CommCounter: kind,
    mesh dim, bytes received, forward and backward) and CommDebugMode's counts, and the values
    against one process."""
    m = mesh((4,))
    g = torch.Generator().manual_seed(55)
    S, w = 64, 8
    q, k, v, go = (torch.randn(2, 4, S, 8, dtype=torch.float64, generator=g) for _ in range(4))
    i = torch.arange(S)
    mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)  # boolean (L, S)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, attn_mask=mask)
    want.backward(go)
    dmask = dtshard.distribute_tensor(mask, m, [Replicate()])
    # a second mesh of the same ranks, built on its own (equal meshes are one: #54 item 1): k and
    # v on it take the same context-parallel plan as on q's mesh object
    m2 = dtshard.init_device_mesh("cpu", (4,))
    assert m2 is not m and m2 == m
    out = {}
    for name in ("none", "CommDebugMode", "FlopCounterMode", "deferring", "equal mesh"):
        dts = [dtshard.distribute_tensor(t, m2 if name == "equal mesh" and j else m, [Shard(2)]).requires_grad_()
               for j, t in enumerate((q, k, v))]
        dgo = dtshard.distribute_tensor(go, m, [Shard(2)])
        mode = {"none": None, "equal mesh": None, "CommDebugMode": dtshard.debug.CommDebugMode(),
                "FlopCounterMode": FlopCounterMode(display=False), "deferring": _DeferringCounter()}[name]
        with CommCounter() as comm:
            if mode is None:
                o = F.scaled_dot_product_attention(*dts, attn_mask=dmask)
                o.backward(dgo)
            else:
                with mode:
                    o = F.scaled_dot_product_attention(*dts, attn_mask=dmask)
                    o.backward(dgo)
        records = [(r.kind, r.mesh_dim, r.recv_bytes) for r in comm.records]
        debug_counts = ({str(k): n for k, n in mode.get_comm_counts().items()}
                        if name == "CommDebugMode" else None)
        errs = max(_rel(a.full_tensor(), b) for a, b in zip([o] + [d.grad for d in dts],
                                                            [want] + [r.grad for r in ref]))
        out[name] = (records, debug_counts, errs)
    return out


def test_the_plan_is_the_same_whoever_watches():
    for rank, out in enumerate(run_distributed(_watched, 4)):
        base = out["none"][0]
        assert base, "no collective at all"
        # the window's halo: mask_kv's all_to_alls, not K/V gathered whole
        assert {kind for kind, _, _ in base} == {"all_to_all"}, (rank, base)
        for name, (records, debug_counts, err) in out.items():
            assert err < 1e-9, (rank, name, err)
            assert records == base, (rank, name, records, base)
        counts = out["CommDebugMode"][1]
        assert sum(counts.values()) == len(base), (rank, counts, base)


def test_values_readable_only_where_nothing_traces():
    """Single process: an observing mode leaves the values readable; a fake or tracing mode, fake,
    meta and functional tensors do not."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    t = torch.ones(4, 4)
    assert attention_cp.values_readable(t)
    with _DeferringCounter(), FlopCounterMode(display=False):
        assert attention_cp.values_readable(t)
    assert not attention_cp.values_readable(torch.ones(4, 4, device="meta"))
    with FakeTensorMode() as fake:
        assert not attention_cp.values_readable(t)
        assert not attention_cp.values_readable(fake.from_tensor(t))
    seen = []
    make_fx(lambda x: seen.append(attention_cp.values_readable(x)) or x + 1)(t)  # a proxy mode traces
    make_fx(lambda x: seen.append(attention_cp.values_readable(t)) or x + 1, tracing_mode="symbolic")(t)
    assert seen == [False, False], seen


def _mqa_two_dims():
    """Multi-query attention (4 query heads, 1 KV head) with the sequence sharded on both dims of
    a 2x2 mesh (and GQA 4:2, whose 2 KV heads divide the inner dim: Ulysses x allgather as
    before): forward and backward bytes each rank receives, against K/V once, and the values."""
    m = mesh((2, 2))
    g = torch.Generator().manual_seed(3)
    rows = []
    for seq, causal, hkv in ((16, True, 1), (19, True, 1), (16, False, 1), (16, True, 2)):
        q = torch.randn(2, 4, seq, 8, dtype=torch.float64, generator=g)
        k, v = (torch.randn(2, hkv, seq, 8, dtype=torch.float64, generator=g) for _ in range(2))
        go = torch.randn(2, 4, seq, 8, dtype=torch.float64, generator=g)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=True)
        want.backward(go)
        layout = [Shard(2), Shard(2)]
        dts = [dtshard.distribute_tensor(t, m, layout).requires_grad_() for t in (q, k, v)]
        with CommCounter() as fwd:
            out = F.scaled_dot_product_attention(*dts, is_causal=causal, enable_gqa=True)
        dgo = dtshard.distribute_tensor(go, m, layout)
        with CommCounter() as bwd:
            out.backward(dgo)
        kv_once = 3 / 4 * (k.numel() + v.numel()) * 8  # (N-1)/N of K and V, float64
        errs = max(_rel(a.full_tensor(), b) for a, b in zip([out] + [d.grad for d in dts],
                                                            [want] + [r.grad for r in ref]))
        kept = all(tuple(t.placements) == tuple(layout) for t in [out] + [d.grad for d in dts])
        rows.append((seq, causal, hkv, fwd.received(), bwd.received(), kv_once, errs, kept,
                     sorted({r.kind for r in fwd.records})))
    return rows


def test_mqa_on_two_mesh_dims_moves_kv_once():
    for rank, rows in enumerate(run_distributed(_mqa_two_dims, 4)):
        for seq, causal, hkv, fwd, bwd, kv_once, err, kept, kinds in rows:
            case = (rank, seq, causal, hkv)
            assert err < 1e-9, (case, err)
            assert kept, case
            if hkv == 1:
                if seq == 16:
                    assert fwd == kv_once == 3072, (case, fwd, kv_once)  # the setup, exactly
                assert fwd <= 1.25 * kv_once, (case, fwd, kv_once)
                assert bwd <= 2.25 * kv_once, (case, bwd, kv_once)  # gathered again, dK/dV reduce_scattered
                assert kinds == ["all_gather"], (case, kinds)
            else:
                assert "all_to_all" in kinds, (case, kinds)  # Ulysses on the inner dim


HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}


def _balanced():
    """balanced forced on 4 ranks (and 2, with the batch on the other dim of a 2x2 mesh), causal
    with q_len == kv_len, kv_len > q_len and kv_len < q_len, even and uneven sequences, MHA / GQA /
    MQA: the values and gradients of one process, the layout kept, the forward's collectives, and
    the (query, key) pairs each rank's kernel calls evaluate (attention_cp.work_stats); then what
    dtshard.debug.explain says for an auto call."""
    rows = []
    g = torch.Generator().manual_seed(9)
    for mesh_shape in ((4,), (2, 2)):
        m = mesh(mesh_shape)
        layout = [Shard(2)] if len(mesh_shape) == 1 else [Shard(0), Shard(2)]
        # (S = 6 on 4 ranks: chunks of 2, 2, 2 and an empty one)
        for seq, dkv, heads in ((64, 0, "mha"), (35, 0, "gqa"), (32, 5, "mqa"), (32, -7, "gqa"), (6, 0, "mqa")):
            if len(mesh_shape) == 2 and heads != "gqa":
                continue
            h, hkv = HEADS[heads]
            q = torch.randn(2, h, seq, 8, dtype=torch.float64, generator=g)
            k, v = (torch.randn(2, hkv, seq + dkv, 8, dtype=torch.float64, generator=g) for _ in range(2))
            go = torch.randn(2, h, seq, 8, dtype=torch.float64, generator=g)
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            want = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=True)
            want.backward(go)
            dts = [dtshard.distribute_tensor(t, m, layout).requires_grad_() for t in (q, k, v)]
            dgo = dtshard.distribute_tensor(go, m, layout)
            with forced_cp("balanced"):
                attention_cp.work_stats["pairs"] = 0
                with CommCounter() as fwd:
                    out = F.scaled_dot_product_attention(*dts, is_causal=True, enable_gqa=True)
                work = attention_cp.work_stats["pairs"]
                out.backward(dgo)
            err = max(_rel(a.full_tensor(), b) for a, b in zip([out] + [d.grad for d in dts],
                                                               [want] + [r.grad for r in ref]))
            kept = all(tuple(t.placements) == tuple(layout) for t in [out] + [d.grad for d in dts])
            kinds = {kind: fwd.count(kind) for kind in fwd.kinds()}
            rows.append((mesh_shape, seq, dkv, heads, err, kept, kinds, work))
    # explain: which strategy ran and why
    m = mesh((4,))
    q = torch.randn(1, 4, 64, 8, dtype=torch.float64, generator=g)
    kv = torch.randn(1, 1, 64, 8, dtype=torch.float64, generator=g)
    dts = [dtshard.distribute_tensor(t, m, [Shard(2)]) for t in (q, kv, kv)]
    text = dtshard.debug.explain(lambda: F.scaled_dot_product_attention(*dts, is_causal=True, enable_gqa=True))
    return rows, text


def test_balanced_is_exact_and_evens_the_causal_work():
    per_rank = run_distributed(_balanced, 4)
    for rank, (rows, _) in enumerate(per_rank):
        for mesh_shape, seq, dkv, heads, err, kept, kinds, work in rows:
            case = (rank, mesh_shape, seq, dkv, heads)
            assert err < 1e-9, (case, err)
            assert kept, case
            if seq > 6:  # K, V; rows out, results back (S = 6: the pairs may need no move)
                assert kinds == {"all_gather": 2, "all_to_all": 2}, (case, kinds)
    n_rows = len(per_rank[0][0])
    for j in range(n_rows):
        mesh_shape, seq, dkv, heads = per_rank[0][0][j][:4]
        if mesh_shape != (4,) or seq % 4:
            continue
        works = [per_rank[r][0][j][7] for r in range(4)]
        # within 1.25x of the mean (the issue); allgather_kv: the last rank 1.75x at S = 64
        assert max(works) <= 1.25 * sum(works) / 4, (seq, dkv, heads, works)
    text = per_rank[0][1]
    assert "context parallelism" in text and "auto" in text, text
    for s in ("allgather_kv", "ring", "balanced"):
        assert s in text, text  # each estimate, the one that ran marked
    assert "->" in text, text


def _explain_two_dims():
    m = mesh((2, 2))
    q = torch.randn(2, 4, 16, 8, dtype=torch.float64)
    out = []
    for hkv in (1, 2):
        kv = torch.randn(2, hkv, 16, 8, dtype=torch.float64)
        dts = [dtshard.distribute_tensor(t, m, [Shard(2), Shard(2)]) for t in (q, kv, kv)]
        out.append(dtshard.debug.explain(
            lambda: F.scaled_dot_product_attention(*dts, is_causal=True, enable_gqa=True)))
    return out


def test_explain_says_how_two_sequence_dims_run():
    flat, usp = run_distributed(_explain_two_dims, 4)[0]
    assert "allgather_kv over mesh dims (0, 1)" in flat and "1 KV heads" in flat, flat
    assert "ulysses on mesh dim 1" in usp and "on mesh dim 0" in usp, usp
