"""examples/elastic.py under torchrun --max-restarts 1: rank 1 is SIGKILLed at step 7, torchrun restarts the
group, every rank resumes from the step-5 checkpoint (its own gcomp residuals included), and the final
parameters equal, bit for bit, those of a run that was never killed."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.models import assert_same_parameters, run_example

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "elastic.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
            "--max-restarts", "1"]


def _run(folder: Path, *extra: str) -> str:
    return run_example([*TORCHRUN, str(EXAMPLE), "--dir", str(folder), "--steps", "12", "--checkpoint-every", "5",
                        *extra])


@pytest.mark.slow
def test_a_killed_worker_restarts_and_resumes_the_same_trajectory(tmp_path):
    plain = _run(tmp_path / "plain")
    assert "RESUMED step=0 attempt=0" in plain and "DONE steps=12" in plain
    killed = _run(tmp_path / "killed", "--kill-at", "7")
    assert "KILLED step=7" in killed and "RESUMED step=5 attempt=1" in killed and "DONE steps=12" in killed
    assert re.search(r"exitcode: -9", killed), "the worker was not killed"
    assert_same_parameters(tmp_path / "plain" / "final.pt", tmp_path / "killed" / "final.pt")
