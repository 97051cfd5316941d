"""Bandwidth schedules (``--bandwidth 1gbit,100mbit@60``): parsing against sweeps, when the rate changes, who
changes it (the parent, over a channel from rank 0), what the results record.

Nothing here times anything. The tests that start workers are marked slow; the one on real links needs root.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
import torch.distributed as dist

from gcomp.bench import netem, rate_control, report, runner, worker
from gcomp.bench.methods import parse_method
from gcomp.bench.rate_control import NoSwitch, RateController, RateSwitch, channel_client
from gcomp.bench.rate_schedule import parse_schedule, segment_times
from gcomp.bench.runner import BenchConfig, free_port
from gcomp.bench.workloads import load_data
from gcomp.cli import main

GBIT, MBIT = 1_000_000_000, 1_000_000


def schedule(text: str, steps: int = 240) -> list[dict]:
    return [s.as_dict() for s in parse_schedule(text, steps)]


@pytest.mark.parametrize("text, points, segments", [
    ("1gbit,100mbit@60", ["1gbit,100mbit@60"], [("1gbit", GBIT, 0), ("100mbit", 100 * MBIT, 60)]),
    (" 1gbit, 100mbit@60 ,500mbit@120", ["1gbit,100mbit@60,500mbit@120"],
     [("1gbit", GBIT, 0), ("100mbit", 100 * MBIT, 60), ("500mbit", 500 * MBIT, 120)]),
    ("100mbit,1gbit", ["100mbit", "1gbit"], None),  # no @ anywhere: a sweep, as before
    ("100mbit", ["100mbit"], None),
    ("none", ["none"], None),
])
def test_a_list_with_an_at_is_one_scheduled_point_and_one_without_stays_a_sweep(text, points, segments):
    config = BenchConfig(bandwidth=text)
    config.check()
    assert config.bandwidths() == points
    expected = None if segments is None else [{"rate": r, "rate_bps": bps, "from_step": n} for r, bps, n in segments]
    assert config.rate_schedule() == expected


@pytest.mark.parametrize("text, message", [
    ("100mbit@5,1gbit@10", "the first rate holds from the start and takes no @STEP"),
    ("1gbit@5", "the first rate holds from the start"),
    ("1gbit,100mbit@60,500mbit", "'500mbit' needs @STEP"),
    ("1gbit,none@60", "'none' cannot be part of a schedule"),
    ("none,1gbit@60", "'none' cannot be part of a schedule"),
    ("1gbit,100mbit@60,500mbit@60", "steps must increase strictly"),
    ("1gbit,100mbit@60,500mbit@30", "steps must increase strictly"),
    ("1gbit,100mbit@0", "steps must increase strictly and be above 0"),
    ("1gbit,100mbit@240", "at or after the run's end \\(--steps 240\\)"),
    ("1gbit,100mbit@300", "every @STEP must be below --steps"),
    ("1gbit,100mbit@x", "@x is not a step number"),
    ("1gbit,100mbit@-5", "@-5 is not a step number"),
    ("1gbit,fast@60", "cannot read 'fast'"),
])
def test_a_mixed_or_out_of_order_schedule_is_refused_naming_the_option(text, message):
    with pytest.raises(ValueError, match=message) as error:
        BenchConfig(bandwidth=text, steps=240).check()
    assert "--bandwidth" in str(error.value)


def test_a_bad_schedule_exits_2_through_the_cli_before_any_worker(tmp_path, capsys):
    assert main(["bench", "--bandwidth", "1gbit,100mbit@20", "--steps", "20", "--out", str(tmp_path / "x")]) == 2
    assert "must be below --steps" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_schedule_with_nccl_is_refused_like_any_shaped_rate(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.4")  # a GPU host as CUDA would report it: the checks only
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="shaping applies to gloo's TCP links only"):
        BenchConfig(bandwidth="1gbit,100mbit@60", backend="nccl", device="cuda", workers=1).check()


def test_segment_times_split_the_step_times_at_every_change():
    times = [1.0, 3.0, 10.0, 20.0, 30.0, 5.0]
    assert segment_times(times, schedule("1gbit,100mbit@2,500mbit@5", 6)) == [
        {"rate": "1gbit", "from_step": 0, "steps": 2, "step_s": 2.0},
        {"rate": "100mbit", "from_step": 2, "steps": 3, "step_s": 20.0},
        {"rate": "500mbit", "from_step": 5, "steps": 1, "step_s": 5.0}]


def test_the_switch_changes_at_the_named_steps_and_starts_every_run_at_the_first_rate():
    requests, barriers = [], []
    switch = RateSwitch(schedule("1gbit,100mbit@3,500mbit@5", 8), lambda step, bps: requests.append((step, bps)),
                        barrier=lambda: barriers.append(len(requests)))
    said = [[switch.before_step(step) for step in range(8)] for _run in range(2)]
    assert said[0] == [None, None, None, "100mbit", None, "500mbit", None, None]  # the links start at 1gbit
    assert said[1] == ["1gbit", None, None, "100mbit", None, "500mbit", None, None]  # back to 1gbit first
    assert requests == [(3, 100 * MBIT), (5, 500 * MBIT), (0, GBIT), (3, 100 * MBIT), (5, 500 * MBIT)]
    assert barriers == [1, 2, 3, 4, 5]  # every change: the request first, then the barrier


def test_ranks_other_than_0_only_meet_at_the_barrier():
    barriers = []
    switch = RateSwitch(schedule("1gbit,100mbit@2", 4), None, barrier=lambda: barriers.append(1))
    assert [switch.before_step(step) for step in range(4)] == [None, None, "100mbit", None]
    assert barriers == [1]


def test_no_switch_without_an_applied_schedule():
    unshaped = {"rate_schedule": schedule("1gbit,100mbit@2", 4), "rate_schedule_applied": False}
    assert isinstance(rate_control.worker_switch(unshaped, 0), NoSwitch)
    assert isinstance(rate_control.worker_switch({"rate_schedule": None}, 0), NoSwitch)
    with pytest.raises(RuntimeError, match="GCOMP_RATE_CHANNEL"):
        channel_client({})


def test_a_worker_asks_for_the_change_before_the_steps_clock_starts(monkeypatch):
    """Two runs of 5 steps with ``1gbit,100mbit@3`` on one rank: the request comes when exactly 3 steps (6
    synchronisations: one at each end of a timed step) are done, and the second run starts back at 1gbit."""
    syncs, requests = [], []
    monkeypatch.setattr(worker, "synchronize", lambda device: syncs.append(device))
    plan = schedule("1gbit,100mbit@3", 5)
    config = {**vars(BenchConfig(model="mlp:8", steps=5, eval_every=5, verbose=False)), "bandwidth": "x",
              "bandwidth_bps": None, "method": "identity", "rate_schedule": plan}
    started = not dist.is_initialized()
    if started:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        switch = RateSwitch(plan, lambda step, bps: requests.append((step, bps, len(syncs))))
        rows = []
        for _run in range(2):
            syncs.clear()
            rows.append(worker.run_method(parse_method("identity"), config, load_data("digits"), None,
                                          lambda text: None, switch=switch))
    finally:
        if started:
            dist.destroy_process_group()
    assert requests == [(3, 100 * MBIT, 6), (0, GBIT, 0), (3, 100 * MBIT, 6)]
    for row in rows:
        assert [(s["rate"], s["from_step"], s["steps"]) for s in row["segments"]] == [("1gbit", 0, 3),
                                                                                      ("100mbit", 3, 2)]
        assert row["segments"][1]["step_s"] == pytest.approx(sum(row["step_times"][3:]) / 2)


def test_the_controller_runs_each_request_and_answers_it_over_the_pipes():
    changes = []

    def change(step, bps):
        if bps == 7:
            raise RuntimeError("tc refused\nsecond line")
        changes.append((step, bps))

    with RateController(change) as controller:
        # this process plays rank 0: its own copies of rank 0's ends, as a child would inherit them
        ends = ",".join(str(os.dup(fd)) for fd in controller.child_fds)
        controller.launched()
        request = channel_client({rate_control.CHANNEL_ENV: ends})
        request(60, 100 * MBIT)
        request(0, GBIT)
        with pytest.raises(RuntimeError, match="before step 9 failed: RuntimeError: tc refused second line"):
            request(9, 7)
        del request  # rank 0 exits: its ends close
    assert changes == controller.changes == [(60, 100 * MBIT), (0, GBIT)]
    assert not controller._thread.is_alive()  # the end of the channel ended it


class Recorded:
    """What ``netem.run_command`` was asked to run."""

    def __init__(self):
        self.commands = []

    def __call__(self, argv):
        self.commands.append(list(argv))
        return ""


def test_set_rate_changes_the_tbf_on_both_ends_of_every_link_in_place(monkeypatch):
    recorded = Recorded()
    monkeypatch.setattr(netem, "run_command", recorded)
    network = netem.ShapedNetwork(2, GBIT)
    with pytest.raises(RuntimeError, match="while entered"):
        network.set_rate(100 * MBIT)
    network.prefix, network.namespaces, network._active = "gc0000001abc", ["gc0000001abcn0", "gc0000001abcn1"], True
    network.set_rate(100 * MBIT)
    tbf = ["root", "tbf", "rate", "100000000bit", "burst", "65536", "latency", "50ms"]  # the burst follows the rate
    assert recorded.commands == [
        ["tc", "-n", "gc0000001abcn0", "qdisc", "change", "dev", "eth0", *tbf],
        ["tc", "qdisc", "change", "dev", "gc0000001abcv0", *tbf],
        ["tc", "-n", "gc0000001abcn1", "qdisc", "change", "dev", "eth0", *tbf],
        ["tc", "qdisc", "change", "dev", "gc0000001abcv1", *tbf]]
    assert network.rate_bps == 100 * MBIT
    network._active = False


def test_the_segment_table_has_a_column_per_segment_and_a_row_per_method():
    def run(method, seed, times):
        return {"method": method, "seed": seed, "steps": 4, "prune_ratio": None,
                "segments": segment_times(times, schedule("1gbit,100mbit@2", 4))}

    rows = [run("identity", 0, [0.01, 0.01, 0.1, 0.1]), run("fp16", 0, [0.01, 0.01, 0.05, 0.05]),
            run("identity", 1, [0.03, 0.03, 0.3, 0.3])]
    lines = report.segment_markdown(rows).splitlines()
    assert lines[0] == "| method | step ms at 1gbit (steps 0–1) | step ms at 100mbit (steps 2–3) |"
    assert lines[2:] == ["| identity | 20.0 | 200.0 |", "| fp16 | 10.0 | 50.0 |"]  # identity: median of 2 seeds
    assert report.segment_markdown([{"method": "identity", "steps": 4}]) is None


BRIEF = ["bench", "--workers", "2", "--steps", "4", "--eval-every", "2", "--model", "mlp:8", "--pretrain-epochs",
         "0", "--bandwidth", "1gbit,100mbit@2"]


class FakeNetwork:
    """A "shaped" network that shapes nothing: the workers run on 127.0.0.1; ``set_rate`` is recorded."""

    rates: list[int] = []

    def __init__(self, workers, rate_bps):
        self.addresses, self.rate_bps = ["127.0.0.1"] * workers, rate_bps
        FakeNetwork.rates = [rate_bps]

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        pass

    def prefix_command(self, i, argv):
        return list(argv)

    def env(self, i):
        return {}

    def set_rate(self, rate_bps):
        FakeNetwork.rates.append(rate_bps)


@pytest.mark.slow
def test_every_method_run_switches_through_the_parent_at_its_step(tmp_path, capsys, monkeypatch):
    """The whole path without root: rank 0 asks the parent (over the channel passed to it alone), the parent
    sets the network's rate; each method's run starts at the first rate again."""
    controllers = []

    class Recording(RateController):
        def __enter__(self):
            controllers.append(self)
            return super().__enter__()

    monkeypatch.setattr(netem, "permitted", lambda: (True, ""))
    monkeypatch.setattr(netem, "ShapedNetwork", FakeNetwork)
    monkeypatch.setattr(runner, "RateController", Recording)
    out = tmp_path / "fake"
    assert main(BRIEF + ["--out", str(out), "--method", "identity;fp16"]) == 0
    assert controllers[0].changes == [(2, 100 * MBIT), (0, GBIT), (2, 100 * MBIT)]
    assert FakeNetwork.rates == [GBIT, 100 * MBIT, GBIT, 100 * MBIT]
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["schedule"] == schedule("1gbit,100mbit@2", 4) and results["meta"]["schedule_applied"]
    assert "then 100mbit from step 2" in results["meta"]["network"]
    for row in results["runs"]:
        assert row["bandwidth"] == "1gbit,100mbit@2" and row["bandwidth_bps"] is None
        assert [(s["rate"], s["steps"]) for s in row["segments"]] == [("1gbit", 2), ("100mbit", 2)]
    printed = capsys.readouterr().out
    assert "### step time per segment of the bandwidth schedule\n" in printed
    assert "| method | step ms at 1gbit (steps 0–1) | step ms at 100mbit (steps 2–3) |" in printed
    assert "| fp16 |" in printed.split("### step time per segment")[1]


@pytest.mark.slow
def test_without_shaping_a_schedule_runs_unshaped_and_says_so(tmp_path, capsys, monkeypatch):
    why = "bandwidth shaping needs root: running unshaped"
    monkeypatch.setattr(netem, "permitted", lambda: (False, why))
    out = tmp_path / "unshaped"
    assert main(BRIEF + ["--out", str(out), "--method", "identity"]) == 0
    results = json.loads((out / "results.json").read_text())
    assert results["meta"]["schedule_applied"] is False and results["meta"]["network"].endswith(why)
    assert results["meta"]["schedule"][1] == {"rate": "100mbit", "rate_bps": 100 * MBIT, "from_step": 2}
    assert [(r["bandwidth"], len(r["segments"])) for r in results["runs"]] == [("none", 2)]
    printed = capsys.readouterr().out
    assert printed.count(why) == 2  # the one message, and the network line of the summary
    assert "### step time per segment of the bandwidth schedule (not applied: the links were unshaped)" in printed


def tbf_rates(network) -> list[str]:
    """The rate tc reports on every tbf of ``network`` (each worker's eth0, then its bridge-side end)."""
    shown = []
    for i, namespace in enumerate(network.namespaces):
        for where in (["-n", namespace, "qdisc", "show", "dev", "eth0"],
                      ["qdisc", "show", "dev", network._host_end(i)]):
            text = subprocess.run(["tc", *where], capture_output=True, text=True, check=True).stdout.split()
            shown.append(text[text.index("rate") + 1])
    return shown


@pytest.mark.slow
def test_on_real_links_tc_reports_each_scheduled_rate(tmp_path, monkeypatch):
    ok, why = netem.permitted()
    if not ok:
        pytest.skip(why)
    seen = []
    set_rate = netem.ShapedNetwork.set_rate

    def set_and_read_back(self, rate_bps):
        set_rate(self, rate_bps)
        seen.append(tbf_rates(self))

    monkeypatch.setattr(netem.ShapedNetwork, "set_rate", set_and_read_back)
    assert main(BRIEF + ["--out", str(tmp_path / "real"), "--method", "identity;fp16"]) == 0
    assert seen == [["100Mbit"] * 4, ["1Gbit"] * 4, ["100Mbit"] * 4]  # 2 workers, 2 ends each


def test_bench_help_shows_the_schedule_syntax(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    assert "RATE@STEP is a schedule" in " ".join(capsys.readouterr().out.split())
