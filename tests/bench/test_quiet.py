"""The benchmarks' output stays short: each warning once per run, the profiler's own lines held back, progress
only on a terminal."""
from __future__ import annotations

import io
import os
import sys
import warnings

import torch

from gcomp.bench import codec_table
from gcomp.bench.allocations import measure_allocations
from gcomp.bench.quiet import Progress, held_back_profiler_lines, once_per_cause


def _one_node_warnings(log) -> list[str]:
    return [str(w.message) for w in log if "ranks are on one node" in str(w.message)]


def test_the_one_node_warning_of_two_installs_shows_once(monkeypatch):
    started = codec_table.one_rank_group(torch.device("cpu"))
    try:
        with warnings.catch_warnings(record=True) as log, once_per_cause():
            warnings.simplefilter("default")
            for _ in range(2):  # two installs of hierarchical: the cause, twice
                codec_table.reducer("hierarchical", 256, torch.Generator().manual_seed(0))
                warnings.resetwarnings()  # as PyTorch's catch_warnings do between installs
                warnings.simplefilter("default")
            codec_table.reducer("prunex", 256, torch.Generator().manual_seed(0))  # another method: its own line
    finally:
        if started:
            torch.distributed.destroy_process_group()
    shown = _one_node_warnings(log)
    assert len(shown) == 2 and shown[0].startswith("hierarchical:") and shown[1].startswith("prunex:")


def test_once_per_cause_keys_by_category_and_text():
    with warnings.catch_warnings(record=True) as log, once_per_cause():
        warnings.simplefilter("always")
        for text in ("a", "a", "b"):
            warnings.warn(text, UserWarning)
        warnings.warn("a", DeprecationWarning)
    assert [(w.category, str(w.message)) for w in log] == [(UserWarning, "a"), (UserWarning, "b"),
                                                           (DeprecationWarning, "a")]
    with warnings.catch_warnings(record=True) as log:  # outside the block: as Python does
        warnings.simplefilter("always")
        warnings.warn("a")
        warnings.warn("a")
    assert len(log) == 2


def test_the_profiler_s_lines_are_held_back_and_everything_else_comes_through(capfd):
    capfd.readouterr()
    measure_allocations(lambda: torch.ones(4096) + 1)
    assert "profiler_start" not in capfd.readouterr().err  # kineto's USDT lines, at every start and stop
    with held_back_profiler_lines():
        os.write(2, b"USDT:2026 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(2, b"something else went wrong\n")
        print("a Python line on stderr", file=sys.stderr)
    err = capfd.readouterr().err
    assert "profiler_start" not in err
    assert "something else went wrong" in err and "a Python line on stderr" in err


def test_progress_is_silent_off_a_terminal_and_a_line_on_one():
    quiet = io.StringIO()
    bar = Progress(3, "codec", stream=quiet)  # a StringIO is no terminal
    for _ in range(3):
        bar.update("topk, 1 MB")
    bar.close()
    assert quiet.getvalue() == "" and bar.done == 3
    shown = io.StringIO()
    bar = Progress(2, "codec", shown=True, stream=shown)
    bar.update("topk, 1 MB")
    bar.close()
    assert "codec" in shown.getvalue() and "/2" in shown.getvalue()  # tqdm's bar, or the plain line


def _codec_row(name: str, size_mb: float) -> dict:
    return {"method": name, "size_mb": size_mb, "codec_clock": "wall", "bits_per_entry": 32.0, "floor": 2.0,
            "peak_extra_frac": 6.97, "largest_alloc_frac": 12.25, "codec_ratio": 220.75, "reduce_ratio": 300.26,
            "reduce_gbps": 24.1, "copy_gbps": 44.2}


def test_the_codec_table_fits_100_columns_and_the_full_one_has_every_size():
    rows = [_codec_row(name, size) for size in (1.0, 4.0, 16.0, 64.0) for name in codec_table.default_rows()]
    rows.append({"method": "topk", "size_mb": 64.0, "error": "RuntimeError: no"})
    table = codec_table.markdown(rows)
    assert max(map(len, table.splitlines())) <= 100, table
    assert "| reduce/copy |" in table and "at 64 MB per bucket" in table
    assert "| pactrain:ternary=true | 32 | 2.00 | 6.97 | 12.25 | 220.75 | 300.26 | 24.1 |" in table
    full = codec_table.markdown(rows, full=True)
    assert all(f"reduce / copy, {size:g} MB" in full for size in (1, 4, 16, 64))


def test_gcomp_bench_codec_prints_a_short_narrow_table(tmp_path, capsys):
    from gcomp.cli import main
    out = tmp_path / "codec"
    assert main(["bench", "--codec", "--sizes-mb", "0.25", "--method", "identity;fp16", "--out", str(out)]) == 0
    printed = capsys.readouterr()
    lines = printed.out.splitlines()
    assert max(len(line) for line in lines if not line.startswith("written to")) <= 100 and len(lines) <= 12
    assert f"written to {out.resolve()}:\n  codec.json, codec.csv, codec.md" in printed.out
    assert "profiler_start" not in printed.err and "| fp16 |" in printed.out
    assert "reduce / copy, 0.25 MB" in (out / "codec.md").read_text()
