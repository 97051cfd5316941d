"""The contracts of docs/design.md, run against every registered method (``gcomp.available()``).

A method registered later (a new compressor file, an entry point) is picked up here without editing this
file. Multi-process checks run on 1-4 gloo ranks through ``tests.distributed.run_ranks_once``; each rank job
covers several configurations at once (see tests/contracts_jobs.py) and the tests below read their own
configuration from a per-session cache, so a failure names the exact method and configuration.

1. shape / dtype / device kept, result = mean over ranks      test_reduce_*
2. replicas identical after DDP training                       test_training_*
3. all-reduce codecs are homomorphic (hypothesis, 1-8 ranks)   test_allreduce_homomorphism
4. lossless methods equal the dense all-reduce                 test_lossless_*
5. error-feedback conservation                                 test_error_feedback_conservation
6. non-finite values surface on every rank                     test_nonfinite_surfaces_on_every_rank
7. state_dict round trip                                       test_state_dict_resume_is_bit_identical
8. bad configuration fails early and clearly                   test_bad_parameter_*, test_unknown_*
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gcomp
from gcomp.params import OneOf, Range
from tests import contracts_jobs as jobs
from tests.distributed import run_ranks_once

METHODS = gcomp.available()
WORLDS = (1, 2, 3, 4)


def _method(name: str) -> gcomp.Method:
    return gcomp.create(name)


ALLREDUCE_METHODS = [m for m in METHODS if _method(m).compressor.collective == gcomp.ALLREDUCE]
LOSSLESS_METHODS = [m for m in METHODS if _method(m).compressor.lossless]
ERROR_FEEDBACK_METHODS = [m for m in METHODS if _method(m).memory.stateful]


def _reduce_results(name: str, world: int) -> list[dict]:
    return run_ranks_once(("reduce", name, world), world, jobs.job_reduce, name)


TRAIN_CONFIGS = [(several, static) for several in (False, True) for static in (False, True)]


def _train_results(name: str, world: int) -> list[dict]:
    return run_ranks_once(("train", name, world), world, jobs.job_train, name, TRAIN_CONFIGS,
                   reference=name in LOSSLESS_METHODS)


def _params(names, *axes):
    """pytest params over the product of ``names`` and ``axes`` (each a list of (id, value)), readable ids."""
    combos = [((name,), name) for name in names]
    for axis in axes:
        combos = [(values + (value,), f"{label}-{part}") for values, label in combos for part, value in axis]
    return [pytest.param(*values, id=label) for values, label in combos]


WORLD_AXIS = [(f"ws{w}", w) for w in WORLDS]
LAYOUT_AXIS = [(layout, layout) for layout in jobs.LAYOUTS]
PATH_AXIS = [(path, path) for path in jobs.PATHS]
BUCKETS_AXIS = [("one", False), ("several", True)]
STATIC_AXIS = [("dynamic", False), ("static", True)]


def _assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    message = jobs.mismatch(actual, expected, bound, what)
    assert message is None, message


# --- contract 1 (and 4 with fake buckets): shape, dtype, device, mean --------------------------------------------

@pytest.mark.parametrize("name, world, layout, path", _params(METHODS, WORLD_AXIS, LAYOUT_AXIS, PATH_AXIS))
def test_reduce_keeps_bucket_and_returns_the_mean(name, world, layout, path):
    """Fake buckets fed to ``HookState.reduce`` on ``world`` ranks, 3 steps, fp32, fp64, fp16 and bf16 buckets.

    Every rank's result has the bucket's shape, dtype and device, and is the same on every rank. Warm-up
    path: a dense all-reduce, so the mean of the buckets. Compressing path: the mean over ranks of what each
    rank sent (its payload decoded locally), for methods whose result is that sum (``decodes_alone``; PowerSGD
    and majority votes are checked by their own tests). Both within the rounding of the wire dtype.
    """
    ranks = _reduce_results(name, world)
    for dtype in jobs.DTYPES:
        key = (path, layout, str(dtype).removeprefix("torch."))
        for step, buckets in enumerate(ranks[0][key]):
            for index, report in enumerate(buckets):
                where = f"{key} step {step} bucket {index}"
                for rank, r in enumerate(ranks):
                    mine = r[key][step][index]
                    assert (mine["shape"], mine["dtype"], mine["device"]) == mine["bucket"], (
                        f"{where}: rank {rank} got shape, dtype, device {mine['shape'], mine['dtype'], mine['device']}"
                        f" for a bucket of {mine['bucket']}")
                assert not report["differ"], f"{where}: ranks {report['differ']} got another result than rank 0"
                if path == "warmup":
                    assert report["dense"] is None, report["dense"]
                elif _method(name).compressor.decodes_alone:
                    assert report["mean"] is None, report["mean"]


@pytest.mark.parametrize("name, world, layout", _params(LOSSLESS_METHODS, WORLD_AXIS, LAYOUT_AXIS))
def test_lossless_reduce_is_the_dense_mean(name, world, layout):
    ranks = _reduce_results(name, world)
    for dtype in jobs.DTYPES:
        for buckets in ranks[0][("compress", layout, str(dtype).removeprefix("torch."))]:
            for report in buckets:
                assert report["dense"] is None, report["dense"]


# --- contract 6: non-finite values surface everywhere ------------------------------------------------------------

@pytest.mark.parametrize("name, world, path, kind",
                         _params(METHODS, WORLD_AXIS, PATH_AXIS, [(k, k) for k in jobs.NONFINITE]))
def test_nonfinite_surfaces_on_every_rank(name, world, path, kind):
    """The last rank's bucket holds one NaN (or +inf); every rank's result must hold a non-finite value."""
    ranks = _reduce_results(name, world)
    for rank, r in enumerate(ranks):
        assert not r[("nonfinite", path, kind)], f"rank {rank}: a {kind} in rank {world - 1}'s bucket vanished"


# --- contract 2 (and 4 in DDP): replicas identical after training ------------------------------------------------

@pytest.mark.parametrize("name, world, several, static", _params(METHODS, WORLD_AXIS, BUCKETS_AXIS, STATIC_AXIS))
def test_training_keeps_replicas_identical(name, world, several, static):
    ranks = _train_results(name, world)
    runs = [r[(several, static)] for r in ranks]
    for rank, run in enumerate(runs):
        assert torch.equal(run["params"], runs[0]["params"]), f"rank {rank}'s parameters differ from rank 0's"
        assert torch.isfinite(run["params"]).all() and torch.isfinite(run["losses"]).all()
    assert not torch.equal(runs[0]["params"], runs[0]["init"]), "training did not change the parameters"


@pytest.mark.parametrize("name, world, several, static", _params(METHODS, WORLD_AXIS, BUCKETS_AXIS, STATIC_AXIS))
def test_training_stats(name, world, several, static):
    ranks = _train_results(name, world)
    method = _method(name)
    numel = sum(p.numel() for p in jobs.models.mlp().parameters())
    steps = jobs.TRAIN_STEPS
    for rank, r in enumerate(ranks):
        stats = r[(several, static)]["stats"]
        assert stats["steps"] == steps, f"rank {rank}: {stats}"
        assert stats["bytes_sent"] > 0, f"rank {rank}: {stats}"
        assert stats["bytes_dense"] == 4 * numel * steps, f"rank {rank}: {stats}"
        warmup = (2 if static else 1) if method.stateful else 0
        assert stats["warmup_steps"] == warmup, f"rank {rank}: {stats}"
        assert stats["dense_buckets"] >= warmup, f"rank {rank}: {stats}"
        # The configuration really has the bucket count it claims (else the matrix would test less than it says).
        assert (stats["buckets"] > steps) == several, f"rank {rank}: {stats}"


@pytest.mark.parametrize("name, world, several, static",
                         _params(LOSSLESS_METHODS, WORLD_AXIS, BUCKETS_AXIS, STATIC_AXIS))
def test_lossless_training_equals_plain_ddp(name, world, several, static):
    ranks = _train_results(name, world)
    for run in (r[(several, static)] for r in ranks):
        torch.testing.assert_close(run["params"], run["reference"], rtol=1e-5, atol=1e-7)


# --- contract 7: state_dict round trip ---------------------------------------------------------------------------

def _layout_independent(name: str) -> bool:
    """Whether the method treats each parameter's entries alike wherever DDP places them in the bucket
    (never when its compressor says it ``depends_on_layout``).

    Only then can a resumed plain-DDP run (whose fresh model starts again from DDP's initial bucket layout)
    follow the uninterrupted run (on the rebuilt layout) bit for bit. Checked on the MLP's parameters laid out
    in two orders, over a few error-feedback steps.
    """
    if _method(name).compressor.depends_on_layout:
        return False
    named = [(n, p.numel()) for n, p in jobs.models.mlp().named_parameters()]
    g = torch.Generator().manual_seed(5)
    grads = {n: torch.randn(k, generator=g) * 10.0 ** torch.randint(-3, 3, (), generator=g) for n, k in named}

    def run(order):
        method = _method(name)
        info = gcomp.BucketInfo.from_layout(0, torch.float32, [n for n, _ in order], [k for _, k in order])
        decoded = []
        for step in range(3):
            flat = torch.cat([grads[n] for n, _ in order]) * (step + 1)
            compensated = method.memory.compensate(flat, info)
            payload = method.compressor.compress(compensated, info)
            method.memory.update(compensated, info, method.compressor, payload)
            d = method.compressor.decompress(payload.tensors, payload.ctx)
            decoded.append({n: d[o:o + k] for n, o, k in info.segments()})
        return decoded

    return all(torch.equal(a[n], b[n]) for a, b in zip(run(named), run(named[::-1])) for n in a)


@pytest.mark.parametrize("name, flavour", _params(METHODS, [(f, f) for f in jobs.RESUMES]))
def test_state_dict_resume_is_bit_identical(name, flavour):
    """Train, checkpoint (torch.save, torch.load(weights_only=True)), resume on a fresh DDP model and hook: the
    parameters equal those of a run that never stopped, bit for bit (2 ranks; see jobs.RESUMES)."""
    if flavour not in jobs.FIXED_LAYOUT and not _layout_independent(name):
        pytest.skip(f"{name} depends on where a parameter lies in the bucket, and a fresh DDP model starts from "
                    "its initial layout: the fixed-layout cases carry the contract")
    ranks = run_ranks_once(("resume",), 2, jobs.job_resume, METHODS)
    for rank, r in enumerate(ranks):
        run = r[(name, flavour)]
        assert torch.equal(run["resumed"], run["straight"]), (
            f"rank {rank}: the resumed run left the trajectory (max difference "
            f"{(run['resumed'] - run['straight']).abs().max().item():.3g})")
        assert run["resumed_steps"] == run["straight_steps"] == run["steps"]


# --- contract 3: homomorphism of all-reduce codecs (local, no processes) -----------------------------------------

@pytest.mark.parametrize("name", ALLREDUCE_METHODS)
@settings(max_examples=50, deadline=None)
@given(world=st.integers(1, 8), numel=st.integers(1, 300), seed=st.integers(0, 2**31 - 1),
       log_scale=st.floats(-3, 3), zeros=st.sampled_from([0.0, 0.5, 1.0]),
       dtype=st.sampled_from(jobs.DTYPES))
def test_allreduce_homomorphism(name, world, numel, seed, log_scale, zeros, dtype):
    """decompress(elementwise sum of the payloads, in their dtype) == sum of decompress(payload)."""
    g = torch.Generator().manual_seed(seed)
    methods = [_method(name) for _ in range(world)]  # one per rank, created alike as ranks do
    for round_ in range(2):  # a second round checks that per-rank state (e.g. a shared seed) stays in step
        xs = []
        for _ in range(world):
            x = torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** log_scale
            x[torch.rand(numel, generator=g) < zeros] = 0.0
            xs.append(x.to(dtype))
        info = gcomp.BucketInfo.single(xs[0])
        payloads = [m.compressor.compress(x, info) for m, x in zip(methods, xs)]
        decoded = [m.compressor.decompress(p.tensors, p.ctx) for m, p in zip(methods, payloads)]
        summed = [sum(parts[1:], parts[0].clone()) for parts in zip(*(p.tensors for p in payloads))]
        total = sum(decoded[1:], decoded[0].clone())
        eps, tiny = jobs.wire_precision(payloads[0].tensors, dtype)
        bound = jobs.sum_bound(world, torch.stack(decoded).double().abs().sum(0), eps, tiny)
        for rank, (m, p) in enumerate(zip(methods, payloads)):  # each rank decodes the sum with its own ctx
            result = m.compressor.decompress([t.clone() for t in summed], p.ctx)
            assert result.shape == xs[0].shape and result.dtype == dtype
            if m.compressor.lossless:
                assert torch.equal(result, total), f"round {round_}, rank {rank}: lossless codec not exact"
            else:
                _assert_within(result, total.double(), bound, f"round {round_}, rank {rank}")


# --- contract 5: error-feedback conservation (local) -------------------------------------------------------------

@pytest.mark.parametrize("dtype", jobs.DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("name", ERROR_FEEDBACK_METHODS)
def test_error_feedback_conservation(name, dtype):
    """decompress(payload) + new residual == gradient + old residual, step after step, across a re-layout.

    The residual is read by compensating a zero gradient on a copy of the memory. The only slack allowed is
    the rounding of the stored residual itself (none at all for codecs that send entries unchanged).
    """
    method = _method(name)
    memory, compressor = method.memory, method.compressor
    numels = {"a.weight": 120, "a.bias": 7, "b.weight": 50}
    layouts = [gcomp.BucketInfo.from_layout(0, dtype, list(numels), list(numels.values())),
               gcomp.BucketInfo.from_layout(0, dtype, list(numels)[::-1], list(numels.values())[::-1])]
    g = torch.Generator().manual_seed(1)
    eps = torch.finfo(dtype).eps

    def residual(info):
        return copy.deepcopy(memory).compensate(torch.zeros(info.numel, dtype=dtype), info)

    for step in range(6):
        info = layouts[step // 3]  # the second layout is DDP's rebuild: residuals must follow the parameters
        grad = (torch.randn(info.numel, generator=g, dtype=torch.float64) * 10.0 ** (step - 2)).to(dtype)
        old = residual(info)
        compensated = memory.compensate(grad, info)
        assert torch.equal(compensated, grad + old), f"step {step}: compensate is not gradient + residual"
        payload = compressor.compress(compensated, info)
        memory.update(compensated, info, compressor, payload)
        sent = compressor.decompress(payload.tensors, payload.ctx)
        new = residual(info)
        _assert_within(sent.double() + new.double(), compensated.double(), eps * new.double().abs(),
                       f"step {step}: sent + new residual vs gradient + old residual")
        if step == 2:
            assert new.abs().sum() > 0, "a lossy error-feedback method kept no residual"


# --- contract 8: bad configuration -------------------------------------------------------------------------------

def _out_of_range(spec) -> list[tuple[str, object]]:
    """Values of the right type outside ``spec.allowed`` (computed here, not with ``Range.__contains__``)."""
    a, t = spec.allowed, spec.type
    cases = []
    if isinstance(a, Range) and t in (int, float):
        if a.low is not None:
            cases.append(("below", math.floor(a.low) - 1 if t is int else a.low - max(1.0, abs(a.low))))
            if a.low_open and (t is float or float(a.low).is_integer()):
                cases.append(("low", t(a.low)))
            if t is float:
                cases.append(("neg-inf", -math.inf))
        if a.high is not None:
            cases.append(("above", math.ceil(a.high) + 1 if t is int else a.high + max(1.0, abs(a.high))))
            if a.high_open and (t is float or float(a.high).is_integer()):
                cases.append(("high", t(a.high)))
            if t is float:
                cases.append(("inf", math.inf))
    elif isinstance(a, OneOf):
        if t is str:
            cases.append(("other", "-".join(map(str, a.choices)) + "-other"))
        elif t in (int, float):
            cases.append(("other", t(max(a.choices)) + 1))
    if t is float:
        cases.append(("nan", math.nan))
        if isinstance(a, Range) and (a.low is not None or a.high is not None):
            cases.append(("huge-int", 10**400 if a.high is not None else -10**400))  # float() overflows
    return cases


_WRONG_TYPES = {float: [("str", "0.5"), ("bool", True), ("none", None)],
                int: [("float", 1.5), ("str", "1"), ("bool", True), ("none", None)],
                bool: [("str", "yes"), ("int", 2), ("none", None)],
                str: [("int", 1), ("none", None)]}


def _bad_cases():
    for name in METHODS:
        for pname, spec in gcomp.spec(name).params.items():
            for label, value in _out_of_range(spec) + _WRONG_TYPES.get(spec.type, [("none", None)]):
                yield pytest.param(name, pname, value, id=f"{name}-{pname}-{label}")


BAD_CASES = list(_bad_cases())


def _check_message(message: str, name: str, pname: str, value) -> None:
    spec = gcomp.spec(name).params[pname]
    assert name in message, message
    assert f"'{pname}'" in message, message
    if spec.allowed is not None:
        assert str(spec.allowed) in message, message
    assert repr(value) in message, message


@pytest.mark.parametrize("name, pname, value", BAD_CASES)
def test_bad_parameter_fails_at_create(name, pname, value):
    with pytest.raises(ValueError) as err:
        gcomp.create(name, **{pname: value})
    _check_message(str(err.value), name, pname, value)


def test_bad_parameter_fails_at_install_and_leaves_ddp_free():
    cases = [(p.values[0], {p.values[1]: p.values[2]}) for p in BAD_CASES]
    cases += [(name, {"no_such_parameter": 1}) for name in METHODS]
    outcomes = run_ranks_once(("install-rejects",), 1, jobs.job_install_rejects, cases)[0]
    for (name, params), (message, reinstalled) in zip(cases, outcomes):
        (pname, value), = params.items()
        assert message is not None, f"install({name!r}, {params}) did not raise ValueError"
        if pname == "no_such_parameter":
            assert pname in message, message
        else:
            _check_message(message, name, pname, value)
        assert reinstalled, f"a failed install({name!r}, {params}) left a hook on the DDP model"


@pytest.mark.parametrize("name", METHODS)
def test_unknown_parameter_is_named(name):
    with pytest.raises(ValueError, match="no_such_parameter"):
        gcomp.create(name, no_such_parameter=1)


@pytest.mark.parametrize("name", METHODS)
def test_unknown_method_lists_the_closest_names(name):
    typo = name[:-1] + ("x" if name[-1] != "x" else "y")
    if typo in METHODS:
        pytest.skip(f"{typo!r} is itself registered")
    with pytest.raises(gcomp.UnknownMethodError) as err:
        gcomp.create(typo)
    assert isinstance(err.value, ValueError)
    assert repr(name) in str(err.value), str(err.value)


@pytest.mark.parametrize("name", METHODS)
def test_describe_names_every_parameter_and_range(name):
    text = gcomp.describe(name)
    for pname, spec in gcomp.spec(name).params.items():
        assert pname in text and repr(spec.default) in text, text
        if spec.allowed is not None:
            assert str(spec.allowed) in text, text
