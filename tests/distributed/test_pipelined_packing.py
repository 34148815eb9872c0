"""Pipelined packing (``dtshard.config.pipeline_chunk_bytes``, dtshard/redistribute.py): a large
S(d)->R, P->S(d) or S(d)->S(e) transfer is cut into pieces, each piece's collective in flight
while the next is packed and the previous unpacked.  Forced on for CPU with tiny pieces, against
the one-collective path on the same ranks: the same values bit for bit (and ``full_tensor`` equal
to the single-process tensor), the same plan, the same CommCounter records (one collective, the
same bytes), every element copied at most once each way (exactly once where the one-collective
path copies it), piece j+1 issued before piece j is waited on, gradients equal."""

from __future__ import annotations

import torch

import dtshard
from dtshard import collectives as C
from dtshard.debug import CommCounter
from dtshard.redistribute import plan_text
from dtshard.testing import run_distributed

from _cases import Ps, global_tensor, make_dtensor, mesh

_STARTS = ("start_all_gather", "start_reduce_scatter", "start_all_to_all")


class _Pipelining:
    """Pipelining forced on for CPU meshes with pieces of ``chunk`` bytes (restored on exit: the
    worker processes are reused by other tests)."""

    def __init__(self, chunk: int, cap: int = 8, devices=("cpu",)):
        self.values = {"pipeline_chunk_bytes": chunk, "pipeline_max_chunks": cap, "pipeline_device_types": devices}

    def __enter__(self):
        self.saved = {k: getattr(dtshard.config, k) for k in self.values}
        for k, v in self.values.items():
            setattr(dtshard.config, k, v)
        return self

    def __exit__(self, *exc):
        for k, v in self.saved.items():
            setattr(dtshard.config, k, v)
        return False


class _Events:
    """Log of the piece collectives issued and waited on (collectives.start_* wrapped) and of the
    copy passes redistribute reports (the observers CopyCounter uses), in order."""

    def __init__(self):
        self.log: list = []

    def __enter__(self):
        self.saved = {name: getattr(C, name) for name in _STARTS}
        log = self.log

        class Work:
            def __init__(self, work, j):
                self.work, self.j = work, j

            def wait(self):
                log.append(("wait", self.j))
                return self.work.wait()

        def wrap(fn):
            def start(*args, **kwargs):
                j = sum(1 for e in log if e[0] == "start")
                log.append(("start", j))
                return Work(fn(*args, **kwargs), j)
            return start

        for name, fn in self.saved.items():
            setattr(C, name, wrap(fn))
        self.observe = lambda kind, nbytes: log.append(("copy", kind, nbytes))
        dtshard._trace.copy_observers.append(self.observe)
        return self

    def __exit__(self, *exc):
        dtshard._trace.copy_observers.remove(self.observe)
        for name, fn in self.saved.items():
            setattr(C, name, fn)
        return False

    def starts(self) -> int:
        return sum(1 for e in self.log if e[0] == "start")

    def copied(self, kind: str) -> int:
        return sum(e[2] for e in self.log if e[0] == "copy" and e[1] == kind)

    def pieces(self, kind: str) -> int:
        return sum(1 for e in self.log if e[0] == "copy" and e[1] == kind)


def _full(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:  # arbitrary floats: reductions must agree bit for bit
        return torch.randn(tuple(shape), generator=g).to(dtype)
    return global_tensor(shape, seed, dtype)


def _once(m, full, src, dst, pipelined: bool, chunk: int):
    x = make_dtensor(full, m, Ps(src))
    ctx = _Pipelining(chunk) if pipelined else _Pipelining(0)
    with ctx, CommCounter() as comm, _Events() as ev:
        y = x.redistribute(m, Ps(dst))
        text = plan_text(x._spec, Ps(dst))
    records = [(r.op, r.kind, r.mesh_dim, r.nbytes, r.group_size, r.recv_bytes) for r in comm.records]
    return y, records, ev, text


def _compare(cases):
    """Per case: (ok flags, details) comparing the pipelined and the one-collective paths."""
    out = []
    for mesh_shape, shape, src, dst, dtype_name, chunk, seed in cases:
        dtype = getattr(torch, dtype_name)
        m = mesh(mesh_shape)
        full = _full(shape, dtype, seed)
        ctx = f"{src} -> {dst} shape={shape} mesh={mesh_shape} {dtype_name}"
        y0, rec0, ev0, text0 = _once(m, full, src, dst, False, chunk)
        y1, rec1, ev1, text1 = _once(m, full, src, dst, True, chunk)
        a, b = y0.to_local(), y1.to_local()
        xl = make_dtensor(full, m, Ps(src)).to_local()
        x_bytes = xl.numel() * xl.element_size()
        assert a.dtype == b.dtype == full.dtype and a.shape == b.shape, (ctx, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), f"{ctx}: pipelined local differs by {(a.double() - b.double()).abs().max()}"
        f1 = y1.full_tensor()
        if any(p.startswith("P") for p in src):
            torch.testing.assert_close(f1, full, msg=lambda s: ctx + "\n" + s)
        else:
            assert torch.equal(f1, full), ctx
        assert text0 == text1, (ctx, text0, text1)
        assert rec0 == rec1, (ctx, rec0, rec1)
        assert ev0.starts() == 0, (ctx, ev0.log)
        kinds = ("pack", "unpack", "local")
        out.append({
            "ctx": ctx,
            "records": rec1,
            "starts": ev1.starts(),
            "plain": {k: ev0.copied(k) for k in kinds},
            "piped": {k: ev1.copied(k) for k in kinds},
            "pieces": {k: ev1.pieces(k) for k in kinds},
            "other_copies": [e for e in ev1.log if e[0] == "copy" and e[1] not in kinds],
            "out_bytes": b.numel() * b.element_size(),
            "in_bytes": x_bytes,
            "overlap": _overlapped(ev1.log),
        })
    return out


def _overlapped(log) -> bool:
    """Piece 1 is issued before piece 0 is waited on, and no piece is unpacked before the next
    one is issued (except the last)."""
    starts = [k for k, e in enumerate(log) if e[0] == "start"]
    waits = [k for k, e in enumerate(log) if e[0] == "wait"]
    if len(starts) < 2 or len(waits) != len(starts):
        return False
    return all(waits[j] > starts[j + 1] for j in range(len(starts) - 1))


def _check(results):
    for per_rank in zip(*results):
        ctxs = {r["ctx"] for r in per_rank}
        assert len(ctxs) == 1
        ctx = per_rank[0]["ctx"]
        starts = {r["starts"] for r in per_rank}
        assert len(starts) == 1, (ctx, starts)  # every rank cut the transfer into the same pieces
        for r in per_rank:
            assert r["starts"] >= 2, (ctx, r["starts"])
            assert r["overlap"], ctx
            assert len(r["records"]) == 1, (ctx, r["records"])  # one logical collective
            assert not r["other_copies"], (ctx, r["other_copies"])
            # one pass: every element is copied at most once each way, and never where the
            # one-collective path does not copy it.  "local": a member's own piece of an
            # all_to_all, copied once straight into its place (the one collective copies it
            # into the send buffer, then the backend out of it)
            plain, piped, pieces = r["plain"], r["piped"], r["pieces"]
            assert plain["local"] == 0, (ctx, plain)
            assert piped["pack"] <= plain["pack"] and piped["unpack"] <= plain["unpack"], (ctx, piped, plain)
            assert piped["local"] <= min(r["in_bytes"], r["out_bytes"]), (ctx, piped, r)
            if plain["unpack"]:  # the one collective unpacks every element of the result
                assert plain["unpack"] == r["out_bytes"], (ctx, plain, r["out_bytes"])
                assert piped["unpack"] + piped["local"] == r["out_bytes"], (ctx, piped, r["out_bytes"])
                assert pieces["unpack"] >= 2, (ctx, pieces)
            if plain["pack"] == r["in_bytes"]:  # ... packs every element of the input
                assert piped["pack"] + piped["local"] == r["in_bytes"], (ctx, piped, r["in_bytes"])
                assert pieces["pack"] >= 2, (ctx, pieces)


C16 = 64  # bytes per piece: a few hundred bytes of tensor make 2-8 pieces

_CASES_2 = [
    # S(1) -> R: pieces of rows (lead), uneven columns (padded), fp64, int64
    ((2,), (12, 10), ("S1",), ("R",), "float32", C16, 0),
    ((2,), (13, 7), ("S1",), ("R",), "float32", C16, 1),
    ((2,), (9, 5), ("S1",), ("R",), "float64", C16, 2),
    ((2,), (12, 10), ("S1",), ("R",), "int64", C16, 3),
    # 3-D, the gathered dim after the leading one: pieces of the leading dim
    ((2,), (2, 12, 6), ("S1",), ("R",), "float32", C16, 4),
    ((2,), (3, 13, 6), ("S1",), ("R",), "float32", C16, 5),
    # P -> S(1): each piece lands in place; uneven: pieces of the exact all_to_all + reduction
    ((2,), (12, 10), ("Psum",), ("S1",), "float32", C16, 6),
    ((2,), (12, 10), ("Psum",), ("S1",), "int64", C16, 7),
    ((2,), (11, 10), ("Psum",), ("S1",), "float64", C16, 8),
    ((2,), (12, 7), ("Psum",), ("S1",), "float32", C16, 9),
    ((2,), (12, 7), ("Psum",), ("S1",), "int32", C16, 21),  # the local keeps int32 (not int64)
    ((2,), (12, 8), ("Pmax",), ("S1",), "float32", C16, 10),
    ((2,), (1, 12, 6), ("Psum",), ("S1",), "float32", C16, 11),
    # S0 <-> S1 of 2-D tensors: pairwise pieces; even and uneven
    ((2,), (12, 10), ("S0",), ("S1",), "float32", C16, 12),
    ((2,), (13, 7), ("S0",), ("S1",), "float32", C16, 13),
    ((2,), (12, 10), ("S1",), ("S0",), "float32", C16, 14),
    ((2,), (13, 7), ("S1",), ("S0",), "int64", C16, 15),
    # 3-D: S1 -> S2 and S2 -> S1 in pieces of dim 0, S0 -> S2 pairwise, P -> S2, S2 -> R
    ((2,), (4, 6, 5), ("S1",), ("S2",), "float32", C16, 16),
    ((2,), (3, 7, 5), ("S2",), ("S1",), "float64", C16, 17),
    ((2,), (5, 3, 6), ("S0",), ("S2",), "float32", C16, 18),
    ((2,), (3, 4, 6), ("Psum",), ("S2",), "float32", C16, 19),
    ((2,), (3, 4, 7), ("S2",), ("R",), "float32", C16, 20),
]

_CASES_4 = [
    ((4,), (8, 10), ("S1",), ("R",), "float32", C16, 0),
    ((4,), (9, 7), ("S1",), ("R",), "float64", C16, 1),
    ((4,), (8, 12), ("Psum",), ("S1",), "float32", C16, 2),
    ((4,), (8, 10), ("Psum",), ("S1",), "float32", C16, 3),
    ((4,), (16, 10), ("S0",), ("S1",), "float32", C16, 4),
    ((4,), (13, 9), ("S0",), ("S1",), "int64", C16, 5),
    ((4,), (12, 10), ("S1",), ("S0",), "float32", C16, 6),
    ((4,), (4, 8, 5), ("S1",), ("S2",), "float32", C16, 7),
    # a 2x2 mesh: mesh dim 1's groups hold 3 and 2 rows (dim 0 sharded unevenly on mesh dim 0),
    # yet every rank cuts the same number of pieces
    ((2, 2), (5, 12), ("S0", "S1"), ("S0", "R"), "float32", 16, 7),
    ((2, 2), (5, 12), ("S0", "Psum"), ("S0", "S1"), "float32", 16, 8),
    ((2, 2), (5, 12, 4), ("S0", "S1"), ("S0", "S2"), "float32", 16, 9),
]


#: the gathered dim leads (every dim before it has length 1): the one all_gather lands in place,
#: even and padded, so nothing is unpacked and nothing is pipelined
_IN_PLACE_2 = [
    ((2,), (1, 12, 6), ("S1",), ("R",), "float32", C16, 22),
    ((2,), (1, 13, 6), ("S1",), ("R",), "float32", C16, 23),
]


def test_pipelined_2_ranks():
    results = run_distributed(_compare, 2, _CASES_2 + _IN_PLACE_2)
    k = len(_CASES_2)
    _check([r[:k] for r in results])
    for per_rank in zip(*(r[k:] for r in results)):
        for r in per_rank:
            assert r["starts"] == 0 and len(r["records"]) == 1, (r["ctx"], r["starts"], r["records"])
            # nothing unpacked (the short chunk of the uneven case is padded on the way in)
            assert r["plain"]["unpack"] == 0 and r["plain"] == r["piped"], (r["ctx"], r["plain"], r["piped"])


def test_pipelined_4_ranks_and_2x2():
    _check(run_distributed(_compare, 4, _CASES_4))


# ---------------------------------------------------------------------------------------------
# backward, defaults, tracing
# ---------------------------------------------------------------------------------------------


def _grads(chunk, cases):
    out = []
    for mesh_shape, shape, src, dst, grad_dst in cases:
        m = mesh(mesh_shape)
        full = _full(shape, torch.float32, 3)
        w = _full(shape, torch.float32, 4)
        with _Pipelining(chunk), _Events() as ev:
            x = make_dtensor(full, m, Ps(src)).detach().requires_grad_()
            y = x.redistribute(m, Ps(dst))
            wl = make_dtensor(w, m, Ps(dst)).to_local()
            # the gradient of y arrives with placements grad_dst (Partial: a reduce_scatter back)
            (y.to_local(grad_placements=Ps(grad_dst)) * wl).sum().backward()
        out.append((x.grad.to_local(), str(x.grad.placements), ev.starts()))
    return out


_GRAD_CASES = [
    ((2,), (12, 10), ("S1",), ("R",), ("Psum",)),  # backward: P -> S1, pipelined
    ((2,), (12, 10), ("S0",), ("S1",), ("S1",)),  # backward: S1 -> S0, pipelined
    ((2,), (4, 6, 5), ("S1",), ("S2",), ("S2",)),
]


def _grads_both(cases):
    return _grads(0, cases), _grads(C16, cases)


def test_pipelined_backward_equals_plain():
    for plain, piped in run_distributed(_grads_both, 2, _GRAD_CASES):
        for (g0, p0, s0), (g1, p1, s1), case in zip(plain, piped, _GRAD_CASES):
            assert s0 == 0 and s1 >= 4, (case, s0, s1)  # forward and backward both in pieces
            assert p0 == p1, (case, p0, p1)
            assert torch.equal(g0, g1), case


def _modes():
    m = mesh((2,))
    full = _full((64, 64), torch.float32, 0)
    x = make_dtensor(full, m, Ps(("S1",)))
    res = {}
    with _Pipelining(256), _Events() as ev:
        x.redistribute(m, Ps(("R",)))
    res["forced"] = ev.starts()
    # below twice the piece size: one collective
    with _Pipelining(full.numel() * 4), _Events() as ev:
        x.redistribute(m, Ps(("R",)))
    res["small"] = ev.starts()
    # not on a device type the config does not name
    with _Pipelining(256, devices=("cuda",)), _Events() as ev:
        x.redistribute(m, Ps(("R",)))
    res["device"] = ev.starts()
    # the last step of an async redistribute stays one (unwaited) collective
    with _Pipelining(256), _Events() as ev:
        y = x.redistribute(m, Ps(("R",)), async_op=True)
        assert torch.equal(y.full_tensor(), full)
    res["async"] = ev.starts()
    # the cap on the number of pieces
    with _Pipelining(16, cap=3), _Events() as ev:
        x.redistribute(m, Ps(("R",)))
    res["capped"] = ev.starts()
    return res


def test_when_it_applies():
    for res in run_distributed(_modes, 2):
        assert res == {"forced": 8, "small": 0, "device": 0, "async": 0, "capped": 3}, res


def test_default_pieces():
    """The defaults (8 MiB pieces, CPU and CUDA): a 16 MiB S1->R or P->S1 on 2 ranks goes in 2
    pieces (measured faster than one collective on gloo), an 8 MiB one and the 8 MiB all_to_all
    of a 16 MiB S0->S1 in one collective (pieces of 4 MiB measured no faster), 64 MiB in 8 pieces.
    A function of metadata only: no coordinate goes in, so every rank cuts the same pieces."""
    from types import SimpleNamespace

    from dtshard.redistribute import Step
    from dtshard.redistribute.pipelining import choose_pipe

    cfg = dtshard.config
    assert cfg.pipeline_device_types == ("cpu", "cuda") and cfg.pipeline_chunk_bytes == 8 * 2**20
    assert cfg.pipeline_max_chunks == 8
    S0, S1, R, P = (p for p in Ps(("S0", "S1", "R", "Psum")))

    def pieces(n_rows, src, dst, mesh_shape=(2,)):
        spec = SimpleNamespace(shape=(n_rows, 2048), mesh_shape=mesh_shape, dtype=torch.float32)
        kind = {(S1, R): "all_gather", (P, S1): "reduce_scatter", (S0, S1): "all_to_all"}[(src, dst)]
        pipe = choose_pipe(spec, (src,), Step(0, src, dst, kind), cfg.pipeline_chunk_bytes, cfg.pipeline_max_chunks)
        return None if pipe is None else (pipe.pieces, pipe.dim, pipe.sub)

    assert pieces(2048, S1, R) == (2, 0, False)  # 16 MiB
    assert pieces(2048, P, S1) == (2, 0, False)
    assert pieces(1024, S1, R) is None  # 8 MiB
    assert pieces(2048, S0, S1) is None  # 16 MiB: 8 MiB a rank
    assert pieces(4096, S0, S1) == (2, 0, True)  # 32 MiB: pairwise pieces of the dim-0 blocks
    assert pieces(8192, S1, R) == (8, 0, False)  # 64 MiB
    assert pieces(8192, S1, R, (4,)) == (8, 0, False)


def _traced():
    """Under a dispatch mode and under torch.compile the one-collective path runs (functional
    collectives that trace into graphs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch._dynamo.reset()
    m = mesh((2,))
    full = _full((16, 8), torch.float32, 0)
    x = make_dtensor(full, m, Ps(("S1",)))

    def f(t):
        return t.redistribute(m, Ps(("R",))).to_local() * 2

    with _Pipelining(C16), _Events() as ev:
        with Passthrough():
            y0 = f(x)
        y1 = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    return torch.equal(y0, full * 2) and torch.equal(y1, full * 2), ev.starts()


def test_not_pipelined_while_tracing():
    for ok, starts in run_distributed(_traced, 2, timeout=180):
        assert ok and starts == 0
