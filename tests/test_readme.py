"""Every Python snippet in the README runs as written, so none can rot.

A snippet is marked by an HTML comment on the line before its fence, which the rendered page hides:

    <!-- test: torchrun 2; ratio > 1 -->     run under ``torchrun --nproc_per_node 2`` (gloo on this machine's CPUs)
    <!-- test: python -->                    run as a plain script

``ratio > X`` also asks that every compression ratio the snippet prints (``4.6x``) be above X. Every ```python
block of the README carries a mark: a block without one fails here, so no snippet goes untested.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^(?:<!-- test: (?P<mark>[^\n]*?) -->\n)?```python\n(?P<code>.*?)^```$", re.M | re.S)
MARK = re.compile(r"^(?P<how>torchrun 2|python)(?:; ratio > (?P<ratio>[\d.]+))?$")
RATIO = re.compile(r"(\d+\.\d+)x")  # two ranks' lines may interleave: "2.0xrank 0: 2.0x"


def snippets(text: str) -> list[tuple[str, str, str | None]]:
    """``(id, code, mark)`` for every ```python block of ``text``; the id is the line the block starts on and the
    bold title or heading above it."""
    found = []
    for match in FENCE.finditer(text):
        before = text[:match.start()]
        titles = re.findall(r"^(?:#+ (.+)|\*\*(.+?)\*\*)", before, re.M)
        title = next((a or b for a, b in reversed(titles)), "top")
        line = text[:match.start("code")].count("\n")  # the fence's line
        found.append((f"line {line}: {title}", match["code"], match["mark"]))
    return found


def _environment() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def test_the_readme_has_its_snippets_and_every_one_is_marked():
    found = snippets(README)
    assert len(found) >= 5, [name for name, _, _ in found]
    unmarked = [name for name, _, mark in found if mark is None]
    assert not unmarked, f"README python blocks without a '<!-- test: ... -->' line before them: {unmarked}"
    bad = [(name, mark) for name, _, mark in found if not MARK.match(mark)]
    assert not bad, f"marks must read 'torchrun 2' or 'python', optionally '; ratio > X': {bad}"


def test_the_quick_start_is_within_the_first_40_lines_and_shows_compression():
    name, code, mark = snippets(README)[0]
    end = README.index(code) + len(code)
    assert README[:end].count("\n") < 40, name
    assert "torchrun 2" in mark and "ratio > 1" in mark, mark
    assert "range(5)" in code  # more steps than DDP's dense warm-up step


def test_the_parser_finds_marked_and_unmarked_blocks():
    text = "# A\n<!-- test: python -->\n```python\nprint(1)\n```\n\n**B**\n```python\nx = 2\n```\n"
    assert snippets(text) == [("line 3: A", "print(1)\n", "python"), ("line 8: B", "x = 2\n", None)]
    assert RATIO.findall("rank 1: 2.0xrank 0: 2.0x\n") == ["2.0", "2.0"]  # two ranks' prints, interleaved


@pytest.mark.slow
@pytest.mark.parametrize("name, code, mark", snippets(README), ids=[name for name, _, _ in snippets(README)])
def test_readme_snippet_runs_as_written(name, code, mark, tmp_path):
    how = MARK.match(mark or "")
    assert how, f"{name}: unmarked"
    script = tmp_path / "snippet.py"
    script.write_text(code)
    cmd = [sys.executable, str(script)]
    if how["how"] == "torchrun 2":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=_environment(), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{name} exited {proc.returncode}\n{out[-4000:]}"
    if how["ratio"]:
        ratios = [float(r) for r in RATIO.findall(proc.stdout)]
        expected = 2 if how["how"] == "torchrun 2" else 1
        assert len(ratios) == expected, f"{name}: expected {expected} printed ratios, got {proc.stdout!r}"
        assert all(r > float(how["ratio"]) for r in ratios), f"{name}: {proc.stdout!r}"
