"""The FSDP2 variant of the contract suite, over every method with an FSDP codec (``gcomp.fsdp.fsdp_methods()``).

1. the result is this rank's shard of the sum over ranks: exact for lossless methods, 16-bit close for the casts;
2. error feedback conserves: the shards plus every rank's residual add up to the sum of the inputs;
3. a non-finite entry surfaces in the output of the shard it belongs to;
4. FSDP's AVG divides the sum by the shard count;
5. refusals at install name what can be used, with the registry's own messages for bad names and parameters.
"""
from __future__ import annotations

import pytest
import torch

from gcomp.fsdp import fsdp_methods
from tests.distributed import run_ranks_once
from tests.fsdp import contract_jobs as jobs

METHODS = fsdp_methods()
WORLDS = (2, 4)


def _results(world: int) -> list[dict]:
    return run_ranks_once(("fsdp-contracts", world), world, jobs.job_contracts, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", METHODS)
def test_result_is_the_shard_of_the_sum(name, world):
    for rank in _results(world):
        run = rank[name]
        if run["lossless"]:
            torch.testing.assert_close(run["last"], run["sum"], rtol=1e-6, atol=1e-6)
            if world == 2:
                assert torch.equal(run["last"], run["sum"])
        elif name in ("fp16", "bf16"):
            tol = 1e-2 if name == "bf16" else 2e-3
            torch.testing.assert_close(run["last"], run["sum"], rtol=tol, atol=tol * run["sum"].abs().max().item())
        assert not torch.isnan(run["last"]).any()


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [m for m in METHODS if m in ("randomk", "spardl")])
def test_error_feedback_conserves_the_sum(name, world):
    for rank in _results(world):
        run = rank[name]
        # every step's shards, plus what every rank holds back after them, is every step's input summed
        torch.testing.assert_close(run["conserved"], run["total"] * run["steps"], rtol=1e-4, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", METHODS)
def test_nonfinite_surfaces_on_its_shard(name, world):
    results = _results(world)
    target = results[0][name]["nan_shard"]
    assert results[target][name]["nan"]


@pytest.mark.slow
@pytest.mark.parametrize("name", METHODS)
def test_avg_divides_by_the_shard_count(name):
    for rank in _results(2):
        run = rank[name]
        if run["lossless"]:
            torch.testing.assert_close(run["avg"], run["sum"] / 2, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
def test_pactrain_packs_in_the_contract_runs():
    for rank in _results(2):
        assert rank["pactrain"]["packed"] > 0


def _refusals() -> dict:
    return run_ranks_once(("fsdp-refusals", 2), 2, jobs.job_refusals, timeout=300)[0]


@pytest.mark.slow
def test_refusals_at_install():
    out = _refusals()
    kind, text = out["topk"]
    assert kind == "ValueError" and "topk cannot serve FSDP2" in text
    assert all(m in text for m in METHODS)
    assert "ternary=True is not supported" in out["ternary"][1]
    assert "teams=1" in out["teams"][1]
    for key in ("unknown", "bad_param", "unknown_param"):
        assert out[key] == out[key + "_create"]  # the registry's own error, as under DDP
    assert "already installed" in out["twice"]
