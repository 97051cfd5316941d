"""How gcomp launches, awaits and counts its collectives, and where a codec's work runs on CUDA.

- **In flight.** Every asynchronous collective goes through ``launched``, so that ``settle`` can wait until the
  backend's threads are done with it: they run our ``then`` callbacks and, after the future DDP waits for has
  completed, still drop Python objects under the GIL; a main thread that reached interpreter shutdown meanwhile
  aborts the process (CPython < 3.14). The hook settles at the end of every backward pass; exit settles the rest.
- **Errors.** A failed collective (a dead peer, a timeout) is never read as a result: ``when_done`` and
  ``when_all_done`` hand on its error, and ``then_on`` makes a CUDA reader wait for a callback's kernels.
- **Counts** (``stats``, read by ``gcomp simulate``'s cost model): ``rounds`` (latency rounds on a bucket's
  critical path), ``allreduce_calls/bytes``, ``allgather_calls/bytes``, ``p2p_rounds/bytes`` (per round the busier
  direction), ``round_work_s`` (codec work between rounds); plain arithmetic, only into keys ``stats`` holds.
- **The codec stream** (CUDA, off by default: ``GCOMP_CODEC_STREAM=1`` or ``with codec_stream():``): a bucket's
  encode and decode run on a side stream per device, so they overlap the rest of the backward pass.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Iterable, Iterator

import torch
import torch.distributed as dist

ALLREDUCE_KEYS = ("allreduce_calls", "allreduce_bytes")
ALLGATHER_KEYS = ("allgather_calls", "allgather_bytes")
P2P_KEYS = ("p2p_rounds", "p2p_bytes")
COUNTER_KEYS = ("rounds", *ALLREDUCE_KEYS, *ALLGATHER_KEYS, *P2P_KEYS, "round_work_s")
STREAM_ENV = "GCOMP_CODEC_STREAM"

_in_flight: list[dist.Work] = []
_lock = threading.Lock()  # callbacks of one round launch the next from the backend's threads
_PRUNE_AT = 256  # outside a backward pass nobody settles: completed works are forgotten at this length
_streams: dict[int, "torch.cuda.Stream"] = {}
_stream_forced: list[bool] = []


# --- in flight ------------------------------------------------------------------------------------------------------

def launched(work: dist.Work) -> torch.futures.Future:
    """``work.get_future()``, with ``work`` remembered until ``settle``."""
    with _lock:
        if len(_in_flight) >= _PRUNE_AT:
            _in_flight[:] = [w for w in _in_flight if not w.is_completed()]
        _in_flight.append(work)
    return work.get_future()


def settle(timeout: float | None = None) -> None:
    """Wait until every collective launched so far is finished, callbacks included, and forget it; with
    ``timeout`` (seconds), that long at most. A failure is not raised here: its future carries it."""
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


# at exit, a collective still in flight (a rank leaving mid-step) is given a few seconds, not the group's timeout
atexit.register(settle, timeout=5.0)


def when_done(future: torch.futures.Future, value: Any) -> torch.futures.Future:
    """A future of ``value`` once ``future`` completes, failing with ``future``'s error if it failed (a plain
    ``then(lambda _: value)`` would hand DDP the untouched buffers of a collective that never happened)."""
    def check(done: torch.futures.Future) -> Any:
        done.value()
        return value

    return future.then(check)


def when_all_done(futures: list[torch.futures.Future], value: Any) -> torch.futures.Future:
    """``when_done`` for several futures: ``value`` once all complete, else the first failure's error."""
    def check(done: torch.futures.Future) -> Any:
        for sub in done.value():
            sub.value()
        return value

    return torch.futures.collect_all(futures).then(check)


def then_on(future: torch.futures.Future, fn, device: torch.device) -> torch.futures.Future:
    """``future.then(fn)``; on CUDA a future the reading stream waits for. ``then`` on a future that knows no
    devices (gloo's) returns one that knows none, and DDP's copy of the value was not ordered after the kernels
    ``fn`` launched (seen on an H200, two gloo ranks: replicas differed after six steps); this one's
    ``set_result`` records an event on ``fn``'s stream, which the reader's ``wait`` waits for."""
    if device.type != "cuda":
        return future.then(fn)
    result = torch.futures.Future(devices=[device])

    def run(done: torch.futures.Future) -> None:
        try:
            value = fn(done)
        except BaseException as err:  # noqa: BLE001 -- the collective's or the decoder's error, handed on
            result.set_exception(err)
            return
        result.set_result(value)

    future.add_done_callback(run)
    return result


def all_gather_flat(out: torch.Tensor, tensor: torch.Tensor, group: dist.ProcessGroup | None = None,
                    async_op: bool = False):
    """Every rank's ``tensor`` concatenated into ``out``: ``all_gather_single`` from torch 2.13, before it
    ``all_gather_into_tensor`` (looked up per call, so a test may wrap either)."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return gather(out, tensor, group=group, async_op=async_op)


# --- counts -----------------------------------------------------------------------------------------------------------

def add(stats: dict | None, key: str, value: float) -> None:
    if stats is not None and key in stats:
        stats[key] += value


def count_round(stats: dict | None, rounds: int = 1) -> None:
    add(stats, "rounds", rounds)


def count_collectives(stats: dict | None, kind: str, tensors: Iterable[torch.Tensor]) -> None:
    """One ``kind`` collective (``"allreduce"``, ``"allgather"``) per tensor, of its bytes."""
    tensors = list(tensors)
    add(stats, f"{kind}_calls", len(tensors))
    add(stats, f"{kind}_bytes", sum(t.numel() * t.element_size() for t in tensors))


def count_p2p_round(stats: dict | None, sent: int, received: int) -> None:
    """One point-to-point round in which this rank sends ``sent`` and receives ``received`` bytes."""
    if sent or received:
        add(stats, "rounds", 1)
        add(stats, "p2p_rounds", 1)
        add(stats, "p2p_bytes", max(sent, received))


@contextmanager
def timed(stats: dict | None, key: str) -> Iterator[None]:
    """The block's host seconds added to ``stats[key]`` (``encode_s``, ``decode_s``, ``round_work_s``)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        add(stats, key, time.perf_counter() - start)


def round_work(stats: dict | None):
    """``timed`` as ``round_work_s``: codec work between a communicator's rounds."""
    return timed(stats, "round_work_s")


# --- the codec stream (CUDA) ------------------------------------------------------------------------------------

@contextmanager
def codec_stream(on: bool = True) -> Iterator[None]:
    """Codecs on CUDA tensors run on a side stream inside the block (``on=False``: they do not)."""
    _stream_forced.append(on)
    try:
        yield
    finally:
        _stream_forced.pop()


def side_stream(tensor: torch.Tensor) -> "torch.cuda.Stream | None":
    """The codec stream of ``tensor``'s device when its codec runs on one (a CUDA tensor, the stream enabled)."""
    on = _stream_forced[-1] if _stream_forced else os.environ.get(STREAM_ENV, "").strip().lower() in ("1", "true",
                                                                                                       "yes")
    if not (tensor.is_cuda and on):
        return None
    index = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    if index not in _streams:
        _streams[index] = torch.cuda.Stream(device=index)
    return _streams[index]
