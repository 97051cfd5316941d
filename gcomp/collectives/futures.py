"""Futures that carry their collectives' errors, and the collectives still in flight.

A failed collective (a dead peer, a timeout) must never be read as a result: ``when_done`` and ``when_all_done``
hand on its error.

Every collective gcomp launches goes through ``launched``, so that ``settle`` can wait until the backend's
worker threads are finished with it. They run our ``then`` callbacks, and after the last of them has completed
the future DDP waits for they still drop Python objects (the callbacks, their values), which takes the GIL. If
the main thread has meanwhile reached interpreter shutdown, CPython (before 3.14) ends such a thread in the
middle of a C++ destructor and the process aborts ("terminate called without an active exception", SIGABRT):
a finished training run that torchrun then reports as failed. The hook settles at the end of every backward
pass, and ``settle`` runs at exit for collectives launched outside one.
"""
from __future__ import annotations

import atexit
import threading
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

_in_flight: list[dist.Work] = []
_lock = threading.Lock()  # callbacks of one round launch the next from the backend's threads
_PRUNE_AT = 256  # outside a backward pass nobody settles: completed works are forgotten at this length


def launched(work: dist.Work) -> torch.futures.Future:
    """``work.get_future()``, with ``work`` remembered until ``settle``."""
    with _lock:
        if len(_in_flight) >= _PRUNE_AT:
            _in_flight[:] = [w for w in _in_flight if not w.is_completed()]
        _in_flight.append(work)
    return work.get_future()


def settle(timeout: float | None = None) -> None:
    """Wait until every collective launched so far is finished, its future's callbacks included, and forget it;
    with ``timeout`` (seconds), for that long at most in all.

    A failed collective is not raised here: its error reaches the caller through its future (DDP raises it).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        with _lock:
            if not _in_flight:
                return
            works = _in_flight[:]
            _in_flight.clear()
        for work in works:
            try:
                if deadline is None:
                    work.wait()
                else:
                    work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
            except Exception:  # noqa: BLE001 - reported through the work's future, where the result is read
                pass
        if deadline is not None and time.monotonic() >= deadline:
            return


def in_flight() -> int:
    """How many launched collectives ``settle`` has not waited for yet."""
    with _lock:
        return len(_in_flight)


# At exit, a collective still in flight (a rank leaving mid-step) is given a few seconds, not the group's timeout.
atexit.register(settle, timeout=5.0)


def when_done(future: torch.futures.Future, value: Any) -> torch.futures.Future:
    """A future of ``value`` once ``future`` completes, failing with ``future``'s own error if it failed.

    ``future.then(lambda _: value)`` would not: a ``then`` callback runs on a failed future too, and one that
    ignores its argument hands DDP the untouched output buffers of a collective that never happened.
    """
    def check(done: torch.futures.Future) -> Any:
        done.value()  # raises the collective's error, if any
        return value

    return future.then(check)


def when_all_done(futures: list[torch.futures.Future], value: Any) -> torch.futures.Future:
    """``when_done`` for several futures: ``value`` once all complete, else the first failure's error."""
    def check(done: torch.futures.Future) -> Any:
        for sub in done.value():
            sub.value()
        return value

    return torch.futures.collect_all(futures).then(check)
