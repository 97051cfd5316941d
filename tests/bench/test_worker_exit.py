"""A bench worker leaves without the interpreter's shutdown, its output flushed and its exit code kept; an error
it raises is recorded for the parent first (``gcomp.bench.failures``)."""
from __future__ import annotations

import subprocess
import sys


def test_exit_now_flushes_and_keeps_the_code():
    code = ("import sys; from gcomp.bench.worker import _exit_now; print('rows written'); "
            "print('a warning', file=sys.stderr); _exit_now(3)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3
    assert done.stdout == "rows written\n" and done.stderr == "a warning\n"


def test_the_worker_module_ends_through_it():
    source = open(sys.modules["gcomp"].__path__[0] + "/bench/worker.py").read()
    assert source.rstrip().endswith('if __name__ == "__main__":\n    with once_per_cause():\n        code = recorded(main)  '
                                    "# an error is written for the parent's message, then raised\n"
                                    "    _exit_now(code)")
