"""The only module of dtshard that talks to ``torch.distributed``.

Every collective runs over the process group of ONE mesh dim: under ``torch.compile`` (or any
dispatch mode) through PyTorch's functional collectives (``torch.ops._c10d_functional``), which
trace into graphs; eagerly on plain tensors straight on the ProcessGroup object (same
collectives, without the functional ops' Python layers).  Each call is reported to the active ``dtshard.debug.CommCounter`` objects
(kind, mesh dim, bytes this rank puts on the wire), which is how tests assert minimum traffic.

Byte accounting (per rank, ``n`` ranks in the group), matching docs/ARCHITECTURE's table:
all_gather ``(n-1) * input``, reduce_scatter ``(n-1)/n * input``, all_reduce ``2(n-1)/n * input``
(ring), all_to_all ``input - the part kept locally``, broadcast ``input`` on non-source ranks.
"""

from __future__ import annotations

import datetime
import math
import os
import queue
import threading
import weakref
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.device_mesh import init_device_mesh as _torch_init_device_mesh
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_mode

from dtshard import hooks

__all__ = [
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "reduce",
    "reduce_scatter",
    "mesh_coordinate",
    "mesh_dim_rank",
    "world_rank",
    "init_device_mesh",
    "DeviceMesh",
    "init_process_group",
]

_fc = torch.ops._c10d_functional

# Partial reduce op -> the ProcessGroup's ReduceOp for the eager path ("avg" goes through the
# functional collectives, which average; "product" is PRODUCT: gloo and NCCL reduce with it)
_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
               "product": dist.ReduceOp.PRODUCT}

#: backend name -> the reduce ops its reduce_scatter lacks while its all_reduce has them: PyTorch's
#: threaded process group (ranks as threads of one process, what PyTorch's own DTensor and FSDP2
#: tests run on) reduce-scatters with SUM and AVG only ("ReduceScatter does not support
#: ReduceOp.MAX").  There a reduce_scatter with another op runs as an all_reduce of which each rank
#: keeps its block (:func:`_lacks_reduce_scatter`).  gloo (torch 2.13) and NCCL have all four;
#: ``tests/dropin/test_issue54_dtensor.py`` runs the fallback on gloo by listing gloo here.
REDUCE_SCATTER_LACKS: dict[str, frozenset] = {"threaded": frozenset({"max", "min", "product"})}

from dtshard import _trace
from dtshard._trace import comm_observers as _observers
from dtshard.layout import group_coords
from dtshard.spec import mesh_identity

# Per-mesh caches, keyed by id() but checked against a weak reference: a mesh that was freed can
# leave its id to a new mesh, which must not inherit the old process groups.  Slicing a mesh
# (``mesh["tp"]``) makes a new DeviceMesh object every time, so the weak reference also drops
# the entry when its mesh is freed (otherwise a loop that slices would grow the caches forever).
_group_names: dict[tuple[int, int], tuple] = {}
_coordinates: dict[int, tuple] = {}


def _cache_put(cache: dict, key, mesh: DeviceMesh, value):
    """Store ``(weakref(mesh), value)`` under ``key``; the entry goes when ``mesh`` is freed."""

    def drop(ref, cache=cache, key=key):
        hit = cache.get(key)
        if hit is not None and hit[0] is ref:  # not an entry a newer mesh with this id made
            del cache[key]

    cache[key] = (weakref.ref(mesh, drop), value)
    return value


def _group(mesh: DeviceMesh, mesh_dim) -> tuple[str, int]:
    """(process group name, group size) of one mesh dim, or of the flattened group of a tuple of
    mesh dims (:func:`flat_group`), cached per mesh object."""
    key = (id(mesh), mesh_dim)
    hit = _group_names.get(key)
    if hit is None or hit[0]() is not mesh:
        group = _process_group(mesh, mesh_dim)
        return _cache_put(_group_names, key, mesh, (group.group_name, group_size(mesh, mesh_dim)))
    return hit[1]


def group_size(mesh: DeviceMesh, mesh_dim) -> int:
    """Ranks in the group of one mesh dim, or of a tuple of mesh dims flattened."""
    if isinstance(mesh_dim, tuple):
        n = 1
        for d in mesh_dim:
            n *= mesh.size(d)
        return n
    return mesh.size(mesh_dim)


def _process_group(mesh: DeviceMesh, mesh_dim):
    if isinstance(mesh_dim, tuple):
        return mesh.get_group(mesh_dim[0]) if len(mesh_dim) == 1 else flat_group(mesh, mesh_dim)
    return mesh.get_group(mesh_dim)


#: (mesh identity, dims) -> ProcessGroup of the flattened group this rank belongs to
_flat_groups: dict[tuple, object] = {}


def flat_group(mesh: DeviceMesh, dims: tuple[int, ...]):
    """The process group of the ranks that differ from this rank only in mesh ``dims``, ordered
    row-major over ``dims`` in mesh order (so group rank = the linearised coordinate, the order
    in which nested shards of one tensor dim follow each other).

    Created by dtshard on first use, once per (mesh, dims) and cached by the mesh's identity
    (layout and process groups), with ``use_local_synchronization=True``: only the group's own
    members take part, so ranks that never plan a step over these dims (another pipeline stage,
    another sub-mesh) are not involved and cannot deadlock.  Members reach the creation together
    because they run the same redistribute (plans are functions of metadata all ranks share).
    The group gets the default group's timeout.
    """
    dims = tuple(sorted(dims))
    key = (mesh_identity(mesh), dims)
    pg = _flat_groups.get(key)
    if pg is None:
        coord = mesh_coordinate(mesh)
        table = rank_table(mesh)  # (the group is created on first use, maybe while torch.compile traces)
        ranks = []
        for c in group_coords(tuple(mesh.shape), dims, coord):
            r = table
            for v in c:
                r = r[v]
            ranks.append(int(r))
        kwargs = {}
        try:
            default = dist.distributed_c10d._get_default_group()
            kwargs["timeout"] = default._get_backend(torch.device(mesh.device_type)).options._timeout
        except Exception:  # an unusual backend: PyTorch's default timeout
            pass
        pg = _flat_groups[key] = dist.new_group(ranks, use_local_synchronization=True, **kwargs)
    return pg


_pgs: dict[tuple[int, int], tuple] = {}


def _group_object(mesh: DeviceMesh, mesh_dim):
    """The ProcessGroup of one mesh dim (or of a tuple of them, flattened), cached per mesh."""
    key = (id(mesh), mesh_dim)
    hit = _pgs.get(key)
    if hit is None or hit[0]() is not mesh:
        return _cache_put(_pgs, key, mesh, _process_group(mesh, mesh_dim))
    return hit[1]


def _eager_group(mesh: DeviceMesh, mesh_dim: int, x: torch.Tensor):
    """The ProcessGroup object of one mesh dim when ``x`` is a plain tensor outside any tracing
    (no torch.compile, no dispatch mode): eager calls then go straight to the group, which
    skips the functional collectives' Python autograd and registry layers (~40 us a call).
    None otherwise: the functional collectives trace into graphs."""
    if type(x) is not torch.Tensor or x.is_complex() or torch.compiler.is_compiling() or _current_mode() is not None \
            or _in_flight[0]:
        return None  # complex: the functional ops move them as real views (gloo has no complex)
    return _group_object(mesh, mesh_dim)


def _backend_name(pg) -> str:
    try:
        return dist.get_backend(pg)
    except Exception:  # noqa: BLE001 - a group torch does not know the backend of
        name = getattr(pg, "getBackendName", None) or getattr(pg, "name", None)
        try:
            return str(name()) if name is not None else ""
        except Exception:  # noqa: BLE001
            return ""


_backends: dict[tuple, tuple] = {}


@hooks.constant_result  # asked while torch.compile traces a reduce_scatter (a backend, not a tensor)
def _lacks_reduce_scatter(mesh: DeviceMesh, mesh_dim, op) -> bool:
    """Does the backend of this mesh dim's group lack a reduce_scatter with ``op`` (a name)
    (:data:`REDUCE_SCATTER_LACKS`)?  The backend is cached per mesh object; the table is read on
    every call (a test may change it)."""
    if not REDUCE_SCATTER_LACKS or not isinstance(op, str):
        return False
    key = (id(mesh), mesh_dim)
    hit = _backends.get(key)
    if hit is None or hit[0]() is not mesh:
        backend = _cache_put(_backends, key, mesh, _backend_name(_group_object(mesh, mesh_dim)))
    else:
        backend = hit[1]
    lacks = REDUCE_SCATTER_LACKS.get(backend)
    return lacks is not None and op in lacks


def _lacks_reduce_scatter_pg(pg, op) -> bool:
    """:func:`_lacks_reduce_scatter` for a process group object."""
    if not REDUCE_SCATTER_LACKS or not isinstance(op, str):
        return False
    lacks = REDUCE_SCATTER_LACKS.get(_backend_name(pg))
    return lacks is not None and op in lacks


_orders: dict[tuple, tuple] = {}


@hooks.constant_result  # asked while torch.compile traces a collective (the rank table does not trace)
def _member_order(mesh: DeviceMesh, mesh_dim) -> tuple[int, ...] | None:
    """Where each member of the group of ``mesh_dim`` (one mesh dim, or a tuple of them
    flattened) sits in its process group: ``order[i]`` is the group rank of the member dtshard
    numbers ``i`` (:func:`group_rank`: its coordinate along the dim, row-major over flattened
    dims).  None when the two agree, as they do whenever the ranks ascend along the group (process
    groups number their members by ascending rank; every ``init_device_mesh`` mesh).  A
    ``DeviceMesh`` built from a rank table that descends along a dim, or whose flattened dims do
    not ascend together (the transposed table ``[[0, 2], [1, 3]]``, flattened), differs: the
    collectives below then put the blocks where dtshard's layout says (PyTorch's DTensor gets
    such meshes wrong along a descending dim).  Reads only the group's own ranks (linear in the
    group); cached per mesh object."""
    key = (id(mesh), mesh_dim)
    hit = _orders.get(key)
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    dims = tuple(sorted(mesh_dim)) if isinstance(mesh_dim, tuple) else (mesh_dim,)
    coord = mesh_coordinate(mesh)
    table = rank_table(mesh, tuple(slice(None) if d in dims else coord[d] for d in range(mesh.ndim)))
    ranks, stack = [], [table]
    while stack:  # the nested lists flattened row-major (the group's order)
        t = stack.pop()
        if isinstance(t, list):
            stack.extend(reversed(t))
        else:
            ranks.append(int(t))
    order = None
    if any(a > b for a, b in zip(ranks, ranks[1:])):
        pg = _group_object(mesh, mesh_dim)
        order = tuple(dist.get_group_rank(pg, r) for r in ranks)
        if order == tuple(range(len(ranks))):
            order = None
    return _cache_put(_orders, key, mesh, order)


def _blocks_from_group_order(t: torch.Tensor, order) -> torch.Tensor:
    """``t``'s ``n`` equal dim-0 blocks, in group-rank order, put in member order."""
    n = len(order)
    idx = torch.tensor(order, device=t.device)
    return t.reshape(n, -1).index_select(0, idx).reshape(t.shape)


def _blocks_to_group_order(t: torch.Tensor, order) -> torch.Tensor:
    """``t``'s ``n`` equal dim-0 blocks, in member order, put in group-rank order."""
    inv = [0] * len(order)
    for i, p in enumerate(order):
        inv[p] = i
    return _blocks_from_group_order(t, inv)


#: set by :func:`in_flight`: the next functional collective's result is returned unwaited
_in_flight = [False]


class in_flight:
    """Inside this block, the collectives of this module return their result while still in
    flight, as PyTorch's ``AsyncCollectiveTensor`` (waited on its first use): what
    ``redistribute(async_op=True)`` runs its last step under.  Outside any tracing only, unless
    ``graph=True``: then, under torch.compile, the result is the functional collective's
    un-waited output and the caller places the wait in the graph itself (:func:`wait_in_graph`),
    after the work that may overlap it."""

    def __init__(self, graph: bool = False):
        self.graph = graph

    def __enter__(self):
        self.prev = _in_flight[0]
        compiling = torch.compiler.is_compiling()
        _in_flight[0] = "graph" if compiling and self.graph else not compiling
        return self

    def __exit__(self, *exc):
        _in_flight[0] = self.prev
        return False


def wait_in_graph(t: torch.Tensor) -> torch.Tensor:
    """The wait of a functional collective issued under ``in_flight(graph=True)`` while tracing."""
    return _fc.wait_tensor(t)


def _wait(t: torch.Tensor) -> torch.Tensor:
    if _in_flight[0] == "graph":
        return t  # the caller waits (wait_in_graph) where the graph should
    if _in_flight[0]:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor

        return AsyncCollectiveTensor(t)  # waits on its first use
    return _fc.wait_tensor(t)


def waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or, for a collective's result still in flight (PyTorch's
    ``AsyncCollectiveTensor``, see :class:`in_flight`), the finished plain tensor.

    For results that leave dtshard with an autograd history (``DTensor.to_local()`` of a tensor
    that requires grad): torch 2.13's AOTAutograd replaces an ``AsyncCollectiveTensor`` input of a
    compiled region by its waited inner tensor, which has no autograd history, so the gradient of
    everything before the region (an embedding in front of a compiled transformer block) would
    silently be zero."""
    if type(t) is torch.Tensor:
        return t
    from torch.distributed._functional_collectives import AsyncCollectiveTensor

    return t.trigger_wait() if isinstance(t, AsyncCollectiveTensor) else t


def consumed(out: torch.Tensor, *results: torch.Tensor) -> torch.Tensor:
    """``out``, made to depend on collective ``results`` that this rank does not read (an
    exchange in which it receives nothing).  Eagerly ``out`` itself.  While tracing, a result no
    output depends on is left out of this rank's graph by AOTAutograd's partitioner (it keeps
    only what the outputs need) while the ranks that read it keep it: the ranks would then wait in
    different collectives.  The dependency is an empty slice of each result (a view: nothing
    copied), summed (zero) and added."""
    if type(out) is torch.Tensor and not torch.compiler.is_compiling() and _current_mode() is None:
        return out
    for r in results:
        out = out + (r.narrow(0, 0, 0) if r.dim() else r.view(1).narrow(0, 0, 0)).sum().to(out.dtype)
    return out


def _notify(kind: str, mesh_dim, nbytes: int, group_size: int, recv: int | None = None) -> None:
    """Tell the observers (CommCounter) of one collective: its kind, the mesh dim (a tuple for a
    flattened group), bytes this rank sends, and bytes it receives (by default what the kind's
    ring algorithm receives; all_to_all passes its own)."""
    if recv is None:
        recv = _RECV.get(kind, lambda b, n: b)(nbytes, group_size)
    for observer in _observers:
        observer(kind, mesh_dim, nbytes, group_size, recv)


#: bytes received per rank from bytes sent, by kind (all_gather and reduce_scatter are symmetric;
#: a ring all_reduce receives what it sends)
_RECV = {"broadcast": lambda b, n: b}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def mesh_coordinate(mesh: DeviceMesh) -> tuple[int, ...]:
    """This rank's coordinate on ``mesh`` (cached per mesh object)."""
    hit = _coordinates.get(id(mesh))
    if hit is None or hit[0]() is not mesh:
        c = mesh.get_coordinate()
        if c is None:
            raise RuntimeError(
                f"rank {dist.get_rank()} is not part of mesh {mesh}; dtshard tensors live only on "
                "the ranks of their mesh."
            )
        return _cache_put(_coordinates, id(mesh), mesh, tuple(c))
    return hit[1]


@hooks.constant_result  # a parallel style's hook asks it inside compiled blocks (the rank tables do not trace)
def sub_mesh_dims(big: DeviceMesh, sub: DeviceMesh) -> tuple[int, ...] | None:
    """The dims of ``big`` that ``sub`` is, for this rank: ``sub`` a sub-mesh of ``big`` (a slice
    ``big[names]`` through this rank, e.g. a tensor-parallel ``mesh["tp"]`` of a ``(dp, cp, tp)``
    mesh): its dim names among ``big``'s, the same sizes, and its ranks those of ``big`` along
    those dims at this rank's other coordinates.  None otherwise (or for a rank outside ``big``)."""
    bn, sn = big.mesh_dim_names, sub.mesh_dim_names
    if not bn or not sn or len(sn) >= len(bn) or any(n not in bn for n in sn):
        return None
    dims = tuple(bn.index(n) for n in sn)
    if list(dims) != sorted(dims) or any(big.size(d) != sub.size(i) for i, d in enumerate(dims)):
        return None
    coord = big.get_coordinate()
    if coord is None:
        return None
    index = tuple(slice(None) if d in dims else c for d, c in enumerate(coord))
    return dims if rank_table(big, index) == rank_table(sub) else None


def rank_table(mesh: DeviceMesh, index: tuple = ()):
    """``mesh.mesh[index].tolist()``: the ranks of the mesh (or of a slice of it), read outside any
    fake or tracing dispatch mode (the table is a real tensor, and dtshard may ask while
    torch.compile traces)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return mesh.mesh[index].tolist()


def is_member(mesh: DeviceMesh) -> bool:
    """Is this rank part of ``mesh``?  (A rank outside a sub-mesh runs the same program; its
    DTensors on that mesh hold empty shards and their ops are no-ops, as in PyTorch.)"""
    hit = _members.get(id(mesh))
    if hit is None or hit[0]() is not mesh:
        return _cache_put(_members, id(mesh), mesh, mesh.get_coordinate() is not None)
    return hit[1]


_members: dict = {}


def mesh_dim_rank(mesh: DeviceMesh, mesh_dim: int) -> int:
    return mesh_coordinate(mesh)[mesh_dim]


def group_rank(mesh: DeviceMesh, mesh_dim) -> int:
    """This rank's index in the group of one mesh dim, or of a tuple of mesh dims flattened."""
    coord = mesh_coordinate(mesh)
    if not isinstance(mesh_dim, tuple):
        return coord[mesh_dim]
    r = 0
    for d in sorted(mesh_dim):
        r = r * mesh.size(d) + coord[d]
    return r


def world_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def all_gather(x: torch.Tensor, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Concatenate every rank's ``x`` along dim 0 (all ranks pass equal shapes)."""
    name, n = _group(mesh, mesh_dim)
    if _observers:
        _notify("all_gather", mesh_dim, (n - 1) * _nbytes(x), n)
    x = x.contiguous()
    order = _member_order(mesh, mesh_dim)
    pg = _eager_group(mesh, mesh_dim, x)
    if pg is not None:
        out = x.new_empty((n * x.shape[0],) + tuple(x.shape[1:]) if x.dim() else (n,))
        _pg_all_gather(pg, out, x, False).wait()
    else:
        out = _wait(_fc.all_gather_into_tensor(x, n, name))
    return out if order is None else _blocks_from_group_order(out, order)


def can_overlap(x: torch.Tensor) -> bool:
    """Can a collective on ``x`` be left in flight while the caller computes?  Eagerly on a plain
    tensor with no dispatch mode (the work handle is waited later), or while torch.compile
    traces (the functional collective's wait goes later in the graph: ``in_flight(graph=True)``)."""
    if _in_flight[0]:
        return False
    if torch.compiler.is_compiling():
        return True
    return type(x) is torch.Tensor and _current_mode() is None


def reduce_scatter(x: torch.Tensor, op: str, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Reduce ``x`` (shape ``(n*b, ...)``) over the group; rank ``i`` gets block ``i``.  On a
    backend whose reduce_scatter lacks ``op`` (:data:`REDUCE_SCATTER_LACKS`): an all_reduce (as
    such reported to the observers), of which this rank keeps its block."""
    name, n = _group(mesh, mesh_dim)
    if _lacks_reduce_scatter(mesh, mesh_dim, op):
        full = all_reduce(x, op, mesh, mesh_dim)
        b = x.shape[0] // n
        return full.narrow(0, group_rank(mesh, mesh_dim) * b, b).clone(memory_format=torch.contiguous_format)
    if _observers:
        _notify("reduce_scatter", mesh_dim, (n - 1) * _nbytes(x) // n, n)
    x = x.contiguous()
    order = _member_order(mesh, mesh_dim)
    if order is not None:
        x = _blocks_to_group_order(x, order)
    pg = _eager_group(mesh, mesh_dim, x) if op in _REDUCE_OPS else None
    if pg is not None:
        out = x.new_empty((x.shape[0] // n,) + tuple(x.shape[1:]))
        work = _pg_reduce_scatter(pg, out, x, op, False)
        del x  # the backend holds what it needs: a packed input the caller let go dies before the wait
        work.wait()
        return out
    return _wait(_fc.reduce_scatter_tensor(x, op, n, name))


def all_reduce(x: torch.Tensor, op: str, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Elementwise reduction (``sum``, ``avg``, ``max``, ``min``) over the group; new tensor."""
    name, n = _group(mesh, mesh_dim)
    if _observers:
        _notify("all_reduce", mesh_dim, 2 * (n - 1) * _nbytes(x) // n, n)
    pg = _eager_group(mesh, mesh_dim, x) if op in _REDUCE_OPS else None
    if pg is not None:
        out = x.clone(memory_format=torch.contiguous_format)
        opts = dist.AllreduceOptions()
        opts.reduceOp = _REDUCE_OPS[op]
        pg.allreduce([out], opts).wait()
        return out
    return _wait(_fc.all_reduce(x.contiguous(), op, name))


def reduce(x: torch.Tensor, op: str, mesh: DeviceMesh, mesh_dim, dst_index: int) -> torch.Tensor:
    """The elementwise reduction (``sum``, ``max``, ``min``) of the group's ``x`` on the member at
    index ``dst_index`` of the group of ``mesh_dim`` (a tuple: the flattened group); what the others
    get back is not to be read.  Accounted as a chain into the destination: every other member
    sends its (partial) result once, and a member receives at most one.  Traced (torch.compile),
    or on a backend other than gloo and NCCL, it runs as an all_reduce (the same values on the
    destination, more bytes)."""
    name, n = _group(mesh, mesh_dim)
    if _observers:
        _notify("reduce", mesh_dim, 0 if group_rank(mesh, mesh_dim) == dst_index else _nbytes(x), n, _nbytes(x))
    order = _member_order(mesh, mesh_dim)
    root = dst_index if order is None else order[dst_index]  # the destination's group rank
    pg = _eager_group(mesh, mesh_dim, x) if op in _REDUCE_OPS else None
    if pg is not None and _backend_name(pg) in ("gloo", "nccl"):
        out = x.clone(memory_format=torch.contiguous_format)
        opts = dist.ReduceOptions()
        opts.reduceOp = _REDUCE_OPS[op]
        opts.rootRank = root
        opts.rootTensor = 0
        pg.reduce([out], opts).wait()
        return out
    return _wait(_fc.all_reduce(x.contiguous(), op, name))


def all_to_all(
    x: torch.Tensor,
    output_split_sizes: Sequence[int],
    input_split_sizes: Sequence[int],
    mesh: DeviceMesh,
    mesh_dim: int,
) -> torch.Tensor:
    """``all_to_all_single`` along dim 0 of ``x`` with the given (possibly uneven) splits."""
    name, n = _group(mesh, mesh_dim)
    if _observers:
        me = group_rank(mesh, mesh_dim)
        row = x.element_size() * (x[0].numel() if x.dim() and x.shape[0] else math.prod(x.shape[1:]))
        sent = (sum(input_split_sizes) - input_split_sizes[me]) * row
        _notify("all_to_all", mesh_dim, sent, n, (sum(output_split_sizes) - output_split_sizes[me]) * row)
    x = x.contiguous()
    if x.is_complex():
        # gloo's all_to_all takes no complex dtype: move the (real, imaginary) pairs instead (a
        # trailing dim of 2; the splits count dim-0 rows, so they stay the same)
        out = all_to_all(torch.view_as_real(x), output_split_sizes, input_split_sizes, mesh, mesh_dim) \
            if not _observers else _quiet_all_to_all(x, output_split_sizes, input_split_sizes, mesh, mesh_dim)
        return torch.view_as_complex(out)
    order = _member_order(mesh, mesh_dim)
    if order is not None:  # send and receive in group-rank order, return in member order
        inv = [0] * n
        for i, p in enumerate(order):
            inv[p] = i
        pieces = x.split(list(input_split_sizes))
        x = torch.cat([pieces[inv[p]] for p in range(n)])
        input_split_sizes = [input_split_sizes[inv[p]] for p in range(n)]
        got_sizes = [output_split_sizes[inv[p]] for p in range(n)]
        got = _a2a_call(x, got_sizes, input_split_sizes, mesh, mesh_dim, name).split(got_sizes)
        return torch.cat([got[order[i]] for i in range(n)])
    return _a2a_call(x, output_split_sizes, input_split_sizes, mesh, mesh_dim, name)


def _a2a_call(x, output_split_sizes, input_split_sizes, mesh, mesh_dim, name) -> torch.Tensor:
    pg = _eager_group(mesh, mesh_dim, x)
    if pg is not None:
        out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
        pg.alltoall_base(out, x, list(output_split_sizes), list(input_split_sizes), dist.AllToAllOptions()).wait()
        return out
    return _wait(_fc.all_to_all_single(x, list(output_split_sizes), list(input_split_sizes), name))


def _quiet_all_to_all(x, output_split_sizes, input_split_sizes, mesh, mesh_dim) -> torch.Tensor:
    """The real-pair all_to_all of a complex ``x``, not reported again to the observers (the call
    for ``x`` itself already was)."""
    saved = list(_observers)
    _observers.clear()
    try:
        return all_to_all(torch.view_as_real(x), output_split_sizes, input_split_sizes, mesh, mesh_dim)
    finally:
        _observers.extend(saved)


def _quiet_all_to_all_real(x, output_split_sizes, input_split_sizes, mesh, mesh_dim) -> torch.Tensor:
    """:func:`all_to_all` not reported to the observers (a piece of a transfer its caller reports)."""
    saved = list(_observers)
    _observers.clear()
    try:
        return all_to_all(x, output_split_sizes, input_split_sizes, mesh, mesh_dim)
    finally:
        _observers.extend(saved)


def broadcast(x: torch.Tensor, src_index: int, mesh: DeviceMesh, mesh_dim: int) -> torch.Tensor:
    """Every rank gets the ``x`` of the rank at index ``src_index`` along ``mesh_dim``."""
    name, n = _group(mesh, mesh_dim)
    if _observers:
        if group_rank(mesh, mesh_dim) != src_index:
            _notify("broadcast", mesh_dim, _nbytes(x), n)
        else:  # the source moves no bytes in the accounting, but takes part in the call
            for observer in _trace.source_observers:
                observer("broadcast", mesh_dim, n)
    order = _member_order(mesh, mesh_dim)
    src = src_index if order is None else order[src_index]  # the source's group rank
    return _fc.wait_tensor(_fc.broadcast(x.contiguous(), src, name))


def all_gather_object(obj, mesh: DeviceMesh, mesh_dim: int) -> list:
    """Gather a picklable object from every rank of one mesh dim (used by checks, not hot paths)."""
    group = mesh.get_group(mesh_dim)
    out = [None] * mesh.size(mesh_dim)
    dist.all_gather_object(out, obj, group=group)
    return out


def all_gather_object_mesh(obj, mesh: DeviceMesh) -> list:
    """Gather a picklable object from every rank of the whole mesh (all its dims flattened), in
    no particular order: callers include what identifies the sender (used by checks and by
    metadata exchanges whose size all ranks know, not hot paths)."""
    group = mesh.get_group(0) if mesh.ndim == 1 else flat_group(mesh, tuple(range(mesh.ndim)))
    out = [None] * mesh.size()
    dist.all_gather_object(out, obj, group=group)
    return out


def init_device_mesh(device_type: str, mesh_shape, *, mesh_dim_names=None, backend_override=None) -> DeviceMesh:
    """PyTorch's ``init_device_mesh`` (same signature, returns its ``DeviceMesh``), except that
    every mesh-dim process group inherits the default group's timeout.

    PyTorch creates the sub-groups of an N-D mesh with its 30-minute default even when the world
    group was given a short timeout, so one failing rank could block the others for half an hour.
    """
    if backend_override is None:
        backend_override = _default_timeout_overrides(device_type, len(tuple(mesh_shape)))
    kwargs = {"mesh_dim_names": mesh_dim_names}
    if backend_override is not None:
        kwargs["backend_override"] = backend_override
    return _torch_init_device_mesh(device_type, tuple(mesh_shape), **kwargs)


def _default_timeout_overrides(device_type: str, ndim: int):
    """``backend_override`` giving every mesh dim's group the default group's backend and
    timeout (None when there is no default group or an unusual backend)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    default = dist.distributed_c10d._get_default_group()
    backend = dist.get_backend(default)
    options_cls = {"gloo": getattr(dist, "ProcessGroupGloo", None), "nccl": getattr(dist, "ProcessGroupNCCL", None)}.get(backend)
    try:
        timeout = default._get_backend(torch.device(device_type)).options._timeout
        opts = options_cls._Options() if backend == "gloo" else options_cls.Options()
        opts._timeout = timeout
        return {i: (backend, opts) for i in range(ndim)}
    except Exception:  # an unusual backend: keep PyTorch's defaults
        return None


_regrouped: dict = {}


def regrouped_mesh(mesh: DeviceMesh, k: int) -> DeviceMesh:
    """``mesh``'s ranks, in order, as a 2-D mesh of shape ``(-1, k)``: dim 1 is groups of ``k``
    consecutive ranks (FSDP's ``reshard_after_forward=k``: the group a parameter is resharded to
    after forward).  Every rank must call it (it creates process groups); cached per (mesh, k)."""
    key = (id(mesh), k)
    hit = _regrouped.get(key)
    if hit is not None and hit[0]() is mesh:
        return hit[1]
    kwargs = {}
    overrides = _default_timeout_overrides(mesh.device_type, 2)
    if overrides is not None:
        kwargs["backend_override"] = (overrides[0], overrides[1])  # the constructor takes a tuple
    return _cache_put(_regrouped, key, mesh, DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, k), **kwargs))


def init_process_group(backend: str = "gloo", *, timeout_s: float = 60.0, **kwargs) -> None:
    """Initialise the default process group with a finite timeout (dtshard never waits forever)."""
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


# ---------------------------------------------------------------------------------------------
# Flat, optionally asynchronous collectives into caller-given buffers (used by dtshard.fsdp).
# Eager only: FSDP issues them from module and autograd hooks on plain tensors, and lets the
# work run while the next layer computes.  Each returns the backend's work handle (``.wait()``)
# when ``async_op=True``, else waits and returns None.  Traffic is reported when the call is
# issued, with the same byte accounting as the functions above.
# ---------------------------------------------------------------------------------------------


def _pg_all_gather(pg, out: torch.Tensor, x: torch.Tensor, async_op: bool):
    """``all_gather_single`` (what ``dist.all_gather_into_tensor`` calls in PyTorch 2.13), else
    the older ``_allgather_base``."""
    if hasattr(pg, "all_gather_single"):
        opts = dist.distributed_c10d.AllgatherOptions()
        opts.asyncOp = async_op
        return pg.all_gather_single(out, x, opts)
    return pg._allgather_base(out, x)


def _pg_reduce_scatter(pg, out: torch.Tensor, x: torch.Tensor, op: str, async_op: bool):
    """``reduce_scatter_single`` (what ``dist.reduce_scatter_tensor`` calls in PyTorch 2.13),
    else ``_reduce_scatter_base``.  On gloo either copies the whole input into a staging buffer
    while the call is issued (in the caller's thread) and reduces that copy asynchronously: the
    input is not read after the call returns (``tests/distributed/test_collective_staging.py``
    checks it, so a PyTorch upgrade that changes it fails there first)."""
    if _lacks_reduce_scatter_pg(pg, op):  # an all_reduce of which this rank keeps its block
        full = x.reshape(-1).clone()
        ar = dist.AllreduceOptions()
        ar.reduceOp = _REDUCE_OPS[op]
        pg.allreduce([full], ar).wait()
        out.view(-1).copy_(full.view(pg.size(), -1)[pg.rank()])
        return _Done()
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = _REDUCE_OPS[op] if isinstance(op, str) else op  # a name, or a ReduceOp
    if hasattr(pg, "reduce_scatter_single"):
        opts.asyncOp = async_op
        return pg.reduce_scatter_single(out, x, opts)
    return pg._reduce_scatter_base(out, x, opts)


def _finish(work, async_op: bool):
    if async_op:
        return work
    work.wait()
    return None


class _Done:
    """The handle of a collective a custom comm ran synchronously (it returned no work)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def _run_comm(comm, async_op: bool, **kwargs):
    """Call a user's FSDP comm object (``torch.distributed.fsdp``'s ``AllGather`` /
    ``ReduceScatter`` protocol) and return a work handle (``async_op``) or wait."""
    work = comm(async_op=async_op, **kwargs)
    if work is None:
        return _Done() if async_op else None
    return _finish(work, async_op)


def comm_allocate(comm, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A flat buffer of ``size`` elements from a user's comm object (its ``allocate``), or a
    plain one when ``comm`` is None."""
    if comm is None:
        return torch.empty(size, dtype=dtype, device=device)
    t = comm.allocate((size,), dtype=dtype, device=device)
    if t.numel() != size or t.dtype != dtype or t.device != device or not t.is_contiguous():
        raise ValueError(
            f"{type(comm).__name__}.allocate(({size},), dtype={dtype}, device={device}) returned a tensor of "
            f"shape {tuple(t.shape)}, {t.dtype} on {t.device}; it must return a contiguous buffer of that size")
    return t.view(-1)


class ProcessGroupAllocComm:
    """FSDP comm (all_gather and reduce_scatter) whose staging buffers come from the process
    group's own allocator where the backend has one (NCCL's, for zero-copy transfers), else
    plain ones (gloo): ``FSDPModule.set_allocate_memory_from_process_group_for_comm``."""

    def __init__(self, mesh: DeviceMesh, mesh_dim: int):
        self._pg = _group_object(mesh, mesh_dim)

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        backend = self._pg._get_backend(device)
        if backend.supports_tensor_alloc(device):
            return backend.allocate_tensor(math.prod(int(s) for s in size), dtype=dtype, device=device)
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op=None, async_op: bool = False):
        if op is None:
            return _pg_all_gather(group, output_tensor, input_tensor, async_op)
        return _pg_reduce_scatter(group, output_tensor, input_tensor, op, async_op)


#: ranks -> the separate process group made for them (FSDP's reduce_scatter group)
_separate_groups: dict = {}


def separate_group_mesh(mesh: DeviceMesh, mesh_dim: int) -> DeviceMesh:
    """A 1-D mesh over this rank's group of ``mesh_dim`` with a process group of its own (one
    per set of ranks, made once): FSDP's reduce_scatter then runs on a communicator separate
    from its all_gather's.  Collective over each group's ranks only (local synchronization):
    every rank of ``mesh`` must call it."""
    ranks = tuple(dist.get_process_group_ranks(_group_object(mesh, mesh_dim)))
    hit = _separate_groups.get(ranks)
    if hit is None:
        pg = dist.new_group(list(ranks), use_local_synchronization=True, group_desc="dtshard_fsdp_reduce_scatter")
        hit = _separate_groups[ranks] = DeviceMesh.from_group(pg, mesh.device_type)
    return hit


def all_gather_into(out: torch.Tensor, x: torch.Tensor, mesh: DeviceMesh, mesh_dim: int, *,
                    async_op: bool = False, comm=None):
    """Concatenate every rank's contiguous ``x`` along dim 0 into ``out`` (``n * x.numel()``
    elements, contiguous, same dtype): one ``all_gather_into_tensor`` over one mesh dim.
    ``comm``: a user's ``AllGather`` object runs it instead (``set_custom_all_gather``)."""
    pg = _group_object(mesh, mesh_dim)
    n = group_size(mesh, mesh_dim)
    if out.numel() != n * x.numel() or out.dtype != x.dtype or not (out.is_contiguous() and x.is_contiguous()):
        raise ValueError(
            f"all_gather_into: output of {out.numel()} {out.dtype} elements cannot hold {n} contiguous "
            f"inputs of {x.numel()} {x.dtype} elements (mesh dim {mesh_dim} of mesh {tuple(mesh.shape)})")
    if _observers:
        _notify("all_gather", mesh_dim, (n - 1) * _nbytes(x), n)
    order = _member_order(mesh, mesh_dim)
    if order is not None:  # waited here, then the blocks put in member order
        if comm is not None:
            _run_comm(comm, False, output_tensor=out, input_tensor=x, group=pg)
        else:
            _pg_all_gather(pg, out, x, False).wait()
        out.copy_(_blocks_from_group_order(out, order))
        return _Done() if async_op else None
    if comm is not None:
        return _run_comm(comm, async_op, output_tensor=out, input_tensor=x, group=pg)
    return _finish(_pg_all_gather(pg, out, x, async_op), async_op)


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, op: str, mesh: DeviceMesh, mesh_dim: int, *,
                        async_op: bool = False, consume_input: bool = False, comm=None):
    """Reduce the contiguous ``x`` (``n * out.numel()`` elements) over one mesh dim; rank ``i``
    gets block ``i`` in ``out``.  ``op``: ``sum``, ``max`` or ``min`` (gloo has no ``avg`` for
    reduce_scatter: callers divide afterwards).

    ``consume_input``: the caller is done with ``x`` (a packed buffer): where the backend copied
    it while issuing the call (gloo on CPU, see :func:`_pg_reduce_scatter`), its storage is
    released at once (resized to 0), so an asynchronous reduce_scatter holds one copy of the
    input while in flight, not two.  Elsewhere (NCCL reads it on its stream) it is left alone.
    ``comm``: a user's ``ReduceScatter`` object runs it instead (``set_custom_reduce_scatter``),
    with ``ReduceOp.SUM`` for ``sum`` (FSDP divides afterwards)."""
    pg = _group_object(mesh, mesh_dim)
    n = group_size(mesh, mesh_dim)
    if op not in _REDUCE_OPS:
        raise ValueError(f"reduce_scatter_into: op {op!r} is not one of {sorted(_REDUCE_OPS)}")
    if x.numel() != n * out.numel() or out.dtype != x.dtype or not (out.is_contiguous() and x.is_contiguous()):
        raise ValueError(
            f"reduce_scatter_into: input of {x.numel()} {x.dtype} elements does not split into {n} "
            f"outputs of {out.numel()} {out.dtype} elements (mesh dim {mesh_dim} of mesh {tuple(mesh.shape)})")
    if _observers:
        if comm is None and _lacks_reduce_scatter(mesh, mesh_dim, op):  # runs as an all_reduce
            _notify("all_reduce", mesh_dim, 2 * (n - 1) * _nbytes(x) // n, n)
        else:
            _notify("reduce_scatter", mesh_dim, (n - 1) * _nbytes(x) // n, n)
    order = _member_order(mesh, mesh_dim)
    if order is not None:  # the input's blocks in group-rank order (a copy, the caller's to drop)
        x = _blocks_to_group_order(x, order)
        consume_input = False
    if comm is not None:  # a user's ReduceScatter object (set_custom_reduce_scatter)
        return _run_comm(comm, async_op, output_tensor=out, input_tensor=x, group=pg, op=_REDUCE_OPS[op])
    work = _pg_reduce_scatter(pg, out, x, op, async_op)
    if consume_input and async_op and x.device.type == "cpu" and _is_gloo(pg):
        x.untyped_storage().resize_(0)
        # gloo's work object holds its staging copy until the work object is destroyed, not
        # until the reduction ends: hand it to the waiter thread, which drops it at the end
        return _Released(work)
    return _finish(work, async_op)


class _Released:
    """The handle of an asynchronous gloo collective whose work object is waited on, and dropped,
    by a waiter thread, so what the work object holds (gloo's staging copy of a reduce_scatter's
    input: as large as the input) is freed when the collective ends, not when the caller gets
    round to ``wait()``.  ``wait()`` blocks until then and raises what the collective raised
    (its process group's timeout bounds it)."""

    __slots__ = ("_done", "_error")

    def __init__(self, work):
        self._done = threading.Event()
        self._error = None
        _waiter_queue().put((work, self))

    def wait(self) -> bool:
        self._done.wait()
        if self._error is not None:
            raise self._error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()


_waiter: list = [None, None]  # [pid, queue] of this process's waiter thread


def _waiter_queue() -> "queue.SimpleQueue":
    if _waiter[0] != os.getpid():  # none yet, or this is a forked child (threads do not survive)
        q: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_wait_loop, args=(q,), name="dtshard-collective-waiter", daemon=True).start()
        _waiter[0], _waiter[1] = os.getpid(), q
    return _waiter[1]


def _wait_loop(q: "queue.SimpleQueue") -> None:
    while True:
        work, handle = q.get()
        try:
            work.wait()  # releases the GIL while it blocks
        except BaseException as e:  # noqa: BLE001 - handed to the caller's wait()
            handle._error = e
        del work  # the staging buffer goes here, with the last reference
        handle._done.set()
        del handle


def _is_gloo(pg) -> bool:
    try:
        return dist.get_backend(pg) == "gloo"
    except Exception:  # noqa: BLE001 - a group torch does not know the backend of: assume not
        return False


def all_reduce_(x: torch.Tensor, op: str, mesh: DeviceMesh, mesh_dim: int, *, async_op: bool = False):
    """In-place elementwise reduction (``sum``, ``max``, ``min``) of the contiguous ``x`` over
    one mesh dim."""
    pg = _group_object(mesh, mesh_dim)
    n = group_size(mesh, mesh_dim)
    if op not in _REDUCE_OPS:
        raise ValueError(f"all_reduce_: op {op!r} is not one of {sorted(_REDUCE_OPS)}")
    if not x.is_contiguous():
        raise ValueError("all_reduce_: the tensor must be contiguous (it is reduced in place)")
    if _observers:
        _notify("all_reduce", mesh_dim, 2 * (n - 1) * _nbytes(x) // n, n)
    opts = dist.AllreduceOptions()
    opts.reduceOp = _REDUCE_OPS[op]
    return _finish(pg.allreduce([x], opts), async_op)


# ---------------------------------------------------------------------------------------------
# Pieces of one pipelined transfer (``dtshard.redistribute``'s pipelined packing).  Eager only,
# on plain tensors (:func:`can_pipeline`): each call issues ONE asynchronous collective over one
# mesh dim on contiguous caller-given buffers and returns the backend's work handle (``.wait()``).
# They are not reported to the observers one by one: the caller reports the whole transfer once,
# with :func:`report_transfer` and the bytes of the un-pipelined collective, so a CommCounter sees
# one collective and the same bytes whichever path ran.
# ---------------------------------------------------------------------------------------------


def can_pipeline(x: torch.Tensor) -> bool:
    """May a transfer of ``x`` be cut into asynchronous pieces?  Eagerly only: a plain (not
    complex: gloo has no complex dtypes) tensor, no dispatch mode, not while torch.compile traces,
    and not inside :class:`in_flight` (whose caller wants the collective's result unwaited)."""
    return (type(x) is torch.Tensor and not x.is_complex() and not _in_flight[0]
            and _current_mode() is None and not torch.compiler.is_compiling())


def _piece_check(what: str, ok: bool, detail: str, mesh: DeviceMesh, mesh_dim: int) -> None:
    if not ok:
        raise ValueError(f"{what}: {detail} (mesh dim {mesh_dim} of mesh {tuple(mesh.shape)})")


def start_all_gather(out: torch.Tensor, x: torch.Tensor, mesh: DeviceMesh, mesh_dim: int):
    """Issue an all_gather of ``x`` (made contiguous) into the contiguous ``out`` (``n * x.numel()``
    elements, member ``r``'s piece at block ``r``); returns the work handle.  Not reported."""
    n = group_size(mesh, mesh_dim)
    _piece_check("start_all_gather", out.is_contiguous() and out.numel() == n * x.numel() and out.dtype == x.dtype,
                 f"output {tuple(out.shape)} {out.dtype} cannot hold {n} pieces {tuple(x.shape)} {x.dtype}",
                 mesh, mesh_dim)
    order = _member_order(mesh, mesh_dim)
    work = _pg_all_gather(_group_object(mesh, mesh_dim), out.view(-1), x.contiguous().view(-1), order is None)
    if order is None:
        return work
    work.wait()  # then the blocks in member order
    out.copy_(_blocks_from_group_order(out, order))
    return _Done()


def start_reduce_scatter(out: torch.Tensor, x: torch.Tensor, op: str, mesh: DeviceMesh, mesh_dim: int):
    """Issue a reduce_scatter of ``x`` (made contiguous; ``n * out.numel()`` elements, block ``r``
    for member ``r``) into the contiguous ``out`` (a view of a larger tensor is fine); ``op``:
    ``sum``, ``max``, ``min`` or ``product``.  Returns the work handle.  Not reported."""
    n = group_size(mesh, mesh_dim)
    _piece_check("start_reduce_scatter", op in _REDUCE_OPS, f"op {op!r} is not one of {sorted(_REDUCE_OPS)}",
                 mesh, mesh_dim)
    _piece_check("start_reduce_scatter",
                 out.is_contiguous() and x.numel() == n * out.numel() and out.dtype == x.dtype,
                 f"input {tuple(x.shape)} {x.dtype} does not split into {n} outputs {tuple(out.shape)} {out.dtype}",
                 mesh, mesh_dim)
    order = _member_order(mesh, mesh_dim)
    x = x.contiguous().view(-1) if order is None else _blocks_to_group_order(x.contiguous().view(-1), order)
    return _pg_reduce_scatter(_group_object(mesh, mesh_dim), out.view(-1), x, op, True)


def start_all_to_all(out: torch.Tensor, x: torch.Tensor, output_split_sizes: Sequence[int],
                     input_split_sizes: Sequence[int], mesh: DeviceMesh, mesh_dim: int):
    """Issue ``all_to_all_single`` of the 1-D ``x`` (segment ``r`` of ``input_split_sizes[r]``
    elements to member ``r``) into the contiguous 1-D ``out`` (segment ``r`` from member ``r``);
    zero splits are allowed (a piece exchanged with some members only).  Returns the work
    handle.  Not reported."""
    _piece_check("start_all_to_all",
                 x.dim() == 1 and out.dim() == 1 and out.is_contiguous() and out.dtype == x.dtype
                 and x.numel() == sum(input_split_sizes) and out.numel() == sum(output_split_sizes),
                 f"1-D buffers of {x.numel()} and {out.numel()} elements do not match splits "
                 f"{list(input_split_sizes)} -> {list(output_split_sizes)}", mesh, mesh_dim)
    if _member_order(mesh, mesh_dim) is not None:  # waited here, in member order
        out.copy_(all_to_all(x, output_split_sizes, input_split_sizes, mesh, mesh_dim)
                  if not _observers else _quiet_all_to_all_real(x, output_split_sizes, input_split_sizes, mesh, mesh_dim))
        return _Done()
    return _group_object(mesh, mesh_dim).alltoall_base(out, x.contiguous(), list(output_split_sizes),
                                                       list(input_split_sizes), dist.AllToAllOptions())


def report_transfer(kind: str, mesh_dim, nbytes: int, group_size: int, recv: int | None = None) -> None:
    """Report a transfer made of pieces (:func:`start_all_gather` and friends) to the observers
    as the one collective of ``kind`` it replaces, with that collective's bytes (sent, and
    received: by default what ``kind`` receives for ``nbytes`` sent)."""
    if _observers:
        _notify(kind, mesh_dim, nbytes, group_size, recv)
