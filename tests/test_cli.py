"""The ``gcomp`` command: ``list`` and ``describe``, as a function, as ``python -m gcomp`` and as a script."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

import gcomp
from gcomp.cli import main


def _run(*args, script: str | None = None) -> subprocess.CompletedProcess:
    command = [script] if script else [sys.executable, "-m", "gcomp"]
    return subprocess.run(command + list(args), capture_output=True, text=True, timeout=120)


def _listed(stdout: str) -> list[str]:
    return [line.split()[0] for line in stdout.splitlines() if line.strip() and not line.startswith("gcomp describe")]


def test_main_list_prints_every_available_name(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert _listed(out) == gcomp.available()
    for name in gcomp.available():
        line = next(l for l in out.splitlines() if l.split()[0] == name)
        assert (gcomp.create(name).collective or "chosen per bucket") in line


def test_list_is_plain_text_within_100_columns(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert max(map(len, out.splitlines())) <= 100 and "`" not in out
    assert len(out.splitlines()) == len(gcomp.available()) + 2  # and the line naming gcomp describe
    hierarchical = next(line for line in out.splitlines() if line.startswith("hierarchical "))
    assert 'the inner method ("topk:ratio=0.05"' in hierarchical and hierarchical.endswith("…")


@pytest.mark.parametrize("text, room, expected", [
    ("Uses ``x`` and :class:`gcomp.Method`. Then more.", 80, "Uses x and gcomp.Method."),
    ("one two three four", 12, "one two…"),
    ("short", 10, "short"),
])
def test_plain_summary_drops_markup_and_cuts_at_a_word(text, room, expected):
    from gcomp.cli import plain_summary
    assert plain_summary(text, room) == expected


def test_python_m_gcomp_list():
    result = _run("list")
    assert result.returncode == 0, result.stderr
    names = _listed(result.stdout)
    assert names == sorted(names)
    assert set(names) == set(gcomp.available())


def test_gcomp_script_list():
    script = shutil.which("gcomp", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the gcomp console script is not installed next to this interpreter")
    result = _run("list", script=script)
    assert result.returncode == 0, result.stderr
    assert set(_listed(result.stdout)) == set(gcomp.available())


def test_main_describe_topk_prints_the_ratio_parameter(capsys):
    assert main(["describe", "topk"]) == 0
    out = capsys.readouterr().out
    assert "topk" in out and "allgather" in out
    ratio_line = next(l for l in out.splitlines() if l.strip().startswith("ratio"))
    assert "0.01" in ratio_line and "(0, 1]" in ratio_line


def test_main_describe_unknown_exits_2_with_close_names_on_stderr(capsys):
    assert main(["describe", "topkk"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "topkk" in captured.err
    assert "did you mean 'topk'" in captured.err


def test_python_m_gcomp_describe_nosuch_exits_2():
    result = _run("describe", "nosuch")
    assert result.returncode == 2
    assert result.stdout == ""
    assert "nosuch" in result.stderr
    for name in ("bf16", "fp16", "identity", "topk"):  # nothing is close: the registered names are listed
        assert name in result.stderr
    assert "Traceback" not in result.stderr


def test_main_without_subcommand_fails(capsys):
    with pytest.raises(SystemExit) as excinfo:
        main([])
    assert excinfo.value.code not in (0, None)
    assert "usage" in capsys.readouterr().err


def test_python_m_gcomp_without_subcommand_fails():
    result = _run()
    assert result.returncode != 0
    assert "usage" in result.stderr


# --- gcomp bench --device / --backend: refused clearly, before anything starts -----------------------------------

no_gpu = pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks what happens without CUDA")


@no_gpu
@pytest.mark.parametrize("flags, message", [
    (["--codec", "--device", "cuda"], "gcomp bench --codec: --device cuda: "),
    (["--device", "cuda"], "gcomp bench: --device cuda: "),
    (["--backend", "nccl", "--device", "cuda"], "gcomp bench: --device cuda: "),
])
def test_bench_on_cuda_without_it_exits_2_saying_why(tmp_path, capsys, flags, message):
    assert main(["bench", *flags, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and "leave --device out to run on the CPU" in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_bench_nccl_without_cuda_device_exits_2(tmp_path, capsys):
    assert main(["bench", "--backend", "nccl", "--out", str(tmp_path / "x")]) == 2
    assert "--backend nccl reduces CUDA tensors only: add --device cuda" in capsys.readouterr().err


def test_codec_table_runs_on_one_rank_of_its_device_s_backend(tmp_path, capsys):
    assert main(["bench", "--codec", "--backend", "nccl", "--out", str(tmp_path / "x")]) == 2
    assert "--codec runs on one rank, on gloo for the CPU and NCCL for --device cuda" in capsys.readouterr().err


def test_bench_refuses_an_unknown_device(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--codec", "--device", "tpu"])
    assert exit_.value.code == 2 and "invalid choice: 'tpu'" in capsys.readouterr().err


def test_nccl_race_defaults_to_no_shaping_and_passes_device_and_backend_on(tmp_path, monkeypatch):
    import torch

    from gcomp.bench import runner
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    seen = []

    def run(config, out):
        config.check()
        seen.append(config)
        raise ValueError("stop before any worker")

    monkeypatch.setattr(runner, "run", run)
    assert main(["bench", "--device", "cuda", "--backend", "nccl", "--out", str(tmp_path / "x")]) == 2
    assert (seen[0].device, seen[0].backend, seen[0].bandwidth) == ("cuda", "nccl", "none")
    assert main(["bench", "--device", "cuda", "--out", str(tmp_path / "x")]) == 2  # gloo on GPUs: shaped
    assert (seen[1].device, seen[1].backend, seen[1].bandwidth) == ("cuda", "gloo", "100mbit")


# --- gcomp bench: a worker's failure named in the parent's message ----------------------------------------------

FAKE_WORKER = """
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location("failures", sys.argv[1])
failures = importlib.util.module_from_spec(spec)
spec.loader.exec_module(failures)

def main(argv):
    if os.environ["RANK"] == "1":  # the peer fails after the cause, as a survivor does
        time.sleep(0.3)
        raise ConnectionResetError("Connection reset by peer")
    raise ValueError("spardl: parameter 'teams' must divide the number of workers (2); got 3\\nsecond line")

sys.exit(failures.recorded(main, sys.argv[2:]))
"""


def test_the_first_failing_worker_s_error_is_the_parent_s_message(tmp_path, capfd, monkeypatch):
    """Workers run as ``python -m gcomp.bench.worker CONFIG``; here a stand-in that fails as a bad method does
    on rank 0 and as its peer then does on rank 1."""
    import subprocess as sp

    from gcomp.bench import failures, runner
    popen = sp.Popen

    def fake(argv, **kwargs):
        assert argv[1:3] == ["-m", "gcomp.bench.worker"]
        return popen([argv[0], "-c", FAKE_WORKER, failures.__file__, *argv[3:]], **kwargs)

    monkeypatch.setattr(runner.subprocess, "Popen", fake)
    out = tmp_path / "run"
    assert main(["bench", "--workers", "2", "--bandwidth", "none", "--pretrain-epochs", "0", "--method", "identity",
                 "--out", str(out)]) == 1
    err = capfd.readouterr().err
    last = err.strip().splitlines()[-1]
    assert last == ("gcomp bench: benchmark workers failed (exit codes 1, 1); rank 0 failed first: ValueError: "
                    "spardl: parameter 'teams' must divide the number of workers (2); got 3. Their full output is "
                    "above"), err
    assert "Traceback" in err and err.count("Traceback") == 2  # the workers' own, none of the parent


def test_workers_that_die_without_an_error_are_named_by_their_signal(tmp_path):
    from gcomp.bench import failures
    config = tmp_path / "worker-config-0.json"
    failures.check([0, 0], config)  # all well: nothing raised
    failures.error_path(config, 0).write_text("stale, from an earlier launch")
    failures.clear(config, 2)
    with pytest.raises(failures.WorkersFailed) as err:
        failures.check([-6, 0], config)
    assert str(err.value) == ("benchmark workers failed (exit codes -6 (SIGABRT), 0); none raised a Python error "
                              "(a crash or a signal). Their full output is above")


@pytest.mark.slow
def test_a_method_that_fails_in_the_workers_says_why_in_one_line(tmp_path, capfd):
    """The real worker: spardl's teams must divide the workers, which only a worker's process group knows."""
    assert main(["bench", "--workers", "1", "--steps", "1", "--bandwidth", "none", "--pretrain-epochs", "0",
                 "--model", "mlp:8", "--method", "spardl:teams=2", "--out", str(tmp_path / "run")]) == 1
    last = capfd.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("gcomp bench: benchmark workers failed (exit codes 1); rank 0 failed first: ValueError: "
                           "spardl: parameter 'teams' must divide the number of workers (1); got 2"), last


def test_bench_help_shows_the_default_sizes(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--help"])
    assert exit_.value.code == 0
    assert "bucket sizes in MB (default: 1 4 16 64)" in " ".join(capsys.readouterr().out.split())


def test_bench_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    text = " ".join(capsys.readouterr().out.split()).split("options:", 1)[1]  # argparse wraps the help
    for option, default in (("--workers WORKERS", "default: 4"), ("--steps STEPS", "(default: 240)"),
                            ("--bandwidth BANDWIDTH", "(default: 100mbit)"), ("--lr LR", "default: 0.004"),
                            ("--target-accuracy TARGET_ACCURACY", "default: 99% of all-reduce's best accuracy"),
                            ("--sizes-mb SIZES_MB [SIZES_MB ...]", "(default: 1 4 16 64)")):
        assert default in text.split(option, 1)[1][:420], option  # its help, wrapped, runs to 400 characters
    assert "torch:allreduce, torch:fp16, torch:powersgd)" in text  # --method: the default comparison


def test_simulate_help_shows_the_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["simulate", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: identity)" in text and "node size for hierarchical methods (default: 1)" in text
    assert "--projection" in text
