"""A comparison's plots (PNG, matplotlib where installed): accuracy against time, time to accuracy, bytes and
the step's breakdown for the first bandwidth, one plot per sweep (bandwidth, prune ratio), and for a bandwidth
schedule each method's step time and cumulative time, step by step.

A run that never reached the target gets no bar and a "not reached" label, never a bar of height 0; the others
carry their value. The accuracy plot ends shortly after the last run reached the target (``accuracy_xlim``;
results.json keeps the whole curves), and PyTorch's hooks are dashed.
"""
from __future__ import annotations

import math
from pathlib import Path


def all_plots(runs: list[dict], entries: list[dict], out: Path) -> dict[str, Path]:
    """Every plot that applies; ``entries`` are the summary's (``gcomp.bench.race.summarise``) or the runs
    themselves. Returns {kind: path}; nothing when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    if not runs:
        return {}
    first_bandwidth = runs[0].get("bandwidth")
    first_seed = runs[0].get("seed")
    ratios = {r.get("prune_ratio") for r in runs if r.get("prune_ratio") is not None}
    at_first = [e for e in entries if e.get("bandwidth") == first_bandwidth]
    made = {
        "accuracy": _accuracy(plt, [r for r in runs if r.get("bandwidth") == first_bandwidth
                                    and r.get("seed") == first_seed], len(ratios) > 1, out),
        "tta": _tta(plt, at_first, len(ratios) > 1, out),
        "bytes": _bars(plt, at_first, "bytes_sent_per_step", "bytes per step (rank 0)", "bytes on the wire per step",
                       out / "bytes_per_step.png", len(ratios) > 1, log=True),
        "breakdown": _breakdown(plt, at_first, len(ratios) > 1, out),
    }
    if len({r.get("bandwidth") for r in runs}) > 1:
        made["bandwidth_sweep"] = _bandwidth_sweep(plt, entries, len(ratios) > 1, out)
    if len(ratios) > 1:
        made["prune_sweep"] = _prune_sweep(plt, at_first, out)
    scheduled = [r for r in runs if r.get("segments") and r.get("step_times") and r.get("seed") == first_seed]
    if scheduled:
        made["step_times"] = _step_times(plt, scheduled, out)
    return made


def _label(entry: dict, with_ratio: bool) -> str:
    ratio = entry.get("prune_ratio")
    return entry["method"] + (f" @{ratio:g}" if with_ratio and ratio is not None else "")


X_MARGIN = 1.15  # the accuracy plot ends this far past the last run's time to the target


def accuracy_xlim(runs: list[dict], margin: float = X_MARGIN) -> float | None:
    """Where the accuracy plot's time axis ends: ``margin`` times the latest time to the target among the runs
    that reached it, so that the race, not a slow run's tail, fills the plot (results.json keeps the whole
    curves); None (the whole curves) when no run reached it, or when that would cut no curve."""
    times = [r["time_to_target_s"] for r in runs if r.get("time_to_target_s") is not None]
    ends = [r["history"][-1]["train_s"] for r in runs if r.get("history")]
    if not times or not ends:
        return None
    limit = margin * max(times)
    return limit if limit < max(ends) else None


def line_style(method: str) -> str:
    """PyTorch's own hooks (``torch:*``) dashed, gcomp's methods solid: where both overlap, both show."""
    return "--" if method.startswith("torch:") else "-"


def accuracy_axes(plt, runs, with_ratio):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        ax.plot([h["train_s"] for h in r["history"]], [h["accuracy"] for h in r["history"]], marker=".",
                linestyle=line_style(r["method"]), label=_label(r, with_ratio))
    if runs and runs[0].get("target_accuracy"):
        ax.axhline(runs[0]["target_accuracy"], color="grey", linestyle=":", label="target")
    seed = runs[0].get("seed") if runs else None
    limit = accuracy_xlim(runs)
    if limit is not None:
        ax.set_xlim(0, limit)
    ax.set(xlabel="training time (s)" + (" (cut after the last run reached the target)" if limit else ""),
           ylabel="test accuracy", title="accuracy against wall time" + (f" (seed {seed})" if seed is not None else ""))
    ax.legend(fontsize=7)
    return fig, ax


def _accuracy(plt, runs, with_ratio, out):
    fig, _ = accuracy_axes(plt, runs, with_ratio)
    return _save(fig, out / "accuracy_vs_time.png", plt)


def _errors(entries, key):
    """Error bars (below, above) from each entry's range over seeds; zero where it has none or never reached;
    None (no bars) where no entry summarises several seeds."""
    if all(e.get("seeds", 1) < 2 for e in entries):
        return None
    low, high = [], []
    for e in entries:
        span = e.get("ranges", {}).get(key)
        value = e.get(key)
        if span is None or value is None:
            low.append(0.0)
            high.append(0.0)
        else:
            low.append(max(value - span[0], 0.0))
            high.append(max(span[1] - value, 0.0) if span[1] != float("inf") else 0.0)
    return [low, high]


def tta_axes(plt, entries, with_ratio):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [_label(e, with_ratio) for e in entries]
    heights = [e["tta_speedup"] if e.get("tta_speedup") is not None else float("nan") for e in entries]
    bars = ax.bar(names, heights, yerr=_errors(entries, "tta_speedup"), capsize=3)  # NaN: no bar, the label says why
    ax.bar_label(bars, labels=["" if math.isnan(h) else f"{h:.2f}x" for h in heights], fontsize=7, padding=2)
    for i, e in enumerate(entries):
        if e.get("tta_speedup") is None:
            ax.annotate("not reached" if e.get("target_accuracy") is not None else "no target", (i, 1.0),
                        ha="center", va="bottom", rotation=90, fontsize=7, color="firebrick")
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set_xlim(-0.5, len(entries) - 0.5)  # a run with no bar at the end still shows, with its label
    seeds = max((e.get("seeds", 1) for e in entries), default=1)
    ax.set(ylabel="time-to-accuracy speedup over all-reduce",
           title="time to accuracy (1: all-reduce)" + (f", median and range of {seeds} seeds" if seeds > 1 else ""))
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    return fig, ax


def _tta(plt, entries, with_ratio, out):
    fig, _ = tta_axes(plt, entries, with_ratio)
    return _save(fig, out / "time_to_accuracy.png", plt)


def _bars(plt, entries, key, ylabel, title, path, with_ratio, log=False):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar([_label(e, with_ratio) for e in entries], [e[key] for e in entries])
    ax.set(ylabel=ylabel, yscale="log" if log else "linear", title=title)
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    return _save(fig, path, plt)


def _breakdown(plt, entries, with_ratio, out):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [_label(e, with_ratio) for e in entries]
    bottom = [0.0] * len(entries)
    for key, label in (("compute_s_per_step", "compute"), ("encode_s_per_step", "encode"),
                       ("comm_s_per_step", "communicate"), ("decode_s_per_step", "decode")):
        values = [1000 * (e.get(key) or 0.0) for e in entries]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel="ms per step", title="where a step's time goes")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    return _save(fig, out / "time_breakdown.png", plt)


def _bandwidth_sweep(plt, entries, with_ratio, out):
    """Time to accuracy over all-reduce's, per method (bars) at each bandwidth (groups): PacTrain's Fig. 3."""
    bandwidths = list(dict.fromkeys(e["bandwidth"] for e in entries))
    methods = list(dict.fromkeys(_label(e, with_ratio) for e in entries))
    width = 0.8 / max(len(methods), 1)
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for j, method in enumerate(methods):
        mine = [next((e for e in entries if e["bandwidth"] == b and _label(e, with_ratio) == method), None)
                for b in bandwidths]
        xs = [i + (j - (len(methods) - 1) / 2) * width for i in range(len(bandwidths))]
        heights = [e["tta_speedup"] if e and e.get("tta_speedup") is not None else float("nan") for e in mine]
        present = [e or {} for e in mine]
        ax.bar(xs, heights, width, yerr=_errors(present, "tta_speedup"), capsize=2, label=method)
        for x, e in zip(xs, mine):
            if e and e.get("tta_speedup") is None and e.get("target_accuracy") is not None:
                ax.annotate("not reached", (x, 1.0), ha="center", va="bottom", rotation=90, fontsize=6,
                            color="firebrick")
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set_xticks(range(len(bandwidths)), bandwidths)
    ax.set(xlabel="bandwidth per link", ylabel="time-to-accuracy speedup over all-reduce",
           title="time to accuracy against bandwidth (1: all-reduce at that bandwidth)")
    ax.legend(fontsize=7)
    return _save(fig, out / "bandwidth_sweep.png", plt)


def _prune_sweep(plt, entries, out):
    """Final accuracy and time to accuracy against the prune ratio, per pruning method, beside the dense
    all-reduce run's: PacTrain's Fig. 6."""
    from gcomp.bench.race import baseline
    base = baseline(entries)
    pruning = [e for e in entries if e.get("prune_ratio") is not None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    for method in dict.fromkeys(e["method"] for e in pruning):
        mine = sorted((e for e in pruning if e["method"] == method), key=lambda e: e["prune_ratio"])
        ratios = [e["prune_ratio"] for e in mine]
        left.errorbar(ratios, [e["final_accuracy"] for e in mine], yerr=_errors(mine, "final_accuracy"),
                      marker="o", capsize=3, label=method)
        times = [e["time_to_target_s"] if e.get("time_to_target_s") is not None else float("nan") for e in mine]
        right.errorbar(ratios, times, yerr=_errors(mine, "time_to_target_s"), marker="o", capsize=3, label=method)
        for x, e in zip(ratios, mine):
            if e.get("time_to_target_s") is None and e.get("target_accuracy") is not None:
                right.annotate("not reached", (x, 0), ha="center", va="bottom", rotation=90, fontsize=7,
                               color="firebrick")
    if base is not None:
        left.axhline(base["final_accuracy"], color="grey", linestyle=":", label=f"dense {base['method']}")
        left.axhline(base["final_accuracy"] - 0.02, color="grey", linestyle="--", linewidth=0.8,
                     label="2 points below dense")
        if base.get("time_to_target_s") is not None:
            right.axhline(base["time_to_target_s"], color="grey", linestyle=":", label=f"dense {base['method']}")
    left.set(xlabel="prune ratio", ylabel="final test accuracy", title="accuracy against prune ratio")
    right.set(xlabel="prune ratio", ylabel="time to target accuracy (s)", title="time to accuracy",
              ylim=(0, None))
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    return _save(fig, out / "prune_ratio_sweep.png", plt)


def _step_times(plt, runs, out):
    """Step time (a running median of 5 steps, so that one slow step does not hide the trend) and cumulative
    training time against the step, with the schedule's rate changes marked."""
    import statistics

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.5))
    for r in runs:
        ms = [1000 * t for t in r["step_times"]]
        smooth = [statistics.median(ms[max(0, i - 2):i + 3]) for i in range(len(ms))]
        left.plot(range(len(ms)), smooth, label=_label(r, False), linewidth=1)
        total, cumulative = 0.0, []
        for t in r["step_times"]:
            total += t
            cumulative.append(total)
        right.plot(range(len(ms)), cumulative, label=_label(r, False), linewidth=1)
    for segment in runs[0]["segments"][1:]:
        for ax in (left, right):
            ax.axvline(segment["from_step"], color="grey", linestyle=":")
    rates = " then ".join(f"{seg['rate']} from step {seg['from_step']}" for seg in runs[0]["segments"])
    left.set(xlabel="step", ylabel="step time (ms, median of 5)", yscale="log", title=rates)
    right.set(xlabel="step", ylabel="training time so far (s)", title="cumulative time")
    left.legend(fontsize=7)
    right.legend(fontsize=7)
    return _save(fig, out / "step_times.png", plt)


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
