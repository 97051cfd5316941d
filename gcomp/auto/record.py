"""What ``auto`` measured on one bucket layout: each candidate's codec seconds and collectives, and the seconds
the chosen one took."""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from gcomp.link import Launched
from gcomp.bucket import BucketInfo

# the counters of ``gcomp.collectives.counting`` the choice prices, in the order they travel
COUNTS = ("rounds", "allreduce_calls", "allreduce_bytes", "allgather_calls", "allgather_bytes")
CODEC_KEYS = ("encode_s", "decode_s", "round_work_s")
WIDTH = 2 + len(COUNTS)  # per candidate: codec seconds, wait seconds, then the counts


@dataclass
class LayoutRecord:
    """One layout's measurements. ``codec[i]``: codec seconds of candidate ``i``, one per bucket reduced with
    it; ``counts[i]``: its last bucket's collectives; ``chosen``: the candidate in use once decided;
    ``last``: the candidate that reduced the bucket last (whose held-back gradient a switch hands on);
    ``waited[i]``: wall seconds less codec seconds of candidate ``i``'s buckets (its collectives, as this run
    meets them); ``waits``: the same of the chosen candidate's buckets since the last check."""

    bucket: BucketInfo
    candidates: int
    codec: list = field(default_factory=list)
    waited: list = field(default_factory=list)
    counts: list = field(default_factory=list)
    chosen: int | None = None
    last: int | None = None
    predicted: dict = field(default_factory=dict)  # candidate index -> predicted seconds, at the last choice
    waits: list = field(default_factory=list)

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
        if self.chosen is None:  # measuring: kept per candidate for the decision
            self.waited[candidate].append(wait_s)
        elif candidate == self.chosen:
            self.waits.append(wait_s)

    def codec_s(self, candidate: int) -> float:
        """The candidate's codec seconds: the fastest of its buckets after the first (which pays first-time
        allocations), or the first when there is only one; 0 when it never ran here."""
        samples = self.codec[candidate]
        if not samples:
            return 0.0
        return min(samples[1:]) if len(samples) > 1 else samples[0]

    def wait_s(self, candidate: int) -> float:
        """The candidate's wait seconds while measuring: the median of its buckets after the first; 0 when it
        never ran here."""
        return median_after_first(self.waited[candidate])

    def vector(self) -> list[float]:
        """This rank's measurements, ``WIDTH`` values per candidate, for the ranks to agree on (MAX)."""
        out = []
        for i in range(self.candidates):
            out += [self.codec_s(i), self.wait_s(i)]
            out.extend(self.counts[i] or [0.0] * len(COUNTS))
        return out

    @staticmethod
    def launched(values, workers: int) -> Launched:
        """The agreed counts of one candidate (``vector``'s layout: codec and wait seconds first) as one
        bucket's."""
        counts = dict(zip(COUNTS, values[2:WIDTH]))
        return Launched(workers, buckets=1, **counts)


def median_after_first(samples: list[float]) -> float:
    """The median of ``samples`` past the first (which pays a switch and first-time costs); 0 for none."""
    kept = samples[1:] if len(samples) > 1 else samples
    return statistics.median(kept) if kept else 0.0
