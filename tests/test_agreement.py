"""Ranks that disagree fail together (``gcomp.agreement``): at install, at a comm_hook's first bucket and at a
checkpoint's load, every rank raises a ValueError naming the first field that differs and the ranks on each
side, before any gradient moves; ranks that agree pay one all-gather."""
from __future__ import annotations

import pytest

from tests import agreement_jobs as jobs
from tests.distributed import run_ranks

WORLDS = (2, 3)


def _split(world: int, base: str, odd: str) -> list[str]:
    """``odd`` on the last rank, ``base`` on the others."""
    return [base] * (world - 1) + [odd]


def _all_refuse(outcomes, *words):
    for rank, (kind, message) in enumerate(outcomes):
        assert kind == "ValueError", (rank, kind, message)
        for word in words:
            assert word in message, (rank, word, message)


@pytest.mark.parametrize("world, base, odd, field", [
    (2, "auto:allow=identity|fp16", "auto:allow=identity|bf16", "method"),     # replicas used to end different
    (3, "auto:allow=identity|fp16", "auto:allow=identity|bf16", "method"),
    (2, "auto:allow=identity|topk", "auto:allow=identity|randomk", "method"),  # used to hang until the timeout
    (3, "auto:allow=identity|fp16", "auto:allow=fp16|identity", "method"),     # used to abort in gloo
    (2, "auto:trials=2", "auto:trials=3", "method"),
    (3, "auto:probe_every=100", "auto:probe_every=50", "method"),
    (2, "topk:ratio=0.1", "topk:ratio=0.2", "method"),
    (3, "topk:ratio=0.1", "randomk:ratio=0.1", "method"),
])
def test_methods_that_differ_are_refused_on_every_rank(world, base, odd, field):
    outcomes = run_ranks(world, jobs.install_per_rank, _split(world, base, odd))
    _all_refuse(outcomes, f"disagree on {field}", base.split(":")[0], f"rank {world - 1} has", "Install the same method")
    assert odd.split("=")[-1] in outcomes[0][1]  # each side's value is shown, on every rank


@pytest.mark.parametrize("world", WORLDS)
def test_ranks_that_agree_train_alike(world):
    outcomes = run_ranks(world, jobs.install_per_rank, ["auto:allow=identity|fp16"] * world)
    assert all(kind == "ok" for kind, _ in outcomes), outcomes
    assert len({value for _, value in outcomes}) == 1


@pytest.mark.parametrize("world", WORLDS)
def test_parameters_that_differ_are_refused(world):
    outcomes = run_ranks(world, jobs.install_renamed_on, world - 1)
    _all_refuse(outcomes, "disagree on parameters", "item 0", "0.weight", "first.weight", "same model")


def test_dense_rules_that_differ_are_refused():
    outcomes = run_ranks(2, jobs.install_dense_per_rank, ["*.bias", None])
    _all_refuse(outcomes, "disagree on dense parameters", "0.bias", "none (no dense=)", "rank 1 has",
                "same dense= and dense_below= on every rank")


@pytest.mark.parametrize("world", WORLDS)
def test_comm_hook_over_another_group_than_ddp_is_refused(world):
    groups = [list(range(world - 1))] * (world - 1) + [[world - 1]]
    outcomes = run_ranks(world, jobs.comm_hook_groups, groups, True)
    _all_refuse(outcomes, "gcomp.comm_hook", "the DDP model's group has", "same ranks as DDP")


def test_comm_hook_over_a_group_it_cannot_check_warns():
    outcomes = run_ranks(2, jobs.comm_hook_groups, [[0, 1], [0, 1]], False)
    for kind, message in outcomes:
        assert kind == "warns" and "cannot check against the DDP model" in message and "model=ddp_model" in message


def test_comm_hook_on_a_rank_outside_its_group_is_refused_at_once():
    outcomes = run_ranks(3, jobs.comm_hook_not_member, [0, 1])
    assert outcomes[0][0] == outcomes[1][0] == "ok"
    kind, message = outcomes[2]
    assert kind == "ValueError" and "is not in process_group" in message and "global rank 2" in message


@pytest.mark.parametrize("world", WORLDS)
def test_checkpoints_of_different_steps_are_refused(world):
    outcomes = run_ranks(world, jobs.load_per_rank, world - 1)
    _all_refuse(outcomes, "gcomp checkpoint", "disagree on checkpoint", "step 3", "step 4", "Load the same checkpoint")


@pytest.mark.parametrize("world", WORLDS)
def test_a_load_refused_on_one_rank_is_refused_on_every_rank(world):
    outcomes = run_ranks(world, jobs.load_per_rank, -1, world - 1)
    # the refusing rank gives its own reason; the others say which rank refused, and why
    assert outcomes[-1][0] == "ValueError" and "checkpoint is for randomk" in outcomes[-1][1]
    for kind, message in outcomes[:-1]:
        assert kind == "ValueError" and "disagree on checkpoint" in message and "randomk" in message


@pytest.mark.parametrize("world", WORLDS)
def test_agree_names_the_first_differing_field_and_each_side(world):
    fields = [{"a": "same", "b": "x", "c": "y"}] * (world - 1) + [{"a": "same", "b": "z", "c": "w"}]
    outcomes = run_ranks(world, jobs.agree_fields, fields)
    ranks = ", ".join(map(str, range(world - 1)))
    _all_refuse(outcomes, "probe: the ranks disagree on b:", f"{'rank' if world == 2 else 'ranks'} {ranks} ha",
                f"rank {world - 1} has 'z'", "make b alike")


def test_agreement_costs_one_collective():
    assert run_ranks(2, jobs.collectives_of_agreeing_install) == [1, 1]
