"""An FSDP2 checkpoint (``gather_state_dict()``) resumed on another number of ranks, 2 -> 3 and 3 -> 2: residuals kept
per parameter are re-sharded (their sum over the ranks kept, and taken up at the next step); pactrain, whose state
is laid out by the shards, is refused on every rank alike, saying both world sizes and what to do."""
from __future__ import annotations

import pytest
import torch

import gcomp
from gcomp import checkpoint
from tests.distributed import run_ranks_once
from tests.fsdp import resize_jobs as jobs

RESIZES = [(2, 3), (3, 2)]


def _resize(old: int, new: int) -> tuple[dict, list[dict]]:
    runs = jobs.RESHARDED + jobs.REFUSED
    saved = run_ranks_once(("fsdp-resize-save", old), old, jobs.save, runs, timeout=300)[0]
    return saved, run_ranks_once(("fsdp-resize", old, new), new, jobs.resume, runs, saved, timeout=300)


def _per_parameter(pieces: dict, sizes: dict, world: int) -> dict:
    """``{(slot, parameter): float64 tensor}``: each parameter's pieces ``name[s]`` joined, FSDP's padding dropped."""
    out = {}
    for slot, tensors in pieces.items():
        for name, size in sizes.items():
            if f"{name}[0]" in tensors:
                whole = torch.cat([tensors[f"{name}[{s}]"].reshape(-1) for s in range(world)])
                out[(slot, name)] = whole[:torch.Size(size).numel()].double()
    return out


def _total(per_rank: list[dict]) -> dict:
    total = {}
    for residuals in per_rank:
        for key, t in residuals.items():
            total[key] = total.get(key, 0) + t
    return total


@pytest.mark.slow
@pytest.mark.parametrize("old, new", RESIZES)
@pytest.mark.parametrize("label", [run[0] for run in jobs.RESHARDED])
def test_residuals_are_resharded_by_parameter_their_total_kept_and_taken_up(label, old, new):
    saved, resumed = _resize(old, new)
    method = gcomp.create(dict((run[0], run[1]) for run in jobs.RESHARDED)[label])
    before = _total([_per_parameter(method.parameter_state(checkpoint.unpack(k, b)["method"]), saved["sizes"], old)
                     for k, b in saved[label]["ranks"].items()])
    after = _total([_per_parameter(r[label]["loaded"], saved["sizes"], new) for r in resumed])
    assert before and set(before) == set(after)
    assert any(bool(t.abs().sum() > 0) for t in before.values())
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=1e-6, atol=1e-7)
    pieces = {f"{n}[{s}]" for n in saved["sizes"] for s in range(new)}
    for rank, r in enumerate(resumed):  # keyed by this run's shards; a new rank without an old one starts at 0
        assert set(r[label]["loaded"]["residuals"]) == (pieces if rank < old else set())
        assert r[label]["iteration"] == 4
    assert any(r[label]["differs"] for r in resumed)  # the residuals moved the next step


@pytest.mark.slow
@pytest.mark.parametrize("old, new", RESIZES)
@pytest.mark.parametrize("label", [run[0] for run in jobs.REFUSED])
def test_pactrain_refuses_a_resize_on_every_rank(label, old, new):
    _, resumed = _resize(old, new)
    for r in resumed:
        error = r[label].get("error", "")
        for words in (f"saved at world size {old}, this run has {new}", "pactrain under FSDP2 keeps its mask tracker",
                      f"resume on {old} ranks", "start pactrain's state afresh", "skip load_state_dict"):
            assert words in error, (words, r[label])
