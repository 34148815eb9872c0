"""Tests of the multi-process test harness (dtshard.testing.harness).

Every function run on the workers is defined at module level: it is pickled by
reference and re-imported by the workers (as ``test_harness``, the name pytest
gives this file).
"""

import datetime
import os
import socket
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

from dtshard.testing import (
    DistributedTestError,
    check_pool,
    get_rank,
    get_world_size,
    launch,
    pool_pids,
    run_distributed,
)

# --------------------------------------------------------------------------
# Functions run on the workers
# --------------------------------------------------------------------------


def _rank_and_sum():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return get_rank(), get_world_size(), t.item()


def _worker_environment():
    return {
        "testing": os.environ.get("DTSHARD_TESTING"),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
        "pid": os.getpid(),
    }


def _pid():
    return os.getpid()


def _with_kwargs(a, *, b):
    return a + b + dist.get_rank()


def _tensor_result():
    return torch.arange(4) * dist.get_rank()


def _raise_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t)  # rank 0 blocks here: rank 1 never joins
    return t.item()


def _raise_on_rank_1_short_pg_timeout(seconds):
    # A group with a short timeout, so rank 0's blocked collective errors out
    # quickly (the pool's default group has DTSHARD_TEST_PG_TIMEOUT, 30 s).
    group = dist.new_group(timeout=datetime.timedelta(seconds=seconds))
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item()


def _exit_on_rank_1(code):
    if dist.get_rank() == 1:
        os._exit(code)
    time.sleep(30)  # rank 0 is still busy: the death must be noticed anyway
    return "unreachable"


def _sleep_then_return(seconds):
    time.sleep(seconds)
    return dist.get_rank()


def _unpicklable_result():
    return lambda: None


def _change_global_state():
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return True


def _env_and_start():
    import multiprocessing
    import sys

    return (os.environ.get("DTSHARD_HARNESS_PROBE"), os.environ.get("PYTHONHASHSEED"),
            hash("dtshard"), multiprocessing.parent_process() is not None, "dtshard" in sys.modules)


def _global_state():
    return torch.get_default_dtype(), torch.is_grad_enabled()


# --------------------------------------------------------------------------
# Tests
# --------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_results_per_rank(world_size):
    total = float(sum(range(world_size)))
    expected = [(rank, world_size, total) for rank in range(world_size)]
    assert run_distributed(_rank_and_sum, world_size) == expected


def test_workers_get_the_parents_environment_of_now(monkeypatch):
    """Workers are forked from the fork server, which started with an older environment: a new
    pool still sees the parent's environment as it is when the pool starts, one string-hash seed
    on every rank, and no call may change the server's preload list once it runs."""
    from dtshard.testing import preload_in_workers, shutdown_pools

    run_distributed(_rank_and_sum, 2)  # the server runs
    monkeypatch.setenv("DTSHARD_HARNESS_PROBE", "now")
    shutdown_pools(2)
    infos = run_distributed(_env_and_start, 2)
    assert [i[0] for i in infos] == ["now", "now"]
    assert infos[0][1] == infos[1][1] is not None and infos[0][2] == infos[1][2]
    assert all(i[4] for i in infos)  # dtshard came preloaded
    if os.environ.get("DTSHARD_START_METHOD", "forkserver") == "forkserver":
        with pytest.raises(RuntimeError, match="after the fork server started"):
            preload_in_workers("json.decoder")


def test_worker_environment():
    infos = run_distributed(_worker_environment, 2)
    assert [info["testing"] for info in infos] == ["1", "1"]
    assert [info["threads"] for info in infos] == [1, 1]
    assert [info["backend"] for info in infos] == ["gloo", "gloo"]
    assert infos[0]["pid"] != os.getpid()


def test_args_kwargs_and_tensor_results():
    assert run_distributed(_with_kwargs, 3, 10, b=5) == [15, 16, 17]
    results = run_distributed(_tensor_result, 2)
    torch.testing.assert_close(results[1], torch.arange(4))


def test_pool_is_reused():
    first = run_distributed(_pid, 2)
    second = run_distributed(_pid, 2)
    assert first == second
    assert pool_pids(2) == first
    assert len(set(first)) == 2


def test_shutting_down_one_pool_keeps_the_others():
    from dtshard.testing import shutdown_pools

    two, one = run_distributed(_pid, 2), run_distributed(_pid, 1)
    shutdown_pools(1)
    assert pool_pids(1) is None
    assert pool_pids(2) == two and run_distributed(_pid, 2) == two
    assert run_distributed(_pid, 1) != one  # a fresh pool


def test_per_call_overhead_is_small():
    run_distributed(_pid, 2)  # pool up
    start = time.perf_counter()
    for _ in range(50):
        run_distributed(_pid, 2)
    per_call = (time.perf_counter() - start) / 50
    assert per_call < 0.05, f"{per_call * 1e3:.1f} ms per call"


def test_exception_on_one_rank():
    run_distributed(_pid, 2)  # a healthy pool that the failure will kill
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_1, 2)
    elapsed = time.monotonic() - start
    message = str(info.value)
    assert "rank 1" in message
    assert "ValueError: boom on rank 1" in message
    assert "_raise_on_rank_1" in message  # the remote traceback
    assert 1 in info.value.failed_ranks
    assert elapsed < 20, elapsed
    # The pool was torn down; the next call starts a new one and works.
    assert run_distributed(_rank_and_sum, 2) == [(0, 2, 1.0), (1, 2, 1.0)]


def test_exception_reaches_pg_timeout_on_other_rank(monkeypatch):
    # A short process-group timeout and a long grace period: rank 0's own
    # collective times out and is reported next to rank 1's exception.
    monkeypatch.setenv("DTSHARD_TEST_FAILURE_GRACE", "30")
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank_1_short_pg_timeout, 2, 2)
    assert time.monotonic() - start < 25
    assert info.value.failed_ranks == [0, 1]
    assert "boom on rank 1" in str(info.value)
    assert info.value.failures[0].kind == "exception"
    assert "Timed out" in info.value.failures[0].summary
    assert run_distributed(_rank_and_sum, 2)[1] == (1, 2, 1.0)


def test_dead_worker_is_reported(monkeypatch):
    monkeypatch.setenv("DTSHARD_TEST_FAILURE_GRACE", "1")  # rank 0 is busy: don't wait long
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_on_rank_1, 2, 3)
    assert time.monotonic() - start < 15
    failure = info.value.failures[1]
    assert failure.kind == "died"
    assert "exited with code 3" in str(info.value)
    assert run_distributed(_pid, 2)[1] != 0


def test_overall_timeout():
    start = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_sleep_then_return, 1, 30, timeout=1)
    assert time.monotonic() - start < 10
    assert info.value.failed_ranks == [0]
    assert "1 s timeout" in str(info.value)
    assert run_distributed(_sleep_then_return, 1, 0) == [0]


def test_unpicklable_function_and_result():
    with pytest.raises(TypeError, match="module level"):
        run_distributed(lambda: 1, 1)
    with pytest.raises(DistributedTestError, match="cannot be pickled"):
        run_distributed(_unpicklable_result, 1)
    assert run_distributed(_sleep_then_return, 1, 0) == [0]


def test_global_state_is_reset_between_calls():
    assert run_distributed(_change_global_state, 1) == [True]
    assert run_distributed(_global_state, 1) == [(torch.float32, True)]


def test_sys_path_changes_reach_workers(tmp_path, monkeypatch):
    # A module that only becomes importable after the pool started, like a
    # test module pytest collects later (it prepends the module's directory).
    run_distributed(_pid, 2)
    (tmp_path / "dtshard_harness_late_module.py").write_text(textwrap.dedent("""
        import torch.distributed as dist

        def answer():
            return 42 + dist.get_rank()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    import dtshard_harness_late_module

    try:
        assert run_distributed(dtshard_harness_late_module.answer, 2) == [42, 43]
    finally:
        sys.modules.pop("dtshard_harness_late_module", None)


def test_check_pool():
    run_distributed(_pid, 2)
    assert check_pool(2)
    assert check_pool(2, barrier=True)
    assert not check_pool(17)  # no such pool


def test_launch_fresh_processes():
    # launch() shares WorkerGroup.run with run_distributed, so its failure
    # handling is covered by the tests above; one successful run is enough here.
    assert launch(_rank_and_sum, 2) == [(0, 2, 1.0), (1, 2, 1.0)]


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_launch_under_torchrun_runs_in_process(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    assert launch(_rank_and_sum, 1) == [(0, 1, 0.0)]
    assert not dist.is_initialized()
