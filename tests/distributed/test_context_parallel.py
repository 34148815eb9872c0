"""Context parallelism: attention on sequence-sharded q, k, v (dtshard/rules/attention_cp.py).

Every strategy (ulysses, allgather_kv, ring) x {no mask, causal, causal with q_len != kv_len} x {MHA, GQA 4:1, MQA} x {2 and 4
ranks, a 2x2 mesh with the batch on the other mesh dim} x {sequence divisible by the ranks and
not}: the output and dq/dk/dv in float64 against one process (rel 1e-9) on every rank, the
outputs and gradients laid out like the inputs, and the bytes each rank receives in the forward
against the strategy's formula (all-gather of K/V: K and V once, with their own heads).

With attention masks (every strategy, mask_kv included) x {random boolean (B, H, L, S), the same
with rows masked everywhere, additive sliding windows below and above the local length ((L, S)
and (1, 1, L, S)), 3 causal documents (boolean (B, 1, L, S), a Replicate DTensor)} x the same heads,
meshes and sequences: the same checks, mask_kv's forward bytes within a window's K/V and under
the whole K/V, each mask read once; compiled with fullgraph=True; the mask agreement check.

Both matrices run eagerly here; a sample of them compiled (each compile costs ~1.3 s of CPU a
rank). ``python tools/cp_matrix.py`` runs every case of both compiled (``_run(..., compiled=True)``)
with the same verdicts (``check_strategies``, ``check_masked``) and records its last run in
``last_cp_matrix.json``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import dtshard
from dtshard import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from dtshard.debug import CommCounter
from dtshard.rules import attention_cp
from dtshard.testing import run_distributed

from _cases import forced_cp, mesh

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}  # GQA 4:1; MQA: one key/value head


def _cases(world):
    seqs = (2 * world, 2 * world + 3)  # divisible by the ranks, and not
    strategies = [s for s in attention_cp.STRATEGIES if s != "mask_kv"]  # (mask_kv needs a mask)
    for strategy, masking, heads, seq in itertools.product(strategies, ("none", "causal", "causal_kv"), HEADS, seqs):
        if strategy == "balanced" and masking == "none":
            continue  # (balanced evens causal work: a call without is_causal is the rule's, run above)
        yield strategy, masking, heads, seq


def _layout(mesh_shape):
    """(mesh, q/k/v placements, the sequence's mesh dim, its size): the sequence on the last mesh
    dim, the batch on the other one of a 2-D mesh."""
    m = mesh(mesh_shape)
    seq_dim_of_mesh = len(mesh_shape) - 1
    placements = [Replicate()] * len(mesh_shape)
    placements[seq_dim_of_mesh] = Shard(2)
    if len(mesh_shape) == 2:
        placements[0] = Shard(0)  # the batch on the other mesh dim
    return m, placements, seq_dim_of_mesh, mesh_shape[seq_dim_of_mesh]


def _attend(compiled: bool, **kw):
    """``F.scaled_dot_product_attention(q, k, v, **kw, **more)``; with ``compiled``, under
    ``torch.compile(fullgraph=True)`` (aot_eager, static shapes, Dynamo reset first: every case is
    a compile of its own, and a graph break raises)."""
    def attend(q, k, v, **more):
        return F.scaled_dot_product_attention(q, k, v, **kw, **more)

    return _compile(attend) if compiled else attend


def _compile(fn):
    """``fn`` under ``torch.compile(fullgraph=True)`` (aot_eager, static shapes), Dynamo reset first."""
    torch._dynamo.reset()
    return torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=False)


def _run(mesh_shape, compiled=False):
    """The unmasked matrix on ``mesh_shape``, eager or (``compiled``) each call compiled; the
    compiled run's collectives are the graph's, so its counts are not recorded."""
    m, placements, seq_dim_of_mesh, n = _layout(mesh_shape)
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
        applies = attention_cp._bytes(strategy, *dts, seq_dim_of_mesh, None, causal) is not None
        old = dtshard.config.attention_cp
        dtshard.config.attention_cp = strategy
        try:
            attend = _attend(compiled, is_causal=causal, enable_gqa=gqa)
            with CommCounter() as fwd:
                out = attend(*dts)
            out.backward(dgo)
        except Exception as e:
            raise AssertionError(f"{strategy}, {masking}, {heads}, seq {seq} on mesh {mesh_shape}"
                                 f"{' (compiled)' if compiled else ''}") from e
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


def check_strategies(per_rank, mesh_shape, compiled=False) -> int:
    """The verdict on :func:`_run`'s results from every rank (the test's, and
    ``tools/cp_matrix.py``'s on the compiled matrix); returns the number of cases checked."""
    ran, cases = set(), 0
    for rank_results in per_rank:
        for strategy, masking, heads, seq, applies, err, laid_out, received, kv_once, kinds in rank_results:
            case = (strategy, masking, heads, seq, mesh_shape, "compiled" if compiled else "eager")
            cases += 1
            assert err < 1e-9, (case, err)
            if applies:  # (else the rule's plan ran, with the layout it chose)
                assert laid_out, case
                ran.add((strategy, heads))
                if compiled:
                    continue
                if strategy == "allgather_kv":  # K and V gathered, nothing else moves
                    assert kinds == {"all_gather": 2}, (case, kinds)
                    assert received <= 1.25 * kv_once + 1, (case, received, kv_once)
                elif strategy == "balanced":  # and the busy ranks' last rows out, their results back
                    assert kinds in ({"all_gather": 2}, {"all_gather": 2, "all_to_all": 2}), (case, kinds)
                elif strategy == "ring":  # K and V together, one block a step
                    assert kinds == {"all_to_all": mesh_shape[-1] - 1}, (case, kinds)
                    assert received <= 1.25 * kv_once + 1, (case, received, kv_once)
                else:  # q, k, v to heads, the output and its log-sum-exp back
                    assert kinds == {"all_to_all": 5}, (case, kinds)
    # all-gather of K/V and the ring run for every head layout; ulysses where the heads divide
    assert {(s, h) for s in ("allgather_kv", "ring", "balanced") for h in HEADS} <= ran
    assert ("ulysses", "mha") in ran
    return cases


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_sequence_sharded_attention_strategies(mesh_shape):
    check_strategies(run_distributed(_run, math.prod(mesh_shape), mesh_shape), mesh_shape)


def test_the_choice_is_by_the_slowest_ranks_estimated_time():
    """From global shapes (the same on every rank): the forward's bytes per rank, and the choice by
    the estimated step time of the slowest rank (attention_cp.estimate)."""

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
    assert attention_cp._bytes("balanced", q, kv1, kv1, 0) is None  # not causal: nothing to even out
    # MHA: ulysses moves (n-1)/n^2 of q, k, v, out; all-gather (n-1)/n of k and v: n/2 times more
    ratio = attention_cp._bytes("allgather_kv", q, kv4, kv4, 0) / attention_cp._bytes("ulysses", q, kv4, kv4, 0)
    assert ratio == pytest.approx(n / 2)
    assert attention_cp.choose_strategy(q, kv4, kv4, 0, None, True) == "ulysses"  # balanced, fewest bytes
    # MQA, causal: allgather_kv's last rank evaluates 1.75x the mean pairs; balanced evens them
    gather, bal = (attention_cp.estimate(s, q, kv1, kv1, 0, None, True) for s in ("allgather_kv", "balanced"))
    assert gather.imbalance == pytest.approx(1.75, rel=1e-3) and bal.imbalance < 1.01
    assert bal.compute < 0.6 * gather.compute
    assert attention_cp.choose_strategy(q, kv1, kv1, 0, None, True) == "balanced"
    # short sequences: compute is cheap, the fewer collectives win
    short = _T((1, 8, 64, 64), n), _T((1, 1, 64, 64), n)
    assert attention_cp.choose_strategy(short[0], short[1], short[1], 0, None, True) == "allgather_kv"
    # the costs are settings: compute free, only bytes and calls count
    old = dtshard.config.attention_cp_pair_seconds
    dtshard.config.attention_cp_pair_seconds = 0.0
    try:
        assert attention_cp.choose_strategy(q, kv1, kv1, 0, None, True) == "allgather_kv"
    finally:
        dtshard.config.attention_cp_pair_seconds = old
    # K/V too large to gather whole on one rank: the ring, which receives the same bytes
    old = dtshard.config.attention_cp_gather_bytes
    dtshard.config.attention_cp_gather_bytes = 2**20
    try:
        assert attention_cp.choose_strategy(q, kv1, kv1, 0, None, True) == "ring"
    finally:
        dtshard.config.attention_cp_gather_bytes = old
    assert attention_cp._bytes("ring", q, kv1, kv1, 0) == attention_cp._bytes("allgather_kv", q, kv1, kv1, 0)


def _compiled_error(q, k, v, m, layout, strategy, attend=None) -> float:
    """One causal call under torch.compile(fullgraph=True) (a graph break raises) with ``strategy``
    forced, q, k, v laid out ``layout`` on ``m``: the largest relative error of the output and
    dq/dk/dv against one process.  ``attend(q, k, v)``: the call (default: causal SDPA)."""
    if attend is None:  # (the compiled form tools/cp_matrix.py runs the whole matrix in)
        attend = _attend(False, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    fn = _compile(attend)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attend(*ref)
    want.sum().backward()
    dts = [dtshard.distribute_tensor(t, m, layout).requires_grad_() for t in (q, k, v)]
    try:
        with forced_cp(strategy):
            out = fn(*dts)
            out.sum().backward()
    finally:
        torch._dynamo.reset()
    return max(((a.full_tensor() - b).abs().max() / b.abs().max()).item()
               for a, b in zip([out] + [d.grad for d in dts], [want.detach()] + [r.grad for r in ref]))


def _compiled(strategy, hkv):
    """One causal call per strategy under torch.compile(fullgraph=True): no graph break, the same
    values and gradients as one process."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 7, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, hkv, 7, 8, dtype=torch.float64, generator=g) for _ in range(2))
    return _compiled_error(q, k, v, mesh((2,)), [Shard(2)], strategy)


@pytest.mark.parametrize("strategy,hkv", [("ulysses", 4), ("allgather_kv", 1), ("ring", 1)])
def test_compiled_fullgraph(strategy, hkv):
    assert max(run_distributed(_compiled, 2, strategy, hkv)) < 1e-9


# --- attention masks -----------------------------------------------------------------------------

MASKS = ("random", "dead_rows", "window_small", "window_large", "documents")
WINDOW = {"window_small": 3, "window_large": 6}  # local length 4 (4 rows a rank): w below and above it


def _window(seq, w):
    """Causal sliding window: row i sees keys (i - w, i]; additive float, shape (L, S)."""
    i = torch.arange(seq)
    keep = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - w)
    return torch.zeros(seq, seq, dtype=torch.float64).masked_fill(~keep, float("-inf"))


def _mask(kind, b, h, seq, g):
    """The mask of each kind, with its broadcasting shape and type: random: boolean (B, H, L, S),
    every row keeping a key; dead_rows: the same with rows masked everywhere; windows: additive
    float (L, S) and (1, 1, L, S); documents: boolean (B, 1, L, S), 3 documents of uneven lengths
    per batch (boundaries differing between batches), causal within."""
    if kind in ("random", "dead_rows"):
        m = torch.rand(b, h, seq, seq, generator=g) > 0.6
        m[..., torch.arange(seq), torch.randint(0, seq, (seq,), generator=g)] = True
        if kind == "dead_rows":
            m[:, :, 0] = False  # the first row of the first rank, and rows of the last rank's
            m[1, :, seq - 2:] = False
        return m
    if kind in WINDOW:
        m = _window(seq, WINDOW[kind])
        return m if kind == "window_small" else m[None, None]
    i = torch.arange(seq)
    m = torch.zeros(b, 1, seq, seq, dtype=torch.bool)
    for bi in range(b):
        cuts = [0, seq // 5 + bi, seq // 5 + bi + seq // 2, seq]  # uneven: ~1/5, 1/2, the rest
        doc = torch.bucketize(i, torch.tensor(cuts[1:-1]), right=True)
        m[bi, 0] = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    return m


def _run_masked(mesh_shape, compiled=False):
    """The masked matrix on ``mesh_shape``, eager or (``compiled``) each call compiled."""
    m, placements, seq_dim_of_mesh, n = _layout(mesh_shape)
    other = mesh_shape[0] if len(mesh_shape) == 2 else 1
    results = []
    for kind, heads, seq in itertools.product(MASKS, HEADS, (4 * n, 4 * n + 3)):
        h, hkv = HEADS[heads]
        gqa = hkv != h
        g = torch.Generator().manual_seed(seq * 7 + h)
        q = torch.randn(2, h, seq, 8, generator=g, dtype=torch.float64)
        k, v = (torch.randn(2, hkv, seq, 8, generator=g, dtype=torch.float64) for _ in range(2))
        go = torch.randn(2, h, seq, 8, generator=g, dtype=torch.float64)
        mask = _mask(kind, 2, h, seq, g)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*ref, attn_mask=mask, enable_gqa=gqa)
        want.backward(go)
        wants = [want] + [r.grad for r in ref]
        # documents: a Replicate DTensor (its local tensor is the mask); the others plain tensors
        dmask = dtshard.distribute_tensor(mask, m, [Replicate()] * len(mesh_shape)) if kind == "documents" else mask
        for strategy in attention_cp.STRATEGIES:
            if strategy == "balanced":
                continue  # (causal calls without a mask only)
            dts = [dtshard.distribute_tensor(t, m, placements).requires_grad_() for t in (q, k, v)]
            if strategy == "ulysses" and kind != "random" \
                    and attention_cp._bytes(strategy, *dts, seq_dim_of_mesh) is None:
                continue  # heads that do not divide: the rule's path, run once per head layout (random)
            dgo = dtshard.distribute_tensor(go, m, placements)
            float_mask = mask if mask.dtype != torch.bool else \
                torch.zeros(mask.shape, dtype=torch.float64).masked_fill(~mask, float("-inf"))
            old = dtshard.config.attention_cp
            dtshard.config.attention_cp = strategy
            misses = attention_cp.mask_table_stats["misses"]
            try:
                attend = _attend(compiled, enable_gqa=gqa)
                with CommCounter() as fwd:
                    out = attend(*dts, attn_mask=dmask)
                out.backward(dgo)
                misses = attention_cp.mask_table_stats["misses"] - misses  # forward and backward
                lse_err = 0.0
                if kind == "dead_rows":  # the op's log-sum-exp too: rows masked everywhere as one process
                    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
                    _, lse = op(*(d.detach() for d in dts), attn_mask=float_mask)
                    _, want_lse = op(q, k, v, attn_mask=float_mask)
                    lse_err = (lse.full_tensor() - want_lse).abs().max().item()
            except Exception as e:
                raise AssertionError(f"{strategy}, {kind}, {heads}, seq {seq} on mesh {mesh_shape}"
                                     f"{' (compiled)' if compiled else ''}") from e
            finally:
                dtshard.config.attention_cp = old
            applies = attention_cp._bytes(strategy, *dts, seq_dim_of_mesh, float_mask) is not None
            got = [out] + [d.grad for d in dts]
            errs = [((a.full_tensor() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, wants)]
            laid_out = all(tuple(t.placements) == tuple(placements) for t in got)
            row = 2 * hkv * 8 * 8 * 2 // other  # one key row of K and V: B x Hkv x (E + Ev) float64s
            full = (n - 1) * -(-seq // n) * row  # what allgather_kv receives (padded to the largest chunk)
            results.append((strategy, kind, heads, seq, applies, max(errs), lse_err, laid_out, fwd.received(),
                            row, full, misses))
    return results


def check_masked(per_rank, mesh_shape, compiled=False) -> int:
    """The verdict on :func:`_run_masked`'s results from every rank (the test's, and
    ``tools/cp_matrix.py``'s on the compiled matrix); returns the number of cases checked.
    Compiled, mask_kv cannot read the traced mask, so the call takes the rule's path (its values
    are checked; its layout is the rule's)."""
    n = mesh_shape[-1]
    ran, cases = set(), 0
    for rank_results in per_rank:
        for strategy, kind, heads, seq, applies, err, lse_err, laid_out, received, row, full, misses in rank_results:
            case = (strategy, kind, heads, seq, mesh_shape, "compiled" if compiled else "eager")
            cases += 1
            assert err < 1e-9, (case, err)
            assert lse_err < 1e-9, (case, lse_err)
            if not applies or (compiled and strategy == "mask_kv"):
                continue
            assert laid_out, case
            ran.add((strategy, kind))
            if compiled:
                continue
            assert misses == (1 if strategy == "mask_kv" else 0), (case, misses)  # once per mask
            if strategy == "mask_kv" and kind in WINDOW:
                w = WINDOW[kind]
                assert received <= 1.25 * w * row, (case, received, w * row)
                if w <= seq // n:  # a halo of w - 1 rows, under the whole K/V
                    assert received < full, (case, received, full)
    strategies = ("allgather_kv", "ring") if compiled else ("allgather_kv", "ring", "mask_kv")
    assert {(s, k) for s in strategies for k in MASKS} <= ran, ran
    assert {("ulysses", k) for k in MASKS} <= ran
    return cases


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_masked_attention_strategies(mesh_shape):
    """Every strategy x {random boolean mask, with rows masked everywhere, sliding window below
    and above the local length, 3 causal documents} x {MHA, GQA, MQA} x {even, uneven sequence}:
    values and gradients as one process (rel 1e-9), layouts kept; mask_kv receives a window's
    halo (at most the window's K/V, less than the whole K/V when the window is under the local
    length) and reads each mask once."""
    check_masked(run_distributed(_run_masked, math.prod(mesh_shape), mesh_shape), mesh_shape)


def _compiled_masked():
    """Under torch.compile(fullgraph=True): the ring with a document mask (a Replicate DTensor,
    additive float (B, 1, L, S)) and ulysses with a sliding window, exact, no graph break; mask_kv
    with a sliding window (plain boolean (L, S)) cannot read a traced mask, so it does not apply
    (no table is read) and the call takes the rule's path, exact too."""
    m = mesh((2,))
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 9, 8, dtype=torch.float64, generator=g)
    k, v = (torch.randn(2, 2, 9, 8, dtype=torch.float64, generator=g) for _ in range(2))
    window = _window(9, 3) == 0  # boolean
    docs = _mask("documents", 2, 4, 9, g)
    docs = torch.zeros(docs.shape, dtype=torch.float64).masked_fill(~docs, float("-inf"))
    errs, misses = [], attention_cp.mask_table_stats["misses"]
    # (allgather_kv slices the mask as the ring does; each compile costs seconds)
    for strategy, mask in (("ring", docs), ("ulysses", window), ("mask_kv", window)):
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*ref, attn_mask=mask, enable_gqa=True)
        want.sum().backward()
        dmask = dtshard.distribute_tensor(mask, m, [Replicate()]) if mask is docs else mask
        dts = [dtshard.distribute_tensor(t, m, [Shard(2)]).requires_grad_() for t in (q, k, v)]
        fn = torch.compile(lambda a, b, c, msk: F.scaled_dot_product_attention(a, b, c, attn_mask=msk, enable_gqa=True),
                           backend="aot_eager", fullgraph=True)
        old = dtshard.config.attention_cp
        dtshard.config.attention_cp = strategy
        try:
            out = fn(*dts, dmask)
            out.sum().backward()
        finally:
            dtshard.config.attention_cp = old
            torch._dynamo.reset()
        errs.append(max(((a.full_tensor() - b).abs().max() / b.abs().max()).item()
                        for a, b in zip([out] + [d.grad for d in dts], [want] + [r.grad for r in ref])))
    return errs, attention_cp.mask_table_stats["misses"] - misses


def test_compiled_fullgraph_with_masks():
    for errs, misses in run_distributed(_compiled_masked, 2):
        assert max(errs) < 1e-9, errs
        assert misses == 0


def _mask_reads_and_agreement():
    """mask_kv reads an additive mask once across calls (a boolean one once per forward: F.sdpa
    makes a new additive mask each call), again after an in-place write; the debug check
    (config.attention_cp_check_masks) raises on masks that differ between ranks."""
    m = mesh((2,))
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, 10, 8, dtype=torch.float64, generator=g) for _ in range(3))
    dts = [dtshard.distribute_tensor(t, m, [Shard(2)]).requires_grad_() for t in (q, k, v)]
    window = _window(10, 3)
    old = dtshard.config.attention_cp
    dtshard.config.attention_cp = "mask_kv"
    reads = []
    try:
        for mask in (window, window == 0):
            before = attention_cp.mask_table_stats["misses"]
            for _ in range(2):
                F.scaled_dot_product_attention(*dts, attn_mask=mask).sum().backward()
            reads.append(attention_cp.mask_table_stats["misses"] - before)
        before = attention_cp.mask_table_stats["misses"]
        window[0, 1] = 0.0  # an in-place write: read again
        F.scaled_dot_product_attention(*dts, attn_mask=window)
        reads.append(attention_cp.mask_table_stats["misses"] - before)
        dtshard.config.attention_cp_check_masks = True
        F.scaled_dot_product_attention(*dts, attn_mask=window)  # the same on both ranks: fine
        try:
            F.scaled_dot_product_attention(*dts, attn_mask=_window(10, 3 + torch.distributed.get_rank()))
            caught = ""
        except ValueError as e:
            caught = str(e)
    finally:
        dtshard.config.attention_cp = old
        dtshard.config.attention_cp_check_masks = False
    return reads, caught


def test_mask_read_once_and_agreement_check():
    for reads, caught in run_distributed(_mask_reads_and_agreement, 2):
        assert reads == [1, 2, 1], reads  # additive: once for 2 calls; boolean: once a forward
        assert "differs between the ranks" in caught and "(10, 10)" in caught, caught


# --- load-balanced (striped) causal layouts, and Ulysses x ring on two mesh dims -----------------


def _errs(out, dts, want, ref):
    return max(((a.full_tensor() - b).abs().max() / b.abs().max()).item()
               for a, b in zip([out] + [d.grad for d in dts], [want] + [r.grad for r in ref]))


def _one_process(g, b, h, hkv, seq, kv_seq, causal):
    """float64 q, k, v, an output gradient, and one process's attention on leaf copies (its
    output, with the leaves' gradients filled)."""
    q = torch.randn(b, h, seq, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(b, hkv, kv_seq, 8, generator=g, dtype=torch.float64) for _ in range(2))
    go = torch.randn(b, h, seq, 8, generator=g, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=hkv != h)
    want.backward(go)
    return q, k, v, go, ref, want


def _striped_and_usp():
    """On 4 ranks: q, k, v laid out ``_StridedShard(2, split_factor=sf)`` (the striped layout:
    ``sf = S / 4`` gives rank ``r`` the tokens ``r, r + 4, ...``; a smaller ``sf`` stripes
    blocks), through allgather_kv and the ring, causal (also with kv_len != q_len) and not: the
    values and gradients of one process, the layout kept, and the (query, key) pairs each rank's
    kernel calls compute; the same layouts with masks (a sliding window, random boolean, causal
    documents) through allgather_kv, the ring and Ulysses.  On a 2x2 mesh, the sequence sharded
    on both mesh dims: Ulysses on the inner dim x each single-dim strategy on the outer one."""
    g = torch.Generator().manual_seed(11)
    rows = []
    m = mesh((4,))
    for seq, sf, masking, heads, strategy in itertools.product(
            (32, 35), ("tokens", 4), ("causal", "causal_kv", "none"), ("mha", "gqa"), ("allgather_kv", "ring")):
        if seq % 4 and sf == "tokens":
            continue  # token striping needs S divisible by the ranks (each chunk one token a rank)
        split = seq // 4 if sf == "tokens" else sf
        h, hkv = HEADS[heads]
        kv_seq = seq + 4 if masking == "causal_kv" else seq
        causal = masking != "none"
        q, k, v, go, ref, want = _one_process(g, 1, h, hkv, seq, kv_seq, causal)
        layout = [_StridedShard(2, split_factor=split)]
        dts = [dtshard.distribute_tensor(t, m, layout).requires_grad_() for t in (q, k, v)]
        with forced_cp(strategy):
            attention_cp.work_stats["pairs"] = 0
            with CommCounter() as fwd:
                out = F.scaled_dot_product_attention(*dts, is_causal=causal, enable_gqa=hkv != h)
            work = attention_cp.work_stats["pairs"]
            out.backward(dtshard.distribute_tensor(go, m, layout))
        kinds = {kind: fwd.count(kind) for kind in fwd.kinds()}
        rows.append(("striped", seq, sf, masking, heads, strategy, _errs(out, dts, want, ref),
                     tuple(out.placements) == tuple(layout) and all(tuple(d.grad.placements) == tuple(layout)
                                                                 for d in dts), work, kinds))
    # masks on the striped layouts: each kernel call gets the mask's rows and keys at the
    # positions the layout's runs hold
    for seq, sf, kind, heads, strategy in itertools.product(
            (32, 35), ("tokens", 4), ("window_small", "random", "documents"), ("mha", "gqa"),
            ("allgather_kv", "ring", "ulysses")):
        if (seq % 4 and sf == "tokens") or (strategy == "ulysses" and heads != "mha"):
            continue
        split = seq // 4 if sf == "tokens" else sf
        h, hkv = HEADS[heads]
        q, k, v, go, _, _ = _one_process(g, 2, h, hkv, seq, seq, False)
        mask = _mask(kind, 2, h, seq, g)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        want = F.scaled_dot_product_attention(*ref, attn_mask=mask, enable_gqa=hkv != h)
        want.backward(go)
        layout = [_StridedShard(2, split_factor=split)]
        dts = [dtshard.distribute_tensor(t, m, layout).requires_grad_() for t in (q, k, v)]
        with forced_cp(strategy):
            with CommCounter() as fwd:
                out = F.scaled_dot_product_attention(*dts, attn_mask=mask, enable_gqa=hkv != h)
            out.backward(dtshard.distribute_tensor(go, m, layout))
        kinds = {kind: fwd.count(kind) for kind in fwd.kinds()}
        rows.append(("striped_masked", seq, sf, kind, heads, strategy, _errs(out, dts, want, ref),
                     tuple(out.placements) == tuple(layout) and all(tuple(d.grad.placements) == tuple(layout)
                                                                 for d in dts), None, kinds))
    m2 = mesh((2, 2))
    for seq, masking, heads, strategy in itertools.product((8, 11), ("causal", "none"), ("mha", "gqa"),
                                                            ("auto", "allgather_kv", "ring")):
        h, hkv = HEADS[heads]
        causal = masking != "none"
        q, k, v, go, ref, want = _one_process(g, 2, h, hkv, seq, seq, causal)
        layout = [Shard(2), Shard(2)]
        dts = [dtshard.distribute_tensor(t, m2, layout).requires_grad_() for t in (q, k, v)]
        with forced_cp(strategy):
            with CommCounter() as fwd:
                out = F.scaled_dot_product_attention(*dts, is_causal=causal, enable_gqa=hkv != h)
            out.backward(dtshard.distribute_tensor(go, m2, layout))
        kinds = sorted({(r.kind, r.mesh_dim) for r in fwd.records})
        rows.append(("usp", seq, None, masking, heads, strategy, _errs(out, dts, want, ref),
                     tuple(out.placements) == tuple(layout), None, kinds))
    return rows


def test_striped_causal_layouts_balance_the_work_and_usp_on_two_mesh_dims():
    per_rank = run_distributed(_striped_and_usp, 4, timeout=300)
    for rank, rows in enumerate(per_rank):
        for kind, seq, sf, masking, heads, strategy, err, kept, work, kinds in rows:
            case = f"rank {rank}: {kind} S={seq} sf={sf} {masking} {heads} {strategy}"
            assert err < 1e-9, f"{case}: rel error {err:.2e}"
            assert kept, f"{case}: the layout was not kept"
            if kind == "striped_masked":  # the strategy's own collectives: not the rule's path
                # (K and V gathered: an all_gather each, or an all_to_all each for an uneven
                # strided layout, which the redistribute planner moves that way)
                want = {"allgather_kv": ({"all_gather": 2}, {"all_to_all": 2}), "ring": ({"all_to_all": 3},),
                        "ulysses": ({"all_to_all": 5},)}[strategy]
                assert kinds in want, (case, kinds)
            if kind == "usp":
                # Ulysses' all_to_alls on the inner mesh dim, the outer dim's strategy on dim 0
                assert ("all_to_all", 1) in kinds and any(d == 0 for _, d in kinds), (case, kinds)
                assert all(d in (0, 1) for _, d in kinds), (case, kinds)
    # causal work per rank: the striped layouts within 1.25x of the mean (a plain Shard's last
    # rank does 1.73x the mean on this shape: rows 24-31 against 0-31)
    for i, row in enumerate(per_rank[0]):
        kind, seq, sf, masking = row[:4]
        if kind != "striped" or masking != "causal" or seq % 4:
            continue
        works = [per_rank[r][i][8] for r in range(4)]
        mean = sum(works) / 4
        assert max(works) <= 1.25 * mean, (row[:6], works)


def _compiled_layouts():
    """torch.compile(fullgraph=True) of a causal call on the striped layout (ring) and on the
    sequence sharded over both dims of a 2x2 mesh (Ulysses x allgather): one process's values."""
    g = torch.Generator().manual_seed(5)
    errs = []
    for layout_mesh, layout, strategy in (((4,), [_StridedShard(2, split_factor=4)], "ring"),
                                          ((2, 2), [Shard(2), Shard(2)], "auto")):
        q = torch.randn(2, 4, 16, 8, dtype=torch.float64, generator=g)
        k, v = (torch.randn(2, 2, 16, 8, dtype=torch.float64, generator=g) for _ in range(2))
        errs.append(_compiled_error(q, k, v, mesh(layout_mesh), layout, strategy))
    return errs


def test_compiled_fullgraph_striped_and_usp():
    for errs in run_distributed(_compiled_layouts, 4, timeout=300):
        assert max(errs) < 1e-9, errs
