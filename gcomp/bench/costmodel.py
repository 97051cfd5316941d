"""The alpha-beta cost model behind ``gcomp simulate``: step time of a measured method at other scales.

A benchmark run measures, per optimizer step and per rank, what each method computes (forward, backward,
optimizer, encode, decode) and how many bytes it hands to its collective. Here those measurements are combined
with the classic alpha-beta cost of that collective (``alpha``: seconds per message, ``beta``: seconds per byte)
to predict the step time at worker counts and bandwidths that were never run. ``model_error`` checks the model
against the runs that were measured on a shaped network.

Cost of one collective, ``n`` bytes handed over by each of ``P`` ranks:

- ring all-reduce: ``2(P-1)/P * n * beta + 2(P-1) * alpha``;
- ring all-gather (each rank contributes ``n``): ``(P-1) * n * beta + (P-1) * alpha``;
- SparDL (point-to-point, ``n`` = bytes of the rank's k selected entries): ``2(P-1)/P * n * beta
  + 2 ceil(log2 P) * alpha``;
- gTop-k (tree, ``n`` = bytes of k entries): ``2 ceil(log2 P) * (n * beta + alpha)``;
- hierarchical (``M`` nodes of ``G`` ranks): ring all-reduce of the dense bucket inside each node, the inner
  collective across the ``M`` leaders, and a tree broadcast of the dense bucket inside each node
  (``ceil(log2 G) * (n_dense * beta_intra + alpha_intra)``);
- one worker: no communication.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Sequence

from gcomp.bench.netem import RATE_UNITS, parse_rate
from gcomp.core import ALLREDUCE, COLLECTIVES, HIERARCHICAL, POINT_TO_POINT
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
        """A network from a bandwidth as ``--bandwidth`` reads it (``gcomp.bench.netem.parse_rate``): ``"100mbit"``,
        ``"1gbit"``, ``"10Gbit"``; ``"none"`` has no bandwidth to model and is refused."""
        rate = parse_rate(text) if isinstance(text, str) else None
        if rate is None:
            raise ValueError(f"bandwidth must be a rate such as '100mbit', '1gbit' or '10gbit'; got {text!r}")
        return cls(float(rate), alpha_s)


def bandwidth_label(bandwidth_bps: float) -> str:
    """``1e9`` -> ``"1gbit"``: the largest unit that keeps the number >= 1."""
    for unit, scale in sorted(RATE_UNITS.items(), key=lambda item: -item[1]):
        if unit and bandwidth_bps >= scale:
            return f"{bandwidth_bps / scale:g}{unit}"
    return f"{bandwidth_bps:g}bit"


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


@dataclass(frozen=True)
class Profile:
    """One method as a benchmark run measured it, per optimizer step and per rank.

    ``bytes_sent`` is what the rank hands to its collective (for an all-gather: its own contribution; for a
    point-to-point method: the bytes of its k selected entries; for hierarchical: what a leader hands to the
    inner collective); ``bytes_dense`` what a plain fp32 all-reduce would hand over. ``steps_to_target`` is
    ``None`` when the run never reached the target accuracy. The ``measured_*`` fields describe the run itself
    and feed ``model_error``.
    """

    method: str
    collective: str
    bytes_sent: float
    bytes_dense: float
    compute_s: float
    encode_s: float
    decode_s: float
    steps_to_target: int | None = None
    measured_step_s: float | None = None
    measured_workers: int | None = None
    measured_bandwidth_bps: float | None = None
    kind: str = ""  # the registered method name behind a label such as "topk:ratio=0.01" ("" : method)

    REQUIRED_KEYS = ("method", "collective", "bytes_sent_per_step", "bytes_dense_per_step", "compute_s_per_step",
                     "encode_s_per_step", "decode_s_per_step")

    @classmethod
    def from_row(cls, row: dict) -> Profile:
        """A profile from one ``results.json`` row; the optional keys (``steps_to_target``, ``step_s``,
        ``workers``, ``bandwidth_bps``) may be missing or ``None``."""
        if not isinstance(row, dict):
            raise ValueError(f"a results row must be a JSON object with a method's figures; got {row!r:.60}")
        missing = [key for key in cls.REQUIRED_KEYS if row.get(key) is None]
        if missing:
            raise ValueError(f"results row for method {row.get('method')!r} lacks {', '.join(missing)}")
        kind = str(row.get("name") or row["method"])
        try:
            return cls._from_checked_row(row, kind)
        except (TypeError, ValueError) as err:
            raise ValueError(f"results row for method {row.get('method')!r} holds a value that is not a number "
                             f"({err})") from err

    @classmethod
    def _from_checked_row(cls, row: dict, kind: str) -> Profile:
        return cls(method=str(row["method"]), collective=str(row["collective"]), kind=kind,
                   bytes_sent=_selection_bytes(row, kind), bytes_dense=float(row["bytes_dense_per_step"]),
                   compute_s=float(row["compute_s_per_step"]), encode_s=float(row["encode_s_per_step"]),
                   decode_s=float(row["decode_s_per_step"]),
                   steps_to_target=_optional(row, "steps_to_target", int),
                   measured_step_s=_optional(row, "step_s", float),
                   measured_workers=_optional(row, "workers", int),
                   measured_bandwidth_bps=_optional(row, "bandwidth_bps", float))

    @property
    def local_s(self) -> float:
        """What a step costs apart from communication: compute, encode and decode."""
        return self.compute_s + self.encode_s + self.decode_s


def _selection_bytes(row: dict, kind: str) -> float:
    """A run counts every byte a rank sends over all rounds; the point-to-point formulas take the bytes of
    one selection (k entries): SparDL sends 2(P-1)/P of them per rank, gTop-k's root one per tree level."""
    sent, workers = float(row["bytes_sent_per_step"]), row.get("workers") or 1
    if row["collective"] != POINT_TO_POINT or workers < 2:
        return sent
    if kind == "spardl":
        return sent * workers / (2 * (workers - 1))
    if kind == "gtopk":
        return sent / math.ceil(math.log2(workers))
    return sent


def _optional(row: dict, key: str, kind: type):
    value = row.get(key)
    return None if value is None else kind(value)


def profile_comm_s(profile: Profile, workers: int, network: Network, **kw) -> float:
    """``comm_time`` of one step of ``profile`` (a hierarchical method's dense bytes default to ``bytes_dense``)."""
    if profile.collective == HIERARCHICAL and kw.get("dense_bytes") is None:
        kw["dense_bytes"] = profile.bytes_dense
    return comm_time(profile.collective, profile.bytes_sent, workers, network, method=profile.kind or profile.method,
                     **kw)


def step_time(profile: Profile, workers: int, network: Network, **kw) -> float:
    """Predicted seconds per optimizer step: compute + encode + decode + communication (``kw`` goes to
    ``comm_time``).

    Communication is deliberately not overlapped with the backward pass: the prediction is an upper bound
    that favours no method, whereas overlap would hide part of the dense baseline's (larger) communication.
    """
    return profile.local_s + profile_comm_s(profile, workers, network, **kw)


def _find_baseline(profiles: Sequence[Profile], baseline: str) -> Profile:
    for profile in profiles:
        if profile.method == baseline:
            return profile
    known = ", ".join(sorted({p.method for p in profiles})) or "none"
    raise ValueError(f"baseline method {baseline!r} has no profile (methods: {known})")


def _ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator == 0:
        return None
    return numerator / denominator


def project(profiles: Sequence[Profile], workers: Sequence[int], networks: Sequence[Network],
            baseline: str = "identity", **kw) -> list[dict]:
    """One row per (method, workers, network): predicted ``step_s`` and ``comm_s``, ``speedup_vs_baseline``
    (the baseline's step time over this one's), ``tta_s`` (``steps_to_target * step_s``, ``None`` if the
    target was never reached) and ``tta_speedup`` (baseline's ``tta_s`` over this one's, ``None`` when either
    is missing). ``kw`` goes to ``comm_time`` (e.g. ``ranks_per_node``, ``intra``)."""
    base = _find_baseline(profiles, baseline)
    rows = []
    for network in networks:
        for count in workers:
            base_step = step_time(base, count, network, **kw)
            base_tta = None if base.steps_to_target is None else base.steps_to_target * base_step
            for profile in profiles:
                comm = profile_comm_s(profile, count, network, **kw)
                step = profile.local_s + comm
                tta = None if profile.steps_to_target is None else profile.steps_to_target * step
                rows.append({"method": profile.method, "collective": profile.collective, "workers": count,
                             "bandwidth": network.label, "bandwidth_bps": network.bandwidth_bps,
                             "alpha_s": network.alpha_s, "step_s": step, "comm_s": comm,
                             "speedup_vs_baseline": _ratio(base_step, step), "tta_s": tta,
                             "tta_speedup": _ratio(base_tta, tta)})
    return rows


def model_error(profiles: Sequence[Profile], network_alpha_s: float = DEFAULT_ALPHA_S, **kw) -> list[dict]:
    """Predicted against measured step time for every profile measured on a shaped network (with
    ``measured_step_s``, ``measured_workers`` and ``measured_bandwidth_bps``); ``rel_error`` is
    ``(predicted - measured) / measured``."""
    rows = []
    for profile in profiles:
        if None in (profile.measured_step_s, profile.measured_workers, profile.measured_bandwidth_bps):
            continue
        network = Network(profile.measured_bandwidth_bps, network_alpha_s)
        predicted = step_time(profile, profile.measured_workers, network, **kw)
        measured = profile.measured_step_s
        rows.append({"method": profile.method, "workers": profile.measured_workers, "bandwidth": network.label,
                     "predicted_s": predicted, "measured_s": measured,
                     "rel_error": _ratio(predicted - measured, measured)})
    return rows
