"""``examples/tensor_parallel.py`` is a torch.distributed.tensor script with dtshard imports: run
as it is and with the imports swapped back to PyTorch's, it trains to the same losses."""

from __future__ import annotations

import os
import types

from dtshard.testing import run_distributed

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tensor_parallel.py")
OURS = ("from dtshard import Replicate, Shard, distribute_tensor, init_device_mesh\n"
        "from dtshard.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n")
THEIRS = ("from torch.distributed.tensor import Replicate, Shard, distribute_tensor, init_device_mesh\n"
          "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module\n")


def _source() -> str:
    with open(EXAMPLE) as f:
        text = f.read()
    assert OURS in text, "the example's import block changed: update this test"
    return text


def _run(lib: str) -> list:
    text = _source()
    if lib == "torch":
        text = text.replace(OURS, THEIRS)
    mod = types.ModuleType(f"example_{lib}")
    exec(compile(text, EXAMPLE, "exec"), mod.__dict__)  # noqa: S102 - our own example file
    return mod.train()


def test_example_runs_unchanged_but_for_its_import():
    text = _source()
    # the two versions differ in exactly the import lines
    diff = [a for a, b in zip(text.splitlines(), text.replace(OURS, THEIRS).splitlines()) if a != b]
    assert len(diff) == 2, diff
    ours = run_distributed(_run, 2, "dtshard")
    theirs = run_distributed(_run, 2, "torch")
    for a, b in zip(ours, theirs):
        assert len(a) == 5
        for x, y in zip(a, b):
            assert abs(x - y) <= 1e-6 * max(1.0, abs(y)), (a, b)
