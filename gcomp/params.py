"""Declarative parameter constraints, read from a method factory's ``Annotated`` signature.

    @gcomp.register("topk")
    def topk(ratio: Annotated[float, Range(0, 1, low_open=True)] = 0.01) -> Method: ...
"""
from __future__ import annotations

import inspect
import math
import typing
from dataclasses import dataclass
from typing import Any, Callable

_TYPE_NAMES = {bool: "a bool", int: "an int", float: "a float", str: "a string"}


@dataclass(frozen=True)
class Range:
    """A closed, open or half-open numeric interval; ``None`` leaves a side unbounded."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value) -> bool:
        if isinstance(value, float) and math.isnan(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True

    def __str__(self) -> str:
        lo = "-inf" if self.low is None else f"{self.low:g}"
        hi = "inf" if self.high is None else f"{self.high:g}"
        left = "(" if self.low_open or self.low is None else "["
        right = ")" if self.high_open or self.high is None else "]"
        return f"in {left}{lo}, {hi}{right}"


@dataclass(frozen=True)
class OneOf:
    """One of a fixed set of values."""

    choices: tuple

    def __init__(self, *choices):
        object.__setattr__(self, "choices", tuple(choices))

    def __contains__(self, value) -> bool:
        return value in self.choices

    def __str__(self) -> str:
        return "one of " + ", ".join(repr(c) for c in self.choices)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a method: its type, default, allowed values and one line of help."""

    name: str
    type: type
    default: Any
    allowed: Any = None  # Range, OneOf, a constraint with convert() (gcomp.registry.Nested), or None
    help: str = ""

    def describe(self) -> str:
        allowed = f", {self.allowed}" if self.allowed is not None else ""
        text = f"{self.name}: {self.type.__name__} = {self.default!r}{allowed}"
        return f"{text}  -- {self.help}" if self.help else text

    def validate(self, method: str, value: Any) -> Any:
        """The value, converted where lossless (an int for a float; a constraint's ``convert``), or ``ValueError``."""
        if hasattr(self.allowed, "convert"):
            # the default as it is: checked at registration, when the method it names may not be registered yet
            if isinstance(value, str) and value == self.default:
                return value
            return self.allowed.convert(method, self.name, value)
        ok_type = {
            bool: lambda v: isinstance(v, bool),
            int: lambda v: isinstance(v, int) and not isinstance(v, bool),
            float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
            str: lambda v: isinstance(v, str),
        }.get(self.type, lambda v: isinstance(v, self.type))
        allowed = f" {self.allowed}" if self.allowed is not None else ""
        if not ok_type(value) or (self.type is float and isinstance(value, float) and math.isnan(value)):
            kind = _TYPE_NAMES.get(self.type, self.type.__name__)
            raise ValueError(f"{method}: parameter '{self.name}' must be {kind}{allowed}; got {value!r}")
        if self.type is float:
            try:
                value = float(value)
            except OverflowError:
                raise ValueError(f"{method}: parameter '{self.name}' must be a float{allowed}; "
                                 f"got {value!r}") from None
        if self.allowed is not None and value not in self.allowed:
            raise ValueError(f"{method}: parameter '{self.name}' must be{allowed}; got {value!r}")
        return value


def specs_from_signature(method: str, factory: Callable) -> dict[str, ParamSpec]:
    """Read ``ParamSpec`` s from a factory whose parameters all have defaults and type annotations."""
    hints = typing.get_type_hints(factory, include_extras=True)
    specs = {}
    for name, p in inspect.signature(factory).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise TypeError(f"{method}: the factory may not take *args or **kwargs")
        if p.default is p.empty:
            raise TypeError(f"{method}: parameter '{name}' needs a default")
        hint = hints.get(name, type(p.default))
        allowed, help_text = None, ""
        if typing.get_origin(hint) is typing.Annotated:
            base, *extras = typing.get_args(hint)
            for extra in extras:
                if isinstance(extra, (Range, OneOf)) or hasattr(extra, "convert"):
                    allowed = extra
                elif isinstance(extra, str):
                    help_text = extra
            hint = base
        specs[name] = ParamSpec(name, hint, p.default, allowed, help_text)
    return specs
