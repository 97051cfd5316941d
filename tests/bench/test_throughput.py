"""``gcomp.bench.throughput``'s link probe on 2 gloo ranks (alpha and beta derived from the two timed all-reduces;
consistency only, no timing is asserted), the links in results.json's meta, ``gcomp.bench.straggler``'s wait for
peers, and the link model's names still importable from the bench modules they left for ``gcomp.link``."""
from __future__ import annotations

import pytest

from gcomp.bench.straggler import ReadyClock, waits
from gcomp.bench.throughput import loaded_latency_s, probe_link, probe_loaded_latency
from gcomp.link import PROBE_LARGE_BYTES, PROBE_SMALL_BYTES, link_from_timings
from tests.distributed import run_ranks


def _probe_job() -> dict:
    return {"link": probe_link(repeats=(3, 2), large_bytes=1 << 16)}


def test_probes_run_on_every_rank_and_derive_their_figures():
    for out in run_ranks(2, _probe_job):
        link = out["link"]
        assert link["probe_small_bytes"] == PROBE_SMALL_BYTES and link["probe_large_bytes"] == 1 << 16
        derived = link_from_timings(link["probe_small_s"], link["probe_large_s"], 2, PROBE_SMALL_BYTES, 1 << 16)
        assert (link["alpha_s"], link["beta_s"]) == (derived["alpha_s"], derived["beta_s"])
    assert PROBE_LARGE_BYTES > PROBE_SMALL_BYTES


def test_results_meta_lists_each_probed_link_once():
    from gcomp.bench.report import links
    link = {"alpha_s": 1e-4, "beta_s": 8e-8}
    rows = [{"bandwidth": "100mbit", "workers": 4, "link": link}, {"bandwidth": "100mbit", "workers": 4, "link": link},
            {"bandwidth": "1gbit", "workers": 4, "link": {"alpha_s": 9e-5, "beta_s": 8e-9}},
            {"bandwidth": "none", "workers": 4}]
    assert links(rows) == [
        {"bandwidth": "100mbit", "workers": 4, "alpha_s": 1e-4, "beta_s": 8e-8, "measured_bps": pytest.approx(1e8)},
        {"bandwidth": "1gbit", "workers": 4, "alpha_s": 9e-5, "beta_s": 8e-9, "measured_bps": pytest.approx(1e9)}]


def test_waits_are_rank_zeros_lag_behind_the_last_ready_rank():
    ready = [[10.0, 20.0, 30.0], [10.5, 19.0, 30.25], [9.0, 20.75, 29.0]]
    assert waits(ready) == [0.5, 0.75, 0.25]
    assert waits([[1.0, 2.0], [1.5]]) == [0.5]  # only the steps every rank recorded


class _Bucket:
    def __init__(self, last):
        self.last = last

    def is_last(self):
        return self.last


class _State:
    """A hook state's surface: ``reduce`` (which encodes for 0.25 s) and ``stats``."""

    def __init__(self):
        self.stats = {"encode_s": 0.0}

    def reduce(self, bucket):
        self.stats["encode_s"] += 0.25
        return "future"


def test_ready_clock_records_the_last_bucket_once_encoded(monkeypatch):
    import gcomp.bench.straggler as straggler
    ticks = iter([100.0, 200.0])
    monkeypatch.setattr(straggler.time, "perf_counter", lambda: next(ticks))
    state = _State()
    clock = ReadyClock(state)
    assert state.reduce(_Bucket(False)) == "future"  # an earlier bucket: not the step's readiness
    assert state.reduce(_Bucket(True)) == "future"
    assert clock.ready == [200.25]
    assert ReadyClock(None).ready == []


def test_loaded_latency_counts_from_the_last_arrival():
    # two all-reduces on 3 ranks (4 messages each): rank 0 done at 10 and 21; the last arrivals 8 and 20.5
    spans = [[(7.0, 10.0), (20.0, 21.0)], [(8.0, 10.1), (20.5, 21.1)], [(6.0, 10.2), (19.0, 21.2)]]
    # durations 2.0 and 0.5: median 1.25, over 2 * (3 - 1) = 4 messages
    assert loaded_latency_s(spans, 3) == pytest.approx(1.25 / 4)
    assert loaded_latency_s(spans[:1], 1) is None


def _loaded_job():
    steps = []
    return probe_loaded_latency(lambda: steps.append(1), repeats=3), len(steps)


def test_loaded_latency_probe_runs_the_local_step_before_each_all_reduce():
    for alpha, steps in run_ranks(2, _loaded_job):
        assert steps == 3 and alpha >= 0.0
