"""Futures that carry their collectives' errors: a failed collective (a dead peer, a timeout) must never be
read as a result."""
from __future__ import annotations

from typing import Any

import torch


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
