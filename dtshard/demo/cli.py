"""``python -m dtshard.demo``: the command line; launches the chosen demo's ranks and prints its report."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import time


from dtshard.demo.block import Config, _all_ok, report
from dtshard.demo.cnn import report_cnn
from dtshard.demo.llama import _llama_step_ok, report_llama
from dtshard.demo.unet3d import report_unet3d
from dtshard.testing import DistributedTestError, launch


def _under_torchrun() -> bool:
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dtshard.demo",
                                     description=importlib.import_module("dtshard.demo").__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5, help="training steps (default 5)")
    parser.add_argument("--world-size", type=int, default=None,
                        help="CPU processes to spawn (default 2, 4 for --model unet3d; ignored under torchrun)")
    parser.add_argument("--model", choices=("block", "llama", "cnn", "unet3d"), default="block",
                        help="block: the tensor-parallel transformer block (default); llama: the "
                             "Llama-style model with tensor + sequence parallelism and AdamW; cnn: a "
                             "UNet with the images sharded on H (spatial halo exchange); unet3d: a 3-D "
                             "UNet with volumes sharded on D x H (4 ranks) or D")
    parser.add_argument("--fsdp", action="store_true",
                        help="with --model llama: FSDP (fully_shard) over every rank instead of TP")
    parser.add_argument("--dp", type=int, default=None,
                        help="with --model llama: data-parallel (FSDP) size; with --tp, FSDP x TP on a 2-D mesh")
    parser.add_argument("--tp", type=int, default=None, help="with --model llama and --dp: tensor-parallel size")
    args = parser.parse_args(argv)
    if args.world_size is None:
        args.world_size = 4 if args.model == "unet3d" else 2
    if args.steps < 1 or args.world_size < 1:
        parser.error("--steps and --world-size must be >= 1")
    if (args.fsdp or args.dp or args.tp) and args.model != "llama":
        args.model = "llama"  # FSDP and FSDP x TP train the Llama model
    if args.dp is not None or args.tp is not None:
        dp, tp = (1 if args.dp is None else args.dp), (1 if args.tp is None else args.tp)
        if dp < 1 or tp < 1:
            parser.error("--dp and --tp must be >= 1")
        if not _under_torchrun():
            args.world_size = dp * tp
        elif dp * tp != int(os.environ["WORLD_SIZE"]):
            parser.error(f"--dp {dp} x --tp {tp} != WORLD_SIZE {os.environ['WORLD_SIZE']}")
        args.dp = dp
    elif args.fsdp:
        args.dp = int(os.environ["WORLD_SIZE"]) if _under_torchrun() else args.world_size
    else:
        args.dp = 1
    if args.model == "cnn":
        return _main_cnn(args)
    if args.model == "unet3d":
        return _launch_and_report(
            "train_unet3d_worker", (args.steps,), args,
            ok=lambda results: all(abs(r["loss"] - r["ref"]) <= 1e-6 + 1e-5 * abs(r["ref"]) and r["dev_w"] <= 1e-5
                                   for r in results[0]["rows"]) if results else True,
            report_fn=lambda results, elapsed, world: report_unet3d(args.steps, world, results, elapsed,
                                                                     (16, 16, 8), (32, 32, 16)))
    if args.model == "llama":
        return _main_llama(args)

    cfg = Config()
    return _launch_and_report(
        "train_worker", (cfg, args.steps), args,
        ok=lambda results: _all_ok(results[0]["ranks"]),
        report_fn=lambda results, elapsed, world: report(cfg, args.steps, results[0]["ranks"], elapsed))


def _launch_and_report(worker_name: str, worker_args: tuple, args, *, ok, report_fn) -> int:
    """Run ``dtshard.demo.<worker_name>(*worker_args)`` on every rank (spawned, or this process
    under torchrun), then print the report on rank 0; the exit code says whether every step
    matched one process."""
    # by module name (not this module's globals, which are __main__'s under `python -m`), so that
    # spawned ranks can import the worker
    worker = getattr(importlib.import_module("dtshard.demo"), worker_name)

    torchrun = _under_torchrun()
    world = int(os.environ["WORLD_SIZE"]) if torchrun else args.world_size
    start = time.perf_counter()
    try:
        results = launch(worker, world, *worker_args, timeout=300.0)
    except DistributedTestError as e:
        print(f"FAILED: the demo raised on some rank:\n{e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - torchrun: this rank raised
        import traceback

        traceback.print_exc()
        print(f"FAILED: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    elapsed = time.perf_counter() - start
    if torchrun and int(os.environ["RANK"]) != 0:
        return 0 if ok(results) else 1
    return 0 if report_fn(results, elapsed, world) else 1


def _main_cnn(args) -> int:
    return _launch_and_report(
        "train_cnn_worker", (args.steps,), args, ok=lambda results: True,
        report_fn=lambda results, elapsed, world: report_cnn(args.steps, world, results, elapsed, 14))


def _main_llama(args) -> int:
    return _launch_and_report(
        "train_llama_worker", (args.steps, args.dp), args,
        ok=lambda results: all(_llama_step_ok([r["rows"][k] for r in results[0]["ranks"]])
                               for k in range(args.steps)),
        report_fn=lambda results, elapsed, world: report_llama(args.steps, results[0]["ranks"], elapsed))
