"""Which method a check runs, in a form the worker processes rebuild it from: a registered name (with parameters),
or a module-level factory named by its module and qualified name."""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from typing import Any, Callable

import gcomp
from gcomp.fsdp.install import config_label
from gcomp.registry import load_entry_points


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _reference(factory: Callable) -> tuple[str, str]:
    """``(module, qualname)`` that import ``factory`` back, or TypeError saying why there is none."""
    module, qualname = getattr(factory, "__module__", None), getattr(factory, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        problem = f"it has no module and name to import it by (a {type(factory).__name__})"
    elif "<lambda>" in qualname:
        problem = "it is a lambda"
    elif "<locals>" in qualname:
        problem = "it is defined inside a function"
    else:
        try:
            found = _resolve(module, qualname)
        except Exception as err:  # noqa: BLE001 -- any failure to import it back is the answer
            problem = f"importing {module}.{qualname} back failed ({type(err).__name__}: {err})"
        else:
            problem = None if found == factory else f"{module}.{qualname} is another object"
    if problem is not None:
        raise TypeError(
            f"gcomp.testing: the method factory {factory!r} cannot be sent to the worker processes, which import "
            f"it by module and name: {problem}. Pass a function defined with def at the top level of an "
            "importable module (it takes no arguments and returns the configured method), or a registered name")
    return module, qualname


@dataclass(frozen=True)
class MethodSource:
    """A method the checks create in this process and in every rank process: ``name`` (``gcomp.create(name,
    **params)``), else ``factory``, ``(module, qualname)`` of a module-level callable taking no arguments. ``path``:
    this process's ``sys.path``, which a worker started before a plugin's directory was on it appends."""

    name: str | None = None
    factory: tuple[str, str] | None = None
    path: tuple[str, ...] = ()
    params: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def of(cls, name_or_factory: str | Callable, **params) -> "MethodSource":
        """A source for a registered name or a module-level factory (TypeError for anything else)."""
        if isinstance(name_or_factory, MethodSource):
            return name_or_factory
        if isinstance(name_or_factory, str):
            return cls(name=name_or_factory, path=tuple(sys.path), params=tuple(params.items()))
        if not callable(name_or_factory):
            raise TypeError("gcomp.testing: expected a registered method name or a module-level callable that "
                            f"returns a configured method; got {type(name_or_factory).__name__}")
        return cls(factory=_reference(name_or_factory), path=tuple(sys.path))

    @property
    def label(self) -> str:
        """The name (``name:key=value,...`` with parameters), or ``module:qualname`` of the factory."""
        return config_label(self.name, dict(self.params)) if self.name is not None else ":".join(self.factory)

    @property
    def registered(self) -> bool:
        return self.name is not None

    def _extend_path(self) -> None:
        """This process's ``sys.path`` extended by the source's (a plugin found after the process started)."""
        missing = [p for p in self.path if p not in sys.path]
        if missing:
            sys.path.extend(missing)
            importlib.invalidate_caches()
            load_entry_points(force=True)

    def create(self) -> Any:
        """A fresh, configured method."""
        if self.name is not None:
            if self.name not in gcomp.available():
                self._extend_path()  # an unknown name is left for gcomp.create to refuse
            return gcomp.create(self.name, **dict(self.params))
        try:
            factory = _resolve(*self.factory)
        except ImportError:
            self._extend_path()
            factory = _resolve(*self.factory)
        return factory()

    def install(self, model, **params) -> Any:
        """``gcomp.install`` of this method on ``model`` (a name with ``params``, else the factory's method)."""
        if self.name is None:
            return gcomp.install(model, self.create(), **params)
        if self.name not in gcomp.available():
            self._extend_path()
        return gcomp.install(model, self.name, **{**dict(self.params), **params})


def as_source(method: str | MethodSource) -> MethodSource:
    """A job's method argument as a ``MethodSource`` (a bare string is a registered name)."""
    return method if isinstance(method, MethodSource) else MethodSource(name=method)
