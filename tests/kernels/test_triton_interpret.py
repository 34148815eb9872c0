"""The Triton backend of dtshard_kernels, run on CPU in Triton's interpreter.

Every op runs with ``backend="triton"`` on CPU tensors and must equal the reference bit for bit,
over ranks 1..6, every dim, uneven sizes (zeros included), 5 dtypes and non-contiguous layouts.
Also: op registration, ``torch.library.opcheck`` (schema, fake tensor, autograd registration,
AOT dispatch), autograd against the reference, graph capture with ``make_fx`` and
``torch.compile(fullgraph=True, backend="aot_eager")`` running the interpreted kernels.

``TRITON_INTERPRET=1`` must be set before triton and ``dtshard_kernels.triton`` are imported,
hence at the top of this module (pytest imports it at collection, before any test runs).

On a GPU machine the SAME tests run the kernels compiled for the GPU, on CUDA tensors, with
``DTSHARD_KERNEL_TEST_DEVICE=cuda`` (``benchmarks/gpu_check.sh`` does this; run only this module
then, since the interpreter is chosen per process)::

    DTSHARD_KERNEL_TEST_DEVICE=cuda TRITON_INTERPRET=0 python -m pytest tests/kernels/test_triton_interpret.py

Every tensor a test makes is then created on the GPU (random values are drawn on CPU, so they are
the same numbers as in the CPU run, and moved); nothing else changes.
"""

import os

# "cpu" (default): Triton's interpreter on CPU tensors; "cuda": the compiled kernels on the GPU
DEVICE = os.environ.get("DTSHARD_KERNEL_TEST_DEVICE", "cpu").strip().lower()
if DEVICE not in ("cpu", "cuda"):
    raise RuntimeError(f"DTSHARD_KERNEL_TEST_DEVICE must be 'cpu' or 'cuda', got {DEVICE!r}")
# tests/conftest.py defaults TRITON_INTERPRET to 1; the CUDA run must override it before triton loads
os.environ["TRITON_INTERPRET"] = "1" if DEVICE == "cpu" else "0"

import logging  # noqa: E402
import random  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

# triton is part of the [triton] extra the README's test command installs: a triton that does not
# import (missing, or broken by a missing dependency of its interpreter) fails here, never skips
import triton  # noqa: E402

import dtshard_kernels as K  # noqa: E402
import dtshard_kernels.triton as KT  # noqa: E402
from dtshard_kernels import reference as R  # noqa: E402
from dtshard_kernels.triton import copy_kernels as CK  # noqa: E402
from dtshard_kernels.triton import ops as KO  # noqa: E402

if DEVICE == "cpu" and not KT.INTERPRETED:  # pragma: no cover - tests/conftest.py sets TRITON_INTERPRET=1 first
    raise RuntimeError(
        "dtshard_kernels.triton was imported before TRITON_INTERPRET=1 was set, so its kernels "
        "cannot run on CPU in this process (tests/conftest.py sets it; something imported triton "
        "earlier): run `TRITON_INTERPRET=1 pytest tests/kernels`")
if DEVICE == "cuda":  # pragma: no cover - GPU machines only
    # asked for explicitly: a missing GPU or an interpreted build is an error, never a skip
    if not torch.cuda.is_available():
        raise RuntimeError("DTSHARD_KERNEL_TEST_DEVICE=cuda but torch.cuda.is_available() is False")
    if KT.INTERPRETED:
        raise RuntimeError("DTSHARD_KERNEL_TEST_DEVICE=cuda but dtshard_kernels.triton was built for the "
                           "interpreter (TRITON_INTERPRET=1 when triton was imported): run only this module")

# Without a GPU driver, torch's mutation analysis of triton kernels (which compiles them to TTIR)
# fails and logs a long warning before falling back to "every tensor argument is mutated" (so on
# CPU the compiled graphs clone the kernels' inputs; harmless).  torch.compile resets logger
# levels, so drop those records with a filter.
logging.getLogger("torch._higher_order_ops.triton_kernel_wrap").addFilter(
    lambda record: "assuming every input is mutated" not in record.getMessage())

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool]
SHAPES = [(7,), (5, 6), (3, 4, 5), (2, 3, 4, 3), (2, 1, 3, 2, 3)]
LAYOUTS = ["contiguous", "transposed", "stepped"]
T = "triton"


# --------------------------------------------------------------------------------------------
# helpers (kept local: test modules do not import each other)
# --------------------------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _on_device():
    """With DEVICE "cuda", the tensors every test makes (torch.zeros, torch.tensor, ...) are made on
    the GPU; on CPU this does nothing."""
    if DEVICE == "cpu":
        yield
        return
    with torch.device(DEVICE):
        yield


def _values(shape, dtype, gen):
    """Random values drawn on CPU (``gen`` is a CPU generator), then moved to DEVICE (a no-op on CPU),
    so a CUDA run checks the same numbers."""
    if dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen, device="cpu").bool()
    elif dtype == torch.int64:
        t = torch.randint(-(2**40), 2**40, shape, generator=gen, device="cpu")
    else:
        t = torch.randn(shape, generator=gen, device="cpu").to(dtype)
    return t.to(DEVICE)


def randn(shape, seed):
    """``torch.randn(shape)`` from a seeded CPU generator, on DEVICE."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), device="cpu").to(DEVICE)


def make(shape, dtype=torch.float32, layout="contiguous", seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(shape)
    if layout == "contiguous" or len(shape) == 0:
        return _values(shape, dtype, gen)
    # the views are taken on DEVICE (moving a non-dense view would make it contiguous)
    if layout == "transposed":
        return _values(shape[::-1], dtype, gen).permute(*reversed(range(len(shape))))
    if layout == "stepped":
        big = _values(tuple(2 * s + 1 for s in shape), dtype, gen)
        return big[tuple(slice(1, 1 + 2 * s, 2) for s in shape)]
    raise AssertionError(layout)


def split_sizes(total, n, rng):
    cuts = sorted(rng.randint(0, total) for _ in range(n - 1))
    bounds = [0, *cuts, total]
    return [bounds[k + 1] - bounds[k] for k in range(n)]


def cases(seed=0):
    """(shape, dim, sizes, layout, dtype): every rank 1..5 and dim, n in 1..5 with uneven sizes
    (zeros included); layouts and dtypes cycle so that each appears with every rank."""
    rng = random.Random(seed)
    out, k = [], 0
    for shape in SHAPES:
        for d in range(len(shape)):
            for n in (1, 2, 3, 5):
                sizes = split_sizes(shape[d], n, rng)
                dim = d - len(shape) if (n + d) % 2 else d
                out.append((shape, dim, sizes, LAYOUTS[k % 3], DTYPES[k % 5]))
                k += 1
    # ndim 6 with unmergeable strides: exercises the contiguous fallback
    out.append(((2, 2, 1, 2, 2, 3), 5, [1, 2], "stepped", torch.float32))
    out.append(((2, 2, 1, 2, 2, 3), 0, [0, 2], "transposed", torch.int64))
    return out


def _id(case):
    shape, dim, sizes, layout, dtype = case
    return f"{'x'.join(map(str, shape))}-d{dim}-{sizes}-{layout}-{str(dtype)[6:]}"


CASES = cases()


def bits(t):
    """A bit-exact comparable view (NaN payloads, -0.0)."""
    return t.view(CK.int_view_dtype(t.dtype))


def assert_same(out, ref, *inputs):
    assert out.dtype == ref.dtype and out.shape == ref.shape, (out.dtype, ref.dtype, out.shape, ref.shape)
    assert out.is_contiguous()
    assert torch.equal(bits(out), bits(ref))
    if not out.is_floating_point():
        assert torch.equal(out, ref)
    if out.numel():
        for t in inputs:
            if t.numel():
                assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


# --------------------------------------------------------------------------------------------
# registration
# --------------------------------------------------------------------------------------------


def test_ops_registered():
    for name in ("pack", "unpack", "a2a_pack", "a2a_unpack", "slice_copy", "halo_cat", "halo_split"):
        assert name in KT.OP_NAMES
        assert hasattr(torch.ops.dtshard, name), name
        assert isinstance(getattr(torch.ops.dtshard, name).default, torch._ops.OpOverload)


def test_resolve_backend():
    x = torch.zeros(3)
    assert K.resolve_backend(x, "triton") == "triton"
    # auto never picks the interpreter; on CUDA tensors it picks the compiled kernels
    assert K.resolve_backend(x, "auto") == ("reference" if DEVICE == "cpu" else "triton")


# --------------------------------------------------------------------------------------------
# values: triton == reference, bit for bit
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_pack_unpack(case):
    shape, dim, sizes, layout, dtype = case
    x = make(shape, dtype, layout)
    for block in (None, max(sizes) + 1):
        buf = K.pack(x, dim, sizes, block, backend=T)
        assert_same(buf, R.pack(x, dim, sizes, block), x)
        # unpack from a non-contiguous buffer too
        src = buf if layout == "contiguous" else make(buf.shape, dtype, layout, seed=1)
        assert_same(K.unpack(src, dim, sizes, backend=T), R.unpack(src, dim, sizes), src)
    assert torch.equal(K.unpack(buf, dim, sizes, backend=T), x)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_a2a_pack_unpack(case):
    shape, dim, sizes, layout, dtype = case
    x = make(shape, dtype, layout)
    flat = K.a2a_pack(x, dim, sizes, backend=T)
    assert_same(flat, R.a2a_pack(x, dim, sizes), x)
    assert_same(K.a2a_unpack(flat, list(shape), dim, sizes, backend=T), x.contiguous(), flat)
    stepped = make((2 * flat.numel(),), dtype, "contiguous", seed=2)[::2]  # a strided 1-D buffer
    assert_same(K.a2a_unpack(stepped, list(shape), dim, sizes, backend=T),
                R.a2a_unpack(stepped, list(shape), dim, sizes), stepped)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_halo_cat_split(case):
    shape, dim, sizes, layout, dtype = case
    x = make(shape, dtype, layout)
    parts = list(torch.split(x, sizes, dim))
    parts[0] = parts[0].contiguous()  # mixed layouts
    for pads in [(0, 0), (2, 1)]:
        out = K.halo_cat(parts, dim, *pads, backend=T)
        assert_same(out, R.halo_cat(parts, dim, *pads), x, parts[0])
        src = out if layout == "contiguous" else make(out.shape, dtype, layout, seed=3)
        got = K.halo_split(src, dim, sizes, *pads, backend=T)
        ref = R.halo_split(src, dim, sizes, *pads)
        assert isinstance(got, list) and len(got) == len(ref)
        for g, r in zip(got, ref):
            assert_same(g, r, src)


@pytest.mark.parametrize("case", CASES[::3], ids=_id)
def test_slice_copy(case):
    shape, dim, _, layout, dtype = case
    x = make(shape, dtype, layout)
    n = x.shape[dim]
    for start, length in [(0, n), (1, n - 2), (n - 1, 1), (0, 0)]:
        if length >= 0:
            assert_same(K.slice_copy(x, dim, start, length, backend=T), R.slice_copy(x, dim, start, length), x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_all_ops_dtype_layout_sweep(dtype, layout):
    x = make((3, 5, 4), dtype, layout, seed=7)
    for dim, sizes in [(0, [2, 0, 1]), (1, [1, 3, 1]), (-1, [4, 0])]:
        assert_same(K.pack(x, dim, sizes, backend=T), R.pack(x, dim, sizes), x)
        assert_same(K.a2a_pack(x, dim, sizes, backend=T), R.a2a_pack(x, dim, sizes), x)
        assert_same(K.slice_copy(x, dim, 1, 1, backend=T), R.slice_copy(x, dim, 1, 1), x)
        parts = list(torch.split(x, sizes, dim))
        assert_same(K.halo_cat(parts, dim, 1, 2, backend=T), R.halo_cat(parts, dim, 1, 2), x)


def test_bitwise_specials():
    nan_payload = torch.tensor([0x7FC12345, 0xFFC00001 - 2**32], dtype=torch.int32).view(torch.float32)
    x = torch.cat([torch.tensor([float("nan"), -0.0, float("inf"), -float("inf"), 1e-45]), nan_payload])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        y = x.to(dtype) if dtype != torch.float32 else x
        assert_same(K.pack(y, 0, [3, 4], backend=T), R.pack(y, 0, [3, 4]))
        assert_same(K.a2a_pack(y, 0, [5, 2], backend=T), R.a2a_pack(y, 0, [5, 2]))
    h = torch.tensor([0x7C01, 0x8000 - 2**16, 0xFFFF - 2**16], dtype=torch.int16)  # fp16 sNaN, -0, NaN
    for dtype in (torch.float16, torch.bfloat16):
        y = h.view(dtype)
        assert torch.equal(bits(K.slice_copy(y, 0, 0, 3, backend=T)), h)


def test_zero_numel_and_empty():
    x = torch.empty(0, 3)
    # nothing to read but padding to write
    assert_same(K.pack(x, 0, [0, 0], block=2, backend=T), R.pack(x, 0, [0, 0], block=2))
    assert_same(K.pack(x, 1, [1, 2], backend=T), R.pack(x, 1, [1, 2]))
    e = torch.empty(3, 0)
    assert_same(K.pack(e, 1, [], backend=T), R.pack(e, 1, []))
    assert_same(K.unpack(torch.zeros(2, 0, 3), 0, [0, 0], backend=T), torch.zeros(0, 3))
    assert_same(K.a2a_pack(x, 1, [1, 2], backend=T), torch.empty(0))
    assert_same(K.a2a_unpack(torch.empty(0), [0, 3], 1, [1, 2], backend=T), torch.empty(0, 3))
    assert_same(K.slice_copy(x, 1, 1, 2, backend=T), torch.empty(0, 2))
    assert_same(K.halo_cat([torch.empty(2, 0)], 1, 1, 1, backend=T), torch.zeros(2, 2))
    assert_same(K.halo_cat([torch.empty(2, 0), torch.ones(2, 1)], 1, 1, 0, backend=T),
                torch.tensor([[0.0, 1.0], [0.0, 1.0]]))
    assert [p.shape for p in K.halo_split(torch.zeros(2, 2), 1, [0, 0], 1, 1, backend=T)] == [(2, 0), (2, 0)]
    s = make((1, 1, 1))
    assert_same(K.pack(s, 1, [1], block=3, backend=T), R.pack(s, 1, [1], block=3))
    x = torch.arange(4.0).view(4, 1).expand(4, 6)  # stride 0
    assert_same(K.pack(x, 1, [2, 0, 4], backend=T), R.pack(x, 1, [2, 0, 4]))


def test_multi_tile_grid(monkeypatch):
    """Tiny tiles, so that every grid axis (blocks, outer, len, inner tiles) has several tiles."""
    monkeypatch.setattr(CK, "_TILE_ELEMS", 8)
    for dtype, layout in [(torch.float32, "transposed"), (torch.bool, "stepped")]:
        x = make((4, 5, 3), dtype, layout, seed=5)
        for dim, sizes in [(0, [3, 0, 1]), (1, [4, 1]), (2, [1, 2])]:
            assert_same(K.pack(x, dim, sizes, block=6, backend=T), R.pack(x, dim, sizes, block=6), x)
            assert_same(K.a2a_pack(x, dim, sizes, backend=T), R.a2a_pack(x, dim, sizes), x)
            parts = list(torch.split(x, sizes, dim))
            assert_same(K.halo_cat(parts, dim, 3, 2, backend=T), R.halo_cat(parts, dim, 3, 2), x)


def test_one_launch_per_op(monkeypatch):
    launches = []
    real = KO.block_copy
    monkeypatch.setattr(KO, "block_copy", lambda *a, **k: (launches.append(len(a[2])), real(*a, **k)))
    x = make((4, 6, 3), torch.float32, "transposed")
    sizes = [1, 0, 2, 3]
    K.pack(x, 1, sizes, backend=T)
    K.unpack(R.pack(x, 1, sizes), 1, sizes, backend=T)
    K.a2a_pack(x, 1, sizes, backend=T)
    K.a2a_unpack(R.a2a_pack(x, 1, sizes), list(x.shape), 1, sizes, backend=T)
    K.slice_copy(x, 1, 1, 4, backend=T)
    K.halo_split(x, 1, sizes, 0, 0, backend=T)
    assert launches == [4, 4, 4, 4, 1, 4]  # one launch each, carrying all blocks
    launches.clear()
    K.halo_cat(list(torch.split(x, [2, 4], 1)), 1, 1, 1, backend=T)
    assert launches == [1, 1]  # one per part (separate tensors); the zero halos ride along


def test_unsupported_element_size():
    with pytest.raises(TypeError, match="16-byte elements"):
        K.slice_copy(torch.zeros(3, dtype=torch.complex128), 0, 0, 2, backend=T)


def test_validation_through_triton():
    with pytest.raises(ValueError, match=r"dtshard_kernels\.pack: sizes \[3, 2\] sum to 5"):
        K.pack(torch.zeros(4, 6), 1, [3, 2], backend=T)
    with pytest.raises(ValueError, match=r"dtshard_kernels\.unpack: sizes \[4, 1\] exceed"):
        torch.ops.dtshard.unpack(torch.zeros(2, 3), 0, [4, 1])  # the op validates too


# --------------------------------------------------------------------------------------------
# autograd and op checks
# --------------------------------------------------------------------------------------------

_GRAD_FNS = {
    "pack": lambda t, b: K.pack(t, 1, [2, 0, 3], block=4, backend=b),
    "unpack": lambda t, b: K.unpack(t.reshape(2, 2, 5, 3)[:, :, 1:], 1, [4, 2], backend=b),
    "a2a_pack": lambda t, b: K.a2a_pack(t, 2, [2, 1], backend=b),
    "a2a_unpack": lambda t, b: K.a2a_unpack(t.reshape(-1), [4, 5, 3], 1, [2, 3], backend=b),
    "slice_copy": lambda t, b: K.slice_copy(t, -1, 1, 2, backend=b),
    "halo_cat": lambda t, b: K.halo_cat([t, t.narrow(1, 0, 2)], 1, 1, 2, backend=b),
    "halo_split": lambda t, b: torch.cat([p.reshape(-1) for p in K.halo_split(t, 1, [1, 3], 1, 0, backend=b)]),
}


@pytest.mark.parametrize("name", list(_GRAD_FNS))
def test_autograd_matches_reference(name):
    fn = _GRAD_FNS[name]
    results = []
    for backend in ("reference", T):
        x = randn((3, 5, 4), seed=0).transpose(0, 2).requires_grad_()
        y = fn(x, backend)
        w = randn(y.shape, seed=1)
        (y * w).sum().backward()
        results.append((y.detach(), x.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("name", ["pack", "unpack", "a2a_pack", "a2a_unpack", "slice_copy", "halo_cat", "halo_split"])
def test_opcheck(name):
    x = torch.randn(6, 5).requires_grad_()
    args = {
        "pack": (x, 1, [3, 2], 4),
        "unpack": (torch.randn(2, 6, 3).requires_grad_(), 1, [3, 2]),
        "a2a_pack": (x, 0, [1, 0, 5]),
        "a2a_unpack": (torch.randn(30).requires_grad_(), [6, 5], 1, [3, 2]),
        "slice_copy": (x, 0, 1, 3),
        "halo_cat": ([x, torch.randn(6, 2).requires_grad_()], 1, 1, 2),
        "halo_split": (x, 0, [2, 3], 1, 0),
    }[name]
    torch.library.opcheck(getattr(torch.ops.dtshard, name).default, args)


# --------------------------------------------------------------------------------------------
# graph capture and torch.compile
# --------------------------------------------------------------------------------------------


def test_make_fx_capture():
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return torch.ops.dtshard.unpack(torch.ops.dtshard.pack(x, 1, [3, 2], 4), 1, [3, 2])

    x = torch.randn(6, 5)
    gm = make_fx(f, tracing_mode="fake")(x)
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.dtshard.pack.default in targets and torch.ops.dtshard.unpack.default in targets
    assert torch.equal(gm(x), x)


def test_compile_fullgraph_aot_eager():
    """torch.compile traces THROUGH the triton_op: the graph holds the triton kernel HOP, and the
    compiled function runs the (interpreted) kernels."""
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    def f(x, y):
        p = torch.ops.dtshard.pack(x, 1, [3, 0, 2], 4)
        flat = torch.ops.dtshard.a2a_pack(y, 0, [1, 3])
        h = torch.ops.dtshard.halo_cat([y, y], 1, 1, 0)
        return torch.ops.dtshard.unpack(p, 1, [3, 0, 2]) * 2, flat + 1, h

    x = make((6, 5), layout="transposed")
    y = make((4, 3), layout="stepped")
    torch._dynamo.reset()
    backend = AotEagerAndRecordGraphs()
    got = torch.compile(f, fullgraph=True, backend=backend)(x, y)
    want = (x * 2, R.a2a_pack(y, 0, [1, 3]) + 1, R.halo_cat([y, y], 1, 1, 0))
    for g, w in zip(got, want):
        assert torch.equal(g, w)
    hop = torch.ops.higher_order.triton_kernel_wrapper_functional
    launches = [n for n in backend.fw_graphs[0].graph.nodes if n.target is hop]
    assert len(launches) == 5  # pack, unpack, a2a_pack, one per halo_cat part


def test_compile_public_api_with_grad():
    def f(x):
        buf = K.pack(x, 0, [2, 1, 3], backend=T)
        out = K.unpack(buf, 0, [2, 1, 3], backend=T)
        return torch.cat(K.halo_split(K.halo_cat([out], 1, 1, 1, backend=T), 1, [2, 3], 1, 1, backend=T), 1)

    torch._dynamo.reset()
    x = torch.randn(6, 5, requires_grad=True)
    y = torch.compile(f, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(y, x)
    y.backward(torch.arange(30.0).view(6, 5))
    assert torch.equal(x.grad, torch.arange(30.0).view(6, 5))


# --------------------------------------------------------------------------------------------
# the real GPU compiler (no GPU needed): the interpreter cannot catch compiler-only failures
# --------------------------------------------------------------------------------------------


def _compile_launch(monkeypatch, call):
    """Run ``call`` with the launch intercepted and compile that launch for sm_90 the way the JIT
    would specialise it (pointers 16-byte aligned, ints == 1 constexpr, ints % 16 == 0 marked).
    Returns the PTX."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    launches = []

    class _Capture:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launches.append((args, kwargs))

    monkeypatch.setattr(CK, "wrap_triton", lambda kernel: _Capture())
    call()
    (args, kwargs), = launches
    kwargs = dict(kwargs)
    num_warps = kwargs.pop("num_warps")
    kernel = CK.block_copy_kernel
    values = dict(zip(kernel.arg_names, args), **kwargs)
    types = {torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64"}
    signature, constexprs, attrs = {}, {}, {}
    for k, name in enumerate(kernel.arg_names):
        v = values[name]
        if isinstance(v, torch.Tensor):
            signature[name] = "*" + types[v.dtype]
            attrs[(k,)] = [["tt.divisibility", 16]]
        elif name.isupper() or v == 1:
            signature[name] = "constexpr"
            constexprs[(k,)] = v
        else:
            signature[name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                attrs[(k,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return compiled.asm["ptx"]


@pytest.mark.parametrize("case", ["aligned-fp32", "aligned-bf16", "uneven-last-dim", "5d-stepped-dim0", "5d-stepped-dim4"])
def test_compiles_for_gpu(monkeypatch, case):
    if "nvidia" not in getattr(triton.backends, "backends", {}):
        pytest.skip("this triton build ships no nvidia backend, so there is no GPU compiler to "
                    "compile for sm_90 with (PyPI's triton wheels ship it)")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # silence a triton 3.9 warning
    x = torch.zeros(16, 255, 64)
    if case == "aligned-fp32":
        ptx = _compile_launch(monkeypatch, lambda: torch.ops.dtshard.pack(x, 1, [64, 64, 64, 63], None))
    elif case == "aligned-bf16":
        ptx = _compile_launch(monkeypatch, lambda: torch.ops.dtshard.unpack(
            torch.zeros(4, 16, 64, 64, dtype=torch.bfloat16), 1, [64, 64, 64, 63]))
    elif case == "uneven-last-dim":
        ptx = _compile_launch(monkeypatch, lambda: torch.ops.dtshard.a2a_pack(
            torch.zeros(64, 1001, dtype=torch.bool), 1, [251, 251, 251, 248]))
    else:  # 4 unmergeable inner (dim 0) or outer (dim 4) source dims
        y = make((3, 4, 3, 4, 5), torch.int64, "stepped")
        dim = int(case[-1])
        ptx = _compile_launch(monkeypatch, lambda: torch.ops.dtshard.halo_cat([y], dim, 1, 2))
    assert ".entry" in ptx
    if case.startswith("aligned"):  # 16-byte vector loads and stores, masked or not
        assert "ld.global.v4" in ptx and "st.global.v4" in ptx
