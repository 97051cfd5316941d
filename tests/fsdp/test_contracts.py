"""The FSDP2 variant of the contract suite, over every method with an FSDP codec and every variant its codec declares
(``gcomp.fsdp.fsdp_configs()``: ``pactrain``'s ternary paths too).

1. the result is this rank's shard of the sum over ranks: exact for lossless methods, 16-bit close for the casts;
2. error feedback conserves: the shards plus every rank's residual add up to the sum of the inputs;
3. a non-finite entry surfaces in the output of the shard it belongs to;
4. FSDP's AVG divides the sum by the shard count;
5. refusals at install name what can be used, with the registry's own messages for bad names and parameters;
6. pactrain's ternary paths: unbiased on the support, exactly zero off it, the carried scale alike on every rank,
   each call's bytes by the codec's formula.
"""
from __future__ import annotations

import pytest
import torch

from gcomp.collectives import bitpack
from gcomp.compressors.pactrain import codec as scale_grid
from gcomp.fsdp import fsdp_methods
from tests.distributed import run_ranks_once
from tests.fsdp import contract_jobs as jobs

METHODS = fsdp_methods()
CONFIGS = [label for label, _, _ in jobs.CONFIGS]
TERNARY = [label for label, _, params in jobs.CONFIGS if params.get("ternary")]
WORLDS = (2, 4)


def test_the_suite_runs_pactrains_ternary_paths():
    assert {"pactrain:ternary=true", "pactrain:ternary=true,rounds=2",
            "pactrain:ternary=true,error_feedback=true"} <= set(CONFIGS)
    assert set(METHODS) <= set(CONFIGS)


def _results(world: int) -> list[dict]:
    return run_ranks_once(("fsdp-contracts", world), world, jobs.job_contracts, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", CONFIGS)
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
@pytest.mark.parametrize("name", [m for m in CONFIGS if m in ("randomk", "spardl", "fp8", "mx") or "error_feedback=true" in m])
def test_error_feedback_conserves_the_sum(name, world):
    for rank in _results(world):
        run = rank[name]
        # every step's shards, plus what every rank holds back after them, is every step's input summed
        torch.testing.assert_close(run["conserved"], run["total"] * run["steps"], rtol=1e-4, atol=1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_nonfinite_surfaces_on_its_shard(name, world):
    results = _results(world)
    target = results[0][name]["nan_shard"]
    assert results[target][name]["nan"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CONFIGS)
def test_avg_divides_by_the_shard_count(name):
    for rank in _results(2):
        run = rank[name]
        if run["lossless"]:
            torch.testing.assert_close(run["avg"], run["sum"] / 2, rtol=1e-6, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["pactrain", *TERNARY])
def test_pactrain_packs_in_the_contract_runs(name):
    for rank in _results(2):
        assert rank[name]["packed"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["pactrain", *TERNARY])
def test_pactrain_output_is_exactly_zero_off_the_support(name, world):
    nonzero = False
    for rank in _results(world):
        run = rank[name]
        pruned = run["own_mask"] == 0
        assert pruned.any() and (run["last"][pruned] == 0).all() and (run["first"][pruned] == 0).all()
        nonzero |= bool((run["last"][~pruned] != 0).any())  # a shard of small entries may draw only zeros
    assert nonzero


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", TERNARY)
def test_ternary_carried_scale_is_alike_on_every_rank(name, world):
    results = _results(world)
    exponents = [rank[name]["exponents"] for rank in results]
    assert exponents[0] is not None and exponents[0].numel() == 2  # one per parameter: weight, bias
    assert all(torch.equal(e, exponents[0]) for e in exponents)


def ternary_call_bytes(world: int, mask: torch.Tensor, params: int, one_round: bool) -> int:
    """Bytes one packed ternary call hands to collectives (``PacTrainCodec``'s docstring): K the longest row's kept
    count, W its words of ``lane_bits(world)``-bit fields; one round: ``8 world (W + H + 3)``, H the counting lanes
    of ``params`` parameters; two rounds: ``4 (params + 2)`` (the MAX of the scales) + ``8 world W``."""
    kept = int(mask.sum(1).max())
    words = bitpack.packed_words(kept, bitpack.lane_bits(world))
    if one_round:
        return 8 * world * (words + scale_grid.hist_words(params, world) + 3)
    return 4 * (params + 2) + 8 * world * words


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", TERNARY)
def test_ternary_bytes_per_call_equal_the_formula(name, world):
    for rank in _results(world):
        run = rank[name]
        params = len(run["sizes"])
        two = ternary_call_bytes(world, run["mask"], params, one_round=False)
        one = ternary_call_bytes(world, run["mask"], params, one_round=True)
        # the first packed call takes the exact scale in two rounds; later ones one round, unless rounds=2
        assert run["call_bytes"] == ([two, two, two] if "rounds=2" in name else [two, one, one])
        # calls 2 and 3, then the NaN and AVG calls
        assert run["stats"]["one_round_buckets"] == (0 if "rounds=2" in name else 4)
        assert run["stats"]["scale_resyncs"] == 0


def _unbiased(world: int) -> list[dict]:
    configs = [c for c in jobs.CONFIGS if c[0] in ("pactrain:ternary=true", "pactrain:ternary=true,rounds=2")]
    return run_ranks_once(("fsdp-unbiased", world), world, jobs.job_unbiased, configs, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("world", (3, 4))
@pytest.mark.parametrize("name", ["pactrain:ternary=true", "pactrain:ternary=true,rounds=2"])
def test_ternary_is_an_unbiased_shard_of_the_sum(name, world):
    for rank in _unbiased(world):
        run = rank[name]
        kept = run["own_mask"] != 0
        error = (run["mean"] - run["sum"]).abs()
        assert float(error[kept].max()) < run["bound"]
        assert (run["mean"][~kept] == 0).all()
        # not vacuous: the sum's entries are well above the bound, and a single draw is far from them
        assert float(run["sum"][kept].abs().median()) > run["bound"]


def _refusals() -> dict:
    return run_ranks_once(("fsdp-refusals", 2), 2, jobs.job_refusals, timeout=300)[0]


@pytest.mark.slow
def test_refusals_at_install():
    out = _refusals()
    kind, text = out["topk"]
    assert kind == "ValueError" and "topk cannot serve FSDP2" in text
    assert all(m in text for m in METHODS)
    assert out["ternary"] is None  # pactrain's ternary path serves FSDP2 (it was refused before)
    assert "teams=1" in out["teams"][1]
    for key in ("unknown", "bad_param", "unknown_param"):
        assert out[key] == out[key + "_create"]  # the registry's own error, as under DDP
    assert "already installed" in out["twice"]
