"""gcomp.outer.DiLoCo on gloo ranks: synchronous DDP's parameters at sync_every=1, the outer gradient conserved
under error feedback, bit-identical replicas, Streaming DiLoCo's schedule, a dead peer, 2 nodes of 2."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.outer import outer_jobs as jobs
from tests.test_peer_failure import GLOO_ERRORS


@pytest.mark.parametrize("world", [2, 3])
def test_sync_every_one_is_synchronous_ddp(world):
    for distances in run_ranks(world, jobs.job_like_ddp, 6):
        assert len(distances) == 6 and max(distances) < 1e-5, distances


def test_the_outer_gradient_is_conserved_under_error_feedback():
    """Sum over outer steps of the reduced outer gradients + what every rank's topk still holds back == the sum
    over outer steps of the outer gradients' mean (float64)."""
    results = run_ranks(3, jobs.job_conservation, 12, 3)
    r = results[0]
    assert r["outer_steps"] == 4 and len(r["sent"]) > 1  # several buckets, several outer steps
    assert r["bytes_sent"] < r["bytes_dense"] / 2
    for sent, given, held in zip(r["sent"], r["given"], r["held"]):
        assert held.abs().sum() > 0  # topk held something back
        torch.testing.assert_close(sent + held, given, rtol=1e-12, atol=1e-12)
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other["sent"], r["sent"]))


def test_streaming_keeps_replicas_bit_identical_and_follows_the_schedule():
    results = run_ranks(3, jobs.job_streaming, 16, sync_every=8, fragments=3, overlap=2)
    r = results[0]
    assert all(torch.equal(x["start"], r["start"]) for x in results)  # every rank started from rank 0's
    # fragments launch at s % 8 in (0, 2, 5) (f*8//3) and apply 2 steps later
    assert r["acted"] == [2, 4, 5, 7, 8, 10, 12, 13, 15, 16], r["acted"]
    assert r["stats"]["outer_steps"] == 5  # launched at 2, 5, 8, 10, 13; 16's still in flight
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other["theta"], r["theta"]))
        assert other["stats"]["bytes_sent"] == r["stats"]["bytes_sent"] > 0
    names = [n for f in r["fragments"] for n in f]
    assert len(names) == len(set(names)) == 6 and all(r["fragments"])


def test_a_partial_merge_keeps_the_global_copy_identical_and_the_replicas_their_own():
    results = run_ranks(2, jobs.job_streaming, 8, sync_every=4, alpha=0.5)
    assert results[0]["stats"]["outer_steps"] == 2
    assert all(torch.equal(a, b) for a, b in zip(results[0]["theta"], results[1]["theta"]))
    assert not torch.equal(results[0]["params"], results[1]["params"])  # half of each rank's own steps kept
    assert not torch.equal(results[0]["params"], results[0]["theta"][-1])


def test_a_dead_peer_during_an_outer_reduction_raises_on_every_survivor():
    ranks = run_ranks(3, jobs.job_peer_dies, 3, timeout=60)
    assert ranks[-1].get("died")
    for rank, seen in enumerate(ranks[:-1]):
        assert seen["error"] is not None, f"rank {rank} went on: {seen}"
        assert seen["steps"] == 2, seen  # the inner steps ran; the outer sync at step 3 failed
        assert any(words in seen["error"] for words in GLOO_ERRORS + ("timeout",)), seen["error"][:400]


def test_two_nodes_of_two_with_an_inner_ddp():
    results = run_ranks(4, jobs.job_nodes, 7)
    first = results[0]["seen"]
    assert len(first) == 2
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(other["seen"], first))
    assert results[0]["stats"]["bytes_sent"] > 0


def test_every_method_that_does_not_read_the_model_runs_the_outer_loop():
    import gcomp

    names = [n for n in gcomp.available() if not gcomp.create(n).reads_model]
    results = run_ranks(3, jobs.job_every_method, names, 6, timeout=300)
    for name in names:
        first = results[0][name]
        assert "error" not in first, f"{name}: {first['error']}"
        assert first["outer_steps"] == 3 and first["sent"] > 0, (name, first)
        for other in results[1:]:
            assert torch.equal(other[name]["params"], first["params"]), name
