"""Which allowed method is fastest for one bucket: each one's measured codec time plus its collectives priced
on the measured link (the alpha-beta formulas of ``gcomp.link``), with a margin against
flapping between two close ones."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from gcomp.link import Launched, Network, launched_s


@dataclass(frozen=True)
class BucketCost:
    """One method on one bucket, as measured: ``codec_s`` host seconds to encode and decode it (the slowest
    rank's, so that every rank prices alike), ``launched``, the collectives it launched for it with their
    bytes (``Launched`` with ``buckets=1``), and ``overhead_s``, what its collectives took beyond their price
    on the link they were measured on (gloo's own work, peers late on shared cores), carried to another link
    as it is."""

    codec_s: float
    launched: Launched
    overhead_s: float = 0.0

    def __post_init__(self):
        for name in ("codec_s", "overhead_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"BucketCost: {name} must be a finite number >= 0; got {value!r}")


def link_network(alpha_s: float, beta_s: float) -> Network:
    """The link as measured (``gcomp.link.link_from_timings``: seconds per message and per byte)
    as the cost formulas take it; a ``beta_s`` of 0 (a probe that saw no cost per byte) is read as 1 Tbit/s."""
    return Network(8.0 / max(beta_s, 8e-12), max(alpha_s, 0.0))


def predict_s(cost: BucketCost, workers: int, network: Network) -> float:
    """Seconds one bucket takes with this method: its codec time, its collectives on ``network`` and its
    overhead."""
    return cost.codec_s + launched_s(cost.launched, workers, network) + cost.overhead_s


@dataclass(frozen=True)
class Choice:
    """The method for a bucket, the predicted seconds of every candidate, and whether it changed."""

    method: str
    predicted_s: dict
    switched: bool


def choose(costs: Mapping[str, BucketCost], workers: int, network: Network, current: str | None = None,
           margin: float = 0.1) -> Choice:
    """The fastest of ``costs`` (by ``predict_s``; ties go to the earlier entry, so the same inputs give the
    same choice on every rank). A ``current`` method is kept unless the fastest is predicted faster by more
    than ``margin`` of its time: a switch must pay for itself, and two methods within noise of each other
    must not alternate."""
    if not costs:
        raise ValueError("choose: no candidate")
    if not 0 <= margin < 1:
        raise ValueError(f"choose: margin must be in [0, 1); got {margin!r}")
    predicted = {name: predict_s(cost, workers, network) for name, cost in costs.items()}
    best = min(predicted, key=predicted.__getitem__)  # min keeps the first of equal values
    if current in predicted and predicted[best] >= (1 - margin) * predicted[current]:
        return Choice(current, predicted, False)
    return Choice(best, predicted, current is not None and best != current)
