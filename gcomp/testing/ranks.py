"""The rank runner: a module-level function run on N gloo ranks (127.0.0.1), each rank's return value collected, by
pools of ``spawn``-ed processes kept per world size (``close_pools`` ends them; a failed or hung job, its pool)."""
from __future__ import annotations

import io
import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from datetime import timedelta

import torch

COLLECTIVE_TIMEOUT_S = 60
MAX_RANKS = 8  # gloo processes on one machine: more only slows every check down


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, jobs, results) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    while True:
        job = jobs.get()
        if job is None:
            break
        try:
            fn, args, kwargs = pickle.loads(job)
            buf = io.BytesIO()
            torch.save(fn(*args, **kwargs), buf)
            results.put((rank, True, buf.getvalue()))
        except BaseException:  # noqa: BLE001 -- every failure goes back to the caller
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankPool:
    """``world`` processes in one gloo process group, taking jobs until closed."""

    def __init__(self, world: int):
        if not isinstance(world, int) or isinstance(world, bool) or not 1 <= world <= MAX_RANKS:
            raise ValueError(f"a rank pool runs 1 to {MAX_RANKS} ranks; got {world!r}")
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
        """``fn(*args, **kwargs)`` on every rank: results in rank order, or AssertionError with each failed rank's
        traceback (the pool is closed)."""
        try:
            job = pickle.dumps((fn, args, kwargs))
        except Exception as err:  # a lambda, a local function, an open file...: it would never reach the ranks
            raise TypeError(f"{getattr(fn, '__qualname__', None) or repr(fn)} cannot be sent to the rank processes "
                            f"({type(err).__name__}: {err}); jobs go by reference: a module-level function, with "
                            "picklable arguments") from None
        for q in self.jobs:
            q.put(job)
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
    """``fn(*args, **kwargs)`` on each of ``world`` ranks (1 to 8), results in rank order; ``fresh=True``: a new
    process group, closed after."""
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
    """End every pooled worker process."""
    for pool in _pools.values():
        pool.close()
    _pools.clear()


_outcomes: dict = {}


def run_ranks_once(key, world: int, fn, *args, **kwargs) -> list:
    """``run_ranks`` once per ``key`` in a process (a test session): later calls reuse its result, or its failure."""
    if key not in _outcomes:
        try:
            _outcomes[key] = (True, run_ranks(world, fn, *args, **kwargs))
        except AssertionError as err:
            _outcomes[key] = (False, err)
    ok, value = _outcomes[key]
    if not ok:
        raise AssertionError(f"rank job {key} failed: {value}") from value
    return value
