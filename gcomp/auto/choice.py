"""What ``auto`` may choose among (``allow``), what each candidate costs on a bucket, as measured per layout
(``LayoutRecord``) and priced on a link (``gcomp.link``), and the choice, with a margin against flapping."""
from __future__ import annotations

import difflib
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from gcomp.bucket import BucketInfo
from gcomp.core import ALLGATHER, ALLREDUCE
from gcomp.link import Launched, Network, launched_s
from gcomp.method import MethodUnit
from gcomp.registry import Nested, UnknownMethodError, available, from_spec

EXACT = ("identity",)  # pactrain joins them on a pruned model: its packed sum is the dense one's, losslessly
HALF = ("fp16", "bf16")
PRESETS = ("exact", "half")
PRICED = (ALLREDUCE, ALLGATHER)  # the collectives the choice prices from a bucket's counted calls and bytes alone
SEPARATOR = "|"  # between the specs of a list given as one string (``auto:allow=identity|fp16``)


class AllowList:
    """``allow``'s values, held as text (a preset's name, or canonical specs joined by ``|``) to print, checkpoint."""

    def __str__(self) -> str:
        return f"'exact', 'half', or a list of method specs (in a string: joined by '{SEPARATOR}')"

    def convert(self, method: str, param: str, value: Any) -> str:
        if isinstance(value, str) and value.strip() in PRESETS:  # spaces dropped, as around a list's entries
            return value.strip()
        listed = value.split(SEPARATOR) if isinstance(value, str) else value
        if not isinstance(listed, (list, tuple)) or not all(isinstance(v, str) for v in listed):
            raise ValueError(f"{method}: parameter '{param}' must be {self}; got {listed!r}")
        specs = allowed_methods(list(listed), pruned=True, given=value)  # the checks and messages of every entry
        return SEPARATOR.join(Nested().convert(method, param, spec) for spec in specs)


def allowed_methods(allow: str | Sequence[str], pruned: bool, given: object = None) -> list[str]:
    """The specs ``auto`` chooses among, in tie-breaking order: a preset's (``pactrain`` when ``pruned``: its sum is
    the dense one) or ``allow``'s, each checked as ``gcomp.create`` checks it, and refused if the choice cannot price
    its collective or it cannot hand over at a switch what it holds back. ``given``: ``allow`` as written."""
    if isinstance(allow, str):
        if allow not in PRESETS:
            raise ValueError(f"auto: allow must be one of {', '.join(map(repr, PRESETS))} or a list of method "
                             f"specs; got {allow!r}{_closest(allow)}")
        exact = list(EXACT) + (["pactrain"] if pruned else [])
        return exact if allow == "exact" else exact + list(HALF)
    given = list(allow) if given is None else given
    specs = [str(s).strip() for s in allow]
    if not specs:
        raise ValueError("auto: allow lists no method")
    for number, text in enumerate(specs, 1):
        name = text.partition(":")[0].strip()
        if not text:
            raise ValueError(f"auto: allow entry {number} of {given!r} is empty; list method specs, in a string "
                             f"joined by '|' (identity|fp16)")
        if name == "auto":
            raise ValueError("auto: allow cannot list auto itself")
        if name in PRESETS:
            held = ", ".join(EXACT + (HALF if name == "half" else ()))
            raise ValueError(f"auto: allow entry {text!r} is a preset, which stands alone (allow={name!r}); a list "
                             f"names methods only ({name!r} is {held}, with pactrain on a pruned model)")
        if name not in available():
            methods = ", ".join(n for n in available() if n != "auto")
            raise UnknownMethodError(f"auto: allow entry {text!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                                     f"registered method ({methods}){_closest(name)}")
    if len(set(specs)) != len(specs):
        raise ValueError(f"auto: allow lists a method twice: {specs}")
    for text in specs:
        try:
            method = from_spec(text)
        except ValueError as err:
            raise ValueError(f"auto: allow entry {text!r}: {err}") from None
        if method.collective not in PRICED:
            raise ValueError(f"auto: allow entry {text!r} runs the {method.collective!r} collective, "
                             f"which auto cannot price yet; it chooses among {' and '.join(PRICED)} methods")
        if method.error_feedback and type(method).flush is MethodUnit.flush:
            raise ValueError(f"auto: allow entry {text!r} keeps gradient it did not send inside its codec and cannot "
                             "hand it to another method at a switch; leave its error feedback off")
    return specs


def _closest(name: str) -> str:
    """"; did you mean ...?" with the presets and methods closest to ``name`` (one differing in case first)."""
    candidates = {**{p: f"the preset {p!r}" for p in PRESETS}, **{m: repr(m) for m in available() if m != "auto"}}
    same = [c for c in candidates if c.lower() == name.strip().lower()]
    if same:
        return f"; did you mean {candidates[same[0]]}? Names are case-sensitive"
    close = difflib.get_close_matches(name.strip(), candidates, n=3, cutoff=0.4)
    return f"; did you mean {' or '.join(candidates[c] for c in close)}?" if close else ""


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
    """One layout's measurements per candidate (codec seconds, waits while measuring, collectives, agreed ``costs``);
    ``chosen`` and its ``waits`` since the last check; ``last``: the candidate that reduced the layout last."""

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
        codec_s = sum(float(stats.get(k, 0.0)) for k in CODEC_KEYS)
        wait_s = max(wall_s - codec_s, 0.0)
        self.codec[candidate].append(codec_s)
        self.counts[candidate] = [float(stats.get(k, 0)) for k in COUNTS]
        if self.chosen is None:
            self.waited[candidate].append(wait_s)
        elif candidate == self.chosen:
            self.waits.append(wait_s)

    def codec_s(self, candidate: int) -> float:
        """The fastest bucket after the first (which pays first-time allocations)."""
        samples = self.codec[candidate]
        return (min(samples[1:]) if len(samples) > 1 else samples[0]) if samples else 0.0

    def vector(self) -> list[float]:
        """``WIDTH`` values per candidate, for the ranks to agree on (MAX)."""
        out = []
        for i in range(self.candidates):
            out += [self.codec_s(i), median_after_first(self.waited[i]), *(self.counts[i] or [0.0] * len(COUNTS))]
        return out


@dataclass(frozen=True)
class BucketCost:
    """One method on one bucket: codec seconds, collectives, and what they took beyond their price where measured."""

    codec_s: float
    launched: Launched
    overhead_s: float = 0.0

    def __post_init__(self):
        for name in ("codec_s", "overhead_s"):
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"BucketCost: {name} must be a finite number >= 0; got {value!r}")


def link_network(alpha_s: float, beta_s: float) -> Network:
    """The link measured (seconds per message and per byte) as the formulas take it; no cost per byte: 1 Tbit/s."""
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
