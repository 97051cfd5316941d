"""A bandwidth schedule: ``--bandwidth 1gbit,100mbit@60,500mbit@120`` changes every link's rate during a run.

The first rate holds from step 0; each later ``RATE@N`` holds from step ``N`` (counted from 0, so ``@60``
leaves 60 steps at the rate before it) until the next. A comma list where no entry has ``@`` is a sweep
(one comparison per rate), as before; this module only reads lists that have one. Every method's run follows
the same schedule from its first step: the links go back to the first rate when the next run starts.

How the change reaches the links is ``gcomp.bench.rate_control``; this module parses and checks the schedule
and splits a run's per-step times into its segments.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

from gcomp.link import parse_rate

FORM = "RATE,RATE@STEP,... (1gbit,100mbit@60: 1gbit from the start, 100mbit from step 60 on)"


@dataclass(frozen=True)
class Segment:
    """One rate of a schedule and the step from which it holds."""

    rate: str
    rate_bps: int
    from_step: int

    def as_dict(self) -> dict:
        return {"rate": self.rate, "rate_bps": self.rate_bps, "from_step": self.from_step}


def is_schedule(text: str | None) -> bool:
    """Whether ``--bandwidth`` asks for a schedule (some entry has ``@``) rather than one rate or a sweep."""
    return text is not None and "@" in str(text)


def parse_schedule(text: str, steps: int) -> list[Segment]:
    """``"1gbit,100mbit@60"`` -> its segments; a ValueError naming ``--bandwidth`` and what is wrong."""
    entries = [entry.strip() for entry in str(text).split(",") if entry.strip()]
    where = f"--bandwidth {text}"
    segments = []
    for i, entry in enumerate(entries):
        rate, at, step_text = entry.partition("@")
        if i == 0 and at:
            raise ValueError(f"{where}: the first rate holds from the start and takes no @STEP; expected {FORM}")
        if i > 0 and not at:
            raise ValueError(f"{where}: {entry!r} needs @STEP (every rate after the first says from which step it "
                             f"holds); a list with no @ at all is a sweep. Expected {FORM}")
        rate_bps = parse_rate(rate)
        if rate_bps is None:
            raise ValueError(f"{where}: 'none' cannot be part of a schedule (tc shapes the links from the start "
                             f"or not at all); expected {FORM}")
        step = _step(step_text, where) if at else 0
        if segments and step <= segments[-1].from_step:
            raise ValueError(f"{where}: steps must increase strictly and be above 0; {entry!r} comes after "
                             f"step {segments[-1].from_step}")
        if step >= steps:
            raise ValueError(f"{where}: {entry!r} starts at or after the run's end (--steps {steps}); every "
                             f"@STEP must be below --steps")
        segments.append(Segment(rate.strip(), rate_bps, step))
    if len(segments) < 2:
        raise ValueError(f"{where}: a schedule needs a first rate and at least one RATE@STEP; expected {FORM}")
    return segments


def _step(text: str, where: str) -> int:
    if not text.strip().isdigit():
        raise ValueError(f"{where}: @{text} is not a step number (a whole number); expected {FORM}")
    return int(text)


def describe_schedule(schedule: list[dict]) -> str:
    """``1gbit, then 100mbit from step 60``."""
    return ", then ".join([schedule[0]["rate"]] + [f"{s['rate']} from step {s['from_step']}" for s in schedule[1:]])


def segment_times(step_times: list[float], schedule: list[dict]) -> list[dict]:
    """Per segment of ``schedule`` (``Segment.as_dict()`` entries): its rate, first step, how many steps of
    ``step_times`` fell in it and their mean time (``None`` for none)."""
    bounds = [s["from_step"] for s in schedule[1:]] + [len(step_times)]
    rows = []
    for segment, end in zip(schedule, bounds):
        times = step_times[segment["from_step"]:end]
        rows.append({"rate": segment["rate"], "from_step": segment["from_step"], "steps": len(times),
                     "step_s": statistics.mean(times) if times else None})
    return rows
