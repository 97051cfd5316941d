"""examples/pactrain.py: pre-train, prune, fine-tune with pactrain and densely; the figures it prints add up.

One brief run on 2 spawned workers (a small MLP, 20 fine-tuning steps, ternary off and on) is parsed from its
``RESULT`` lines; the byte ratios are checked against what the model's size and kept count imply.
"""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gcomp.collectives.bitpack import lane_bits, packed_words
from gcomp.compressors.pactrain import scale_grid

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "pactrain.py"
HIDDEN, STEPS = 32, 20
RESULT = re.compile(r"^RESULT (.*)$", re.M)


def _load_example():
    sys.path.insert(0, str(EXAMPLE.parent))  # the example imports its helpers from examples/train.py
    try:
        spec = importlib.util.spec_from_file_location("gcomp_example_pactrain", EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(EXAMPLE.parent))
        sys.modules.pop("train", None)  # the example keeps its own references; no module "train" lingers


def _value(text: str):
    if text == "n/a":
        return None
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


def _results(out: str) -> dict[str, dict]:
    rows = {}
    for m in RESULT.finditer(out):
        fields = dict(item.split("=", 1) for item in m[1].split())
        rows[fields["run"]] = {k: _value(v) for k, v in fields.items()}
    return rows


@pytest.fixture(scope="module")
def brief(tmp_path_factory) -> tuple[str, Path]:
    checkpoint = tmp_path_factory.mktemp("pactrain") / "pretrained.pt"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(EXAMPLE), "--nproc", "2", "--both", "--epochs", "1", "--steps", str(STEPS),
           "--hidden", str(HIDDEN), "--pretrain-epochs", "2", "--checkpoint", str(checkpoint)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout, checkpoint


def test_runs_dense_and_both_pactrain_variants_with_sane_figures(brief):
    out, checkpoint = brief
    assert "2 worker(s)" in out and checkpoint.exists() and f"saved to {checkpoint}" in out
    rows = _results(out)
    assert list(rows) == ["dense", "pactrain", "pactrain+ternary"], out  # printed once, by rank 0 only
    weights = 64 * HIDDEN + HIDDEN * HIDDEN + HIDDEN * 10
    params = weights + 2 * HIDDEN + 10
    kept = (params - round(0.5 * weights)) / params  # GraSP removes exactly half of the Linear weights
    for r in rows.values():
        assert 0.0 <= r["acc_before"] <= 1.0 and 0.0 <= r["acc_after"] <= 1.0
        assert 0.0 < r["ratio"] <= 1.0 and r["steps"] == STEPS and r["params"] == params
    dense = rows["dense"]
    assert dense["ratio"] == 1.0 and dense["kept"] == 1.0 and dense["freezes"] is None
    for name in ("pactrain", "pactrain+ternary"):
        r = rows[name]
        assert r["kept"] == pytest.approx(kept, abs=1e-6)
        assert r["acc_before"] == rows["pactrain"]["acc_before"]  # the same pruned model
        assert r["freezes"] >= 1 and r["unfreezes"] == 0 and r["mask_mismatches"] == 0
        assert 1 < r["frozen_at"] < STEPS
        assert r["packed_buckets"] == STEPS - r["frozen_at"] + 1  # one bucket, packed from the freeze on
        assert r["ratio_frozen"] < r["ratio"] < 1.0  # the dense steps before the freeze cost more
    # Once frozen, ternary off sends the kept entries plus one counter: (kept * params + 1) / params.
    assert rows["pactrain"]["ratio_frozen"] == pytest.approx(kept + 1 / params, abs=2e-6)
    # Ternary on 2 ranks, in one round after its first packed step: 3-bit fields, 21 to an int64 word, the next
    # scale's counting lanes for the 6 parameters and 3 counts; the one two-round step adds little.
    one_round = 8 * (packed_words(round(kept * params), lane_bits(2)) + scale_grid.hist_words(6, 2) + 3)
    assert rows["pactrain+ternary"]["ratio_frozen"] == pytest.approx(one_round / (4 * params), abs=0.002)


def test_rejects_bad_configuration_before_starting(capsys):
    example = _load_example()
    for argv, message in ((["--ternary", "--both"], "--both already runs"),
                          (["--param", "ternary=true"], "not --param"),
                          (["--param", "ratio=0.1"], "has a parameter 'ratio'"),
                          (["--param", "clip=-1"], "clip"),
                          (["--prune-ratio", "1"], "--prune-ratio must be in [0, 1)")):
        with pytest.raises(SystemExit) as exc:
            example.parse_args(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err, argv
    args = example.parse_args(["--both", "--param", "clip=2.5"])
    assert args.variants == [False, True] and args.method_params == {"clip": 2.5}
