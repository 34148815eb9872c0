"""The FSDP demos train next to one process and match it: ``python -m dtshard.demo --model llama
--fsdp`` (2 ranks) and ``--dp 2 --tp 2`` (FSDP x TP, 4 ranks), through the demo's own worker and
its own pass/fail check (the one that sets the exit status)."""

from __future__ import annotations

import pytest

from dtshard import demo
from dtshard.testing import run_distributed


@pytest.mark.parametrize("world,dp", [(2, 2), (4, 2)], ids=["fsdp-2", "fsdp-x-tp-2x2"])
def test_llama_fsdp_demos_match_one_process(world, dp):
    results = run_distributed(demo.train_llama_worker, world, 3, dp, timeout=300)
    ranks = results[0]["ranks"]
    assert ranks[0]["dp"] == dp and ranks[0]["tp"] == world // dp
    for k in range(3):
        per_rank = [r["rows"][k] for r in ranks]
        assert demo._llama_step_ok(per_rank), per_rank
    # FSDP's own collectives only (no Partial gradient left for the optimizer)
    assert all(r["rows"][0]["opt_bytes"] == 0 for r in ranks)
    if dp == world:
        assert ranks[0]["rows"][0]["kinds"] == {"all_gather": 5, "reduce_scatter": 3}


def test_demo_arguments():
    with pytest.raises(SystemExit):
        demo.main(["--dp", "0"])
