"""Project step time and time-to-accuracy of gradient-compression methods to large clusters (alpha-beta model).

    gcomp simulate --results results.json --workers 8 16 32 64 --bandwidth 1gbit 10gbit   # or python -m gcomp.bench.simulate

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

import argparse
import json
import math
import numbers
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

ALLREDUCE, ALLGATHER, POINT_TO_POINT, HIERARCHICAL = "allreduce", "allgather", "point-to-point", "hierarchical"
COLLECTIVES = (ALLREDUCE, ALLGATHER, POINT_TO_POINT, HIERARCHICAL)
P2P_METHODS = ("spardl", "gtopk")
DEFAULT_ALPHA_S = 50e-6
DEFAULT_WORKERS = (8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_BANDWIDTHS = ("100mbit", "1gbit", "10gbit", "100gbit")
BIT_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_BANDWIDTH_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]bit)\s*$", re.IGNORECASE)


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
        """A network from a bandwidth such as ``"100mbit"``, ``"1gbit"`` or ``"10Gbit"`` (case-insensitive)."""
        match = _BANDWIDTH_RE.match(text) if isinstance(text, str) else None
        if match is None:
            raise ValueError(f"bandwidth must look like '100mbit', '1gbit' or '10gbit' "
                             f"(units: {', '.join(BIT_UNITS)}); got {text!r}")
        value = float(match.group(1)) * BIT_UNITS[match.group(2).lower()]
        if value <= 0:
            raise ValueError(f"bandwidth must be positive; got {text!r}")
        return cls(value, alpha_s)


def bandwidth_label(bandwidth_bps: float) -> str:
    """``1e9`` -> ``"1gbit"``: the largest unit that keeps the number >= 1."""
    for unit, scale in sorted(BIT_UNITS.items(), key=lambda item: -item[1]):
        if bandwidth_bps >= scale:
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
        missing = [key for key in cls.REQUIRED_KEYS if row.get(key) is None]
        if missing:
            raise ValueError(f"results row for method {row.get('method')!r} lacks {', '.join(missing)}")
        kind = str(row.get("name") or row["method"])
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


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def markdown(rows: Sequence[dict]) -> str:
    """A markdown table of ``rows`` (columns: every key, in first-seen order; ``None`` shows as ``-``)."""
    if not rows:
        return "(no rows)"
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(key)) for key in columns) + " |" for row in rows]
    return "\n".join(lines)


def plot(rows: Sequence[dict], path) -> None:
    """Speedup against workers (log scale), one line per method, one panel per bandwidth, saved as a PNG."""
    import matplotlib  # lazily: the model itself needs no plotting library

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = sorted({row["bandwidth_bps"] for row in rows})
    methods = list(dict.fromkeys(row["method"] for row in rows))
    fig, axes = plt.subplots(1, max(len(bandwidths), 1), figsize=(4 * max(len(bandwidths), 1), 3.5),
                             squeeze=False, sharey=True)
    for ax, bandwidth in zip(axes[0], bandwidths):
        for method in methods:
            points = sorted((row["workers"], row["speedup_vs_baseline"]) for row in rows
                            if row["bandwidth_bps"] == bandwidth and row["method"] == method
                            and row["speedup_vs_baseline"] is not None)
            if points:
                ax.plot(*zip(*points), marker="o", label=method)
        ax.set_xscale("log", base=2)
        ax.set_title(bandwidth_label(bandwidth))
        ax.set_xlabel("workers")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("step-time speedup vs baseline")
    axes[0][-1].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_runs(path: Path) -> list[dict]:
    """The ``runs`` of a results file; ``SystemExit`` with the reason when it is missing, unreadable or empty."""
    if not path.is_file():
        raise SystemExit(f"simulate: results file {str(path)!r} not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"simulate: cannot read {str(path)!r}: {err}") from err
    runs = data.get("runs") if isinstance(data, dict) else None
    if not runs:
        raise SystemExit(f"simulate: {str(path)!r} has no runs (expected a JSON object with a non-empty 'runs' list)")
    return runs


def largest_run_per_method(runs: Sequence[dict]) -> list[dict]:
    """For each method (in first-seen order), its row with the most workers (the first such row on a tie)."""
    chosen: dict[str, dict] = {}
    for row in runs:
        best = chosen.get(row.get("method"))
        if best is None or (row.get("workers") or 1) > (best.get("workers") or 1):
            chosen[row.get("method")] = row
    return list(chosen.values())


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="gcomp simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, nargs="+", required=True,
                        help="results.json of one or more benchmark runs (runs at several worker counts and "
                             "bandwidths check the model against more measurements)")
    parser.add_argument("--workers", type=int, nargs="+", default=list(DEFAULT_WORKERS))
    parser.add_argument("--bandwidth", nargs="+", default=list(DEFAULT_BANDWIDTHS), help="e.g. 1gbit 10gbit")
    parser.add_argument("--alpha-us", type=float, default=DEFAULT_ALPHA_S * 1e6, help="latency per message")
    parser.add_argument("--baseline", default="identity")
    parser.add_argument("--ranks-per-node", type=int, default=1, help="node size for hierarchical methods")
    parser.add_argument("--intra-bandwidth", default=None, help="intra-node link (default: as between nodes)")
    parser.add_argument("--out", type=Path, default=None, help="default: the results file's folder")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """CLI: project the profiles of a results file, print the tables, write ``simulate.json`` and
    ``simulate.png`` (the plot is skipped, with a note, when matplotlib is not installed)."""
    args = _parse_args(argv)
    runs = [run for path in args.results for run in load_runs(path)]
    alpha_s = args.alpha_us * 1e-6
    try:
        networks = [Network.parse(text, alpha_s) for text in args.bandwidth]
        intra = None if args.intra_bandwidth is None else Network.parse(args.intra_bandwidth, alpha_s)
        comm_kw = {"ranks_per_node": args.ranks_per_node, "intra": intra}
        profiles = [Profile.from_row(row) for row in largest_run_per_method(runs)]
        rows = project(profiles, args.workers, networks, args.baseline, **comm_kw)
        errors = model_error([Profile.from_row(row) for row in runs], alpha_s, **comm_kw)
    except ValueError as err:
        raise SystemExit(f"simulate: {err}") from err
    print(markdown(rows))
    print("\nModel error against the measured runs:\n")
    print(markdown(errors))
    out = args.out or args.results[0].parent
    out.mkdir(parents=True, exist_ok=True)
    settings = {"workers": args.workers, "bandwidth": args.bandwidth, "alpha_s": alpha_s,
                "baseline": args.baseline, "ranks_per_node": args.ranks_per_node,
                "intra_bandwidth": args.intra_bandwidth}
    (out / "simulate.json").write_text(json.dumps({"settings": settings, "rows": rows, "model_error": errors},
                                                  indent=2))
    try:
        plot(rows, out / "simulate.png")
    except ImportError:
        print("simulate: matplotlib is not installed; no simulate.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
