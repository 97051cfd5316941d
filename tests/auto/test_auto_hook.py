"""``auto`` through the hook on 2-4 gloo ranks: every rank decides alike, switches keep replicas identical and
the gradient's total exact, ``allow="exact"`` picks lossless methods only."""
from __future__ import annotations

import pytest
import torch

from tests.auto import auto_jobs as jobs
from tests.distributed import run_ranks

pytestmark = pytest.mark.slow

LOSSY = ["identity", "test-strided", "test-late"]  # hand-built (tests/auto/auto_jobs.py): a residual, a held slot


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_agree_on_every_choice_and_switch_alike(world):
    results = run_ranks(world, jobs.job_switching, LOSSY, 24)
    first = results[0]
    assert first["stats"]["auto_explore_steps"] == 2 * len(LOSSY)
    assert first["stats"]["auto_switches"] >= 1, "the alternating link never moved a choice"
    assert first["stats"]["auto_probes"] >= 2
    assert set(first["choices"].values()) <= set(LOSSY) and first["choices"]
    for r in results[1:]:
        assert r["choices"] == first["choices"]
        assert r["stats"]["auto_switches"] == first["stats"]["auto_switches"]
        assert torch.equal(r["params"], first["params"]), "replicas differ after auto's switches"


def test_exact_never_picks_a_lossy_method_and_keeps_pactrain_for_pruned_models():
    unpruned = run_ranks(3, jobs.job_switching, "exact", 16)
    pruned = run_ranks(3, jobs.job_switching, "exact", 16, prune=True)
    assert unpruned[0]["active"] == ["identity"]
    assert pruned[0]["active"] == ["identity", "pactrain"]
    for results in (unpruned, pruned):
        assert all(all(r["lossless"]) for r in results)
        assert all(set(r["choices"].values()) <= set(r["active"]) for r in results)
        assert all(torch.equal(r["params"], results[0]["params"]) for r in results)
    assert pruned[0]["stats"]["auto_switches"] >= 1  # identity and pactrain alternate on the alternating link


def test_a_switch_keeps_the_gradient_total_exact():
    """Sum over steps of the mean results, plus what every rank's candidates still hold back, equals the sum of
    the gradients over steps and ranks divided by the world size (float64; a residual memory's and a held slot's
    gradient handed to the next method at each switch)."""
    results = run_ranks(3, jobs.job_conservation, LOSSY, 20)
    r = results[0]
    assert r["switches"] >= 2
    assert all(x["parked"] == 0 for x in results), "a method switched off still holds gradient back"
    for sent, given, held in zip(r["sent"], r["given"], r["held"]):
        torch.testing.assert_close(sent + held, given / r["world"], rtol=1e-12, atol=1e-12)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other["sent"], r["sent"]))


def test_ranks_decide_from_the_slowest_ranks_measurements():
    results = run_ranks(2, jobs.job_one_slow_rank, 8)
    assert results[0]["choices"] and set(results[0]["choices"].values()) == {"fp16"}
    assert results[1]["choices"] == results[0]["choices"]
    assert torch.equal(results[0]["params"], results[1]["params"])
