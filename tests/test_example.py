"""The examples and the README: they run, print what they promise, and say what the code does.

examples/train.py runs briefly on 2 workers (spawned by itself, and under torchrun); the README's
quick start runs under two torchrun agents (tests/test_readme.py runs every README snippet); the "add a
compressor" code of docs/add-a-method.md is the code of
examples/custom_compressor.py, which runs in its own process so its method never joins this session's
registry (the contract suite collects ``gcomp.available()``).
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gcomp
import gcomp.hook
from tests.distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
README = (ROOT / "README.md").read_text()
DOCS = ROOT / "docs"
BRIEF = ["--epochs", "1", "--steps", "3"]
ROW = re.compile(r"^(\S+)\s+([-\d.naninf]+)\s+([\d.]+)\s+(\d+)\s+([\d.]+)x\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$",
                 re.M)


def _load_train():
    spec = importlib.util.spec_from_file_location("gcomp_example_train", EXAMPLES / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = _load_train()


def _run(cmd: list[str]) -> str:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]


def _table(out: str) -> dict[str, dict]:
    rows = {}
    for m in ROW.finditer(out):
        rows[m[1]] = {"loss": float(m[2]), "accuracy": float(m[3]), "bytes_per_step": int(m[4]),
                      "ratio": float(m[5])}
    return rows


def _block_after(heading: str, text: str = README) -> str:
    """The first ```python block after a heading of the README (or of ``text``)."""
    start = text.index(heading)
    match = re.search(r"```python\n(.*?)```", text[start:], re.S)
    assert match, f"no python block after {heading!r}"
    return match[1]


@pytest.fixture(scope="module")
def spawned_output() -> str:
    return _run([sys.executable, str(EXAMPLES / "train.py"), "--nproc", "2", "--compressor", "identity,topk",
                 "--param", "topk.ratio=0.01", *BRIEF])


def test_train_spawns_workers_and_prints_accuracy_and_ratio(spawned_output):
    out = spawned_output
    assert "2 worker(s)" in out
    epoch_lines = [line for line in out.splitlines() if "epoch 1/1" in line]
    assert len(epoch_lines) == 2, out  # one per method, from rank 0 only
    assert all("test accuracy" in line and "compression ratio" in line for line in epoch_lines)
    assert out.count("final loss") == 1, out  # the comparison table, printed once
    rows = _table(out)
    assert set(rows) == {"identity", "topk"}, out
    dense_bytes = 4 * sum(p.numel() for p in train.make_model().parameters())
    assert rows["identity"]["bytes_per_step"] == dense_bytes
    assert rows["identity"]["ratio"] == 1.0
    assert rows["topk"]["ratio"] > 1.5 and rows["topk"]["bytes_per_step"] < dense_bytes / 1.5
    for r in rows.values():
        assert 0.0 <= r["accuracy"] <= 1.0 and math.isfinite(r["loss"])


def test_train_under_torchrun_matches_spawned_workers(spawned_output):
    out = _run(_torchrun(str(EXAMPLES / "train.py"), "--compressor", "identity,topk",
                         "--param", "topk.ratio=0.01", *BRIEF))
    assert "2 worker(s)" in out
    assert _table(out) == _table(spawned_output)  # same seed, same data, same shards: the same run


def test_param_routing():
    methods = ["identity", "topk"]
    assert train.method_params("identity", ["ratio=0.05"], methods) == {}
    assert train.method_params("topk", ["ratio=0.05"], methods) == {"ratio": 0.05}
    assert train.method_params("topk", ["topk.ratio=1"], methods) == {"ratio": 1}
    assert train.method_params("identity", ["topk.ratio=1"], methods) == {}
    with pytest.raises(ValueError, match="none of identity, topk has a parameter 'bits'"):
        train.method_params("topk", ["bits=4"], methods)
    with pytest.raises(ValueError, match="'fp16' is not among the compared"):
        train.method_params("topk", ["fp16.ratio=1"], methods)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        train.method_params("topk", ["ratio"], methods)
    assert [train.parse_value(t, None) for t in ("true", "False", "3", "0.5", "1e-3", "mean")] == \
        [True, False, 3, 0.5, 1e-3, "mean"]


@pytest.mark.parametrize("argv, message", [
    (["--compressor", "topk", "--param", "ratio=2"], "topk: parameter 'ratio' must be in (0, 1]; got 2"),
    (["--compressor", "topkk"], "did you mean 'topk'"),
    (["--compressor", "fp16,identity", "--param", "ratio=0.1"], "has a parameter 'ratio'"),
])
def test_train_rejects_bad_configuration_before_starting(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        train.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_custom_compressor_example_registers_and_trains():
    out = _run([sys.executable, str(EXAMPLES / "custom_compressor.py"), "--nproc", "2",
                "--compressor", "identity,absmax", "--param", "absmax.bits=4", *BRIEF])
    assert "absmax: Absmax quantisation" in out and "bits: int = 8, in [2, 8]" in out
    rows = _table(out)
    assert set(rows) == {"identity", "absmax"}, out
    assert rows["absmax"]["ratio"] > 1.5 and 0.0 <= rows["absmax"]["accuracy"] <= 1.0
    assert "absmax" not in gcomp.available()  # it ran in its own process


def test_readme_add_a_compressor_is_the_example_code():
    block = _block_after("# Add a compressor", (DOCS / "add-a-method.md").read_text())
    assert "@gcomp.register(" in block
    assert block in (EXAMPLES / "custom_compressor.py").read_text()


@pytest.mark.slow
def test_readme_snippet_runs_under_torchrun_on_two_nodes(tmp_path):
    """The README's quick start under two torchrun agents on one machine, as on two nodes (``--nnodes 2``,
    c10d rendezvous), as written: it compresses past DDP's warm-up step and exits cleanly."""
    snippet = _block_after("## Quick start")
    *body, last = snippet.strip().splitlines()
    assert "dist.destroy_process_group()" in last  # the README's last line, kept last
    script = tmp_path / "snippet.py"
    checks = ['assert state.stats["steps"] == 5 and state.stats["warmup_steps"] == 1, state.stats',
              'assert state.compression_ratio > 1, state.stats']
    script.write_text("\n".join([*body, *checks,
                                  'print(f"snippet ok on rank {dist.get_rank()}", flush=True)', last, ""]))
    port = str(free_port())
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "snippet", str(script)]
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    nodes = [subprocess.Popen(agent, cwd=ROOT, env={**env, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    for node, out in zip(nodes, outs):
        assert node.returncode == 0, out[-3000:]
    assert sorted(re.findall(r"snippet ok on rank (\d)", "".join(outs))) == ["0", "1"], outs


def test_readme_stats_match_the_hook():
    section = (DOCS / "statistics.md").read_text()
    readme_keys = set(re.findall(r"^\| `(\w+)`(?: / `(\w+)`)? \|", section, re.M))
    readme_keys = {k for pair in readme_keys for k in pair if k}
    assert readme_keys == set(gcomp.run_state.STAT_KEYS)


def test_readme_commands_are_the_makefile_and_ci():
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^run:", makefile, re.M) and re.search(r"^test:", makefile, re.M)
    assert "make run" in README and "make test" in README
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "make test"
    assert (ROOT / "constraints.txt").read_text().count("torch==2.13.0") == 1
    assert torch.__version__.split("+")[0] == "2.13.0"
