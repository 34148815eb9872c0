"""``parallelize_module``: apply parallel styles to a module or its submodules (PyTorch's API)."""

from __future__ import annotations

import warnings
from fnmatch import fnmatch

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from dtshard.parallel.style import ParallelStyle

__all__ = ["parallelize_module"]


def parallelize_module(
    module: nn.Module,
    device_mesh: DeviceMesh | None = None,
    parallelize_plan: ParallelStyle | dict[str, ParallelStyle] | None = None,
    *,
    src_data_rank: int | None = 0,
) -> nn.Module:
    """Apply tensor parallelism: ``parallelize_plan`` is one :class:`ParallelStyle` for ``module``
    itself, or a dict from submodule paths (``fnmatch`` patterns per path component, e.g.
    ``"layers.*.attention.wq"``) to styles.  ``device_mesh`` must be 1-D (slice an N-D mesh
    first, e.g. ``mesh["tp"]``).  ``src_data_rank``: the rank, WITHIN each group of the mesh
    (as in PyTorch: on ``mesh["tp"]`` the default 0 is the first rank of every tp group), whose
    parameter values are used (scattered/broadcast by ``distribute_tensor``); ``None`` trusts
    every rank's own copy.
    """
    if device_mesh is None:
        try:
            from torch.distributed.device_mesh import _mesh_resources

            device_mesh = _mesh_resources.get_current_mesh()
        except Exception as e:  # pragma: no cover
            raise ValueError("parallelize_module: pass device_mesh") from e
    if device_mesh.ndim != 1:
        raise ValueError(
            f"parallelize_module: the mesh must be 1-D, got a {device_mesh.ndim}-D mesh "
            f"{tuple(device_mesh.shape)}; slice it first (e.g. mesh['tp'])."
        )
    if parallelize_plan is None:
        warnings.warn(
            "No parallelize_plan is provided and auto-parallel is not supported at the moment, so this "
            "parallelize_module call will do nothing.",
            stacklevel=2,
        )
        return module
    if isinstance(parallelize_plan, ParallelStyle):
        parallelize_plan.src_data_rank = src_data_rank
        return parallelize_plan._apply(module, device_mesh)
    if not isinstance(parallelize_plan, dict):
        raise TypeError(
            f"Expect Union[ParallelStyle, Dict[str, ParallelStyle]] for parallelize_plan, "
            f"{type(parallelize_plan)} found! (use the styles of dtshard.parallel, not those of "
            "torch.distributed.tensor.parallel)"
        )
    for module_path, style in parallelize_plan.items():
        if not isinstance(style, ParallelStyle):
            raise TypeError(
                f"parallelize_module: the plan entry {module_path!r} is a {type(style).__name__}; use the "
                "styles of dtshard.parallel (a torch.distributed.tensor.parallel style would build "
                "PyTorch DTensors)."
            )
        if module_path == "":
            parallelize_module(module, device_mesh, style, src_data_rank=src_data_rank)
            continue
        path_splits = module_path.split(".")
        token = path_splits[0]
        matched = [(n, m) for n, m in module.named_children() if fnmatch(n, token)]
        if not matched:
            warnings.warn(
                f"Parallelize plan key '{module_path}' could not be resolved: no submodule matching token "
                f"'{token}' in module {module}, skipping this plan entry.",
                stacklevel=2,
            )
            continue
        rest = ".".join(path_splits[1:])
        for _, submodule in matched:
            if rest:
                parallelize_module(submodule, device_mesh, {rest: style}, src_data_rank=src_data_rank)
            else:
                parallelize_module(submodule, device_mesh, style, src_data_rank=src_data_rank)
    return module
