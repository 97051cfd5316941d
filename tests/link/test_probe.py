"""The timed probe of a link (``gcomp.link.probe``): alpha and beta from two timed all-reduces, worked out by hand,
and the timed all-reduce on 2 gloo ranks as ``auto`` calls it (no warm-up; consistency only, no timing is
asserted)."""
from __future__ import annotations

import pytest

from gcomp.link import PROBE_LARGE_BYTES, PROBE_SMALL_BYTES, link_from_timings, timed_allreduce_s
from tests.distributed import run_ranks


def test_link_from_two_timed_allreduces():
    # P=4: 2*3 = 6 messages and 1.5x the bytes. beta = (0.1203 - 0.0003) / (1.5 * 1e6) = 8e-8;
    # alpha = (0.0003 - 1.5 * 8 * 8e-8) / 6
    link = link_from_timings(0.0003, 0.1203, 4, small_bytes=8, large_bytes=1_000_008)
    assert link["beta_s"] == pytest.approx(8e-8)
    assert link["alpha_s"] == pytest.approx((0.0003 - 9.6e-7) / 6)
    assert link_from_timings(0.0003, 0.1203, 1) == {"alpha_s": None, "beta_s": None}


def _timed_job() -> dict:
    small = timed_allreduce_s(PROBE_SMALL_BYTES, 2, None, "cpu", warmup=False)
    large = timed_allreduce_s(1 << 16, 1, None, "cpu", warmup=False)
    return {"small_s": small, "large_s": large, "link": link_from_timings(small, large, 2, PROBE_SMALL_BYTES, 1 << 16)}


def test_timed_allreduces_without_warm_up_give_a_link_on_every_rank():
    for out in run_ranks(2, _timed_job):
        assert out["small_s"] > 0 and out["large_s"] > 0
        assert out["link"]["alpha_s"] >= 0 and out["link"]["beta_s"] >= 0
    assert PROBE_LARGE_BYTES > PROBE_SMALL_BYTES
