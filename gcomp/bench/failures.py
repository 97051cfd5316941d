"""A benchmark worker's failure told to the parent: a worker that raises writes its error's line (the exception's
type and the first line of its message) beside its config before the traceback ends it, and the parent's message
names the first one written. The first is the cause: the others fail after it, when its rank leaves the group
("Connection reset by peer")."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Callable, Sequence


class WorkersFailed(RuntimeError):
    """The benchmark's workers ended with an error; the message names the first worker's and its rank."""


def error_path(config_path: Path, rank: int) -> Path:
    """Where the worker of ``rank`` launched with ``config_path`` writes its error's line."""
    return Path(config_path).with_name(f"{Path(config_path).stem}.rank{rank}.error")


def recorded(main: Callable[[list[str]], int], argv: list[str] | None = None) -> int:
    """``main(argv)`` (argv: ``[CONFIG.json]``); an exception it raises is written to ``error_path`` (rank from
    ``RANK``) and raised again, so its traceback still reaches the worker's stderr."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        return main(argv)
    except Exception as err:
        lines = str(err).strip().splitlines()
        line = f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__
        try:
            error_path(Path(argv[0]), int(os.environ.get("RANK", 0))).write_text(
                json.dumps({"time": time.time(), "error": line}))
        except (OSError, IndexError, ValueError):
            pass  # the traceback below still says it
        raise


def clear(config_path: Path, workers: int) -> None:
    """Remove the error lines an earlier launch with the same config path left."""
    for rank in range(workers):
        error_path(config_path, rank).unlink(missing_ok=True)


def check(codes: Sequence[int], config_path: Path) -> None:
    """``WorkersFailed`` when any exit code is not 0, naming the first error a worker wrote (and its rank), or,
    when none wrote one, the signals that ended them."""
    if not any(codes):
        return
    written = []
    for rank in range(len(codes)):
        try:
            entry = json.loads(error_path(config_path, rank).read_text())
            written.append((float(entry["time"]), rank, str(entry["error"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    shown = ", ".join(_code(c) for c in codes)
    if written:
        _, rank, line = min(written)
        cause = f"; rank {rank} failed first: {line}"
    else:
        cause = "; none raised a Python error (a crash or a signal)"
    raise WorkersFailed(f"benchmark workers failed (exit codes {shown}){cause}. Their full output is above")


def _code(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            pass
    return str(code)
