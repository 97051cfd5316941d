"""The bandwidth schedule's plot: each method's step time and cumulative time, step by step."""
from __future__ import annotations

import pytest

from gcomp.bench import plots

pytest.importorskip("matplotlib")


def _run(method: str, segments) -> dict:
    times = [0.02] * 10 + [0.2] * 10
    return {"method": method, "seed": 0, "bandwidth": "1gbit,100mbit@10", "step_times": times, "segments": segments,
            "history": [{"train_s": sum(times), "accuracy": 0.5}], "bytes_sent_per_step": 10.0, "step_s": 0.1,
            "compute_s_per_step": 0.0, "encode_s_per_step": 0.0, "decode_s_per_step": 0.0, "comm_s_per_step": 0.1}


def test_a_schedule_gets_a_step_time_plot_and_a_fixed_rate_none(tmp_path):
    segments = [{"rate": "1gbit", "from_step": 0, "steps": 10, "step_s": 0.02},
                {"rate": "100mbit", "from_step": 10, "steps": 10, "step_s": 0.2}]
    runs = [_run("identity", segments), _run("auto", segments)]
    made = plots.all_plots(runs, runs, tmp_path)
    assert made["step_times"] == tmp_path / "step_times.png" and made["step_times"].stat().st_size > 0
    fixed, elsewhere = [_run("identity", None)], tmp_path / "fixed"
    elsewhere.mkdir()
    assert "step_times" not in plots.all_plots(fixed, fixed, elsewhere)
