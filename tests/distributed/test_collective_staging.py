"""The backend behaviour ``collectives.reduce_scatter_into(..., consume_input=True)`` relies on.

gloo (PyTorch 2.13, CPU) copies a reduce_scatter's whole input into a staging buffer while the
call is issued and reduces that copy asynchronously, so FSDP releases its packed gradient buffer
as soon as the call returns (one copy in flight instead of two).  If a PyTorch upgrade made gloo
read the input later, that release would corrupt gradients silently: this test overwrites the
input right after issuing, many times and at several sizes, and requires exact results.  It also
checks ``consume_input`` itself: the storage is released and the result is exact.
"""

from __future__ import annotations

import torch

from dtshard.testing import run_distributed


def _overwrite_after_issue():
    import torch.distributed as dist

    import dtshard
    from dtshard import collectives as C

    rank, n = dist.get_rank(), dist.get_world_size()
    bad = 0
    for size in (1, 1000, 1 << 18, 1 << 21):
        for _ in range(10):
            x = torch.arange(n * size, dtype=torch.float32) + rank
            out = torch.empty(size)
            work = dist.reduce_scatter_tensor(out, x, async_op=True)
            x.fill_(1e6)
            work.wait()
            want = sum(torch.arange(n * size, dtype=torch.float32)[rank * size:(rank + 1) * size] + r for r in range(n))
            bad += int(not torch.equal(out, want))
    mesh = dtshard.init_device_mesh("cpu", (n,))
    x = torch.arange(n * 4096, dtype=torch.float32) * (rank + 1)
    want = torch.arange(n * 4096, dtype=torch.float32)[rank * 4096:(rank + 1) * 4096] * sum(range(1, n + 1))
    out = torch.empty(4096)
    work = C.reduce_scatter_into(out, x, "sum", mesh, 0, async_op=True, consume_input=True)
    released = x.untyped_storage().size() == 0
    work.wait()
    return bad, released, torch.equal(out, want)


def test_gloo_reduce_scatter_does_not_read_its_input_after_the_call():
    for bad, released, exact in run_distributed(_overwrite_after_issue, 2):
        assert bad == 0, f"{bad} reduce_scatters read their input after the call returned"
        assert released and exact
