"""examples/accelerate_train.py launched on 2 CPU processes by the line docs/integrations.md shows: the hook ran
(fewer bytes than dense), the replicas agree, and resuming from ``accelerator.save_state`` ends bit-identical to
the uninterrupted run (topk: the file holds every rank's residuals). On one process the helper installs nothing
and says so in the state it returns; an Accelerator that runs each launched process alone, or a model not
prepared, is an error naming the fix."""
from __future__ import annotations

import logging
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("accelerate")

from tests.models import assert_same_parameters, run_example  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "accelerate_train.py"
# As the docs and the example show it: on CPU, --multi_gpu is Accelerate's route to several processes (torchrun);
# --cpu starts one process whatever --num_processes says (several only through MPI)
LAUNCH = "accelerate launch --multi_gpu --num_processes 2 --main_process_port 0 examples/accelerate_train.py"


def _run(folder: Path, *extra: str) -> str:
    accelerate, *rest = shlex.split(LAUNCH)
    cmd = [str(Path(sys.executable).parent / accelerate), *rest]  # the venv's own accelerate
    return run_example([*cmd, "--dir", str(folder), "--steps", "20", "--save-at", "8", *extra], cwd=ROOT)


def test_the_launch_line_is_the_one_the_docs_show():
    assert LAUNCH in (ROOT / "docs" / "integrations.md").read_text()
    assert LAUNCH in EXAMPLE.read_text()


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
            state = gcomp_accelerate.install(accelerator, model, "topk", ratio=0.05)
        assert str(state).startswith("gcomp: not distributed: nothing compressed (topk; one process")
        assert state.stats["bytes_sent"] == 0 and state.compression_ratio == 1.0
        assert any("no hook installed" in r.message for r in caplog.records if r.name == "gcomp")
        assert accelerator._custom_objects == []
        with pytest.raises(ValueError, match="ratio"):
            gcomp_accelerate.install(accelerator, model, "topk", ratio=5.0)
    finally:
        AcceleratorState._reset_state(True)


def test_an_accelerator_that_runs_each_launched_process_alone_is_refused(monkeypatch):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    from gcomp.integrations import accelerate as gcomp_accelerate

    try:
        accelerator = Accelerator()  # on CPU without cpu=True: one process, whatever the launcher started
        model = accelerator.prepare(nn.Linear(4, 2))
        monkeypatch.setenv("WORLD_SIZE", "2")
        with pytest.raises(ValueError, match=r"Accelerate runs this process alone though 2 were launched .*"
                                             r"Accelerator\(cpu=True\), launched by `accelerate launch "
                                             r"--multi_gpu --num_processes N` or torchrun"):
            gcomp_accelerate.install(accelerator, model, "topk", ratio=0.05)
    finally:
        AcceleratorState._reset_state(True)


def test_gcomp_install_under_accelerate_names_prepare_and_the_helper():
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    import gcomp

    try:
        Accelerator(cpu=True)
        with pytest.raises(TypeError, match=r"got Linear\. Under Accelerate: call accelerator.prepare\(model\) "
                                            r"first, then gcomp.integrations.accelerate.install\(accelerator, "
                                            r"model, \.\.\.\)"):
            gcomp.install(nn.Linear(4, 2), "topk", ratio=0.05)
    finally:
        AcceleratorState._reset_state(True)
    with pytest.raises(TypeError, match=r"Wrap it first: DistributedDataParallel\(model\)"):
        gcomp.install(nn.Linear(4, 2), "topk", ratio=0.05)  # the Accelerator is gone: plain advice again
