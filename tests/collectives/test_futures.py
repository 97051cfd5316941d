"""The bookkeeping of collectives in flight (``gcomp.collectives.launch``); ``tests/test_exit.py`` runs the
race it prevents between real processes."""
from __future__ import annotations

from datetime import timedelta

import pytest
import torch

from gcomp.collectives import launch as futures


class FakeWork:
    """A ``dist.Work`` as ``launched`` and ``settle`` use it."""

    def __init__(self, completed: bool = False, error: Exception | None = None, never: bool = False):
        self.completed, self.error, self.never = completed, error, never
        self.waits: list[timedelta | None] = []

    def get_future(self) -> torch.futures.Future:
        return torch.futures.Future()

    def is_completed(self) -> bool:
        return self.completed

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append(timeout)
        if self.never:
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        self.completed = True
        return True


@pytest.fixture(autouse=True)
def _empty():
    futures.settle()
    yield
    futures.settle()


def test_settle_waits_for_every_launched_work_and_forgets_it():
    works = [FakeWork() for _ in range(3)]
    for work in works:
        assert isinstance(futures.launched(work), torch.futures.Future)
    assert futures.in_flight() == 3
    futures.settle()
    assert futures.in_flight() == 0
    assert all(w.waits == [None] for w in works)
    futures.settle()
    assert all(len(w.waits) == 1 for w in works), "a settled work was waited for again"


def test_a_failed_collective_is_not_raised_by_settle_its_future_carries_it():
    futures.launched(FakeWork(error=RuntimeError("Connection closed by peer")))
    after = FakeWork()
    futures.launched(after)
    futures.settle()
    assert after.waits == [None], "a failure stopped settle from waiting for the works after it"


def test_settle_with_a_timeout_passes_what_is_left_of_it_to_each_wait():
    stuck, later = FakeWork(never=True), FakeWork()
    futures.launched(stuck)
    futures.launched(later)
    futures.settle(timeout=5.0)
    assert futures.in_flight() == 0
    assert 0 < stuck.waits[0].total_seconds() <= 5.0
    assert 0 < later.waits[0].total_seconds() <= stuck.waits[0].total_seconds()


def test_completed_works_are_forgotten_when_nobody_settles():
    done = [FakeWork(completed=True) for _ in range(futures._PRUNE_AT - 1)]
    pending = FakeWork()
    for work in [pending, *done]:
        futures.launched(work)
    assert futures.in_flight() == futures._PRUNE_AT
    futures.launched(FakeWork())
    assert futures.in_flight() == 2, "completed works were kept"
