"""``check_method``: the contracts (``report.CONTRACTS``) against one method, a registered name or a module-level
factory, on gloo ranks of this machine; a report of every (contract, configuration) checked."""
from __future__ import annotations

import traceback
from typing import Any, Callable, Iterable

import gcomp
from gcomp.testing import config_checks, process_checks as checks
from gcomp.testing.buckets import DTYPES, LAYOUTS, dtype_name
from gcomp.testing.ranks import MAX_RANKS, run_ranks_once
from gcomp.testing.reduce_jobs import FSDP_CHECKS, NONFINITE, PATHS, job_fsdp, job_reduce
from gcomp.testing.report import CONTRACTS, FAILED, NUMBERS, PASSED, SKIPPED, ContractError, Report, Skip
from gcomp.testing.source import MethodSource
from gcomp.testing.train_jobs import RESUME_WORLD, RESUMES, TRAIN_CONFIGS, job_resume, job_train

TRAITS = ("collective", "lossless", "stateful", "decodes_alone", "depends_on_layout", "reads_model", "error_feedback")


def _contracts(contracts: Iterable[int | str] | None) -> list[int]:
    chosen = set()
    for c in CONTRACTS if contracts is None else [contracts] if isinstance(contracts, (int, str)) else contracts:
        number = NUMBERS.get(c, c if isinstance(c, int) and not isinstance(c, bool) else None)
        if number not in CONTRACTS:
            raise ValueError(f"check_method: unknown contract {c!r}; the contracts are "
                             + ", ".join(f"{n} ({key})" for n, (key, _) in CONTRACTS.items()))
        chosen.add(number)
    return sorted(chosen)


class _Run:
    """One ``check_method`` call: the method, its rank jobs and the report."""

    def __init__(self, source: MethodSource, method: Any, worlds: list[int], timeout: float):
        self.source, self.method, self.worlds, self.timeout = source, method, worlds, timeout
        self.report = Report(source.label)

    def job(self, key: tuple, world: int, fn: Callable, *args) -> list:
        """``fn`` on ``world`` ranks, once per ``key`` and method; a failed job fails every check that reads it."""
        return run_ranks_once((self.source, *key), world, fn, *args, timeout=self.timeout)

    def reduce(self, world: int) -> list:
        return self.job(("reduce", world), world, job_reduce, self.source)

    def train(self, world: int) -> list:
        return self.job(("train", world), world, job_train, self.source, TRAIN_CONFIGS, bool(self.method.lossless))

    def check(self, number: int, config: str, fn: Callable) -> None:
        """Run one check and record it: passed (with its note), skipped (with the reason) or failed."""
        contract = CONTRACTS[number][0]
        try:
            note = fn()
        except Skip as skip:
            self.report.add(contract, config, SKIPPED, str(skip))
        except AssertionError as err:
            self.report.add(contract, config, FAILED, str(err) or "AssertionError")
        except Exception as err:  # noqa: BLE001 -- a method that raises breaks the contract; say where
            self.report.add(contract, config, FAILED, f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        else:
            self.report.add(contract, config, PASSED, note if isinstance(note, str) else "")


def _skip(reason: str) -> None:
    raise Skip(reason)


def _checks(run: _Run, number: int, examples: int, seed: int):
    """``(config, check)`` of contract ``number``; a string instead: the reason it is skipped for this method."""
    m, name, worlds, trains = run.method, run.source.name, run.worlds, TRAIN_CONFIGS
    train = [(f"{'several' if s else 'one'} {'static' if st else 'dynamic'}", s, st) for s, st in trains]
    if number == 1:
        return [(f"ws{w} {lay} {p}", lambda w=w, lay=lay, p=p: checks.check_reduce(run.reduce(w), lay, p,
                                                                                    m.decodes_alone))
                for w in worlds for lay in LAYOUTS for p in PATHS]
    if number == 2:
        return [(f"ws{w} {c} {what}", lambda w=w, s=s, st=st, f=f, e=extra: f(run.train(w), s, st, *e))
                for w in worlds for c, s, st in train for what, f, extra in
                (("replicas", checks.check_replicas, ()), ("stats", checks.check_stats, (m.stateful,)))]
    if number == 3:
        if m.collective != gcomp.ALLREDUCE or not isinstance(m, gcomp.Method):
            return (f"applies to a gcomp.Method of collective {gcomp.ALLREDUCE!r}; this is a {type(m).__name__} of "
                    f"{m.collective!r}")
        return [(checks.example_label(**ex), lambda ex=ex: checks.check_homomorphism(
            run.source.create, **ex)) for ex in checks.homomorphism_examples(examples, seed)]
    if number == 4:
        if not m.lossless:
            return "applies to lossless methods; this one's lossless is False"
        return [(f"ws{w} {lay} reduce", lambda w=w, lay=lay: checks.check_lossless_reduce(run.reduce(w), lay))
                for w in worlds for lay in LAYOUTS] + [
            (f"ws{w} {c} training", lambda w=w, s=s, st=st: checks.check_lossless_training(run.train(w), s, st))
            for w in worlds for c, s, st in train]
    if number == 5:
        if not m.error_feedback:
            return "applies to methods with error feedback; this one's error_feedback is False"
        return [(dtype_name(d), lambda d=d: checks.check_conservation(run.reduce(worlds[0]), d, m)) for d in DTYPES]
    if number == 6:
        return [(f"ws{w} {p} {k}", lambda w=w, p=p, k=k: checks.check_nonfinite(run.reduce(w), p, k))
                for w in worlds for p in PATHS for k in NONFINITE]
    if number == 7:
        dependence = checks.layout_dependence(run.source.create, run.source.label)

        def resume(f):
            checks.resume_skip(f, dependence)
            checks.check_resume(run.job(("resume",), RESUME_WORLD, job_resume, [run.source]), run.source, f)
        return [(f"ws{RESUME_WORLD} {f}", lambda f=f: resume(f)) for f in RESUMES]
    if number == 8:
        if not run.source.registered:
            return "needs a registered name: the parameter ranges, unknown names and describe are the registry's"
        cases = config_checks.install_cases(name)
        rejects = lambda: run.job(("install-rejects",), 1, config_checks.job_install_rejects,  # noqa: E731
                                  [(run.source, c) for c in cases])[0]
        return ([(f"create {p}={label}", lambda p=p, v=v: config_checks.check_bad_create(name, p, v))
                 for p, label, v in config_checks.bad_cases(name)]
                + [(f"install {p}={v!r}", lambda i=i, c=c: config_checks.check_install_reject(name, c, rejects()[i]))
                   for i, c in enumerate(cases) for p, v in c.items()]
                + [(label, lambda f=f: f(name)) for label, f in (
                    ("unknown parameter", config_checks.check_unknown_parameter),
                    ("unknown method", config_checks.check_unknown_method),
                    ("describe", config_checks.check_describe))])
    if number == 9:
        return [(f"ws{w} {lay}", lambda w=w, lay=lay: checks.check_fidelity(run.reduce(w), lay, m))
                for w in worlds for lay in LAYOUTS] + [
            (f"ws{w} draws", lambda w=w: checks.check_unbiased(run.reduce(w), m)) for w in worlds]
    if number == 10:
        return [(f"ws{w} {lay}", lambda w=w, lay=lay: checks.check_bytes(run.reduce(w), lay, m))
                for w in worlds for lay in LAYOUTS]
    if not m.serves_fsdp:
        return "the method does not serve FSDP2 (traits.rows is None, or its communicator's rows is False)"
    return [(f"ws{w} {c}", lambda w=w, c=c: checks.check_fsdp(run.job(("fsdp", w), w, job_fsdp, [run.source]),
                                                                run.source.label, c))
            for w in worlds for c in FSDP_CHECKS]


def check_method(name_or_factory: str | Callable[[], Any], world_sizes: Iterable[int] = (1, 2, 3), *,
                 contracts: Iterable[int | str] | None = None, examples: int = 20, seed: int = 0,
                 raise_on_failure: bool = True, timeout: float = 300) -> Report:
    """The ``Report`` of the contracts (``CONTRACTS``; ``contracts``: some by number or key) on one method: a
    registered name, or a module-level callable with no arguments returning the configured method (the workers
    import it by module and name: a lambda or a nested function is a TypeError). Rank jobs on ``world_sizes`` ranks
    (1 to 8; contract 7 on 2), each within ``timeout`` seconds; ``examples`` seeded (``seed``) homomorphism examples.
    Raises ``ContractError`` listing every failure, unless ``raise_on_failure=False``."""
    source = MethodSource.of(name_or_factory)
    chosen, worlds = _contracts(contracts), sorted(set(world_sizes))
    if not worlds or not all(isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= MAX_RANKS for w in worlds):
        raise ValueError(f"check_method: world_sizes must be rank counts from 1 to {MAX_RANKS}; got {world_sizes!r}")
    if not isinstance(examples, int) or examples < 0:
        raise ValueError(f"check_method: examples must be a count, 0 or more; got {examples!r}")
    method = source.create()  # an unknown name, a bad factory: raised here, before any process starts
    lacking = [t for t in TRAITS if not hasattr(method, t)]
    if lacking:
        raise TypeError(f"check_method: {source.label} gave a {type(method).__name__}, which lacks the method "
                        f"traits {', '.join(lacking)}: return a configured gcomp.Method")
    run = _Run(source, method, worlds, timeout)
    for number in chosen:
        found = _checks(run, number, examples, seed)
        for config, fn in [("all", lambda: _skip(found))] if isinstance(found, str) else found:
            run.check(number, config, fn)
    if raise_on_failure and run.report.failures:
        raise ContractError(run.report)
    return run.report
