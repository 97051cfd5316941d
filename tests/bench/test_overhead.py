"""``gcomp bench --overhead`` on the CPU (what CI runs): every method's step beside plain DDP and PyTorch's hooks,
the codec's share, a row per failure; its models and their synthetic batches. Nothing here asserts a time."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from gcomp.bench import overhead, overhead_models
from gcomp.cli import main


@pytest.mark.slow
def test_a_brief_cpu_run_gives_every_method_a_row_beside_plain_ddp(tmp_path):
    out = tmp_path / "ovh"
    done = subprocess.run([sys.executable, "-m", "gcomp", "bench", "--overhead", "--steps", "3", "--warmup", "1",
                           "--profile-steps", "1", "--method", "fp16", "--method", "topk:ratio=0.01",
                           "--method", "pactrain", "--method", "torch:fp16", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads((out / "overhead.json").read_text())
    rows = {r["method"]: r for r in report["rows"]}
    assert list(rows) == ["ddp", "fp16", "topk:ratio=0.01", "pactrain", "torch:fp16"]
    assert rows["ddp"]["x_ddp"] == 1.0 and rows["ddp"]["codec_ms"] == 0.0
    for label, row in rows.items():
        assert "error" not in row, row
        assert row["step_ms"] > 0 and math.isfinite(row["x_ddp"]) and row["codec_ms"] >= 0, row
        assert (row["model"], row["device"], row["world"]) == ("mlp", "cpu", 1)
    assert rows["topk:ratio=0.01"]["codec_ms"] > 0 and rows["torch:fp16"]["hook_ms"] > 0
    assert report["config"]["model"] == "mlp" and report["config"]["batch"] == 64
    assert "| topk:ratio=0.01 |" in done.stdout and "x DDP" in done.stdout


def test_bad_options_are_refused_before_anything_runs(capsys):
    assert main(["bench", "--overhead", "--method", "nosuch"]) == 2
    assert "unknown gradient-compression method 'nosuch'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:  # refused by argparse, as every count of the command line
        main(["bench", "--overhead", "--steps", "0"])
    assert usage.value.code == 2 and "--steps: must be a whole number of at least 1; got 0" in capsys.readouterr().err
    assert main(["bench", "--overhead", "--model", "decoder:128"]) == 2
    assert "decoder:WIDTH,DEPTH" in capsys.readouterr().err
    assert main(["bench", "--overhead", "--model", "lenet"]) == 2
    assert "trains resnet50, decoder, mlp" in capsys.readouterr().err


def test_the_defaults_follow_the_device():
    cpu = overhead.OverheadConfig().resolved()
    assert (cpu.model, cpu.batch) == ("mlp", 64)
    cuda = overhead.OverheadConfig(device="cuda").resolved()
    assert cuda.model in ("resnet50", "decoder") and cuda.batch == (128 if cuda.model == "resnet50" else 8)
    assert set(overhead.DEFAULT_METHODS) >= {"torch:fp16", "torch:bf16", "torch:powersgd", "powersgd", "pactrain"}


@pytest.mark.parametrize("spec, kind, shapes", [
    ("mlp:32", "features", ((5, 64), (5,))),
    ("decoder:64,1", "tokens", ((5, 64), (5, 64))),
])
def test_models_train_a_step_on_their_synthetic_batch(spec, kind, shapes):
    model, got = overhead_models.build(spec)
    x, y = overhead_models.batch(model, got, 5, torch.device("cpu"), seed=0)
    assert got == kind and (tuple(x.shape), tuple(y.shape)) == shapes
    loss = overhead_models.loss(model(x), y)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())


def test_the_default_decoder_is_gpt2_small_sized():
    with torch.device("meta"):
        model, kind = overhead_models.build("decoder")
    assert kind == "tokens" and 123e6 < sum(p.numel() for p in model.parameters()) < 125e6
