#!/usr/bin/env bash
# GPU-ready checks of dtshard: kernel tests compiled for the GPU, kernel bandwidth vs a
# device-to-device copy, inductor-compiled TP and UNet steps on a 1-rank NCCL mesh, and
# DTSHARD_KERNELS=triton through dtshard vs the reference, and bench_attention_cp.py on the CPU cores
# (CPU tensors), and the CUDA attention kernels as context parallelism calls them; prints one table.  Without a GPU the
# GPU sections print SKIP and their CPU stand-ins run.  Any cwd; uses `python` on PATH.
# Options (see benchmarks/gpu_check.py): --budget SECONDS (480), --only PREFIXES, --with-cpu, --shards N,
# --cpu-compile-backend {aot_eager,inductor}, --json FILE.
# Exit: 0 all passed and met their targets, 1 a check failed / timed out / was not reached,
# 2 no failure but a performance target missed.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$here/.."
exec python "$here/gpu_check.py" "$@"
