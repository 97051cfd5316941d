"""The race's plots read at a glance: the time axis ends shortly after the last run reached the target, PyTorch's
hooks are dashed, and the time-to-accuracy bars carry their values (read from the figures' objects, not pixels)."""
from __future__ import annotations

import pytest

from gcomp.bench import plots


def _run(method: str, reached_at: float | None, end: float) -> dict:
    history = [{"step": i, "train_s": end * i / 4, "accuracy": 0.2 * i} for i in range(1, 5)]
    return {"method": method, "history": history, "time_to_target_s": reached_at, "target_accuracy": 0.6,
            "seed": 0}


def test_the_time_axis_ends_past_the_last_time_to_target():
    runs = [_run("identity", 30.0, 41.0), _run("pactrain", 4.0, 8.0), _run("topk", None, 10.0)]
    assert plots.accuracy_xlim(runs) == pytest.approx(1.15 * 30.0)
    runs[0]["time_to_target_s"] = 6.0  # all-reduce reached the target early, then trained on to 41 s
    assert plots.accuracy_xlim(runs) == pytest.approx(1.15 * 6.0)
    assert plots.accuracy_xlim([_run("identity", None, 41.0)]) is None  # none reached: the whole curves
    assert plots.accuracy_xlim([_run("identity", 40.0, 41.0)]) is None  # it would cut nothing


def test_torch_hooks_are_dashed_and_the_axis_is_cut():
    plt = pytest.importorskip("matplotlib.pyplot")
    runs = [_run("identity", 6.0, 41.0), _run("torch:allreduce", 6.5, 40.0), _run("fp16", 3.0, 20.0)]
    fig, ax = plots.accuracy_axes(plt, runs, False)
    styles = {line.get_label(): line.get_linestyle() for line in ax.get_lines()}
    plt.close(fig)
    assert styles["torch:allreduce"] == "--" and styles["identity"] == "-" and styles["fp16"] == "-"
    assert ax.get_xlim()[1] == pytest.approx(1.15 * 6.5)


def test_time_to_accuracy_bars_carry_their_values():
    plt = pytest.importorskip("matplotlib.pyplot")
    entries = [{"method": "identity", "tta_speedup": 1.0, "target_accuracy": 0.6},
               {"method": "pactrain", "tta_speedup": 2.345, "target_accuracy": 0.6},
               {"method": "topk", "tta_speedup": None, "target_accuracy": 0.6}]
    fig, ax = plots.tta_axes(plt, entries, False)
    texts = [t.get_text() for t in ax.texts]
    plt.close(fig)
    assert "1.00x" in texts and "2.35x" in texts and "not reached" in texts
    assert ax.get_xlim() == (-0.5, 2.5)  # the last method, with no bar, is still in view
