"""Per-parameter control (``gcomp.dense``): parameters kept dense travel uncompressed, their gradients exactly
plain DDP's, for every registered method; buckets without any are untouched; resumes and the stats count them."""
from __future__ import annotations

import pytest
import torch

import gcomp
from gcomp.bucket import BucketInfo
from gcomp.dense import DenseRule, split_of
from tests import dense_jobs as jobs
from tests.distributed import run_ranks_once
from tests.models import mlp

BIAS_BYTES = (32 + 32 + 10) * 4  # mlp's biases, float32


def _every_method():
    return run_ranks_once("dense: every method", 2, jobs.every_method, dense=["*.bias"])


@pytest.mark.parametrize("name", gcomp.available())
def test_dense_parameters_get_plain_ddps_gradient_under_every_method(name):
    ranks = _every_method()
    got = ranks[0][name]
    assert got["dense"] == ["0.bias", "2.bias", "4.bias"]
    assert got["checked"] >= 3 and got["differ"] == [], got["differ"]
    assert ranks[1][name]["sum"] == got["sum"] and got["loss"] == got["loss"]  # replicas alike, loss finite
    stats = got["stats"]
    assert stats["dense_params"] == 3
    assert stats["dense_bytes"] == got["checked"] * BIAS_BYTES  # the warm-up's plain all-reduces not counted
    assert stats["bytes_sent"] > stats["dense_bytes"]


def test_dense_below_keeps_the_small_parameters_dense():
    got = run_ranks_once("dense: below", 2, jobs.train_dense, "topk", dense_below=40)[0]
    assert got["dense"] == ["0.bias", "2.bias", "4.bias"] and got["differ"] == [] and got["checked"] >= 3


def test_a_predicate_selects_by_name_and_parameter():
    got = run_ranks_once("dense: predicate", 2, jobs.train_dense, "auto",
                         dense=jobs.last_layer)[0]
    assert got["dense"] == ["4.bias", "4.weight"] and got["differ"] == []
    assert got["stats"]["dense_bytes"] == got["checked"] * (32 * 10 + 10) * 4


def test_buckets_without_dense_parameters_are_untouched():
    plain = run_ranks_once("dense: calls none", 2, jobs.method_calls)[0]
    only_last = run_ranks_once("dense: calls 4.*", 2, jobs.method_calls, dense="4.*")[0]
    mixed = run_ranks_once("dense: calls below", 2, jobs.method_calls, dense_below=40)[0]
    assert plain["allreduces"] == 3 and all(own for _, own in plain["calls"])
    # the bucket of 4.* alone is one plain all-reduce; the others reach the method as they are
    assert only_last["calls"] == [(("2.bias", "2.weight"), True), (("0.bias", "0.weight"), True)]
    assert only_last["allreduces"] == 3
    # each bucket: its bias in one all-reduce, its weight through the method: one more all-reduce per bucket
    assert [names for names, _ in mixed["calls"]] == [("4.weight",), ("2.weight",), ("0.weight",)]
    assert mixed["allreduces"] == 6


def test_a_resume_with_dense_parameters_equals_the_run_straight_through():
    got = run_ranks_once("dense: resume", 2, jobs.resumed_alike, ["topk", "powersgd", "dgc", "efsignsgd"])[0]
    for case, (same, straight_bytes, resumed_bytes, dense_params) in got.items():
        assert same, case
        assert straight_bytes == resumed_bytes > 0 and dense_params == 3, case


def test_the_split_of_a_layout():
    info = BucketInfo.from_layout(0, torch.float32, ["a", "b", "c", "d"], [2, 3, 4, 1])
    assert split_of(info, frozenset({"x"}), torch.device("cpu")) is None
    assert split_of(info, frozenset("abcd"), torch.device("cpu")).sub is None
    run = split_of(info, frozenset({"a", "d"}), torch.device("cpu"))  # b, c: one run of the buffer, a view
    assert run.sub.names == ("b", "c") and (run.start, run.stop) == (2, 9) and run.comp_index is None
    assert run.dense_index.tolist() == [0, 1, 9]
    mixed = split_of(info, frozenset({"b"}), torch.device("cpu"))  # a, c, d around b: a copy by positions
    assert mixed.sub.names == ("a", "c", "d") and mixed.sub.numel == 7
    assert mixed.comp_index.tolist() == [0, 1, 5, 6, 7, 8, 9] and mixed.dense_index.tolist() == [2, 3, 4]


def test_rules_select_by_pattern_predicate_and_size():
    named = list(mlp(0).named_parameters())
    assert DenseRule("2.*").select(named) == ("2.weight", "2.bias")
    assert DenseRule(["0.bias", "4.*"]).select(named) == ("0.bias", "4.weight", "4.bias")
    assert DenseRule(lambda n, p: p.dim() == 1).select(named) == ("0.bias", "2.bias", "4.bias")
    assert DenseRule(dense_below=400).select(named) == ("0.bias", "2.bias", "4.weight", "4.bias")
    assert DenseRule("0.bias", dense_below=20).select(named) == ("0.bias", "4.bias")
    with pytest.warns(UserWarning, match="keeps every parameter dense"):
        DenseRule("*").select(named)
    with pytest.warns(UserWarning, match="keeps no parameter of the model dense"):
        DenseRule(dense_below=2).select(named)


def test_a_load_keeps_this_runs_count_of_dense_parameters_and_warns_of_state_left_unused():
    for dense_params, said in run_ranks_once("dense: load", 2, jobs.loaded_without_a_rule):
        assert dense_params == 3
        assert len(said) == 1 and "the state saved for 3 parameter(s) this run keeps dense" in said[0], said
        assert "0.bias" in said[0] and "is not used" in said[0], said
