"""The DDP hook itself: bit-identity with plain DDP, install errors, warm-up and statistics, DDP options.

The generic per-method contracts live in tests/test_contracts.py; these are the hook's own promises.
"""
from __future__ import annotations

import contextlib
import inspect

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gcomp
from gcomp.collectives.sparse_wire import coded_bytes
from tests.distributed import run_ranks
from tests.models import SEVERAL_BUCKETS_MB, batch, ddp, flat_grads, flat_params, mlp, train

STEPS = 20
LR = 0.1

DDP_FLAGS = {
    "one-bucket": {},
    "several-buckets": {"bucket_cap_mb": SEVERAL_BUCKETS_MB},
    "static-graph": {"static_graph": True},
    "static-graph-several": {"static_graph": True, "bucket_cap_mb": SEVERAL_BUCKETS_MB},
}


# --------------------------------------------------------------------------------------------------- helpers

def record_buckets(state: gcomp.HookState) -> list[tuple[int, int, bool]]:
    """Log (index, numel, is_last) of every bucket the hook reduces, seen from outside the hook's own stats."""
    log = []
    original = state.reduce

    def reduce(bucket):
        log.append((bucket.index(), bucket.buffer().numel(), bucket.is_last()))
        return original(bucket)

    state.reduce = reduce
    return log


def per_step(log: list[tuple[int, int, bool]]) -> list[list[tuple[int, int]]]:
    """Split a bucket log into steps: each step is the list of (index, numel) it reduced."""
    steps, current = [], []
    for index, numel, last in log:
        current.append((index, numel))
        if last:
            steps.append(current)
            current = []
    assert not current, "a step ended without its last bucket"
    return steps


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_to_all",
                "all_to_all_single", "broadcast", "reduce_scatter", "reduce_scatter_tensor", "reduce", "gather",
                "scatter", "barrier")


@contextlib.contextmanager
def record_groups():
    """Yield a list that collects the ``group`` argument of every ``torch.distributed`` collective called."""
    seen, saved = [], {}
    for name in _COLLECTIVES:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn
        signature = inspect.signature(fn)

        def wrapper(*args, __fn=fn, __sig=signature, **kwargs):
            bound = __sig.bind(*args, **kwargs)
            seen.append(bound.arguments.get("group"))
            return __fn(*args, **kwargs)

        setattr(dist, name, wrapper)
    try:
        yield seen
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def topk_bytes(numel: int, ratio: float) -> int:
    k = max(1, int(ratio * numel))
    return k * 4 + coded_bytes(numel, k)  # fp32 values + the positions' code (topk's default)


# ------------------------------------------------------------------------------------------------------ jobs

def _identity_vs_plain(ddp_kwargs: dict, steps: int, group: str = "default") -> dict:
    plain = ddp(mlp(0), **ddp_kwargs)
    train(plain, steps, lr=LR)
    hooked = ddp(mlp(0), **ddp_kwargs)
    pg = dist.new_group(list(range(dist.get_world_size()))) if group == "new" else None
    state = gcomp.install(hooked, "identity", process_group=pg)
    log = record_buckets(state)
    with record_groups() as groups:
        train(hooked, steps, lr=LR)
    out = {"plain": flat_params(plain), "hooked": flat_params(hooked), "steps": per_step(log),
           "uses_group": bool(groups) and all(g is pg for g in groups) if pg is not None else None,
           "stats": dict(state.stats)}
    if pg is not None:
        dist.destroy_process_group(pg)
    return out


def _install_errors() -> dict:
    model = ddp(mlp(0))
    errors = {}

    def attempt(label, *args, **kwargs):
        try:
            gcomp.install(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 -- the test inspects it
            errors[label] = err
        else:
            errors[label] = None

    attempt("unknown", model, "topkk")
    attempt("method+params", model, gcomp.create("topk", ratio=0.1), ratio=0.2)
    attempt("bad-type", model, 3)
    attempt("bad-param", model, "topk", ratio=1.5)
    # None of the failures above may have registered anything: a correct install still works...
    state = gcomp.install(model, gcomp.create("identity"))
    # ... once.
    attempt("twice", model, "identity")
    attempt("twice-other", model, "topk")
    # A DDP model that already carries somebody else's hook.
    other = ddp(mlp(0))
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    other.register_comm_hook(None, allreduce_hook)
    attempt("foreign-hook", other, "identity")
    train(model, 2, lr=LR)
    return {"errors": errors, "steps": state.stats["steps"]}


def _warmup_and_stats(name: str, params: dict, ddp_kwargs: dict, steps: int) -> dict:
    """Train a hooked model and, in lockstep, plain DDP at the same parameters: per-step grads of both."""
    hooked = ddp(mlp(0), **ddp_kwargs)
    plain = ddp(mlp(0), **ddp_kwargs)
    state = gcomp.install(hooked, name, **params)
    warmup = state.warmup
    log = record_buckets(state)
    rank = dist.get_rank()
    grads = []
    for step in range(steps):
        with torch.no_grad():
            for p, q in zip(plain.parameters(), hooked.parameters()):
                p.copy_(q)
        pair = []
        for model in (hooked, plain):
            model.zero_grad(set_to_none=True)
            x, y = batch(step, rank)
            nn.functional.cross_entropy(model(x), y).backward()
            pair.append(flat_grads(model))
        grads.append(pair)
        with torch.no_grad():
            for p in hooked.parameters():
                p.sub_(LR * p.grad)
    return {"stats": dict(state.stats), "warmup": warmup, "steps": per_step(log), "grads": grads,
            "params": flat_params(hooked)}


def _topk_trajectory(ddp_kwargs: dict, steps: int, group: str = "default") -> dict:
    model = ddp(mlp(0), **ddp_kwargs)
    pg = dist.new_group(list(range(dist.get_world_size()))) if group == "new" else None
    state = gcomp.install(model, "topk", process_group=pg, ratio=0.05)
    with record_groups() as groups:
        train(model, steps, lr=LR)
    # every collective of the hook ran on ``pg`` (DDP itself calls none once the model is built)
    out = {"params": flat_params(model), "stats": dict(state.stats),
           "uses_group": bool(groups) and all(g is pg for g in groups) if pg is not None else None}
    if pg is not None:
        dist.destroy_process_group(pg)
    return out


def _ddp_group_is_default(steps: int) -> dict:
    """DDP built on a new group, install without process_group: the hook takes DDP's group."""
    pg = dist.new_group(list(range(dist.get_world_size())))
    model = ddp(mlp(0), process_group=pg)
    state = gcomp.install(model, "identity")
    train(model, steps, lr=LR)
    out = {"params": flat_params(model), "uses_group": state.group is pg}
    dist.destroy_process_group(pg)
    return out


# ----------------------------------------------------------------------------------------------------- tests

@pytest.mark.parametrize("flags", list(DDP_FLAGS), ids=list(DDP_FLAGS))
@pytest.mark.parametrize("world", [2, 3])
def test_identity_is_bit_identical_to_plain_ddp(world, flags):
    results = run_ranks(world, _identity_vs_plain, DDP_FLAGS[flags], STEPS)
    for r in results:
        assert torch.equal(r["hooked"], r["plain"]), f"identity differs from plain DDP ({flags}, {world} ranks)"
        assert r["stats"]["steps"] == STEPS
        assert len(r["steps"]) == STEPS
    # Replicas agree, and the several-bucket variants really ran with several buckets after the rebuild.
    for r in results[1:]:
        assert torch.equal(r["hooked"], results[0]["hooked"])
    buckets_last_step = len(results[0]["steps"][-1])
    if "several" in flags:
        assert buckets_last_step >= 2
    else:
        assert buckets_last_step == 1


def test_install_rejects_a_model_that_is_not_ddp():
    model = mlp(0)
    with pytest.raises(TypeError, match="DistributedDataParallel") as err:
        gcomp.install(model, "identity")
    assert "Sequential" in str(err.value)  # names what it got
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        gcomp.install(model, "topk", ratio=0.1)


def test_install_errors_on_a_ddp_model():
    result, _ = run_ranks(2, _install_errors)
    errors = result["errors"]

    unknown = errors["unknown"]
    assert isinstance(unknown, gcomp.UnknownMethodError) and isinstance(unknown, ValueError)
    assert "topkk" in str(unknown) and "'topk'" in str(unknown)

    assert isinstance(errors["method+params"], ValueError)
    assert "ratio" in str(errors["method+params"]) and "gcomp.create" in str(errors["method+params"])
    assert isinstance(errors["bad-type"], TypeError)
    assert isinstance(errors["bad-param"], ValueError)
    assert "ratio" in str(errors["bad-param"]) and "1.5" in str(errors["bad-param"])

    for label in ("twice", "twice-other", "foreign-hook"):
        assert isinstance(errors[label], RuntimeError), (label, errors[label])
    assert "already installed" in str(errors["twice"])
    assert "identity" in str(errors["twice"])  # names the hook that is in place
    assert result["steps"] == 2  # the hook installed after the failures works


def _install_on_another_group() -> str:
    other = dist.new_group([0, 1])  # every rank makes it; rank 2 is not in it
    try:
        gcomp.install(ddp(mlp(0)), "topk", process_group=other)
    except ValueError as err:
        return str(err)
    finally:
        if dist.get_rank() < 2:
            dist.destroy_process_group(other)
    return "installed"


def test_install_refuses_a_group_other_than_ddps():
    """The hook reducing over other ranks than DDP's would let replicas diverge in silence (before: divergence,
    or an AttributeError at the first backward on a rank outside the group)."""
    messages = run_ranks(3, _install_on_another_group)
    for message in messages[:2]:
        assert "process_group has 2 ranks [0, 1] but the DDP model's group has 3 [0, 1, 2]" in message, message
    assert "(global rank 2) is not in process_group" in messages[2] and "has 3 ranks" in messages[2], messages[2]


def _install_on_a_compiled_model() -> bool:
    model = ddp(mlp(0))
    state = gcomp.install(torch.compile(model), "topk", ratio=0.5)  # compiles nothing until the first call
    return model._gcomp_state is state


def test_install_unwraps_a_compiled_ddp_model():
    assert run_ranks(1, _install_on_a_compiled_model) == [True]


WARMUP_CASES = {
    # name, params, ddp flags, expected warm-up steps
    "topk": ("topk", {"ratio": 0.05}, {}, 1),
    "topk-static-graph": ("topk", {"ratio": 0.05}, {"static_graph": True}, 2),
    "topk-several-buckets": ("topk", {"ratio": 0.05}, {"bucket_cap_mb": SEVERAL_BUCKETS_MB}, 1),
    "identity-static-graph": ("identity", {}, {"static_graph": True}, 0),
    "identity": ("identity", {}, {}, 0),
}


@pytest.mark.parametrize("case", list(WARMUP_CASES), ids=list(WARMUP_CASES))
def test_warmup_and_stats(case):
    name, params, flags, warmup = WARMUP_CASES[case]
    steps = 4
    world = 2
    results = run_ranks(world, _warmup_and_stats, name, params, flags, steps)
    for r in results:
        stats = r["stats"]
        assert {"steps", "bytes_sent", "bytes_dense", "encode_s", "decode_s", "warmup_steps",
                "dense_buckets"} <= set(stats)
        assert r["warmup"] == warmup
        assert stats["steps"] == steps == len(r["steps"])
        assert stats["warmup_steps"] == warmup
        assert stats["dense_buckets"] == sum(len(s) for s in r["steps"][:warmup])
        assert stats["buckets"] == sum(len(s) for s in r["steps"])
        assert isinstance(stats["encode_s"], float) and isinstance(stats["decode_s"], float)
        assert stats["encode_s"] > 0 and stats["decode_s"] > 0  # steps after the warm-up were encoded

        numels = [[n for _, n in s] for s in r["steps"]]
        assert stats["bytes_dense"] == 4 * sum(map(sum, numels))
        if name == "identity":
            assert stats["bytes_sent"] == stats["bytes_dense"]
        else:
            ratio = params["ratio"]
            expected = 4 * sum(map(sum, numels[:warmup]))
            expected += sum(topk_bytes(n, ratio) for s in numels[warmup:] for n in s)
            assert stats["bytes_sent"] == expected
            assert stats["bytes_sent"] < stats["bytes_dense"]

        for step, (hooked, plain) in enumerate(r["grads"]):
            if step < warmup or name == "identity":
                # plain all-reduce: exactly what DDP without a hook computes at the same parameters
                assert torch.equal(hooked, plain), f"step {step} should be a plain all-reduce"
            else:
                sent = sum(max(1, int(params["ratio"] * n)) for n in numels[step])
                nonzero = int((hooked != 0).sum())
                assert 0 < nonzero <= world * sent, f"step {step}: {nonzero} nonzero, at most {world * sent}"
                assert not torch.equal(hooked, plain)
    for r in results[1:]:
        assert torch.equal(r["params"], results[0]["params"])
        for (a, _), (b, _) in zip(r["grads"], results[0]["grads"]):
            assert torch.equal(a, b)
    if "several" in case:
        assert len(results[0]["steps"][-1]) >= 2


def _lowprec_bytes(name: str, steps: int) -> dict:
    model = ddp(mlp(0), bucket_cap_mb=SEVERAL_BUCKETS_MB)
    state = gcomp.install(model, name)
    train(model, steps, lr=LR)
    return {"stats": dict(state.stats), "warmup": state.warmup}


@pytest.mark.parametrize("name", ["fp16", "bf16"])
def test_lowprec_sends_half_the_dense_bytes(name):
    for r in run_ranks(2, _lowprec_bytes, name, 3):
        stats = r["stats"]
        assert r["warmup"] == 0 and stats["warmup_steps"] == 0 and stats["dense_buckets"] == 0
        assert stats["steps"] == 3
        assert stats["bytes_dense"] > 0
        assert 2 * stats["bytes_sent"] == stats["bytes_dense"]


@pytest.mark.parametrize("flags", ["one-bucket", "several-buckets"])
def test_gradient_as_bucket_view(flags):
    kwargs = dict(DDP_FLAGS[flags], gradient_as_bucket_view=True)
    results = run_ranks(2, _identity_vs_plain, kwargs, STEPS)
    for r in results:
        assert torch.equal(r["hooked"], r["plain"])
    if "several" in flags:
        assert len(results[0]["steps"][-1]) >= 2

    viewed = run_ranks(2, _topk_trajectory, kwargs, STEPS)
    copied = run_ranks(2, _topk_trajectory, DDP_FLAGS[flags], STEPS)
    assert torch.equal(viewed[1]["params"], viewed[0]["params"])  # replicas identical
    for v, c in zip(viewed, copied):
        # the bucket view changes where DDP keeps the gradients, not what the method computes
        assert torch.equal(v["params"], c["params"])
        assert v["stats"]["bytes_sent"] == c["stats"]["bytes_sent"]
    assert not torch.equal(viewed[0]["params"], results[0]["plain"])  # and topk is not plain all-reduce


@pytest.mark.parametrize("world", [2, 3])
def test_process_group_argument(world):
    flags = DDP_FLAGS["several-buckets"]
    for r in run_ranks(world, _identity_vs_plain, flags, STEPS, group="new"):
        assert r["uses_group"]
        assert torch.equal(r["hooked"], r["plain"])
    own = run_ranks(world, _topk_trajectory, flags, STEPS, group="new")
    default = run_ranks(world, _topk_trajectory, flags, STEPS)
    for o, d in zip(own, default):
        assert o["uses_group"]
        assert torch.equal(o["params"], d["params"])
        assert o["stats"]["bytes_sent"] == d["stats"]["bytes_sent"]
    for o in own[1:]:
        assert torch.equal(o["params"], own[0]["params"])


def test_hook_defaults_to_the_ddp_models_group():
    results = run_ranks(2, _ddp_group_is_default, 5)
    for r in results:
        assert r["uses_group"]
    assert torch.equal(results[0]["params"], results[1]["params"])
