"""The race's statistics by hand: targets per race, medians and ranges over seeds, "not reached" kept apart from
any number, the verdicts, the short-race warning, and the sweep's jobs (what a launch of the workers runs)."""
import pytest

from gcomp.bench import race, report
from gcomp.bench.runner import BenchConfig

TIMES = {"compute_s_per_step": 0.01, "encode_s_per_step": 0.0, "comm_s_per_step": 0.01, "decode_s_per_step": 0.0}


def run(method, seed, tta, bandwidth="100mbit", ratio=None, final=1.0):
    """A run whose accuracy is 0.5 at step 10 and ``final`` from the step whose train_s is ``tta`` on (None:
    it stays at 0.5, never reaching a target above it)."""
    history = [{"step": 10, "train_s": 1.0, "accuracy": 0.5}]
    if tta is not None:
        history.append({"step": int(10 * tta), "train_s": float(tta), "accuracy": final})
    history.append({"step": 1000, "train_s": 100.0, "accuracy": final if tta is not None else 0.5})
    return {"method": method, "seed": seed, "bandwidth": bandwidth, "prune_ratio": ratio, "step_s": 0.1,
            "bytes_sent_per_step": 100.0, "bytes_dense_per_step": 400.0, "history": history,
            "final_accuracy": history[-1]["accuracy"], **TIMES}


def test_every_race_sets_its_own_target_from_its_all_reduce_run():
    rows = [run("identity", 0, 10.0, final=0.9), run("topk", 0, 5.0, final=0.9),
            run("identity", 1, 10.0, final=0.8), run("topk", 1, 5.0, final=0.8)]
    race.add_derived(rows, None)
    assert [r["target_accuracy"] for r in rows] == pytest.approx([0.891, 0.891, 0.792, 0.792])
    assert [r["tta_speedup"] for r in rows] == [1.0, 2.0, 1.0, 2.0]


def test_medians_ranges_and_not_reached_over_seeds():
    rows = [run("identity", s, t) for s, t in ((0, 10.0), (1, 12.0), (2, 11.0))]
    rows += [run("pactrain", s, t) for s, t in ((0, 4.0), (1, 5.0), (2, 6.0))]
    rows += [run("topk", s, t) for s, t in ((0, 9.0), (1, None), (2, None))]  # one seed of three reached
    race.add_derived(rows, None)
    summary = {e["method"]: e for e in race.summarise(rows)}
    pac = summary["pactrain"]
    assert pac["seeds"] == 3 and pac["reached"] == 3 and pac["time_to_target_s"] == 5.0
    assert pac["ranges"]["time_to_target_s"] == (4.0, 6.0)
    assert pac["tta_speedup"] == pytest.approx(2.4)  # median of 10/4, 12/5, 11/6
    topk = summary["topk"]
    assert topk["reached"] == 1 and topk["time_to_target_s"] is None and topk["tta_speedup"] is None
    assert topk["tta_per_seed"] == [9.0, None, None]
    table = {line.split("|")[1].strip(): line
             for line in report.markdown(list(summary.values()), full=True).splitlines()[2:]}
    assert "| not reached (9.00–not reached) |" in table["topk"]
    assert "| 5.00 (4.00–6.00) |" in table["pactrain"]
    narrow = {line.split("|")[1].strip(): line for line in report.markdown(list(summary.values())).splitlines()[2:]}
    assert "| 5.00 | 2.40 |" in narrow["pactrain"] and "| not reached | not reached |" in narrow["topk"]
    assert " 0.00" not in table["topk"]  # never a zero that reads as instant


def test_an_even_number_of_seeds_takes_the_slower_middle_run():
    rows = [run("identity", 0, 10.0), run("identity", 1, 10.0), run("topk", 0, 4.0), run("topk", 1, None)]
    race.add_derived(rows, None)
    topk = next(e for e in race.summarise(rows) if e["method"] == "topk")
    assert topk["time_to_target_s"] is None and topk["tta_speedup"] is None  # half the seeds never reached


@pytest.mark.parametrize("mine, theirs, expected", [
    ([1.0, 2.0], [3.0, 4.0], "faster"),
    ([5.0, 6.0], [3.0, 4.0], "slower"),
    ([2.0, 3.5], [3.0, 4.0], "within spread"),
    ([None, None], [3.0, 4.0], "slower"),
    ([1.0, None], [3.0, 4.0], "within spread"),
    ([1.0], [3.0], None),  # one seed: no spread to judge by
])
def test_verdict_beyond_the_spread_of_the_seeds(mine, theirs, expected):
    assert race.verdict(mine, theirs) == expected


def test_verdicts_against_all_reduce_and_the_best_pytorch_hook():
    rows = []
    for seed in range(3):
        rows += [run("identity", seed, 10.0 + seed), run("torch:allreduce", seed, 10.5 + seed),
                 run("torch:fp16", seed, 6.0 + seed), run("pactrain", seed, 2.0 + seed),
                 run("fp16", seed, 9.0 + seed)]
    race.add_derived(rows, None)
    summary = {e["method"]: e for e in race.summarise(rows)}
    assert summary["identity"]["vs_allreduce"] is None  # the baseline itself
    assert summary["pactrain"]["best_torch_hook"] == "torch:fp16"
    assert summary["pactrain"]["vs_allreduce"] == "faster" and summary["pactrain"]["vs_best_torch_hook"] == "faster"
    assert summary["fp16"]["vs_allreduce"] == "within spread"  # 9..11 against 10..12: overlapping
    assert summary["torch:fp16"]["vs_best_torch_hook"] is None
    head = report.markdown(list(summary.values()), full=True).splitlines()[0]
    assert "TTA vs all-reduce" in head and "TTA vs best PyTorch hook (torch:fp16)" in head
    narrow = report.markdown(list(summary.values())).splitlines()
    assert narrow[0].endswith("| TTA speedup | vs all-reduce |") and "| faster |" in narrow[2 + 3]  # pactrain
    assert max(map(len, narrow)) <= 100


def test_bandwidths_are_separate_races_and_summaries():
    rows = [run("identity", 0, 10.0, "100mbit"), run("topk", 0, 5.0, "100mbit"),
            run("identity", 0, 4.0, "1gbit"), run("topk", 0, 8.0, "1gbit")]
    race.add_derived(rows, None)
    summary = race.summarise(rows)
    assert [(e["bandwidth"], e["method"], e["tta_speedup"]) for e in summary] == [
        ("100mbit", "identity", 1.0), ("100mbit", "topk", 2.0), ("1gbit", "identity", 1.0), ("1gbit", "topk", 0.5)]


def test_a_prune_sweep_keeps_ratios_apart_and_labels_them():
    rows = [run("identity", 0, 10.0), run("pactrain", 0, 5.0, ratio=0.3), run("pactrain", 0, 6.0, ratio=0.7)]
    race.add_derived(rows, None)
    summary = race.summarise(rows)
    assert [(e["method"], e["prune_ratio"], e["time_to_target_s"]) for e in summary] == [
        ("identity", None, 10.0), ("pactrain", 0.3, 5.0), ("pactrain", 0.7, 6.0)]
    assert "| pactrain @0.7 |" in report.markdown(summary)


def test_a_baseline_at_the_target_from_its_first_evaluations_is_warned_about():
    quick = [run("identity", 0, 1.0), run("topk", 0, 1.0)]  # at the target at its first evaluation
    race.add_derived(quick, 0.5)
    warning = race.short_race_warning(quick)
    assert warning is not None and "evaluation 1 of 3" in warning and "\n" not in warning
    slow = [run("identity", 0, 10.0)]
    slow[0]["history"][1:1] = [{"step": s, "train_s": s / 10, "accuracy": 0.5} for s in (20, 30, 40)]
    race.add_derived(slow, None)
    assert race.short_race_warning(slow) is None


def test_the_sweep_runs_every_method_once_per_seed_and_only_pruning_methods_at_other_ratios():
    config = BenchConfig(methods=["identity", "pactrain", "torch:fp16"], seeds=2, seed=5, prune_ratio=[0.3, 0.6])
    config.check()
    assert config.jobs() == [
        {"method": "identity", "seed": 5, "prune_ratio": 0.3}, {"method": "pactrain", "seed": 5, "prune_ratio": 0.3},
        {"method": "torch:fp16", "seed": 5, "prune_ratio": 0.3}, {"method": "pactrain", "seed": 5, "prune_ratio": 0.6},
        {"method": "identity", "seed": 6, "prune_ratio": 0.3}, {"method": "pactrain", "seed": 6, "prune_ratio": 0.3},
        {"method": "torch:fp16", "seed": 6, "prune_ratio": 0.3}, {"method": "pactrain", "seed": 6, "prune_ratio": 0.6}]


@pytest.mark.parametrize("settings, message", [
    ({"prune_ratio": [0.3, 0.6], "methods": ["identity", "topk"]}, "no method compared prunes"),
    ({"prune_ratio": [0.3, 0.3]}, "twice"),
    ({"prune_ratio": [0.3, 1.2]}, "[0, 1)"),
    ({"bandwidth": "100mbit,100mbit"}, "twice"),
    ({"bandwidth": "100mbit,none"}, "'none'"),
    ({"bandwidth": "100mbit,fast"}, "cannot read 'fast'"),
    ({"seeds": 0}, "setting 'seeds'"),
    ({"model": "resnet18:wide"}, "base width"),
])
def test_bad_sweeps_are_refused_before_anything_runs(settings, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        BenchConfig(**settings).check()


def test_a_hierarchical_runs_row_carries_its_inter_node_bytes_per_step():
    from gcomp.bench.methods import parse_method
    from gcomp.bench.worker import summarise
    counters = [{"bytes_sent": 10 * s, "bytes_dense": 40 * s, "encode_s": 0.0, "decode_s": 0.0,
                 "inter_bytes": 3 * s, "inter_bytes_dense": 8 * s} for s in range(1, 5)]
    config = {"seed": 0, "prune_ratio": 0.5, "model": "mlp", "dataset": "digits", "bandwidth": "none",
              "bandwidth_bps": None}
    row = summarise(parse_method("prunex"), config, [0.1] * 4, [], counters, [], 0.01, 0.5, 2, 100)
    assert row["inter_bytes_per_step"] == 3 and row["inter_bytes_dense_per_step"] == 8
    assert row["prune_ratio"] == 0.5 and row["seed"] == 0
    plain = summarise(parse_method("topk"), config, [0.1] * 4, [], [{k: v for k, v in c.items() if "inter" not in k}
                                                                   for c in counters], [], 0.01, 1.0, 2, 100)
    assert "inter_bytes_per_step" not in plain and plain["prune_ratio"] is None  # topk does not prune


def test_the_full_table_says_when_no_pytorch_hook_was_raced():
    rows = []
    for seed in range(2):
        rows += [run("identity", seed, 10.0 + seed), run("fp16", seed, 4.0 + seed)]
    race.add_derived(rows, None)
    head = report.markdown(race.summarise(rows), full=True).splitlines()[0]
    assert "(none raced)" in head and "(None)" not in head
