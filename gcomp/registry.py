"""Selection by name: ``register``, ``create``, ``available``, ``describe``, ``parse_spec``, ``method_from`` and the
``gcomp.methods`` entry points."""
from __future__ import annotations

import difflib
import inspect
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Union

from gcomp.method import Method, MethodUnit
from gcomp.params import ParamSpec, specs_from_signature

ENTRY_POINT_GROUP = "gcomp.methods"


class UnknownMethodError(ValueError):
    """No method is registered under that name."""


@dataclass(frozen=True)
class MethodSpec:
    """A registered method: its factory, parameters and where it comes from; ``variants``, parameter sets that put
    something else on the wire (the contract suites run each)."""

    name: str
    factory: Callable[..., MethodUnit]
    params: dict[str, ParamSpec]
    summary: str
    paper: str
    variants: tuple[dict, ...] = ()

    def create(self, **params) -> MethodUnit:
        unknown = set(params) - set(self.params)
        if unknown:
            raise ValueError(f"{self.name}: unknown parameter(s) {', '.join(sorted(unknown))}; "
                             f"accepted: {', '.join(self.params) or 'none'}")
        values = {n: s.default for n, s in self.params.items()}
        values.update({n: self.params[n].validate(self.name, v) for n, v in params.items()})
        method = self.factory(**values)
        method.name, method.params = self.name, values
        return method

    @property
    def serves_fsdp(self) -> bool:
        """Whether the method, with its defaults, serves FSDP2's reduce-scatter."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return self.create().serves_fsdp


_REGISTRY: dict[str, MethodSpec] = {}
_entry_points_loaded = False


def register(name: str, *, paper: str = "", override: bool = False, variants: tuple[dict, ...] = ()) -> Callable:
    """Decorator: register a factory ``(**params) -> MethodUnit`` under ``name``. Every parameter needs a default;
    ``Annotated[float, Range(0, 1), "help"]`` validates it at ``create``. ``variants``: parameter sets that put
    something else on the wire (the contract suites run each)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a method name must be a non-empty string; got {name!r}")

    def decorator(factory: Callable[..., MethodUnit]) -> Callable[..., MethodUnit]:
        if name in _REGISTRY and not override and _REGISTRY[name].factory is not factory:
            raise ValueError(f"a method named '{name}' is already registered (pass override=True to replace it)")
        doc = inspect.getdoc(factory) or ""
        params = specs_from_signature(name, factory)
        for p in params.values():
            try:
                p.validate(name, p.default)
            except ValueError as err:
                raise ValueError(f"the default of a registered method is invalid: {err}") from None
        _REGISTRY[name] = MethodSpec(name, factory, params,
                                     doc.split("\n\n")[0].replace("\n", " "), paper, tuple(variants))
        return factory

    return decorator


def load_entry_points(force: bool = False) -> None:
    """Import the ``gcomp.methods`` entry points: a module (importing it registers its methods) or a factory
    (registered under the entry point's name unless it registered itself)."""
    global _entry_points_loaded
    if _entry_points_loaded and not force:
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            obj = ep.load()
        except Exception as err:  # one broken plugin must not hide the built-ins or the other plugins
            warnings.warn(f"gcomp: could not load method plugin {ep.name!r} ({ep.value}): {err}", stacklevel=2)
            continue
        if ep.name not in _REGISTRY and callable(obj) and not inspect.ismodule(obj):
            register(ep.name)(obj)


def _spec(name: str) -> MethodSpec:
    load_entry_points()
    if isinstance(name, str) and ":" in name and name.partition(":")[0].strip() in _REGISTRY:
        raise UnknownMethodError(_spec_given_as_name(name))
    if name not in _REGISTRY:
        close = difflib.get_close_matches(name, _REGISTRY, n=3, cutoff=0.4) if isinstance(name, str) else []
        hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""
        raise UnknownMethodError(f"unknown gradient-compression method {name!r}{hint} "
                                 f"(registered: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name]


def _spec_given_as_name(text: str) -> str:
    """Why a spec (``"topk:ratio=0.1"``) is not a name, and the call that takes it."""
    try:
        name, params = parse_spec(text)
    except ValueError as err:
        return f"{text!r} is a method spec (name:key=value,...), not a name; and as a spec: {err}"
    call = ", ".join([repr(name)] + [f"{k}={v!r}" for k, v in params.items()])
    return (f"{text!r} is a method spec (name:key=value,...), not a name: gcomp.create and gcomp.install take the "
            f"name and its parameters as keywords ({call}); gcomp.registry.from_spec reads a spec")


def available(fsdp: bool = False) -> list[str]:
    """Sorted names of every registered method; with ``fsdp=True``, of those that serve FSDP2's reduce-scatter."""
    load_entry_points()
    return sorted(name for name, s in _REGISTRY.items() if not fsdp or s.serves_fsdp)


def create(name: str, **params) -> MethodUnit:
    """A configured ``Method``; parameters are validated here, before any training starts."""
    return _spec(name).create(**params)


def from_spec(text: str) -> MethodUnit:
    """``create`` of a method spec (``"topk:ratio=0.05"``, as ``parse_spec`` reads it)."""
    name, params = parse_spec(text)
    return create(name, **params)


def method_from(name_or_method: Union[str, MethodUnit], params: dict) -> MethodUnit:
    """A registered name (``params`` go to ``create``, validated there) or a method built by hand."""
    if isinstance(name_or_method, str):
        return create(name_or_method, **params)
    if isinstance(name_or_method, MethodUnit):
        if params:
            raise ValueError(f"parameters {sorted(params)} were given with an already created method; "
                             "pass them to gcomp.create instead")
        return name_or_method
    raise TypeError(f"name_or_method must be a method name or a gcomp.Method; got {type(name_or_method).__name__}")


def parse_spec(text: str) -> tuple[str, dict]:
    """``"topk:ratio=0.05"`` (or a bare name) -> the name and its parameters, each typed by its declaration (a bool
    is true, false, 1 or 0). Only the text is checked; ``create`` validates the values."""
    text = text.strip()
    name, _, rest = text.partition(":")
    declared = _spec(name).params
    params = {}
    for item in rest.split(",") if rest else ():
        if not item.strip():
            raise ValueError(f"{text!r}: an empty parameter (two commas in a row, or one at an end); write "
                             f"{name}:key=value,key=value")
        key, eq, value = item.partition("=")
        if not eq or key not in declared:
            raise ValueError(f"{text!r}: expected key=value with a parameter of {name} "
                             f"({', '.join(declared) or 'none'}); got {item!r}")
        if key in params:
            raise ValueError(f"{text!r}: parameter {key!r} of {name} is given twice; give it once")
        try:
            params[key] = _typed(value, declared[key].type)
        except ValueError as err:
            raise ValueError(f"{text!r}: parameter {key!r} of {name} must be a {declared[key].type.__name__}: "
                             f"{err}") from None
    return name, params


def spec_argument(text: str) -> tuple[str, dict]:
    """``parse_spec`` as an argparse ``type`` (argparse would replace a ValueError's message with "invalid value")."""
    import argparse

    try:
        return parse_spec(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _typed(value: str, kind: type):
    if kind is bool:
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError(f"expected true or false, got {value!r}")
        return value.lower() in ("true", "1")
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"got {value!r}") from None


def spec(name: str) -> MethodSpec:
    """The registration record of ``name`` (factory, parameter specs, summary)."""
    return _spec(name)


def describe(name: str) -> str:
    """A human-readable description: summary, collective, wire format, parameters with defaults and ranges."""
    s = _spec(name)
    method = s.create()
    parts = (f" ({type(method.compressor).__name__} + {type(method.memory).__name__} + "
             f"{type(method.communicator).__name__})" if isinstance(method, Method) else f" ({type(method).__name__})")
    lines = [f"{name}: {s.summary}",
             f"  collective: {method.collective or 'that of the method chosen per bucket'}{parts}",
             f"  lossless: {'yes' if method.lossless else 'no'}; state across steps: "
             f"{'yes' if method.stateful else 'no'}",
             "  FSDP2: " + (f"serves fully_shard's reduce-scatter (rows: {method.traits.rows})"
                           if method.serves_fsdp else "no (DDP only)")]
    if s.paper:
        lines.append(f"  paper: {s.paper}")
    lines.append("  parameters:" if s.params else "  parameters: none")
    lines += [f"    {p.describe()}" for p in s.params.values()]
    doc = inspect.getdoc(type(method.compressor) if isinstance(method, Method) else type(method)) or ""
    if doc:
        lines.append("  on the wire: " + doc.split("\n\n")[0].replace("\n", " "))
    return "\n".join(lines)


@dataclass(frozen=True)
class Nested:
    """Another registered method as a parameter's value: a spec (``"topk:ratio=0.05"``) or a ``Method`` made by
    ``gcomp.create``. Validation returns its canonical spec (the parameters off their defaults, in declared order),
    plain text that prints, compares and checkpoints; the factory creates the method anew from it."""

    def __str__(self) -> str:
        return "a method spec (name or name:key=value,...) or a Method from gcomp.create"

    def convert(self, method: str, param: str, value: Any) -> str:
        """``value``'s canonical spec, or ``ValueError`` naming ``method`` and ``param``."""
        if isinstance(value, MethodUnit):
            if value.name not in available():
                raise ValueError(f"{method}: parameter '{param}' takes a Method made by gcomp.create, which records "
                                 f"its name and parameters; got one named {value.name!r}")
            name, params = value.name, value.params
        elif isinstance(value, str):
            try:
                name, params = parse_spec(value)
            except UnknownMethodError as err:
                raise ValueError(f"{method}: parameter '{param}' must name a registered method; got {value!r} "
                                 f"({err})") from None
            except ValueError as err:
                raise ValueError(f"{method}: parameter '{param}': {err}") from None
        else:
            raise ValueError(f"{method}: parameter '{param}' must be {self}; got {value!r}")
        declared = spec(name).params
        try:
            values = {k: declared[k].validate(name, v) for k, v in params.items()}
        except ValueError as err:
            raise ValueError(f"{method}: parameter '{param}': {err}") from None
        changed = [f"{k}={_text(values[k])}" for k in declared if k in values and values[k] != declared[k].default]
        return f"{name}:{','.join(changed)}" if changed else name


def _text(value: Any) -> str:
    """A parameter's value as ``registry.parse_spec`` reads it back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value) if isinstance(value, float) else str(value)
