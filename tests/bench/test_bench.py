"""``gcomp bench`` in brief: workloads, method specs, a 2-worker unshaped run of a few steps, the report files.

Nothing here times anything: the harness's figures are reported by ``gcomp bench`` itself.
"""
from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from gcomp.bench import race, report, simulate
from gcomp.bench.methods import parse_method
from gcomp.bench.workloads import MODELS, accuracy, load_data, loss_fn, make_model
from gcomp.collectives.sparse_wire import coded_bytes
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
    for bad, message in (("torch:int8", "unknown PyTorch hook"), ("topk:rat=1", "parameter of topk"),
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
    target = race.add_derived(rows, None)
    assert target == 0.99  # 99% of the all-reduce run's best
    assert [r["time_to_target_s"] for r in rows] == [10.0, 2.5, None]
    assert [r["steps_to_target"] for r in rows] == [20, 10, None]
    assert rows[1]["tta_speedup"] == 4.0 and rows[2]["tta_speedup"] is None
    assert rows[1]["step_speedup"] == 2.0 and rows[0]["compression"] == 4.0
    table = {line.split("|")[1].strip(): line for line in report.markdown(rows, full=True).splitlines()[2:]}
    assert table["topk"].count("not reached") == 3, table["topk"]  # steps and time to target, its speedup
    assert "not reached" not in table["pactrain"] and "| 10 | 2.50 | 4.00 |" in table["pactrain"]


def test_without_a_target_nothing_reads_as_not_reached():
    rows = [{"method": "topk", "step_s": 0.1, "bytes_sent_per_step": 1.0, "bytes_dense_per_step": 4.0,
             "history": [{"step": 5, "train_s": 0.5, "accuracy": 0.3}], "final_accuracy": 0.3, **TIMES}]
    assert race.add_derived(rows, None) is None  # no all-reduce run: no target
    assert "not reached" not in report.markdown(rows, full=True) and "| — | — | — |" in report.markdown(rows, full=True)
    assert "not reached" not in report.markdown(rows) and "| 0.3000 | — | — |" in report.markdown(rows)


def test_a_load_above_the_worker_count_is_named_in_one_warning():
    rows = [{"method": "identity", "load_average": {"start": 1.2, "end": 3.9}},
            {"method": "topk", "load_average": {"start": 0.5, "end": 1.0}},
            {"method": "fp16"}]
    assert report.load_warning(rows, 4) is None
    warning = report.load_warning(rows, 2, {"start": 0.4, "end": 2.5})
    assert warning.count("\n") == 0 and "identity (3.9)" in warning and "the whole bench (2.5)" in warning
    assert "topk" not in warning and "2 workers" in warning


def test_a_brief_unshaped_race_with_two_seeds_and_a_prune_sweep_writes_every_output(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["bench", "--workers", "2", "--bandwidth", "none", "--steps", "6", "--eval-every", "3",
                 "--model", "mlp:32", "--pretrain-epochs", "1", "--cache-dir", str(tmp_path / "cache"),
                 "--seeds", "2", "--prune-ratio", "0.3,0.6",
                 "--out", str(out), "--method", "identity;pactrain:ternary=true;torch:fp16;torch:powersgd"])
    assert code == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    runs = {(r["method"], r["seed"], r["prune_ratio"]): r for r in results["runs"]}
    methods = [("identity", None), ("pactrain:ternary=true", 0.3), ("torch:fp16", None), ("torch:powersgd", None),
               ("pactrain:ternary=true", 0.6)]  # the other ratio: only the method that prunes runs again
    assert list(runs) == [(m, seed, ratio) for seed in (0, 1) for m, ratio in methods]
    params = runs["identity", 0, None]["parameters"]  # 64*32 + 32 + 32*10 + 10
    assert params == 64 * 32 + 32 + 32 * 10 + 10
    for r in runs.values():
        assert r["steps"] == 6 and len(r["step_times"]) == 6 and len(r["history"]) == 2 and r["workers"] == 2
        assert r["bytes_dense_per_step"] == params * 4  # one bucket here (every run's model fits in 25 MB)
        assert r["step_s"] >= r["comm_s_per_step"] >= 0
        assert (r["device"], r["backend"]) == ("cpu", "gloo")  # the defaults
    assert runs["identity", 0, None]["bytes_sent_per_step"] == params * 4
    assert runs["torch:fp16", 1, None]["bytes_sent_per_step"] == params * 2
    assert runs["torch:powersgd", 0, None]["one_bucket"] and "(one bucket)" in printed
    kept = {ratio: runs["pactrain:ternary=true", 0, ratio]["kept_fraction"] for ratio in (0.3, 0.6)}
    assert kept[0.6] < 0.45 < kept[0.3] < 0.75  # each run pruned at its own ratio (biases are kept)
    assert runs["identity", 0, None]["history"] != runs["identity", 1, None]["history"] or \
        runs["identity", 0, None]["losses"] != runs["identity", 1, None]["losses"]  # another seed, another run
    with open(out / "results.csv") as fh:
        assert [(r["method"], r["seed"]) for r in csv.DictReader(fh)] == [(m, str(s)) for m, s, _ in runs]
    summary = [(e["method"], e["prune_ratio"], e["seeds"]) for e in results["summary"]]
    assert summary == [(m, ratio, 2) for m, ratio in methods]
    assert "| pactrain:ternary=true @0.6 |" in printed and "| vs all-reduce |" in printed
    assert results["meta"]["network"].startswith("unshaped") and "2 seeds (medians; ranges in summary.md)" in printed
    assert "TTA vs best PyTorch hook" in (out / "summary.md").read_text()  # the full table
    assert max(len(line) for line in printed.splitlines() if line.startswith("|")) <= 100
    for load in [results["meta"]["load_average"]] + [r["load_average"] for r in runs.values()]:
        assert set(load) == {"start", "end"} and all(v >= 0 for v in load.values())
    for png in ("accuracy_vs_time.png", "time_to_accuracy.png", "bytes_per_step.png", "time_breakdown.png",
                "prune_ratio_sweep.png"):
        assert (out / png).stat().st_size > 1000
    assert not (out / "bandwidth_sweep.png").exists()  # one bandwidth: no sweep plot
    # the pre-training is cached, once per seed
    assert len(list(tmp_path.joinpath("cache").glob("pretrained-*.pt"))) == 2
    # gcomp simulate reads the sweep's results.json, one method per prune ratio
    assert simulate.main(["--results", str(out / "results.json"), "--workers", "8", "--bandwidth", "1gbit"]) == 0
    projected = json.loads((out / "simulate.json").read_text())["rows"]
    assert {"pactrain:ternary=true @0.3", "pactrain:ternary=true @0.6"} <= {r["method"] for r in projected}


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
    k = int(0.01 * 65536)  # 0.25 MB of fp32: a value and a coded position for 1% of the entries
    assert bits["topk"] == pytest.approx((4 * k + coded_bytes(65536, k)) * 8 / 65536, rel=0.01)
    assert 15 < bits["pactrain"] < 17  # the kept half, packed, plus one flag entry
    assert all(r["copy_s"] > 0 and r["codec_ratio"] >= 0 for r in rows)
    floors = {r["method"]: r["floor"] for r in rows if r["size_mb"] == 0.25}
    assert floors["identity"] == 0 and floors["fp16"] == 1.5  # the bucket read and written, 16 bits each way
    assert floors["topk"] == pytest.approx(1 + bits["topk"] / 32 + 1, rel=0.01)  # plus its residual, read and written
    assert floors["pactrain"] == pytest.approx(1 + bits["pactrain"] / 32)
    for r in rows:
        assert r["device"] == "cpu" and r["codec_clock"] == "wall"
        assert r["copy_gbps"] == pytest.approx(r["size_mb"] * 2**20 / r["copy_s"] / 1e9)
        assert r["reduce_gbps"] == pytest.approx(r["size_mb"] * 2**20 / r["reduce_s"] / 1e9, nan_ok=True)
        assert r["peak_extra_frac"] >= r["largest_alloc_frac"] >= 0
    memory = {r["method"]: (r["peak_extra_frac"], r["largest_alloc_frac"]) for r in rows if r["size_mb"] == 0.25}
    assert max(memory["identity"]) < 0.01  # the bucket is its own result: a few bytes of bookkeeping at most
    assert memory["topk"][1] > 0  # its decode writes a fresh dense tensor
    printed = capsys.readouterr().out
    assert f"| topk | {bits['topk']:.3g} | " in printed and (out / "codec.csv").exists()  # 0.402: coded positions
    assert "| peak extra | largest alloc | codec/copy | reduce/copy | GB/s |" in printed  # the largest size
    full = (out / "codec.md").read_text()
    assert "peak extra / bucket, 0.25 MB" in full and "reduce GB/s, 0.0625 MB" in full
    assert "copy: " in printed and "GB/s at 0.25 MB" in printed
    assert main(["bench", "--codec", "--method", "topkk", "--out", str(out)]) == 2


def test_a_brief_shaped_run_goes_through_namespaces_or_says_why_not(tmp_path, capsys):
    from gcomp.bench import netem
    ok, why = netem.permitted()
    if not ok:
        pytest.skip(why)
    out = tmp_path / "shaped"
    assert main(["bench", "--workers", "2", "--bandwidth", "1gbit,500mbit", "--steps", "4", "--eval-every", "2",
                 "--model", "mlp:32", "--pretrain-epochs", "0", "--out", str(out), "--method", "identity;fp16"]) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["network"].startswith("shaped: 2 namespaces")
    assert [(r["method"], r["bandwidth"], r["bandwidth_bps"]) for r in results["runs"]] == [
        ("identity", "1gbit", 1e9), ("fp16", "1gbit", 1e9), ("identity", "500mbit", 5e8), ("fp16", "500mbit", 5e8)]
    assert all(r["steps"] == 4 for r in results["runs"]) and "### 500mbit" in printed
    assert [e["tta_speedup"] for e in results["summary"] if e["method"] == "identity"] == [1.0, 1.0]
    assert (out / "bandwidth_sweep.png").stat().st_size > 1000
    mine = netem.PREFIX + f"{os.getpid() % 10**7:07d}"  # the names this process gave its namespaces
    assert not [n for n in netem.namespace_names() if n.startswith(mine)]


def test_a_method_that_fails_leaves_an_error_row_and_the_others_go_on(tmp_path, capsys, monkeypatch):
    from gcomp.bench import codec_table
    measure = codec_table.measure

    def failing(name, *args, **kwargs):
        if name == "fp16":
            raise RuntimeError("no such kernel")
        return measure(name, *args, **kwargs)

    monkeypatch.setattr(codec_table, "measure", failing)
    out = tmp_path / "codec"
    assert main(["bench", "--codec", "--sizes-mb", "0.0625", "--method", "identity;fp16", "--out", str(out)]) == 1
    rows = json.loads((out / "codec.json").read_text())
    assert rows[1] == {"method": "fp16", "device": "cpu", "size_mb": 0.0625, "error": "RuntimeError: no such kernel"}
    captured = capsys.readouterr()
    assert "| fp16 | error |" in captured.out and "| identity | 32 |" in captured.out
    assert "failed: fp16 (0.0625 MB)" in captured.err
    with open(out / "codec.csv") as fh:
        assert [r["error"] for r in csv.DictReader(fh)] == ["", "RuntimeError: no such kernel"]


class _FakeEvent:
    """A CUDA event on a fake device timeline (``now`` in ms, advanced by the timed operation)."""

    def __init__(self, timeline: dict):
        self.timeline, self.at = timeline, None

    def record(self):
        self.at = self.timeline["now"]

    def synchronize(self):
        self.timeline["waits"] += 1

    def elapsed_time(self, end) -> float:
        return end.at - self.at


def test_median_times_with_the_cuda_event_clock_reads_device_time_and_syncs_before_each_sample():
    from gcomp.bench.timing import CudaEventClock, median_times
    timeline = {"now": 0.0, "waits": 0, "syncs": 0}

    def synchronize():
        timeline["syncs"] += 1

    def op(ms):
        def run():
            timeline["now"] += ms
        return run

    clock = CudaEventClock(event=lambda: _FakeEvent(timeline), synchronize=synchronize)
    times = median_times({"copy": op(4.0), "reduce": op(10.0)}, repeats=3, clock=clock)
    assert times == {"copy": pytest.approx(0.004), "reduce": pytest.approx(0.010)}  # seconds, from milliseconds
    samples = 2 * 1 + 2 * 3  # one sizing sample per operation, then 3 repeats of each
    assert timeline["syncs"] == timeline["waits"] == samples


def test_a_host_clock_function_still_times_samples():
    from gcomp.bench.timing import median_times
    ticks = iter(range(1000))
    assert median_times({"op": lambda: None}, repeats=3, clock=lambda: float(next(ticks))) == {"op": 1.0}


def test_allocations_of_a_call_on_the_cpu():
    from gcomp.bench.allocations import measure_allocations
    kept = []

    def fn():
        scratch = torch.empty(1000)  # 4000 bytes, freed on return
        kept.append(torch.empty(500))  # 2000 bytes, held after
        del scratch

    memory = measure_allocations(fn, "cpu")
    assert (memory.peak_extra_bytes, memory.largest_bytes) == (6000, 4000)
    assert measure_allocations(lambda: None).peak_extra_bytes == 0


def test_gbps_is_bytes_over_seconds_and_nan_below_the_clock():
    import math

    from gcomp.bench.codec_table import gbps
    assert gbps(4e9, 2.0) == 2.0 and math.isnan(gbps(1e6, 0.0)) and math.isnan(gbps(1e6, -1e-6))


@pytest.fixture
def two_fake_gpus(monkeypatch):
    """CUDA as a GPU host would report it (nothing runs on it: the checks only)."""
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


@pytest.mark.parametrize("settings, message", [
    ({"backend": "nccl"}, "--backend nccl reduces CUDA tensors only: add --device cuda"),
    ({"backend": "mpi"}, "--backend must be one of gloo, nccl"),
    ({"device": "tpu"}, "--device must be one of cpu, cuda"),
    ({"device": "cuda", "backend": "nccl", "workers": 4, "bandwidth": "none"},
     "one worker per GPU: --workers 4, but 2 GPU(s)"),
    ({"device": "cuda", "backend": "nccl", "workers": 2}, "--bandwidth 100mbit: shaping applies to gloo's TCP"),
    ({"device": "cuda", "backend": "nccl", "workers": 2, "bandwidth": "1gbit,100mbit"}, "Use --bandwidth none"),
])
def test_device_and_backend_settings_are_checked_before_anything_starts(two_fake_gpus, settings, message):
    from gcomp.bench.runner import BenchConfig
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        BenchConfig(**settings).check()


def test_gpus_that_fit_the_workers_pass_and_gloo_shares_them(two_fake_gpus):
    from gcomp.bench.devices import worker_device
    from gcomp.bench.runner import BenchConfig
    BenchConfig(device="cuda", backend="nccl", workers=2, bandwidth="none").check()
    BenchConfig(device="cuda", backend="gloo", workers=4).check()  # gloo: 4 workers on 2 GPUs, shaped
    assert [worker_device("cuda", rank) for rank in range(4)] == [torch.device("cuda", r % 2) for r in range(4)]
    assert worker_device("cpu", 3) == torch.device("cpu")


def test_without_cuda_the_device_check_says_why(monkeypatch):
    from gcomp.bench.runner import BenchConfig
    monkeypatch.setattr(torch.version, "cuda", None)
    with pytest.raises(ValueError, match="--device cuda: this torch .* is built without CUDA"):
        BenchConfig(device="cuda").check()
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="--backend nccl: no CUDA GPU is visible"):
        from gcomp.bench.devices import check_backend
        check_backend("nccl", "cuda", 1)


def test_a_worker_synchronises_the_device_around_every_timed_step(monkeypatch):
    """On a GPU the host clock must wait for the kernels at both ends of each step and compute sample; here
    the calls are counted on the CPU (where synchronising is a no-op)."""
    import torch.distributed as dist

    from gcomp.bench import worker
    from gcomp.bench.runner import BenchConfig, free_port
    calls = []
    monkeypatch.setattr(worker, "synchronize", lambda device: calls.append(device))
    config = {**vars(BenchConfig(model="mlp:8", steps=3, eval_every=3, verbose=False)), "bandwidth": "none",
              "bandwidth_bps": None, "method": "identity"}
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        row = worker.run_method(parse_method("identity"), config, load_data("digits"), None, lambda text: None)
    finally:
        if started:
            dist.destroy_process_group()
    assert len(calls) == 2 * (3 + worker.COMPUTE_SAMPLES) and set(calls) == {torch.device("cpu")}
    assert row["steps"] == 3


def test_codec_table_holds_pactrain_ternary_and_pytorchs_powersgd_beside_ours(tmp_path, capsys):
    from gcomp.bench import codec_table
    assert codec_table.default_rows()[-2:] == ["pactrain:ternary=true", "torch:powersgd"]
    out = tmp_path / "codec"
    # in a process of its own: PyTorch's hook leaves gloo's threads finishing callbacks (gcomp.bench.codec_hooks)
    done = subprocess.run([sys.executable, "-m", "gcomp", "bench", "--codec", "--sizes-mb", "0.25", "--method",
                           "pactrain:ternary=true;torch:powersgd;powersgd", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["method"]: r for r in json.loads((out / "codec.json").read_text())}
    assert "error" not in rows["torch:powersgd"] and "error" not in rows["pactrain:ternary=true"], rows
    assert 0.9 < rows["pactrain:ternary=true"]["bits_per_entry"] < 1.2  # 2-bit fields for the kept half, one rank
    # PyTorch's hook at rank 2 on the 256 x 256 matrix: P and Q, (256 + 256) * 2 fp32 values for 65,536 entries
    assert rows["torch:powersgd"]["bits_per_entry"] == (256 + 256) * 2 * 32 / 65536
    assert math.isnan(rows["torch:powersgd"]["codec_ratio"]) and rows["torch:powersgd"]["reduce_s"] > 0
    assert main(["bench", "--codec", "--method", "torch:fp16", "--out", str(tmp_path / "x")]) == 2
    assert "of PyTorch's hooks it times torch:powersgd" in capsys.readouterr().err
