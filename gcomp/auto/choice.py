"""What a candidate costs on a bucket: as measured per layout (``LayoutRecord``) and priced on a link (the
alpha-beta formulas of ``gcomp.link``), and the choice, with a margin against flapping between close ones."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Mapping

from gcomp.bucket import BucketInfo
from gcomp.link import Launched, Network, launched_s

# the counters of ``gcomp.collectives.launch`` the choice prices, in the order they travel
COUNTS = ("rounds", "allreduce_calls", "allreduce_bytes", "allgather_calls", "allgather_bytes")
CODEC_KEYS = ("encode_s", "decode_s", "round_work_s")
WIDTH = 2 + len(COUNTS)  # per candidate: codec seconds, wait seconds, then the counts


def median_after_first(samples: list[float]) -> float:
    """The median of ``samples`` past the first (which pays a switch and first-time costs); 0 for none."""
    kept = samples[1:] if len(samples) > 1 else samples
    return statistics.median(kept) if kept else 0.0


@dataclass
class LayoutRecord:
    """One layout's measurements of each candidate ``i``: ``codec[i]`` (its codec seconds per bucket), ``waited[i]``
    (wall less codec seconds, while measuring), ``counts[i]`` (its last bucket's collectives), ``costs[i]`` (agreed,
    once decided). ``chosen``: the candidate in use then, ``predicted`` each one's seconds at that choice, ``waits``
    the chosen one's since the last check; ``last``: the one that reduced the layout last."""

    bucket: BucketInfo
    candidates: int
    last: int | None = None
    chosen: int | None = None
    predicted: dict = field(default_factory=dict)
    waits: list = field(default_factory=list)
    costs: dict = field(default_factory=dict)

    def __post_init__(self):
        self.codec = [[] for _ in range(self.candidates)]
        self.waited = [[] for _ in range(self.candidates)]
        self.counts = [None] * self.candidates

    def observe(self, candidate: int, stats: dict, wall_s: float) -> None:
        """One bucket reduced by ``candidate``: ``stats`` its own counters, ``wall_s`` from its encode to its result."""
        codec_s = sum(float(stats.get(k, 0.0)) for k in CODEC_KEYS)
        wait_s = max(wall_s - codec_s, 0.0)
        self.codec[candidate].append(codec_s)
        self.counts[candidate] = [float(stats.get(k, 0)) for k in COUNTS]
        if self.chosen is None:
            self.waited[candidate].append(wait_s)
        elif candidate == self.chosen:
            self.waits.append(wait_s)

    def codec_s(self, candidate: int) -> float:
        """The fastest bucket after the first (which pays first-time allocations), else the first; 0 for none."""
        samples = self.codec[candidate]
        return (min(samples[1:]) if len(samples) > 1 else samples[0]) if samples else 0.0

    def vector(self) -> list[float]:
        """This rank's measurements, ``WIDTH`` values per candidate, for the ranks to agree on (MAX)."""
        out = []
        for i in range(self.candidates):
            out += [self.codec_s(i), median_after_first(self.waited[i]), *(self.counts[i] or [0.0] * len(COUNTS))]
        return out


@dataclass(frozen=True)
class BucketCost:
    """One method on one bucket: ``codec_s``, the slowest rank's seconds to encode and decode it; ``launched``, its
    collectives (``buckets=1``); ``overhead_s``, what they took beyond their price on the link measured (gloo's own
    work, peers late on shared cores), carried to another link as it is."""

    codec_s: float
    launched: Launched
    overhead_s: float = 0.0

    def __post_init__(self):
        for name in ("codec_s", "overhead_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"BucketCost: {name} must be a finite number >= 0; got {value!r}")


def link_network(alpha_s: float, beta_s: float) -> Network:
    """The link measured (seconds per message and per byte) as the formulas take it; a ``beta_s`` of 0 (a probe
    that saw no cost per byte) is read as 1 Tbit/s."""
    return Network(8.0 / max(beta_s, 8e-12), max(alpha_s, 0.0))


def predict_s(cost: BucketCost, workers: int, network: Network) -> float:
    """Seconds one bucket takes with this method: codec, collectives on ``network``, overhead."""
    return cost.codec_s + launched_s(cost.launched, workers, network) + cost.overhead_s


@dataclass(frozen=True)
class Choice:
    method: str
    predicted_s: dict  # every candidate's predicted seconds
    switched: bool


def choose(costs: Mapping[str, BucketCost], workers: int, network: Network, current: str | None = None,
           margin: float = 0.1) -> Choice:
    """The fastest of ``costs`` by ``predict_s`` (ties go to the earlier entry: every rank chooses alike); the
    ``current`` method is kept unless the fastest is predicted faster by more than ``margin`` of its time."""
    if not costs:
        raise ValueError("choose: no candidate")
    if not 0 <= margin < 1:
        raise ValueError(f"choose: margin must be in [0, 1); got {margin!r}")
    predicted = {name: predict_s(cost, workers, network) for name, cost in costs.items()}
    best = min(predicted, key=predicted.__getitem__)  # min keeps the first of equal values
    if current in predicted and predicted[best] >= (1 - margin) * predicted[current]:
        return Choice(current, predicted, False)
    return Choice(best, predicted, current is not None and best != current)
