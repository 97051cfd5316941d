"""``gcomp bench --outer``: the outer-loop spec, its errors, the report's outer columns and a 2-worker run."""
from __future__ import annotations

import json

import pytest

from gcomp.bench import report, simulate
from gcomp.bench.methods import parse_method
from gcomp.bench.outer_spec import ADAMW_LR, DEFAULTS, is_outer, parse_outer
from gcomp.bench.runner import BenchConfig
from gcomp.cli import main


def test_an_outer_spec_takes_a_nested_method_with_its_own_colon_and_commas():
    spec = parse_outer("diloco:every=20,lr=0.5,method=qsgd:levels=7,seed=3")
    assert spec.params == {**DEFAULTS, "every": 20, "lr": 0.5, "method": "qsgd:levels=7,seed=3"}
    bracketed = parse_outer("diloco:method=[topk:ratio=0.05],every=20,inner=adamw")
    assert (bracketed.params["method"], bracketed.params["every"], bracketed.params["inner"]) == \
        ("topk:ratio=0.05", 20, "adamw")
    assert parse_outer("diloco").params == DEFAULTS  # every 50, identity, outer SGD 0.7 / Nesterov 0.9, inner sgd
    assert parse_method("diloco:every=5,method=fp16").label == "diloco:every=5,method=fp16"  # the race's label
    assert is_outer(" diloco:every=5") and not is_outer("identity") and not is_outer("topk:ratio=0.1")


def test_the_inner_lr_is_the_races_for_sgd_and_adamws_default_for_adamw():
    assert parse_outer("diloco").inner_lr(0.004) == 0.004
    assert parse_outer("diloco:inner=adamw").inner_lr(0.004) == ADAMW_LR
    assert parse_outer("diloco:inner=adamw,inner_lr=0.01").inner_lr(0.004) == 0.01


@pytest.mark.parametrize("text, message", [
    ("diloco:evry=5", "unknown key 'evry' (did you mean 'every'?)"),
    ("dilocco:every=5", "unknown outer loop 'dilocco' (did you mean 'diloco'?)"),
    ("diloco:every=0", "every must be a whole number of at least 1; got '0'"),
    ("diloco:every=x", "every must be a whole number"),
    ("diloco:lr=0", "lr must be a number above 0"),
    ("diloco:momentum=1", "momentum must be in [0, 1)"),
    ("diloco:inner=adam", "inner must be one of sgd, adamw (did you mean 'adamw'?)"),
    ("diloco:every", "'every' is not key=value"),
    ("diloco:every=5,every=6", "every is given twice"),
    ("diloco:every=4,fragments=5", "fragments (5) above every (4)"),
    ("diloco:every=4,overlap=4", "overlap (4) must be below every / fragments (4 / 1)"),
    ("diloco:every=8,fragments=2,overlap=4", "overlap (4) must be below every / fragments (8 / 2)"),
    ("diloco:method=torch:fp16", "method must be a gcomp method"),
    ("diloco:method=topkk", "method 'topkk'"),
    ("diloco:method=topk:ratio=0.05,every=50", "so every went to it: put method last, or in brackets"),
    ("diloco:method=[topk", "has no closing ]"),
])
def test_a_bad_outer_spec_says_what_is_wrong(text, message):
    with pytest.raises(ValueError) as err:
        parse_outer(text)
    assert message in str(err.value)


def test_bad_outer_arguments_fail_before_any_worker(tmp_path, capsys):
    assert main(["bench", "--outer", "topk", "--out", str(tmp_path / "x")]) == 2  # a per-step method
    assert "unknown outer loop 'topk'" in capsys.readouterr().err
    assert main(["bench", "--outer", "diloco:every=5,method=nosuch", "--out", str(tmp_path / "x")]) == 2
    assert "method 'nosuch'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is an outer loop"):
        BenchConfig(methods=["identity", "diloco:every=5"], fsdp=True).check()
    assert not (tmp_path / "x").exists()


def test_the_full_table_has_an_outer_steps_column_and_the_short_one_a_note():
    rows = [{"method": "identity", "step_s": 0.1, "compression": 1.0, "bytes_sent_per_step": 400.0},
            {"method": "diloco:every=50,method=fp16", "step_s": 0.01, "compression": 100.0, "outer_steps": 4,
             "steps": 200, "bytes_sent_per_step": 4.0}]
    full = report.markdown(rows, full=True).splitlines()
    assert full[0].endswith("| outer steps |") and full[2].endswith("| — |") and full[3].endswith("| 4 |")
    assert "outer steps" not in report.markdown(rows)  # the short table stays six columns
    note = report.outer_notes(rows)
    assert "diloco:every=50,method=fp16: 4 outer steps in 200 inner steps, 4 bytes per inner step (100.0x" in note
    assert report.outer_notes(rows[:1]) is None


def test_a_brief_unshaped_race_of_an_outer_loop_beside_all_reduce(tmp_path, capsys):
    out = tmp_path / "run"
    code = main(["bench", "--workers", "2", "--bandwidth", "none", "--steps", "6", "--eval-every", "3",
                 "--model", "mlp:32", "--pretrain-epochs", "0", "--method", "identity", "--out", str(out),
                 "--outer", "diloco:every=3,method=identity;diloco:every=2,inner=adamw,method=fp16"])
    assert code == 0
    printed = capsys.readouterr().out
    runs = {r["method"]: r for r in json.loads((out / "results.json").read_text())["runs"]}
    assert list(runs) == ["identity", "diloco:every=3,method=identity", "diloco:every=2,inner=adamw,method=fp16"]
    params = runs["identity"]["parameters"]
    plain, half = runs["diloco:every=3,method=identity"], runs["diloco:every=2,inner=adamw,method=fp16"]
    assert (plain["outer_steps"], half["outer_steps"]) == (2, 3)
    assert [h["step"] for h in plain["history"]] == [3, 6] and [h["step"] for h in half["history"]] == [2, 4, 6]
    assert plain["bytes_dense_per_step"] == half["bytes_dense_per_step"] == 4 * params
    # identity sends the fp32 outer gradient once per 3 steps; fp16 half of it once per 2
    assert plain["bytes_sent_total"] == 2 * 4 * params and half["bytes_sent_total"] == 3 * 2 * params
    assert plain["compression"] == pytest.approx(3.0) and half["compression"] == pytest.approx(4.0)
    assert half["inner_optimizer"] == "adamw" and plain["inner_lr"] == 0.004
    assert "diloco:every=3,method=identity: 2 outer steps in 6 inner steps" in printed
    assert "| outer steps |" in (out / "summary.md").read_text()
    assert max(len(line) for line in printed.splitlines() if line.startswith("|")) <= 100
    # gcomp simulate models per-step runs only: it leaves the outer loops out
    assert simulate.main(["--results", str(out / "results.json"), "--workers", "8", "--bandwidth", "1gbit"]) == 0
    projected = json.loads((out / "simulate.json").read_text())["rows"]
    assert {r["method"] for r in projected} == {"identity"}


def test_an_outer_spec_refuses_a_method_that_reads_the_model_before_any_worker_starts():
    from gcomp.bench.outer_spec import parse_outer

    with pytest.raises(ValueError, match="reads the model"):
        parse_outer("diloco:every=10,method=pactrain")
