"""A Hugging Face ``LlamaForCausalLM`` trained on a sequence-sharded batch (context parallelism as
placements), against the same model in one process: 3 AdamW steps, the loss of every step and
every weight after every step, on every rank.

The model code is ``transformers``' own, unchanged (``attn_implementation="sdpa"``); the only
dtshard-specific lines are how the batch is laid out and one context manager:

- ``input_ids`` and ``labels`` are ``distribute_tensor(ids, mesh, [Shard(1)])`` (CP), or
  ``[Shard(0), Shard(1)]`` on a ``("dp", "cp")`` mesh (CP x FSDP);
- the forward runs inside ``dtshard.experimental.implicit_replication()`` (PyTorch's own hook,
  ``torch.distributed.tensor.experimental.implicit_replication``, works too): the model builds
  position ids, rotary tables and masks as plain tensors from the GLOBAL sequence length (a
  DTensor reports its global shape), so every rank holds the same full tensor and it joins the
  DTensor ops as ``Replicate``; FSDP's gathered (plain) parameters join the same way.

The attention is dtshard's context-parallel SDPA (``dtshard/rules/attention_cp.py``, strategy by
cost); the loss (``transformers``' ``ForCausalLMLoss``: shift, cross entropy, mean over the
tokens) is the global token mean as a DTensor.  Under FSDP the parameters' gradients arrive as
DTensors of that one global loss, so FSDP sums them over its ranks instead of averaging
(``ParamGroup._global_loss_grads``).

Tolerances: the model runs in float64, but ``ForCausalLMLoss`` upcasts the logits to float32, so
the loss and the gradient flowing back from it carry float32 rounding, which depends on the
order of the sums: the loss within 1e-6 relative, each weight within 1e-5 of its largest
magnitude after AdamW (as in test_llama.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

import dtshard
from dtshard import Replicate, Shard
from dtshard.testing import preload_in_workers, run_distributed

# every worker (2 + 4 + 8 of them) would import transformers' Llama on its first use (~6 s of CPU
# each on 2 cores); the fork server imports it once instead, when this module is collected (before
# any pool starts).  An unusable transformers fails the tests below, where they import it.
preload_in_workers("transformers.models.llama.modeling_llama")

STEPS = 3
LR = 2e-3


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                       attn_implementation="sdpa")


def _tensor_parallel(model, tp_mesh) -> None:
    """torchtitan's block plan, the projections keeping DTensor outputs (so attention runs on
    DTensors whose heads are sharded on tp and sequence on cp)."""
    from dtshard.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    col, row = ColwiseParallel(use_local_output=False), RowwiseParallel(use_local_output=False)
    for layer in model.model.layers:
        parallelize_module(layer, tp_mesh, {
            "self_attn.q_proj": col, "self_attn.k_proj": col, "self_attn.v_proj": col, "self_attn.o_proj": row,
            "mlp.gate_proj": col, "mlp.up_proj": col, "mlp.down_proj": row})


def _train(kind: str, seq: int, strategy: str = "auto", compiled_layers=False, batch: int = 2):
    """``compiled_layers=True``: each decoder layer ``layer.compile(fullgraph=True)`` (aot_eager),
    as torchtitan compiles its blocks, and the model called with ``use_cache=False`` (training: a
    KV cache would be an extra output of each compiled layer that the backward never reaches,
    whose zero gradient AOTAutograd receives as a plain tensor and rejects for a DTensor output).
    ``compiled_layers="hooks"``: the same with ``torch._dynamo.config.wrap_top_frame = True``, so
    each layer's FSDP hooks (its parameter gather) trace into the layer's graph: FSDP on DTensor
    activations needs it (a gather compiled as a frame of its own returns plain parameters whose
    DTensor gradients its backward cannot take)."""
    from transformers import LlamaForCausalLM

    from dtshard.fsdp import fully_shard

    torch.manual_seed(0)
    ref = LlamaForCausalLM(_config()).double()
    model = copy.deepcopy(ref)
    if kind == "cp":
        mesh = dtshard.init_device_mesh("cpu", (torch.distributed.get_world_size(),), mesh_dim_names=("cp",))
        batch_layout = [Shard(1)]
        dtshard.distribute_module(model, mesh)  # the parameters replicated over the sequence ranks
    elif kind == "cp_fsdp":  # FSDP over the flattened (dp, cp) group, as torchtitan shards over dp_shard_cp
        mesh = dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        batch_layout = [Shard(0), Shard(1)]
        fsdp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
        for layer in model.model.layers:
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    elif kind == "cp_tp":  # the blocks tensor-parallel on mesh["tp"], the batch's sequence on "cp"
        mesh = dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("cp", "tp"))
        batch_layout = [Shard(1), Replicate()]
        _tensor_parallel(model, mesh["tp"])
        dtshard.distribute_module(model, mesh)  # the rest (embedding, norms, head) replicated on the whole mesh
    elif kind == "dp_tp":  # the batch on "dp", the blocks tensor-parallel on "tp" (no sequence sharding)
        mesh = dtshard.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        batch_layout = [Shard(0), Replicate()]
        _tensor_parallel(model, mesh["tp"])
        dtshard.distribute_module(model, mesh)
    else:  # "cp_fsdp_tp": torchtitan's order, TP on mesh["tp"], then FSDP over the flattened (dp, cp)
        mesh = dtshard.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
        batch_layout = [Shard(0), Shard(1), Replicate()]
        _tensor_parallel(model, mesh["tp"])
        fsdp_mesh = mesh["dp", "cp"]._flatten("dp_cp")
        for layer in model.model.layers:
            fully_shard(layer, mesh=fsdp_mesh)
        fully_shard(model, mesh=fsdp_mesh)
    if compiled_layers:
        backend = "aot_eager"
        if kind == "dp_tp":
            # a plain AOTAutograd backend: its default partitioner keeps only what the outputs
            # need, so a collective whose result a rank leaves unread would vanish from that
            # rank's graph (aot_eager's and inductor's min-cut partitioner keeps collectives)
            from functorch.compile import make_boxed_func
            from torch._dynamo.backends.common import aot_autograd

            backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward))
        wrap_top_frame = torch._dynamo.config.wrap_top_frame
        torch._dynamo.config.wrap_top_frame = compiled_layers == "hooks"
        # dp_tp: the first layer holds every exchange of the empty-shard case (measured: it
        # deadlocks without collectives.consumed as the two layers do), at half the compiles
        for layer in model.model.layers[:1] if kind == "dp_tp" else model.model.layers:
            layer.compile(backend=backend, fullgraph=True)
    extra = {"use_cache": False} if compiled_layers else {}
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=LR, foreach=False)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, foreach=False)
    ref_params = dict(ref.named_parameters())
    g = torch.Generator().manual_seed(1)
    old = dtshard.config.attention_cp
    dtshard.config.attention_cp = strategy
    rows = []
    try:
        for _ in range(STEPS):
            ids = torch.randint(0, 64, (batch, seq), generator=g)
            loss_ref = ref(input_ids=ids, labels=ids).loss
            loss_ref.backward()
            opt_ref.step()
            opt_ref.zero_grad()
            dids = dtshard.distribute_tensor(ids, mesh, batch_layout)
            with dtshard.experimental.implicit_replication():
                out = model(input_ids=dids, labels=dids, **extra)
            loss, logits = out.loss, out.logits
            assert isinstance(logits, dtshard.DTensor) and isinstance(loss, dtshard.DTensor)
            with dtshard.debug.CommCounter() as comm:
                loss.backward()
            opt.step()
            opt.zero_grad()
            dev = 0.0
            for n, p in model.named_parameters():
                assert isinstance(p, dtshard.DTensor), f"{n} is not a DTensor"
                want = ref_params[n].detach()
                dev = max(dev, ((p.full_tensor() - want).abs().max() / want.abs().max()).item())
            rows.append((loss_ref.item(), loss.full_tensor().item(), dev, tuple(logits.placements), tuple(logits.shape)))
    finally:
        dtshard.config.attention_cp = old
        if compiled_layers:
            torch._dynamo.config.wrap_top_frame = wrap_top_frame
    # bytes of the TP projections' TP-local gradients: reduced over dp x cp by an all_reduce they
    # would cost 1.5x this per rank; FSDP's reduce_scatter sums their terms instead
    tp_bytes = sum(p.numel() // 2 * p.element_size() for n, p in model.named_parameters()
                   if kind == "cp_fsdp_tp" and n.split(".")[-2].endswith("proj"))
    return rows, (comm.received("all_reduce"), tp_bytes)


@pytest.mark.parametrize("kind,world,seq,strategy,compiled_layers", [
    pytest.param("cp", 2, 13, "auto", False, id="cp2-uneven"),
    pytest.param("cp", 2, 12, "ring", False, id="cp2-ring"),
    pytest.param("cp", 4, 12, "auto", False, id="cp4"),
    # CP x FSDP, each layer compiled with its FSDP hooks (torchtitan's form): parameters gathered
    # in the layer's graph, their gradients those of one global loss (fsdp/_group.py
    # _global_loss_param); the eager global-loss path runs in cp2xfsdp2xtp2 (the same flattened
    # dp x cp group)
    pytest.param("cp_fsdp", 4, 12, "auto", "hooks", id="cp2xfsdp2-compiled-layers"),
    pytest.param("cp_tp", 4, 12, "auto", False, id="cp2xtp2"),
    # each decoder layer compiled: the parallel styles' hooks ask about sub-meshes while traced
    pytest.param("cp_tp", 4, 12, "auto", True, id="cp2xtp2-compiled-layers"),
    pytest.param("cp_fsdp_tp", 8, 12, "auto", False, id="cp2xfsdp2xtp2"),
    # a batch of ONE over dp=2, the layers compiled: half the ranks hold empty shards, receive
    # nothing in some exchanges and skip the attention kernel; their graphs must still hold every
    # collective (collectives.consumed), or the ranks deadlock in different collectives
    pytest.param("dp_tp", 4, 12, "auto", True, id="dp2xtp2-batch1-compiled-layers"),
])
def test_hf_llama_trains_on_a_sequence_sharded_batch(kind, world, seq, strategy, compiled_layers):
    batch = 1 if kind == "dp_tp" else 2
    results = run_distributed(_train, world, kind, seq, strategy, compiled_layers, batch, timeout=300)
    for rank, (rows, _) in enumerate(results):
        assert rows == results[0][0], f"rank {rank} saw other values than rank 0"
    rows = results[0][0]
    for rank, (_, (all_reduced, tp_bytes)) in enumerate(results):
        # CP x FSDP x TP: no TP gradient is all-reduced over dp x cp before FSDP's reduce_scatter
        # (fsdp/_state.py _outer_terms); measured 34 KB against 145 KB when they were
        assert all_reduced < 1.5 * tp_bytes or not tp_bytes, (rank, all_reduced, tp_bytes)
    for step, (want, got, dev, placements, shape) in enumerate(rows, 1):
        assert abs(got - want) <= 1e-6 * abs(want), f"step {step}: loss {got} vs one process's {want}"
        assert dev <= 1e-5, f"step {step}: a weight deviates by {dev:.2e} of its scale from one process's"
        assert shape == (batch, seq, 64)
        if seq % world == 0 and kind != "dp_tp":  # the sequence stays sharded through the model (uneven: the planner may
            # move a flattened (batch, sequence) dim to the batch, which is exact too)
            want = {"cp": (Shard(1),), "cp_fsdp": (Shard(0), Shard(1)), "cp_tp": (Shard(1), Replicate()),
                    "cp_fsdp_tp": (Shard(0), Shard(1), Replicate())}[kind]
            assert placements == want, placements
    if batch > 1:  # one sequence a step: its loss says little about progress (the values match above)
        assert rows[-1][0] < rows[0][0], "the model did not train"
