"""``gcomp bench`` in brief: workloads, method specs, a 2-worker unshaped run of a few steps, the report files.

Nothing here times anything: the harness's figures are reported by ``gcomp bench`` itself.
"""
from __future__ import annotations

import csv
import json
import os

import pytest
import torch

from gcomp.bench import report
from gcomp.bench.methods import parse_method
from gcomp.bench.workloads import MODELS, accuracy, load_data, loss_fn, make_model
from gcomp.cli import main


@pytest.mark.parametrize("model", MODELS)
def test_every_model_trains_a_step_on_an_embedded_dataset(model):
    data = load_data("text" if model == "charlm" else "digits")
    net = make_model("mlp:16" if model == "mlp" else model, data)
    x, y = data.train[0][:4], data.train[1][:4]
    loss = loss_fn(net(x), y)
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in net.parameters() if p.requires_grad)
    assert 0.0 <= accuracy(net, (data.test[0][:8], data.test[1][:8])) <= 1.0


def test_datasets_are_embedded_or_a_clear_error():
    digits = load_data("digits")
    assert digits.shape == (1, 8, 8) and digits.classes == 10 and len(digits.train[1]) == 1437
    text = load_data("text")
    assert torch.equal(text.train[0][0, 1:], text.train[1][0, :-1])  # the next character is the label
    shard = digits.shard(1, 3)
    assert len(shard[1]) == len(digits.train[1]) // 3
    with pytest.raises(FileNotFoundError, match="cifar10 needs --data-dir"):
        load_data("cifar10")
    with pytest.raises(ValueError, match="unknown dataset 'mnist'"):
        load_data("mnist")
    with pytest.raises(ValueError, match="unknown model 'resnet50'"):
        make_model("resnet50", digits)


def test_method_specs():
    assert parse_method("pactrain:ternary=true").params == {"ternary": True}
    assert parse_method("topk:ratio=0.01").collective == "allgather"
    assert parse_method("torch:powersgd").one_bucket
    for bad, message in (("torch:bf16", "unknown PyTorch hook"), ("topk:rat=1", "parameter of topk"),
                         ("topk:ratio=2", "'ratio' must be in"), ("nope", "nope")):
        with pytest.raises(ValueError, match=message):
            parse_method(bad)


TIMES = {"compute_s_per_step": 0.01, "encode_s_per_step": 0.0, "comm_s_per_step": 0.01, "decode_s_per_step": 0.0}


def test_time_to_target_and_speedups_by_hand():
    def row(method, step_s, history):
        return {"method": method, "step_s": step_s, "bytes_sent_per_step": 100.0, "bytes_dense_per_step": 400.0,
                "history": [{"step": s, "train_s": t, "accuracy": a} for s, t, a in history], **TIMES,
                "final_accuracy": history[-1][2]}

    rows = [row("identity", 0.5, [(10, 5.0, 0.5), (20, 10.0, 1.0)]),
            row("pactrain", 0.25, [(10, 2.5, 0.99), (20, 5.0, 1.0)]),
            row("topk", 0.1, [(10, 1.0, 0.2), (20, 2.0, 0.3)])]
    target = report.add_derived(rows, None)
    assert target == 0.99  # 99% of the all-reduce run's best
    assert [r["time_to_target_s"] for r in rows] == [10.0, 2.5, None]
    assert [r["steps_to_target"] for r in rows] == [20, 10, None]
    assert rows[1]["tta_speedup"] == 4.0 and rows[2]["tta_speedup"] is None
    assert rows[1]["step_speedup"] == 2.0 and rows[0]["compression"] == 4.0
    table = {line.split("|")[1].strip(): line for line in report.markdown(rows).splitlines()[2:]}
    assert table["topk"].count("not reached") == 2, table["topk"]  # time to target and its speedup
    assert "not reached" not in table["pactrain"] and "| 2.50 | 4.00 |" in table["pactrain"]


def test_without_a_target_nothing_reads_as_not_reached():
    rows = [{"method": "topk", "step_s": 0.1, "bytes_sent_per_step": 1.0, "bytes_dense_per_step": 4.0,
             "history": [{"step": 5, "train_s": 0.5, "accuracy": 0.3}], "final_accuracy": 0.3, **TIMES}]
    assert report.add_derived(rows, None) is None  # no all-reduce run: no target
    assert "not reached" not in report.markdown(rows) and "| — | — |" in report.markdown(rows)


def test_a_load_above_the_worker_count_is_named_in_one_warning():
    rows = [{"method": "identity", "load_average": {"start": 1.2, "end": 3.9}},
            {"method": "topk", "load_average": {"start": 0.5, "end": 1.0}},
            {"method": "fp16"}]
    assert report.load_warning(rows, 4) is None
    warning = report.load_warning(rows, 2, {"start": 0.4, "end": 2.5})
    assert warning.count("\n") == 0 and "identity (3.9)" in warning and "the whole bench (2.5)" in warning
    assert "topk" not in warning and "2 workers" in warning


def test_a_brief_unshaped_run_writes_every_output(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["bench", "--workers", "2", "--bandwidth", "none", "--steps", "6", "--eval-every", "3",
                 "--model", "mlp:32", "--pretrain-epochs", "1", "--cache-dir", str(tmp_path / "cache"),
                 "--out", str(out), "--method", "identity;pactrain:ternary=true;torch:fp16;torch:powersgd"])
    assert code == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    runs = {r["method"]: r for r in results["runs"]}
    assert list(runs) == ["identity", "pactrain:ternary=true", "torch:fp16", "torch:powersgd"]
    params = runs["identity"]["parameters"]  # 64*32 + 32 + 32*10 + 10
    assert params == 64 * 32 + 32 + 32 * 10 + 10
    for r in runs.values():
        assert r["steps"] == 6 and len(r["step_times"]) == 6 and len(r["history"]) == 2 and r["workers"] == 2
        assert r["bytes_dense_per_step"] == params * 4  # one bucket here (every run's model fits in 25 MB)
        assert r["step_s"] >= r["comm_s_per_step"] >= 0
    assert runs["identity"]["bytes_sent_per_step"] == params * 4
    assert runs["torch:fp16"]["bytes_sent_per_step"] == params * 2
    assert runs["torch:powersgd"]["one_bucket"] and "(one bucket)" in printed
    assert runs["pactrain:ternary=true"]["kept_fraction"] < 0.6
    with open(out / "results.csv") as fh:
        assert [r["method"] for r in csv.DictReader(fh)] == list(runs)
    assert "| identity |" in printed and results["meta"]["network"].startswith("unshaped")
    for load in [results["meta"]["load_average"]] + [r["load_average"] for r in runs.values()]:
        assert set(load) == {"start", "end"} and all(v >= 0 for v in load.values())
    for png in ("accuracy_vs_time.png", "time_to_accuracy.png", "bytes_per_step.png", "time_breakdown.png"):
        assert (out / png).stat().st_size > 1000
    # the pre-training is cached: a second run loads it
    assert any(tmp_path.joinpath("cache").glob("pretrained-*.pt"))


def test_bad_bench_arguments_fail_before_any_worker(tmp_path, capsys):
    assert main(["bench", "--method", "topkk", "--out", str(tmp_path / "x")]) == 2
    assert "did you mean" in capsys.readouterr().err


def test_codec_table_reports_ratios_to_a_copy_and_bits_per_entry(tmp_path, capsys):
    out = tmp_path / "codec"
    assert main(["bench", "--codec", "--sizes-mb", "0.0625", "0.25", "--method", "identity;fp16;topk;pactrain",
                 "--out", str(out)]) == 0
    rows = json.loads((out / "codec.json").read_text())
    assert [(r["method"], r["size_mb"]) for r in rows] == [(m, s) for s in (0.0625, 0.25)
                                                           for m in ("identity", "fp16", "topk", "pactrain")]
    bits = {r["method"]: r["bits_per_entry"] for r in rows if r["size_mb"] == 0.25}
    assert bits["identity"] == 32 and bits["fp16"] == 16
    assert bits["topk"] == pytest.approx(64 * 0.01, rel=0.01)  # value + int32 index for 1% of the entries
    assert 15 < bits["pactrain"] < 17  # the kept half, packed, plus one flag entry
    assert all(r["copy_s"] > 0 and r["codec_ratio"] >= 0 for r in rows)
    printed = capsys.readouterr().out
    assert "| topk | 0.64 |" in printed and (out / "codec.csv").exists()
    assert main(["bench", "--codec", "--method", "topkk", "--out", str(out)]) == 2


def test_a_brief_shaped_run_goes_through_namespaces_or_says_why_not(tmp_path, capsys):
    from gcomp.bench import netem
    ok, why = netem.permitted()
    if not ok:
        pytest.skip(why)
    out = tmp_path / "shaped"
    assert main(["bench", "--workers", "2", "--bandwidth", "1gbit", "--steps", "4", "--eval-every", "2",
                 "--model", "mlp:32", "--pretrain-epochs", "0", "--out", str(out), "--method", "identity"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["network"].startswith("shaped: 2 namespaces")
    [run] = results["runs"]
    assert run["bandwidth"] == "1gbit" and run["bandwidth_bps"] == 1e9 and run["steps"] == 4
    mine = netem.PREFIX + f"{os.getpid() % 10**7:07d}"  # the names this process gave its namespaces
    assert not [n for n in netem.namespace_names() if n.startswith(mine)]
