"""FSDP2's contract (11 of ``gcomp.testing.CONTRACTS``: this rank's shard of the sum as the error model says, error
feedback conserved, a non-finite entry on its shard, AVG divided by the shard count) over every method that serves
FSDP2 and every variant it was registered with (``gcomp.fsdp.fsdp_configs()``), by ``gcomp.testing``;
then pactrain's own on FSDP2 (its ternary paths: exactly zero off the support, the carried scale alike on every
rank, each call's bytes by the codec's formula) and the refusals at install."""
from __future__ import annotations

import pytest
import torch

import gcomp
from gcomp.collectives import bitpack
from gcomp.fsdp import fsdp_configs, fsdp_methods
from gcomp.testing import MethodSource, Skip, fidelity, process_checks
from gcomp.testing.reduce_jobs import FSDP_CHECKS, job_fsdp
from gcomp.testing.models import fsdp_mlp
from tests.distributed import run_ranks_once

PARAMS = {"randomk": {"ratio": 0.2}, "spardl": {"density": 0.2}}
SOURCES = [MethodSource.of(name, **{**PARAMS.get(name, {}), **params}) for _, name, params in fsdp_configs()]
CONFIGS = [s.label for s in SOURCES]
TERNARY = [label for label in CONFIGS if "ternary=true" in label]
WORLDS = (2, 4)


def _results(world: int) -> list[dict]:
    return run_ranks_once(("fsdp-contracts", world), world, job_fsdp, SOURCES, timeout=300)


def test_the_suite_runs_every_method_and_variant():
    assert {MethodSource.of(n, **PARAMS.get(n, {})).label for n in fsdp_methods()} <= set(CONFIGS) and set(fsdp_methods()) >= {"fp16"}
    if "pactrain" in fsdp_methods():
        assert {"pactrain:ternary=true", "pactrain:ternary=true,rounds=2",
                "pactrain:ternary=true,error_feedback=true"} <= set(CONFIGS)


@pytest.mark.slow
@pytest.mark.parametrize("what", FSDP_CHECKS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_fsdp_contract(name, world, what):
    try:
        process_checks.check_fsdp(_results(world), name, what)
    except Skip as skip:
        pytest.skip(str(skip))


@pytest.mark.slow
@pytest.mark.parametrize("name", [c for c in CONFIGS if c.startswith("pactrain")])
def test_pactrain_packs_in_the_contract_runs(name):
    for rank in _results(2):
        assert rank[name]["stats"].get("packed_buckets", 0) > 0


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [c for c in CONFIGS if c.startswith("pactrain")])
def test_pactrain_output_is_exactly_zero_off_the_support(name, world):
    nonzero = False
    for rank in _results(world):
        run = rank[name]
        pruned = run["own_mask"] == 0
        assert pruned.any() and (run["last"][pruned] == 0).all() and (run["first"][pruned] == 0).all()
        nonzero |= bool((run["last"][~pruned] != 0).any())  # a shard of small entries may draw only zeros
    assert nonzero


def _found(state, key: str):
    """The first value under ``key`` anywhere in a nested state dict."""
    if isinstance(state, dict):
        if key in state:
            return state[key]
        for value in state.values():
            found = _found(value, key)
            if found is not None:
                return found
    return None


@pytest.mark.slow
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", TERNARY)
def test_ternary_carried_scale_is_alike_on_every_rank(name, world):
    exponents = [_found(rank[name]["state"], "exponents") for rank in _results(world)]
    assert exponents[0] is not None and exponents[0].numel() == 2  # one per parameter: weight, bias
    assert all(torch.equal(e, exponents[0]) for e in exponents)


def ternary_call_bytes(world: int, mask: torch.Tensor, params: int, one_round: bool) -> int:
    """Bytes one packed ternary call hands to collectives (the codec's docstring): K the longest row's kept count,
    W its words of ``lane_bits(world)``-bit fields; one round: ``8 world (W + H + 3)``, H the counting lanes of
    ``params`` parameters; two rounds: ``4 (params + 2)`` (the MAX of the scales) + ``8 world W``."""
    from gcomp.compressors.pactrain.scale_grid import hist_words
    words = bitpack.packed_words(int(mask.sum(1).max()), bitpack.lane_bits(world))
    if one_round:
        return 8 * world * (words + hist_words(params, world) + 3)
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
        # calls 2 and 3, the draws of the unbiased check, then the NaN and AVG calls; the draws' input (plain normal)
        # is not the calls' (four decades apart), so its first call may take the exact scale again, once
        resyncs = run["stats"]["scale_resyncs"]
        assert resyncs <= (0 if "rounds=2" in name else 1)
        assert run["stats"]["one_round_buckets"] == (0 if "rounds=2" in name else 4 + fidelity.DRAWS - resyncs)


def job_refusals() -> dict:
    """The messages of every refusal at install, and of the registry's checks, under FSDP2."""
    out = {}
    cases = {"topk": ("topk", {}), "ternary": ("pactrain", {"ternary": True}), "teams": ("spardl", {"teams": 2}),
             "unknown": ("idenity", {}), "bad_param": ("randomk", {"ratio": 2.0}), "unknown_param": ("fp16", {"x": 1})}
    for key, (name, params) in cases.items():
        try:
            gcomp.install(fsdp_mlp(False), name, **params)
            out[key] = None
        except (ValueError, RuntimeError) as err:
            out[key] = (type(err).__name__, str(err))
        if key in ("unknown", "bad_param", "unknown_param"):
            try:
                gcomp.create(name, **params)
            except ValueError as err:
                out[key + "_create"] = (type(err).__name__, str(err))
    model = fsdp_mlp(False)
    gcomp.install(model, "identity")
    try:
        gcomp.install(model, "fp16")
        out["twice"] = None
    except RuntimeError as err:
        out["twice"] = str(err)
    return out


@pytest.mark.slow
def test_refusals_at_install():
    out = run_ranks_once(("fsdp-refusals", 2), 2, job_refusals, timeout=300)[0]
    kind, text = out["topk"]
    assert kind == "ValueError" and "topk cannot serve FSDP2" in text
    assert all(m in text for m in fsdp_methods())
    assert out["ternary"] is None  # pactrain's ternary path serves FSDP2 (it was refused before)
    assert "cannot take teams=2" in out["teams"][1] and "FSDP2: 1" in out["teams"][1]
    for key in ("unknown", "bad_param", "unknown_param"):
        assert out[key] == out[key + "_create"]  # the registry's own error, as under DDP
    assert "already installed" in out["twice"]
