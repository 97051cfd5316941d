"""A comparison's outputs: ``results.json``, ``results.csv`` (one row per method), PNG plots, a Markdown table.

Time to accuracy is read off each run's evaluations: the training time (the sum of rank 0's step times,
evaluations excluded) at the first evaluation reaching the target. The target is the config's, or else 99%
of the best accuracy the plain all-reduce runs (``identity``, ``torch:allreduce``) reached.
"""
from __future__ import annotations

import csv
import json
from pathlib import Path

BASELINES = ("identity", "torch:allreduce")
CSV_FIELDS = ("method", "collective", "workers", "model", "dataset", "bandwidth", "steps", "step_s",
              "compute_s_per_step", "encode_s_per_step", "comm_s_per_step", "decode_s_per_step",
              "bytes_sent_per_step", "bytes_dense_per_step", "compression", "final_loss", "final_accuracy",
              "target_accuracy", "time_to_target_s", "steps_to_target", "tta_speedup", "step_speedup",
              "kept_fraction", "one_bucket")


def baseline(rows: list[dict]) -> dict | None:
    for name in BASELINES:
        for r in rows:
            if r["method"] == name:
                return r
    return None


def add_derived(rows: list[dict], target: float | None) -> float | None:
    """Adds the target, time and steps to it, compression and speedups to every row; returns the target."""
    base = baseline(rows)
    if target is None and base is not None and base["history"]:
        target = 0.99 * max(h["accuracy"] for h in base["history"])
    for r in rows:
        r["target_accuracy"] = target
        hit = next((h for h in r["history"] if target is not None and h["accuracy"] >= target), None)
        r["time_to_target_s"] = hit["train_s"] if hit else None
        r["steps_to_target"] = hit["step"] if hit else None
        r["compression"] = r["bytes_dense_per_step"] / r["bytes_sent_per_step"] if r["bytes_sent_per_step"] else None
    for r in rows:
        r["step_speedup"] = base["step_s"] / r["step_s"] if base and r["step_s"] else None
        tta = base and base.get("time_to_target_s")
        r["tta_speedup"] = tta / r["time_to_target_s"] if tta and r["time_to_target_s"] else None
    return target


def _fmt(value, spec: str) -> str:
    return "—" if value is None else format(value, spec)


def _reached(row: dict, value, spec: str) -> str:
    """A time-to-target figure, or "not reached" where a target was set and the run never met it: never a
    blank or a 0 that reads as instant."""
    if row.get("target_accuracy") is not None and row.get("time_to_target_s") is None:
        return "not reached"
    return _fmt(value, spec)


def load_warning(rows: list[dict], workers: int, bench_load: dict | None = None) -> str | None:
    """One line naming the runs during which the machine's 1-minute load average exceeded the worker count
    (their timings are shared with other work), or None."""
    loads = [(r["method"], max(r["load_average"].values())) for r in rows if r.get("load_average")]
    if bench_load:
        loads.append(("the whole bench", max(bench_load.values())))
    busy = [(name, load) for name, load in loads if load > workers]
    if not busy:
        return None
    named = ", ".join(f"{name} ({load:.1f})" for name, load in busy)
    return (f"gcomp bench: warning: the machine's load average exceeded the {workers} workers during {named}: "
            "other work shared the cores, so those timings are noisy; compare ratios from one run, or rerun on a "
            "quieter machine")


def markdown(rows: list[dict]) -> str:
    head = ("| method | step ms | compute | encode | comm | decode | bytes/step | compression | final acc "
            "| time to target s | TTA speedup | step speedup |")
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        lines.append(
            f"| {r['method']}{' (one bucket)' if r.get('one_bucket') else ''} | {1000 * r['step_s']:.1f} "
            f"| {1000 * r['compute_s_per_step']:.1f} | {1000 * r['encode_s_per_step']:.1f} "
            f"| {1000 * r['comm_s_per_step']:.1f} | {1000 * r['decode_s_per_step']:.1f} "
            f"| {r['bytes_sent_per_step']:,.0f} | {_fmt(r['compression'], '.2f')}x "
            f"| {_fmt(r['final_accuracy'], '.4f')} | {_reached(r, r['time_to_target_s'], '.2f')} "
            f"| {_reached(r, r['tta_speedup'], '.2f')} | {_fmt(r['step_speedup'], '.2f')} |")
    return "\n".join(lines)


def write(rows: list[dict], out: Path, meta: dict) -> dict[str, Path]:
    """results.json (meta and full rows), results.csv, and the plots where matplotlib is installed."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "csv": out / "results.csv"}
    paths["json"].write_text(json.dumps({"meta": meta, "runs": rows}, indent=1))
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    paths.update(plots(rows, out))
    return paths


def plots(rows: list[dict], out: Path) -> dict[str, Path]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return {}
    names = [r["method"] for r in rows]
    made = {}

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        ax.plot([h["train_s"] for h in r["history"]], [h["accuracy"] for h in r["history"]], marker=".",
                label=r["method"])
    if rows and rows[0].get("target_accuracy"):
        ax.axhline(rows[0]["target_accuracy"], color="grey", linestyle=":", label="target")
    ax.set(xlabel="training time (s)", ylabel="test accuracy", title="accuracy against wall time")
    ax.legend(fontsize=7)
    made["accuracy"] = _save(fig, out / "accuracy_vs_time.png", plt)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    heights = [r["tta_speedup"] if r["tta_speedup"] is not None else float("nan") for r in rows]
    ax.bar(names, heights)  # NaN: no bar at all, and the label below says why
    for i, r in enumerate(rows):
        if r["tta_speedup"] is None:
            ax.annotate("not reached" if r.get("target_accuracy") is not None else "no target", (i, 1.0),
                        ha="center", va="bottom", rotation=90, fontsize=7, color="firebrick")
    ax.axhline(1.0, color="grey", linestyle=":")
    ax.set(ylabel="time-to-accuracy speedup over all-reduce", title="time to accuracy (1: all-reduce)")
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    made["tta"] = _save(fig, out / "time_to_accuracy.png", plt)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.bar(names, [r["bytes_sent_per_step"] for r in rows])
    ax.set(ylabel="bytes per step (rank 0)", yscale="log", title="bytes on the wire per step")
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    made["bytes"] = _save(fig, out / "bytes_per_step.png", plt)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    bottom = [0.0] * len(rows)
    for key, label in (("compute_s_per_step", "compute"), ("encode_s_per_step", "encode"),
                       ("comm_s_per_step", "communicate"), ("decode_s_per_step", "decode")):
        values = [1000 * r[key] for r in rows]
        ax.bar(names, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(ylabel="ms per step", title="where a step's time goes")
    ax.legend(fontsize=7)
    ax.tick_params(axis="x", rotation=45, labelsize=7)
    made["breakdown"] = _save(fig, out / "time_breakdown.png", plt)
    return made


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
