"""The pure-PyTorch reference of dtshard_kernels against straightforward torch compositions.

The oracles below are the obvious (multi-pass) spellings: ``torch.split``/``torch.chunk`` +
zero-cat + ``torch.stack`` for pack, ``narrow`` + ``torch.cat`` for the rest.  Also: argument
validation, backend selection, autograd (gradcheck) and a hypothesis test.
"""

from __future__ import annotations

import random

import pytest
import torch

import dtshard_kernels as K
from dtshard_kernels import reference as R

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
SHAPES = [(7,), (5, 6), (3, 4, 5), (2, 3, 4, 3), (2, 1, 3, 2, 3)]
LAYOUTS = ["contiguous", "transposed", "stepped"]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _values(shape, dtype, gen):
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=gen)
    return torch.randn(shape, generator=gen).to(dtype)


def make(shape, dtype=torch.float32, layout="contiguous", seed=0):
    """A tensor of ``shape`` with the given memory layout (values deterministic per seed)."""
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if layout == "contiguous" or len(shape) == 0:
        return _values(shape, dtype, gen)
    if layout == "transposed":  # dims stored in reverse order
        t = _values(shape[::-1], dtype, gen).permute(*reversed(range(len(shape))))
        assert t.shape == shape
        return t
    if layout == "stepped":  # every dim sliced with step 2 out of a bigger tensor, plus an offset
        big = _values(tuple(2 * s + 1 for s in shape), dtype, gen)
        t = big[tuple(slice(1, 1 + 2 * s, 2) for s in shape)]
        assert t.shape == shape
        return t
    raise AssertionError(layout)


def split_sizes(total, n, rng):
    """``n`` sizes >= 0 summing to ``total`` (uneven, zeros likely for small totals)."""
    cuts = sorted(rng.randint(0, total) for _ in range(n - 1))
    bounds = [0, *cuts, total]
    return [bounds[k + 1] - bounds[k] for k in range(n)]


def chunk_sizes(total, n):
    """The sizes torch.chunk produces for n chunks, padded with zeros to n entries."""
    c = -(-total // n) if total else 0
    sizes = [min(c, max(0, total - k * c)) for k in range(n)]
    return sizes


def cases(max_ndim=5, seed=0):
    """(shape, dim, sizes) triples: every rank up to max_ndim, every dim (positive and negative),
    n in 1..5, uneven sizes with zeros and torch.chunk's sizes."""
    rng = random.Random(seed)
    out = []
    for shape in SHAPES:
        if len(shape) > max_ndim:
            continue
        for d in range(len(shape)):
            for n in range(1, 6):
                sizes = split_sizes(shape[d], n, rng) if n % 2 else chunk_sizes(shape[d], n)
                dim = d - len(shape) if (n + d) % 2 else d
                out.append((shape, dim, sizes))
    return out


def full_cases():
    """cases() x every layout, the dtype cycling so that each dtype meets every rank and layout."""
    return [(shape, dim, sizes, layout, DTYPES[k % len(DTYPES)])
            for k, ((shape, dim, sizes), layout) in enumerate(
                (c, lay) for c in cases() for lay in LAYOUTS)]


def _id(case):
    shape, dim, sizes, layout, dtype = case
    return f"{'x'.join(map(str, shape))}-d{dim}-{sizes}-{layout}-{str(dtype)[6:]}"


CASES = full_cases()


def oracle_pack(x, dim, sizes, block=None):
    block = max(sizes, default=0) if block is None else block
    pieces = torch.split(x, sizes, dim) if sizes else []
    padded = []
    for p in pieces:
        zshape = list(p.shape)
        zshape[dim] = block - p.shape[dim]
        padded.append(torch.cat([p, torch.zeros(zshape, dtype=x.dtype)], dim))
    if not padded:
        shape = list(x.shape)
        shape[dim] = block
        return torch.zeros([0, *shape], dtype=x.dtype)
    return torch.stack(padded)


def oracle_unpack(buf, dim, sizes):
    return torch.cat([buf[r].narrow(dim, 0, s) for r, s in enumerate(sizes)], dim)


def oracle_a2a_pack(x, dim, sizes):
    offs = [sum(sizes[:r]) for r in range(len(sizes))]
    return torch.cat([x.narrow(dim, o, s).contiguous().reshape(-1) for o, s in zip(offs, sizes)])


def oracle_a2a_unpack(flat, shape, dim, sizes):
    pieces, start = [], 0
    for s in sizes:
        pshape = list(shape)
        pshape[dim] = s
        n = 1
        for v in pshape:
            n *= v
        pieces.append(flat[start:start + n].reshape(pshape))
        start += n
    return torch.cat(pieces, dim)


def oracle_halo_cat(parts, dim, pad_left, pad_right):
    def zeros(k):
        shape = list(parts[0].shape)
        shape[dim] = k
        return torch.zeros(shape, dtype=parts[0].dtype)

    return torch.cat([zeros(pad_left), *parts, zeros(pad_right)], dim)


def oracle_halo_split(grad, dim, sizes, pad_left, pad_right):
    offs = [pad_left + sum(sizes[:r]) for r in range(len(sizes))]
    return [grad.narrow(dim, o, s).contiguous() for o, s in zip(offs, sizes)]


def assert_new_equal(out, expected, *inputs):
    """``out`` equals ``expected`` (shape, dtype, values), is contiguous, and shares no memory
    with any of ``inputs``."""
    assert out.dtype == expected.dtype
    assert out.shape == expected.shape, (out.shape, expected.shape)
    assert torch.equal(out, expected)
    assert out.is_contiguous()
    if out.numel():
        for t in inputs:
            if t.numel():
                assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


def assert_list_equal(outs, expected, *inputs):
    assert isinstance(outs, list) and len(outs) == len(expected)
    for o, e in zip(outs, expected):
        assert_new_equal(o, e, *inputs)


# --------------------------------------------------------------------------------------------
# values against the oracles
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_pack_unpack(case):
    shape, dim, sizes, layout, dtype = case
    x = make(shape, dtype, layout)
    for block in (None, max(sizes) + 2):
        buf = R.pack(x, dim, sizes, block)
        assert_new_equal(buf, oracle_pack(x, dim, sizes, block), x)
        assert_new_equal(R.unpack(buf, dim, sizes), oracle_unpack(buf, dim, sizes), buf)
        assert torch.equal(R.unpack(buf, dim, sizes), x)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_a2a_pack_unpack(case):
    shape, dim, sizes, layout, dtype = case
    x = make(shape, dtype, layout)
    flat = R.a2a_pack(x, dim, sizes)
    assert flat.dim() == 1
    assert_new_equal(flat, oracle_a2a_pack(x, dim, sizes), x)
    # a2a_unpack ignores shape[dim]: pass a wrong one on purpose
    shape_arg = list(x.shape)
    shape_arg[dim] = 99
    back = R.a2a_unpack(flat, shape_arg, dim, sizes)
    assert_new_equal(back, oracle_a2a_unpack(flat, list(x.shape), dim % x.dim(), sizes), flat)
    assert torch.equal(back, x)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_halo_cat_split(case):
    shape, dim, sizes, layout, dtype = case
    x = make(shape, dtype, layout)
    parts = list(torch.split(x, sizes, dim))
    for pads in [(0, 0), (1, 0), (0, 2), (2, 3)]:
        out = R.halo_cat(parts, dim, *pads)
        assert_new_equal(out, oracle_halo_cat(parts, dim, *pads), x)
        assert_list_equal(R.halo_split(out, dim, sizes, *pads), oracle_halo_split(out, dim, sizes, *pads), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_dtype_layout_sweep(dtype, layout):
    x = make((3, 5, 4), dtype, layout, seed=7)
    for dim, sizes in [(0, [2, 0, 1]), (1, [1, 3, 1]), (-1, [4, 0])]:
        buf = R.pack(x, dim, sizes, 5)
        assert_new_equal(buf, oracle_pack(x, dim, sizes, 5), x)
        assert_new_equal(R.unpack(buf, dim, sizes), x.contiguous(), buf)
        flat = R.a2a_pack(x, dim, sizes)
        assert_new_equal(flat, oracle_a2a_pack(x, dim, sizes), x)
        assert_new_equal(R.a2a_unpack(flat, list(x.shape), dim, sizes), x.contiguous(), flat)
        parts = list(torch.split(x, sizes, dim))
        out = R.halo_cat(parts, dim, 1, 2)
        assert_new_equal(out, oracle_halo_cat(parts, dim, 1, 2), x)
        assert_list_equal(R.halo_split(out, dim, sizes, 1, 2), [p.contiguous() for p in parts], out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_slice_copy(shape, layout, dtype):
    x = make(shape, dtype, layout)
    for d in range(x.dim()):
        n = x.shape[d]
        for start, length in [(0, n), (0, 0), (n, 0), (1, n - 2), (n - 1, 1), (0, 1)]:
            if length < 0:
                continue
            for dim in (d, d - x.dim()):
                out = R.slice_copy(x, dim, start, length)
                assert_new_equal(out, x.narrow(d, start, length).contiguous(), x)
    # narrow()'s negative start
    assert torch.equal(R.slice_copy(x, 0, -1, 1), x.narrow(0, -1, 1))


def test_slice_copy_always_copies():
    x = torch.arange(12.0).view(3, 4)
    out = R.slice_copy(x, 0, 0, 3)  # the full, contiguous range: .contiguous() would be a view
    assert torch.equal(out, x) and out.data_ptr() != x.data_ptr()
    out = R.slice_copy(x, 0, 1, 1)
    assert out.data_ptr() != x.data_ptr()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("dim", [0, 1, -1])
def test_pack_matches_chunk(n, dim):
    """DTensor's torch.chunk layout: pad every chunk to the first one's size and stack."""
    x = make((7, 5, 3), torch.float32, "transposed", seed=n)
    chunks = list(torch.chunk(x, n, dim))
    sizes = [c.shape[dim] for c in chunks] + [0] * (n - len(chunks))
    block = sizes[0]
    ref = []
    for r in range(n):
        c = chunks[r] if r < len(chunks) else x.narrow(dim, 0, 0)
        ref.append(torch.nn.functional.pad(c.movedim(dim, -1), (0, block - c.shape[dim])).movedim(-1, dim))
    assert torch.equal(R.pack(x, dim, sizes), torch.stack(ref))
    assert torch.equal(R.unpack(torch.stack(ref), dim, sizes), x)


# --------------------------------------------------------------------------------------------
# edge cases
# --------------------------------------------------------------------------------------------


def test_zero_numel():
    x = torch.empty(0, 3)
    buf = R.pack(x, 0, [0, 0], block=2)  # nothing to read, but padding to write
    assert buf.shape == (2, 2, 3) and torch.equal(buf, torch.zeros(2, 2, 3))
    assert R.unpack(buf, 0, [0, 0]).shape == (0, 3)
    assert R.pack(x, 1, [1, 2]).shape == (2, 0, 2)
    assert R.pack(torch.empty(3, 0), 1, []).shape == (0, 3, 0)  # n == 0: block defaults to 0
    assert R.a2a_pack(x, 1, [1, 2]).shape == (0,)
    assert R.a2a_unpack(torch.empty(0), [0, 3], 1, [1, 2]).shape == (0, 3)
    assert R.slice_copy(x, 1, 1, 2).shape == (0, 2)
    out = R.halo_cat([torch.empty(2, 0)], 1, 1, 1)
    assert torch.equal(out, torch.zeros(2, 2))
    assert [p.shape for p in R.halo_split(out, 1, [0, 0], 1, 1)] == [(2, 0), (2, 0)]


def test_single_block_and_size_one():
    x = make((1, 1, 1), torch.float32)
    assert torch.equal(R.pack(x, 1, [1]), x.unsqueeze(0))
    assert torch.equal(R.pack(x, 2, [1], block=3)[0, :, :, 1:], torch.zeros(1, 1, 2))
    assert torch.equal(R.a2a_pack(x, 0, [1]), x.reshape(-1))


def test_expanded_input():
    x = torch.arange(4.0).view(4, 1).expand(4, 6)  # stride 0
    sizes = [2, 0, 4]
    assert torch.equal(R.pack(x, 1, sizes), oracle_pack(x, 1, sizes))
    assert torch.equal(R.a2a_pack(x, 1, sizes), oracle_a2a_pack(x, 1, sizes))


def test_bitwise_specials():
    x = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45, 3.0])
    nan2 = torch.tensor([0x7FC12345], dtype=torch.int32).view(torch.float32)  # a NaN payload
    x = torch.cat([x, nan2])
    for out in (R.pack(x, 0, [3, 4]), R.a2a_pack(x, 0, [3, 4]), R.slice_copy(x, 0, 0, 7)):
        flat = out.reshape(-1)[: 7] if out.dim() == 1 else torch.cat([out[0, :3], out[1, :4]])
        assert torch.equal(flat.view(torch.int32), x.view(torch.int32))


# --------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda: R.pack(torch.zeros(4, 6), 1, [3, 2]), r"dtshard_kernels\.pack: sizes \[3, 2\] sum to 5 .*shape \(4, 6\), dim 1"),
        (lambda: R.pack(torch.zeros(4, 6), 2, [6]), r"pack: dim 2 out of range .*\(4, 6\)"),
        (lambda: R.pack(torch.zeros(4, 6), -3, [6]), r"pack: dim -3 out of range"),
        (lambda: R.pack(torch.zeros(4, 6), 1, [3, 3], block=2), r"pack: block must be an int >= max\(sizes\) == 3"),
        (lambda: R.pack(torch.zeros(4, 6), 1, [7, -1]), r"pack: sizes must be >= 0"),
        (lambda: R.pack(torch.zeros(4, 6), 1, 6), r"pack: sizes must be a list of ints"),
        (lambda: R.pack(torch.zeros(4, 6), 1.0, [6]), r"pack: dim must be an int"),
        (lambda: R.pack(torch.tensor(1.0), 0, [1]), r"pack: x must have at least 1 dim, got shape \(\)"),
        (lambda: R.unpack(torch.zeros(2, 3), 0, [1, 1, 1]), r"unpack: len\(sizes\) == 3 but buf holds 2 blocks"),
        (lambda: R.unpack(torch.zeros(2, 3), 0, [4, 1]), r"unpack: sizes \[4, 1\] exceed the block length 3"),
        (lambda: R.unpack(torch.zeros(3), 0, [1, 1, 1]), r"unpack: buf must have shape \(n, \*block_shape\)"),
        (lambda: R.a2a_pack(torch.zeros(4, 6), 0, [1, 2]), r"a2a_pack: sizes \[1, 2\] sum to 3 but x.shape\[0\] == 4"),
        (lambda: R.a2a_unpack(torch.zeros(10), [2, 5], 1, [2, 2]), r"a2a_unpack: flat has 10 elements but .* hold 8"),
        (lambda: R.a2a_unpack(torch.zeros(2, 5), [2, 5], 1, [5]), r"a2a_unpack: flat must be 1-D"),
        (lambda: R.slice_copy(torch.zeros(4, 6), 1, 4, 3), r"slice_copy: range .*\[4, 7\) is outside \[0, 6\] \(shape \(4, 6\), dim 1\)"),
        (lambda: R.halo_cat([torch.zeros(2, 3), torch.zeros(3, 3)], 1, 0, 0), r"halo_cat: parts must agree on all dims but dim 1"),
        (lambda: R.halo_cat([torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64)], 0, 0, 0), r"halo_cat: parts must share dtype"),
        (lambda: R.halo_cat([], 0, 0, 0), r"halo_cat: parts must be a non-empty list"),
        (lambda: R.halo_cat([torch.zeros(2)], 0, -1, 0), r"halo_cat: pad_left must be an int >= 0"),
        (lambda: R.halo_split(torch.zeros(2, 6), 1, [2, 2], 1, 0), r"halo_split: pad_left 1 \+ sum\(sizes \[2, 2\]\) \+ pad_right 0 == 5 but grad.shape\[1\] == 6"),
    ],
)
def test_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_public_api_validates_too():
    with pytest.raises(ValueError, match=r"dtshard_kernels\.pack: sizes"):
        K.pack(torch.zeros(4, 6), 1, [3, 2])
    with pytest.raises(ValueError, match=r"dtshard_kernels\.halo_split"):
        K.halo_split(torch.zeros(4, 6), 1, [3, 2], 0, 0)


# --------------------------------------------------------------------------------------------
# backend selection
# --------------------------------------------------------------------------------------------


def test_backend_selection(monkeypatch):
    x = torch.arange(6.0)
    monkeypatch.delenv("DTSHARD_KERNELS", raising=False)
    assert K.resolve_backend(x) == "reference"  # auto on CPU
    assert K.resolve_backend(x, "reference") == "reference"
    assert K.resolve_backend(x, "AUTO") == "reference"
    monkeypatch.setenv("DTSHARD_KERNELS", "reference")
    assert K.resolve_backend(x) == "reference"
    monkeypatch.setenv("DTSHARD_KERNELS", "bogus")
    with pytest.raises(ValueError, match=r"\$DTSHARD_KERNELS must be one of auto, reference, triton, got 'bogus'"):
        K.pack(x, 0, [6])
    with pytest.raises(ValueError, match=r"backend must be one of"):
        K.pack(x, 0, [6], backend="cuda")
    monkeypatch.delenv("DTSHARD_KERNELS")
    # explicit triton on a CPU tensor needs the interpreter
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError, match=r"dtshard_kernels\.slice_copy: backend 'triton' on a CPU tensor needs"):
        K.slice_copy(x, 0, 0, 1, backend="triton")
    with pytest.raises(RuntimeError, match=r"backend 'triton' needs a CUDA tensor"):
        K.slice_copy(x.to("meta"), 0, 0, 1, backend="triton")


def test_public_functions_use_reference_on_cpu(monkeypatch):
    monkeypatch.delenv("DTSHARD_KERNELS", raising=False)
    x = make((3, 5), torch.float32, "transposed")
    assert torch.equal(K.pack(x, 1, [2, 3]), R.pack(x, 1, [2, 3]))
    assert torch.equal(K.unpack(R.pack(x, 1, [2, 3]), 1, [2, 3]), x)
    assert torch.equal(K.a2a_unpack(K.a2a_pack(x, 0, [1, 2]), [3, 5], 0, [1, 2]), x)
    assert torch.equal(K.slice_copy(x, 1, 1, 2), x[:, 1:3])
    assert torch.equal(K.halo_cat([x], 0, 1, 0)[1:], x)
    assert torch.equal(K.halo_split(x, 0, [2], 1, 0)[0], x[1:])


def test_import_is_lazy():
    import subprocess
    import sys

    code = ("import sys, dtshard_kernels as K; "
            "assert 'triton' not in sys.modules, 'triton imported'; "
            "assert 'dtshard_kernels.triton' not in sys.modules; "
            "assert not any(m == 'dtshard' or m.startswith('dtshard.') for m in sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------------------------
# autograd
# --------------------------------------------------------------------------------------------


def test_gradcheck():
    x = torch.randn(3, 5, 4, dtype=torch.float64).transpose(0, 2).requires_grad_()  # (4, 5, 3)
    fns = [
        lambda t: R.pack(t, 1, [2, 0, 3], block=4),
        lambda t: R.unpack(R.pack(t, 0, [1, 3]), 0, [1, 3]),
        lambda t: R.a2a_pack(t, 2, [2, 1]),
        lambda t: R.a2a_unpack(t.reshape(-1), [4, 5, 3], 1, [2, 3]),
        lambda t: R.slice_copy(t, -1, 1, 2),
        lambda t: R.halo_cat([t, t.narrow(1, 0, 2)], 1, 1, 2),
        lambda t: torch.cat([p.reshape(-1) for p in R.halo_split(t, 1, [1, 3], 1, 0)]),
    ]
    for fn in fns:
        assert torch.autograd.gradcheck(fn, (x,))


# --------------------------------------------------------------------------------------------
# hypothesis
# --------------------------------------------------------------------------------------------

import hypothesis  # noqa: E402  (a [test] dependency)
from hypothesis import strategies as st  # noqa: E402


def _pack_case(draw):
    ndim = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(0, 4), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(-ndim, ndim - 1))
    n = draw(st.integers(1, 5))
    total = shape[dim]
    cuts = sorted(draw(st.lists(st.integers(0, total), min_size=n - 1, max_size=n - 1)))
    bounds = [0, *cuts, total]
    sizes = [bounds[k + 1] - bounds[k] for k in range(n)]
    extra = draw(st.integers(0, 2))
    layout = draw(st.sampled_from(LAYOUTS))
    dtype = draw(st.sampled_from(DTYPES))
    return shape, dim, sizes, extra, layout, dtype


def _roundtrips(case):
    shape, dim, sizes, extra, layout, dtype = case
    x = make(shape, dtype, layout)
    block = max(sizes) + extra
    buf = R.pack(x, dim, sizes, block)
    assert torch.equal(buf, oracle_pack(x, dim, sizes, block))
    assert torch.equal(R.unpack(buf, dim, sizes), x)
    flat = R.a2a_pack(x, dim, sizes)
    assert torch.equal(flat, oracle_a2a_pack(x, dim, sizes))
    assert torch.equal(R.a2a_unpack(flat, list(x.shape), dim, sizes), x)
    parts = list(torch.split(x, sizes, dim))
    out = R.halo_cat(parts, dim, extra, 1)
    assert torch.equal(out, oracle_halo_cat(parts, dim, extra, 1))
    assert all(torch.equal(a, b) for a, b in zip(R.halo_split(out, dim, sizes, extra, 1), parts))


test_hypothesis_roundtrips = hypothesis.settings(max_examples=150, deadline=None)(
    hypothesis.given(st.composite(_pack_case)())(_roundtrips))


def test_numpy_ints_accepted():
    import numpy as np  # a runtime dependency of dtshard (pyproject.toml)

    x = make((4, 5), torch.float32)
    out = K.pack(x, np.int64(1), [np.int64(2), np.int32(3)], block=np.int64(3))
    assert torch.equal(out, oracle_pack(x, 1, [2, 3], 3))
    assert torch.equal(K.slice_copy(x, np.int64(0), np.int64(1), np.int64(2)), x[1:3])
    assert torch.equal(K.halo_cat([x], 0, np.int64(1), 0)[1:], x)
    with pytest.raises(ValueError, match="sizes must be a list of ints"):
        R.pack(x, 1, [True, 4])
