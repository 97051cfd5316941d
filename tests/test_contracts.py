"""The contracts of docs/design.md, run against every registered method (``gcomp.available()``).

A method registered later (a new compressor file, an entry point) is picked up here without editing this
file. The jobs and the checks are ``gcomp.testing``'s (the same ``gcomp.testing.check_method`` runs for one
method): here they are parametrised per method and configuration, so a failure names the exact method and
configuration. Multi-process checks run on 1-4 gloo ranks through ``run_ranks_once``; each rank job covers
several configurations at once and the tests below read their own configuration from a per-session cache.

1. shape / dtype / device kept, result = mean over ranks      test_reduce_*
2. replicas identical after DDP training                       test_training_*
3. all-reduce codecs are homomorphic (hypothesis, 1-8 ranks)   test_allreduce_homomorphism
4. lossless methods equal the dense all-reduce                 test_lossless_*
5. error-feedback conservation                                 test_error_feedback_conservation
6. non-finite values surface on every rank                     test_nonfinite_surfaces_on_every_rank
7. state_dict round trip                                       test_state_dict_resume_is_bit_identical
8. bad configuration fails early and clearly                   test_bad_parameter_*, test_unknown_*
9. the error model the compressor declares (traits.fidelity)   test_fidelity, test_unbiased_draws
10. bytes_sent is traits.wire_bytes                            test_bytes_sent_is_wire_bytes
(11. FSDP2's reduce-scatter: tests/fsdp/test_contracts.py)
"""
from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import gcomp
from gcomp.testing import Skip, config_checks, process_checks
from gcomp.testing.buckets import DTYPES, LAYOUTS, dtype_name
from gcomp.testing.ranks import run_ranks_once
from gcomp.testing.reduce_jobs import NONFINITE, PATHS, job_reduce
from gcomp.testing.train_jobs import RESUME_WORLD, RESUMES, TRAIN_CONFIGS, job_resume, job_train

METHODS = gcomp.available()
WORLDS = (1, 2, 3, 4)


@functools.lru_cache(maxsize=None)
def _method(name: str) -> gcomp.Method:
    """A method to read traits from (never run: checks create their own)."""
    return gcomp.create(name)


ALLREDUCE_METHODS = [m for m in METHODS if _method(m).collective == gcomp.ALLREDUCE]
LOSSLESS_METHODS = [m for m in METHODS if _method(m).lossless]
ERROR_FEEDBACK_METHODS = [m for m in METHODS if _method(m).error_feedback]


def _traits(name: str):
    return _method(name).compressor.traits if isinstance(_method(name), gcomp.Method) else None


CODEC_METHODS = [m for m in METHODS if _traits(m) is not None]
UNBIASED_METHODS = [m for m in CODEC_METHODS if _traits(m).fidelity.kind == "unbiased"]
SIZED_METHODS = [m for m in CODEC_METHODS if _traits(m).wire_bytes is not None]


def _check(check, *args):
    """Run one of gcomp.testing's checks; one that does not apply is a skip with its reason."""
    try:
        return check(*args)
    except Skip as skip:
        pytest.skip(str(skip))


def _reduce_results(name: str, world: int) -> list[dict]:
    return run_ranks_once(("reduce", name, world), world, job_reduce, name)


def _train_results(name: str, world: int) -> list[dict]:
    return run_ranks_once(("train", name, world), world, job_train, name, TRAIN_CONFIGS,
                          reference=name in LOSSLESS_METHODS)


def _params(names, *axes):
    """pytest params over the product of ``names`` and ``axes`` (each a list of (id, value)), readable ids."""
    combos = [((name,), name) for name in names]
    for axis in axes:
        combos = [(values + (value,), f"{label}-{part}") for values, label in combos for part, value in axis]
    return [pytest.param(*values, id=label) for values, label in combos]


WORLD_AXIS = [(f"ws{w}", w) for w in WORLDS]
LAYOUT_AXIS = [(layout, layout) for layout in LAYOUTS]
PATH_AXIS = [(path, path) for path in PATHS]
BUCKETS_AXIS = [("one", False), ("several", True)]
STATIC_AXIS = [("dynamic", False), ("static", True)]


# --- contract 1 (and 4 with fake buckets): shape, dtype, device, mean --------------------------------------------

@pytest.mark.parametrize("name, world, layout, path", _params(METHODS, WORLD_AXIS, LAYOUT_AXIS, PATH_AXIS))
def test_reduce_keeps_bucket_and_returns_the_mean(name, world, layout, path):
    """Fake buckets fed to ``HookState.reduce`` on ``world`` ranks, 3 steps, fp32, fp64, fp16 and bf16 buckets
    (``gcomp.testing.process_checks.check_reduce``; PowerSGD and majority votes, which do not ``decodes_alone``,
    are checked by their own tests)."""
    _check(process_checks.check_reduce, _reduce_results(name, world), layout, path, _method(name).decodes_alone)


@pytest.mark.parametrize("name, world, layout", _params(LOSSLESS_METHODS, WORLD_AXIS, LAYOUT_AXIS))
def test_lossless_reduce_is_the_dense_mean(name, world, layout):
    _check(process_checks.check_lossless_reduce, _reduce_results(name, world), layout)


# --- contract 6: non-finite values surface everywhere ------------------------------------------------------------

@pytest.mark.parametrize("name, world, path, kind",
                         _params(METHODS, WORLD_AXIS, PATH_AXIS, [(k, k) for k in NONFINITE]))
def test_nonfinite_surfaces_on_every_rank(name, world, path, kind):
    """The last rank's bucket holds one NaN (or +inf); every rank's result must hold a non-finite value."""
    _check(process_checks.check_nonfinite, _reduce_results(name, world), path, kind)


# --- contract 2 (and 4 in DDP): replicas identical after training ------------------------------------------------

@pytest.mark.parametrize("name, world, several, static", _params(METHODS, WORLD_AXIS, BUCKETS_AXIS, STATIC_AXIS))
def test_training_keeps_replicas_identical(name, world, several, static):
    _check(process_checks.check_replicas, _train_results(name, world), several, static)


@pytest.mark.parametrize("name, world, several, static", _params(METHODS, WORLD_AXIS, BUCKETS_AXIS, STATIC_AXIS))
def test_training_stats(name, world, several, static):
    _check(process_checks.check_stats, _train_results(name, world), several, static, _method(name).stateful)


@pytest.mark.parametrize("name, world, several, static",
                         _params(LOSSLESS_METHODS, WORLD_AXIS, BUCKETS_AXIS, STATIC_AXIS))
def test_lossless_training_equals_plain_ddp(name, world, several, static):
    _check(process_checks.check_lossless_training, _train_results(name, world), several, static)


# --- contract 7: state_dict round trip ---------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _layout_dependence(name: str) -> str | None:
    return process_checks.layout_dependence(functools.partial(gcomp.create, name), name)


@pytest.mark.parametrize("name, flavour", _params(METHODS, [(f, f) for f in RESUMES]))
def test_state_dict_resume_is_bit_identical(name, flavour):
    """Train, checkpoint (torch.save, torch.load(weights_only=True)), resume on a fresh DDP model and hook: the
    parameters equal those of a run that never stopped, bit for bit (2 ranks; see train_jobs.RESUMES)."""
    _check(process_checks.resume_skip, flavour, _layout_dependence(name))
    ranks = run_ranks_once(("resume",), RESUME_WORLD, job_resume, METHODS)
    _check(process_checks.check_resume, ranks, name, flavour)


# --- contract 3: homomorphism of all-reduce codecs (local, no processes) -----------------------------------------

@pytest.mark.parametrize("name", ALLREDUCE_METHODS)
@settings(max_examples=50, deadline=None)
@given(world=st.integers(*process_checks.WORLDS), numel=st.integers(*process_checks.NUMELS),
       seed=st.integers(*process_checks.SEEDS), log_scale=st.floats(*process_checks.LOG_SCALES),
       zeros=st.sampled_from(process_checks.ZEROS), dtype=st.sampled_from(DTYPES))
def test_allreduce_homomorphism(name, world, numel, seed, log_scale, zeros, dtype):
    """decompress(elementwise sum of the payloads, in their dtype) == sum of decompress(payload)."""
    _check(process_checks.check_homomorphism, functools.partial(gcomp.create, name), world, numel, seed, log_scale,
           zeros, dtype)


# --- contract 5: error-feedback conservation (the one-rank job's runs) --------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_name)
@pytest.mark.parametrize("name", ERROR_FEEDBACK_METHODS)
def test_error_feedback_conservation(name, dtype):
    """What was sent plus what is held back is the gradient plus what was held, step after step, across a
    re-layout."""
    _check(process_checks.check_conservation, _reduce_results(name, 1), dtype, _method(name))


# --- contracts 9 and 10: fidelity, bytes -------------------------------------------------------------------------

@pytest.mark.parametrize("name, world, layout", _params(CODEC_METHODS, WORLD_AXIS, LAYOUT_AXIS))
def test_fidelity(name, world, layout):
    """Each result, or each rank's bucket reduced alone, keeps the error model the compressor declares."""
    _check(process_checks.check_fidelity, _reduce_results(name, world), layout, _method(name))


@pytest.mark.parametrize("name, world", _params(UNBIASED_METHODS, WORLD_AXIS))
def test_unbiased_draws(name, world):
    _check(process_checks.check_unbiased, _reduce_results(name, world), _method(name))


@pytest.mark.parametrize("name, world, layout", _params(SIZED_METHODS, WORLD_AXIS, LAYOUT_AXIS))
def test_bytes_sent_is_wire_bytes(name, world, layout):
    _check(process_checks.check_bytes, _reduce_results(name, world), layout, _method(name))


# --- contract 8: bad configuration -------------------------------------------------------------------------------

BAD_CASES = [pytest.param(name, pname, value, id=f"{name}-{pname}-{label}")
             for name in METHODS for pname, label, value in config_checks.bad_cases(name)]


@pytest.mark.parametrize("name, pname, value", BAD_CASES)
def test_bad_parameter_fails_at_create(name, pname, value):
    _check(config_checks.check_bad_create, name, pname, value)


def test_bad_parameter_fails_at_install_and_leaves_ddp_free():
    cases = [(name, params) for name in METHODS for params in config_checks.install_cases(name)]
    outcomes = run_ranks_once(("install-rejects",), 1, config_checks.job_install_rejects, cases)[0]
    for (name, params), outcome in zip(cases, outcomes):
        config_checks.check_install_reject(name, params, outcome)


@pytest.mark.parametrize("name", METHODS)
def test_unknown_parameter_is_named(name):
    _check(config_checks.check_unknown_parameter, name)


@pytest.mark.parametrize("name", METHODS)
def test_unknown_method_lists_the_closest_names(name):
    _check(config_checks.check_unknown_method, name)


@pytest.mark.parametrize("name", METHODS)
def test_describe_names_every_parameter_and_range(name):
    _check(config_checks.check_describe, name)
