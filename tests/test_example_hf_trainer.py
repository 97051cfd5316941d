"""examples/hf_trainer.py on 2 CPU processes, as docs/integrations.md shows it: ``GcompCallback`` installs on
the DDP model the Trainer builds (fewer bytes than dense), ``gcomp_ratio`` is in the Trainer's logs, every
checkpoint folder holds every rank's state, and ``train(resume_from_checkpoint=...)`` loads it. On one process
the callback installs nothing and its state says so; a resumed run whose folder holds no gcomp state is an
error on every rank."""
from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
# importing the Trainer's callback API (transformers' trainer, accelerate) takes seconds on its own
pytestmark = pytest.mark.slow

from tests.distributed import run_ranks  # noqa: E402
from tests.models import run_example  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "hf_trainer.py"
SHOWN = "torchrun --nproc_per_node 2 examples/hf_trainer.py --dir /tmp/hf"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _example():
    spec = importlib.util.spec_from_file_location("gcomp_example_hf_trainer", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(folder: Path, *extra: str) -> tuple[dict, float]:
    out = run_example([*TORCHRUN, str(EXAMPLE), "--dir", str(folder), *extra], cwd=ROOT)
    stats = dict((k, int(v)) for k, v in re.findall(r"(\w+)=(\d+)", re.search(r"GCOMP (.*)", out).group(1)))
    return stats, float(re.search(r"LOGGED ratio=([\d.]+)", out).group(1))


def test_trainer_example_compresses_logs_checkpoints_and_resumes(tmp_path):
    assert SHOWN in (ROOT / "docs" / "integrations.md").read_text() and SHOWN in EXAMPLE.read_text()
    stats, logged = _run(tmp_path / "whole")  # 8 steps, checkpoints at 4 and 8
    assert stats["steps"] == 8 and 0 < stats["sent"] < stats["dense"] / 4, stats
    assert logged == pytest.approx(stats["dense"] / stats["sent"], rel=1e-6)
    checkpoint = tmp_path / "whole" / "checkpoint-4"
    saved = [torch.load(checkpoint / f"gcomp-rank{r}.pt", weights_only=True) for r in range(2)]
    assert [s["iteration"] for s in saved] == [4, 4] and sorted(p for s in saved for p in s["ranks"]) == [
        "rank0", "rank1"]
    stats, _ = _run(tmp_path / "resumed", "--resume", str(checkpoint))  # another output_dir
    assert stats["steps"] == 8 and stats["iteration"] == 8, stats  # 4 loaded, 4 run


def test_on_one_process_the_callback_installs_nothing_and_says_so(tmp_path):
    from accelerate.state import AcceleratorState
    from transformers import Trainer, TrainingArguments

    from gcomp.integrations.transformers import GcompCallback

    example = _example()
    callback = GcompCallback("topk", ratio=0.05)
    try:
        args = TrainingArguments(output_dir=str(tmp_path), max_steps=2, logging_steps=1, use_cpu=True,
                                 report_to=[], disable_tqdm=True, save_strategy="no")
        trainer = Trainer(model=example.tiny_gpt2(), args=args, train_dataset=example.RandomTokens(8, 8, 64),
                          callbacks=[callback])
        trainer.train()
    finally:
        AcceleratorState._reset_state(True)
    assert str(callback.state).startswith("gcomp: not distributed: nothing compressed (topk; one process")
    assert [row["gcomp_ratio"] for row in trainer.state.log_history if "loss" in row] == [1.0, 1.0]
    with pytest.raises(ValueError, match="ratio"):
        GcompCallback("topk", ratio=5.0)


def _resume_from_a_folder_without_every_rank(folder: str) -> str:
    import torch.distributed as dist

    from gcomp.integrations.transformers import _load, state_file

    if dist.get_rank() == 0:
        torch.save({}, state_file(folder, 0))
    dist.barrier()
    try:
        _load(Path(folder), None)
    except ValueError as err:
        return str(err)
    return "loaded"


def test_a_resume_without_every_ranks_gcomp_state_is_an_error_on_every_rank(tmp_path):
    for message in run_ranks(2, _resume_from_a_folder_without_every_rank, str(tmp_path)):
        assert message.startswith(f"gcomp: resuming from {tmp_path}, which holds no gcomp state for every rank"), \
            message
        assert "resume=False to start gcomp's state afresh" in message


def test_the_callback_waits_through_evaluation_and_refuses_training_outside_ddp(tmp_path):
    from types import SimpleNamespace

    from gcomp.integrations.transformers import GcompCallback

    callback, model = GcompCallback("topk", ratio=0.05), torch.nn.Linear(4, 2)
    callback.on_train_begin(SimpleNamespace(world_size=2, output_dir=str(tmp_path)), SimpleNamespace(global_step=0),
                            None, model=model)
    model.eval()(torch.randn(1, 4))  # eval_on_start: the Trainer evaluates the bare model
    assert callback.state is None and callback._pending is not None
    with pytest.raises(TypeError, match=r"GcompCallback needs the Trainer's DDP model \(several processes, no "
                                        r"DeepSpeed or FSDP\): the model's first forward ran outside DDP"):
        model.train()(torch.randn(1, 4))


def test_one_process_refuses_to_resume_a_distributed_runs_state(tmp_path):
    from types import SimpleNamespace

    from gcomp.integrations.transformers import GcompCallback, state_file

    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    for rank in range(2):
        torch.save({}, state_file(folder, rank))
    args, step = SimpleNamespace(world_size=1, output_dir=str(tmp_path)), SimpleNamespace(global_step=4)
    with pytest.raises(ValueError, match=r"checkpoint-4 holds a distributed run's gcomp state \(2 rank\(s\)\) but "
                                         r"this run is one process.*resume with as many processes as saved it, or "
                                         r"pass GcompCallback\(\.\.\., resume=False\)"):
        GcompCallback("topk", ratio=0.05).on_train_begin(args, step, None, model=torch.nn.Linear(4, 2))
    callback = GcompCallback("topk", resume=False, ratio=0.05)
    callback.on_train_begin(args, step, None, model=torch.nn.Linear(4, 2))
    assert str(callback.state).startswith("gcomp: not distributed")
