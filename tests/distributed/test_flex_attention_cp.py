"""flex_attention on sequence-sharded DTensors (dtshard/rules/flex_attention_cp.py), forward.

{no block mask, a relative-position score_mod, causal, sliding window (w=3, and w wider than a
rank's chunk), a document mask (3 uneven documents, different per batch row: a block mask with
B=2)} with the default 128 block (every rank needs every key: K/V all-gathered) and with blocks of
2 or 3 (each rank receives only the keys its query blocks touch: one all_to_all; the score_mod
then also sees the received keys' global indices) x {MHA, GQA 4:1 with enable_gqa, MQA} x {2 and
4 ranks, a 2x2 mesh with the batch Shard(0) on mesh dim 0} x {sequence divisible by the ranks and
not}: float64 (flex's CPU math path computes in float64 for float64 inputs), the output and the
log-sum-exp against one process's flex_attention on the full tensors (1e-12), on every rank, laid
out like q.

Most cases call the HOP as ``flex_attention`` does with
``_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG`` (no Dynamo: a Dynamo trace costs ~1 s a call on CPU);
a few per mesh go through the public path unchanged (Dynamo with the eager backend: score_mod and
mask_mod become GraphModules, the document ids a captured buffer, and the call runs once on fake
tensors while tracing, where K/V are gathered whole).
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch
import torch.nn.attention.flex_attention as fa
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import dtshard
from dtshard import Replicate, Shard
from dtshard.debug import CommCounter
from dtshard.experimental import implicit_replication
from dtshard.testing import run_distributed

from _cases import mesh

HEADS = {"mha": (4, 4), "gqa": (8, 2), "mqa": (4, 1)}  # GQA 4:1; MQA: one key/value head
TOL = dict(rtol=1e-12, atol=1e-12)


def _relbias(score, b, h, q_idx, kv_idx):
    return score + (q_idx - kv_idx) * 0.1


def _causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _window(w):
    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < w)
    return mask


def _documents(seq):
    """Document ids per batch row: 3 uneven documents, cut at different places in each row."""
    ids = torch.zeros(2, seq, dtype=torch.long)
    for b, (c1, c2) in enumerate(((seq // 2, seq - 1), (1, seq // 2 + 1))):
        ids[b, c1:] = 1
        ids[b, c2:] = 2
    return ids


def _doc_mask(ids):
    def mask(b, h, q_idx, kv_idx):
        return (ids[b, q_idx] == ids[b, kv_idx]) & (q_idx >= kv_idx)
    return mask


def _masks(seq, n):
    """(name, mask_mod or None, block-mask batch size, score_mod or None)."""
    wide = -(-seq // n) + 2  # wider than a rank's chunk
    return [("none", None, None, None), ("relbias", None, None, _relbias), ("causal", _causal, None, None),
            ("window3+relbias", _window(3), None, _relbias), ("window_wide", _window(wide), None, None),
            ("documents+relbias", _doc_mask(_documents(seq)), 2, _relbias)]


def _inputs(seq, heads):
    h, hkv = HEADS[heads]
    g = torch.Generator().manual_seed(seq * 7 + h)
    return [torch.randn(2, hh, seq, 8, generator=g, dtype=torch.float64) for hh in (h, hkv, hkv)]


@contextlib.contextmanager
def _no_dynamo(on: bool):
    old = fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG
    fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = on
    try:
        yield
    finally:
        fa._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = old


def _check(m, placements, seq, heads, mask_mod, mb, score_mod, block, dynamo, compiled=False):
    """One case: (max abs error of out, of lse, layouts kept, collective kinds, bytes received,
    bytes an all-gather of K and V receives).  ``dynamo``: flex_attention's own Dynamo path;
    ``compiled``: the call inside ``torch.compile(fullgraph=True)`` (aot_eager, static shapes),
    under ``implicit_replication()`` (a mod that indexes a captured plain tensor, the document ids,
    is traced with 0-d DTensor indices)."""
    q, k, v = _inputs(seq, heads)
    gqa = q.shape[1] != k.shape[1]
    bm = None if mask_mod is None else create_block_mask(mask_mod, mb, None, seq, seq, device="cpu",
                                                          BLOCK_SIZE=block)
    with _no_dynamo(True):
        want, want_lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True)
    dts = [dtshard.distribute_tensor(t, m, placements) for t in (q, k, v)]
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(lambda a, b, c: flex_attention(a, b, c, score_mod=score_mod, block_mask=bm, enable_gqa=gqa,
                                                          return_lse=True),
                           backend="aot_eager", fullgraph=True, dynamic=False)
        with implicit_replication():
            out, lse = fn(*dts)
    else:
        with _no_dynamo(not dynamo), CommCounter() as comm:
            out, lse = flex_attention(*dts, score_mod=score_mod, block_mask=bm, enable_gqa=gqa, return_lse=True)
    coord = m.get_coordinate()
    laid_out = all(type(t) is dtshard.DTensor and tuple(t.placements) == tuple(placements)
                   and tuple(t._local_tensor.shape) == tuple(t._spec.local_shape(coord)) for t in (out, lse))
    errs = ((out.full_tensor() - want).abs().max().item(), (lse.full_tensor() - want_lse).abs().max().item())
    n = m.shape[-1]
    others = m.shape[0] if len(m.shape) == 2 else 1
    row = 8 * k.element_size() * k.shape[0] * k.shape[1] // others  # one key (or value) row of this rank
    gathered = sum((n - 1) * -(-seq // n) * row for _ in (k, v))  # padded to the largest chunk
    if dynamo or compiled:  # (a trace's run on fake tensors would be counted too)
        return errs, laid_out, {}, 0, gathered
    return errs, laid_out, {kind: comm.count(kind) for kind in comm.kinds()}, int(comm.received()), gathered


def _run(mesh_shape, compiled=False):
    """The matrix on ``mesh_shape``: eagerly (the HOP without Dynamo, and one case through
    flex_attention's own Dynamo path), or every case compiled (``tools/cp_matrix.py``)."""
    m = mesh(mesh_shape)
    placements = [Replicate()] * len(mesh_shape)
    placements[-1] = Shard(2)
    if len(mesh_shape) == 2:
        placements[0] = Shard(0)  # the batch on the other mesh dim
    n = mesh_shape[-1]
    results = []
    for seq, heads in itertools.product((2 * n, 2 * n + 3), HEADS):
        for name, mask_mod, mb, score_mod in _masks(seq, n):
            # one KV block of 128 (K/V gathered whole), or blocks of 3 (2 for the wide window)
            block = 128 if seq % n == 0 else 2 if name == "window_wide" else 3
            case = (name, block, heads, seq, mesh_shape)
            try:
                results.append((case, compiled) + _check(m, placements, seq, heads, mask_mod, mb, score_mod, block,
                                                         False, compiled))
            except Exception as e:
                raise AssertionError(case + (("compiled",) if compiled else ())) from e
    if compiled:
        return results
    # through Dynamo, as flex_attention runs by default (score_mod and mask_mod traced into
    # GraphModules; the HOP run once on fake tensors for metadata, then on the real ones)
    seq = 2 * n + 3
    case = ("dynamo causal+relbias", 3, "gqa", seq, mesh_shape)
    try:
        results.append((case, True) + _check(m, placements, seq, "gqa", _causal, None, _relbias, 3, True))
    except Exception as e:
        raise AssertionError(case) from e
    return results


def check_flex(per_rank, mesh_shape, compiled=False) -> int:
    """The verdict on :func:`_run`'s results from every rank (the test's, and
    ``tools/cp_matrix.py``'s on the compiled matrix); returns the number of cases checked."""
    selective, cases = 0, 0
    for rank_results in per_rank:
        assert len(rank_results) == len(per_rank[0])
        for case, dynamo, (err_out, err_lse), laid_out, kinds, received, gathered in rank_results:
            cases += 1
            assert err_out < 1e-12 and err_lse < 1e-12, (case, err_out, err_lse)
            assert laid_out, case
            if dynamo:
                continue
            name, block = case[0], case[1]
            if name in ("none", "relbias") or block == 128:  # one KV block: every rank needs every key
                assert kinds == {"all_gather": 2}, (case, kinds)
                assert received <= 1.25 * gathered, (case, received, gathered)
            else:  # the keys of the KV blocks this rank's query blocks touch, K and V in one exchange
                assert kinds in ({"all_to_all": 1}, {"all_gather": 2}), (case, kinds)
                assert received <= gathered, (case, received, gathered)
                selective += kinds == {"all_to_all": 1}
    assert compiled or selective > 0
    return cases


@pytest.mark.parametrize("mesh_shape", [(2,), (4,), (2, 2)], ids=["2", "4", "2x2"])
def test_flex_attention_on_sequence_shards(mesh_shape):
    check_flex(run_distributed(_run, math.prod(mesh_shape), mesh_shape), mesh_shape)


def _windowed_receives_less(world):
    """A window of 3 in blocks of 2 over 4 ranks of 4 rows: each rank needs the keys of its own
    chunk and one block before it, so it receives 2 rows of K and V (rank 0 none), not 12."""
    m = mesh((world,))
    q, k, v = _inputs(4 * world, "mqa")
    bm = create_block_mask(_window(3), None, None, 4 * world, 4 * world, device="cpu", BLOCK_SIZE=2)
    dts = [dtshard.distribute_tensor(t, m, [Shard(2)]) for t in (q, k, v)]
    with _no_dynamo(True), CommCounter() as comm:
        out = flex_attention(*dts, block_mask=bm, enable_gqa=True)
    with _no_dynamo(True):
        want = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(out.full_tensor(), want, **TOL)
    return comm.received(), 2 * 2 * 2 * 8 * 8  # 2 rows of K and of V, batch 2, 1 head, 8 floats of 8 bytes


def test_a_window_moves_only_the_keys_it_needs():
    results = run_distributed(_windowed_receives_less, 4, 4)
    assert results[0][0] == 0
    for received, two_rows in results[1:]:
        assert received == two_rows


def _other_layouts(world):
    """Layouts the context-parallel path does not take run replicated, laid out as q."""
    m = mesh((world,))
    q, k, v = _inputs(2 * world + 1, "mha")
    bm = create_block_mask(_causal, None, None, q.shape[2], q.shape[2], device="cpu")
    with _no_dynamo(True):
        want = flex_attention(q, k, v, score_mod=_relbias, block_mask=bm)
    out = []
    for pq, pkv in (([Shard(2)], [Replicate()]), ([Shard(1)], [Shard(1)]), ([Replicate()], [Replicate()])):
        dts = [dtshard.distribute_tensor(t, m, p) for t, p in ((q, pq), (k, pkv), (v, pkv))]
        with _no_dynamo(True):
            got = flex_attention(*dts, score_mod=_relbias, block_mask=bm)
        torch.testing.assert_close(got.full_tensor(), want, **TOL)
        out.append(tuple(got.placements) == tuple(pq))
    return out


def test_other_layouts_run_replicated():
    for kept in run_distributed(_other_layouts, 2, 2):
        assert kept == [True, True, True]


def _backward_raises(world):
    m = mesh((world,))
    q, k, v = _inputs(2 * world, "mha")
    dts = [dtshard.distribute_tensor(t, m, [Shard(2)]).requires_grad_() for t in (q, k, v)]
    msgs = []
    try:  # torch's own check, on the DTensors as on plain tensors
        flex_attention(*dts)
    except NotImplementedError as e:
        msgs.append(str(e))
    # the HOP called directly: the forward runs, its backward raises instead of being wrong
    from torch._higher_order_ops.flex_attention import flex_attention as hop
    bm = create_block_mask(_causal, None, None, 2 * world, 2 * world, device="cpu")
    out, _, _ = hop(*dts, lambda s, b, h, qi, ki: s, bm.as_tuple(), 8 ** -0.5,
                    fa._apply_kernel_options(q, k, v, False, None))
    try:
        out.sum().backward()
    except NotImplementedError as e:
        msgs.append(str(e))
    return msgs


def test_backward_raises():
    for msgs in run_distributed(_backward_raises, 2, 2):
        assert len(msgs) == 2, msgs
        assert "does not support backward on CPU" in msgs[0]
        assert "dtshard flex_attention: the backward" in msgs[1]


def _compiled(world):
    """torch.compile(fullgraph=True) (aot_eager: the traced graph holds the K/V gather and the local
    block mask made from the wrapped mask_mod); and the known limit: through Dynamo a mod that
    indexes a captured plain tensor raises dtshard's mixed-tensor error (Dynamo's example indices
    for the mods are 0-d DTensors), never a wrong result (under ``implicit_replication()`` it runs:
    ``tools/cp_matrix.py`` compiles the document masks that way)."""
    m = mesh((world,))
    seq = 2 * world + 3
    q, k, v = _inputs(seq, "gqa")
    bm = create_block_mask(_window(3), None, None, seq, seq, device="cpu", BLOCK_SIZE=3)
    with _no_dynamo(True):
        want = flex_attention(q, k, v, score_mod=_relbias, block_mask=bm, enable_gqa=True)
    dts = [dtshard.distribute_tensor(t, m, [Shard(2)]) for t in (q, k, v)]
    f = torch.compile(lambda a, b, c: flex_attention(a, b, c, score_mod=_relbias, block_mask=bm, enable_gqa=True),
                      fullgraph=True, backend="aot_eager")
    out = f(*dts)
    torch.testing.assert_close(out.full_tensor(), want, **TOL)
    docs = create_block_mask(_doc_mask(_documents(seq)), 2, None, seq, seq, device="cpu")
    try:
        flex_attention(*dts, block_mask=docs, enable_gqa=True)
        error = ""
    except Exception as e:
        error = str(e)
    return tuple(map(str, out.placements)), "MixedTensorError" in error and "aten.index.Tensor" in error


def test_compiled_fullgraph():
    for placements, limit_raises in run_distributed(_compiled, 2, 2):
        assert placements == ("S(2)",)
        assert limit_raises
