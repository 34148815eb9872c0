"""Multi-process test harness: run a function on every rank of a gloo process group.

Two entry points:

``run_distributed(fn, world_size, *args, timeout=120, **kwargs)``
    For tests.  Runs ``fn(*args, **kwargs)`` on every rank of a *pool* of
    ``world_size`` spawned worker processes and returns the per-rank results.
    Pools are cached per world size and reused across calls, because starting
    processes and importing torch costs seconds while one call costs
    milliseconds.  After any failure the pool is killed and a fresh one is
    started on the next call.

``launch(fn, world_size, *args)``
    For scripts and demos.  Starts a fresh group of processes, runs ``fn(*args)``
    once, tears the group down.  Under ``torchrun`` it runs ``fn`` in the current
    process instead.

How a call works
----------------
The parent pickles ``(fn, args, kwargs)`` once (``fn`` by reference, so it must
be a module-level function) and sends the bytes to every worker over a
``multiprocessing`` Pipe.  Each worker unpickles it, runs it, and sends back
``("ok", result)`` or ``("err", summary, traceback)``.  The parent waits on the
pipes *and* the process sentinels, so a worker that dies is noticed at once.

Failure handling (nothing may hang)
-----------------------------------
* A rank that raises is reported with its remote traceback.  The other ranks
  are given a short grace period (``DTSHARD_TEST_FAILURE_GRACE``, default 2 s)
  to answer too; ranks that are still silent after it are usually blocked in a
  collective waiting for the failed rank, and are reported as such.
* A rank whose process exits is reported with its exit code / signal.
* The whole call is bounded by ``timeout`` seconds.
* In every failure case the pool is killed (a process group that saw an error
  may be unusable) and ``DistributedTestError`` is raised.

Environment knobs (read when a pool is created / a call is made)
-----------------------------------------------------------------
``DTSHARD_TEST_PG_TIMEOUT``      process-group timeout of pool workers, seconds (30)
``DTSHARD_TEST_FAILURE_GRACE``   wait for other ranks after the first failure (2)
``DTSHARD_TEST_START_TIMEOUT``   limit for starting a pool, seconds (120)
``DTSHARD_TEST_HEALTH_CHECK``    "1": ping the pool before every call (off)

``DTSHARD_START_METHOD``         "forkserver" (default) or "spawn"

Workers get the parent's environment as it is when they start, plus
``DTSHARD_TESTING=1`` (pools only), ``OMP_NUM_THREADS=1``, one ``PYTHONHASHSEED`` (the parent's,
or 0), ``torch.set_num_threads(1)``, the parent's ``sys.path`` (re-sent whenever it
changes, so modules pytest imports later also resolve), and the usual torchrun
variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``).

How workers start
-----------------
Through multiprocessing's *fork server*: one clean process, started on first
use, imports torch, ``torch.distributed``, dtshard and whatever
:func:`preload_in_workers` named, once; every worker is then forked from it
(milliseconds) instead of being spawned as a fresh interpreter that imports
torch again (a second of CPU per rank; a suite starts ~25 pools).  The server
freezes what it imported (``gc.freeze``, in ``_fork_server_freeze``), so a
worker's full garbage collections skip those ~390k objects.  The server
is not the parent: it has run no test code, holds no process group and no
thread a fork could copy in a locked state.  Each worker still gets the
parent's current environment, working directory, ``sys.path`` and main module,
as under spawn.  ``DTSHARD_START_METHOD=spawn`` goes back to spawn.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import importlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import warnings
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

__all__ = [
    "DistributedTestError",
    "RankFailure",
    "run_distributed",
    "launch",
    "get_rank",
    "get_world_size",
    "check_pool",
    "warm_up",
    "pool_pids",
    "shutdown_pools",
    "preload_in_workers",
]

_HOST = "127.0.0.1"
_DEFAULT_PG_TIMEOUT = 30.0
_DEFAULT_FAILURE_GRACE = 2.0
_DEFAULT_START_TIMEOUT = 120.0
_LAUNCH_PG_TIMEOUT = 60.0
# How long a clean shutdown waits for workers before killing them.
_SHUTDOWN_JOIN_TIMEOUT = 5.0
# What the fork server imports before it forks any worker (see "How workers start").
_BASE_PRELOAD = ("torch", "torch.distributed", "dtshard", "dtshard.testing.harness")
_extra_preload: list[str] = []
_forkserver_started = False


def _env_float(name: str, default: float) -> float:
    value = os.environ.get(name, "").strip()
    return float(value) if value else default


# --------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------


@dataclasses.dataclass
class RankFailure:
    """What went wrong on one rank.

    ``kind`` is ``"exception"`` (``fn`` raised), ``"died"`` (the process
    exited) or ``"no answer"`` (still silent when the parent gave up).
    """

    rank: int
    kind: str
    summary: str
    traceback: str = ""

    def format(self) -> str:
        """The failure as text: rank, kind, summary and the remote traceback."""
        text = f"--- rank {self.rank} ({self.kind}): {self.summary}"
        if self.traceback:
            text += "\n" + self.traceback.rstrip()
        return text


class DistributedTestError(AssertionError):
    """A distributed call failed on at least one rank.

    Attributes:
        failures: ``{rank: RankFailure}`` for every rank that raised, died or
            did not answer.
        results: ``{rank: value}`` for the ranks that did finish.
    """

    def __init__(self, message: str, failures: dict[int, RankFailure] | None = None,
                 results: dict[int, Any] | None = None):
        super().__init__(message)
        self.failures = dict(failures or {})
        self.results = dict(results or {})

    @property
    def failed_ranks(self) -> list[int]:
        """The ranks that failed, sorted."""
        return sorted(self.failures)


# --------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------


def _send(conn: multiprocessing.connection.Connection, message: tuple) -> None:
    """Send a message with plain pickle.

    ``Connection.send`` would use multiprocessing's ForkingPickler, for which
    torch registers shared-memory reductions of tensors; plain pickle copies
    the data, which is what we want for small results.
    """
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def _recv(conn: multiprocessing.connection.Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


def _summarize(exc: BaseException) -> str:
    return f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}".removeprefix("builtins.")


def _watch_parent(parent_pid: int) -> None:
    """Exit the worker if the parent process goes away (no orphans).

    Polls the parent's pid rather than ``os.getppid()``: a worker forked by the
    fork server is the server's child, not the parent's.
    """
    while True:
        time.sleep(0.5)
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            os._exit(1)
        except PermissionError:  # the pid was reused by another user's process
            os._exit(1)


def _reset_worker_state() -> None:
    """Undo the cheapest, most common global changes a test function makes."""
    if torch.get_default_dtype() != torch.float32:
        torch.set_default_dtype(torch.float32)
    if not torch.is_grad_enabled():
        torch.set_grad_enabled(True)
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def _worker_main(rank: int, world_size: int, store_port: int, pg_timeout: float,
                 conn: multiprocessing.connection.Connection, parent_pid: int,
                 environ: dict[str, str]) -> None:
    """Body of one worker process: init the process group, then serve requests.

    Requests (parent -> worker):
        ("run", payload_bytes, sys_path_or_None)  -> ("ok", result) | ("err", summary, tb)
        ("ping", do_barrier)                      -> ("pong",) | ("err", summary, tb)
        ("stop",)                                 -> exits, no reply
    On start-up the worker sends ("ready", pid) or ("err", summary, tb).
    """
    # Ctrl-C is for the parent; it kills us when it cleans up.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    # The parent's environment now (a forked worker would otherwise see the fork server's, as it
    # was when the server started), then this rank's torchrun variables.
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update({
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": _HOST,
        "MASTER_PORT": str(store_port),
    })
    torch.set_num_threads(1)
    try:
        timeout = datetime.timedelta(seconds=pg_timeout)
        store = dist.TCPStore(_HOST, store_port, world_size, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", rank=rank, world_size=world_size, store=store,
                                timeout=timeout)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        _send(conn, ("err", _summarize(exc), traceback.format_exc()))
        return
    _send(conn, ("ready", os.getpid()))

    while True:
        try:
            request = _recv(conn)
        except (EOFError, OSError):  # parent gone
            break
        kind = request[0]
        if kind == "stop":
            break
        try:
            if kind == "run":
                _, payload, sys_path = request
                if sys_path is not None and sys_path != sys.path:
                    sys.path[:] = sys_path
                    importlib.invalidate_caches()
                fn, args, kwargs = pickle.loads(payload)
                result = fn(*args, **kwargs)
                try:
                    reply = pickle.dumps(("ok", result), protocol=pickle.HIGHEST_PROTOCOL)
                except Exception as exc:
                    raise TypeError(
                        f"the return value of {getattr(fn, '__qualname__', fn)!r} on rank {rank} "
                        f"cannot be pickled ({exc}); return plain tensors / numbers / lists"
                    ) from exc
            elif kind == "ping":
                if request[1]:
                    dist.barrier()
                reply = pickle.dumps(("pong",))
            else:
                raise RuntimeError(f"unknown request {kind!r}")
        except BaseException as exc:  # noqa: BLE001 - includes pytest's skip/fail outcomes
            reply = pickle.dumps(("err", _summarize(exc), traceback.format_exc()))
        finally:
            _reset_worker_state()
            sys.stdout.flush()
            sys.stderr.flush()
        try:
            conn.send_bytes(reply)
        except (EOFError, OSError):
            break

    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip the (slow, occasionally hanging) interpreter teardown


# --------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _environ(updates: dict[str, str]) -> Iterator[None]:
    """Temporarily set environment variables (spawned children inherit them)."""
    saved = {name: os.environ.get(name) for name in updates}
    os.environ.update(updates)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _exit_description(process: multiprocessing.Process) -> str:
    process.join(timeout=1.0)
    code = process.exitcode
    if code is None:
        return "process closed its pipe but is still running"
    if code < 0:
        try:
            return f"process was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"process was killed by signal {-code}"
    return f"process exited with code {code}"


def _describe(fn: Any) -> str:
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", None) or repr(fn)
    return f"{module}.{name}" if module else name


def _pickle_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    try:
        return pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception as exc:
        raise TypeError(
            f"cannot send {_describe(fn)} to the worker processes: {exc}. The function must be "
            "defined at module level (no lambdas, closures or nested functions) and its "
            "arguments must be picklable."
        ) from exc


def preload_in_workers(*modules: str) -> None:
    """Have the fork server import ``modules`` before it forks any worker.

    For modules that many workers import (a test suite's heavy helpers): each is
    then imported once per test session instead of once per worker.  Call it
    before the first pool starts (a conftest is the place); a later call raises,
    because the server has already started with its list.
    """
    global _extra_preload
    with _LOCK:
        new = [m for m in modules if m not in _extra_preload and m not in _BASE_PRELOAD]
        if new and _forkserver_started:
            raise RuntimeError(
                f"preload_in_workers({', '.join(map(repr, modules))}) after the fork server "
                "started; call it before the first run_distributed/launch (e.g. in conftest.py)")
        _extra_preload += new


def _worker_context() -> multiprocessing.context.BaseContext:
    """The multiprocessing context workers start from (see "How workers start")."""
    global _forkserver_started
    method = os.environ.get("DTSHARD_START_METHOD", "").strip() or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise ValueError(f"DTSHARD_START_METHOD={method!r}: use 'forkserver' or 'spawn'")
    if method == "forkserver" and "forkserver" not in multiprocessing.get_all_start_methods():
        method = "spawn"  # not on this platform (Windows)
    ctx = multiprocessing.get_context(method)
    if method == "forkserver" and not _forkserver_started:
        # the freeze last: it freezes what every module before it imported
        ctx.set_forkserver_preload(list(_BASE_PRELOAD) + _extra_preload + ["dtshard.testing._fork_server_freeze"])
        _forkserver_started = True
    return ctx


class WorkerGroup:
    """``world_size`` worker processes that share one gloo process group.

    Used both as a cached test pool (:func:`run_distributed`) and as the
    one-shot group of :func:`launch`.  Not thread-safe; callers serialize.
    """

    def __init__(self, world_size: int, pg_timeout: float, *, testing: bool):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self.testing = testing
        self.processes: list[multiprocessing.Process] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self.pids: list[int] = []
        self.broken = False
        self._store: Any = None
        self._sent_sys_path: list[str] | None = None
        self._ready = False

    # -- life cycle --------------------------------------------------------

    def start(self) -> None:
        """Start the workers (does not wait for them; see :meth:`wait_ready`)."""
        ctx = _worker_context()
        # The rendezvous store lives in the parent: port 0 lets the OS pick a
        # free port, so there is no race for "a free port".
        self._store = dist.TCPStore(_HOST, 0, None, is_master=True, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=self.pg_timeout))
        env = {"OMP_NUM_THREADS": "1"}
        # One string-hash seed for every rank: code that iterates a set of strings (PyTorch's
        # OpInfo sample generators do) then takes the same path on every rank, as SPMD code must;
        # with per-process hash randomisation two ranks could build different inputs and enter
        # different collectives.
        env["PYTHONHASHSEED"] = os.environ.get("PYTHONHASHSEED") or "0"
        if self.testing:
            env["DTSHARD_TESTING"] = "1"
        if sys.platform.startswith("linux") and "GLOO_SOCKET_IFNAME" not in os.environ:
            env["GLOO_SOCKET_IFNAME"] = "lo"  # everything is on 127.0.0.1
        # The fork server, started by the first worker, keeps the environment it started with
        # (PYTHONHASHSEED and OMP_NUM_THREADS only take effect at interpreter start); every
        # worker also gets the parent's environment of now, as a spawned one would.
        with _environ(env):
            environ = dict(os.environ)
            for rank in range(self.world_size):
                parent_end, child_end = ctx.Pipe(duplex=True)
                process = ctx.Process(
                    target=_worker_main,
                    args=(rank, self.world_size, self._store.port, self.pg_timeout, child_end,
                          os.getpid(), environ),
                    name=f"dtshard-worker-{self.world_size}-{rank}",
                    daemon=True,
                )
                process.start()
                child_end.close()
                self.processes.append(process)
                self.conns.append(parent_end)

    def wait_ready(self, timeout: float) -> None:
        """Wait until every worker has initialised its process group."""
        replies, failures = self._collect(time.monotonic() + timeout, "start-up", timeout)
        if failures:
            self.kill()
            raise DistributedTestError(
                f"could not start {self.world_size} worker process(es) (their stderr may say more; "
                "a script that starts workers needs an `if __name__ == '__main__':` guard, because "
                "spawn re-imports the main module):\n"
                + "\n".join(failures[rank].format() for rank in sorted(failures)),
                failures,
            )
        self.pids = [replies[rank][1] for rank in range(self.world_size)]
        self._ready = True

    def usable(self, pg_timeout: float) -> bool:
        return (self._ready and not self.broken and self.pg_timeout == pg_timeout
                and all(p.is_alive() for p in self.processes))

    def shutdown(self) -> None:
        """Ask workers to exit cleanly; kill the ones that do not within a few seconds."""
        if not self.broken:
            for conn in self.conns:
                with contextlib.suppress(OSError, ValueError):
                    _send(conn, ("stop",))
            deadline = time.monotonic() + _SHUTDOWN_JOIN_TIMEOUT
            for process in self.processes:
                process.join(timeout=max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Kill every worker at once (used after failures) and release resources."""
        self.broken = True
        for process in self.processes:
            if process.is_alive():
                with contextlib.suppress(Exception):
                    process.kill()
        for process in self.processes:
            process.join(timeout=5.0)
        for conn in self.conns:
            with contextlib.suppress(Exception):
                conn.close()
        self._store = None

    # -- requests ----------------------------------------------------------

    def run(self, payload: bytes, timeout: float | None, description: str) -> list:
        """Run a pickled ``(fn, args, kwargs)`` on every rank; return per-rank results."""
        try:
            sys_path = None if self._sent_sys_path == sys.path else list(sys.path)
            message = pickle.dumps(("run", payload, sys_path), protocol=pickle.HIGHEST_PROTOCOL)
            self._broadcast(message, description)
            self._sent_sys_path = list(sys.path)
            deadline = None if timeout is None else time.monotonic() + timeout
            replies, failures = self._collect(deadline, description, timeout)
        except BaseException:  # e.g. KeyboardInterrupt while waiting: never leave a half-run pool
            self.kill()
            raise
        if failures:
            self.kill()
            results = {rank: reply[1] for rank, reply in replies.items()}
            raise DistributedTestError(self._failure_message(description, failures),
                                       failures, results)
        return [replies[rank][1] for rank in range(self.world_size)]

    def _failure_message(self, description: str, failures: dict[int, RankFailure]) -> str:
        """Headline naming the failed ranks, then one block per rank (real failures first)."""
        failed = sorted(r for r, f in failures.items() if f.kind != "no answer")
        silent = sorted(r for r, f in failures.items() if f.kind == "no answer")
        parts = []
        if failed:
            parts.append("failed on rank(s) " + ", ".join(map(str, failed)))
        if silent:
            parts.append("no answer from rank(s) " + ", ".join(map(str, silent)))
        headline = f"{description} (world_size={self.world_size}) " + "; ".join(parts) + ":"
        return "\n".join([headline] + [failures[rank].format() for rank in failed + silent])

    def ping(self, timeout: float, barrier: bool = False) -> bool:
        """Cheap health check: every worker answers (after a barrier if asked)."""
        try:
            self._broadcast(pickle.dumps(("ping", barrier)), "ping")
            _, failures = self._collect(time.monotonic() + timeout, "ping", timeout)
        except DistributedTestError:
            return False
        if failures:
            self.kill()
            return False
        return True

    def _broadcast(self, message: bytes, description: str) -> None:
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except (OSError, ValueError) as exc:
                self.kill()
                failure = RankFailure(rank, "died", f"{_exit_description(self.processes[rank])} "
                                      f"before the call (send failed: {exc})")
                raise DistributedTestError(
                    f"{description} (world_size={self.world_size}): {failure.format()}",
                    {rank: failure},
                ) from exc

    def _collect(self, deadline: float | None, description: str,
                 timeout: float | None = None) -> tuple[dict[int, tuple], dict[int, RankFailure]]:
        """Wait for one reply per rank.

        Returns ``(replies, failures)``.  Stops early ``failure_grace`` seconds
        after the first failure, or at ``deadline``; silent ranks then become
        ``"no answer"`` failures.
        """
        grace = _env_float("DTSHARD_TEST_FAILURE_GRACE", _DEFAULT_FAILURE_GRACE)
        pending = set(range(self.world_size))
        replies: dict[int, tuple] = {}
        failures: dict[int, RankFailure] = {}
        first_failure_at: float | None = None

        while pending:
            limit = deadline
            if first_failure_at is not None:
                limit = first_failure_at + grace if limit is None else min(limit, first_failure_at + grace)
            remaining = None if limit is None else limit - time.monotonic()
            if remaining is not None and remaining <= 0:
                break
            owners: dict[Any, int] = {}
            for rank in pending:
                owners[self.conns[rank]] = rank
                owners[self.processes[rank].sentinel] = rank
            ready = multiprocessing.connection.wait(list(owners), timeout=remaining)
            for rank in sorted({owners[obj] for obj in ready}):
                if rank not in pending:
                    continue
                message = None
                conn = self.conns[rank]
                try:
                    readable = conn.poll()
                    if readable:
                        message = _recv(conn)
                except (EOFError, OSError):  # the worker closed its end of the pipe
                    readable = True
                if message is None:
                    if not readable and self.processes[rank].is_alive():
                        continue  # spurious wake-up
                    failures[rank] = RankFailure(rank, "died", _exit_description(self.processes[rank]))
                elif message[0] == "err":
                    failures[rank] = RankFailure(rank, "exception", message[1], message[2])
                else:
                    replies[rank] = message
                pending.discard(rank)
                if rank in failures and first_failure_at is None:
                    first_failure_at = time.monotonic()

        failed_first = sorted(failures)
        for rank in sorted(pending):
            if failed_first:
                first = ", ".join(str(r) for r in failed_first)
                why = (f"no answer within {grace:g} s after rank(s) {first} failed "
                       "(probably blocked in a collective); killed")
            elif timeout is not None:
                why = f"no answer within the {timeout:g} s timeout of {description}; killed"
            else:
                why = f"no answer during {description}; killed"
            failures[rank] = RankFailure(rank, "no answer", why)
        return replies, failures


# --------------------------------------------------------------------------
# Test pools
# --------------------------------------------------------------------------

_LOCK = threading.RLock()
_POOLS: dict[int, WorkerGroup] = {}
_ATEXIT_REGISTERED = False


def _ensure_atexit() -> None:
    global _ATEXIT_REGISTERED
    if not _ATEXIT_REGISTERED:
        atexit.register(shutdown_pools)
        _ATEXIT_REGISTERED = True


def _pool_pg_timeout() -> float:
    return _env_float("DTSHARD_TEST_PG_TIMEOUT", _DEFAULT_PG_TIMEOUT)


def _start_pools(world_sizes: list[int]) -> None:
    """Make sure a usable pool exists for each world size; start missing ones in parallel."""
    pg_timeout = _pool_pg_timeout()
    starting: list[WorkerGroup] = []
    for world_size in world_sizes:
        pool = _POOLS.get(world_size)
        if pool is not None and pool.usable(pg_timeout):
            continue
        if pool is not None:
            _POOLS.pop(world_size)
            pool.shutdown()
        _ensure_atexit()
        pool = WorkerGroup(world_size, pg_timeout, testing=True)
        try:
            pool.start()
        except BaseException:
            pool.kill()
            raise
        starting.append(pool)
    start_timeout = _env_float("DTSHARD_TEST_START_TIMEOUT", _DEFAULT_START_TIMEOUT)
    try:
        for pool in starting:
            pool.wait_ready(start_timeout)
            _POOLS[pool.world_size] = pool
    except BaseException:
        for pool in starting:
            if _POOLS.get(pool.world_size) is not pool:
                pool.kill()
        raise


def _get_pool(world_size: int) -> WorkerGroup:
    _start_pools([world_size])
    pool = _POOLS[world_size]
    if os.environ.get("DTSHARD_TEST_HEALTH_CHECK", "") == "1" and not pool.ping(timeout=10.0):
        _POOLS.pop(world_size, None)
        pool.kill()
        _start_pools([world_size])
        pool = _POOLS[world_size]
    return pool


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any,
                    timeout: float | None = 120.0, **kwargs: Any) -> list:
    """Run ``fn(*args, **kwargs)`` on every rank of a ``world_size`` worker pool.

    Returns the list of per-rank return values (index = rank).  Inside ``fn``
    the default process group (gloo) is already initialised; use
    ``torch.distributed`` as usual.

    ``fn`` must be a module-level function (it is pickled by reference), and
    ``args``/``kwargs``/the return value must be picklable.  Pools are cached
    per world size and reused.

    Raises:
        DistributedTestError: some rank raised, died, or did not answer within
            ``timeout`` seconds (``None``: no overall limit).  The pool is then
            killed and restarted on the next call.
        TypeError: ``fn`` or its arguments cannot be pickled.
    """
    payload = _pickle_call(fn, args, kwargs)
    with _LOCK:
        pool = _get_pool(world_size)
        try:
            return pool.run(payload, timeout, f"run_distributed({_describe(fn)})")
        finally:
            if pool.broken:
                _POOLS.pop(world_size, None)


def check_pool(world_size: int, timeout: float = 10.0, barrier: bool = False) -> bool:
    """Health check of the cached pool for ``world_size`` (a ping, plus a barrier if asked).

    Returns True if the pool exists and answered; otherwise kills it (the next
    :func:`run_distributed` starts a fresh one) and returns False.
    """
    with _LOCK:
        pool = _POOLS.get(world_size)
        if pool is None:
            return False
        if pool.usable(pool.pg_timeout) and pool.ping(timeout, barrier=barrier):
            return True
        _POOLS.pop(world_size, None)
        pool.kill()
        return False


def warm_up(*world_sizes: int) -> None:
    """Start the pools for ``world_sizes`` concurrently (optional; saves a little time)."""
    with _LOCK:
        _start_pools(sorted(set(world_sizes)))


def pool_pids(world_size: int) -> list[int] | None:
    """PIDs of the cached pool's workers by rank, or None if there is no pool."""
    with _LOCK:
        pool = _POOLS.get(world_size)
        return list(pool.pids) if pool is not None else None


def shutdown_pools(*world_sizes: int) -> None:
    """Stop the cached pools of ``world_sizes`` (every pool when none is named): clean exit, then
    kill stragglers. Safe to call twice. A test that leaves its workers in a state later tests
    must not see names its own world size only, so the other pools live on (starting a pool costs
    seconds per rank)."""
    with _LOCK:
        names = list(_POOLS) if not world_sizes else [n for n in world_sizes if n in _POOLS]
        pools = [_POOLS.pop(n) for n in names]
        for pool in pools:
            with contextlib.suppress(Exception):
                pool.shutdown()


def get_rank() -> int:
    """Rank in the default process group (0 when not initialised)."""
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size() -> int:
    """Size of the default process group (1 when not initialised)."""
    return dist.get_world_size() if dist.is_initialized() else 1


# --------------------------------------------------------------------------
# launch (non-test use)
# --------------------------------------------------------------------------


def _under_torchrun() -> bool:
    return all(name in os.environ for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def launch(fn: Callable[..., Any], world_size: int, *args: Any,
           timeout: float | None = 600.0, pg_timeout: float = _LAUNCH_PG_TIMEOUT) -> list:
    """Run ``fn(*args)`` on ``world_size`` fresh processes; return the per-rank results.

    The processes are spawned, initialise a gloo process group (timeout
    ``pg_timeout`` s), run ``fn`` once and exit.  Failure handling is the same
    as :func:`run_distributed` (raises :class:`DistributedTestError`; bounded by
    ``timeout`` seconds, ``None`` for no limit).  ``fn`` must be defined at
    module level, and a script calling ``launch`` needs the usual
    ``if __name__ == "__main__":`` guard (spawn re-imports the main module).

    Under torchrun (``RANK``, ``WORLD_SIZE`` and ``MASTER_ADDR`` set) the
    process group is initialised from the environment (unless it already is)
    and ``fn`` runs in this process; the return value is ``[result]``.
    """
    if _under_torchrun():
        if int(os.environ["WORLD_SIZE"]) != world_size:
            warnings.warn(f"launch(world_size={world_size}) under torchrun with "
                          f"WORLD_SIZE={os.environ['WORLD_SIZE']}; using the torchrun world size",
                          stacklevel=2)
        created = not dist.is_initialized()
        if created:
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=pg_timeout))
        try:
            return [fn(*args)]
        finally:
            if created:
                dist.destroy_process_group()

    payload = _pickle_call(fn, args, {})
    group = WorkerGroup(world_size, pg_timeout, testing=False)
    try:
        group.start()
        group.wait_ready(_env_float("DTSHARD_TEST_START_TIMEOUT", _DEFAULT_START_TIMEOUT))
        return group.run(payload, timeout, f"launch({_describe(fn)})")
    finally:
        group.shutdown()
