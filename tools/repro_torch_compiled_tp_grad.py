"""PyTorch's own FSDP2 x TP with a compiled block: the embedding's gradient comes back zero.

Why ``tests/fsdp/test_fsdp_compile.py`` does not compare dtshard's compiled FSDP x TP with
PyTorch's compiled FSDP2 on the same config: PyTorch 2.13 cannot run it correctly.  Compiling the
whole model fails at the embedding ("Mixing fake modes NYI", torchtitan#534), and compiling each
block (torchtitan's ``apply_compile``) trains with a silently wrong gradient: the embedding in
front of a compiled tensor-parallel block gets a zero gradient (with TP only and no FSDP its
``.grad`` is a plain tensor instead).  FSDP without TP is right.  Pure PyTorch, no dtshard:

    torchrun --nproc-per-node 4 tools/repro_torch_compiled_tp_grad.py          # FSDP2 x TP
    torchrun --nproc-per-node 4 tools/repro_torch_compiled_tp_grad.py notp     # FSDP2 only

prints the embedding's gradient norm eager and with the block compiled (aot_eager); measured on
2026-12-04 with torch 2.13.0 (CPU, gloo): FSDP2 x TP eager 16.33, compiled 0.00; FSDP2 only
16.33 both.
"""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(16)
        self.w1 = nn.Linear(16, 32, bias=False)
        self.w2 = nn.Linear(32, 16, bias=False)

    def forward(self, x):
        return x + self.w2(torch.relu(self.w1(self.norm(x))))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.layers = nn.ModuleList([Block()])
        self.out = nn.Linear(16, 64, bias=False)

    def forward(self, tokens):
        h = self.emb(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.out(h)


def build(compiled: bool, mesh, tp: bool) -> Model:
    torch.manual_seed(0)
    m = Model()
    if tp:
        parallelize_module(m, mesh["tp"], {
            "emb": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "out": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
        for block in m.layers:
            parallelize_module(block, mesh["tp"], {
                "norm": SequenceParallel(), "w1": ColwiseParallel(input_layouts=Shard(1)),
                "w2": RowwiseParallel(output_layouts=Shard(1))})
    if compiled:  # torchtitan's apply_compile: each block, before fully_shard
        for i, block in enumerate(m.layers):
            m.layers[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
    for block in m.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    return m


def main() -> None:
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp = "notp" not in sys.argv
    torch.manual_seed(1)
    tokens = torch.randint(0, 64, (2, 8))
    for compiled in (False, True):
        m = build(compiled, mesh, tp)
        m(tokens).float().sum().backward()
        norm = m.emb.weight.grad.full_tensor().norm().item()
        if dist.get_rank() == 0:
            print(f"{'FSDP2 x TP' if tp else 'FSDP2'}, block {'compiled' if compiled else 'eager   '}: "
                  f"embedding gradient norm {norm:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
