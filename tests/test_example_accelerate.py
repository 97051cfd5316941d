"""examples/accelerate_train.py under torchrun on 2 CPU processes: the hook ran (fewer bytes than dense), the
replicas agree, and resuming from ``accelerator.save_state`` ends bit-identical to the uninterrupted run
(topk: the file holds every rank's residuals). On one process the helper installs nothing."""
from __future__ import annotations

import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "accelerate_train.py"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _assert_replicas_identical(folder: Path) -> None:
    ranks = [torch.load(folder / f"final_rank{r}.pt", weights_only=True) for r in range(2)]
    assert ranks[0].keys() == ranks[1].keys()
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0]), "the replicas differ"


def _run(folder: Path, *extra: str) -> str:
    done = subprocess.run([*TORCHRUN, str(EXAMPLE), "--dir", str(folder), "--steps", "20", "--save-at", "8", *extra],
                          capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    return out


@pytest.mark.slow
def test_accelerate_example_compresses_and_resumes_bit_identically(tmp_path):
    whole = _run(tmp_path / "whole")
    sent, dense, steps = map(int, re.search(r"BYTES sent=(\d+) dense=(\d+) steps=(\d+)", whole).groups())
    assert steps == 20 and 0 < sent < dense / 4, whole[-2000:]
    _assert_replicas_identical(tmp_path / "whole")
    saved = torch.load(tmp_path / "whole" / "state" / "custom_checkpoint_0.pkl", weights_only=True)
    assert sorted(saved["ranks"]) == ["rank0", "rank1"]
    resumed = _run(tmp_path / "resumed", "--resume", str(tmp_path / "whole" / "state"))
    _assert_replicas_identical(tmp_path / "resumed")
    a = torch.load(tmp_path / "whole" / "final_rank0.pt", weights_only=True)
    b = torch.load(tmp_path / "resumed" / "final_rank0.pt", weights_only=True)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "the resumed run differs"


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
