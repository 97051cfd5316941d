"""``python -m gcomp.bench.block_codec``: one row per format, ratios to a copy, and the table (never the times)."""
import torch

from gcomp.bench import block_codec


def test_rows_and_table():
    threads = torch.get_num_threads()
    rows = block_codec.run(size_mb=0.0625, repeats=1, formats=["mxfp4", "fp8_e5m2"])
    assert torch.get_num_threads() == threads  # one thread while timing, then as before
    assert [r["format"] for r in rows] == ["mxfp4", "fp8_e5m2"]
    assert [r["bits"] for r in rows] == [4.25, 8.25]
    assert all(r["encode"] > 0 and r["decode"] > 0 and r["both"] == r["encode"] + r["decode"] for r in rows)
    table = block_codec.markdown(rows)
    assert "| mxfp4 | 4.25 |" in table and "| fp8_e5m2 | 8.25 |" in table
