"""What keeps the benchmarks' output short: each warning once per run, the profiler's own lines held back, and
progress as a bar on a terminal (a few summary lines elsewhere).

- ``once_per_cause()``: within it, a warning whose category and text were shown already is not shown again.
  Python's own "once per location" does not hold over a run: every ``warnings.catch_warnings`` (PyTorch enters
  many) resets the registries, so one cause (a method warning at every install) printed once per bucket size.
- ``held_back_profiler_lines()``: PyTorch's profiler (kineto) writes ``USDT: ... profiler_start``/``stop`` to
  file descriptor 2 at every start and stop, and c10 a ``CPUAllocator`` note on a block allocated before it
  started, whatever the log level. Within it, fd 2 goes to a temporary file; on leaving, every other line is
  written back to stderr, so nothing else is lost.
- ``on_terminal()``: whether stdout is a terminal, where a bar redraws in place.
"""
from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
import warnings

PROFILER_NOISE = re.compile(r"^(USDT|STAGE):.*profiler|CPUAllocator\.cpp.*before the profiling started")


@contextlib.contextmanager
def once_per_cause():
    """Show each warning (category and message text) once within the block, however often it is raised, on
    one line (without the line of source that raised it)."""
    shown: set[tuple[type, str]] = set()
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        key = (category, str(message))
        if key in shown:
            return
        shown.add(key)
        previous(message, category, filename, lineno, file, "" if line is None else line)  # no source line

    warnings.showwarning = show
    try:
        yield shown
    finally:
        if warnings.showwarning is show:
            warnings.showwarning = previous


@contextlib.contextmanager
def held_back_profiler_lines():
    """fd 2 into a temporary file within the block; then every line but the profiler's own back to stderr."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no fd 2 to redirect: nothing to hold back
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = [line for line in held.read().decode(errors="replace").splitlines(keepends=True)
                    if not PROFILER_NOISE.search(line)]
            if rest:
                sys.stderr.write("".join(rest))
                sys.stderr.flush()


def on_terminal(stream=None) -> bool:
    """Whether ``stream`` (stdout by default) is a terminal."""
    stream = sys.stdout if stream is None else stream
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """Progress over ``total`` items: a tqdm bar on a terminal (else a ``\\r`` line); nothing elsewhere, where
    the caller prints its few summary lines."""

    def __init__(self, total: int, label: str, shown: bool | None = None, stream=None):
        self.stream = sys.stdout if stream is None else stream
        self.shown = on_terminal(self.stream) if shown is None else shown
        self.total, self.label, self.done, self._bar = total, label, 0, None
        if self.shown:
            try:
                from tqdm import tqdm
                self._bar = tqdm(total=total, desc=label, leave=False, file=self.stream, dynamic_ncols=True)
            except ImportError:
                pass

    def update(self, text: str = "") -> None:
        self.done += 1
        if not self.shown:
            return
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)
            self._bar.update()
        else:
            self.stream.write(f"\r{self.label} {self.done}/{self.total} {text}"[:99].ljust(99))
            self.stream.flush()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.shown:
            self.stream.write("\r" + " " * 99 + "\r")
            self.stream.flush()
