"""The alpha-beta cost of collectives on ``P`` ranks (``alpha``: seconds per message, ``beta``: seconds per byte),
as ``gcomp simulate`` prices a step and ``auto`` each candidate (the table: docs/algorithms.md §12). ``Network`` is
one link type; ``launched_s`` prices what a step launched as a run counted it (``Launched``), ``comm_time`` one
collective of the step's bytes (a run without counts: an older one, a PyTorch hook). One worker costs nothing.
"""
from __future__ import annotations

import math
import numbers
import re
from dataclasses import dataclass

from gcomp.core import ALLREDUCE, COLLECTIVES, HIERARCHICAL, POINT_TO_POINT

# a link's rate as text, in bits per second with tc's decimal units ("100mbit"), as --bandwidth takes it
RATE_UNITS = {"": 1, "bit": 1, "kbit": 1_000, "mbit": 1_000_000, "gbit": 1_000_000_000, "tbit": 1_000_000_000_000}
_RATE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(bit|kbit|mbit|gbit|tbit)?\s*$", re.IGNORECASE)
RATE_FORMS = ("a rate in bits per second such as 500kbit, 100mbit, 1gbit, 2.5gbit (decimal multiples, as tc) "
               "or 'none'")


def parse_rate(text: str) -> int | None:
    """``"100mbit"`` -> ``100_000_000`` bits per second; ``"none"`` or ``""`` -> ``None`` (no shaping)."""
    if text is None or text.strip().lower() in ("", "none"):
        return None
    match = _RATE_RE.match(text)
    if match is None:
        raise ValueError(f"--bandwidth: cannot read {text!r}; expected {RATE_FORMS}")
    rate = round(float(match.group(1)) * RATE_UNITS[(match.group(2) or "").lower()])
    if rate <= 0:
        raise ValueError(f"--bandwidth: {text!r} is not a positive rate; expected {RATE_FORMS}")
    return rate


def bandwidth_label(bandwidth_bps: float) -> str:
    """``1e9`` -> ``"1gbit"``: the largest unit that keeps the number >= 1."""
    for unit, scale in sorted(RATE_UNITS.items(), key=lambda item: -item[1]):
        if unit and bandwidth_bps >= scale:
            return f"{bandwidth_bps / scale:g}{unit}"
    return f"{bandwidth_bps:g}bit"


P2P_METHODS = ("spardl", "gtopk")
DEFAULT_ALPHA_S = 50e-6


@dataclass(frozen=True)
class Network:
    """One link type: ``bandwidth_bps`` bits per second per link, ``alpha_s`` seconds of latency per message."""

    bandwidth_bps: float
    alpha_s: float = DEFAULT_ALPHA_S

    def __post_init__(self):
        if not self.bandwidth_bps > 0 or not math.isfinite(self.bandwidth_bps):
            raise ValueError(f"Network: bandwidth_bps must be a positive finite number; got {self.bandwidth_bps!r}")
        if not self.alpha_s >= 0:
            raise ValueError(f"Network: alpha_s must be >= 0; got {self.alpha_s!r}")

    @property
    def beta_s(self) -> float:
        """Seconds per byte."""
        return 8.0 / self.bandwidth_bps

    @property
    def label(self) -> str:
        """The bandwidth as ``parse`` reads it back, e.g. ``"10gbit"``."""
        return bandwidth_label(self.bandwidth_bps)

    @classmethod
    def parse(cls, text: str, alpha_s: float = DEFAULT_ALPHA_S) -> Network:
        """A network from a bandwidth as ``--bandwidth`` reads it (``parse_rate``): ``"100mbit"``,
        ``"1gbit"``, ``"10Gbit"``; ``"none"`` has no bandwidth to model and is refused."""
        rate = parse_rate(text) if isinstance(text, str) else None
        if rate is None:
            raise ValueError(f"bandwidth must be a rate such as '100mbit', '1gbit' or '10gbit'; got {text!r}")
        return cls(float(rate), alpha_s)


def ring_allreduce_s(nbytes: float, workers: int, network: Network) -> float:
    """Ring all-reduce (reduce-scatter then all-gather) of ``nbytes`` per rank."""
    if workers == 1:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes * network.beta_s + 2 * (workers - 1) * network.alpha_s


def ring_allgather_s(nbytes: float, workers: int, network: Network) -> float:
    """Ring all-gather where every rank contributes ``nbytes``."""
    return (workers - 1) * nbytes * network.beta_s + (workers - 1) * network.alpha_s


def rounds(workers: int) -> int:
    """``ceil(log2 P)``: the depth of a binary tree or recursive-doubling schedule over ``P`` ranks."""
    return math.ceil(math.log2(workers)) if workers > 1 else 0


def spardl_s(nbytes: float, workers: int, network: Network) -> float:
    """SparDL: about a reduce-scatter plus all-gather of the selected entries, in ``2 ceil(log2 P)`` messages."""
    if workers == 1:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes * network.beta_s + 2 * rounds(workers) * network.alpha_s


def gtopk_s(nbytes: float, workers: int, network: Network) -> float:
    """gTop-k: a tree reduction then a tree broadcast, each round moving k entries (``nbytes``)."""
    return 2 * rounds(workers) * (nbytes * network.beta_s + network.alpha_s)


def tree_broadcast_s(nbytes: float, workers: int, network: Network) -> float:
    """Binomial-tree broadcast of ``nbytes`` to ``workers`` ranks."""
    return rounds(workers) * (nbytes * network.beta_s + network.alpha_s)


def p2p_depth(workers: int) -> int:
    """Rounds of SparDL's and gTop-k's schedules (one team): ``2 ceil(log2 P)``."""
    return 2 * rounds(workers)


def p2p_byte_share(method: str, workers: int) -> float:
    """Bytes a point-to-point schedule moves per rank and round-critical path, in selections (k entries):
    SparDL ``2(P-1)/P``, gTop-k's root one per round, ``2 ceil(log2 P)``."""
    if method == "gtopk":
        return float(p2p_depth(workers))
    return 2 * (workers - 1) / workers


@dataclass(frozen=True)
class Launched:
    """What one rank's communicator launched per optimizer step, as a run counted it (``gcomp.collectives.
    counting``) at ``workers`` ranks: all-reduces and all-gathers with their bytes, point-to-point rounds with
    the bytes of each round's busier direction, sequential ``rounds`` and ``buckets``."""

    workers: int
    rounds: float = 0.0
    allreduce_calls: float = 0.0
    allreduce_bytes: float = 0.0
    allgather_calls: float = 0.0
    allgather_bytes: float = 0.0
    p2p_rounds: float = 0.0
    p2p_bytes: float = 0.0
    buckets: float = 0.0

    COUNTS = ("rounds", "allreduce_calls", "allreduce_bytes", "allgather_calls", "allgather_bytes", "p2p_rounds",
              "p2p_bytes", "buckets")

    @classmethod
    def from_row(cls, row: dict) -> Launched | None:
        """The ``*_per_step`` counts of a results row; None for a row without them (an older run, a PyTorch
        hook, a single worker)."""
        values = {key: row.get(f"{key}_per_step") for key in cls.COUNTS}
        workers = row.get("workers") or 1
        if None in values.values() or workers < 2:
            return None
        return cls(int(workers), **{key: float(value) for key, value in values.items()})


def launched_s(launched: Launched, workers: int, network: Network, method: str = "") -> float:
    """Seconds of communication of one step of ``launched`` on ``workers`` ranks: each collective priced by
    the alpha-beta cost of its algorithm (gloo's ring all-reduce ``2(P-1)`` messages and ``2(P-1)/P`` of its
    bytes, ring all-gather ``P-1`` and ``P-1`` times), each point-to-point round ``alpha`` plus its busier
    direction's bytes. At another worker count the counts stay per step, except a point-to-point schedule's
    rounds and bytes, which scale as ``p2p_depth`` and ``p2p_byte_share`` of ``method``."""
    if workers == 1:
        return 0.0
    alpha, beta = network.alpha_s, network.beta_s
    seconds = (launched.allreduce_calls * 2 * (workers - 1) * alpha
               + launched.allreduce_bytes * 2 * (workers - 1) / workers * beta
               + launched.allgather_calls * (workers - 1) * alpha
               + launched.allgather_bytes * (workers - 1) * beta)
    if launched.p2p_rounds:
        measured = launched.workers
        seconds += (launched.p2p_rounds * p2p_depth(workers) / p2p_depth(measured) * alpha
                    + launched.p2p_bytes * p2p_byte_share(method, workers) / p2p_byte_share(method, measured) * beta)
    return seconds


def point_to_point_s(method: str, nbytes: float, workers: int, network: Network) -> float:
    """The point-to-point schedule of ``method`` (``"spardl"`` or ``"gtopk"``)."""
    if method == "spardl":
        return spardl_s(nbytes, workers, network)
    if method == "gtopk":
        return gtopk_s(nbytes, workers, network)
    raise ValueError(f"point-to-point: unknown method {method!r}; the model knows {', '.join(P2P_METHODS)}")


def hierarchical_s(nbytes: float, workers: int, network: Network, *, method: str, ranks_per_node: int,
                   intra: Network | None, dense_bytes: float | None, inner: str) -> float:
    """Dense all-reduce inside each node, ``inner`` across the node leaders, tree broadcast inside each node."""
    if dense_bytes is None:
        raise ValueError("hierarchical: dense_bytes (the bucket's bytes, reduced inside each node) is required")
    if ranks_per_node < 1 or workers % ranks_per_node:
        raise ValueError(f"hierarchical: workers ({workers}) must be a multiple of ranks_per_node "
                         f"({ranks_per_node})")
    if inner == HIERARCHICAL:
        raise ValueError("hierarchical: the inner collective cannot be 'hierarchical' itself")
    # Without a faster intra-node link given, assume none: the conservative choice.
    intra = intra or network
    nodes = workers // ranks_per_node
    return (ring_allreduce_s(dense_bytes, ranks_per_node, intra)
            + comm_time(inner, nbytes, nodes, network, method=method)
            + tree_broadcast_s(dense_bytes, ranks_per_node, intra))


def comm_time(collective: str, nbytes: float, workers: int, network: Network, *, method: str = "",
              ranks_per_node: int = 1, intra: Network | None = None, dense_bytes: float | None = None,
              inner: str = ALLREDUCE) -> float:
    """Seconds one step's ``collective`` takes when each of ``workers`` ranks hands it ``nbytes``.

    ``"point-to-point"``: ``method`` (``"spardl"`` or ``"gtopk"``) picks the schedule and ``nbytes`` is the
    bytes of the rank's k selected entries (values and indices). ``"hierarchical"``: ``nbytes`` is what each
    leader hands to the ``inner`` collective (an all-reduce unless said otherwise; ``method`` is passed on to
    it), ``dense_bytes`` the bucket reduced and broadcast inside each node of ``ranks_per_node`` ranks over
    ``intra`` (default: the same link as between nodes). One worker communicates nothing.
    """
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; the model knows {', '.join(COLLECTIVES)}")
    if isinstance(workers, bool) or not isinstance(workers, numbers.Integral) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1; got {workers!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0; got {nbytes!r}")
    if collective == POINT_TO_POINT:
        return point_to_point_s(method, nbytes, workers, network)
    if collective == HIERARCHICAL:
        return hierarchical_s(nbytes, workers, network, method=method, ranks_per_node=ranks_per_node,
                              intra=intra, dense_bytes=dense_bytes, inner=inner)
    if workers == 1:
        return 0.0
    if collective == ALLREDUCE:
        return ring_allreduce_s(nbytes, workers, network)
    return ring_allgather_s(nbytes, workers, network)
