"""``fully_shard(..., reshard_after_forward=k)`` with an int: reshard to k ranks after forward.

PyTorch's semantics: after forward each rank keeps 1/k of the group's parameters (not 1/W), and
backward all-gathers them over a group of k consecutive ranks only (intra-node on a real
cluster), not over all W.  Checked on 4 ranks with k=2 against the same model trained in one
process and against ``reshard_after_forward=True``: the losses and parameters, the collectives
per step (forward all_gathers over 4 ranks, backward all_gathers over 2 with half the bytes,
reduce_scatters over 4), what a block holds between forward and backward; k=1 / k=W reduce to
False / True (as in PyTorch) and a k that does not divide W raises on every rank.
"""

from __future__ import annotations

import pytest
import torch

import dtshard
from dtshard.debug import CommCounter
from dtshard.fsdp import fully_shard
from dtshard.testing import run_distributed
from test_fully_shard import N_BLOCKS, _batch, _dp_index, _full_params, _models, _shard


def _train_k(raf, steps: int = 3):
    mesh = dtshard.init_device_mesh("cpu", (4,))
    model, ref = _models()
    _shard(model, mesh, reshard_after_forward=raf)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    me, n = _dp_index(mesh)
    rows = []
    for step in range(steps):
        x, y = _batch(step, n)
        with CommCounter() as fwd:
            loss = ((model(x[4 * me:4 * me + 4]) - y[4 * me:4 * me + 4]) ** 2).mean()
        g = model.blocks[0]._dtshard_fsdp.group
        kept = (g.state, g._post.numel() if g._post is not None else 0, g.W * g.S)
        with CommCounter() as bwd:
            loss.backward()
        opt.step()
        opt.zero_grad()
        rloss = ((ref(x) - y) ** 2).mean()
        rloss.backward()
        ropt.step()
        ropt.zero_grad()
        sig = lambda recs, kind: sorted((r.group_size, r.nbytes) for r in recs if r.kind == kind)  # noqa: E731
        rows.append((loss.item(), rloss.item(), sig(fwd.records, "all_gather"), sig(bwd.records, "all_gather"),
                     sig(bwd.records, "reduce_scatter"), kept))
    err = max((a - b.detach()).abs().max().item() for a, b in zip(_full_params(model), ref.parameters()))
    return rows, err


def _all_k():
    import warnings

    out = {k: _train_k(k) for k in (2, True)}
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out["k1"] = _train_k(1, steps=1)
        out["k1_warned"] = any("reshard_after_forward=1" in str(x.message) for x in w)
    out["k4"] = _train_k(4, steps=1)
    try:
        fully_shard(torch.nn.Linear(4, 4), mesh=dtshard.init_device_mesh("cpu", (4,)), reshard_after_forward=3)
        out["k3"] = None
    except ValueError as e:
        out["k3"] = str(e)
    # the process group is still usable after the error
    t = dtshard.distribute_tensor(torch.arange(8.0), dtshard.init_device_mesh("cpu", (4,)), [dtshard.Shard(0)])
    out["after"] = t.full_tensor().tolist()
    return out


def test_reshard_after_forward_int_gathers_backward_over_k_ranks():
    res = run_distributed(_all_k, 4, timeout=240)
    N = N_BLOCKS
    for r in res:
        rows2, err2 = r[2]
        rows_t, err_t = r[True]
        assert err2 < 1e-5 and err_t < 1e-5, (err2, err_t)
        for (l2, rl, f2, b2, rs2, kept2), (lt, _, ft, bt, rst, kept_t) in zip(rows2, rows_t):
            assert l2 == lt  # the same computation, only the backward all_gather's group differs
            assert f2 == ft and len(f2) == N + 1 and all(gs == 4 for gs, _ in f2)
            assert rs2 == rst and len(rs2) == N + 1
            # backward: every group (an explicit reshard_after_forward applies to the root too)
            # gathered over 2 ranks; each rank sends its slab of W/k = 2 shards once (2 S
            # elements) instead of its shard to 3 others (3 S)
            assert len(b2) == N + 1 and all(gs == 2 for gs, _ in b2), b2
            assert sorted(nb for _, nb in b2) == sorted(nb * 2 // 3 for _, nb in bt), (b2, bt)
            state, post, full = kept2
            assert state == "sharded" and post == full // 2, kept2  # 1/k of the gathered group
            assert kept_t == ("sharded", 0, kept_t[2])
        assert all(len(b) == 0 for _, _, _, b, _, _ in r["k1"][0])  # k=1: reshard_after_forward=False
        assert r["k1_warned"]
        assert all(len(b) == N + 1 and all(gs == 4 for gs, _ in b) for _, _, _, b, _, _ in r["k4"][0])  # k=W: True
        assert r["k3"] is not None and "divide the shard mesh dim's size 4" in r["k3"], r["k3"]
        assert r["after"] == list(range(8))
    for step, rows in enumerate(zip(*(r[2][0] for r in res))):
        m = sum(row[0] for row in rows) / len(rows)
        assert abs(m - rows[0][1]) < 1e-5, (step, m, rows[0][1])


@pytest.mark.parametrize("k", [2.0, "2"])
def test_reshard_after_forward_bad_type(k):
    with pytest.raises(ValueError, match="reshard_after_forward must be None, a bool, or an int"):
        fully_shard(torch.nn.Linear(2, 2), mesh=object(), reshard_after_forward=k)
