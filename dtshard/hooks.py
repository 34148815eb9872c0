"""Extension points: how a feature plugs into the core without the core importing it.

The core (spec, registry, planner, redistribute, collectives, dispatcher, the tensor class) calls
what features register here, and never imports the features.  A feature registers at its own
import; one that is never imported costs nothing.  This module sits at the bottom of the import
graph (it imports nothing of dtshard), so every layer may use it.

torch.compile integration (applied once ``torch._dynamo`` is imported, at once if it already is;
importing Dynamo eagerly would add about a second to ``import dtshard``):

- :func:`in_graph`: a function that becomes ONE node of a compiled graph
  (``torch.compiler.allow_in_graph``), e.g. ``from_local`` with grad;
- :func:`constant_result`: a pure function of metadata that Dynamo calls while tracing and takes
  the result of as a constant (``torch.compiler.assume_constant_result``), e.g. a question about
  meshes whose body reads a mesh's rank table (a real tensor that does not trace);
- :func:`runtime_entry_points`: functions PyTorch's runtime calls while no graph is traced (the
  dispatcher, autograd Functions' backward, end-of-backward callbacks).  Dynamo skips them and
  everything they call, as PyTorch's DTensor does with ``torch._disable_dynamo``;
- :func:`on_dynamo_import`: anything else to set up then (rules for the prims Dynamo rewrites
  ops into).

Layout extensions:

- :func:`layout_extension`: a feature that adds per-tensor layout data to a spec (its ``extra``:
  a halo's widths, ``dtshard.spatial``) registers, for the data's type, how ops on such DTensors
  run (``dispatch``), how a handler that does not read the data gets them without it (``strip``)
  and how the tensor API (``to_local``, ``redistribute``, compile's tangents) drops it
  (``drop``).  The core calls them only for a DTensor that carries such data, so no other op pays
  for the feature.  The data describes the local tensor's contents; the tensor class stamps the
  version counter it was made at in the tensor's ``__dict__`` under :data:`LAYOUT_VERSION`, so
  the extension can tell when an in-place write made it stale.

Gradient settlement:

- :func:`grad_settler`: ``fn(param, grad) -> bool`` offered every Partial gradient that reaches a
  DTensor leaf, in registration order; True means it took the gradient (a bucket that reduces it
  later, ``dtshard.grad_buckets``).  When none does, the tensor class reduces it on its own.

The other extension points are the registry's (``register_rule``, ``register_handler``; handlers
use the kit in ``dtshard.handlers``) and ``dtshard.config``.
"""

from __future__ import annotations

import sys
from typing import Callable, NamedTuple

__all__ = ["LAYOUT_VERSION", "LayoutExtension", "constant_result", "extension_of", "grad_settler", "grad_settlers",
           "in_graph", "layout_extension", "layout_extensions", "on_dynamo_import", "runtime_entry_points"]

_in_graph: list = []
_constants: list = []
_entry_points: list = []
_on_dynamo: list = []
_dynamo_ready = [False]
#: the registered gradient settlers, in order (read by the tensor class on every settlement)
grad_settlers: list[Callable] = []


def in_graph(fn):
    """Decorator: ``fn`` is one node of a torch.compile graph (``torch.compiler.allow_in_graph``)."""
    _in_graph.append(fn)
    if _dynamo_ready[0]:
        _allow_in_graph(fn)
    return fn


def constant_result(fn):
    """Decorator: while torch.compile traces, ``fn`` runs as plain Python and its result is a
    constant of the graph (``torch.compiler.assume_constant_result``).  Only for pure functions of
    metadata every rank knows the same at trace and at run time (meshes, placements); its
    arguments must be constants to Dynamo (meshes, ints, tuples)."""
    _constants.append(fn)
    if _dynamo_ready[0]:
        _assume_constant(fn)
    return fn


def runtime_entry_points(*fns) -> None:
    """Dynamo never compiles these functions (methods: the function object, or the bound/unbound
    method) as frames of their own, nor anything they call.

    When a compiled function breaks its graph (``loss.backward()``, ``print``, an explicit
    ``torch._dynamo.graph_break()``), the breaking call runs eagerly with Dynamo's frame hook still
    installed, so every Python frame it enters is a candidate for compilation.  Compiled, dtshard's
    runtime would add frames and graph breaks that the same program on plain tensors does not have,
    or fail (a resume function inside ``DTensor.__new__`` sees a DTensor without its spec).  When a
    graph IS traced, Dynamo inlines these functions as before: frame strategies decide what
    happens to frames that run, not what the tracer inlines."""
    _entry_points.extend(fns)
    if _dynamo_ready[0]:
        _skip(fns)


def on_dynamo_import(callback: Callable[[], None]) -> Callable[[], None]:
    """Decorator: run ``callback()`` once ``torch._dynamo`` is imported (at once if it already is)."""
    _on_dynamo.append(callback)
    if _dynamo_ready[0]:
        callback()
    return callback


class LayoutExtension(NamedTuple):
    #: ``dispatch(op, args, kwargs)``: the op on arguments among which a DTensor carries the data
    dispatch: Callable
    #: ``strip(op, args, kwargs, handler)``: ``handler(op, args', kwargs')`` with the data removed
    strip: Callable
    #: ``drop(dt)``: the same global tensor without the data (differentiable)
    drop: Callable


#: the registered layout extensions, by the type of the data they put in a spec's ``extra``
layout_extensions: dict[type, LayoutExtension] = {}

#: the key, in a DTensor's ``__dict__``, of its version counter when its layout data was made
LAYOUT_VERSION = "_dtshard_layout_v"


def layout_extension(data_type: type, *, dispatch: Callable, strip: Callable, drop: Callable) -> None:
    """Register the layout extension whose data (of ``data_type``) a spec holds in ``extra``."""
    layout_extensions[data_type] = LayoutExtension(dispatch, strip, drop)


def extension_of(extra: object) -> LayoutExtension:
    """The layout extension that owns the spec data ``extra``."""
    ext = layout_extensions.get(type(extra))
    if ext is None:
        raise RuntimeError(f"dtshard: a DTensor's layout carries {type(extra).__name__} data ({extra}) but no "
                           "layout extension for it is registered: import the feature that made it")
    return ext


def grad_settler(fn: Callable) -> Callable:
    """Decorator: offer ``fn(param, grad) -> bool`` every Partial gradient of a DTensor leaf."""
    grad_settlers.append(fn)
    return fn


def _allow_in_graph(fn) -> None:
    import torch

    torch.compiler.allow_in_graph(fn)


def _assume_constant(fn) -> None:
    import torch

    torch.compiler.assume_constant_result(fn)


def _skip(fns) -> None:
    # SKIP for the frame AND for every frame it calls: Dynamo's own ``skip_code`` skips only the
    # frame itself, and then compiles each function it calls as a frame of its own.
    from torch._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    skip_recursively = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for fn in fns:
        set_code_exec_strategy(getattr(fn, "__func__", fn).__code__, skip_recursively)


def _dynamo_imported() -> None:
    _dynamo_ready[0] = True
    for fn in _in_graph:
        _allow_in_graph(fn)
    for fn in _constants:
        _assume_constant(fn)
    _skip(_entry_points)
    for callback in _on_dynamo:
        callback()


class _OnDynamoImport:
    """Runs :func:`_dynamo_imported` right after ``torch._dynamo`` is imported."""

    def find_spec(self, name, path, target=None):
        if name != "torch._dynamo":
            return None
        sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return None
        exec_module = spec.loader.exec_module

        def exec_then_register(module):
            exec_module(module)
            _dynamo_imported()

        spec.loader.exec_module = exec_then_register
        return spec


if "torch._dynamo" in sys.modules:
    _dynamo_imported()
else:
    sys.meta_path.insert(0, _OnDynamoImport())
