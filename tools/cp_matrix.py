"""Context parallelism's whole matrix under ``torch.compile(fullgraph=True)`` (issue #30).

    python tools/cp_matrix.py                      # every mesh, both matrices, compiled
    python tools/cp_matrix.py --meshes 2           # one mesh (2, 4 or 2x2)
    python tools/cp_matrix.py --matrices masked    # one matrix (strategies, masked or flex)

The suite runs the matrices of ``tests/distributed/test_context_parallel.py`` (SDPA: every
strategy x {no mask, causal, causal with kv_len != q_len} and x {random boolean, rows masked
everywhere, sliding windows, causal documents} x {MHA, GQA 4:1, MQA} x {sequence divisible by 2 x
ranks and not} x {2 and 4 ranks, a 2x2 mesh}) and of ``test_flex_attention_cp.py``
(flex_attention forward: score_mod, causal, windows, documents, two block sizes) eagerly on every
mesh, and a sample of them compiled (a compile costs ~1.3 s of CPU a rank, so the whole compiled
matrix, ~600 compiles, is too slow for the suite's time budget). This tool runs every case
compiled (aot_eager, static shapes, each case its own compile; a graph break raises), with the
tests' own verdicts (``check_strategies``, ``check_masked``: output and dq/dk/dv within 1e-9 of one
process on every rank, layouts kept; ``check_flex``: output and log-sum-exp within 1e-12), and
records the result, with its date, commit and numbers, in
``tests/distributed/last_cp_matrix.json``.  It exits 1 on any failure.

Compiled, the collectives are the graph's (not counted per call); mask_kv cannot read a traced
mask, so those calls take the rule's path, whose values are checked like the others'; the flex
calls run under ``implicit_replication()`` (the document mask's mod indexes a captured plain
tensor with the 0-d DTensor indices Dynamo traces mods with).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "distributed"))
sys.path.insert(0, os.path.join(ROOT, "kernels"))  # this checkout's dtshard_kernels
sys.path.insert(0, ROOT)

import test_context_parallel as T  # noqa: E402
import test_flex_attention_cp as FX  # noqa: E402

from dtshard.testing import run_distributed  # noqa: E402

RECORD = os.path.join(ROOT, "tests", "distributed", "last_cp_matrix.json")
MESHES = {"2": (2,), "4": (4,), "2x2": (2, 2)}
# name: (the ranks' function, the test's verdict, a result row's largest error)
MATRICES = {"strategies": (T._run, T.check_strategies, lambda r: r[5]),
            "masked": (T._run_masked, T.check_masked, lambda r: max(r[5], r[6])),
            "flex": (FX._run, FX.check_flex, lambda r: max(r[2]))}


def _commit() -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--meshes", default="2,4,2x2", help="comma-separated: 2, 4, 2x2")
    ap.add_argument("--matrices", default="strategies,masked,flex", help="comma-separated: strategies, masked, flex")
    ap.add_argument("--no-record", action="store_true", help=f"do not write {os.path.relpath(RECORD, ROOT)}")
    args = ap.parse_args(argv)
    rows, failed = [], False
    for name in args.meshes.split(","):
        mesh_shape = MESHES[name]
        for matrix in args.matrices.split(","):
            run, check, err = MATRICES[matrix]
            t0 = time.time()
            try:
                per_rank = run_distributed(run, math.prod(mesh_shape), mesh_shape, True, timeout=3600)
                cases = check(per_rank, mesh_shape, compiled=True)
                worst = max(err(r) for ranks in per_rank for r in ranks)
                row = {"mesh": name, "matrix": matrix, "verdict": "pass", "cases": cases // len(per_rank),
                       "ranks": len(per_rank), "max_err": worst, "seconds": round(time.time() - t0, 1)}
            except Exception as e:  # noqa: BLE001 - reported, and the tool exits 1
                failed = True
                row = {"mesh": name, "matrix": matrix, "verdict": "FAIL", "error": str(e)[:2000],
                       "seconds": round(time.time() - t0, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if not args.no_record and args.meshes == "2,4,2x2" and args.matrices == "strategies,masked,flex":
        with open(RECORD, "w") as f:
            json.dump({"date": time.strftime("%Y-%m-%d"), "commit": _commit(), "torch": _torch_version(),
                       "command": "python tools/cp_matrix.py", "results": rows}, f, indent=1)
            f.write("\n")
    return 1 if failed else 0


def _torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
