"""Hook state checkpoints: resuming in a fresh process group continues the very same trajectory."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import gcomp
from tests.distributed import run_ranks
from tests.models import batch, ddp, flat_params, mlp

WORLD = 2
FIRST, SECOND = 10, 10
METHOD, PARAMS = "topk", {"ratio": 0.05}
INT_STATS = ("steps", "buckets", "bytes_sent", "bytes_dense", "warmup_steps", "dense_buckets")


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(model: nn.Module, opt: torch.optim.Optimizer, start: int, steps: int) -> None:
    rank = dist.get_rank()
    for step in range(start, start + steps):
        x, y = batch(step, rank)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def _uninterrupted(steps: int) -> dict:
    model = ddp(mlp(0))
    state = gcomp.install(model, METHOD, **PARAMS)
    opt = _optimizer(model)
    _train(model, opt, 0, steps)
    return {"params": flat_params(model), "stats": dict(state.stats)}


def _train_and_save(path: str, steps: int) -> dict:
    model = ddp(mlp(0))
    state = gcomp.install(model, METHOD, **PARAMS)
    opt = _optimizer(model)
    _train(model, opt, 0, steps)
    path = path.format(rank=dist.get_rank())
    torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "gcomp": state.state_dict()},
               path)
    return {"params": flat_params(model), "path": path}


def _resume(path: str, start: int, steps: int, load_hook_state: bool = True) -> dict:
    checkpoint = torch.load(path.format(rank=dist.get_rank()), weights_only=True)
    net = mlp(seed=12345)  # different initial weights: everything must come from the checkpoint
    net.load_state_dict(checkpoint["model"])
    model = ddp(net)
    state = gcomp.install(model, METHOD, **PARAMS)
    if load_hook_state:
        state.load_state_dict(checkpoint["gcomp"])
    opt = _optimizer(model)
    opt.load_state_dict(checkpoint["optimizer"])
    _train(model, opt, start, steps)
    return {"params": flat_params(model), "stats": dict(state.stats)}


def _load_errors(steps: int) -> dict:
    model = ddp(mlp(0))
    state = gcomp.install(model, METHOD, **PARAMS)
    _train(model, _optimizer(model), 0, steps)
    saved = state.state_dict()
    errors = {}
    for label, name, params, sd in [
        ("other-method", "identity", {}, saved),
        ("other-params", METHOD, {"ratio": 0.1}, saved),
        ("not-a-state", METHOD, PARAMS, {"format": "something else"}),
        ("same", METHOD, PARAMS, saved),
    ]:
        target = gcomp.install(ddp(mlp(0)), name, **params)
        try:
            target.load_state_dict(sd)
        except Exception as err:  # noqa: BLE001 -- the test inspects it
            errors[label] = err
        else:
            errors[label] = None
    return errors


def _plain_values_only(value, where="state") -> None:
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, (str, int)), f"{where}: key {k!r}"
            _plain_values_only(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _plain_values_only(v, f"{where}[{i}]")
    else:
        assert value is None or isinstance(value, (torch.Tensor, bool, int, float, str)), \
            f"{where}: {type(value).__name__}"


def test_resume_in_a_fresh_process_group_is_bit_identical(tmp_path):
    path = str(tmp_path / "rank{rank}.pt")
    full = run_ranks(WORLD, _uninterrupted, FIRST + SECOND)
    saved = run_ranks(WORLD, _train_and_save, path, FIRST)
    resumed = run_ranks(WORLD, _resume, path, FIRST, SECOND, fresh=True)

    for r in range(WORLD):
        checkpoint = torch.load(saved[r]["path"], weights_only=True)  # tensors and plain values only
        _plain_values_only(checkpoint["gcomp"])
        residuals = checkpoint["gcomp"]["memory"]["residuals"]
        assert residuals and any(t.abs().sum() > 0 for t in residuals.values())  # there is state to carry
        assert checkpoint["optimizer"]["state"]  # momentum buffers too

        assert torch.equal(resumed[r]["params"], full[r]["params"]), f"rank {r} diverged after resuming"
        for key in INT_STATS:
            assert resumed[r]["stats"][key] == full[r]["stats"][key], key
    assert full[0]["stats"]["steps"] == FIRST + SECOND
    assert torch.equal(full[0]["params"], full[1]["params"])


def test_resume_without_the_hook_state_diverges(tmp_path):
    """The control for the test above: the hook state is what makes the resumed run identical."""
    path = str(tmp_path / "rank{rank}.pt")
    full = run_ranks(WORLD, _uninterrupted, FIRST + SECOND)
    run_ranks(WORLD, _train_and_save, path, FIRST)
    resumed = run_ranks(WORLD, _resume, path, FIRST, SECOND, load_hook_state=False)
    assert not torch.equal(resumed[0]["params"], full[0]["params"])


def test_load_state_dict_rejects_another_method_or_other_parameters():
    errors = run_ranks(WORLD, _load_errors, 3)[0]
    assert errors["same"] is None
    for label in ("other-method", "other-params", "not-a-state"):
        assert isinstance(errors[label], ValueError), (label, errors[label])
    assert "topk" in str(errors["other-method"]) and "identity" in str(errors["other-method"])
    assert "0.05" in str(errors["other-params"]) and "0.1" in str(errors["other-params"])
