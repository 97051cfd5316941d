"""A dead peer ends training on every surviving rank with the collective's own error, for every registered
method: never a hang, never a step on buffers a failed collective left untouched, never a misleading error
(an ``IndexError`` from decoding garbage). 2 and 3 ranks; the dying rank closes its connections as a process
that exits does, and once, for real, its process exits."""
from __future__ import annotations

import pytest

import gcomp
from tests import failure_jobs as jobs
from tests.distributed import run_ranks, run_ranks_once

METHODS = gcomp.available()
# What gloo says when a peer is gone: its connection closed, or (if it closed nothing) the group's timeout.
GLOO_ERRORS = ("Connection closed by peer", "Connection reset by peer", "Timed out", "timed out")


def _check_survivor(name: str, rank: int, seen: dict) -> None:
    assert seen["error"] is not None, f"{name}: rank {rank} went on training after its peer died ({seen})"
    assert seen["steps"] == jobs.DIE_AT, f"{name}: rank {rank} finished {seen['steps']} steps"
    assert any(words in seen["error"] for words in GLOO_ERRORS), (
        f"{name}: rank {rank} did not get the collective's own error: {seen['error'][:400]}")
    assert seen["finite"], f"{name}: rank {rank} stepped on non-finite parameters"


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("name", METHODS)
def test_survivors_raise_the_collectives_error(name, world):
    # a pool of its own: the job makes some sixty process groups, whose gloo threads would otherwise stay in
    # the shared pool's workers and slow every later test
    ranks = run_ranks_once(("peer-dies", world), world, jobs.every_method_loses_a_peer, METHODS, fresh=True,
                           timeout=60 + 3 * jobs.GROUP_TIMEOUT_S * len(METHODS))
    for rank, results in enumerate(ranks[:-1]):
        _check_survivor(name, rank, results[name])
    assert ranks[-1][name].get("died"), ranks[-1][name]


def test_a_peer_whose_process_exits():
    ranks = run_ranks(2, jobs.a_peer_process_exits, "signsgd", fresh=True, timeout=60)
    _check_survivor("signsgd", 0, ranks[0])
