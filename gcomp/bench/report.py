"""A comparison's outputs: ``results.json`` (the settings, every run and the summary over seeds),
``results.csv`` (one row per run), PNG plots (``gcomp.bench.plots``) and Markdown tables.

The figures themselves (time to accuracy, medians, ranges, verdicts) come from ``gcomp.bench.race``.
"""
from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path

CSV_FIELDS = ("method", "collective", "workers", "model", "dataset", "bandwidth", "seed", "prune_ratio", "steps",
              "step_s", "compute_s_per_step", "encode_s_per_step", "comm_s_per_step", "decode_s_per_step",
              "bytes_sent_per_step", "bytes_dense_per_step", "compression", "final_loss", "final_accuracy",
              "target_accuracy", "time_to_target_s", "steps_to_target", "tta_speedup", "step_speedup",
              "kept_fraction", "one_bucket", "inter_bytes_per_step", "inter_bytes_dense_per_step", "outer_steps")


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
    loads: dict[str, float] = {}  # the highest per method, over its seeds and sweep points
    for r in rows:
        if r.get("load_average"):
            loads[r["method"]] = max(loads.get(r["method"], 0.0), *r["load_average"].values())
    if bench_load:
        loads["the whole bench"] = max(bench_load.values())
    busy = [(name, load) for name, load in loads.items() if load > workers]
    if not busy:
        return None
    named = ", ".join(f"{name} ({load:.1f})" for name, load in busy)
    return (f"gcomp bench: warning: the machine's load average exceeded the {workers} workers during {named}: "
            "other work shared the cores, so those timings are noisy; compare ratios from one run, or rerun on a "
            "quieter machine")


def _cell(row: dict, key: str, spec: str, scale: float = 1.0, reached: bool = False) -> str:
    """A figure, followed by its range over seeds "(min–max)" where the row summarises several."""
    value = None if row.get(key) is None else scale * row[key]
    text = _reached(row, value, spec) if reached else _fmt(value, spec)
    span = row.get("ranges", {}).get(key) if row.get("seeds", 1) > 1 else None
    if span is None or text == "—":
        return text
    low, high = (_range_end(row, key, v, spec, scale) for v in span)
    return text if low == high else f"{text} ({low}–{high})"


def _range_end(row: dict, key: str, value: float, spec: str, scale: float) -> str:
    never = (key == "tta_speedup" and value == 0.0) or value == float("inf")
    return "not reached" if never else format(scale * value, spec)


def markdown(rows: list[dict], full: bool = False) -> str:
    """The table of runs, or of a summary's entries (``gcomp.bench.race.summarise``). By default six columns
    within 100: medians, and where there are several seeds the verdict against all-reduce, which reads their
    ranges. ``full`` (summary.md): each figure's range over seeds, the step's breakdown, bytes, steps to target
    and the verdict against the best PyTorch hook too. A method that prunes carries its ratio where the rows
    hold several."""
    verdicts = any(r.get("vs_allreduce") or r.get("vs_best_torch_hook") for r in rows)
    ratios = {r.get("prune_ratio") for r in rows if r.get("prune_ratio") is not None}
    if full:
        head = ("| method | step ms | compute | encode | comm | decode | bytes/step | compression | final acc "
                "| steps to target | time to target s | TTA speedup | step speedup |")
    else:
        head = "| method | step ms | compression | final acc | time to target s | TTA speedup |"
    outer = full and any(r.get("outer_steps") is not None for r in rows)
    head += " outer steps |" if outer else ""
    if verdicts:
        best = next((r["best_torch_hook"] for r in rows if r.get("best_torch_hook")), None)
        hook = f"TTA vs best PyTorch hook ({best})" if best else "TTA vs best PyTorch hook (none raced)"
        head += f" TTA vs all-reduce | {hook} |" if full else " vs all-reduce |"
    lines = [head, "|" + " --- |" * (head.count("|") - 1)]
    for r in rows:
        name = r["method"] + (f" @{r['prune_ratio']:g}" if len(ratios) > 1 and r.get("prune_ratio") is not None
                              else "")
        name += " (one bucket)" if r.get("one_bucket") else ""
        compression = f"{_fmt(r.get('compression'), '.2f')}x"
        if full:
            step, accuracy = _cell(r, "step_s", ".1f", 1000), _cell(r, "final_accuracy", ".4f")
            target = _cell(r, "time_to_target_s", ".2f", reached=True)
            speedup = _cell(r, "tta_speedup", ".2f", reached=True)
        else:  # medians only (the verdict column reads the ranges), so that several seeds fit 100 columns
            step, accuracy = _fmt(_ms(r, "step_s"), ".1f"), _fmt(r.get("final_accuracy"), ".4f")
            target = _reached(r, r.get("time_to_target_s"), ".2f")
            speedup = _reached(r, r.get("tta_speedup"), ".2f")
        if full:
            line = (f"| {name} | {step} | {_fmt(_ms(r, 'compute_s_per_step'), '.1f')} "
                    f"| {_fmt(_ms(r, 'encode_s_per_step'), '.1f')} | {_fmt(_ms(r, 'comm_s_per_step'), '.1f')} "
                    f"| {_fmt(_ms(r, 'decode_s_per_step'), '.1f')} | {_cell(r, 'bytes_sent_per_step', ',.0f')} "
                    f"| {compression} | {accuracy} | {_cell(r, 'steps_to_target', '.0f', reached=True)} "
                    f"| {target} | {speedup} | {_fmt(r.get('step_speedup'), '.2f')} |")
        else:
            line = f"| {name} | {step} | {compression} | {accuracy} | {target} | {speedup} |"
        line += f" {_fmt(r.get('outer_steps'), '.0f')} |" if outer else ""
        if verdicts:
            line += (f" {r.get('vs_allreduce') or '—'} | {r.get('vs_best_torch_hook') or '—'} |" if full
                     else f" {r.get('vs_allreduce') or '—'} |")
        lines.append(line)
    return "\n".join(lines)


def outer_notes(rows: list[dict]) -> str | None:
    """Under the short table, a line per outer loop (``gcomp bench --outer``): the outer steps it took and its
    bytes per inner step against per-step all-reduce's; None when there is none."""
    lines = [f"{r['method']}: {_fmt(r.get('outer_steps'), '.0f')} outer steps in {r.get('steps', '?')} inner "
             f"steps, {_fmt(r.get('bytes_sent_per_step'), ',.0f')} bytes per inner step "
             f"({_fmt(r.get('compression'), ',.1f')}x fewer than a per-step fp32 all-reduce)"
             for r in rows if r.get("outer_steps") is not None]
    return "\n".join(["outer loops (accuracy read after each sync):"] + lines) if lines else None


def segment_markdown(rows: list[dict]) -> str | None:
    """For a bandwidth schedule: each method's mean step time per segment of the schedule, one column per
    segment (the median over seeds where there are several); None when no run has segments."""
    scheduled = [r for r in rows if r.get("segments")]
    if not scheduled:
        return None
    segments = scheduled[0]["segments"]
    ends = [s["from_step"] for s in segments[1:]] + [scheduled[0]["steps"]]
    head = "| method | " + " | ".join(f"step ms at {s['rate']} (steps {s['from_step']}–{end - 1})"
                                     for s, end in zip(segments, ends)) + " |"
    lines = [head, "|" + " --- |" * (len(segments) + 1)]
    ratios = {r.get("prune_ratio") for r in scheduled if r.get("prune_ratio") is not None}
    groups: dict[tuple, list[dict]] = {}
    for r in scheduled:
        groups.setdefault((r["method"], r.get("prune_ratio")), []).append(r)
    for (method, ratio), runs in groups.items():
        name = method + (f" @{ratio:g}" if len(ratios) > 1 and ratio is not None else "")
        cells = []
        for i in range(len(segments)):
            times = [run["segments"][i]["step_s"] for run in runs if run["segments"][i]["step_s"] is not None]
            cells.append(_fmt(1000 * statistics.median(times) if times else None, ".1f"))
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _ms(row: dict, key: str):
    return None if row.get(key) is None else 1000 * row[key]


def links(rows: list[dict]) -> list[dict]:
    """The links the runs' workers probed (``gcomp.bench.throughput.probe_link``), one per bandwidth and worker
    count: latency per message ``alpha_s``, seconds per byte ``beta_s`` and the rate that makes."""
    seen: dict[tuple, dict] = {}
    for r in rows:
        link = r.get("link")
        if isinstance(link, dict) and link.get("beta_s"):
            seen.setdefault((r.get("bandwidth"), r.get("workers")), {
                "bandwidth": r.get("bandwidth"), "workers": r.get("workers"), "alpha_s": link.get("alpha_s"),
                "beta_s": link["beta_s"], "measured_bps": 8.0 / link["beta_s"]})
    return list(seen.values())


def write(rows: list[dict], out: Path, meta: dict, summary: list[dict] | None = None) -> dict[str, Path]:
    """results.json (meta, with the probed ``links`` beside the ``network``; every run and the summary),
    results.csv (the runs), summary.md (the full table of the summary, every bandwidth), and the plots where matplotlib is installed."""
    from gcomp.bench import plots
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "csv": out / "results.csv", "table": out / "summary.md"}
    body = {"meta": {**meta, "links": links(rows)}, "runs": rows}
    if summary is not None:
        body["summary"] = summary
    paths["json"].write_text(json.dumps(body, indent=1))
    with open(paths["csv"], "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=CSV_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    paths["table"].write_text(markdown(summary if summary is not None else rows, full=True) + "\n")
    paths.update(plots.all_plots(rows, summary if summary is not None else rows, out))
    return paths
