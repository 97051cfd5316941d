"""Bit-identical resumes (issue 28): every method that keeps state, checkpointed and resumed on a fresh model, DDP
and hook state, takes the very steps of a run that never stopped (parameters and bytes sent), on 1, 2 and 3 of
DDP's buckets; and a checkpoint saved right after a load holds everything the loaded one did.

DDP starts a fresh model on one bucket of every parameter, in registration order, and rebuilds its buckets after
the first step; the resumed run reduces that first bucket as the saved run's layouts (``gcomp.resume_layouts``).
Without that, almost every method left the trajectory (random draws taken in bucket order, a top-k per bucket,
pactrain's per-layout tracker). One rank shows it for every method; two ranks for the methods whose ranks
exchange more than a sum (SparDL's teams, gTop-k's tree) and the per-rank residuals of ternary error feedback.
"""
from __future__ import annotations

import pytest
import torch

from gcomp.bucket import BucketInfo
from gcomp.resume_layouts import SavedLayouts
from tests import resume_jobs as jobs
from tests.distributed import run_ranks, run_ranks_once

CASES = list(jobs.cases())
ON_TWO_RANKS = ["spardl", "gtopk", "pactrain:ternary,error_feedback", "hierarchical", "prunex"]


def _results(world: int, names: list[str], configs: dict) -> dict:
    return run_ranks_once(("resume", world), world, jobs.job_resume, names, configs, timeout=300)


def test_the_cases_cover_every_method_with_state():
    """Every registered method that checkpoints something, but auto (a resumed run measures its candidates
    again, by design: docs/checkpoints-and-faults.md)."""
    assert {"dgc", "powersgd", "pactrain", "prunex", "randomk", "signum", "spardl", "topk", "terngrad"} <= set(CASES)
    assert "auto" not in CASES and "identity" not in CASES


@pytest.mark.parametrize("world, names, configs", [(1, CASES, list(jobs.CONFIGS)),
                                                   (2, ON_TWO_RANKS, ["1 bucket", "3 buckets"])],
                         ids=["1-rank", "2-ranks"])
def test_a_resumed_run_is_bit_identical_to_one_never_stopped(world, names, configs):
    failed = []
    for rank, results in enumerate(_results(world, names, {c: jobs.CONFIGS[c] for c in configs})):
        for (case, config, schedule), (same, sent, steps) in results.items():
            if not same or sent[0] != sent[1] or steps[0] != steps[1]:
                failed.append(f"rank {rank} {case} on {config}, {schedule}: parameters "
                              f"{'equal' if same else 'differ'}, bytes sent {sent[0]} vs {sent[1]}, steps {steps}")
        assert len(results) == len(names) * len(configs) * 2
    assert not failed, "\n".join(failed)


def test_a_state_saved_right_after_a_load_holds_what_was_loaded():
    """Before: pactrain's tracker saved only the tracks stepped since the load; the entries the load parked for
    the first step (supports, carried scales, residuals) were dropped, and a run resumed from that file packed
    one bucket of two and lost its residual."""
    resaved = run_ranks(1, jobs.job_resave, CASES)[0]
    assert resaved == {case: True for case in CASES}, [case for case, same in resaved.items() if not same]


def test_the_saved_layouts_are_those_of_ddps_rebuilt_buckets():
    """After the rebuild, DDP's buckets hold the parameters in the order their gradients become ready (the last
    layer first), as many buckets as ``bucket_cap_mb`` makes: what the checkpoint records."""
    one, three = run_ranks(1, jobs.job_layouts, 1)[0], run_ranks(1, jobs.job_layouts, 3)[0]
    assert one == [["4.bias", "4.weight", "2.bias", "2.weight_orig", "0.bias", "0.weight_orig"]]
    assert three == [["4.bias", "4.weight"], ["2.bias", "2.weight_orig"], ["0.bias", "0.weight_orig"]]


def test_a_checkpoint_taken_before_ddps_rebuild_resumes_on_its_first_buckets():
    """The one case that stays apart, as docs/checkpoints-and-faults.md says: a checkpoint saved before the hook saw DDP's rebuilt
    buckets (here after the warm-up's one step, before the first compressed one) records no layout to go back
    to, so the resumed run's first step is on the fresh DDP's one bucket, where randomk draws other positions;
    one that does not depend on the layout (topk on one bucket) still resumes bit-identically."""
    early = {"3 buckets, saved after the warm-up": (jobs.BUCKETS[3], 1), "1 bucket, saved after the warm-up":
             (jobs.BUCKETS[1], 1)}
    results = run_ranks(1, jobs.job_resume, ["randomk", "topk"], early)[0]
    assert not results[("randomk", "3 buckets, saved after the warm-up", "resumed")][0]
    assert results[("topk", "1 bucket, saved after the warm-up", "resumed")][0]


def _bucket(index: int, names: list[str]) -> BucketInfo:
    return BucketInfo.from_layout(index, torch.float32, names, [len(n) for n in names])


def test_a_fresh_ddps_bucket_is_cut_into_the_saved_layouts_for_its_first_steps_only():
    """``SavedLayouts.pieces``: a bucket holding exactly the parameters of some saved layouts is cut into them, in
    their saved order of buckets, each parameter found where it lies; one that is a saved layout, or that DDP
    grouped otherwise, goes as it is; and only for the steps given at load."""
    saved = SavedLayouts()
    saved.load(SavedLayouts.check([{"index": 0, "names": ["c", "bb"]}, {"index": 1, "names": ["aaa"]}]), steps=1)
    first = _bucket(0, ["aaa", "bb", "c"])  # registration order, one bucket: entries aaa 0-3, bb 3-5, c 5-6
    pieces = saved.pieces(first)
    assert [(info.index, info.names, where) for info, where in pieces] == [(0, ("c", "bb"), [(5, 1), (3, 2)]),
                                                                           (1, ("aaa",), [(0, 3)])]
    assert pieces[0][0].key == _bucket(0, ["c", "bb"]).key  # the saved run's state is found by its key
    assert saved.pieces(_bucket(0, ["c", "bb"])) is None  # the saved layout itself
    assert saved.pieces(_bucket(0, ["aaa", "c"])) is None  # grouped otherwise: as it is
    saved.left -= 1  # a step was taken (the hook state counts them)
    assert saved.pieces(first) is None  # DDP has rebuilt its buckets by now
    assert saved.state([]) == [{"index": 0, "names": ["c", "bb"]}, {"index": 1, "names": ["aaa"]}]  # saved again
    assert saved.state([_bucket(2, ["z"])]) == [{"index": 2, "names": ["z"]}]  # a step taken since: its own


def test_saved_layouts_are_checked_at_load():
    for bad, words in [("x", "must be a list"), ([{"index": -1, "names": []}], "at least 0"),
                       ([{"index": 0, "names": ["a"]}, {"index": 1, "names": ["a"]}], "'a' is in two buckets")]:
        with pytest.raises(ValueError, match=words):
            SavedLayouts.check(bad)
