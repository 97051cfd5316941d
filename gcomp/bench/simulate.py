"""``gcomp simulate``: project the methods of one or more bench runs to large clusters, and check the model.

    gcomp simulate --results results.json --workers 8 16 32 64 --bandwidth 1gbit 10gbit   # or python -m gcomp.bench.simulate

Each method's row with the most workers becomes a :class:`gcomp.bench.costmodel.Profile`; the table gives its
step time and speedups at every worker count and bandwidth asked for, with the model's error on that method's
measured runs beside it (``model_error``: the largest over them, sign kept). The error table compares the model
with every row that was measured on a shaped network, each priced on the link its workers probed: step and
communication, measured and predicted, and the error in percent. The latency per message of the projection
is the median of the runs' probed latencies unless ``--alpha-us`` sets one. Prints the error table (``--projection``:
the projection's too), then where it wrote ``simulate.json`` (``model_error`` and ``rel_error`` there are
fractions), ``simulate.csv`` (the projection), ``model_error.csv`` (every column of the error table) and
``simulate.png`` (a method whose model error exceeds 15% dotted).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from typing import Sequence

import statistics

from gcomp.bench.arguments import NON_NEGATIVE, POSITIVE_INT, check_out, files_line
from gcomp.bench.costmodel import Profile, error_by_method, model_error, project
from gcomp.link import DEFAULT_ALPHA_S, Network, bandwidth_label

DEFAULT_WORKERS = (8, 16, 32, 64, 128, 256, 512, 1024)
DEFAULT_BANDWIDTHS = ("100mbit", "1gbit", "10gbit", "100gbit")


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


UNTRUSTED = 0.15  # a method whose model error exceeds this is drawn dotted, and its label says so


def untrusted(rows: Sequence[dict], limit: float = UNTRUSTED) -> set[str]:
    """The methods whose ``model_error`` (largest over their measured runs) exceeds ``limit`` in magnitude."""
    return {row["method"] for row in rows if row.get("model_error") is not None and abs(row["model_error"]) > limit}


def plot(rows: Sequence[dict], path):
    """Speedup against workers (log scale), one line per method, one panel per bandwidth, saved as a PNG; a
    method whose model error exceeds 15% is dotted, its label saying "model error > 15%". Returns the figure's
    axes (closed), so that a test can read the lines."""
    import matplotlib  # lazily: the model itself needs no plotting library

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bandwidths = sorted({row["bandwidth_bps"] for row in rows})
    methods = list(dict.fromkeys(row["method"] for row in rows))
    doubtful = untrusted(rows)
    fig, axes = plt.subplots(1, max(len(bandwidths), 1), figsize=(4 * max(len(bandwidths), 1), 3.5),
                             squeeze=False, sharey=True)
    for ax, bandwidth in zip(axes[0], bandwidths):
        for method in methods:
            points = sorted((row["workers"], row["speedup_vs_baseline"]) for row in rows
                            if row["bandwidth_bps"] == bandwidth and row["method"] == method
                            and row["speedup_vs_baseline"] is not None)
            if points and method in doubtful:
                ax.plot(*zip(*points), marker="x", linestyle=":", alpha=0.7,
                        label=f"{method} (model error > {UNTRUSTED:.0%})")
            elif points:
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
    return axes[0]


def load_runs(path: Path) -> list[dict]:
    """The ``runs`` of a results file; ValueError with the reason when it is missing, unreadable or malformed.
    Outer loops' runs (``gcomp bench --outer``) are left out: the model prices every step's collectives."""
    if not path.is_file():
        raise ValueError(f"results file {str(path)!r} not found")
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {str(path)!r} as JSON ({err}); give a results.json of gcomp bench") from err
    runs = data.get("runs") if isinstance(data, dict) else None
    if not runs or not isinstance(runs, list):
        raise ValueError(f"{str(path)!r} has no runs (expected a JSON object with a non-empty 'runs' list)")
    bad = [i for i, run in enumerate(runs) if not isinstance(run, dict)]
    if bad:
        raise ValueError(f"{str(path)!r}: runs {bad[:5]} are not JSON objects (one per method and run)")
    if all(run.get("outer_steps") is not None for run in runs):
        raise ValueError(f"{str(path)!r} holds outer loops' runs only, which gcomp simulate does not model")
    return [run for run in runs if run.get("outer_steps") is None]


def largest_run_per_method(runs: Sequence[dict]) -> list[dict]:
    """For each method (in first-seen order), its row with the most workers (the first such row on a tie: the
    first seed and bandwidth of a sweep). A method that a prune-ratio sweep ran at several ratios is one method
    per ratio, labelled ``method @ratio``."""
    ratios: dict[str, set] = {}
    for row in runs:
        if row.get("prune_ratio") is not None:
            ratios.setdefault(row.get("method"), set()).add(row["prune_ratio"])
    chosen: dict[tuple, dict] = {}
    for row in runs:
        key = (row.get("method"), row.get("prune_ratio"))
        best = chosen.get(key)
        if best is None or (row.get("workers") or 1) > (best.get("workers") or 1):
            chosen[key] = row
    return [dict(row, method=f"{method} @{ratio:g}") if len(ratios.get(method, ())) > 1 else row
            for (method, ratio), row in chosen.items()]


def probed_alpha_s(runs: Sequence[dict]) -> float | None:
    """The median latency per message the runs' workers probed on their links (``gcomp.bench.throughput``);
    None when no run probed one."""
    alphas = [run["link"]["alpha_s"] for run in runs
              if isinstance(run.get("link"), dict) and run["link"].get("alpha_s") is not None]
    return statistics.median(alphas) if alphas else None


def error_table(errors: Sequence[dict], full: bool = False) -> list[dict]:
    """``model_error``'s rows as printed: milliseconds and the error in percent; ``full`` (model_error.csv):
    the link, local work, wait and communication too."""
    def ms(value):
        return None if value is None else round(1000 * value, 2)
    rows = []
    for e in errors:
        row = {"method": e["method"], "workers": e["workers"], "bandwidth": e["bandwidth"]}
        if full:
            row.update({"link alpha us": round(e["link_alpha_us"], 1), "link Mbit/s": round(e["link_mbit"], 1),
                        "local ms": ms(e["local_s"]), "wait ms": ms(e["wait_s"]),
                        "comm measured ms": ms(e["measured_comm_s"]), "comm predicted ms": ms(e["predicted_comm_s"])})
        row.update({"measured ms": ms(e["measured_s"]), "predicted ms": ms(e["predicted_s"]),
                    "error %": _percent(e["rel_error"])})
        rows.append(row)
    return rows


def _percent(fraction) -> str | None:
    return None if fraction is None else f"{100 * fraction:+.1f}"


def projection_table(rows: Sequence[dict], full: bool = False) -> list[dict]:
    """The projection as printed (``--projection``): milliseconds, speedups, the model error in percent;
    ``full`` (simulate.csv): every column of the rows, the error in percent."""
    if full:
        return [{**{k: v for k, v in row.items() if k != "model_error"},
                 "model error %": _percent(row.get("model_error"))} for row in rows]

    def ms(value):
        return None if value is None else round(1000 * value, 2)
    return [{"method": row["method"], "workers": row["workers"], "bandwidth": row["bandwidth"],
             "step ms": ms(row["step_s"]), "comm ms": ms(row["comm_s"]), "speedup": row["speedup_vs_baseline"],
             "TTA s": row["tta_s"], "TTA speedup": row["tta_speedup"],
             "model error %": _percent(row.get("model_error"))} for row in rows]


def error_summary(errors: Sequence[dict]) -> str:
    """One line: how far the model is from the measured runs."""
    rel = [abs(e["rel_error"]) for e in errors if e["rel_error"] is not None]
    if not rel:
        return "model error: no run measured on a shaped network, so the projection is unchecked"
    return (f"model error against {len(rel)} measured runs: largest {100 * max(rel):.1f}%, median "
            f"{100 * statistics.median(rel):.1f}%")


def _parse_args(argv):
    parser = argparse.ArgumentParser(prog="gcomp simulate", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, nargs="+", required=True,
                        help="results.json of one or more benchmark runs (runs at several worker counts and "
                             "bandwidths check the model against more measurements)")
    parser.add_argument("--workers", type=POSITIVE_INT, nargs="+", default=list(DEFAULT_WORKERS),
                        help=f"worker counts to project to (default: {' '.join(map(str, DEFAULT_WORKERS))})")
    parser.add_argument("--bandwidth", nargs="+", default=list(DEFAULT_BANDWIDTHS),
                        help=f"link rates to project to (default: {' '.join(DEFAULT_BANDWIDTHS)})")
    parser.add_argument("--alpha-us", type=NON_NEGATIVE, default=None,
                        help="latency per message of the projection (default: the median the runs probed, else "
                             f"{DEFAULT_ALPHA_S * 1e6:g})")
    parser.add_argument("--baseline", default="identity", help="the method speedups are against (default: identity)")
    parser.add_argument("--ranks-per-node", type=POSITIVE_INT, default=1,
                        help="node size for hierarchical methods (default: 1)")
    parser.add_argument("--intra-bandwidth", default=None, help="intra-node link (default: as between nodes)")
    parser.add_argument("--out", type=Path, default=None, help="where to write (default: the results file's folder)")
    parser.add_argument("--projection", action="store_true",
                        help="print the projection's table too (one row per method, worker count and bandwidth; "
                             "default: only in simulate.json and simulate.csv)")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """CLI: project the profiles of a results file, print the error table, write the files (module doc; the
    plot is skipped, with a note, when matplotlib is not installed) and say where."""
    args = _parse_args(argv)
    out = args.out or args.results[0].parent
    try:
        check_out(out)
        runs = [run for path in args.results for run in load_runs(path)]
        probed = probed_alpha_s(runs)
        alpha_s = args.alpha_us * 1e-6 if args.alpha_us is not None else probed or DEFAULT_ALPHA_S
        networks = [Network.parse(text, alpha_s) for text in args.bandwidth]
        intra = None if args.intra_bandwidth is None else Network.parse(args.intra_bandwidth, alpha_s)
        comm_kw = {"ranks_per_node": args.ranks_per_node, "intra": intra}
        profiles = [Profile.from_row(row) for row in largest_run_per_method(runs)]
        rows = project(profiles, args.workers, networks, args.baseline, **comm_kw)
        errors = model_error([Profile.from_row(row) for row in runs], alpha_s, **comm_kw)
    except ValueError as err:
        raise SystemExit(f"gcomp simulate: {err}") from err
    worst = error_by_method(errors)
    for row in rows:
        row["model_error"] = worst.get(row["method"])
    source = "--alpha-us" if args.alpha_us is not None else "probed by the runs" if probed else "default"
    print("Model error against the measured runs (each on its own probed link):\n")
    print(markdown(error_table(errors)))
    print("\n" + error_summary(errors))
    print(f"projection: {len(rows)} rows at {alpha_s * 1e6:.1f} us per message ({source})"
          + ("" if args.projection else "; --projection prints them"))
    if args.projection:
        print("\n" + markdown(projection_table(rows)))
    out.mkdir(parents=True, exist_ok=True)
    settings = {"workers": args.workers, "bandwidth": args.bandwidth, "alpha_s": alpha_s, "alpha_source": source,
                "baseline": args.baseline, "ranks_per_node": args.ranks_per_node,
                "intra_bandwidth": args.intra_bandwidth}
    (out / "simulate.json").write_text(json.dumps({"settings": settings, "rows": rows, "model_error": errors},
                                                  indent=2))
    written = [out / "simulate.json", _csv(out / "simulate.csv", projection_table(rows, full=True)),
               _csv(out / "model_error.csv", error_table(errors, full=True))]
    try:
        plot(rows, out / "simulate.png")
        written.append(out / "simulate.png")
    except ImportError:
        print("simulate: matplotlib is not installed; no simulate.png", file=sys.stderr)
    doubtful = sorted(untrusted(rows))
    if doubtful:
        print(f"dotted in simulate.png (model error > {UNTRUSTED:.0%}): {', '.join(doubtful)}")
    print("\n" + files_line(out, written))
    return 0


def _csv(path: Path, rows: Sequence[dict]) -> Path:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    return path


if __name__ == "__main__":
    raise SystemExit(main())
