"""What ``gcomp bench`` and ``gcomp simulate`` check of their arguments before any work starts: numbers within
their bounds (an argparse ``type``, so a bad one is a usage error naming the option) and output folders that can
be created and written (a ValueError naming the folder and why)."""
from __future__ import annotations

import argparse
import math
import os
import tempfile
import textwrap
from pathlib import Path
from typing import Callable


def number(kind: type, low: float, strict: bool = False) -> Callable[[str], float]:
    """An argparse ``type`` reading ``kind`` (int or float), finite and at least ``low`` (above it when
    ``strict``); anything else is refused with the bound and the value, as argparse's own usage errors are."""
    what = "a whole number" if kind is int else "a number"
    bound = f"above {low:g}" if strict else f"of at least {low:g}"

    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"must be {what} {bound}; got {text}")
        return value

    convert.__name__ = f"{kind.__name__} {bound}"
    return convert


POSITIVE_INT = number(int, 1)  # workers, steps, batch sizes, seeds to run
COUNT = number(int, 0)  # epochs, warm-up steps: none is fine
POSITIVE = number(float, 0, strict=True)  # sizes, rates
NON_NEGATIVE = number(float, 0)  # latencies


def check_out(path: Path, flag: str = "--out") -> None:
    """A ValueError naming ``path`` and why when it cannot be a folder this process writes: a file on the way,
    or a place where nothing may be created. Leaves nothing behind: the nearest folder that exists is tried
    with a temporary file or folder, which is removed."""
    path = Path(path)
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        where = "it" if existing == path else str(existing)
        raise ValueError(f"{flag} {path}: cannot be a folder: {where} is a file; name a folder")
    try:
        if existing == path:
            handle, name = tempfile.mkstemp(dir=path, prefix=".gcomp-probe-")
            os.close(handle)
            os.unlink(name)
        else:
            os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".gcomp-probe-"))
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write there: creating a file in {existing} fails "
                         f"({err.strerror or err}); name a folder this user may write") from None


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every option of ``gcomp bench`` that a ``BenchConfig`` field backs says its default in --help."""
    from dataclasses import fields

    from gcomp.bench import runner
    config = runner.BenchConfig()
    shown = {f.name: getattr(config, f.name) for f in fields(config)}
    shown.update(method=", ".join(config.methods), target_accuracy="99% of all-reduce's best accuracy",
                 cache_dir="~/.cache/gcomp")
    for action in parser._actions:
        if shown.get(action.dest) is not None and "default" not in (action.help or ""):
            value = shown[action.dest]
            text = f"default: {value}" if not isinstance(value, list) else f"default: {', '.join(map(str, value))}"
            text = text.replace("%", "%%")  # argparse expands help with %-formatting
            action.help = f"{action.help} ({text})" if action.help else text


def files_line(out, paths) -> str:
    """Where a command wrote its files: the folder's full path on a line, then their names, wrapped within 100
    columns."""
    names = textwrap.wrap(", ".join(Path(p).name for p in paths), 98, break_on_hyphens=False)
    return "\n".join([f"written to {Path(out).resolve()}:"] + [f"  {line}" for line in names])
