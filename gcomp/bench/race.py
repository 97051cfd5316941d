"""The race's figures: time to the target accuracy per run, then medians, ranges and a verdict over seeds.

A race is every run of one seed at one bandwidth: its target is 99% of the best accuracy its plain all-reduce
run (``identity``, else ``torch:allreduce``) reached, unless the config sets one. Time to accuracy is the
training time (the sum of rank 0's step times, evaluations excluded, warm-up and mask-tracking steps included)
at the first evaluation reaching the target.

Over seeds, every figure is summarised as a median and a range (min, max); a run that never reached the target
counts as infinitely slow, so one such seed shows in the range and a majority shows as "not reached" (for an
even number of seeds, the race's figures take the slower of the two middle runs). The
verdict compares a method's times to accuracy with another's across the seeds: ``faster`` when its slowest seed
beats the other's fastest, ``slower`` when its fastest loses to the other's slowest, else ``within spread``.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict

BASELINES = ("identity", "torch:allreduce")
SUMMARISED = ("step_s", "compute_s_per_step", "encode_s_per_step", "comm_s_per_step", "decode_s_per_step",
              "bytes_sent_per_step", "bytes_dense_per_step", "compression", "final_loss", "final_accuracy",
              "target_accuracy", "time_to_target_s", "steps_to_target", "tta_speedup", "step_speedup",
              "kept_fraction", "outer_steps")
RACE_FIGURES = ("time_to_target_s", "steps_to_target", "tta_speedup")
NEVER = math.inf  # a run that never reached the target, as a time to accuracy


def baseline(rows: list[dict]) -> dict | None:
    """The plain all-reduce run among ``rows`` (``identity`` first, else ``torch:allreduce``), or None."""
    for name in BASELINES:
        for r in rows:
            if r["method"] == name:
                return r
    return None


def race_key(row: dict) -> tuple:
    """Which race a run belongs to: its bandwidth and its seed."""
    return row.get("bandwidth"), row.get("seed")


def _grouped(rows: list[dict], key) -> dict[tuple, list[dict]]:
    """The rows by ``key(row)``, groups and rows in the order they come."""
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[key(r)].append(r)
    return groups


def add_derived(rows: list[dict], target: float | None) -> float | None:
    """Adds the target, time and steps to it, compression and speedups to every run, race by race. Returns the
    target (the first race's where the races set different ones)."""
    targets = [_derive_race(race, target) for race in _grouped(rows, race_key).values()]
    return targets[0] if targets else target


def _derive_race(rows: list[dict], target: float | None) -> float | None:
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


SHORT_RACE_EVALS = 3  # a baseline at the target before its 3rd evaluation: the race is too short to tell


def short_race_warning(rows: list[dict]) -> str | None:
    """One line when a race's all-reduce run met its target within its first evaluations (time to accuracy
    then measures little more than step time), or None. Call :func:`add_derived` first."""
    short = []
    for (bandwidth, seed), race in _grouped(rows, race_key).items():
        base = baseline(race)
        if base is None or base.get("steps_to_target") is None:
            continue
        at = next(i for i, h in enumerate(base["history"], 1) if h["step"] == base["steps_to_target"])
        if at < SHORT_RACE_EVALS:
            short.append((bandwidth, seed, at, len(base["history"])))
    if not short:
        return None
    named = ", ".join(f"evaluation {at} of {n}" + (f" (seed {seed})" if seed is not None else "")
                      for _, seed, at, n in short)
    return (f"gcomp bench: warning: all-reduce met the target at {named}: the race is decided at the first "
            "evaluations, so time to accuracy measures little more than step time; start further from the target "
            "(fewer --pretrain-epochs, a lower --lr, more --steps) or evaluate more often (--eval-every)")


def entry_key(row: dict) -> tuple:
    """What the summary keeps apart: the bandwidth, the method and (for a method that prunes) its ratio."""
    return row.get("bandwidth"), row["method"], row.get("prune_ratio")


def summarise(rows: list[dict]) -> list[dict]:
    """One entry per bandwidth, method and prune ratio (in the runs' order): every figure of ``SUMMARISED`` as
    its median over the seeds, ``ranges`` (min, max) for each, ``seeds`` and ``reached`` (how many seeds met
    the target), and the verdicts against all-reduce and the best of PyTorch's hooks (``None`` for one seed).
    Call :func:`add_derived` first."""
    summary = [_entry(runs) for runs in _grouped(rows, entry_key).values()]
    for bandwidth in dict.fromkeys(e["bandwidth"] for e in summary):
        _add_verdicts([e for e in summary if e["bandwidth"] == bandwidth])
    return summary


def _entry(runs: list[dict]) -> dict:
    first = runs[0]
    entry = {key: first.get(key) for key in ("method", "name", "collective", "bandwidth", "bandwidth_bps",
                                             "prune_ratio", "workers", "model", "dataset", "one_bucket", "steps")}
    entry.update(seeds=len(runs), seed_list=[r.get("seed") for r in runs], ranges={},
                 reached=sum(r.get("time_to_target_s") is not None for r in runs))
    times = [_tta(r) for r in runs]
    entry["tta_per_seed"] = [None if t == NEVER else t for t in times]
    targeted = first.get("target_accuracy") is not None
    for key in SUMMARISED:
        values = [r.get(key) for r in runs]
        if targeted and key == "time_to_target_s":
            values = times
        elif targeted and key == "steps_to_target":
            values = [NEVER if v is None else v for v in values]
        elif targeted and key == "tta_speedup":
            values = [0.0 if t == NEVER else v for v, t in zip(values, times)]
        values = [v for v in values if v is not None]
        if not values:
            entry[key] = None
            continue
        entry["ranges"][key] = (min(values), max(values))
        if key in RACE_FIGURES:  # the slower of the two middle runs for an even number of seeds
            median = (statistics.median_low if key == "tta_speedup" else statistics.median_high)(values)
            entry[key] = None if median in (NEVER, 0.0) else median
        else:
            entry[key] = statistics.median(values)
    return entry


def _tta(row: dict) -> float:
    return NEVER if row.get("time_to_target_s") is None else row["time_to_target_s"]


def verdict(times: list[float | None], others: list[float | None]) -> str | None:
    """``faster``, ``slower`` or ``within spread``: times to accuracy (None: never reached) of one method
    against another's, over the same seeds; None with fewer than two seeds (no spread to judge by)."""
    if len(times) < 2 or len(others) < 2:
        return None
    mine = [NEVER if t is None else t for t in times]
    theirs = [NEVER if t is None else t for t in others]
    if max(mine) < min(theirs):
        return "faster"
    if min(mine) > max(theirs):
        return "slower"
    return "within spread"


def _add_verdicts(entries: list[dict]) -> None:
    base = baseline(entries)
    hooks = [e for e in entries if e["method"].startswith("torch:")]
    best = min(hooks, key=lambda e: _median_tta(e), default=None)
    for e in entries:
        e["vs_allreduce"] = None if base is None or e is base else verdict(e["tta_per_seed"], base["tta_per_seed"])
        e["best_torch_hook"] = best["method"] if best else None
        e["vs_best_torch_hook"] = None if best is None or e is best else verdict(e["tta_per_seed"],
                                                                                best["tta_per_seed"])


def _median_tta(entry: dict) -> float:
    return statistics.median(NEVER if t is None else t for t in entry["tta_per_seed"])
