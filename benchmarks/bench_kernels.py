"""Achieved bandwidth of the dtshard_kernels packing ops.

For each size (MiB of input) and op, prints the achieved GB/s ((bytes read + bytes written) /
time) of

- ``kernel``: the dtshard_kernels op with the chosen backend (``auto``: the reference on CPU,
  Triton on CUDA),
- ``copy_``: a plain ``dst.copy_(src)`` moving the same number of output bytes into a
  preallocated ``dst`` (the roofline),
- ``clone``: ``src.clone()`` of the same bytes, i.e. a copy INCLUDING the allocation of its
  output, as every op here allocates its result (on CPU, fresh large allocations are mmapped and
  page-faulted on first touch, which can dominate: compare the kernel with this column),
- ``torch``: the multi-op torch composition DTensor uses for the same job (chunk + pad + stack,
  split + contiguous + cat, cat with zeros, ...), counted with the SAME logical bytes, so its GB/s
  is an "effective" bandwidth;

and the ratios ``kernel/copy_`` (fraction of the roofline), ``kernel/clone`` and
``torch/kernel`` (time of the composition over the time of the kernel: > 1 means the kernel is
faster).

    python benchmarks/bench_kernels.py                   # 1, 16, 64 MiB on cuda if available
    python benchmarks/bench_kernels.py --quick           # smoke run (< 20 s on CPU)
    python benchmarks/bench_kernels.py --sizes 4 256 --device cuda --dtype bfloat16 --n 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dtshard_kernels as K

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64, "bool": torch.bool}


def chunk_sizes(total: int, n: int) -> list[int]:
    c = -(-total // n) if total else 0
    return [min(c, max(0, total - k * c)) for k in range(n)]


def _timer(device: torch.device, reps: int, warmup: int):
    def run(fn) -> float:
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            times = []
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            return statistics.median(times)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return run


def _pad_to(t: torch.Tensor, dim: int, block: int) -> torch.Tensor:
    """DTensor's pad_tensor: F.pad along ``dim`` (on the last dims, hence the movedim dance)."""
    if t.shape[dim] == block:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim) + [0, block - t.shape[dim]]
    return torch.nn.functional.pad(t, pad)


def make_cases(x: torch.Tensor, dim: int, n: int, backend: str | None):
    """(name, kernel fn, torch-composition fn, bytes moved, output bytes) for each op."""
    item = x.element_size()
    sizes = chunk_sizes(x.shape[dim], n)
    block = sizes[0]
    nbytes = x.numel() * item
    per = x.numel() // x.shape[dim]
    buf = K.pack(x, dim, sizes, backend="reference")
    flat = K.a2a_pack(x, dim, sizes, backend="reference")
    halo = 2
    left, right = x.narrow(dim, 0, halo).clone(), x.narrow(dim, x.shape[dim] - halo, halo).clone()
    padded = K.halo_cat([left, x, right], dim, 1, 1, backend="reference")
    start, length = sizes[0], sizes[1]
    shape = list(x.shape)

    def torch_pack():  # DTensor: chunk, pad every chunk to the first one's size, stack
        return torch.stack([_pad_to(c, dim, block) for c in torch.chunk(x, n, dim)])

    def torch_unpack():  # DTensor: chunk the gathered buffer, unpad, cat along dim
        return torch.cat([c[0].narrow(dim, 0, s) for c, s in zip(torch.chunk(buf, n, 0), sizes)], dim)

    def torch_a2a_pack():  # split, make each piece contiguous, flatten, cat
        return torch.cat([p.contiguous().view(-1) for p in torch.split(x, sizes, dim)])

    def torch_a2a_unpack():
        pieces = torch.split(flat, [s * per for s in sizes])
        return torch.cat([p.view(shape[:dim] + [s] + shape[dim + 1:]) for p, s in zip(pieces, sizes)], dim)

    def torch_halo_cat():
        zl = torch.zeros(shape[:dim] + [1] + shape[dim + 1:], dtype=x.dtype, device=x.device)
        return torch.cat([zl, left, x, right, zl], dim)

    def torch_halo_split():
        return [padded.narrow(dim, 1 + o, s).contiguous()
                for o, s in zip([0, halo, halo + shape[dim]], [halo, shape[dim], halo])]

    b = backend
    out_pack = buf.numel() * item
    halo_bytes = (left.numel() + right.numel()) * item
    return [
        ("pack", lambda: K.pack(x, dim, sizes, backend=b), torch_pack, nbytes + out_pack, out_pack),
        ("unpack", lambda: K.unpack(buf, dim, sizes, backend=b), torch_unpack, 2 * nbytes, nbytes),
        ("a2a_pack", lambda: K.a2a_pack(x, dim, sizes, backend=b), torch_a2a_pack, 2 * nbytes, nbytes),
        ("a2a_unpack", lambda: K.a2a_unpack(flat, shape, dim, sizes, backend=b), torch_a2a_unpack,
         2 * nbytes, nbytes),
        ("slice_copy", lambda: K.slice_copy(x, dim, start, length, backend=b),
         lambda: x.narrow(dim, start, length).contiguous(), 2 * per * length * item, per * length * item),
        ("halo_cat", lambda: K.halo_cat([left, x, right], dim, 1, 1, backend=b), torch_halo_cat,
         nbytes + halo_bytes + padded.numel() * item, padded.numel() * item),
        ("halo_split", lambda: K.halo_split(padded, dim, [halo, shape[dim], halo], 1, 1, backend=b),
         torch_halo_split, 2 * (nbytes + halo_bytes), nbytes + halo_bytes),
    ]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=None, help="input sizes in MiB (default 1 16 64)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--n", type=int, default=4, help="number of blocks (ranks), default 4")
    p.add_argument("--dim", type=int, default=1, help="packed dim of the (16, L, 64) input, default 1")
    p.add_argument("--backend", default=None, choices=K.BACKENDS, help="default: $DTSHARD_KERNELS or auto")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--quick", action="store_true", help="smoke run: 1 MiB, few repetitions")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads (1 gives stable numbers on a busy machine)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but CUDA is not available")
    sizes_mib = args.sizes or ([1] if args.quick else [1, 16, 64])
    reps = args.reps or (5 if args.quick else (20 if device.type == "cuda" else 10))
    warmup = 1 if args.quick else 3
    dtype = DTYPES[args.dtype]
    timer = _timer(device, reps, warmup)

    probe = torch.empty(0, device=device)
    used = K.resolve_backend(probe, args.backend)
    print(f"device {device}  dtype {args.dtype}  n {args.n}  backend {args.backend or 'env/auto'} -> {used}  "
          f"torch {torch.__version__}  threads {torch.get_num_threads()}")
    head = (f"{'op':<11} {'MiB':>6} {'kernel GB/s':>12} {'copy_ GB/s':>11} {'clone GB/s':>11} "
            f"{'torch GB/s':>11} {'kernel/copy_':>13} {'kernel/clone':>13} {'torch/kernel':>13}")
    print(head)
    print("-" * len(head))
    for mib in sizes_mib:
        item = torch.empty(0, dtype=dtype).element_size()
        numel = int(mib * 2**20) // item
        length = max(args.n + 1, numel // (16 * 64) - 1)  # uneven split along dim 1
        if dtype == torch.bool:
            x = torch.rand(16, length, 64, device=device) > 0.5
        elif dtype == torch.int64:
            x = torch.randint(0, 100, (16, length, 64), device=device)
        else:
            x = torch.randn(16, length, 64, device=device, dtype=dtype)
        dim = args.dim
        cases = make_cases(x, dim, args.n, args.backend)
        for _, kern, comp, _, _ in cases:  # first calls: compilation, allocator warm-up
            kern()
            comp()
        for name, kern, comp, moved, out_bytes in cases:
            src = torch.empty(out_bytes, dtype=torch.uint8, device=device)
            dst = torch.empty_like(src)
            t_k = timer(kern)
            t_c = timer(lambda: dst.copy_(src))
            t_a = timer(lambda: src.clone())
            t_t = timer(comp)
            gbs = lambda b, t: b / t / 1e9  # noqa: E731
            k, c, a = gbs(moved, t_k), gbs(2 * out_bytes, t_c), gbs(2 * out_bytes, t_a)
            print(f"{name:<11} {x.numel() * item / 2**20:>6.1f} {k:>12.1f} {c:>11.1f} {a:>11.1f} "
                  f"{gbs(moved, t_t):>11.1f} {k / c:>13.2f} {k / a:>13.2f} {t_t / t_k:>13.2f}")


if __name__ == "__main__":
    main()
