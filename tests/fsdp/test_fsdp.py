"""gcomp under FSDP2 (``fully_shard``) on 2 and 3 gloo ranks: lossless methods against plain FSDP2, the bytes of
each method's formula, pruned weights kept at zero, checkpoints, and refusals at install."""
from __future__ import annotations

import pytest
import torch

from gcomp.run_state import STAT_KEYS as _STAT_KEYS
from tests.distributed import run_ranks_once
from tests.fsdp import fsdp_jobs as jobs

LOSSY_TOLERANCE = {"fp16": 1e-3, "bf16": 1e-2}


def _train(world: int) -> dict:
    return run_ranks_once(("fsdp-train", world), world, jobs.job_train, timeout=300)[0]


def _reference(results: dict, label: str) -> dict:
    return results["plain-pruned" if label.startswith("pactrain") else "plain"]["params"]


@pytest.mark.slow
@pytest.mark.parametrize("label", ["identity", "pactrain"])
def test_lossless_is_bit_identical_to_plain_fsdp2_on_two_ranks(label):
    results = _train(2)
    reference = _reference(results, label)
    for name, value in results[label]["params"].items():
        assert torch.equal(value, reference[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("label", ["identity", "pactrain"])
def test_lossless_matches_plain_fsdp2_within_float_tolerance_on_three_ranks(label):
    results = _train(3)  # three summands: the all-to-all's sum order is not gloo's
    reference = _reference(results, label)
    for name, value in results[label]["params"].items():
        torch.testing.assert_close(value, reference[name], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("label", sorted(LOSSY_TOLERANCE))
def test_half_precision_stays_close_to_plain_fsdp2(label):
    results = _train(2)
    reference = _reference(results, label)
    for name, value in results[label]["params"].items():
        torch.testing.assert_close(value, reference[name], rtol=0, atol=LOSSY_TOLERANCE[label])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("label", ["identity", "fp16", "bf16", "pactrain", "pactrain-ternary", "randomk", "spardl"])
def test_bytes_sent_equal_the_method_formula(label, world):
    run = _train(world)[label]
    assert run["last"]["bytes_dense"] == run["dense_last"]
    assert run["last"]["bytes_sent"] == run["expected_last"]
    assert run["stats"]["bytes_sent"] < run["stats"]["bytes_dense"] or label == "identity"


@pytest.mark.slow
def test_pactrain_packs_kept_plus_padding_and_keeps_pruned_weights_zero():
    results = _train(3)
    run = results["pactrain"]
    assert run["stats"]["packed_buckets"] == 2 * jobs.STEPS  # both pruned layers, from the first step
    assert run["zeros"] and all(run["zeros"].values())
    assert all(results["plain-pruned"]["zeros"].values())


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_pactrain_ternary_trains_keeps_pruned_weights_zero_and_counts_as_under_ddp(world):
    results = _train(world)
    run = results["pactrain-ternary"]
    stats = run["stats"]
    # both pruned layers packed from the first step, that step in two rounds (the exact scale), then one round
    assert stats["packed_buckets"] == 2 * jobs.STEPS and stats["one_round_buckets"] == 2 * (jobs.STEPS - 1)
    assert stats["scale_resyncs"] == 0 and stats["unfreezes"] == 0 and stats["mask_mismatches"] == 0
    assert run["zeros"] and all(run["zeros"].values())
    # lossy, but a step of the same size: close to plain FSDP2 after 10 steps, and not equal to it
    reference = _reference(results, "pactrain-ternary")
    differs = False
    for name, value in run["params"].items():
        assert torch.isfinite(value).all()
        torch.testing.assert_close(value, reference[name], rtol=0, atol=0.25)
        differs |= not torch.equal(value, reference[name])
    assert differs


@pytest.mark.slow
def test_state_has_the_hook_state_stats_and_counts_steps():
    run = _train(2)["spardl"]
    assert set(_STAT_KEYS) <= set(run["stats"]) and "messages" in run["stats"]
    assert run["stats"]["steps"] == jobs.STEPS
    assert run["stats"]["buckets"] == 3 * jobs.STEPS  # three FSDP modules hold parameters


RESUME = [("pactrain", "pactrain", {}, True), ("randomk", "randomk", {"ratio": 0.3}, False),
          ("spardl", "spardl", {"density": 0.3}, False), ("fp16", "fp16", {}, False),
          ("pactrain-ternary", "pactrain", {"ternary": True}, True),
          ("pactrain-ternary-ef", "pactrain", {"ternary": True, "error_feedback": True}, True),
          ("pactrain-ternary-2", "pactrain", {"ternary": True, "rounds": 2}, True)]


@pytest.mark.slow
@pytest.mark.parametrize("label", [r[0] for r in RESUME])
def test_checkpoint_round_trip_is_bit_identical(label):
    out = run_ranks_once(("fsdp-resume", 2), 2, jobs.job_resume, RESUME, timeout=300)
    for rank in out:
        assert rank[label]["equal"]
        assert rank[label]["iteration"] == 6  # 3 saved, 3 after the resume
        assert rank[label]["keys"] == ["format", "iteration", "method", "params", "ranks", "world_size"]


def _hsdp() -> dict:
    return run_ranks_once(("fsdp-hsdp", 4), 4, jobs.job_hsdp, timeout=300)[0]


@pytest.mark.slow
def test_hsdp_through_gcomp_matches_native_hsdp():
    out = _hsdp()
    for name, value in out["identity"]["params"].items():
        torch.testing.assert_close(value, out["native"][name], rtol=1e-5, atol=1e-6)
    for name, value in out["fp16"]["params"].items():
        torch.testing.assert_close(value, out["native"][name], rtol=0, atol=1e-3)
    assert "native HSDP" in out["refused"] and "replicate_group" not in out["refused"]


@pytest.mark.slow
@pytest.mark.parametrize("label", ["identity", "fp16"])
def test_hsdp_replica_bytes_equal_the_shard_in_the_method_dtype(label):
    run = _hsdp()[label]
    assert run["last"] == run["expected"]
    assert run["steps"] == jobs.STEPS
