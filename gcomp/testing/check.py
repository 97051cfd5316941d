"""``check_method``: run the contracts (``report.CONTRACTS``) against one method, a registered name or a module-level
factory, on gloo ranks of this machine, and report every (contract, configuration) checked."""
from __future__ import annotations

import traceback
from typing import Any, Callable, Iterable

import gcomp
from gcomp.testing import codec_checks, config_checks, fsdp_jobs, process_checks
from gcomp.testing.buckets import DTYPES, LAYOUTS, dtype_name
from gcomp.testing.ranks import MAX_RANKS, run_ranks
from gcomp.testing.reduce_jobs import NONFINITE, PATHS, job_reduce
from gcomp.testing.report import CONTRACTS, FAILED, NUMBERS, PASSED, SKIPPED, ContractError, Report, Skip
from gcomp.testing.source import MethodSource
from gcomp.testing.train_jobs import RESUME_WORLD, RESUMES, TRAIN_CONFIGS, job_resume, job_train

TRAITS = ("collective", "lossless", "stateful", "decodes_alone", "depends_on_layout", "reads_model", "error_feedback")


def _contracts(contracts: Iterable[int | str] | None) -> list[int]:
    if contracts is None:
        return list(CONTRACTS)
    if isinstance(contracts, (int, str)):
        contracts = [contracts]
    chosen = set()
    for c in contracts:
        number = NUMBERS.get(c, c if isinstance(c, int) and not isinstance(c, bool) else None)
        if number not in CONTRACTS:
            raise ValueError(f"check_method: unknown contract {c!r}; the contracts are "
                             + ", ".join(f"{n} ({key})" for n, (key, _) in CONTRACTS.items()))
        chosen.add(number)
    return sorted(chosen)


def _worlds(world_sizes: Iterable[int]) -> list[int]:
    worlds = list(world_sizes)
    if not worlds or not all(isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= MAX_RANKS for w in worlds):
        raise ValueError(f"check_method: world_sizes must be rank counts from 1 to {MAX_RANKS}; got {world_sizes!r}")
    return sorted(set(worlds))


class _Run:
    """One ``check_method`` call: the method, its rank jobs (each run once, on first need) and the report."""

    def __init__(self, source: MethodSource, method: Any, worlds: list[int], timeout: float):
        self.source, self.method, self.worlds, self.timeout = source, method, worlds, timeout
        self.report = Report(source.label)
        self._jobs: dict = {}

    def job(self, key: tuple, world: int, fn: Callable, *args) -> list:
        """``fn`` on ``world`` ranks once per ``key``; a failed job fails every check that reads it."""
        if key not in self._jobs:
            try:
                self._jobs[key] = (True, run_ranks(world, fn, *args, timeout=self.timeout))
            except AssertionError as err:
                self._jobs[key] = (False, f"the rank job {fn.__name__} failed on {world} rank(s): {err}")
        ok, value = self._jobs[key]
        if not ok:
            raise AssertionError(value)
        return value

    def reduce(self, world: int) -> list:
        return self.job(("reduce", world), world, job_reduce, self.source)

    def train(self, world: int) -> list:
        return self.job(("train", world), world, job_train, self.source, TRAIN_CONFIGS, bool(self.method.lossless))

    def check(self, number: int, config: str, fn: Callable, *args) -> None:
        """Run one check and record it: passed (with its note), skipped (with the reason) or failed."""
        contract = CONTRACTS[number][0]
        try:
            note = fn(*args)
        except Skip as skip:
            self.report.add(contract, config, SKIPPED, str(skip))
        except AssertionError as err:
            self.report.add(contract, config, FAILED, str(err) or "AssertionError")
        except Exception as err:  # noqa: BLE001 -- a method that raises breaks the contract; say where
            self.report.add(contract, config, FAILED, f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        else:
            self.report.add(contract, config, PASSED, note if isinstance(note, str) else "")

    def skip(self, number: int, reason: str) -> None:
        self.report.add(CONTRACTS[number][0], "all", SKIPPED, reason)


def _reduce(run: _Run) -> None:
    for world in run.worlds:
        for layout in LAYOUTS:
            for path in PATHS:
                run.check(1, f"ws{world} {layout} {path}", lambda w=world, lay=layout, p=path: (
                    process_checks.check_reduce(run.reduce(w), lay, p, run.method.decodes_alone)))


def _replicas(run: _Run) -> None:
    for world in run.worlds:
        for several, static in TRAIN_CONFIGS:
            config = f"ws{world} {'several' if several else 'one'} {'static' if static else 'dynamic'}"
            run.check(2, f"{config} replicas", lambda w=world, s=several, st=static: (
                process_checks.check_replicas(run.train(w), s, st)))
            run.check(2, f"{config} stats", lambda w=world, s=several, st=static: (
                process_checks.check_stats(run.train(w), s, st, run.method.stateful)))


def _homomorphism(run: _Run, examples: int, seed: int) -> None:
    if run.method.collective != gcomp.ALLREDUCE or not isinstance(run.method, gcomp.Method):
        return run.skip(3, f"applies to a gcomp.Method whose collective is {gcomp.ALLREDUCE!r}; this one is a "
                           f"{type(run.method).__name__} whose collective is {run.method.collective!r}")
    for example in codec_checks.homomorphism_examples(examples, seed):
        run.check(3, codec_checks.example_label(**example),
                  lambda ex=example: codec_checks.check_homomorphism(run.source.create, **ex))


def _lossless(run: _Run) -> None:
    if not run.method.lossless:
        return run.skip(4, "applies to lossless methods; this one's lossless is False")
    for world in run.worlds:
        for layout in LAYOUTS:
            run.check(4, f"ws{world} {layout} reduce", lambda w=world, lay=layout: (
                process_checks.check_lossless_reduce(run.reduce(w), lay)))
        for several, static in TRAIN_CONFIGS:
            config = f"ws{world} {'several' if several else 'one'} {'static' if static else 'dynamic'} training"
            run.check(4, config, lambda w=world, s=several, st=static: (
                process_checks.check_lossless_training(run.train(w), s, st)))


def _conservation(run: _Run) -> None:
    if not run.method.error_feedback:
        return run.skip(5, "applies to methods with error feedback; this one's error_feedback is False")
    for dtype in DTYPES:
        run.check(5, dtype_name(dtype), lambda d=dtype: process_checks.check_conservation(
            run.reduce(run.worlds[0]), d, run.method))


def _nonfinite(run: _Run) -> None:
    for world in run.worlds:
        for path in PATHS:
            for kind in NONFINITE:
                run.check(6, f"ws{world} {path} {kind}", lambda w=world, p=path, k=kind: (
                    process_checks.check_nonfinite(run.reduce(w), p, k)))


def _state_dict(run: _Run) -> None:
    dependence = codec_checks.layout_dependence(run.source.create, run.source.label)
    for flavour in RESUMES:
        def check(f=flavour):
            process_checks.resume_skip(f, dependence)
            ranks = run.job(("resume",), RESUME_WORLD, job_resume, [run.source])
            process_checks.check_resume(ranks, run.source, f)
        run.check(7, f"ws{RESUME_WORLD} {flavour}", check)


def _configuration(run: _Run) -> None:
    if not run.source.registered:
        return run.skip(8, "needs a registered name: the parameter ranges, unknown names and describe are the "
                           "registry's")
    name = run.source.name
    for pname, label, value in config_checks.bad_cases(name):
        run.check(8, f"create {pname}={label}", config_checks.check_bad_create, name, pname, value)
    cases = config_checks.install_cases(name)
    for index, params in enumerate(cases):
        (pname, value), = params.items()
        run.check(8, f"install {pname}={value!r}", lambda i=index, p=params: config_checks.check_install_reject(
            name, p, run.job(("install-rejects",), 1, config_checks.job_install_rejects,
                             [(run.source, c) for c in cases])[0][i]))
    run.check(8, "unknown parameter", config_checks.check_unknown_parameter, name)
    run.check(8, "unknown method", config_checks.check_unknown_method, name)
    run.check(8, "describe", config_checks.check_describe, name)


def _fidelity(run: _Run) -> None:
    for world in run.worlds:
        for layout in LAYOUTS:
            run.check(9, f"ws{world} {layout}", lambda w=world, lay=layout: (
                process_checks.check_fidelity(run.reduce(w), lay, run.method)))
        run.check(9, f"ws{world} draws", lambda w=world: process_checks.check_unbiased(run.reduce(w), run.method))


def _bytes(run: _Run) -> None:
    for world in run.worlds:
        run.check(10, f"ws{world}", lambda w=world: process_checks.check_bytes(run.reduce(w), run.method, w))


def _fsdp(run: _Run) -> None:
    if not run.method.serves_fsdp:
        return run.skip(11, "the method does not serve FSDP2 (traits.rows is None, or its communicator's rows is "
                            "False)")
    for world in run.worlds:
        for what in fsdp_jobs.CHECKS:
            run.check(11, f"ws{world} {what}", lambda w=world, c=what: fsdp_jobs.check_fsdp(
                run.job(("fsdp", w), w, fsdp_jobs.job_fsdp, [run.source]), run.source.label, c))


def check_method(name_or_factory: str | Callable[[], Any], world_sizes: Iterable[int] = (1, 2, 3), *,
                 contracts: Iterable[int | str] | None = None, examples: int = 20, seed: int = 0,
                 raise_on_failure: bool = True, timeout: float = 300) -> Report:
    """Check one method against the contracts (``gcomp.testing.CONTRACTS``) and return the ``Report``.

    ``name_or_factory``: a registered method name (built in, registered with ``gcomp.register``, or from a
    ``gcomp.methods`` entry point), or a module-level callable taking no arguments that returns the configured
    method (a lambda, a nested function or a bound method is refused with a TypeError: the worker processes import
    it by module and name). The rank jobs run gloo on 127.0.0.1, ``world_sizes`` ranks each (1 to 8; the state_dict
    contract on 2). An unknown name raises ``gcomp.UnknownMethodError`` at once.

    ``contracts``: numbers or keys to check, all by default. ``examples``: how many seeded examples (``seed``) the
    homomorphism contract draws. ``timeout``: seconds a rank job may take. Contracts that do not apply are skipped
    with the reason. Raises ``ContractError`` (an AssertionError) listing every failure, unless
    ``raise_on_failure=False``."""
    source = MethodSource.of(name_or_factory)
    chosen, worlds = _contracts(contracts), _worlds(world_sizes)
    if not isinstance(examples, int) or examples < 0:
        raise ValueError(f"check_method: examples must be a count, 0 or more; got {examples!r}")
    method = source.create()  # an unknown name, a bad factory: raised here, before any process starts
    lacking = [t for t in TRAITS if not hasattr(method, t)]
    if lacking:
        raise TypeError(f"check_method: {source.label} gave a {type(method).__name__}, which lacks the method "
                        f"traits {', '.join(lacking)}: return a configured gcomp.Method")
    run = _Run(source, method, worlds, timeout)
    steps = {1: _reduce, 2: _replicas, 3: lambda r: _homomorphism(r, examples, seed), 4: _lossless,
             5: _conservation, 6: _nonfinite, 7: _state_dict, 8: _configuration, 9: _fidelity, 10: _bytes,
             11: _fsdp}
    for number in chosen:
        steps[number](run)
    if raise_on_failure and run.report.failures:
        raise ContractError(run.report)
    return run.report
