"""Run a function on N gloo ranks (127.0.0.1, a free port) and collect each rank's return value.

Pools of worker processes are kept per world size for the whole test session, so a test costs the work it
does, not a process start. A job that fails or hangs on any rank tears its pool down (gloo's own timeout
ends a collective left waiting) and the next job starts a fresh one.
"""
from __future__ import annotations

import io
import multiprocessing
import os
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch

COLLECTIVE_TIMEOUT_S = 60


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serialise(value) -> bytes:
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def _worker(rank: int, world: int, port: int, jobs, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    while True:
        job = jobs.get()
        if job is None:
            break
        fn, args, kwargs = job
        try:
            results.put((rank, True, _serialise(fn(*args, **kwargs))))
        except BaseException:  # noqa: BLE001 -- every failure goes back to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world`` processes in one gloo process group, taking jobs until closed."""

    def __init__(self, world: int):
        ctx = multiprocessing.get_context("spawn")
        self.world = world
        self.results = ctx.Queue()
        self.jobs = [ctx.Queue() for _ in range(world)]
        port = free_port()
        env = os.environ.copy()
        os.environ["OMP_NUM_THREADS"] = "1"
        try:
            self.procs = [ctx.Process(target=_worker, args=(r, world, port, self.jobs[r], self.results), daemon=True)
                          for r in range(world)]
            for p in self.procs:
                p.start()
        finally:
            os.environ.clear()
            os.environ.update(env)

    def run(self, fn, *args, timeout: float = 120, **kwargs) -> list:
        for q in self.jobs:
            q.put((fn, args, kwargs))
        out, errors = {}, {}
        deadline = time.monotonic() + timeout
        while len(out) + len(errors) < self.world:
            remaining = deadline - time.monotonic()
            if errors:  # the others may be stuck in a collective the failed rank never joined
                remaining = min(remaining, 5.0)
            try:
                rank, ok, value = self.results.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                break
            if ok:
                out[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors[rank] = value
        if errors or len(out) < self.world:
            self.close(force=True)
            missing = sorted(set(range(self.world)) - set(out) - set(errors))
            detail = "".join(f"\n--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
            hung = f"; ranks {missing} did not finish within {timeout:.0f}s" if missing else ""
            raise AssertionError(f"{getattr(fn, '__name__', fn)} failed on {self.world} ranks{hung}{detail}")
        return [out[r] for r in range(self.world)]

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def close(self, force: bool = False) -> None:
        if not force:
            for q in self.jobs:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join()


_pools: dict[int, RankPool] = {}


def run_ranks(world: int, fn, *args, fresh: bool = False, timeout: float = 120, **kwargs) -> list:
    """Call ``fn(*args, **kwargs)`` on each of ``world`` ranks; return their results in rank order.

    ``fn`` must be importable (a module-level function). ``fresh=True`` uses a new process group, closed after.
    """
    if fresh:
        pool = RankPool(world)
        try:
            return pool.run(fn, *args, timeout=timeout, **kwargs)
        finally:
            pool.close()
    pool = _pools.get(world)
    if pool is None or not pool.alive:
        pool = _pools[world] = RankPool(world)
    return pool.run(fn, *args, timeout=timeout, **kwargs)


def close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


_outcomes: dict = {}


def run_ranks_once(key, world: int, fn, *args, **kwargs) -> list:
    """``run_ranks`` once per ``key`` in a test session: later tests reuse its result, or its failure (each
    test that needs a failed job fails, naming the key)."""
    if key not in _outcomes:
        try:
            _outcomes[key] = (True, run_ranks(world, fn, *args, **kwargs))
        except AssertionError as err:
            _outcomes[key] = (False, err)
    ok, value = _outcomes[key]
    if not ok:
        raise AssertionError(f"rank job {key} failed") from value
    return value
