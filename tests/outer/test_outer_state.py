"""gcomp.outer.DiLoCo's checkpoints (bit-identical resume, another world size), its agreement at construction and
its bit-identity check."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.outer import outer_jobs as jobs


@pytest.mark.parametrize("kw", [{"sync_every": 4}, {"sync_every": 6, "fragments": 2, "overlap": 2}],
                         ids=["diloco", "streaming-saved-in-flight"])
def test_a_resumed_run_continues_bit_identically(kw):
    # k = 5: saved between outer steps; with overlap, a fragment launched at step 3 is still in flight at 5
    for r in run_ranks(2, jobs.job_resume, 5, **kw):
        (p1, t1, s1), (p2, t2, s2) = r["straight"], r["resumed"]
        assert torch.equal(p1, p2)
        assert all(torch.equal(a, b) for a, b in zip(t1, t2))
        assert s1["outer_steps"] == s2["outer_steps"] > 0 and s1["inner_steps"] == s2["inner_steps"] == 10


def test_a_gathered_checkpoint_resumes_on_another_world_size(tmp_path):
    path = str(tmp_path / "outer.pt")
    before = run_ranks(2, jobs.job_save_gathered, path, 8)
    after = run_ranks(3, jobs.job_resume_resized, path, 8)
    for r in after:
        assert torch.equal(r["loaded"], before[0]["params"])
        assert r["iteration"] == 16
        assert torch.equal(r["params"], after[0]["params"]) and torch.equal(r["theta"], after[0]["theta"])
    assert not torch.equal(after[0]["params"], after[0]["loaded"])  # it trained on


@pytest.mark.parametrize("field, words", [("sync_every", "disagree on outer"), ("method", "disagree on method"),
                                          ("fragments", "disagree on outer")])
def test_ranks_that_build_it_differently_fail_on_every_rank(field, words):
    for message in run_ranks(3, jobs.job_bad_agreement, field):
        assert words in message, message


def test_replicas_that_differ_after_an_outer_step_fail_on_every_rank_naming_the_parameter():
    for message in run_ranks(2, jobs.job_tampered, "2.weight"):
        assert "parameters differ after the outer step, first at '2.weight'" in message, message
