"""``dtshard.config``: the package's global switches, in a module of their own at the bottom of
the import graph, so that any layer (the planner, redistribute, the handlers, FSDP) reads them
without importing the layers above it."""

from __future__ import annotations


class config:
    """Global switches (also settable through :func:`dtshard.replicate_fallback`)."""

    #: When an op has no rule, redistribute its inputs to Replicate, run it, and warn once per op
    #: (instead of raising NotImplementedError).
    fallback_to_replicate: bool = False
    #: Check each new plan against the op's meta kernel on every distinct local shape.
    check_plans: bool = True
    #: Reduce a leaf DTensor's Partial gradient once, right after autograd accumulates it, to the
    #: leaf's placements (dtshard.tensor._settle_grads_of), instead of in every optimizer op.
    settle_partial_grads: bool = True
    #: Partial gradients settled by a plain all_reduce go in buckets of this many bytes, one
    #: asynchronous all_reduce per bucket (``dtshard.grad_buckets``; DDP's 25 MiB); 0: one
    #: collective per gradient, right away.
    grad_bucket_bytes: int = 25 * 2**20
    #: Pipelined packing (dtshard.redistribute): a single-mesh-dim all_gather, reduce_scatter or
    #: all_to_all that needs a packing or unpacking copy (a tensor dim other than 0) and whose
    #: largest local buffer holds at least twice this many bytes is cut into ``bytes //
    #: pipeline_chunk_bytes`` pieces (at most ``pipeline_max_chunks``); each piece's collective is
    #: on the wire while the next piece is packed and the previous one unpacked.  The same plan,
    #: the same bytes (reported as one collective), each element copied once each way.  0: off.
    #: Only on meshes whose device type is in ``pipeline_device_types``.  8 MiB pieces: measured on
    #: 2 and 4 CPU/gloo ranks (benchmarks/bench_pipeline.py, benchmarks/README.md "Pipelined
    #: packing"), 2 pieces of a 16 MiB S1->R or P->S1 took 0.64-0.98x the time of one collective
    #: in 9 of 10 runs (1.06x in the tenth), while pieces of 4 MiB or less gained nothing (8 MiB
    #: transfers) or lost (8 pieces; pairwise all_to_all pieces on 4 ranks).  On CUDA (NCCL) the
    #: same size, unmeasured here: NCCL reaches its bandwidth well below 8 MiB a message.
    pipeline_chunk_bytes: int = 8 * 2**20
    #: The most pieces one pipelined transfer is cut into (see ``pipeline_chunk_bytes``).
    pipeline_max_chunks: int = 8
    #: The mesh device types on which transfers are pipelined (see ``pipeline_chunk_bytes``).
    pipeline_device_types: tuple = ("cpu", "cuda")
    #: A ``ColwiseParallel`` / ``RowwiseParallel`` ``nn.Linear`` runs each eager call as ONE
    #: autograd node over local tensors when it can (``dtshard.parallel._linear``: the same
    #: collectives and values as the per-op path, a fraction of its Python); False: always the
    #: per-op path (benchmarks compare the two).
    tp_linear_fast_path: bool = True
    #: A spatially sharded convolution (one sharded dim) overlaps its halo exchanges with compute:
    #: in backward the input window for the weight gradient travels while the input gradient is
    #: computed; in forward (``halo_overlap_forward``) the output rows that need no halo are
    #: computed while the window travels, then the boundary rows.  Measured with bench_conv.py
    #: (benchmarks/README.md): eagerly, backward 7% faster on 2 and 4 CPU ranks, forward no gain
    #: there (its join costs a copy of the output), so the forward part is off by default.
    halo_overlap: bool = True
    #: The forward part of ``halo_overlap``: compute the rows that need no halo while the halo
    #: travels (off: no gain measured on CPU).
    halo_overlap_forward: bool = False
    #: The same overlap under torch.compile (``halo_overlap_compiled``): the exchange is then an
    #: async functional all_to_all whose wait the graph places after the interior compute.  Off by
    #: default: on CPU (gloo, inductor) the compiled step is 1.6x SLOWER with it (the split graph
    #: does more work than the one-op exchange it replaces; bench_conv.py ``+compiled`` variants).
    halo_overlap_compiled: bool = False
    #: Random ops on DTensors (dtshard/rules/random.py).  "global" (the default): every rank draws
    #: the op's FULL-size random numbers and keeps its slice, so the global values equal one
    #: process with the same seed on ANY mesh and placements (sharding-invariant init, dropout
    #: masks, ...).  "local": an in-place fill (``uniform_``, ``normal_``, ``bernoulli_(p)``, ...,
    #: which ``torch.nn.init`` uses) or ``rand_like``/``randn_like`` of a Shard/Replicate tensor
    #: draws only the local shard, from a generator seeded by one number drawn from the default
    #: generator (the same on every rank, which keeps the ranks' generators in step) and the
    #: rank's shard coordinates: shards still differ and replicas still agree, but the values
    #: change with the layout.  What "global" costs: benchmarks/bench_random.py.
    random_draws: str = "global"
    #: Attention on a sequence-sharded DTensor (context parallelism, dtshard/rules/attention_cp.py):
    #: "auto" picks the strategy with the least ESTIMATED STEP TIME OF THE SLOWEST RANK
    #: (``attention_cp.estimate``: the (query, key) pairs that rank evaluates, from the mask's
    #: table when mask_kv reads one, plus the communication it waits for) among "ulysses"
    #: (sequence <-> heads all_to_alls, each tensor with its own heads), "allgather_kv" (K and V
    #: gathered once, with their own heads), "ring" (K and V passed around the ring, the exchange
    #: under compute), "mask_kv" (the K/V rows a readable mask leaves unmasked) and "balanced"
    #: (causal on a plain Shard: allgather_kv whose busier rank of each pair (r, n-1-r) hands its
    #: last rows to its partner and gets their output and log-sum-exp back, so the pairs evaluate
    #: the same number of (query, key) pairs); naming one forces it where it applies (benchmarks,
    #: tests).  "auto" gathers K and V whole only up to ``attention_cp_gather_bytes`` per rank,
    #: else passes them around the ring.  ``dtshard.debug.explain`` prints each call's estimates.
    attention_cp: str = "auto"
    #: The most bytes of K and V per rank ``attention_cp = "auto"`` gathers whole; above, it
    #: passes them around the ring.
    attention_cp_gather_bytes: int = 256 * 2**20
    #: The costs ``auto`` estimates with, measured on the project's 2-core CPU with gloo, 4 ranks
    #: (``python benchmarks/bench_attention_cp.py --calibrate`` measures them on any machine;
    #: benchmarks/README.md "Context parallelism" has the numbers): seconds per (query, key) pair
    #: per head and per element of ``E + Ev``, forward + backward, of the fused CPU kernel on one
    #: thread (6.1-6.4e-11 at 1K-2K tokens, 8 heads of 64); seconds per byte a rank receives
    #: (3.8 ns at best, 6.6 ns on average under load: a 4 MiB all_gather on 4 ranks) and per
    #: collective call (an 8-byte all_gather: 0.58 ms at best, 7 ms on average under load).  On
    #: GPUs with NCCL all three are far smaller: set them to your machine's (their ratios decide).
    attention_cp_pair_seconds: float = 6.5e-11
    #: Seconds per byte a rank receives (see ``attention_cp_pair_seconds``).
    attention_cp_byte_seconds: float = 6.6e-9
    #: Seconds per collective call (see ``attention_cp_pair_seconds``).
    attention_cp_collective_seconds: float = 2e-3
    #: Debug switch: before context parallelism uses an attention mask, check that every rank of
    #: the mesh holds the same one (a digest of its bytes, one all_gather_object per call).  The
    #: exchange plans assume it and cannot see a mask that differs per rank (a user error).
    attention_cp_check_masks: bool = False
    #: Debug/test switch: also run the meta kernel where a rule's ``meta`` function stands in for
    #: it, and raise RuleError when the two disagree (the OpInfo sweep turns this on).
    verify_meta: bool = False
