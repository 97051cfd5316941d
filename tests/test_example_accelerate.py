"""examples/accelerate_train.py under torchrun on 2 CPU processes: the hook ran (fewer bytes than dense), the
replicas agree, and resuming from ``accelerator.save_state`` ends bit-identical to the uninterrupted run
(topk: the file holds every rank's residuals). On one process the helper installs nothing."""
from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from tests.models import assert_same_parameters, run_example  # noqa: E402

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "accelerate_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _run(folder: Path, *extra: str) -> str:
    return run_example([*TORCHRUN, str(EXAMPLE), "--dir", str(folder), "--steps", "20", "--save-at", "8", *extra])


@pytest.mark.slow
def test_accelerate_example_compresses_and_resumes_bit_identically(tmp_path):
    whole = _run(tmp_path / "whole")
    sent, dense, steps = map(int, re.search(r"BYTES sent=(\d+) dense=(\d+) steps=(\d+)", whole).groups())
    assert steps == 20 and 0 < sent < dense / 4, whole[-2000:]
    assert_same_parameters(*(tmp_path / "whole" / f"final_rank{r}.pt" for r in range(2)))
    saved = torch.load(tmp_path / "whole" / "state" / "custom_checkpoint_0.pkl", weights_only=True)
    assert sorted(saved["ranks"]) == ["rank0", "rank1"]
    _run(tmp_path / "resumed", "--resume", str(tmp_path / "whole" / "state"))
    assert_same_parameters(*(tmp_path / "resumed" / f"final_rank{r}.pt" for r in range(2)))
    assert_same_parameters(tmp_path / "whole" / "final_rank0.pt", tmp_path / "resumed" / "final_rank0.pt")


def test_on_one_process_the_helper_installs_nothing_and_says_so(caplog):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from gcomp.integrations import accelerate as gcomp_accelerate

    try:
        accelerator = Accelerator(cpu=True)
        model = accelerator.prepare(nn.Linear(4, 2))
        with caplog.at_level(logging.INFO, logger="gcomp"):
            assert gcomp_accelerate.install(accelerator, model, "topk", ratio=0.05) is None
        assert any("no hook installed" in r.message for r in caplog.records if r.name == "gcomp")
        assert accelerator._custom_objects == []
        with pytest.raises(ValueError, match="ratio"):
            gcomp_accelerate.install(accelerator, model, "topk", ratio=5.0)
    finally:
        AcceleratorState._reset_state(True)
