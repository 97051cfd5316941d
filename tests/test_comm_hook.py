"""``gcomp.comm_hook``: a hook and its state that need no model (what Lightning's ``DDPStrategy`` takes), and
``install(..., if_distributed=True)`` for scripts that also run on one process."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gcomp
from gcomp.run_state import STAT_KEYS
from tests.distributed import run_ranks
from tests.models import SEVERAL_BUCKETS_MB, ddp, flat_params, mlp, train

STEPS, SPLIT = 6, 3
LR = 0.1


def _topk(model, **kwargs):
    state, hook = gcomp.comm_hook("topk", ratio=0.05, **kwargs)
    model.register_comm_hook(state, hook)
    return state


def _without_a_model() -> dict:
    """Installed, registered by hand without a model, and resumed from a checkpoint of the latter: topk."""
    installed = ddp(mlp(0), bucket_cap_mb=SEVERAL_BUCKETS_MB)
    gcomp.install(installed, "topk", ratio=0.05)
    train(installed, STEPS, lr=LR)

    plain = ddp(mlp(0), bucket_cap_mb=SEVERAL_BUCKETS_MB)
    state = _topk(plain)
    train(plain, STEPS, lr=LR)

    # resumed runs repeat a trajectory exactly where DDP's bucket layout is the same before and after: one bucket
    whole = ddp(mlp(0))
    _topk(whole)
    train(whole, STEPS, lr=LR)
    first = ddp(mlp(0))
    before = _topk(first)
    train(first, SPLIT, lr=LR)
    saved, params = before.state_dict(), first.module.state_dict()
    second_model = mlp(1)
    second_model.load_state_dict(params)
    second = ddp(second_model)
    after, hook = gcomp.comm_hook("topk", ratio=0.05)
    after.load_state_dict(saved)  # before its first step: names are checked at the end of that step
    second.register_comm_hook(after, hook)
    train(second, STEPS - SPLIT, start=SPLIT, lr=LR)

    errors = {}
    other = ddp(mlp(2), bucket_cap_mb=SEVERAL_BUCKETS_MB)
    other.register_comm_hook(state, gcomp.hook.gcomp_hook)  # the first model's state, again
    try:
        train(other, 1, lr=LR)
    except RuntimeError as err:
        errors["second model"] = str(err)
    try:
        state.bind(plain)
    except RuntimeError as err:
        errors["late bind"] = str(err)
    return {"installed": flat_params(installed), "plain": flat_params(plain), "resumed": flat_params(second),
            "whole": flat_params(whole),
            "names": sorted(state._names.values()), "stats": dict(state.stats),
            "errors": errors}


def _wrong_names_on_resume() -> str:
    """A checkpoint keyed by name (install) loaded into a state keyed by place: caught at the first step."""
    model = ddp(mlp(0))
    state = gcomp.install(model, "topk", ratio=0.05)
    train(model, 2, lr=LR)
    saved = state.state_dict()
    fresh = ddp(mlp(0))
    placed = _topk(fresh)
    placed.load_state_dict(saved)
    try:
        train(fresh, 1, lr=LR)
    except (RuntimeError, ValueError) as err:
        return str(err)
    return "no error"


@pytest.fixture(scope="module")
def without_a_model():
    return run_ranks(3, _without_a_model)


def test_a_hook_registered_without_a_model_trains_as_install_does(without_a_model):
    for r in without_a_model:
        assert torch.equal(r["plain"], r["installed"])
        assert r["stats"]["bytes_sent"] < r["stats"]["bytes_dense"]
        assert r["stats"]["steps"] == STEPS
        assert r["names"] and all(n.startswith("bucket") for n in r["names"]), r["names"]
    assert torch.equal(without_a_model[0]["plain"], without_a_model[2]["plain"])


def test_its_checkpoint_resumes_bit_identically_without_a_model(without_a_model):
    for r in without_a_model:
        assert torch.equal(r["resumed"], r["whole"]), "resumed run left the uninterrupted trajectory"


def test_one_state_serves_one_model_and_binds_before_its_first_step(without_a_model):
    for r in without_a_model:
        assert "one state serves one DDP model" in r["errors"]["second model"]
        assert "before the first step" in r["errors"]["late bind"]


def test_a_checkpoint_keyed_by_name_is_refused_by_a_state_keyed_by_place():
    for message in run_ranks(2, _wrong_names_on_resume):
        assert "the model has no such parameter" in message, message


def test_comm_hook_needs_no_process_group_and_validates_at_once():
    assert not dist.is_initialized()
    state, hook = gcomp.comm_hook("topk", ratio=0.05)
    assert state.method.name == "topk" and hook is gcomp.hook.gcomp_hook
    with pytest.raises(ValueError, match="ratio"):
        gcomp.comm_hook("topk", ratio=2.0)
    with pytest.raises(gcomp.UnknownMethodError):
        gcomp.comm_hook("topkk")
    with pytest.raises(RuntimeError, match="init_process_group first"):
        state.state_dict()
    with pytest.raises(TypeError, match="torch.nn.Module"):
        state.bind("model")


def test_install_on_one_process_without_ddp_is_a_no_op_only_when_asked(caplog):
    model = nn.Linear(4, 2)
    with pytest.raises(TypeError, match="if_distributed=True"):
        gcomp.install(model, "topk", ratio=0.05)
    with caplog.at_level(logging.INFO, logger="gcomp"):
        state = gcomp.install(model, "topk", if_distributed=True, ratio=0.05)
    assert isinstance(state, gcomp.NotDistributed) and not state.distributed
    assert state.stats["bytes_sent"] == state.stats["steps"] == 0 and state.compression_ratio == 1.0
    assert sorted(state.stats) == sorted(STAT_KEYS)
    assert str(state) == "gcomp: not distributed: nothing compressed (topk; one process, Linear is not " \
                         "DistributedDataParallel)"
    assert state.state_dict() == {}
    with pytest.raises(ValueError, match="as many processes as saved it"):
        state.load_state_dict({"ranks": {}})
    assert [r.message for r in caplog.records if r.name == "gcomp"] == [
        "gcomp.install: one process and no DistributedDataParallel model (Linear): nothing to compress, no hook "
        "installed"]
    with pytest.raises(ValueError, match="ratio"):
        gcomp.install(model, "topk", if_distributed=True, ratio=2.0)


def test_install_under_a_launcher_without_a_process_group_names_init_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun started 2, the script set up no process group
    with pytest.raises(TypeError, match=r"2 processes were launched, WORLD_SIZE=2, and no process group is set up: "
                                        r"torch.distributed.init_process_group first"):
        gcomp.install(nn.Linear(4, 2), "topk", if_distributed=True, ratio=0.05)


def _pactrain_with_and_without_a_model() -> dict:
    import warnings

    from gcomp.pruning import prune

    out = {}
    for bound in (True, False):
        net = mlp(0)
        prune(net, ratio=0.5, method="magnitude")
        model = ddp(net)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, hook = gcomp.comm_hook("pactrain", stable_steps=1, model=net if bound else None)
            model.register_comm_hook(state, hook)
            train(model, 4, lr=LR)
        out[bound] = {"packed": state.stats["packed_buckets"],
                      "warned": [str(w.message) for w in caught if "knows no model" in str(w.message)]}
    return out


def test_pactrain_sees_its_masks_through_a_bound_model_and_warns_without_one():
    for r in run_ranks(2, _pactrain_with_and_without_a_model):
        assert r[True]["packed"] > 0 and not r[True]["warned"]
        assert r[False]["packed"] == 0 and len(r[False]["warned"]) == 1, r[False]
