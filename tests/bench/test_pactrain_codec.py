"""The codec benchmark runs and reports sane rows (correctness only: timings are never asserted)."""
import math

import pytest
import torch

from gcomp.bench.pactrain_codec import TERNARY_PARTS, markdown, run, synthetic_bucket
from gcomp.collectives import bitpack
from gcomp.packing.support import SupportIndex

TIMES = ["copy_ms", "encode_ms", "decode_ms", "maskpack_ms", "naive_ms", "ternary_ms", "maskpack_x", "naive_x",
         "ternary_x"] + [f"t_{part}_ms" for part in TERNARY_PARTS]


@pytest.mark.parametrize("dtype, elt", [("float32", 4), ("float16", 2)])
def test_a_small_run_gives_complete_rows_and_mask_pack_equals_the_naive_reference(dtype, elt):
    rows = run(sizes_mb=[0.25], ratio=0.5, dtype=dtype, world=4, repeats=1)
    assert len(rows) == 1
    row = rows[0]
    for key in TIMES + ["index_frac", "wire_packed_bpe", "wire_ternary_bpe"]:
        assert math.isfinite(row[key]) and row[key] > 0, key
    assert row["exact"] is True  # gather + scatter == index_select + index_copy_, and == the (pruned) bucket
    assert row["numel"] * elt == 2**18 and row["dtype"] == dtype
    assert 0.45 < row["kept"] / row["numel"] < 0.6  # half of every weight, plus the dense biases
    assert row["wire_packed_bpe"] == (row["kept"] + 1) * elt / row["numel"]
    lanes = bitpack.packed_words(row["kept"], bitpack.lane_bits(4)) * 8
    assert lanes / row["numel"] < row["wire_ternary_bpe"] < lanes / row["numel"] + 0.01  # + the scales
    # The profiler's allocation events: naive allocates its packed vector; mask-pack allocates nothing.
    assert row["mem_naive_frac"] >= row["kept"] / row["numel"]
    assert row["mem_maskpack_frac"] < 0.01
    assert 0 <= row["mem_ternary_frac"] <= 1.0  # the issue: no per-step allocation larger than the bucket
    table = markdown(rows)
    assert table.count("| size MB |") == 2 and "| 0.25 |" in table


def test_the_synthetic_bucket_is_pruned_where_its_support_is_false_and_holds_channels_last_weights():
    bucket, support, params = synthetic_bucket(400_000, 0.5, torch.float32, torch.Generator().manual_seed(1))
    assert bucket.numel() == support.numel() == sum(size.numel() for size, _, _ in params) == 400_000
    assert torch.all(bucket[~support] == 0)
    assert any(mask is None for _, _, mask in params)  # dense biases
    conv = params[0]
    assert conv[0] == torch.Size([128, 64, 3, 3]) and conv[1] == (576, 1, 192, 64)  # channels_last strides
    index = SupportIndex(support, tuple(size.numel() for size, _, _ in params))
    assert index.kept == int(support.sum())
