"""Ending a gloo run's process without the interpreter's shutdown.

A backend thread may still be finishing a collective's Python callbacks, or dropping its tensors, when a script's
last line returns (a trainer's own barrier or gather, PyTorch's hooks). CPython before 3.14 then ends that thread
inside a C++ destructor and the process aborts after all its work is done ("terminate called without an active
exception", SIGABRT), which torchrun reports as a failed run. ``end_process`` waits for gcomp's collectives,
flushes the output and leaves at once.
"""
from __future__ import annotations

import os
import sys


def end_process(code: int = 0, timeout: float = 5.0) -> None:
    """Settle gcomp's collectives (``timeout`` seconds at most), flush stdout and stderr, and end the process with
    ``code``, skipping the interpreter's shutdown (``atexit`` handlers and finalisers do not run: call it last)."""
    from gcomp.collectives import launch as futures  # only when ending: importing gcomp stays light

    futures.settle(timeout=timeout)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
