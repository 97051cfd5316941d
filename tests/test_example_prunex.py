"""examples/prunex.py: dense and prunex over 2 simulated nodes x 2; the figures it prints add up.

One brief run (4 spawned workers, 4 epochs: 1 plain, 1 with the ADMM penalty, the hard prune, 2 more) is parsed
from its ``RESULT`` lines: the dense run's leader sends the whole model across nodes each step, prunex's
sends the kept entries plus one flag entry (the model is one DDP bucket), and the prune was noticed.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULT = re.compile(r"^RESULT (.*)$", re.M)


def test_brief_run_reports_consistent_inter_node_bytes():
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, str(ROOT / "examples" / "prunex.py"), "--nproc", "4", "--ranks-per-node", "2",
           "--epochs", "4", "--admm-start", "1", "--admm-epochs", "1", "--interval", "3"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Warning" not in out.stderr, out.stderr[-3000:]
    rows = {}
    for m in RESULT.finditer(out.stdout):
        fields = dict(item.split("=", 1) for item in m[1].split())
        rows[fields["run"]] = fields
    dense, prunex = rows["dense"], rows["prunex"]
    params = int(dense["params"])
    assert float(dense["inter_bytes_per_step"]) == params * 4
    kept = round(float(prunex["kept"]) * params)
    assert 0.35 < kept / params < 0.5  # 60% of the convolutions' filters pruned, the classifier whole
    assert float(prunex["inter_bytes_per_step"]) == (kept + 1) * 4
    assert int(prunex["unfreezes"]) == 1 and prunex["pruned_norm"] != "n/a"
    assert "hard prune after 2 epochs" in out.stdout
