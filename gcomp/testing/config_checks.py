"""Contract 8, bad configuration fails early and clearly, for a registered method: every parameter given a
value outside its registered range (or of the wrong type) is refused by ``gcomp.create`` and by
``gcomp.install`` (which then leaves the DDP model free), naming the method, the parameter, its range and the
value; an unknown parameter is named; an unknown method name lists the closest names; ``describe`` names
every parameter with its default and range. Checks raise AssertionError (``Skip`` where one does not apply).
"""
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


def check_bad_create(name: str, pname: str, value) -> None:
    """``gcomp.create(name, pname=value)`` raises ValueError with a clear message."""
    try:
        gcomp.create(name, **{pname: value})
    except ValueError as err:
        check_message(str(err), name, pname, value)
    else:
        raise AssertionError(f"gcomp.create({name!r}, {pname}={value!r}) did not raise ValueError")


def job_install_rejects(cases: list[tuple]) -> list:
    """Contract 8 at install time (a rank job): each ``(method, params)`` (a registered name or a
    ``MethodSource``) must raise ValueError from ``gcomp.install`` and leave the DDP model free for a correct
    install afterwards. Returns ``(message or None, reinstalled)`` per case."""
    out = []
    for method, params in cases:
        source = as_source(method)
        ddp_model = models.ddp(models.mlp(0))
        try:
            source.install(ddp_model, **params)
            message = None
        except ValueError as err:
            message = str(err)
        try:
            source.install(ddp_model)
            reinstalled = True
        except RuntimeError:
            reinstalled = False
        out.append((message, reinstalled))
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
    if pname == UNKNOWN_PARAMETER:
        if pname not in message:
            raise AssertionError(f"install({name!r}, {params}): the message does not name {pname}: {message}")
    else:
        check_message(message, name, pname, value)
    if not reinstalled:
        raise AssertionError(f"a failed install({name!r}, {params}) left a hook on the DDP model")


def check_unknown_parameter(name: str) -> None:
    """``gcomp.create(name, no_such_parameter=1)`` raises ValueError naming the parameter."""
    try:
        gcomp.create(name, **{UNKNOWN_PARAMETER: 1})
    except ValueError as err:
        if UNKNOWN_PARAMETER not in str(err):
            raise AssertionError(f"the refusal does not name {UNKNOWN_PARAMETER}: {err}") from None
    else:
        raise AssertionError(f"gcomp.create({name!r}, {UNKNOWN_PARAMETER}=1) did not raise ValueError")


def check_unknown_method(name: str) -> None:
    """A one-letter typo of ``name`` raises ``gcomp.UnknownMethodError`` (a ValueError) listing ``name``."""
    typo = name[:-1] + ("x" if name[-1] != "x" else "y")
    if typo in gcomp.available():
        raise Skip(f"{typo!r} is itself registered")
    try:
        gcomp.create(typo)
    except gcomp.UnknownMethodError as err:
        if not isinstance(err, ValueError):
            raise AssertionError("UnknownMethodError is not a ValueError") from None
        if repr(name) not in str(err):
            raise AssertionError(f"the refusal of {typo!r} does not name {name!r}: {err}") from None
    else:
        raise AssertionError(f"gcomp.create({typo!r}) did not raise UnknownMethodError")


def check_describe(name: str) -> None:
    """``gcomp.describe(name)`` names every parameter with its default and range."""
    text = gcomp.describe(name)
    for pname, spec in gcomp.spec(name).params.items():
        wanted = [pname, repr(spec.default)] + ([str(spec.allowed)] if spec.allowed is not None else [])
        missing = [w for w in wanted if w not in text]
        if missing:
            raise AssertionError(f"describe({name!r}) does not give {', '.join(missing)} of {pname!r}:\n{text}")
