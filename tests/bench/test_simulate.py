"""The step model (``gcomp.bench.costmodel``) against costs worked out by hand, and ``gcomp simulate``; each
collective's formula is checked in ``tests/link/test_costs.py``."""
from __future__ import annotations

import importlib.util
import json

import pytest

from gcomp.bench.costmodel import Profile, error_by_method, model_error, project, step_time
from gcomp.bench.simulate import main, markdown, plot
from gcomp.link import Launched, Network, launched_s

ALPHA = 50e-6
MBIT100 = Network(1e8, ALPHA)  # beta = 8 / 1e8 = 8e-8 s/byte
GBIT = Network(1e9, ALPHA)  # beta = 8 / 1e9 = 8e-9 s/byte
INTRA = Network(1e10, 5e-6)  # beta = 8 / 1e10 = 8e-10 s/byte


def dense_profile(**kw) -> Profile:
    return Profile("identity", "allreduce", bytes_sent=1e6, bytes_dense=1e6, compute_s=0.1, encode_s=0.0,
                   decode_s=0.0, **kw)


def topk_profile(**kw) -> Profile:
    return Profile("topk", "allgather", bytes_sent=1e5, bytes_dense=1e6, compute_s=0.1, encode_s=0.01,
                   decode_s=0.005, **kw)


def test_step_time_adds_local_work_and_communication():
    # 0.1 + 0.01 + 0.005 + [3 * 1e5 * 8e-8 + 3 * 50e-6 = 0.024 + 0.00015]
    assert step_time(topk_profile(), 4, MBIT100) == pytest.approx(0.115 + 0.02415)
    assert step_time(topk_profile(), 1, MBIT100) == pytest.approx(0.115)


def test_step_time_of_a_hierarchical_profile_reduces_its_dense_bytes_inside_nodes():
    profile = Profile("hierarchical", "hierarchical", bytes_sent=1e5, bytes_dense=1e6, compute_s=0.1, encode_s=0.0,
                      decode_s=0.0)
    # The same 2 x 2 case as test_hierarchical_two_nodes_of_two (tests/link/test_costs.py), plus 0.1 s of compute.
    got = step_time(profile, 4, GBIT, ranks_per_node=2, intra=INTRA)
    assert got == pytest.approx(0.1 + 8.1e-4 + 9e-4 + 8.05e-4)


def test_project_speedups_and_time_to_accuracy():
    profiles = [dense_profile(steps_to_target=1000), topk_profile(steps_to_target=1200),
                Profile("never", "allreduce", 5e5, 1e6, 0.1, 0.0, 0.0)]
    rows = project(profiles, [1, 4], [MBIT100])
    assert len(rows) == 6
    by_key = {(row["method"], row["workers"]): row for row in rows}
    # P=4 at 100 Mbit/s:
    # identity: 0.1 + [2*3/4 * 1e6 * 8e-8 + 6 * 50e-6 = 0.1203]  = 0.2203 s; TTA 1000 * 0.2203 = 220.3 s
    # topk:     0.115 + [3 * 1e5 * 8e-8 + 3 * 50e-6 = 0.02415]   = 0.13915 s; TTA 1200 * 0.13915 = 166.98 s
    dense, topk, never = by_key["identity", 4], by_key["topk", 4], by_key["never", 4]
    assert dense["step_s"] == pytest.approx(0.2203) and dense["comm_s"] == pytest.approx(0.1203)
    assert dense["speedup_vs_baseline"] == pytest.approx(1.0) and dense["tta_speedup"] == pytest.approx(1.0)
    assert topk["step_s"] == pytest.approx(0.13915) and topk["comm_s"] == pytest.approx(0.02415)
    assert topk["speedup_vs_baseline"] == pytest.approx(0.2203 / 0.13915)
    assert topk["tta_s"] == pytest.approx(166.98)
    assert topk["tta_speedup"] == pytest.approx(220.3 / 166.98)
    # never: 0.1 + [2*3/4 * 5e5 * 8e-8 + 6 * 50e-6 = 0.0603] = 0.1603 s; it never reaches the target.
    assert never["speedup_vs_baseline"] == pytest.approx(0.2203 / 0.1603)
    assert never["tta_s"] is None and never["tta_speedup"] is None
    # P=1: no communication; identity 0.1 s, topk 0.115 s (it only pays for its codec).
    assert by_key["topk", 1]["speedup_vs_baseline"] == pytest.approx(0.1 / 0.115)
    assert by_key["topk", 1]["comm_s"] == 0.0
    assert topk["bandwidth"] == "100mbit" and topk["bandwidth_bps"] == 1e8 and topk["alpha_s"] == ALPHA


def test_project_without_the_baselines_reached_target_has_no_tta_speedup():
    rows = project([dense_profile(), topk_profile(steps_to_target=10)], [4], [GBIT])
    assert [row["tta_speedup"] for row in rows] == [None, None]
    assert rows[1]["tta_s"] is not None


def test_project_needs_the_baseline():
    with pytest.raises(ValueError, match="baseline method 'identity'.*topk"):
        project([topk_profile()], [4], [GBIT])
    assert len(project([topk_profile()], [4, 8], [GBIT, MBIT100], baseline="topk")) == 4


def test_model_error_against_a_known_measurement():
    measured = dense_profile(measured_step_s=0.25, measured_workers=4, measured_bandwidth_bps=1e8)
    unmeasured = topk_profile(measured_step_s=0.2, measured_workers=4)  # unshaped: no bandwidth
    rows = model_error([measured, unmeasured], network_alpha_s=ALPHA)
    assert len(rows) == 1
    # predicted 0.1 + 0.1203 = 0.2203 s; (0.2203 - 0.25) / 0.25 = -0.1188
    assert rows[0]["predicted_s"] == pytest.approx(0.2203)
    assert rows[0]["measured_s"] == 0.25
    assert rows[0]["rel_error"] == pytest.approx(-0.1188)
    assert rows[0]["bandwidth"] == "100mbit" and rows[0]["workers"] == 4


def row(method, collective, workers, bandwidth_bps, bytes_sent, step_s=None, steps_to_target=None) -> dict:
    return {"method": method, "collective": collective, "bytes_sent_per_step": bytes_sent,
            "bytes_dense_per_step": 1e6, "compute_s_per_step": 0.1, "encode_s_per_step": 0.001,
            "decode_s_per_step": 0.002, "steps_to_target": steps_to_target, "step_s": step_s,
            "workers": workers, "bandwidth_bps": bandwidth_bps}


def test_profile_from_row():
    full = Profile.from_row(row("topk", "allgather", 4, 1e9, 1e5, step_s=0.2, steps_to_target=300))
    assert full == Profile("topk", "allgather", 1e5, 1e6, 0.1, 0.001, 0.002, steps_to_target=300,
                           measured_step_s=0.2, measured_workers=4, measured_bandwidth_bps=1e9, kind="topk")
    bare = {key: value for key, value in row("identity", "allreduce", 4, 1e9, 1e6).items()
            if key not in ("steps_to_target", "step_s", "workers", "bandwidth_bps")}
    assert Profile.from_row(bare) == Profile("identity", "allreduce", 1e6, 1e6, 0.1, 0.001, 0.002, kind="identity")
    with pytest.raises(ValueError, match="compute_s_per_step"):
        Profile.from_row({key: value for key, value in bare.items() if key != "compute_s_per_step"})


def test_markdown_table():
    table = markdown([{"method": "identity", "step_s": 0.123456, "tta_s": None}, {"method": "topk", "extra": 3}])
    lines = table.splitlines()
    assert lines[0] == "| method | step_s | tta_s | extra |"
    assert lines[1] == "|---|---|---|---|"
    assert lines[2] == "| identity | 0.1235 | - | - |"
    assert lines[3] == "| topk | - | - | 3 |"
    assert markdown([]) == "(no rows)"


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = project([dense_profile(), topk_profile()], [8, 16], [GBIT, MBIT100])
    plot(rows, tmp_path / "speedup.png")
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def write_results(path, runs) -> None:
    path.write_text(json.dumps({"runs": runs}))


def test_main_writes_the_projection(tmp_path, capsys):
    results = tmp_path / "results.json"
    write_results(results, [
        row("identity", "allreduce", 2, 1e9, 1e6, step_s=0.12, steps_to_target=100),
        row("identity", "allreduce", 4, 1e9, 1e6, step_s=0.13, steps_to_target=100),
        row("topk", "allgather", 4, None, 1e5, step_s=0.11, steps_to_target=120),  # unshaped: no model error
    ])
    out = tmp_path / "out"
    assert main(["--results", str(results), "--workers", "8", "16", "--bandwidth", "1gbit", "10gbit",
                 "--out", str(out)]) == 0
    written = json.loads((out / "simulate.json").read_text())
    assert len(written["rows"]) == 2 * 2 * 2  # methods x workers x bandwidths
    assert len(written["model_error"]) == 2  # the two shaped identity runs
    assert {r["method"] for r in written["rows"]} == {"identity", "topk"}
    assert written["settings"]["alpha_s"] == pytest.approx(ALPHA)
    captured = capsys.readouterr()
    printed = captured.out
    assert "| method | collective | workers |" not in printed  # the projection: only with --projection
    assert printed.startswith("Model error against the measured runs") and "--projection prints them" in printed
    files = printed.index(f"written to {out.resolve()}:")
    assert printed.index("| error % |") < files and "simulate.json, simulate.csv, model_error.csv" in printed[files:]
    assert "| link Mbit/s |" not in printed and "link Mbit/s" in (out / "model_error.csv").read_text()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "simulate.png").stat().st_size > 0
    else:
        assert "no simulate.png" in captured.err
    assert main(["--results", str(results), "--workers", "8", "--bandwidth", "1gbit", "--out", str(out),
                 "--projection"]) == 0
    printed = capsys.readouterr().out
    errors, projection = printed.index("| error % |"), printed.index("| method | workers | bandwidth | step ms |")
    assert errors < projection < printed.index("written to")
    assert max(len(line) for line in printed.splitlines() if not line.startswith("written to")) <= 100


def test_errors_are_percent_in_both_tables_and_the_plot_dots_a_method_the_model_misses(tmp_path, capsys):
    results = tmp_path / "results.json"
    write_results(results, [row("identity", "allreduce", 4, 1e8, 1e6, step_s=0.2203),  # the model: exact
                            row("topk", "allgather", 4, 1e8, 1e5, step_s=0.5)])  # the model: far below
    assert main(["--results", str(results), "--workers", "8", "--bandwidth", "1gbit", "--out", str(tmp_path),
                 "--projection"]) == 0
    printed = capsys.readouterr().out
    written = json.loads((tmp_path / "simulate.json").read_text())
    topk_error = next(e["rel_error"] for e in written["model_error"] if e["method"] == "topk")
    assert topk_error < -0.15
    error_line = next(line for line in printed.splitlines() if line.startswith("| topk | 4 |"))
    projection_line = next(line for line in printed.splitlines() if line.startswith("| topk | 8 |"))
    percent = f"| {100 * topk_error:+.1f} |"
    assert error_line.endswith(percent) and projection_line.endswith(percent)  # one unit, the same figure
    assert "dotted in simulate.png (model error > 15%): topk" in printed
    pytest.importorskip("matplotlib")
    (ax,) = plot(written["rows"], tmp_path / "marked.png")
    styles = {line.get_label(): line.get_linestyle() for line in ax.get_lines()}
    assert styles == {"identity": "-", "topk (model error > 15%)": ":"}


def test_main_writes_next_to_the_results_by_default(tmp_path):
    results = tmp_path / "results.json"
    write_results(results, [row("identity", "allreduce", 4, 1e9, 1e6)])
    assert main(["--results", str(results), "--workers", "8", "--bandwidth", "1gbit"]) == 0
    assert len(json.loads((tmp_path / "simulate.json").read_text())["rows"]) == 1


def test_main_uses_each_methods_largest_run(tmp_path):
    results = tmp_path / "results.json"
    # The 2-worker identity run hands over 1e6 B, the 8-worker one 2e6 B: the latter must be the profile.
    write_results(results, [row("identity", "allreduce", 8, None, 2e6), row("identity", "allreduce", 2, None, 1e6)])
    main(["--results", str(results), "--workers", "4", "--bandwidth", "100mbit", "--out", str(tmp_path)])
    (projected,) = json.loads((tmp_path / "simulate.json").read_text())["rows"]
    # 0.1 + 0.001 + 0.002 + [2*3/4 * 2e6 * 8e-8 + 6 * 50e-6 = 0.24 + 0.0003]
    assert projected["step_s"] == pytest.approx(0.103 + 0.2403)


def test_main_explains_bad_input(tmp_path):
    with pytest.raises(SystemExit, match="results file .*missing.json.* not found"):
        main(["--results", str(tmp_path / "missing.json")])
    empty = tmp_path / "empty.json"
    write_results(empty, [])
    with pytest.raises(SystemExit, match="has no runs"):
        main(["--results", str(empty)])
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(SystemExit, match="cannot read"):
        main(["--results", str(broken)])
    no_baseline = tmp_path / "topk.json"
    write_results(no_baseline, [row("topk", "allgather", 4, 1e9, 1e5)])
    with pytest.raises(SystemExit, match="baseline method 'identity'"):
        main(["--results", str(no_baseline)])
    with pytest.raises(SystemExit, match="--bandwidth: cannot read 'fast'"):
        main(["--results", str(no_baseline), "--baseline", "topk", "--bandwidth", "fast"])


def test_point_to_point_rows_are_brought_back_to_one_selection():
    # measured at P=4 with k = 11,264 entries of 8 bytes (90,112 bytes): spardl sends 2*3/4 of that per rank,
    # gtopk's root sends it once per tree level (log2 4 = 2)
    base = {"collective": "point-to-point", "bytes_dense_per_step": 4.5e6, "compute_s_per_step": 0.01,
            "encode_s_per_step": 0.0, "decode_s_per_step": 0.0, "workers": 4}
    spardl = Profile.from_row({**base, "method": "spardl:density=0.01", "name": "spardl", "bytes_sent_per_step": 135168})
    gtopk = Profile.from_row({**base, "method": "gtopk", "name": "gtopk", "bytes_sent_per_step": 180224})
    assert spardl.bytes_sent == 90112 and spardl.kind == "spardl"
    assert gtopk.bytes_sent == 90112
    net = Network(1e8, alpha_s=0.0)
    assert step_time(spardl, 4, net) == pytest.approx(0.01 + 135168 * 8 / 1e8)  # the measured bytes again at P=4


def test_gcomp_simulate_runs_the_model_from_the_command_line(tmp_path, capsys):
    from gcomp.cli import main as gcomp_main
    results = tmp_path / "results.json"
    base = {"collective": "allreduce", "bytes_dense_per_step": 4e6, "compute_s_per_step": 0.01,
            "encode_s_per_step": 0.0, "decode_s_per_step": 0.0, "workers": 4, "step_s": 0.5,
            "bandwidth_bps": 1e8, "steps_to_target": 10}
    rows = [{**base, "method": "identity", "bytes_sent_per_step": 4e6},
            {**base, "method": "fp16", "bytes_sent_per_step": 2e6}]
    results.write_text(json.dumps({"runs": rows}))
    assert gcomp_main(["simulate", "--results", str(results), "--workers", "8", "16", "--bandwidth", "1gbit"]) == 0
    out = json.loads((tmp_path / "simulate.json").read_text())
    assert len(out["rows"]) == 2 * 2 * 1  # methods x worker counts x bandwidths
    assert "| fp16 |" in capsys.readouterr().out


# ---- counted collectives, probed links, the error column ---------------------------------------------------

COUNTED = {"rounds_per_step": 3.0, "allreduce_calls_per_step": 2.0, "allreduce_bytes_per_step": 1e6,
           "allgather_calls_per_step": 1.0, "allgather_bytes_per_step": 1e4, "p2p_rounds_per_step": 0.0,
           "p2p_bytes_per_step": 0.0, "buckets_per_step": 1.0, "round_work_s_per_step": 0.004}


def test_profile_reads_the_counts_the_link_and_the_work_between_rounds():
    counted = {**row("powersgd", "allreduce", 4, 1e8, 1e6, step_s=0.3), **COUNTED,
               "link": {"alpha_s": 1e-4, "beta_s": 1.6e-7}}
    profile = Profile.from_row(counted)
    assert profile.launched == Launched(4, 3, 2, 1e6, 1, 1e4, 0, 0, 1)
    assert (profile.link_alpha_s, profile.link_beta_s, profile.round_work_s) == (1e-4, 1.6e-7, 0.004)
    assert profile.local_s == pytest.approx(0.1 + 0.001 + 0.002 + 0.004)
    assert Profile.from_row(row("identity", "allreduce", 4, 1e8, 1e6)).launched is None  # an uncounted run
    assert Profile.from_row({**row("identity", "allreduce", 1, None, 1e6), **COUNTED}).launched is None


def test_model_error_prices_a_run_on_its_probed_link():
    counted = {**row("powersgd", "allreduce", 4, 1e8, 1e6, step_s=0.3), **COUNTED,
               "link": {"alpha_s": 1e-4, "beta_s": 1.6e-7}}  # the path ran at 50 Mbit/s, 100 us per message
    (err,) = model_error([Profile.from_row(counted)])
    # all-reduces 2 * 6 * 1e-4 + 1e6 * 1.5 * 1.6e-7; all-gather 3 * 1e-4 + 1e4 * 3 * 1.6e-7
    comm = 1.2e-3 + 0.24 + 3e-4 + 4.8e-3
    assert err["predicted_comm_s"] == pytest.approx(comm)
    assert err["predicted_s"] == pytest.approx(0.107 + comm)
    assert err["measured_comm_s"] == pytest.approx(0.3 - 0.107)
    assert err["rel_error"] == pytest.approx((0.107 + comm - 0.3) / 0.3)
    assert err["bandwidth"] == "100mbit" and err["link_mbit"] == pytest.approx(50.0)
    assert err["link_alpha_us"] == pytest.approx(100.0)
    assert error_by_method([err, {**err, "rel_error": 0.01}]) == {"powersgd": err["rel_error"]}


def test_main_prints_the_error_column_and_states_it_beside_the_projection(tmp_path, capsys):
    results = tmp_path / "results.json"
    link = {"alpha_s": 1e-4, "beta_s": 8e-8}
    write_results(results, [{**row("identity", "allreduce", 4, 1e8, 1e6, step_s=0.25), **COUNTED, "link": link},
                            {**row("identity", "allreduce", 2, 1e8, 1e6, step_s=0.2), **COUNTED,
                             "link": {**link, "alpha_s": 3e-4}}])
    assert main(["--results", str(results), "--workers", "1024", "--bandwidth", "100gbit",
                 "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "| error % |" in printed and "largest" in printed
    written = json.loads((tmp_path / "simulate.json").read_text())
    errors = {e["workers"]: e["rel_error"] for e in written["model_error"]}
    worst = errors[4] if abs(errors[4]) > abs(errors[2]) else errors[2]
    (projected,) = written["rows"]
    assert projected["model_error"] == pytest.approx(worst)
    assert projected["workers"] == 1024 and projected["bandwidth"] == "100gbit"
    # the projection's latency: the median of the two probed ones
    assert written["settings"]["alpha_s"] == pytest.approx(2e-4) and projected["alpha_s"] == pytest.approx(2e-4)
    main(["--results", str(results), "--workers", "8", "--alpha-us", "5", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "simulate.json").read_text())["settings"]["alpha_s"] == pytest.approx(5e-6)


def test_the_measured_wait_for_peers_is_in_the_checked_step_not_in_the_projection():
    waited = {**row("identity", "allreduce", 4, 1e8, 1e6, step_s=0.25), **COUNTED,
              "link": {"alpha_s": 50e-6, "beta_s": 8e-8}, "wait_s_per_step": 0.02}
    profile = Profile.from_row(waited)
    assert profile.wait_s == 0.02
    (err,) = model_error([profile])
    comm = launched_s(profile.launched, 4, MBIT100)
    assert err["predicted_s"] == pytest.approx(profile.local_s + 0.02 + comm)
    assert err["measured_comm_s"] == pytest.approx(0.25 - profile.local_s - 0.02)
    (projected,) = project([profile], [4], [MBIT100])
    assert projected["step_s"] == pytest.approx(profile.local_s + comm)


def test_model_error_takes_the_latency_the_runs_rounds_met():
    base = {**row("identity", "allreduce", 4, 1e8, 1e6, step_s=0.25), **COUNTED,
            "link": {"alpha_s": 1e-4, "beta_s": 8e-8}}
    idle, loaded = model_error([Profile.from_row(base), Profile.from_row({**base, "alpha_loaded_s": 1e-3})])
    # the same bytes; the 2 all-reduces (6 messages each) and the all-gather (3) at 1e-3 instead of 1e-4
    assert loaded["predicted_comm_s"] - idle["predicted_comm_s"] == pytest.approx(15 * (1e-3 - 1e-4))
    assert loaded["link_alpha_us"] == pytest.approx(1000.0)
