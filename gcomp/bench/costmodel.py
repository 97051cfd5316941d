"""The alpha-beta cost model behind ``gcomp simulate``: step time of a measured method at other scales.

A benchmark run measures, per optimizer step and on rank 0, what each method computes (forward, backward,
optimizer; encode and decode; ``round_work_s``, the codec's work between its rounds) and what its
communicator launched (``gcomp.collectives.counting``: all-reduces and all-gathers with their bytes,
point-to-point rounds with their bytes, sequential rounds). Its workers also probe the path they run on
(``gcomp.bench.throughput``): the latency per message ``alpha`` and the seconds per byte ``beta`` from two
timed gloo all-reduces, and ``alpha`` again right after a step's local work (the latency a step's rounds
meet on a busy machine, which ``model_error`` prices the run with); and they record ``wait_s``, how long
rank 0 waited each step for its slowest peer to be ready to communicate (``gcomp.bench.straggler``).

Predicted step = compute + encode + decode + round work + wait + communication, where communication prices
every counted collective with ``alpha`` and ``beta`` (``launched_s``; ``P`` ranks, ``n`` bytes):

- ring all-reduce (gloo's): ``2(P-1) * alpha + 2(P-1)/P * n * beta`` per all-reduce;
- ring all-gather (each rank contributes ``n``): ``(P-1) * alpha + (P-1) * n * beta`` per all-gather;
- a point-to-point round: ``alpha`` + the bytes of its busier direction times ``beta`` (at another ``P``,
  SparDL's and gTop-k's rounds scale as ``2 ceil(log2 P)``, their bytes as ``2(P-1)/P`` and
  ``2 ceil(log2 P)`` selections);
- hierarchical (``M`` nodes of ``G`` ranks; its intra-node stages are not counted): ring all-reduce of the
  dense bucket inside each node, the inner collective across the ``M`` leaders, and a tree broadcast of the
  dense bucket inside each node (``ceil(log2 G) * (n_dense * beta_intra + alpha_intra)``);
- a run without counts (an older one, a PyTorch hook): one collective of the step's bytes per step
  (``comm_time``: the formulas above, SparDL ``2(P-1)/P * n * beta + 2 ceil(log2 P) * alpha``, gTop-k
  ``2 ceil(log2 P) * (n * beta + alpha)``);
- one worker: no communication.

Communication is not overlapped with the backward pass (``step_time`` says why; the error table shows
measured and predicted communication side by side). ``model_error`` prices every shaped run on the link its
own workers probed and reports the error; ``project`` prices the largest run of each method at other worker
counts and bandwidths with one ``alpha`` and the nominal ``beta``, without the wait for peers (that is this
machine's cores shared by the workers, not a cluster's). Only ``alpha``, ``beta`` and ``wait_s`` come from
outside the counts, all measured by the run; nothing is fitted per method.
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


@dataclass(frozen=True)
class Profile:
    """One method as a benchmark run measured it, per optimizer step and per rank.

    ``bytes_sent`` is what the rank hands to its collective (for an all-gather: its own contribution; for a
    point-to-point method: the bytes of its k selected entries; for hierarchical: what a leader hands to the
    inner collective); ``bytes_dense`` what a plain fp32 all-reduce would hand over. ``steps_to_target`` is
    ``None`` when the run never reached the target accuracy. The ``measured_*`` fields describe the run itself
    and feed ``model_error``, which prices it with the run's own probed link (``link_alpha_s``,
    ``link_beta_s``). With ``launched`` (the run's counted collectives) communication is priced collective by
    collective (``launched_s``); without (an older run, a PyTorch hook), as one ``collective`` of
    ``bytes_sent`` per step.
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
    launched: Launched | None = None  # what the run's communicator launched per step; None: not counted
    round_work_s: float = 0.0  # codec work between the communicator's rounds (not in encode_s, decode_s)
    wait_s: float = 0.0  # per step, rank 0's wait for its slowest peer (gcomp.bench.straggler, in the run)
    link_alpha_s: float | None = None  # the run's path as its workers probed it (gcomp.bench.throughput)
    link_beta_s: float | None = None
    loaded_alpha_s: float | None = None  # alpha as the run's rounds meet it, right after local work

    REQUIRED_KEYS = ("method", "collective", "bytes_sent_per_step", "bytes_dense_per_step", "compute_s_per_step",
                     "encode_s_per_step", "decode_s_per_step")

    @classmethod
    def from_row(cls, row: dict) -> Profile:
        """A profile from one ``results.json`` row; the optional keys (``steps_to_target``, ``step_s``,
        ``workers``, ``bandwidth_bps``, ``comm_s_per_step``, the counts of ``Launched`` and ``link``) may be
        missing or ``None``."""
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
                   measured_bandwidth_bps=_optional(row, "bandwidth_bps", float),
                   launched=Launched.from_row(row), round_work_s=_optional(row, "round_work_s_per_step", float) or 0.0,
                   wait_s=_optional(row, "wait_s_per_step", float) or 0.0,
                   loaded_alpha_s=_optional(row, "alpha_loaded_s", float),
                   link_alpha_s=_optional(row.get("link") or {}, "alpha_s", float),
                   link_beta_s=_optional(row.get("link") or {}, "beta_s", float))

    @property
    def local_s(self) -> float:
        """What a step costs apart from communication: compute, encode, decode and the codec's work between
        rounds."""
        return self.compute_s + self.encode_s + self.decode_s + self.round_work_s

    @property
    def measured_comm_s(self) -> float | None:
        """The measured step less its local work and its wait for peers: what the run spent communicating."""
        if self.measured_step_s is None:
            return None
        return max(self.measured_step_s - self.local_s - self.wait_s, 0.0)


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
    """Seconds of communication of one step of ``profile``: ``launched_s`` of its counted collectives, or
    without counts ``comm_time`` of one collective (always for hierarchical methods, whose intra-node stages
    are not counted; their dense bytes default to ``bytes_dense``)."""
    if profile.launched is not None and profile.collective != HIERARCHICAL:
        return launched_s(profile.launched, workers, network, profile.kind or profile.method)
    if profile.collective == HIERARCHICAL and kw.get("dense_bytes") is None:
        kw["dense_bytes"] = profile.bytes_dense
    return comm_time(profile.collective, profile.bytes_sent, workers, network, method=profile.kind or profile.method,
                     **kw)


def step_time(profile: Profile, workers: int, network: Network, **kw) -> float:
    """Predicted seconds per optimizer step: compute + encode + decode + communication (``kw`` goes to
    ``comm_time``).

    Communication is not overlapped with the backward pass. DDP launches a bucket's collectives as soon as
    its gradients are ready, but a chained round or a point-to-point schedule is waited for in the hook, on
    the backward pass's own thread, and what is left of the backward pass after the first bucket is the
    shortest part of it (the first layers); the error table shows the measured and predicted communication
    side by side, so an overlap the model misses shows up as a measured ``comm`` below the predicted one.
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


def measured_network(profile: Profile, alpha_s: float = DEFAULT_ALPHA_S) -> Network | None:
    """The network ``profile`` ran on: its probed link where the run measured one (``beta`` of the idle probe,
    ``alpha`` as the run's rounds met it where probed, else the idle probe's), else its nominal bandwidth
    with ``alpha_s``; None for a run on no shaped network."""
    if profile.measured_bandwidth_bps is None:
        return None
    alpha = profile.loaded_alpha_s if profile.loaded_alpha_s is not None else profile.link_alpha_s
    if profile.link_beta_s and alpha is not None:
        return Network(8.0 / profile.link_beta_s, alpha)
    return Network(profile.measured_bandwidth_bps, alpha_s)


def model_error(profiles: Sequence[Profile], network_alpha_s: float = DEFAULT_ALPHA_S, **kw) -> list[dict]:
    """Predicted against measured step time for every profile measured on a shaped network (with
    ``measured_step_s``, ``measured_workers`` and ``measured_bandwidth_bps``), priced on the run's own probed
    link (``measured_network``; ``network_alpha_s`` where it has none) and with the run's measured wait for
    peers (``wait_s``); ``rel_error`` is ``(predicted - measured) / measured``. Communication is shown beside
    it: measured (the step less local work and wait) and predicted."""
    rows = []
    for profile in profiles:
        if None in (profile.measured_step_s, profile.measured_workers, profile.measured_bandwidth_bps):
            continue
        network = measured_network(profile, network_alpha_s)
        comm = profile_comm_s(profile, profile.measured_workers, network, **kw)
        predicted = profile.local_s + profile.wait_s + comm
        measured = profile.measured_step_s
        rows.append({"method": profile.method, "workers": profile.measured_workers,
                     "bandwidth": bandwidth_label(profile.measured_bandwidth_bps),
                     "link_alpha_us": network.alpha_s * 1e6, "link_mbit": network.bandwidth_bps / 1e6,
                     "counted": profile.launched is not None, "local_s": profile.local_s,
                     "wait_s": profile.wait_s,
                     "measured_comm_s": profile.measured_comm_s, "predicted_comm_s": comm,
                     "predicted_s": predicted, "measured_s": measured,
                     "rel_error": _ratio(predicted - measured, measured)})
    return rows


def error_by_method(errors: Sequence[dict]) -> dict[str, float]:
    """Per method, its largest relative error (by magnitude, sign kept) over the measured runs."""
    worst: dict[str, float] = {}
    for row in errors:
        if row["rel_error"] is not None and abs(row["rel_error"]) >= abs(worst.get(row["method"], 0.0)):
            worst[row["method"]] = row["rel_error"]
    return worst
