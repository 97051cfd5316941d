"""Contract 8 for a registered method: a parameter out of its range (or of the wrong type) is refused by
``gcomp.create`` and ``gcomp.install`` (leaving the DDP model free), naming the method, the parameter, its range and
the value; an unknown parameter is named; an unknown name lists the closest; ``describe`` names every parameter."""
from __future__ import annotations

import math

import gcomp
from gcomp.params import OneOf, Range
from gcomp.testing import models
from gcomp.testing.report import Skip
from gcomp.testing.source import as_source

UNKNOWN_PARAMETER = "no_such_parameter"


def out_of_range(spec) -> list[tuple[str, object]]:
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


WRONG_TYPES = {float: [("str", "0.5"), ("bool", True), ("none", None)],
               int: [("float", 1.5), ("str", "1"), ("bool", True), ("none", None)],
               bool: [("str", "yes"), ("int", 2), ("none", None)],
               str: [("int", 1), ("none", None)]}


def bad_cases(name: str) -> list[tuple[str, str, object]]:
    """``(parameter, label, bad value)`` for every registered parameter of ``name``: out of range, wrong type."""
    return [(pname, label, value) for pname, spec in gcomp.spec(name).params.items()
            for label, value in out_of_range(spec) + WRONG_TYPES.get(spec.type, [("none", None)])]


def check_message(message: str, name: str, pname: str, value) -> None:
    """The refusal names the method, the parameter, its range and the value given."""
    spec = gcomp.spec(name).params[pname]
    wanted = [name, f"'{pname}'", repr(value)] + ([str(spec.allowed)] if spec.allowed is not None else [])
    missing = [w for w in wanted if w not in message]
    if missing:
        raise AssertionError(f"the refusal of {pname}={value!r} does not name {', '.join(missing)}: {message}")


def _refusal(call, what: str, kind: type = ValueError) -> str:
    """The message of the ``kind`` that ``call()`` raises; AssertionError when it raises none."""
    try:
        call()
    except kind as err:
        return str(err)
    raise AssertionError(f"{what} did not raise {kind.__name__}")


def check_bad_create(name: str, pname: str, value) -> None:
    """``gcomp.create(name, pname=value)`` raises ValueError with a clear message."""
    check_message(_refusal(lambda: gcomp.create(name, **{pname: value}), f"gcomp.create({name!r}, {pname}={value!r})"),
                  name, pname, value)


def job_install_rejects(cases: list[tuple]) -> list:
    """A rank job: per ``(method, params)`` (a name or ``MethodSource``), ``gcomp.install``'s ValueError message (or
    None) and whether a correct install works afterwards."""
    out = []
    for method, params in cases:
        source, ddp_model = as_source(method), models.ddp(models.mlp(0))
        try:
            message = _refusal(lambda: source.install(ddp_model, **params), "install")
        except AssertionError:
            message = None
        try:
            out.append((message, source.install(ddp_model) is not None))
        except RuntimeError:
            out.append((message, False))
    return out


def install_cases(name: str) -> list[dict]:
    """The parameters ``job_install_rejects`` tries for ``name``: every bad case, then an unknown parameter."""
    return [{pname: value} for pname, _, value in bad_cases(name)] + [{UNKNOWN_PARAMETER: 1}]


def check_install_reject(name: str, params: dict, outcome: tuple) -> None:
    """One case's outcome of ``job_install_rejects``: refused with a clear message, the model left free."""
    message, reinstalled = outcome
    (pname, value), = params.items()
    if message is None:
        raise AssertionError(f"install({name!r}, {params}) did not raise ValueError")
    if pname != UNKNOWN_PARAMETER:
        check_message(message, name, pname, value)
    elif pname not in message:
        raise AssertionError(f"install({name!r}, {params}): the message does not name {pname}: {message}")
    if not reinstalled:
        raise AssertionError(f"a failed install({name!r}, {params}) left a hook on the DDP model")


def check_unknown_parameter(name: str) -> None:
    """``gcomp.create(name, no_such_parameter=1)`` raises ValueError naming the parameter."""
    message = _refusal(lambda: gcomp.create(name, **{UNKNOWN_PARAMETER: 1}), f"gcomp.create({name!r}, "
                       f"{UNKNOWN_PARAMETER}=1)")
    if UNKNOWN_PARAMETER not in message:
        raise AssertionError(f"the refusal does not name {UNKNOWN_PARAMETER}: {message}")


def check_unknown_method(name: str) -> None:
    """A one-letter typo of ``name`` raises ``gcomp.UnknownMethodError`` (a ValueError) listing ``name``."""
    typo = name[:-1] + ("x" if name[-1] != "x" else "y")
    if typo in gcomp.available():
        raise Skip(f"{typo!r} is itself registered")
    if not issubclass(gcomp.UnknownMethodError, ValueError):
        raise AssertionError("UnknownMethodError is not a ValueError")
    message = _refusal(lambda: gcomp.create(typo), f"gcomp.create({typo!r})", gcomp.UnknownMethodError)
    if repr(name) not in message:
        raise AssertionError(f"the refusal of {typo!r} does not name {name!r}: {message}")


def check_describe(name: str) -> None:
    """``gcomp.describe(name)`` names every parameter with its default and range."""
    text = gcomp.describe(name)
    for pname, spec in gcomp.spec(name).params.items():
        wanted = [pname, repr(spec.default)] + ([str(spec.allowed)] if spec.allowed is not None else [])
        missing = [w for w in wanted if w not in text]
        if missing:
            raise AssertionError(f"describe({name!r}) does not give {', '.join(missing)} of {pname!r}:\n{text}")
