"""What the communicators launch, counted in the hook's ``stats``: collectives, sequential rounds and bytes per kind.

The cost model (``gcomp.bench.costmodel``) prices a step from these counts, so they follow what the code does,
not what a method is said to do: a chained method that switches to one round shows one round.

- ``rounds``: latency rounds on a bucket's critical path: every collective waited for inside ``exchange`` is
  one, the asynchronous collectives launched together at its end are one more, and each round of a
  point-to-point program in which this rank sends or receives is one;
- ``allreduce_calls`` / ``allreduce_bytes``: all-reduces launched and the bytes this rank handed them;
- ``allgather_calls`` / ``allgather_bytes``: all-gathers and this rank's own contribution (padding included);
- ``p2p_rounds`` / ``p2p_bytes``: point-to-point rounds with traffic on this rank, and per round the larger of
  the bytes it sends and receives (its link's egress and ingress are separate: a round lasts as long as the
  busier direction);
- ``round_work_s``: host seconds of codec work a communicator runs between its rounds, which the encode and
  decode timers do not see (a chained codec's ``second_round``, a point-to-point program's selections and
  merges): local work, not communication.

Counting is plain Python arithmetic on sizes already known (no host synchronisation), and only into keys the
``stats`` dict holds (``HookState.stats`` declares them; a hand-built dict that lacks them counts nothing).
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch

ALLREDUCE_KEYS = ("allreduce_calls", "allreduce_bytes")
ALLGATHER_KEYS = ("allgather_calls", "allgather_bytes")
P2P_KEYS = ("p2p_rounds", "p2p_bytes")
COUNTER_KEYS = ("rounds", *ALLREDUCE_KEYS, *ALLGATHER_KEYS, *P2P_KEYS, "round_work_s")


def _add(stats: dict | None, key: str, value: float) -> None:
    if stats is not None and key in stats:
        stats[key] += value


def count_round(stats: dict | None, rounds: int = 1) -> None:
    """``rounds`` more sequential latency rounds."""
    _add(stats, "rounds", rounds)


def count_collectives(stats: dict | None, kind: str, tensors: Iterable[torch.Tensor]) -> None:
    """One ``kind`` collective (``"allreduce"`` or ``"allgather"``) per tensor, of its bytes."""
    calls = nbytes = 0
    for t in tensors:
        calls += 1
        nbytes += t.numel() * t.element_size()
    _add(stats, f"{kind}_calls", calls)
    _add(stats, f"{kind}_bytes", nbytes)


def count_p2p_round(stats: dict | None, sent: int, received: int) -> None:
    """One point-to-point round in which this rank sends ``sent`` and receives ``received`` bytes."""
    if sent or received:
        _add(stats, "rounds", 1)
        _add(stats, "p2p_rounds", 1)
        _add(stats, "p2p_bytes", max(sent, received))


@contextmanager
def timed(stats: dict | None, key: str) -> Iterator[None]:
    """Adds the block's host seconds to ``stats[key]`` (``encode_s``, ``decode_s``, ``round_work_s``): the one
    timer of every pipeline. An exception passing through (a finished program's StopIteration) is timed too."""
    start = time.perf_counter()
    try:
        yield
    finally:
        _add(stats, key, time.perf_counter() - start)


def round_work(stats: dict | None):
    """``timed`` as ``round_work_s``: codec work between a communicator's rounds."""
    return timed(stats, "round_work_s")
