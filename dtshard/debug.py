"""Debugging views: what moved (CommCounter), which plan each op took (explain), copy passes.

For example::

    with dtshard.debug.CommCounter() as comm:
        y = model(x)
    print(comm.summary())                 # per op: collective kind, mesh dim, bytes
    comm.count("all_gather")              # number of all_gathers
    comm.bytes(kind="all_to_all")         # bytes this rank put on the wire
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterator

from torch.distributed.tensor.placement_types import Partial

from dtshard import _trace
from dtshard.spec import placements_str
from dtshard.tensor import DTensor
from dtshard.propagate import placements_text

__all__ = ["CommCounter", "CommDebugMode", "CommRecord", "CopyCounter", "explain", "peak_alloc_bytes", "plan_log",
           "visualize_sharding"]


@dataclass(frozen=True)
class CommRecord:
    op: str  # the aten op being dispatched, or "<redistribute>" for explicit redistribute calls
    kind: str  # all_gather | reduce_scatter | all_reduce | all_to_all | broadcast
    mesh_dim: int | tuple  # a tuple of mesh dims for a collective over their flattened group
    nbytes: int  # bytes this rank sends (ARCHITECTURE.md accounting)
    group_size: int
    recv_bytes: int = 0  # bytes this rank receives


def _dims_text(mesh_dim) -> str:
    if isinstance(mesh_dim, tuple):
        return "mesh dims " + "x".join(str(d) for d in mesh_dim) + " (flattened)"
    return f"mesh dim {mesh_dim}"


class CommCounter:
    """Context manager recording every collective issued by dtshard on this rank.

    ``CommCounter(module=model)`` also attributes each collective to the innermost submodule
    whose forward is running (forward hooks; backward and other traffic is attributed to
    "<outside module forwards>"),
    see :meth:`by_module`.
    """

    def __init__(self, module=None) -> None:
        self.records: list[CommRecord] = []
        self.modules: list[str] = []  # parallel to records
        self._module = module
        self._stack: list[str] = []
        self._handles: list = []
        self._sharding_info: dict = {}
        self._names = None
        #: kinds of the collectives this rank took part in without moving bytes (a broadcast's
        #: source): not in ``records`` (nothing sent or received), counted by get_total_counts
        self._source_calls: list[str] = []

    def _observe(self, kind: str, mesh_dim, nbytes: int, group_size: int, recv: int | None = None) -> None:
        self.records.append(CommRecord(_trace.current_op[0], kind, mesh_dim, nbytes, group_size,
                                       nbytes if recv is None else recv))
        self.modules.append(self._stack[-1] if self._stack else "<outside module forwards>" if self._module else "")

    def _observe_source(self, kind: str, mesh_dim, group_size: int) -> None:
        self._source_calls.append(kind)

    def __enter__(self) -> "CommCounter":
        _trace.comm_observers.append(self._observe)
        _trace.source_observers.append(self._observe_source)
        self._sharding_info = {}
        self._names = _ModuleNames()
        self._handles.append(_register_global_pre_hook(self._note_sharding))
        if self._module is not None:
            for name, sub in self._module.named_modules():
                label = name or type(self._module).__name__
                self._handles.append(sub.register_forward_pre_hook(self._enter_module(label)))
                self._handles.append(sub.register_forward_hook(self._exit_module))
        return self

    def __exit__(self, *exc) -> bool:
        _trace.comm_observers.remove(self._observe)
        _trace.source_observers.remove(self._observe_source)
        for h in self._handles:
            h.remove()
        self._handles.clear()
        return False

    def _enter_module(self, label: str):
        def hook(module, args) -> None:  # returning None keeps the inputs
            self._stack.append(label)

        return hook

    def _exit_module(self, module, args, output) -> None:  # returning None keeps the output
        self._stack.pop()

    def by_module(self) -> str:
        """One line per (module, collective kind): count and bytes, in first-seen order."""
        agg: dict = {}
        for mod, r in zip(self.modules, self.records):
            a = agg.setdefault((mod, r.kind), [0, 0])
            a[0] += 1
            a[1] += r.nbytes
        if not agg:
            return "no collectives"
        return "\n".join(f"{mod}: {kind} x{n}, {b} bytes" for (mod, kind), (n, b) in agg.items())

    def count(self, kind: str | None = None) -> int:
        """Number of collectives recorded (of ``kind``, e.g. ``\"all_gather\"``, or all of them)."""
        return sum(1 for r in self.records if kind is None or r.kind == kind)

    def bytes(self, kind: str | None = None, mesh_dim: int | None = None) -> int:
        """Bytes this rank sent in the recorded collectives, optionally of one ``kind`` and on one ``mesh_dim``."""
        return sum(
            r.nbytes for r in self.records
            if (kind is None or r.kind == kind) and (mesh_dim is None or r.mesh_dim == mesh_dim)
        )

    def received(self, kind: str | None = None) -> int:
        """Bytes this rank received (all_to_all: exactly its segments from the others)."""
        return sum(r.recv_bytes for r in self.records if kind is None or r.kind == kind)

    def kinds(self) -> list[str]:
        """The kind of every recorded collective, in the order they were issued."""
        return [r.kind for r in self.records]

    # ---- the query methods of torch.distributed.tensor.debug.CommDebugMode ------------------
    def get_total_counts(self) -> int:
        """Number of collective calls this rank took part in (as ``CommDebugMode.get_total_counts``;
        unlike :meth:`count`, a broadcast counts on its source rank too)."""
        return len(self.records) + len(self._source_calls)

    def get_comm_counts(self) -> dict:
        """Collectives by kind, keyed as ``CommDebugMode.get_comm_counts`` keys them: by the
        functional-collective op (``torch.ops.c10d_functional.all_gather_into_tensor``, ...); a
        ``defaultdict(int)``, so a kind that never ran counts 0."""
        out: dict = defaultdict(int)
        for kind in [r.kind for r in self.records] + self._source_calls:
            out[_funcol_op(kind)] += 1
        return out

    def get_sharding_info(self) -> dict:
        """Placements of every DTensor parameter of the modules whose forward ran inside the
        context, keyed ``"<Root class>.<submodule path>.<param>"`` (as
        ``CommDebugMode.get_sharding_info``)."""
        return dict(self._sharding_info)

    def _note_sharding(self, module, args) -> None:  # a global forward pre-hook; keeps the inputs
        name = self._names.name(module)
        for param_name, param in module.named_parameters(recurse=False):
            if hasattr(param.data, "placements"):
                self._sharding_info[f"{name}.{param_name}"] = param.data.placements

    def by_op(self) -> dict[str, dict[str, int]]:
        """Per op that issued collectives (``"<redistribute>"`` for explicit calls): how many of each kind."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for r in self.records:
            out[r.op][r.kind] += 1
        return {k: dict(v) for k, v in out.items()}

    def summary(self) -> str:
        """One line per (op, kind, mesh dim): count and bytes."""
        agg: dict = defaultdict(lambda: [0, 0])
        for r in self.records:
            a = agg[(r.op, r.kind, r.mesh_dim)]
            a[0] += 1
            a[1] += r.nbytes
        if not agg:
            return "no collectives"
        return "\n".join(
            f"{op}: {kind} x{n} on {_dims_text(md)}, {b} bytes" for (op, kind, md), (n, b) in agg.items()
        )


#: CommRecord.kind -> the op PyTorch's CommDebugMode counts it under (its legacy funcol keys)
_FUNCOL_NAMES = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor",
                 "all_reduce": "all_reduce", "all_to_all": "all_to_all_single", "broadcast": "broadcast"}


def _funcol_op(kind: str):
    import torch

    return getattr(torch.ops.c10d_functional, _FUNCOL_NAMES[kind])


def _register_global_pre_hook(hook):
    from torch.nn.modules.module import register_module_forward_pre_hook

    return register_module_forward_pre_hook(hook)


class _ModuleNames:
    """Module names as PyTorch's ModTracker gives them (so ``get_sharding_info`` keys match
    CommDebugMode's): a module first seen is named by its class, its children ``parent.child``."""

    def __init__(self) -> None:
        import weakref

        self._known = weakref.WeakKeyDictionary()
        self._seen = weakref.WeakSet()

    def name(self, module) -> str:
        if module not in self._known:
            self._known[module] = type(module).__name__
        name = self._known[module]
        if module not in self._seen:
            for child_name, child in module.named_children():
                self._known[child] = f"{name}.{child_name}"
                self.name(child)
            self._seen.add(module)
        return name


def __getattr__(name: str):
    # built on first use: importing torch.distributed.tensor.debug is not free
    if name == "CommDebugMode":
        cls = _make_comm_debug_mode()
        globals()["CommDebugMode"] = cls
        return cls
    raise AttributeError(f"module 'dtshard.debug' has no attribute {name!r}")


def _make_comm_debug_mode():
    """``dtshard.debug.CommDebugMode``: PyTorch's ``CommDebugMode`` that also records dtshard's
    DTensor parameters in ``get_sharding_info``.

    PyTorch's mode is a ``TorchDispatchMode``, and modes run before tensor subclasses.  For ITS
    DTensor (``t == DTensor``) it records the op and returns ``NotImplemented``, so that the
    DTensor dispatches with the mode still active and the collectives it issues reach the mode.
    dtshard's DTensor class compares equal to PyTorch's (``tensor._DTensorType``), so PyTorch's own
    mode already counts every collective dtshard issues inside an op (issue #54 item 12); its
    parameter tracker still records only PyTorch's DTensor parameters (``isinstance``), which this
    subclass adds.  Under either mode dtshard's collectives take the functional path
    (``torch.ops._c10d_functional``, see collectives._eager_group) or the c10d ops the mode also
    counts.  Nothing is patched in PyTorch; the eager path outside the modes is unchanged."""
    import torch
    from torch.distributed.tensor.debug import CommDebugMode as _TorchCommDebugMode
    from torch.distributed.tensor.debug._comm_mode import _CommModeModuleTracker

    class _Tracker(_CommModeModuleTracker):
        def _fw_pre_hook(self, mod, input):
            super()._fw_pre_hook(mod, input)
            if self.activation_checkpointing:
                return
            for param_name, param in mod.named_parameters(recurse=False):
                if isinstance(param.data, DTensor):
                    self.sharding_dict[f"{self.name}.{param_name}"] = param.data.placements
                    self.module_helper_dict[self.name].setdefault("parameters", {})[param_name] = \
                        str(param.data.placements)

    class CommDebugMode(_TorchCommDebugMode):
        __doc__ = _make_comm_debug_mode.__doc__

        def __init__(self):
            super().__init__()
            self.advanced_module_tracker = _Tracker()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if isinstance(func, torch._ops.HigherOrderOperator) or not any(issubclass(t, DTensor) for t in types):
                return super().__torch_dispatch__(func, types, args, kwargs)
            # what PyTorch's mode records for an op on its DTensor, then let dtshard run it
            tracker = self.advanced_module_tracker
            ops = self.comm_module_operation_counts.setdefault(tracker.name, {"operations_list": []})
            entry = {"name": func, "input_shape": [], "input_sharding": [], "device_mesh": "",
                     "is_bw": tracker.is_bw, "is_activation_checkpointing": tracker.activation_checkpointing}
            for a in args:
                if isinstance(a, DTensor):
                    entry["input_shape"].append(a.shape)
                    entry["input_sharding"].append(a.placements)
                    entry["device_mesh"] = str(a.device_mesh)
            ops["operations_list"].append(entry)
            return NotImplemented

    CommDebugMode.__module__ = __name__
    CommDebugMode.__qualname__ = "CommDebugMode"
    return CommDebugMode


class CopyCounter:
    """Context manager counting the local copy passes (pack/unpack/slice) made by redistribute."""

    def __init__(self) -> None:
        self.passes: list[tuple[str, int]] = []

    def _observe(self, kind: str, nbytes: int) -> None:
        self.passes.append((kind, nbytes))

    def __enter__(self) -> "CopyCounter":
        _trace.copy_observers.append(self._observe)
        return self

    def __exit__(self, *exc) -> bool:
        _trace.copy_observers.remove(self._observe)
        return False

    def count(self, kind: str | None = None) -> int:
        """Number of copy passes recorded (of ``kind``: ``\"pack\"``, ``\"unpack\"``, ``\"slice\"``, or all of them)."""
        return sum(1 for k, _ in self.passes if kind is None or k == kind)


@contextlib.contextmanager
def plan_log() -> Iterator[list[str]]:
    """Collect the plan text of every dispatched op (cache hits included)."""
    lines: list[str] = []

    def observe(op_name, plan, specs):
        lines.append(plan.describe(specs))

    _trace.plan_observers.append(observe)
    try:
        yield lines
    finally:
        _trace.plan_observers.remove(observe)


def explain(fn, *args, **kwargs) -> str:
    """Run ``fn(*args, **kwargs)`` and return, per dispatched op, the chosen plan, its cost in
    bytes, and the alternatives considered (cheapest first)."""
    seen: list[str] = []

    def observe(op_name, plan, specs):
        text = plan.describe(specs)
        alts = [f"    {'ok ' if ok else 'bad'} {cost:.0f}B  {placements_text(*choice)}"
                for cost, choice, ok in plan.considered]
        seen.append(text + ("\n  considered:\n" + "\n".join(alts) if alts else ""))

    _trace.plan_observers.append(observe)
    try:
        fn(*args, **kwargs)
    finally:
        _trace.plan_observers.remove(observe)
    return "\n".join(seen)


def _blocks(spec, coord) -> list[list[tuple[int, int]]]:
    """The blocks (per dim one index range) a rank holds: one, or several for a strided shard."""
    region = spec.local_region(coord)
    if any(not ivs for ivs in region):  # an empty shard: its (empty) ranges
        shape, offset = spec.local_shape_and_offset(coord) if not spec.has_strided else (
            [0] * len(region), [0] * len(region))
        return [[(o, o + n) for o, n in zip(offset, shape)]]
    return [list(b) for b in itertools.product(*region)]


def _ranges_text(spec, coord) -> str:
    region = spec.local_region(coord)
    if not region:
        return "scalar"
    if any(not ivs for ivs in region) and not spec.has_strided:
        shape, offset = spec.local_shape_and_offset(coord)
        return ", ".join(f"{o}:{o + n}" for o, n in zip(offset, shape))
    return ", ".join("+".join(f"{a}:{b}" for a, b in ivs) or "0:0" for ivs in region)


def visualize_sharding(dt, *, path: str | None = None) -> str:
    """Which rank holds which index range of ``dt``, as text (metadata only, no communication).

    1-D and N-D tensors: one row per rank with its coordinate, index ranges and placement;
    2-D tensors also get a grid of row x column blocks naming the ranks that hold each block.
    With ``path``, also draws the 2-D layout to a PNG (needs matplotlib: ``pip install
    dtshard[plot]``).
    """
    import itertools

    spec = dt._spec
    mesh = spec.mesh
    mesh_shape = tuple(mesh.shape)
    ranks = mesh.mesh.flatten().tolist()
    partial = [i for i, p in enumerate(spec.placements) if isinstance(p, Partial)]
    lines = [f"DTensor {tuple(spec.shape)} {placements_str(spec.placements)} on mesh {mesh_shape}"]
    table = []
    for k, coord in enumerate(itertools.product(*(range(n) for n in mesh_shape))):
        table.append((ranks[k], coord, _blocks(spec, coord), _ranges_text(spec, coord)))
    width = max(len(t[3]) for t in table)
    lines.append(f"{'rank':>4}  {'coord':<{2 + 3 * len(mesh_shape)}}  {'indices':<{width}}")
    for rank, coord, _, text in table:
        note = "  (partial term)" if partial else ""
        lines.append(f"{rank:>4}  {str(coord):<{2 + 3 * len(mesh_shape)}}  {text:<{width}}{note}")
    if spec.ndim == 2:
        rows = sorted({b[0] for _, _, bs, _ in table for b in bs})
        cols = sorted({b[1] for _, _, bs, _ in table for b in bs})
        cells = {}
        for rank, _, bs, _ in table:
            for rr, cc in bs:
                cells.setdefault((rr, cc), []).append(str(rank))
        col_text = [f"{a}:{b}" for a, b in cols]
        cw = max([len(c) for c in col_text] + [len(",".join(v)) for v in cells.values()])
        rw = max(len(f"{a}:{b}") for a, b in rows)
        lines.append("")
        lines.append(" " * rw + " | " + " | ".join(f"{c:^{cw}}" for c in col_text))
        for rr in rows:
            row = [",".join(cells.get((rr, cc), [])) or "-" for cc in cols]
            lines.append(f"{rr[0]}:{rr[1]}".rjust(rw) + " | " + " | ".join(f"{v:^{cw}}" for v in row))
    text = "\n".join(lines)
    if path is not None:
        _draw(table, spec, path)
    return text


def _draw(table, spec, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Rectangle
    except ImportError as e:  # optional extra
        raise ImportError("visualize_sharding(path=...) needs matplotlib: pip install 'dtshard[plot]'") from e
    if spec.ndim != 2:
        raise ValueError(f"visualize_sharding(path=...) draws 2-D tensors; this one is {spec.ndim}-D")
    rows, cols = spec.shape
    fig, ax = plt.subplots(figsize=(5, 5 * max(rows, 1) / max(cols, 1) + 0.5))
    cmap = plt.get_cmap("tab20")
    holders: dict = {}
    for rank, _, bs, _ in table:
        for (r0, r1), (c0, c1) in bs:
            holders.setdefault((r0, r1, c0, c1), []).append(rank)
    for k, ((r0, r1, c0, c1), rs) in enumerate(sorted(holders.items())):
        ax.add_patch(Rectangle((c0, r0), c1 - c0, r1 - r0, facecolor=cmap(k % 20), edgecolor="black"))
        if r1 > r0 and c1 > c0:
            ax.text((c0 + c1) / 2, (r0 + r1) / 2, "rank " + ",".join(map(str, rs)), ha="center", va="center")
    ax.set_xlim(0, cols)
    ax.set_ylim(rows, 0)
    ax.set_xlabel("dim 1")
    ax.set_ylabel("dim 0")
    ax.set_title(f"{tuple(spec.shape)} {placements_str(spec.placements)} mesh {tuple(spec.mesh.shape)}")
    fig.savefig(path, dpi=80, bbox_inches="tight")
    plt.close(fig)


def peak_alloc_bytes(fn) -> int:
    """Peak increase of the bytes allocated through PyTorch's CPU allocator while ``fn()`` runs,
    above what was allocated before it: the allocation and free events ``torch.profiler``
    records with ``profile_memory=True`` (every tensor and storage allocation, collective buffers
    and storage resizes included), summed in time order.  Not RSS.  Used by the FSDP memory
    tests, the 3-D UNet demo and ``benchmarks/bench_fsdp.py``."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    cur = peak = 0
    for e in events:
        cur += e.nbytes()
        peak = max(peak, cur)
    return peak


#: ``MALLOC_MMAP_THRESHOLD_`` value :func:`peak_rss_bytes` needs in the environment of the
#: process it measures (set before the process starts: glibc reads it once).
RSS_MMAP_THRESHOLD = "65536"


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field} line")


def peak_rss_bytes(fn) -> int:
    """Peak increase of this process's resident memory while ``fn()`` runs, above the resident
    memory before it: the kernel's high-water mark (``VmHWM``, reset through
    ``/proc/self/clear_refs``), so it counts memory freed by any thread, gloo's worker threads
    included, at the moment it is really freed.

    :func:`peak_alloc_bytes` cannot see those frees: the profiler records an allocator event
    only on a thread that carries its thread-local state, and a collective's buffers are often
    released by the gloo thread that ran it (the functional collectives of a compiled graph),
    which makes that peak too high by whatever such buffers were alive.

    Exact only when every large allocation is its own ``mmap`` returned to the OS when freed:
    the measured process must run with ``MALLOC_MMAP_THRESHOLD_=65536``
    (:data:`RSS_MMAP_THRESHOLD`; it makes large allocations slower, so do not time steps in
    such a process).  Linux only; raises elsewhere or without that setting."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != RSS_MMAP_THRESHOLD:
        raise RuntimeError("peak_rss_bytes needs the process started with MALLOC_MMAP_THRESHOLD_="
                           f"{RSS_MMAP_THRESHOLD} (freed tensors are returned to the OS only then)")
    gc.collect()
    before = _rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    fn()
    return max(0, _rss_kib("VmHWM") - before) * 1024
