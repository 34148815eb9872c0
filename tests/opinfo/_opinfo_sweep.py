"""The OpInfo sweep: every float32 CPU entry of PyTorch's ``op_db`` on distributed tensors.

Shared by ``tests/opinfo/test_opinfo_sweep.py`` (dtshard, against a generated list of known
failures) and ``tools/opinfo_report.py`` (dtshard next to ``torch.distributed.tensor``).

A **case** is (op, sample, placement scheme).  For each op, up to ``samples_per_op`` sample inputs
are picked deterministically from ``op.sample_inputs`` (generated under a seed derived from the
op's name, so every rank and every run sees the same tensors).  For each sample, every tensor in
its input/args/kwargs gets a placement per scheme (:func:`schemes_for`): all-Replicate, the first
tensor sharded on each of its dims (same-shaped tensors sharded alike, so uneven and empty chunks
occur), other tensors sharded alone, and Partial(sum) inputs whose terms are nontrivial (any op
must give the right value for them: a rule that cannot take a Partial makes the planner reduce it
first).  A case checks, on every rank:

- forward: every output's ``full_tensor()`` against the op on plain tensors (outputs that are not
  deterministic on plain tensors either, like ``empty_like``, compare metadata only), the dtype and
  global shape, and each output's LOCAL shape against its placements;
- backward (ops with autograd): ``torch.autograd.grad`` with fixed random output gradients (laid
  out like the outputs), every input's gradient against the plain gradient, local shapes too.

Random ops run under the same ``torch.manual_seed`` as the plain op and must give the same values.

Statuses: ``pass``, ``error`` (raised), ``wrong`` (silently wrong value), ``shape`` (local shape does
not match the placements: silently wrong too), ``hang`` (no progress: the worker pool was killed).

Work is batched: one ``run_distributed`` call runs a list of cases and appends each result to a
per-rank progress file; the parent watches those files and kills the pool when no case finishes
for ``stall_s`` seconds, records the case in flight as ``hang`` and resumes after it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
import threading
import time
import traceback
import zlib
from dataclasses import dataclass

import torch

SILENT = ("wrong", "shape")  # statuses that mean "silently wrong"

# ---------------------------------------------------------------------------------------------
# op selection (runs in the parent and in the workers)
# ---------------------------------------------------------------------------------------------

_OPS = None


def _op_db():
    global _OPS
    if _OPS is None:
        from torch.testing._internal.common_methods_invocations import op_db

        ops = {}
        for o in op_db:
            if torch.float32 not in o.supported_dtypes("cpu"):
                continue
            key = o.name + ("." + o.variant_test_name if o.variant_test_name else "")
            ops.setdefault(key, o)
        _OPS = ops
    return _OPS


def all_op_keys() -> list[str]:
    return list(_op_db())


def op_seed(key: str) -> int:
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


# ---------------------------------------------------------------------------------------------
# samples and placement schemes
# ---------------------------------------------------------------------------------------------


def _leaves(sample):
    from torch.utils._pytree import tree_flatten

    leaves, spec = tree_flatten((sample.input, sample.args, sample.kwargs))
    return leaves, spec


def _tensor_info(sample):
    leaves, _ = _leaves(sample)
    return [(tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor)]


def _nontensor_sig(sample) -> str:
    leaves, _ = _leaves(sample)
    return repr([a for a in leaves if not isinstance(a, torch.Tensor)])[:200]


def pick_samples(samples: list, k: int) -> list[int]:
    """Deterministic choice of up to ``k`` sample indices (samples over 4096 elements only when
    there is nothing smaller): the first sample whose first tensor has the most dims (<= 4), then
    samples that differ from those chosen in rank, number of tensors or non-tensor arguments."""
    if not samples:
        return []
    infos = [_tensor_info(s) for s in samples]

    def rank_of(i):  # the rank of every tensor (a 1-D input with a 2-D weight is another case)
        return tuple(min(len(shape), 4) for shape, _ in infos[i]) if infos[i] else ()

    def numel(i):
        return sum(math.prod(s) for s, _ in infos[i])

    cand = [i for i in range(len(samples)) if numel(i) <= 4096] or list(range(len(samples)))
    first = max(cand, key=lambda i: (rank_of(i)[:1], -i))
    chosen = [first]
    sigs = [(rank_of(first), len(infos[first]), _nontensor_sig(samples[first]))]
    for level in (2, 0, 1):  # differ in non-tensor args, else in rank, else in tensor count
        for i in cand:
            if len(chosen) >= k:
                return chosen
            sig = (rank_of(i), len(infos[i]), _nontensor_sig(samples[i]))
            if i not in chosen and all(sig[level] != t[level] for t in sigs):
                chosen.append(i)
                sigs.append(sig)
    for i in cand:
        if len(chosen) >= k:
            break
        if i not in chosen:
            chosen.append(i)
    return chosen


def _is_float(dtype) -> bool:
    return dtype.is_floating_point


def schemes_for(infos, mesh_ndim: int, cap: int) -> list[str]:
    """Placement schemes for a sample's tensors, as strings: per tensor ``|``-separated, per mesh
    dim ``.``-separated tokens ``R``, ``S<d>``, ``P`` (Partial sum)."""
    n = len(infos)
    if n == 0:
        return ["-"]
    prim = next((j for j, (s, _) in enumerate(infos) if len(s) > 0), 0)
    pshape = infos[prim][0]
    out = []

    def add(tokens):
        text = "|".join(tokens)
        if text not in out:
            out.append(text)

    R = ".".join(["R"] * mesh_ndim)
    if mesh_ndim == 1:
        add([R] * n)
        for d in range(len(pshape)):
            add([f"S{d}" if s == pshape else "R" for s, _ in infos])
        if _is_float(infos[prim][1]):
            add(["P" if j == prim else "R" for j in range(n)])
        for j, (s, _) in enumerate(infos):
            if j != prim and len(s) > 0 and s != pshape:
                for d in sorted({0, len(s) - 1}):
                    add([f"S{d}" if i == j else "R" for i in range(n)])
        floats = [j for j, (_, dt) in enumerate(infos) if _is_float(dt)]
        if len(floats) > 1:
            add(["P" if j in floats else "R" for j in range(n)])
        # the first tensor sharded while a same-shaped one stays replicated
        if any(j != prim and s == pshape for j, (s, _) in enumerate(infos)) and len(pshape) > 0:
            add([f"S{len(pshape) - 1}" if j == prim else "R" for j in range(n)])
    else:  # 2-D mesh
        nd = len(pshape)
        if nd >= 2:
            add([f"S0.S{nd - 1}" if s == pshape else "R.R" for s, _ in infos])
        if nd >= 1:
            add([f"S{nd - 1}.S{nd - 1}" if s == pshape else "R.R" for s, _ in infos])
        if _is_float(infos[prim][1]):
            last = f"S{nd - 1}" if nd else "R"
            add([f"P.{last}" if j == prim else "R.R" for j in range(n)])
        add(["R.R"] * n)
    return out[:cap]


def strided_schemes_for(infos, cap: int) -> list[str]:
    """Schemes with strided shards (1-D mesh): token ``T<d>`` is ``_StridedShard(d, split_factor=2)``
    (two blocks per rank along ``d``, uneven and empty pieces included), on every tensor shaped
    like the first one, dims 0 and last."""
    if not infos:
        return []
    prim = next((j for j, (s, _) in enumerate(infos) if len(s) > 0), None)
    if prim is None:
        return []
    pshape = infos[prim][0]
    out = []
    for d in sorted({0, len(pshape) - 1}):
        text = "|".join(f"T{d}" if s == pshape else "R" for s, _ in infos)
        if text not in out:
            out.append(text)
    return out[:cap]


def parse_scheme(text: str, n: int, mesh_ndim: int):
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    if text == "-":
        return []
    res = []
    for tok in text.split("|"):
        ps = []
        for t in tok.split("."):
            if t == "R":
                ps.append(Replicate())
            elif t == "P":
                ps.append(Partial("sum"))
            elif t.startswith("T"):
                ps.append(_StridedShard(int(t[1:]), split_factor=2))
            else:
                ps.append(Shard(int(t[1:])))
        res.append(ps)
    assert len(res) == n
    return res


# ---------------------------------------------------------------------------------------------
# backends
# ---------------------------------------------------------------------------------------------


class _Backend:
    name: str

    def __init__(self, mesh):
        self.mesh = mesh
        self.coord = tuple(mesh.get_coordinate())


class _DtshardBackend(_Backend):
    name = "dtshard"

    def __init__(self, mesh):
        super().__init__(mesh)
        import dtshard
        from dtshard.propagate import config

        self.mod = dtshard
        self.DT = dtshard.DTensor
        # every rule's `meta` function is compared with the meta kernel on every sample: a
        # disagreement raises RuleError and shows up as a failure of that op
        config.verify_meta = True

    def from_local(self, local, placements, shape):
        return self.DT.from_local(local, self.mesh, placements, shape=shape)

    def distribute(self, full, placements):
        return self.mod.distribute_tensor(full, self.mesh, placements, src_data_rank=None)

    def local_shape_ok(self, dt):
        local = dt._local_tensor
        ok = (tuple(local.shape) == dt._spec.local_shape(self.coord) and local.dtype == dt.dtype
              and type(local) is torch.Tensor)
        return ok, (
            f"local {type(local).__name__} {tuple(local.shape)} {local.dtype} vs "
            f"{dt._spec.local_shape(self.coord)} {dt.dtype} for {tuple(dt.shape)} {dt.placements}"
        )

    def local(self, dt):
        return dt._local_tensor

    def check_values(self, dt, ref, deterministic, local_ok):
        """Each rank compares its own shard with its slice of the plain result (with the local
        shape check this is what full_tensor() would assemble, and it also checks that Replicate
        copies agree); a Partial output is reduced with full_tensor()."""
        from torch.distributed.tensor.placement_types import Partial

        if any(isinstance(p, Partial) for p in dt.placements):
            full = dt.full_tensor()
            return _values_close(full, ref) if deterministic else ""
        if not local_ok or not deterministic:
            return ""
        from dtshard.spec import take_region

        # the region, not an offset: a view may return a strided shard (several blocks per dim)
        want = take_region(ref.detach(), dt._spec.local_region(self.coord))
        return _values_close(dt._local_tensor, want)


class _TorchBackend(_Backend):
    name = "torch"

    def __init__(self, mesh):
        super().__init__(mesh)
        import torch.distributed.tensor as tdt
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        self.mod = tdt
        self.DT = tdt.DTensor
        self._local_shape = compute_local_shape_and_global_offset

    def from_local(self, local, placements, shape):
        from dtshard.spec import contiguous_strides

        return self.DT.from_local(local, self.mesh, placements, run_check=False, shape=shape,
                                  stride=contiguous_strides(shape))

    def distribute(self, full, placements):
        return self.mod.distribute_tensor(full, self.mesh, placements, src_data_rank=None)

    def local_shape_ok(self, dt):
        want = tuple(self._local_shape(dt.shape, self.mesh, dt.placements)[0])
        got = tuple(dt.to_local().shape)
        return got == want, f"local {got} vs {want} for {tuple(dt.shape)} {dt.placements}"

    def local(self, dt):
        return dt.to_local()

    def check_values(self, dt, ref, deterministic, local_ok):
        full = dt.full_tensor()
        if tuple(full.shape) != tuple(ref.shape):
            return f"full_tensor() has shape {tuple(full.shape)}"
        return _values_close(full, ref) if deterministic else ""


# ---------------------------------------------------------------------------------------------
# one case
# ---------------------------------------------------------------------------------------------


class CaseFailure(Exception):
    def __init__(self, status: str, reason: str):
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _partial_terms(x: torch.Tensor, n: int, c: int) -> torch.Tensor:
    """A nontrivial Partial(sum) term of ``x`` for coordinate ``c`` of ``n``, exact in float:
    rank 0 holds x - round(x), rank 1 round(x), the others 0."""
    if n == 1:
        return x
    r = torch.round(x)
    r = torch.where(torch.isfinite(r), r, torch.zeros_like(r))
    if c == 0:
        return x - r
    if c == 1:
        return r
    return torch.zeros_like(x)


def _local_part(full, mesh_shape, placements, coord):
    from torch.distributed.tensor.placement_types import Partial

    from dtshard.spec import local_region, take_region

    x = take_region(full, local_region(tuple(full.shape), mesh_shape, placements, coord)).detach().clone()
    for i, p in enumerate(placements):
        if isinstance(p, Partial):
            x = _partial_terms(x, mesh_shape[i], coord[i])
    return x


def _reason(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(e).__name__}: {first[:300]}"


def _comparable(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a dense tensor that ``nan_to_num`` and ``equal`` accept (sparse layouts densified,
    complex32 widened: neither op has kernels for those), the same values."""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.dtype == torch.complex32:
        t = t.to(torch.complex64)
    return t


def _same(a, b) -> bool:
    """Are two plain results equal (for the nondeterminism probe)?  NaNs in the same places count
    as equal.  A comparison that cannot be made is "not the same" (False), never a pass."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or a.layout != b.layout:
            return False
        a, b = _comparable(a), _comparable(b)
        if a.is_complex() or a.is_floating_point():
            return bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))) and bool(
                torch.equal(a.isnan(), b.isnan()))
        return bool(torch.equal(a, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an uncomparable pair is not the same
        return False


def _flat(out):
    from torch.utils._pytree import tree_flatten

    return tree_flatten(out)[0]


#: (rtol, atol) per result dtype: fixed, whatever the values' magnitude. Sharding changes the
#: order of a reduction's terms (a Partial summed across ranks, a sum split in blocks), so float
#: results differ from the single-process ones by rounding: a few ulps of the largest term, far
#: under these bounds; a wrong shard, a misplaced block or a lost term is off by the values
#: themselves. Integer and bool results must be equal.
TOLERANCE = {
    torch.float64: (1e-7, 1e-7), torch.complex128: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-4), torch.complex64: (1e-4, 1e-4),
    torch.float16: (1e-3, 1e-3), torch.complex32: (1e-3, 1e-3),
    torch.bfloat16: (1.6e-2, 1e-2),
}

def _tolerance(dtype) -> tuple[float, float]:
    return TOLERANCE.get(dtype, (0.0, 0.0))


def _values_close(got: torch.Tensor, ref: torch.Tensor) -> str:
    """'' when equal within the fixed tolerance of the result's dtype (:data:`TOLERANCE`), else a
    short description. (Ill-conditioned ops get no looser bound here: see FLOAT64_RESCUE.)"""
    rtol, atol = _tolerance(ref.dtype)
    ref = _comparable(ref)
    got = _comparable(got)
    try:
        torch.testing.assert_close(got, ref, rtol=rtol, atol=atol, equal_nan=True,
                                   check_device=False, check_stride=False)
    except AssertionError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return f"wrong value (rtol {rtol:g}, atol {atol:g}: " + "; ".join(lines[1:3])[:200] + ")"
    return ""


class _Checker:
    """Collects the first failure of a case while still running every collective the other ranks
    run (a rank that stopped early would leave the others waiting in a collective)."""

    def __init__(self, be):
        self.be = be
        self.status, self.reason = "pass", ""

    def fail(self, status, reason):
        if self.status == "pass":
            self.status, self.reason = status, reason

    def compare(self, what, got, ref, deterministic: bool):
        be = self.be
        if isinstance(ref, torch.Tensor):
            if not isinstance(got, be.DT):
                # a plain tensor where the single-process op returns a tensor is silently wrong,
                # whatever its values (autograd's own zeros included): it is not the global tensor
                # on any rank that holds a shard, and it loses the layout
                kind = "a plain tensor" if isinstance(got, torch.Tensor) else type(got).__name__
                return self.fail("wrong", f"{what}: got {kind}, expected a DTensor")
            if tuple(got.shape) != tuple(ref.shape) or got.dtype != ref.dtype:
                return self.fail("wrong", f"{what}: global {tuple(got.shape)} {got.dtype} vs "
                                          f"{tuple(ref.shape)} {ref.dtype}")
            ok, msg = be.local_shape_ok(got)
            if not ok:
                self.fail("shape", f"{what}: {msg}")
            err = be.check_values(got, ref, deterministic, local_ok=ok)
            if err:
                self.fail("wrong", f"{what}: {err}")
            return None
        if isinstance(got, torch.Tensor):
            return self.fail("wrong", f"{what}: got a tensor, expected {type(ref).__name__}")
        if deterministic and not _same(got, ref):
            self.fail("wrong", f"{what}: {got!r} vs {ref!r}"[:200])
        return None


_CONTROL = {}


def _agree(ok: bool) -> bool:
    """True when every rank is ok.  The ranks decide together whether to go on (to the backward
    phase, to the next case): a rank that went on alone would leave the others waiting in its
    collectives.  Runs on a group of its own, so a rank stuck in a data collective makes this wait
    too (a clean hang for the watchdog) instead of pairing with the wrong collective."""
    import torch.distributed as dist

    if "group" not in _CONTROL:
        _CONTROL["group"] = dist.new_group(backend="gloo")
    t = torch.tensor([0 if ok else 1], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=_CONTROL["group"])
    return int(t.item()) == 0


def _as_float64(sample):
    """The sample with its float32 tensors (and dtype arguments) in float64, requires_grad kept."""
    def f(t):
        if isinstance(t, torch.dtype):
            return torch.float64 if t == torch.float32 else t
        if t.dtype == torch.float32:
            return t.double().requires_grad_(t.requires_grad)
        return t

    return sample.transform(f)


#: ops whose float32 "wrong" value is checked again in float64: {op: why}. Only these: for any
#: other op a float32 value outside the tolerance stands. A rescued case passes, and the record
#: keeps both runs' verdicts (``rescue``), which the reports list.
FLOAT64_RESCUE: dict[str, str] = {
    "linalg.householder_product": (
        "ill-conditioned: its gradients (up to ~100 on the 5x5 samples) are differences of "
        "products of reflectors, so a reordered float32 sum moves them by ~1e-2 absolute (the "
        "float32 reference itself is that far from float64); in float64 the same case must "
        "pass at rtol = atol = 1e-7"),
}


def _confirm_in_float64(be, opinfo, key, sample, scheme, seed, do_backward, res):
    """A wrong float32 value of an op in :data:`FLOAT64_RESCUE`: run the case again in float64.
    When it then passes on every rank, the float32 difference was rounding and the case passes;
    otherwise the float32 result stands. Returns ``(result, rescue)``, ``rescue`` a dict of both
    runs' verdicts or None."""
    if key not in FLOAT64_RESCUE or not any(dt == torch.float32 for _, dt in _tensor_info(sample)):
        return res, None
    try:
        res64 = _run_case(be, opinfo, _as_float64(sample), scheme, seed, do_backward)
    except Exception as e:  # noqa: BLE001
        res64 = ("error", _reason(e), "", "")
    ok = res64[0] == "pass" and res64[2] in ("pass", "skip", "")
    if not _agree(ok):
        return res, None
    rescue = {"float32": [r for r in (res[1], res[3]) if r], "float64": "pass",
              "why": FLOAT64_RESCUE[key]}
    note = "float32 rounding (equal in float64)"
    return ("pass" if res[0] == "wrong" else res[0], note if res[0] == "wrong" else res[1],
            "pass" if res[2] == "wrong" else res[2], note if res[2] == "wrong" else res[3]), rescue


def _run_case(be, opinfo, sample, scheme: str, seed: int, do_backward: bool) -> tuple[str, str, str, str]:
    """(fwd status, fwd reason, bwd status, bwd reason); bwd status '' when not run."""
    from torch.utils._pytree import tree_unflatten

    leaves, spec = _leaves(sample)
    tpos = [i for i, a in enumerate(leaves) if isinstance(a, torch.Tensor)]
    if not tpos:  # a factory without tensor arguments: no distributed tensor is involved
        return "skip", "no tensor arguments (a factory: no DTensor is involved)", "", ""
    sparse = sorted({str(leaves[i].layout) for i in tpos if leaves[i].layout != torch.strided})
    if sparse:
        return "skip", f"sparse input ({', '.join(sparse)}): DTensors hold strided shards only", "", ""
    mesh_shape = tuple(be.mesh.shape)
    placements = parse_scheme(scheme, len(tpos), len(mesh_shape))

    # reference (plain tensors), twice under the same seed: is it deterministic?
    def plain_inputs():
        vals = list(leaves)
        for i in tpos:
            t = leaves[i].detach().clone()
            vals[i] = t.requires_grad_(leaves[i].requires_grad)
        return vals

    def call(vals):
        inp, args, kwargs = tree_unflatten(vals, spec)
        return opinfo.op(inp, *args, **kwargs)

    try:
        vals = plain_inputs()
        _seed(seed)
        ref = call(vals)
        with torch.no_grad():
            _seed(seed)
            ref2 = call(plain_inputs())
    except Exception as e:  # plain PyTorch cannot run this sample here: the same on every rank
        return "skip", "plain PyTorch raises: " + _reason(e), "", ""
    # uninitialised memory may repeat by chance: never compare the values of empty*
    deterministic = _same(_flat(ref), _flat(ref2)) and "empty" not in opinfo.name

    # distributed inputs (no communication)
    try:
        dvals = list(leaves)
        for j, i in enumerate(tpos):
            t = leaves[i].detach()
            local = _local_part(t, mesh_shape, placements[j], be.coord)
            d = be.from_local(local, placements[j], tuple(t.shape))
            dvals[i] = d.detach().requires_grad_(leaves[i].requires_grad)
    except Exception as e:  # dtshard could not build the inputs: its error, not a skip
        return "error", "inputs: " + _reason(e), "", ""

    fwd = ("pass", "")
    out = None
    try:
        _seed(seed)
        out = call(dvals)
        refs, outs = _flat(ref), _flat(out)
        if len(refs) != len(outs):
            raise CaseFailure("wrong", f"{len(outs)} outputs, expected {len(refs)}")
        chk = _Checker(be)
        for k, (o, r) in enumerate(zip(outs, refs)):
            chk.compare(f"out{k}", o, r, deterministic)
        fwd = (chk.status, chk.reason)
    except CaseFailure as f:
        fwd = (f.status, f.reason)
    except Exception as e:
        fwd = ("error", _reason(e))
    if not _agree(fwd[0] == "pass") or not do_backward:
        return fwd[0], fwd[1], "", ""

    bwd = _backward(be, sample, ref, out, vals, dvals, tpos, leaves, seed, deterministic)
    _agree(bwd[0] in ("pass", "skip", ""))
    return "pass", "", bwd[0], bwd[1]


def _grad_layout(out, ref):
    """Placements of the output gradient: an output's Shard kept; a replicated output of two or
    more rows gets a gradient sharded on dim 0 (a gradient need not arrive in the output's layout,
    and a formula that assumed so would be wrong), Partial outputs a replicated gradient."""
    from torch.distributed.tensor.placement_types import Replicate, Shard, _StridedShard

    ps = [p if type(p) in (Shard, _StridedShard) else Replicate() for p in getattr(out, "placements", [])]
    if ps and all(type(p) is Replicate for p in ps) and ref.dim() >= 1 and ref.shape[0] >= 2:
        ps[-1] = Shard(0)
    return ps


def _backward(be, sample, ref, out, vals, dvals, tpos, leaves, seed, deterministic):
    """(status, reason) of the backward phase. The reference's gradients are computed first, on
    plain tensors only (a failure there is a skip: plain PyTorch cannot differentiate this
    sample); everything that touches a DTensor comes after, so a dtshard failure is an error."""
    fn = sample.output_process_fn_grad
    gin = [j for j, i in enumerate(tpos) if leaves[i].requires_grad]
    try:
        rflat = _flat(fn(ref))
        wanted = [k for k, r in enumerate(rflat) if isinstance(r, torch.Tensor) and r.requires_grad
                  and (r.is_floating_point() or r.is_complex())]
        if not wanted or not gin:
            return "", ""
        g = torch.Generator().manual_seed(seed + 1)
        wref = [torch.randn(rflat[k].shape, generator=g, dtype=rflat[k].dtype) for k in wanted]
        rin = [vals[tpos[j]] for j in gin]
        rgrads = torch.autograd.grad([rflat[k] for k in wanted], rin, wref, allow_unused=True)
    except Exception as e:  # noqa: BLE001 - plain tensors only
        return "skip", "plain PyTorch's backward raises: " + _reason(e)
    try:
        oflat = _flat(fn(out))
        if len(oflat) != len(rflat):
            raise CaseFailure("wrong", f"{len(oflat)} processed outputs, expected {len(rflat)}")
        pairs = [(rflat[k], oflat[k]) for k in wanted]
        for r, o in pairs:
            if not (isinstance(o, torch.Tensor) and o.requires_grad):
                raise CaseFailure("wrong", "an output that needs a gradient does not require grad")
        wdt = [be.distribute(w, _grad_layout(o, r)) if isinstance(o, be.DT) else w
               for w, (r, o) in zip(wref, pairs)]
        din = [dvals[tpos[j]] for j in gin]
        dgrads = torch.autograd.grad([o for _, o in pairs], din, wdt, allow_unused=True)
        chk = _Checker(be)
        for k, (rg, dg) in enumerate(zip(rgrads, dgrads)):
            if rg is None:
                rg = torch.zeros(din[k].shape, dtype=din[k].dtype)
            if dg is None:
                if bool((rg != 0).any()):
                    chk.fail("wrong", f"grad{k}: no gradient")
                continue
            chk.compare(f"grad{k}", dg, rg, deterministic)
        return chk.status, chk.reason
    except CaseFailure as f:
        return f.status, f.reason
    except Exception as e:
        return "error", _reason(e)


# ---------------------------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------------------------

_MESHES: dict = {}


def _mesh(shape):
    shape = tuple(shape)
    if shape not in _MESHES:
        from torch.distributed.device_mesh import init_device_mesh

        _MESHES[shape] = init_device_mesh("cpu", shape)
    return _MESHES[shape]


def _seed(seed: int) -> None:
    # the CPU generator only: torch.manual_seed also seeds lazily-initialised accelerators, and its
    # bookkeeping (a stack trace per call) costs more than a small op
    torch.default_generator.manual_seed(seed)


def _samples(opinfo, key: str):
    """The op's sample inputs, generated under a seed derived from its name (the same tensors on
    every rank and in every run).  Calls ``sample_inputs_func`` directly: ``sample_inputs`` wraps
    it in a tracker that inspects the call stack for every sample, which costs more than the
    sweep itself."""
    import random

    import numpy as np

    seed = op_seed(key)
    _seed(seed)
    random.seed(seed)  # some sample functions draw scalars from Python's or numpy's generator
    np.random.seed(seed)
    return list(opinfo.sample_inputs_func(opinfo, "cpu", torch.float32, opinfo.supports_autograd))


def plan_cases(op_keys, mesh_ndim: int, samples_per_op: int, schemes_per_sample: int,
               strided: bool = False) -> list[tuple]:
    """The case list ``[(op, sample index, scheme)]`` (deterministic; runs anywhere)."""
    ops = _op_db()
    cases = []
    for key in op_keys:
        try:
            samples = _samples(ops[key], key)
        except Exception:
            cases.append((key, -1, "-"))  # recorded as an error by the worker
            continue
        for i in pick_samples(samples, samples_per_op):
            info = _tensor_info(samples[i])
            schemes = strided_schemes_for(info, schemes_per_sample) if strided else \
                schemes_for(info, mesh_ndim, schemes_per_sample)
            for sc in schemes:
                cases.append((key, i, sc))
    return cases


def _warm_up(be) -> None:
    from torch.distributed.tensor.placement_types import Replicate, Shard

    x = torch.arange(6.0).reshape(3, 2)
    d = be.from_local(_local_part(x, tuple(be.mesh.shape), [Shard(0)] * be.mesh.ndim, be.coord),
                      [Shard(0)] * be.mesh.ndim, (3, 2))
    (d * 2 + 1).sum().full_tensor()
    be.distribute(x, [Replicate()] * be.mesh.ndim)
    _agree(True)


def run_cases(backend: str, mesh_shape, cases, progress_dir: str, backward: bool = True):
    """Worker: run ``cases`` on this rank; append each result to the rank's progress file."""
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    rank = dist.get_rank()
    mesh = _mesh(mesh_shape)
    be = _DtshardBackend(mesh) if backend == "dtshard" else _TorchBackend(mesh)
    ops = _op_db()
    path = os.path.join(progress_dir, f"rank{rank}.jsonl")
    results = []
    cache_key, cache_samples = None, None
    prof = None
    if os.environ.get("OPINFO_SWEEP_PROFILE") and rank == 0:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    _warm_up(be)  # first-use costs (imports, groups) must not count against the stall watchdog
    with open(path, "a") as f:
        f.write(json.dumps({"pid": os.getpid()}) + "\n")
        f.flush()
        for idx, (key, si, scheme) in enumerate(cases):
            f.write(json.dumps({"start": idx}) + "\n")
            f.flush()
            t0 = time.perf_counter()
            opinfo = ops[key]
            rescue = None
            try:
                if cache_key != key:
                    cache_key, cache_samples = key, _samples(opinfo, key)
                if si < 0:
                    raise RuntimeError("sample_inputs() failed")
                sample = cache_samples[si]
                res = _run_case(be, opinfo, sample, scheme, op_seed(key) + si,
                                backward and opinfo.supports_autograd)
                if not _agree("wrong" not in (res[0], res[2])):
                    res, rescue = _confirm_in_float64(be, opinfo, key, sample, scheme, op_seed(key) + si,
                                                      backward and opinfo.supports_autograd, res)
            except Exception as e:
                res = ("error", "sweep: " + _reason(e) + " " + traceback.format_exc(limit=-1)[-200:], "", "")
            rec = {"i": idx, "fwd": res[0], "fwd_reason": res[1], "bwd": res[2], "bwd_reason": res[3],
                   "s": round(time.perf_counter() - t0, 4)}
            if rescue is not None:
                rec["rescue"] = rescue
            results.append(rec)
            f.write(json.dumps({"done": rec}) + "\n")
            f.flush()
    if prof is not None:
        prof.disable()
        prof.dump_stats(os.environ["OPINFO_SWEEP_PROFILE"])
    return results


# ---------------------------------------------------------------------------------------------
# parent side: batches, stall watchdog, resume after a hang
# ---------------------------------------------------------------------------------------------


def _read_progress(progress_dir: str, world: int):
    """Per rank: {case index: record}, the index in flight (or None) and the worker pids."""
    done, inflight, pids = [], [], []
    for r in range(world):
        d, cur, pid = {}, None, None
        p = os.path.join(progress_dir, f"rank{r}.jsonl")
        if os.path.exists(p):
            with open(p) as f:
                for line in f:
                    try:
                        j = json.loads(line)
                    except ValueError:
                        continue
                    if "pid" in j:
                        pid = j["pid"]
                    elif "start" in j:
                        cur = j["start"]
                    elif "done" in j:
                        d[j["done"]["i"]] = j["done"]
                        cur = None
        done.append(d)
        inflight.append(cur)
        pids.append(pid)
    return done, inflight, pids


def _merge(recs: list[dict]) -> dict:
    """One record from the ranks' records of a case: the worst status wins."""
    order = {"wrong": 5, "shape": 5, "hang": 4, "error": 3, "skip": 1, "pass": 0, "": -1}
    out = dict(recs[0])
    for r in recs[1:]:
        for ph in ("fwd", "bwd"):
            if order.get(r[ph], 2) > order.get(out[ph], 2):
                out[ph], out[ph + "_reason"] = r[ph], r[ph + "_reason"]
    return out


def run_sweep(backend: str, mesh_shape, cases, *, stall_s: float = 20.0, batch: int = 400,
              backward: bool = True, log=None) -> list[dict]:
    """Run ``cases`` on a worker pool of ``prod(mesh_shape)`` ranks; returns one merged record per
    case (``{"i", "fwd", "fwd_reason", "bwd", "bwd_reason", "s"}``).  Never hangs: a batch that
    makes no progress for ``stall_s`` seconds is killed, its case in flight recorded as ``hang``."""
    from dtshard.testing import run_distributed

    world = math.prod(mesh_shape)
    results: dict[int, dict] = {}
    todo = list(range(len(cases)))
    while todo:
        chunk = todo[:batch]
        with tempfile.TemporaryDirectory(prefix="opinfo_") as pdir:
            box: dict = {}

            def target():
                try:
                    box["res"] = run_distributed(run_cases, world, backend, tuple(mesh_shape),
                                                 [cases[i] for i in chunk], pdir, backward, timeout=None)
                except BaseException as e:  # noqa: BLE001
                    box["err"] = e

            th = threading.Thread(target=target, daemon=True)
            th.start()
            last_change, last_sig = time.monotonic(), None
            killed = False
            while th.is_alive():
                th.join(0.5)
                done, inflight, pids = _read_progress(pdir, world)
                sig = tuple(len(d) for d in done)
                if sig != last_sig:
                    last_sig, last_change = sig, time.monotonic()
                elif not killed and time.monotonic() - last_change > stall_s and all(p is not None for p in pids):
                    killed = True
                    for pid in pids:  # the pool's workers (the harness starts a fresh pool next call)
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except (ProcessLookupError, PermissionError):
                            pass
            done, inflight, _ = _read_progress(pdir, world)
        if "res" in box:
            per_rank = box["res"]
            for j, i in enumerate(chunk):
                results[i] = _merge([per_rank[r][j] for r in range(world)])
            todo = todo[len(chunk):]
            continue
        # a failure: keep what every rank finished, mark the case in flight as hang, go on after it
        if not killed and not any(done) and all(c is None for c in inflight):
            raise box.get("err") or RuntimeError("sweep batch failed")  # the pool itself failed
        finished = [j for j in range(len(chunk)) if all(j in d for d in done)]
        for j in finished:
            results[chunk[j]] = _merge([d[j] for d in done])
        stuck = [c for c in inflight if c is not None]
        if stuck:
            j = min(stuck)
        else:
            j = next((k for k in range(len(chunk)) if k not in finished), None)
            if j is None:
                raise box.get("err") or RuntimeError("sweep batch failed")
        why = "hang: no progress, worker pool killed" if killed else (
            "worker failure: " + str(box.get("err"))[:300].replace("\n", " "))
        results[chunk[j]] = {"i": chunk[j], "fwd": "hang", "fwd_reason": why, "bwd": "", "bwd_reason": "", "s": stall_s}
        if log:
            log(f"  {cases[chunk[j]]}: {why}")
        todo = [i for i in todo if i not in results]
    return [dict(results[i], i=i) for i in range(len(cases))]


# ---------------------------------------------------------------------------------------------
# summaries
# ---------------------------------------------------------------------------------------------


def failure_entries(cases, records) -> dict[str, dict]:
    """``{"op|s<i>|<scheme>|fwd|bwd": {"status", "reason"}}`` for every failing phase."""
    out = {}
    for case, rec in zip(cases, records):
        base = case_base(case)
        if rec["fwd"] not in ("pass", "skip"):
            out[base + "|fwd"] = {"status": rec["fwd"], "reason": rec["fwd_reason"]}
        if rec["bwd"] not in ("pass", "skip", ""):
            out[base + "|bwd"] = {"status": rec["bwd"], "reason": rec["bwd_reason"]}
    return out


def skip_entries(cases, records) -> dict[str, str]:
    """``{"op|s<i>|<scheme>|fwd|bwd": reason}`` for every skipped phase (a factory without tensor
    arguments, a sparse input, a sample plain PyTorch cannot run or differentiate here)."""
    out = {}
    for case, rec in zip(cases, records):
        for ph in ("fwd", "bwd"):
            if rec[ph] == "skip":
                out[f"{case_base(case)}|{ph}"] = rec[ph + "_reason"]
    return out


def rescue_entries(cases, records) -> dict[str, dict]:
    """``{"op|s<i>|<scheme>": {"float32": [reasons], "float64": "pass", "why"}}`` for every case
    that passed only in float64 (:data:`FLOAT64_RESCUE`)."""
    return {case_base(c): r["rescue"] for c, r in zip(cases, records) if r.get("rescue")}


#: what a recorded (known) failure may say: a clear dtshard error, or a limit the README documents.
#: ``--regenerate`` refuses a new failure whose reason matches none of these (a crash inside
#: PyTorch, an internal error, a bare assertion): fix it, or make dtshard raise a clear error.
CLEAR_ERRORS = (
    (r"^NoRuleError: ", "no sharding rule for the op on these placements"),
    (r"^NoMetaKernelError: ", "PyTorch has no meta kernel for the op"),
    (r"^MixedTensorError: ", "a plain tensor mixed with DTensors"),
    (r"^RuntimeError: dtshard: \S+ writes into a DTensor .* view",
     "README, known limits: a write into a view whose plan moved its input"),
    (r"^RuntimeError: \S+ on inputs .*: in-place op would change the placement",
     "README, known limits: an in-place op that would change its tensor's placement"),
)


def unclear_failures(entries: dict[str, dict]) -> dict[str, dict]:
    """The failures of ``entries`` whose reason is not one of :data:`CLEAR_ERRORS`."""
    import re

    pats = [re.compile(p) for p, _ in CLEAR_ERRORS]
    return {k: v for k, v in entries.items()
            if v["status"] != "error" or not any(p.search(v["reason"]) for p in pats)}


@dataclass
class Summary:
    ops: int = 0
    ops_fwd: int = 0  # every case's forward passes
    ops_fwd_bwd: int = 0  # ... and every backward too
    cases: int = 0
    cases_pass: int = 0  # forward and backward (where run) pass
    errors: int = 0
    silent: int = 0
    hangs: int = 0
    skipped: int = 0


def summarize(cases, records) -> tuple[Summary, dict]:
    per_op: dict[str, list] = {}
    s = Summary()
    for (key, _, _), rec in zip(cases, records):
        per_op.setdefault(key, []).append(rec)
    for key, recs in per_op.items():
        real = [r for r in recs if r["fwd"] != "skip"]
        if not real:
            continue
        s.ops += 1
        fwd_ok = all(r["fwd"] == "pass" for r in real)
        s.ops_fwd += fwd_ok
        s.ops_fwd_bwd += fwd_ok and all(r["bwd"] in ("pass", "", "skip") for r in real)
    for rec in records:
        if rec["fwd"] == "skip":
            s.skipped += 1
            continue
        s.cases += 1
        st = {rec["fwd"], rec["bwd"]}
        if rec["fwd"] == "pass" and rec["bwd"] in ("pass", "", "skip"):
            s.cases_pass += 1
        if st & set(SILENT):
            s.silent += 1
        elif "hang" in st:
            s.hangs += 1
        elif "error" in st:
            s.errors += 1
    return s, per_op


# ---------------------------------------------------------------------------------------------
# the configuration the test and the known-failures file share
# ---------------------------------------------------------------------------------------------

#: (mesh shape, samples per op, schemes per sample, ops: None = every float32 op of op_db)
MESH_2 = {"name": "2", "mesh": (2,), "samples_per_op": 3, "schemes_per_sample": 6, "ops": None}
#: a 2x2 mesh (4 ranks) for the ops training leans on most: one sample, three schemes each
OPS_2X2 = [
    "add", "mul", "sub", "div.no_rounding_mode", "where", "sum", "mean", "amax", "var", "std",
    "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.linear", "matmul", "mm", "bmm",
    "addmm", "transpose", "permute", "reshape", "view", "flatten", "unflatten", "cat", "stack", "split",
    "chunk", "select", "index_select", "gather", "nn.functional.dropout", "nn.functional.gelu",
    "nn.functional.relu", "cumsum", "nn.functional.embedding", "nn.functional.cross_entropy",
    "nn.functional.mse_loss", "linalg.vector_norm", "logsumexp", "max.reduction_with_dim", "argmax",
    "masked_fill", "expand", "repeat", "flip", "roll", "tril", "constant_pad_nd", "nn.functional.batch_norm",
    "nn.functional.group_norm", "prod", "topk", "sort",
]
MESH_2X2 = {"name": "2x2", "mesh": (2, 2), "samples_per_op": 1, "schemes_per_sample": 3, "ops": OPS_2X2}
#: strided shards (``_StridedShard(d, 2)``) on 2 ranks: what the planner carries over from every
#: rule's Shard strategies (and the view rules' own strided ones) is checked like everything else
MESH_2_STRIDED = {"name": "2-strided", "mesh": (2,), "samples_per_op": 2, "schemes_per_sample": 2, "ops": None,
                  "strided": True}
CONFIGS = (MESH_2, MESH_2X2, MESH_2_STRIDED)


#: config signature -> its cases (planning them builds every op's samples: seconds; done once)
_CONFIG_CASES: dict = {}


def config_cases(cfg) -> list[tuple]:
    key = repr(sorted(config_signature(cfg).items()))
    if key not in _CONFIG_CASES:
        keys = all_op_keys() if cfg["ops"] is None else [k for k in cfg["ops"] if k in _op_db()]
        _CONFIG_CASES[key] = plan_cases(keys, len(cfg["mesh"]), cfg["samples_per_op"], cfg["schemes_per_sample"],
                                        strided=cfg.get("strided", False))
    return list(_CONFIG_CASES[key])


def config_signature(cfg) -> dict:
    return {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()}


# ---------------------------------------------------------------------------------------------
# the suite's sample of the exhaustive sweep, and the comparison with the known failures
# ---------------------------------------------------------------------------------------------

#: the test suite runs a fixed sample of each configuration's cases (``suite_sample``): per op,
#: this share of its cases (at least one), spread over its placement kinds, and where
#: ``SUITE_EVERY_KIND`` says so at least one case of each kind; ``python tools/opinfo_report.py
#: --check`` runs them all and records its result in ``last_full_sweep.json``.  Measured against
#: the earlier purely random 25% / 34% / 100% sample: as many (op, kind) pairs or more in each
#: configuration (1-D 1544 vs 1537, strided all 679 vs 670, 2x2 all 108) with about a third
#: fewer cases (1555 vs 2380, 679 vs 1103, 108 vs 162).
SUITE_FRACTION = {"2": 0.15, "2-strided": 0.0, "2x2": 0.0}
SUITE_EVERY_KIND = {"2": False, "2-strided": True, "2x2": True}
SUITE_SEED = 0


def placement_kind(scheme: str) -> str:
    """A scheme's kind: the placement letters its inputs use, sorted (``"PRS"``: Partial,
    Replicate and Shard inputs; ``"T"``: strided shards only; ``""``: no tensor input)."""
    return "".join(sorted({ch for ch in scheme if ch in "PRST"}))


def sample_cases(cases, fraction: float, seed: int = SUITE_SEED, every_kind: bool = False) -> list[tuple]:
    """A deterministic sample of ``cases``: for each op, ``ceil(fraction * n)`` of its ``n``
    cases (at least one; with ``every_kind`` at least one per placement kind), taken round-robin
    over its placement kinds (:func:`placement_kind`) so the sample covers as many kinds as its
    size allows; within a kind, drawn by a generator seeded with ``seed`` and the op's name, so
    an op's sample does not change when other ops are added or removed. Keeps the cases' order."""
    import random

    if fraction >= 1.0:
        return list(cases)
    by_op: dict[str, dict[str, list[int]]] = {}
    for i, (key, _, scheme) in enumerate(cases):
        by_op.setdefault(key, {}).setdefault(placement_kind(scheme), []).append(i)
    keep: set[int] = set()
    for key, kinds in by_op.items():
        rng = random.Random(f"{seed}|{key}")
        n = sum(len(v) for v in kinds.values())
        k = max(1, math.ceil(fraction * n), len(kinds) if every_kind else 1)
        order = sorted(kinds)
        rng.shuffle(order)
        for kind in order:
            rng.shuffle(kinds[kind])
        picked: list[int] = []
        r = 0
        while len(picked) < k:
            for kind in order:
                if r < len(kinds[kind]) and len(picked) < k:
                    picked.append(kinds[kind][r])
            r += 1
        keep.update(picked)
    return [c for i, c in enumerate(cases) if i in keep]


def suite_sample(cfg, cases) -> list[tuple]:
    """The test suite's sample of a configuration's cases."""
    return sample_cases(cases, SUITE_FRACTION[cfg["name"]], every_kind=SUITE_EVERY_KIND[cfg["name"]])


def case_base(case) -> str:
    """``op|s<i>|<scheme>``: the prefix of a case's failure keys (see :func:`failure_entries`)."""
    key, si, scheme = case
    return f"{key}|s{si}|{scheme}"


def compare_with_known(cases, records, known_entry) -> list[str]:
    """What is wrong with a sweep of ``cases`` (all of a configuration's, or a sample) against the
    known failures recorded for that configuration (``known_entry``): silently wrong results (always), failures not recorded, and
    recorded failures of these cases that now pass. Returns the report's lines; empty: all good."""
    got = failure_entries(cases, records)
    bases = {case_base(c) for c in cases}
    want = {k: v for k, v in known_entry["failures"].items() if k.rsplit("|", 1)[0] in bases}
    silent = {k: v for k, v in got.items() if v["status"] in SILENT}
    new = {k: v for k, v in got.items() if k not in want and k not in silent}
    fixed = sorted(k for k in want if k not in got)
    skips = skip_entries(cases, records)
    want_skips = {k: v for k, v in known_entry.get("skips", {}).items() if k.rsplit("|", 1)[0] in bases}
    new_skips = {k: v for k, v in skips.items() if want_skips.get(k) != v}
    gone_skips = sorted(k for k in want_skips if k not in skips)
    # Rescues are float32 rounding, which depends on the CPU (its vector width and BLAS kernels
    # reorder sums): the same case is rescued on one machine and passes outright on another. A
    # rescue is therefore reported (``rescue_notes``), not held to the recorded list; what is held
    # is that only FLOAT64_RESCUE's ops are ever rescued, and only when float64 passes at 1e-7.
    stray_rescues = {k: v for k, v in rescue_entries(cases, records).items()
                     if k.split("|", 1)[0] not in FLOAT64_RESCUE}
    lines = []
    if silent:
        lines.append(f"!!! {len(silent)} SILENTLY WRONG result(s) (no exception; fix the rule or make it raise):")
        lines += [f"    {k}: {v['status']}: {v['reason']}" for k, v in sorted(silent.items())]
    if new:
        lines.append(f"{len(new)} new failure(s) not in known_failures.json:")
        lines += [f"    {k}: {v['status']}: {v['reason']}" for k, v in sorted(new.items())]
    if fixed:
        lines.append(f"{len(fixed)} known failure(s) now pass: run `python tools/opinfo_report.py --regenerate`:")
        lines += [f"    {k}" for k in fixed]
    if new_skips:
        lines.append(f"{len(new_skips)} skip(s) not in known_failures.json (a skip checks nothing: "
                     "is the reason right?):")
        lines += [f"    {k}: {v}" for k, v in sorted(new_skips.items())]
    if stray_rescues:
        lines.append(f"{len(stray_rescues)} float64 rescue(s) of an op not in FLOAT64_RESCUE:")
        lines += [f"    {k}: {v}" for k, v in sorted(stray_rescues.items())]
    if gone_skips:
        lines.append(f"{len(gone_skips)} recorded skip(s) no longer happen: "
                     "run `python tools/opinfo_report.py --regenerate`:")
        lines += [f"    {k}" for k in gone_skips]
    return lines


def rescue_notes(cases, records, known_entry) -> list[str]:
    """The float64 rescues of a sweep, for its report: each case's op, sample, scheme and both
    runs' verdicts, marked where it differs from the list the last ``--regenerate`` recorded
    (another CPU rounds float32 sums differently). Informational: :func:`compare_with_known` holds
    the rules a rescue must follow."""
    bases = {case_base(c) for c in cases}
    got = rescue_entries(cases, records)
    want = {k for k in known_entry.get("rescues", {}) if k in bases}
    notes = [f"float64 rescue{'' if k in want else ' (not one where known_failures.json was made)'}: "
             f"{k}: float32 {v['float32']}, float64 {v['float64']}" for k, v in sorted(got.items())]
    notes += [f"recorded rescue passes in float32 on this machine: {k}" for k in sorted(want - set(got))]
    return notes
