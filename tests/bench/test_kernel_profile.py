"""``python -m gcomp.bench.kernel_profile``: where one method's bucket reduction spends its time."""
from __future__ import annotations

import math

import torch.distributed as dist

from gcomp.bench import kernel_profile


def test_profiles_a_method_and_names_its_costliest_operations(capsys):
    assert kernel_profile.main(["--method", "randomk", "nosuchmethod", "--size-mb", "0.25", "--repeats", "2",
                                "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert not dist.is_initialized()  # the one-rank group it started is gone
    assert "randomk:" in out and "us per reduction" in out and "aten::" in out
    assert "nosuchmethod: FAILED: " in out


def test_cpu_profile_has_host_times_and_no_device_time():
    kernel_profile.codec_table.one_rank_group(kernel_profile.torch.device("cpu"))
    try:
        r = kernel_profile.profile_method("identity", 1024, 2, "cpu")
    finally:
        dist.destroy_process_group()
    assert r["wall_us"] > 0 and math.isnan(r["device_us"]) and r["top"]
    assert all(us > 0 and count >= 1 for _, us, count in r["top"])
