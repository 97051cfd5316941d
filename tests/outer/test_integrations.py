"""DiLoCo in Lightning (DiLoCoCallback, a real Trainer on 2 gloo ranks) and Accelerate (the diloco helper)."""
from __future__ import annotations

import pytest
import torch

from tests.distributed import run_ranks
from tests.outer import integration_jobs as jobs


@pytest.mark.slow  # importing Lightning in two ranks
def test_lightning_callback_runs_the_outer_loop():
    pytest.importorskip("lightning")
    results = run_ranks(2, jobs.job_lightning, 6, 3, timeout=120)
    for r in results:
        assert r["stats"]["inner_steps"] == 6 and r["stats"]["outer_steps"] == 2
        assert 0 < r["stats"]["bytes_sent"] < r["stats"]["bytes_dense"]
    assert torch.equal(results[0]["params"], results[1]["params"])  # after an outer step
    assert results[0]["saved"] == ["rank0", "rank1"]


def test_accelerate_helper_keeps_steps_local_and_syncs_every_h():
    results = run_ranks(2, jobs.job_accelerate, 3)
    assert not torch.equal(results[0]["after_one"], results[1]["after_one"])  # the inner step stayed local
    assert torch.equal(results[0]["params"], results[1]["params"])  # the outer step at 3 made them one
    for r in results:
        assert r["stats"]["outer_steps"] == 1 and r["stats"]["bytes_sent"] > 0
    assert results[0]["saved"] == ["rank0", "rank1"] and results[1]["saved"] is None
