"""The alpha-beta cost model behind ``gcomp simulate``: step time of a measured method at other scales.

A benchmark run measures, per optimizer step and on rank 0, what each method computes (forward, backward,
optimizer; encode and decode; ``round_work_s``, the codec's work between its rounds) and what its
communicator launched (``gcomp.collectives.launch``: all-reduces and all-gathers with their bytes,
point-to-point rounds with their bytes, sequential rounds). Its workers also probe the path they run on
(``gcomp.bench.throughput``): the latency per message ``alpha`` and the seconds per byte ``beta`` from two
timed gloo all-reduces, and ``alpha`` again right after a step's local work (the latency a step's rounds
meet on a busy machine, which ``model_error`` prices the run with); and they record ``wait_s``, how long
rank 0 waited each step for its slowest peer to be ready to communicate (``gcomp.bench.straggler``).

Predicted step = compute + encode + decode + round work + wait + communication, where communication prices
every counted collective with ``alpha`` and ``beta`` (``launched_s``): the formulas of
``gcomp.link.costs``.

Communication is not overlapped with the backward pass (``step_time`` says why; the error table shows
measured and predicted communication side by side). ``model_error`` prices every shaped run on the link its
own workers probed and reports the error; ``project`` prices the largest run of each method at other worker
counts and bandwidths with one ``alpha`` and the nominal ``beta``, without the wait for peers (that is this
machine's cores shared by the workers, not a cluster's). Only ``alpha``, ``beta`` and ``wait_s`` come from
outside the counts, all measured by the run; nothing is fitted per method.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from gcomp.core import HIERARCHICAL, POINT_TO_POINT
from gcomp.link import DEFAULT_ALPHA_S, Launched, Network, bandwidth_label, comm_time, launched_s


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
