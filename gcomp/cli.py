"""The ``gcomp`` command: ``gcomp list``, ``gcomp describe NAME``, ``gcomp bench``, ``gcomp simulate``."""
from __future__ import annotations

import argparse
import os
import sys
import time

import gcomp


def _list(args) -> int:
    names = gcomp.available()
    collectives = {name: gcomp.create(name).collective or "chosen per bucket" for name in names}
    width = max(map(len, names), default=0)
    column = max(map(len, collectives.values()), default=0)
    for name in names:
        line = f"{name:<{width}}  {collectives[name]:<{column}}  "
        print(line + plain_summary(gcomp.spec(name).summary, LIST_WIDTH - len(line)))
    print("\ngcomp describe NAME: its parameters, defaults and the whole description")
    return 0


LIST_WIDTH = 100


def plain_summary(text: str, room: int) -> str:
    """``text``'s first sentence as plain text (no reStructuredText roles or backticks), cut at a word to fit
    ``room`` characters with "…" where it is longer."""
    import re
    text = re.sub(r":\w+:`~?([^`]*)`", r"\1", text).replace("``", "").replace("`", "")
    text = " ".join(re.split(r"(?<=\.)\s", " ".join(text.split()), maxsplit=1)[:1])
    if len(text) <= room:
        return text
    cut = text[:max(room - 1, 1)]
    return (cut.rsplit(" ", 1)[0] if " " in cut else cut).rstrip(",;:") + "…"


def _describe(args) -> int:
    try:
        print(gcomp.describe(args.name))
    except gcomp.UnknownMethodError as err:
        print(f"gcomp: {err}", file=sys.stderr)
        return 2
    return 0


def _bench(args) -> int:
    from pathlib import Path

    from gcomp.bench import race, report, runner
    from gcomp.bench.arguments import check_out, files_line
    from gcomp.bench.failures import WorkersFailed
    if args.codec:
        return _codec(args)
    if args.overhead:
        return _overhead(args)
    config = runner.BenchConfig()
    for key in ("dataset", "model", "workers", "bandwidth", "steps", "batch", "lr", "seed", "seeds", "eval_every",
                "pretrain_epochs", "prune_method", "target_accuracy", "data_dir", "cache_dir", "device", "backend"):
        value = getattr(args, key)
        if value is not None:
            setattr(config, key, value)
    if args.method:
        config.methods = [m for item in args.method for m in item.split(";") if m]
    if args.fsdp:
        from gcomp.bench import fsdp
        config.fsdp = True
        if not args.method:
            config.methods = list(fsdp.DEFAULT_METHODS)
    outers = [o for item in args.outer or [] for o in item.split(";") if o.strip()]
    config.methods = config.methods + outers  # beside the per-step methods, in one table (gcomp.bench.outer_spec)
    if config.backend == "nccl" and args.bandwidth is None:
        config.bandwidth = "none"  # tc shapes TCP links, not NCCL's (runner.BenchConfig.check says why)
    out = Path(args.out or f"bench-results/{time.strftime('%Y%m%d-%H%M%S')}")
    load_start = os.getloadavg()[0]
    try:
        if args.prune_ratio is not None:
            config.prune_ratio = _ratios(args.prune_ratio)
        from gcomp.bench.outer_spec import parse_outer
        [parse_outer(text) for text in outers]  # --outer takes outer loops only (a ValueError naming them)
        config.check()
        check_out(out)
        rows, network = runner.run(config, out)
    except (ValueError, FileNotFoundError) as err:
        print(f"gcomp bench: {err}", file=sys.stderr)
        return 2
    except WorkersFailed as err:
        print(f"gcomp bench: {err}", file=sys.stderr)
        return 1
    load = {"start": load_start, "end": os.getloadavg()[0]}  # 1-minute load average of this machine
    target = race.add_derived(rows, config.target_accuracy)
    summary = race.summarise(rows)
    targets = sorted({r["target_accuracy"] for r in rows if r.get("target_accuracy") is not None})
    meta = {"config": vars(config), "network": network, "target_accuracy": target, "targets": targets,
            "load_average": load}
    schedule = config.rate_schedule()
    if schedule:  # applied only where the links were shaped
        meta.update(schedule=schedule, schedule_applied=network.startswith("shaped"))
    paths = report.write(rows, out, meta, summary)
    seeds = f", {config.seeds} seeds (medians; ranges in summary.md)" if config.seeds > 1 else ""
    aim = "none" if not targets else f"{targets[0]:.4f}" + (f"–{targets[-1]:.4f}" if len(targets) > 1 else "")
    print(f"\n{config.model} on {config.dataset}, {config.workers} workers{seeds}; target accuracy {aim}\n"
          f"network: {network}")
    for bandwidth in dict.fromkeys(e["bandwidth"] for e in summary):
        if len(config.bandwidths()) > 1:
            print(f"\n### {bandwidth}")
        entries = [e for e in summary if e["bandwidth"] == bandwidth]
        print("\n" + "\n\n".join(filter(None, (report.markdown(entries), report.outer_notes(entries)))))
    segments = report.segment_markdown(rows)
    if segments:
        unshaped = "" if meta["schedule_applied"] else " (not applied: the links were unshaped)"
        print(f"\n### step time per segment of the bandwidth schedule{unshaped}\n\n{segments}")
    print(f"\n{files_line(out, paths.values())}")
    for warning in (race.short_race_warning(rows), report.load_warning(rows, config.workers, load)):
        if warning:
            print(warning, file=sys.stderr)
    return 0


def _ratios(text: str) -> float | list[float]:
    """--prune-ratio: one ratio, or a comma-separated sweep."""
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--prune-ratio takes a ratio or a comma-separated list of them (0.1,0.3,0.5); got "
                         f"{text!r}") from None
    return values[0] if len(values) == 1 else values


def _overhead(args) -> int:
    import json
    from pathlib import Path

    from gcomp.bench import overhead
    from gcomp.bench.arguments import check_out
    from gcomp.bench.devices import check_device
    config = overhead.OverheadConfig(device=args.device or "cpu")
    for key in ("model", "steps", "batch", "seed", "lr", "warmup", "profile_steps"):
        if getattr(args, key) is not None:
            setattr(config, key, getattr(args, key))
    if args.method:
        config.methods = [m for item in args.method for m in item.split(";") if m]
    out = Path(args.out or f"bench-results/overhead-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        check_device(config.device)
        config.resolved()  # its settings checked before the output folder, as gcomp bench does
        check_out(out)
        rows = overhead.run(config)
    except ValueError as err:
        print(f"gcomp bench --overhead: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(json.dumps({"config": overhead.as_dict(config.resolved()), "rows": rows},
                                                  indent=1))
    first = rows[0]
    print(f"\n{first.get('model')} (batch {first.get('batch')}), {first.get('world')} rank(s) on {first.get('device')}"
          f"\n\n{overhead.markdown(rows)}\n\noverhead.json: {out}")
    failed = [r["method"] for r in rows if "error" in r]
    if failed:
        print(f"gcomp bench --overhead: failed: {', '.join(failed)}; their errors are in overhead.json",
              file=sys.stderr)
    return 1 if rows[0].get("error") else 0


def _codec(args) -> int:
    import csv
    import json
    from pathlib import Path

    from gcomp.bench import codec_table
    from gcomp.bench.arguments import check_out, files_line
    methods = [m for item in args.method for m in item.split(";") if m] if args.method else None
    from gcomp.bench.devices import check_device
    from gcomp.bench.methods import parse_method
    for text in methods or []:
        try:
            if parse_method(text).is_torch and text not in codec_table.EXTRA_ROWS:
                raise ValueError("of PyTorch's hooks it times torch:powersgd")
        except ValueError as err:
            print(f"gcomp bench --codec: {text}: {err}", file=sys.stderr)
            return 2
    out = Path(args.out or f"bench-results/codec-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        check_device(args.device or "cpu")
        if args.backend not in (None, "nccl" if args.device == "cuda" else "gloo"):
            raise ValueError(f"--backend {args.backend}: --codec runs on one rank, on gloo for the CPU and NCCL "
                             "for --device cuda")
        codec_table.check_sizes(args.sizes_mb)
        check_out(out)
    except ValueError as err:
        print(f"gcomp bench --codec: {err}", file=sys.stderr)
        return 2
    rows = codec_table.run(args.sizes_mb, methods, seed=args.seed or 0, device=args.device or "cpu")
    out.mkdir(parents=True, exist_ok=True)
    (out / "codec.json").write_text(json.dumps(rows, indent=1))
    with open(out / "codec.csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(dict.fromkeys(k for r in rows for k in r)))
        writer.writeheader()
        writer.writerows(rows)
    (out / "codec.md").write_text(codec_table.markdown(rows, full=True) + "\n")
    print("\n" + codec_table.markdown(rows) + "\n\n"
          + files_line(out, ["codec.json", "codec.csv", "codec.md (every size)"]))
    failed = [f"{r['method']} ({r['size_mb']:g} MB)" for r in rows if "error" in r]
    if failed:
        print(f"gcomp bench --codec: failed: {', '.join(failed)}; their errors are in codec.json", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    from gcomp.bench.quiet import once_per_cause
    with once_per_cause():
        return _main(argv)


def _main(argv: list[str]) -> int:
    if argv[:1] == ["simulate"]:
        from gcomp.bench import simulate
        return simulate.main(argv[1:])
    from gcomp.bench.arguments import COUNT, POSITIVE, POSITIVE_INT, show_defaults
    parser = argparse.ArgumentParser(prog="gcomp", description="Gradient compression for PyTorch DDP.")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("list", help="registered methods, their collective and a one-line summary").set_defaults(run=_list)
    p = sub.add_parser("describe", help="a method's parameters, defaults, ranges and wire format")
    p.add_argument("name")
    p.set_defaults(run=_describe)
    b = sub.add_parser("bench", help="compare methods under one harness (default: an MLP pre-trained on digits "
                       "0-4, fine-tuned on 5-9, 4 workers, 100mbit)")
    b.add_argument("--method", action="append", metavar="SPEC", help="a method (name or name:key=value,...; "
                   "torch:allreduce, torch:fp16, torch:powersgd); repeatable")
    b.add_argument("--outer", action="append", metavar="SPEC", help="an outer loop raced beside the methods: "
                   "diloco:every=50,method=fp16 (keys every, fragments, overlap, lr, momentum, inner=sgd|adamw, "
                   "inner_lr; method last, or method=[...]); repeatable or ';'-separated")
    b.add_argument("--dataset", help="digits, text, cifar10, cifar100 or synthetic")
    b.add_argument("--model", help="mlp[:W1,W2], resnet18, vgg19, vit or charlm (--overhead: resnet50, "
                   "decoder[:WIDTH,DEPTH] or mlp[:W1,W2])")
    b.add_argument("--workers", type=POSITIVE_INT)
    b.add_argument("--bandwidth", help="per-link limit: 100mbit, 500mbit, 1gbit, ... or none; a comma-separated "
                   "list sweeps them (100mbit,500mbit,1gbit); a list with RATE@STEP is a schedule within every "
                   "run (1gbit,100mbit@60: 1gbit, then 100mbit from step 60 on; steps increasing, below --steps)")
    b.add_argument("--steps", type=POSITIVE_INT, help="training steps per method")
    b.add_argument("--batch", type=POSITIVE_INT, help="batch size per worker")
    b.add_argument("--lr", type=POSITIVE)
    b.add_argument("--seed", type=int)
    b.add_argument("--seeds", type=POSITIVE_INT, help="run every method this many times (seeds SEED, SEED+1, ...): "
                   "medians, ranges and a verdict against all-reduce and the best PyTorch hook")
    b.add_argument("--eval-every", type=POSITIVE_INT, dest="eval_every")
    b.add_argument("--pretrain-epochs", type=COUNT, dest="pretrain_epochs", help="0: start from random weights")
    b.add_argument("--prune-ratio", dest="prune_ratio", help="pactrain/prunex's pruning ratio; a comma-separated "
                   "list sweeps them (0.1,0.3,0.5,0.7,0.8)")
    b.add_argument("--prune-method", dest="prune_method", help="how pactrain/prunex's runs prune the model first: "
                   "grasp (as the PacTrain paper), magnitude or random")
    b.add_argument("--target-accuracy", type=float, dest="target_accuracy")
    b.add_argument("--data-dir", dest="data_dir", help="where cifar10/cifar100 lie (python-pickle format)")
    b.add_argument("--cache-dir", dest="cache_dir", help="pre-trained weights cache")
    b.add_argument("--out", help="results folder (default bench-results/DATE-TIME)")
    b.add_argument("--fsdp", action="store_true", help="the race under FSDP2 (fully_shard) instead of DDP, for the "
                   "methods that support it; torch:allreduce is plain FSDP2 there (default methods: "
                   "torch:allreduce, identity, fp16, pactrain, spardl)")
    b.add_argument("--codec", action="store_true", help="instead: every method's encode+decode and reduction "
                   "time on one rank as a ratio to a copy of the bucket, GB/s, bits per entry and peak extra memory")
    b.add_argument("--overhead", action="store_true", help="instead: what each method adds to a real training step "
                   "beside plain DDP and PyTorch's fp16, bf16 and PowerSGD hooks (one rank per GPU: ResNet-50 or a "
                   "GPT-2-small-sized decoder, bf16; on the CPU a small MLP), with the codec's share")
    b.add_argument("--warmup", type=COUNT, help="--overhead: steps before timing (default 5)")
    b.add_argument("--profile-steps", type=POSITIVE_INT, dest="profile_steps",
                   help="--overhead: steps profiled (default 3)")
    b.add_argument("--device", choices=["cpu", "cuda"], help="where tensors live: cpu or cuda (one "
                   "GPU per worker, cuda:LOCAL_RANK; --codec: the current GPU, timed with CUDA events)")
    b.add_argument("--backend", choices=["gloo", "nccl"], help="the workers' process group: gloo or "
                   "nccl (needs --device cuda and a GPU per worker; no --bandwidth shaping)")
    b.add_argument("--sizes-mb", type=POSITIVE, nargs="+", default=[1, 4, 16, 64], dest="sizes_mb",
                   help="--codec: bucket sizes in MB (default: 1 4 16 64)")
    show_defaults(b)
    b.set_defaults(run=_bench)
    # listed for --help; its options are the simulate module's own, so main() hands them over unparsed
    sub.add_parser("simulate", add_help=False, help="project a bench run's results.json to 8..1024 workers and "
                   "100mbit..100gbit (gcomp simulate --help for its options)")
    args = parser.parse_args(argv)
    return args.run(args)


def run() -> None:
    """The ``gcomp`` command: ``main``, then ``end_process`` (PyTorch's own hooks, which the benchmarks run, leave
    gloo's threads in callbacks gcomp cannot settle, and the interpreter's shutdown would abort on them)."""
    from gcomp.elastic import end_process

    end_process(main())


if __name__ == "__main__":
    run()
