"""``python -m dtshard.validate``: validate sharding rules on simulated ranks (see the package doc).

    python -m dtshard.validate --op aten.add.Tensor,aten.mm --mesh 2,3,2x2 --strided --repro 1
    python -m dtshard.validate --all --mesh 2,3,2x2 --uneven --strided --backward
    python -m dtshard.validate --import mylib.ops --op mylib::my_op     # a torch.library custom op

Prints one line per op (``dtshard.validate.report``), the incorrect strategies (and with
``--incorrect-only`` nothing else), the missing ones, the totals, and exits with status 1 when any
claimed strategy is incorrect.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import warnings

import torch

import dtshard  # noqa: F401  (registers every rule and handler)
from dtshard.registry import get_entry, registered_ops
from dtshard.validate.check import OpReport, validate_op
from dtshard.validate.ranks import validate_handler
from dtshard.validate.report import repro, summary
from dtshard.validate.samples import SampleSource


def _meshes(text: str) -> list[tuple[int, ...]]:
    """``"2,3,2x2"`` -> ``[(2,), (3,), (2, 2)]``."""
    return [tuple(int(n) for n in part.split("x")) for part in text.split(",") if part]


def _op_parts(name: str) -> list[str]:
    """``name`` as ``[namespace, op, overload?]``: ``ns::op[.overload]`` (how ``torch.library``
    names an op), ``[torch.ops.]ns.op[.overload]``, or ``op[.overload]`` (aten's)."""
    name = name.removeprefix("torch.ops.")
    if "::" in name:
        namespace, _, rest = name.partition("::")
        parts = [namespace, *rest.split(".")]
        if not namespace or not all(parts) or len(parts) > 3:
            raise SystemExit(f"dtshard.validate: --op {name!r}: write ns::op or ns::op.overload "
                             "(e.g. mylib::my_op, aten::add.Tensor)")
        return parts
    parts = name.split(".")
    # op / op.overload are aten's; ns.op.overload names its namespace; ns.op does when aten has no
    # op of that first name (a registered namespace always does)
    if len(parts) == 1 or (len(parts) == 2 and parts[0] not in _namespaces()
                           and getattr(torch.ops.aten, parts[0], None) is not None):
        parts.insert(0, "aten")
    return parts


def _ops(text: str) -> list:
    """``aten.add.Tensor,mylib::my_op``: an overload, or every overload of a packet that has a
    rule or handler (every overload when none has: each is then reported "no rule"); any
    namespace (``mylib::my_op``, ``mylib::my_op.default``, ``mylib.my_op.default``; a name without
    one is aten's)."""
    out = []
    for name in filter(None, (n.strip() for n in text.split(","))):
        parts = _op_parts(name)
        packet = getattr(getattr(torch.ops, parts[0]), parts[1], None)
        if packet is None:
            raise SystemExit(f"dtshard.validate: no op {name!r} (torch.ops.{parts[0]} has no {parts[1]!r}): "
                             "import the module that defines it with --import MODULE, or check the name")
        if len(parts) > 2:
            overload = getattr(packet, parts[2], None)
            if overload is None:
                raise SystemExit(f"dtshard.validate: op {name!r}: {parts[0]}::{parts[1]} has no overload "
                                 f"{parts[2]!r} (it has: {', '.join(packet.overloads())})")
            out.append(overload)
        else:
            served = [op for op in registered_ops() if op._overloadpacket is packet]
            out.extend(served or [getattr(packet, o) for o in packet.overloads()])
    return out


def _namespaces() -> set:
    return {op.namespace for op in registered_ops()}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dtshard.validate", description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--op", help="these ops, comma-separated: ns::op[.overload] (mylib::my_op, "
                                    "aten::add.Tensor) or ns.op[.overload] (aten.add.Tensor; aten's without ns)")
    which.add_argument("--all", action="store_true", help="every registered op")
    p.add_argument("--import", dest="imports", action="append", default=[], metavar="MODULE",
                   help="import MODULE first (comma-separated, repeatable): the module that defines your "
                        "custom ops (torch.library) and registers their rules")
    p.add_argument("--mesh", default="2,3,2x2", help="meshes, comma-separated, N-D as AxB (default 2,3,2x2)")
    p.add_argument("--uneven", action=argparse.BooleanOptionalAction, default=True,
                   help="include uneven shards (default on; --no-uneven: even layouts only)")
    p.add_argument("--strided", action="store_true", help="also strided shards (_StridedShard, split factor 2)")
    p.add_argument("--backward", action=argparse.BooleanOptionalAction, default=True,
                   help="also the ops the samples' backward runs, with their shapes (default on)")
    p.add_argument("--missing", action=argparse.BooleanOptionalAction, default=True,
                   help="search 1-D meshes for valid strategies the rule does not claim (default on)")
    p.add_argument("--dtype", default="float32", help="the samples' dtype (default float32)")
    p.add_argument("--samples", type=int, default=2, help="samples per op (default 2)")
    p.add_argument("--incorrect-only", action="store_true", help="print only the incorrect strategies")
    p.add_argument("--repro", type=int, default=0, metavar="N", help="print N reproductions per failing op")
    p.add_argument("--ranks", action="store_true",
                   help="also run handler-served ops as DTensors on real ranks (gloo worker pools)")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    warnings.simplefilter("ignore")  # deprecation chatter of the OpInfo samples
    start, cpu_start = time.perf_counter(), time.process_time()
    for module in (m.strip() for arg in args.imports for m in arg.split(",")):
        if module:
            importlib.import_module(module)
    ops = registered_ops() if args.all else _ops(args.op)
    source = SampleSource(dtype=getattr(torch, args.dtype), per_op=args.samples, backward=args.backward)
    if args.all:
        source.capture()
    meshes = _meshes(args.mesh)
    reports, errors = [], []
    for op in ops:
        entry = get_entry(op)
        if entry is not None and entry.kind == "handler" and args.ranks:
            report = validate_handler(op, source.samples(op), meshes)
        elif entry is not None and entry.kind == "handler":
            report = OpReport(op, "handler", note="handler: not validated here (runs its own code; needs --ranks)")
        else:
            try:
                report = validate_op(op, source, meshes, uneven=args.uneven, strided=args.strided,
                                     missing=args.missing and not args.incorrect_only)
            except Exception as e:  # noqa: BLE001 - reported, and the run fails, but goes on
                report = OpReport(op, "rule", note=f"VALIDATOR ERROR {type(e).__name__}: {e}")
                errors.append(report)
        reports.append(report)
        if not args.incorrect_only:
            print(report.line(), flush=True)
        for f in report.incorrect:
            print(f"  INCORRECT {f.text()}", flush=True)
        for f in report.incorrect[:args.repro]:
            print("  --- reproduction ---\n" + "\n".join("  " + ln for ln in repro(f).splitlines()))
        if not args.incorrect_only:
            for f in report.missing:
                print(f"  missing   {f.text()}")
    print(summary(reports, time.perf_counter() - start, time.process_time() - cpu_start))
    return 1 if errors or any(r.incorrect for r in reports) else 0


if __name__ == "__main__":
    sys.exit(main())
