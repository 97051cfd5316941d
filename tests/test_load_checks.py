"""A checkpoint whose per-rank part does not fit the live model is refused at ``load_state_dict`` with a
ValueError naming the part and both sizes (issue 28), never a raw torch RuntimeError at the first step (or a
state quietly dropped there): generator states, ternary residuals and carried scales, PowerSGD's queries and
errors, SparDL's budgets, the saved layouts. And a hook state bound to one model and registered on another says
so, instead of "the residuals of parameter '<unnamed 0>' hold 640 elements"."""
from __future__ import annotations

import pytest
import torch

from gcomp.bucket import BucketInfo
from gcomp.bucket_state import BucketState
from tests import load_check_jobs as jobs
from tests.distributed import run_ranks_once

# (label, words the ValueError must hold)
CASES = [
    ("pactrain: a generator state of the wrong size", ["pactrain", "generator state for device 'cpu'", "100 bytes",
                                                       "5056"]),
    ("terngrad: a generator state that is not uint8", ["terngrad", "1-D torch.uint8", "torch.float32"]),
    ("dgc: a generator state of the wrong size", ["dgc", "generator state", "100 bytes", "5056"]),
    ("randomk: a generator state of the wrong size", ["randomk", "generator state", "100 bytes", "5056"]),
    ("powersgd: a generator state of the wrong size", ["powersgd", "generator state", "100 bytes", "5056"]),
    ("powersgd: a query of the wrong shape", ["'queries' of parameter '2.weight'", "(16, 2)", "(32, 1)"]),
    ("powersgd: an error of the wrong shape", ["'errors' of parameter '2.weight'", "(1024,)", "(32, 32)"]),
    ("pactrain: a ternary residual of the wrong size", ["tracker entry", "parameters 4.bias, 4.weight", "'residual'",
                                                        "holds 7 entries", "its support keeps"]),
    ("pactrain: a ternary residual of the wrong dtype", ["'residual' must be a 1-D torch.float32", "torch.float64"]),
    ("pactrain: carried exponents of the wrong size", ["'exponents' holds 9 entries", "one per parameter",
                                                       "which has 6"]),
    # an older checkpoint records no names: the live layout checks the exponents when it takes them up
    ("pactrain: carried exponents of the wrong size, no names saved", ["'exponents' holds 9 entries", "which has 6",
                                                                       "the checkpoint is of another model"]),
    ("spardl: a union of two entries", ["spardl budget", "'union' must be one integer", "2 entries"]),
    ("layouts: not a list of layouts", ["'layouts'[0]", "'index'", "'names'"]),
    ("comm_hook: a state bound to another model", ["bound to another model", "One state serves one DDP model",
                                                   "model=ddp_model", "state.bind(ddp_model)"]),
]


@pytest.mark.parametrize("label, words", CASES, ids=[row[0] for row in CASES])
def test_a_part_that_does_not_fit_is_refused_at_load(label, words):
    outcome, message = run_ranks_once("load-checks", 1, jobs.load_cases)[0][label]
    assert outcome == "ValueError", (label, outcome, message)
    for word in words:
        assert word in message, f"{word!r} not in: {message}"


def test_every_case_runs():
    assert {label for label, _ in CASES} == set(run_ranks_once("load-checks", 1, jobs.load_cases)[0])


def test_residuals_made_for_another_model_name_the_cause():
    """A state's pieces that do not fit the bucket they are taken up by (a checkpoint of another model loaded
    into a state that knows no model): the message says why and what to do."""
    state = BucketState(("residuals",), owner="ResidualMemory")
    state.load_state_dict({"residuals": {"bucket0.param0": torch.zeros(640)}})
    bucket = BucketInfo.from_layout(0, torch.float32, ["bucket0.param0"], [10])
    with pytest.raises(ValueError) as err:
        state.get(bucket, torch.zeros(10))
    for word in ("hold 640 elements", "holds 10", "made for another model", "One state serves one DDP model"):
        assert word in str(err.value), str(err.value)
