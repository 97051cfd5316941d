"""Every checkpoint fixture still loads: ``data/<label>.pt``, saved by ``make_fixtures`` from an earlier gcomp.

For each case of ``data/cases.json``, on the world size it was saved at: the same model and state rebuilt through
the public API (``recipes.Run``: ``gcomp.install``, ``gcomp.comm_hook``, ``gcomp.fsdp.replicate``,
``gcomp.outer.DiLoCo``), ``state.load_state_dict(torch.load(path, weights_only=True))`` (HSDP: the entry of this
rank's shard index, ``Run.load``), two more training steps. Each must load without an error, keep the parameters
finite, and go on counting steps (``state.iteration``; DiLoCo's: inner steps) from the saved count.

One rank job per world size runs all of its cases (``run_ranks_once``); the tests read its cached result.
"""
from __future__ import annotations

import traceback
import warnings

import pytest
import torch
import torch.distributed as dist

from tests.checkpoints import recipes
from tests.distributed import run_ranks_once

CASES = recipes.load_cases()
WORLDS = sorted({c["world"] for c in CASES})
MORE = 2  # steps after the load


def job_load(cases: list[dict]) -> dict:
    """Every case of this world size: rebuild, load the fixture, train ``MORE`` steps; per case what happened."""
    out = {}
    for case in cases:
        got: dict = {"error": None}
        try:
            run = recipes.Run(case)
            saved = torch.load(recipes.DATA / f"{case['label']}.pt", weights_only=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run.load(saved)  # state.load_state_dict(saved); HSDP: saved["shard<i>"]
            got["warnings"] = [f"{w.category.__name__}: {w.message}" for w in caught]
            got["loaded_iteration"] = run.state.iteration
            run.train(case["steps"], MORE)
            got["iteration"] = run.state.iteration
            got["finite"] = run.parameters_finite()
            run.close()
        except Exception:  # noqa: BLE001 -- the test reports it; a load refused is refused on every rank alike
            got["error"] = traceback.format_exc()
            dist.barrier()
        out[case["label"]] = got
    return out


def _results(world: int) -> list[dict]:
    cases = [c for c in CASES if c["world"] == world]
    return run_ranks_once(("checkpoint-fixtures", world), world, job_load, cases, timeout=600)


def test_every_fixture_has_a_case_and_every_case_a_fixture():
    files = {p.stem for p in recipes.DATA.glob("*.pt")}
    labels = [c["label"] for c in CASES]
    assert len(labels) == len(set(labels))
    assert files == set(labels), {"files without a case": sorted(files - set(labels)),
                                  "cases without a file": sorted(set(labels) - files)}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[c["label"] for c in CASES])
def test_fixture_loads_and_training_goes_on(case):
    for rank, got in enumerate(_results(case["world"])):
        got = got[case["label"]]
        assert got["error"] is None, f"rank {rank}:\n{got['error']}"
        assert got["loaded_iteration"] == case["steps"], (rank, got)
        assert got["iteration"] == case["steps"] + MORE, (rank, got)
        assert got["finite"], (rank, got)
