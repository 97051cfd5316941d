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


class _CountingOuter:
    """Stands in for DiLoCo: counts its steps as RunState does."""

    def __init__(self, iteration: int):
        self.iteration, self.calls = iteration, 0

    def step(self):
        self.iteration += 1
        self.calls += 1


def test_lightning_callback_resumes_without_replaying_past_steps():
    pytest.importorskip("lightning")
    from types import SimpleNamespace

    from gcomp.integrations.lightning import DiLoCoCallback

    callback = DiLoCoCallback(sync_every=5)
    # Lightning's order on a resume: the callback's state is loaded (the outer count, 40), on_fit_start runs while
    # global_step still reads 0, then the loops are restored (global_step 40) and training goes on
    callback.outer, callback._loaded = _CountingOuter(40), True
    trainer = SimpleNamespace(global_step=40)
    callback.on_train_start(trainer, None)
    trainer.global_step = 41
    callback.on_train_batch_end(trainer, None, None, None, 0)
    assert callback.outer.calls == 1 and callback.outer.iteration == 41
    fresh = DiLoCoCallback(sync_every=5)  # a checkpoint without outer state: the count starts at the trainer's
    fresh.outer = _CountingOuter(0)
    fresh.on_train_start(SimpleNamespace(global_step=40), None)
    fresh.on_train_batch_end(SimpleNamespace(global_step=41), None, None, None, 0)
    assert fresh.outer.calls == 1
