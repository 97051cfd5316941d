"""Hook state checkpoints: resuming in a fresh process group continues the very same trajectory."""
from __future__ import annotations

import io

import pytest
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
        assert value is None or isinstance(value, (torch.Tensor, bool, int, float, str, bytes)), \
            f"{where}: {type(value).__name__}"


def test_resume_in_a_fresh_process_group_is_bit_identical(tmp_path):
    path = str(tmp_path / "rank{rank}.pt")
    full = run_ranks(WORLD, _uninterrupted, FIRST + SECOND)
    saved = run_ranks(WORLD, _train_and_save, path, FIRST)
    resumed = run_ranks(WORLD, _resume, path, FIRST, SECOND, fresh=True)

    for r in range(WORLD):
        checkpoint = torch.load(saved[r]["path"], weights_only=True)  # tensors and plain values only
        _plain_values_only(checkpoint["gcomp"])
        part = torch.load(io.BytesIO(checkpoint["gcomp"]["ranks"][f"rank{r}"]), weights_only=True)  # this rank's
        _plain_values_only(part)
        residuals = part["method"]["memory"]["residuals"]
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


# --- every rank's state is its own ----------------------------------------------------------------------------

def _residuals(state: dict, rank: int) -> dict:
    part = torch.load(io.BytesIO(state["ranks"][f"rank{rank}"]), weights_only=True)
    return part["method"]["memory"]["residuals"]


def _rank0_saves_for_everyone(name: str, params: dict) -> str:
    """The common pattern: rank 0's state_dict() broadcast (as if saved on rank 0 and read by all)."""
    model = ddp(mlp(0))
    state = gcomp.install(model, name, **params)
    _train(model, _optimizer(model), 0, 3)
    saved = [state.state_dict()]
    dist.broadcast_object_list(saved, src=0)
    try:
        gcomp.install(ddp(mlp(0)), name, **params).load_state_dict(saved[0])
    except ValueError as err:
        return str(err)
    return "loaded"


def test_another_ranks_state_is_refused_unless_the_state_is_the_same_everywhere():
    """Before: rank 1 silently took rank 0's residuals. Now a ValueError that says what to do; a method whose
    state is the same on every rank (here: none at all) loads quietly. Rank 0, whose own part it is, refuses too,
    naming rank 1's reason: no rank goes on alone."""
    topk = run_ranks(WORLD, _rank0_saves_for_everyone, "topk", {"ratio": 0.05})
    assert "the ranks disagree on load: rank 0 has 'loaded'; rank 1 has" in topk[0], topk[0]
    assert "not of rank 1" in topk[0] and "refused on every rank" in topk[0]
    assert "holds the state of rank0 of a 2-rank run, not of rank 1" in topk[1], topk[1]
    assert "gather_state_dict()" in topk[1] and "torch.distributed.checkpoint" in topk[1]
    assert run_ranks(WORLD, _rank0_saves_for_everyone, "signsgd", {}) == ["loaded", "loaded"]
    assert run_ranks(WORLD, _rank0_saves_for_everyone, "fp16", {}) == ["loaded", "loaded"]


def _gather_and_resume(path: str, steps: int) -> dict:
    model = ddp(mlp(0))
    state = gcomp.install(model, METHOD, **PARAMS)
    opt = _optimizer(model)
    _train(model, opt, 0, FIRST)
    gathered = state.gather_state_dict(dst=0)  # one file, on rank 0
    if dist.get_rank() == 0:
        torch.save({"gcomp": gathered, "model": model.module.state_dict(), "optimizer": opt.state_dict()}, path)
    else:
        assert gathered is None
    dist.barrier()
    saved = torch.load(path, weights_only=True)
    net = mlp(seed=12345)
    net.load_state_dict(saved["model"])
    resumed = ddp(net)
    gcomp.install(resumed, METHOD, **PARAMS).load_state_dict(saved["gcomp"])
    opt = _optimizer(resumed)
    opt.load_state_dict(saved["optimizer"])  # the same on every rank: DDP keeps replicas identical
    _train(resumed, opt, FIRST, steps)
    return {"params": flat_params(resumed)}


def test_one_gathered_file_resumes_every_rank_bit_identically(tmp_path):
    full = run_ranks(WORLD, _uninterrupted, FIRST + SECOND)
    resumed = run_ranks(WORLD, _gather_and_resume, str(tmp_path / "all.pt"), SECOND)
    for r in range(WORLD):
        assert torch.equal(resumed[r]["params"], full[r]["params"]), f"rank {r} diverged after resuming"


def _dcp_round_trip(path: str) -> dict:
    import torch.distributed.checkpoint as dcp

    model = ddp(mlp(0))
    state = gcomp.install(model, METHOD, **PARAMS)
    _train(model, _optimizer(model), 0, 5)
    before = state.state_dict()
    dcp.save({"gcomp": state}, checkpoint_id=path)
    fresh = gcomp.install(ddp(mlp(0)), METHOD, **PARAMS)
    dcp.load({"gcomp": fresh}, checkpoint_id=path)
    rank = dist.get_rank()
    mine, loaded = _residuals(before, rank), _residuals(fresh.state_dict(), rank)
    return {"same": all(torch.equal(mine[k], loaded[k]) for k in mine), "iteration": fresh.iteration,
            "total": sum(float(t.abs().sum()) for t in mine.values())}


def test_torch_distributed_checkpoint_keeps_every_ranks_own_state(tmp_path):
    """``dcp.save({"gcomp": hook_state})``: each rank's part is one bytes value under its own key, so DCP does
    not keep one copy of residuals it would take for replicated tensors."""
    ranks = run_ranks(WORLD, _dcp_round_trip, str(tmp_path / "dcp"))
    assert all(r["same"] and r["iteration"] == 5 for r in ranks), ranks
    assert ranks[0]["total"] != ranks[1]["total"]  # the ranks' residuals do differ: the check above meant it


def _dcp_save(path: str) -> None:
    import torch.distributed.checkpoint as dcp

    model = ddp(mlp(0))
    state = gcomp.install(model, METHOD, **PARAMS)
    _train(model, _optimizer(model), 0, 3)
    dcp.save({"gcomp": state}, checkpoint_id=path)


def _dcp_load(path: str) -> str:
    import torch.distributed.checkpoint as dcp

    try:
        dcp.load({"gcomp": gcomp.install(ddp(mlp(0)), METHOD, **PARAMS)}, checkpoint_id=path)
    except BaseException as err:  # noqa: BLE001 -- the test reads it (DCP's CheckpointException is a BaseException)
        return f"{type(err).__name__}: {err}"
    return "loaded"


def test_a_dcp_checkpoint_on_fewer_ranks_says_to_gather(tmp_path):
    """DCP stores each rank's own part: on fewer ranks the lost ranks' residuals are missing, and the error says
    which save can resume on another world size (before: "needs every rank's state" and DCP among the ways)."""
    run_ranks(3, _dcp_save, str(tmp_path / "dcp"))
    for message in run_ranks(2, _dcp_load, str(tmp_path / "dcp")):
        assert "saved at world size 3, this run has 2" in message and "gather_state_dict()" in message, message
        assert "torch.distributed.checkpoint and a file per rank hold each rank's own part" in message, message
    # on more ranks DCP's planner refuses before gcomp is asked (what docs/checkpoints-and-faults.md says it does)
    run_ranks(2, _dcp_save, str(tmp_path / "dcp2"))
    assert "gcomp.ranks.rank2" in run_ranks(3, _dcp_load, str(tmp_path / "dcp2"))[2]


def _save_gathered(path: str, name: str, params: dict) -> dict:
    model = ddp(mlp(0))
    state = gcomp.install(model, name, **params)
    _train(model, _optimizer(model), 0, 4)
    gathered = state.gather_state_dict()
    if dist.get_rank() == 0:
        torch.save(gathered, path)
    return {"world": dist.get_world_size()}


def _load_resized(path: str, name: str, params: dict) -> dict:
    state = gcomp.install(ddp(mlp(0)), name, **params)
    try:
        state.load_state_dict(torch.load(path, weights_only=True))
    except ValueError as err:
        return {"error": str(err)}
    return {"residuals": _residuals(state.state_dict(), dist.get_rank()), "iteration": state.iteration}


def _total(residual_sets) -> dict:
    total = {}
    for residuals in residual_sets:
        for k, t in residuals.items():
            total[k] = total.get(k, 0) + t.double()
    return total


@pytest.mark.parametrize("old, new", [(3, 2), (2, 3)])
def test_a_new_world_size_keeps_the_total_residual(tmp_path, old, new):
    """Error feedback across a resize: old rank j's residuals go to new rank j mod N, so the sum over ranks of
    every parameter's residual is the same before and after (a new rank without an old one starts at 0)."""
    path = str(tmp_path / "gathered.pt")
    run_ranks(old, _save_gathered, path, "topk", {"ratio": 0.05})
    saved = torch.load(path, weights_only=True)
    before = _total(_residuals(saved, r) for r in range(old))
    after_ranks = run_ranks(new, _load_resized, path, "topk", {"ratio": 0.05})
    after = _total(r["residuals"] for r in after_ranks)
    assert set(before) == set(after) and before
    for k in before:
        torch.testing.assert_close(after[k], before[k], rtol=1e-6, atol=1e-7)
    assert all(r["iteration"] == 4 for r in after_ranks)


def test_a_resize_is_refused_where_the_state_cannot_move(tmp_path):
    path = str(tmp_path / "gathered.pt")
    run_ranks(3, _save_gathered, path, "signum", {})
    for r in run_ranks(2, _load_resized, path, "signum", {}):
        for words in ("saved at world size 3, this run has 2: signum cannot move its state", "resume on 3 ranks",
                      "start signum's state afresh", "skip load_state_dict"):
            assert words in r["error"], r
    run_ranks(3, _save_gathered, path.replace(".pt", "-one.pt"), "topk", {"ratio": 0.05})
    one = torch.load(path.replace(".pt", "-one.pt"), weights_only=True)
    one["ranks"] = {"rank0": one["ranks"]["rank0"]}  # rank 0's state alone, as a rank-0-only save holds
    torch.save(one, path)
    for r in run_ranks(2, _load_resized, path, "topk", {"ratio": 0.05}):
        assert "saved at world size 3, this run has 2" in r["error"], r
        assert "resuming on 2 ranks needs every rank's state in one object" in r["error"], r
        assert "gather_state_dict()" in r["error"], r


RESIZE_REFUSED = {"signum", "prunex"}  # a momentum that is not additive; state on node leaders only


def _parameter_totals(method: gcomp.MethodUnit, parts: list) -> dict:
    total = {}
    for part in parts:
        for slot, tensors in method.parameter_state(part["method"]).items():
            for name, t in tensors.items():
                total[(slot, name)] = total.get((slot, name), 0) + t.double()
    return total


def _save_every_method(folder: str) -> None:
    for name in gcomp.available():
        _save_gathered(f"{folder}/{name}.pt", name, {})


def _load_every_method(folder: str) -> dict:
    out = {}
    for name in gcomp.available():
        state = gcomp.install(ddp(mlp(0)), name)
        try:
            state.load_state_dict(torch.load(f"{folder}/{name}.pt", weights_only=True))
        except ValueError as err:
            out[name] = str(err)
            continue
        mine = state.state_dict()["ranks"][f"rank{dist.get_rank()}"]
        out[name] = torch.load(io.BytesIO(mine), weights_only=True)
    return out


def test_every_method_resumes_on_fewer_ranks_or_says_it_cannot(tmp_path):
    """3 ranks save (gathered), 2 ranks load: each method either refuses with a clear error or carries on
    with the total of its per-parameter state (residuals, DGC's momentum and velocity, PowerSGD's errors)."""
    run_ranks(3, _save_every_method, str(tmp_path))
    loaded = run_ranks(2, _load_every_method, str(tmp_path))
    for name in gcomp.available():
        if name in RESIZE_REFUSED:
            assert all(f"saved at world size 3, this run has 2: {name} cannot move its state" in r[name]
                       for r in loaded), name
            continue
        assert all(isinstance(r[name], dict) for r in loaded), (name, [r[name] for r in loaded])
        method = gcomp.create(name)
        saved = torch.load(tmp_path / f"{name}.pt", weights_only=True)
        before = _parameter_totals(method, [torch.load(io.BytesIO(b), weights_only=True)
                                            for b in saved["ranks"].values()])
        after = _parameter_totals(method, [r[name] for r in loaded])
        assert set(before) == set(after), name
        for key in before:
            torch.testing.assert_close(after[key], before[key], rtol=1e-6, atol=1e-7, msg=f"{name} {key}")
