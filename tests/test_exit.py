"""A run that ends right after its last step exits cleanly: the backend's worker threads are done with gcomp's
collectives before the interpreter shuts down (``gcomp.collectives.launch``). Without that, each process below
aborts with "terminate called without an active exception" (SIGABRT) after printing DONE."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import free_port

JOBS = Path(__file__).resolve().parent / "exit_jobs.py"


def _run_two_ranks() -> list[str]:
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, str(JOBS), str(rank), "2", port], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    outs = []
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"rank {rank} exited with {proc.returncode}:\n{out[-3000:]}"
        outs.append(out)
    return outs


@pytest.mark.slow
def test_a_callback_still_running_at_the_end_does_not_abort_the_exit():
    outs = _run_two_ranks()
    for rank, out in enumerate(outs):
        # settled at the end of each backward pass, not only at exit
        assert f"STEPPED rank={rank} in_flight=0" in out, out
        assert f"DONE rank={rank}" in out, out
