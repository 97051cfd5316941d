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
    return [line.split()[0] for line in stdout.splitlines() if line.strip()]


def test_main_list_prints_every_available_name(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert _listed(out) == gcomp.available()
    for name in gcomp.available():
        line = next(l for l in out.splitlines() if l.split()[0] == name)
        assert gcomp.create(name).communicator.collective in line


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
