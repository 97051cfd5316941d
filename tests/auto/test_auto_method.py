"""``auto``'s pieces on one process: its parameters, the per-bucket counters, the hand-over of held-back gradient,
and its decisions against a fake link and fake codec timings (no collective runs: the agreement is the identity)."""
from __future__ import annotations

import pytest
import torch

import gcomp
import gcomp.auto.chooser as auto_chooser
from gcomp.auto.choice import LayoutRecord
from gcomp.auto.chooser import AutoChooser
from gcomp.bucket import BucketInfo
from gcomp.compressors.composites import AUTO_KEYS, TeeStats
from gcomp.link import Network
from tests.auto.auto_jobs import hand_built

MB = 1_000_000


@pytest.fixture
def hand_built_methods():
    with hand_built():
        yield


def test_tee_stats_count_apart_and_into_the_parent():
    parent = {"encode_s": 1.0, "bytes_sent": 10}
    own = TeeStats(parent)
    own["encode_s"] += 0.5
    own["bytes_sent"] += 4
    own["bytes_sent"] += 3
    assert own == {"encode_s": 0.5, "bytes_sent": 7}
    assert parent == {"encode_s": 1.5, "bytes_sent": 17}


def test_allow_is_held_as_canonical_text_and_checked_at_creation():
    assert gcomp.create("auto", allow="identity|fp16").specs == ["identity", "fp16"]
    assert gcomp.create("auto", allow=["identity", "bf16"]).params["allow"] == "identity|bf16"
    for allow, match in [(5, "must be 'exact', 'half', or a list"),
                         ("exactly", r"neither a preset \(exact, half\) nor a registered method"),
                         (["hierarchical"], "'hierarchical' collective, which auto cannot price")]:
        with pytest.raises(ValueError, match=match):
            gcomp.comm_hook("auto", allow=allow)


def test_allow_with_the_other_families():  # needs pactrain and the sparse family
    assert gcomp.create("auto").params["allow"] == "exact"
    assert gcomp.create("auto", allow=["identity", "topk:ratio=0.05"]).params["allow"] == "identity|topk:ratio=0.05"
    assert gcomp.create("auto", allow="half").specs == ["identity", "pactrain", "fp16", "bf16"]
    for allow, match in [(["spardl"], "point-to-point"), (["topk:ratio=7"], "allow entry 'topk:ratio=7'")]:
        with pytest.raises(ValueError, match=match):
            gcomp.comm_hook("auto", allow=allow)


def test_a_method_holding_back_gradient_it_cannot_flush_is_refused(hand_built_methods):
    class Hoarder(gcomp.MethodUnit):  # error feedback of its own, and no flush
        collective, error_feedback = gcomp.ALLREDUCE, True

        def reduce(self, buffer, layout, group, stats):
            raise NotImplementedError

    gcomp.register("test-hoarder")(lambda: Hoarder())
    try:
        with pytest.raises(ValueError, match="cannot hand it to another method"):
            gcomp.create("auto", allow=["identity", "test-hoarder"])
    finally:
        gcomp.registry._REGISTRY.pop("test-hoarder")
    assert gcomp.create("auto", allow="identity|test-strided|test-late").specs[1:] == ["test-strided", "test-late"]


def _reduced(method, grad: torch.Tensor, info: BucketInfo) -> torch.Tensor:
    return method.reduce(grad.clone(), info, None, {"bytes_sent": 0}).wait()


@pytest.mark.parametrize("spec", ["test-strided", "test-late"])
def test_a_method_hands_what_it_held_back_over_once(hand_built_methods, group, spec):
    """A residual memory's gradient (``test-strided``) and a held slot's (``test-late``): what was sent plus what is
    flushed is what was given, and the next flush holds nothing."""
    method = gcomp.create(spec)
    info = BucketInfo.single(torch.zeros(50))
    sent, given = torch.zeros(50), torch.zeros(50)
    assert method.flush(info, given) is None
    for step in range(3):
        grad = torch.randn(50, generator=torch.Generator().manual_seed(step))
        sent, given = sent + _reduced(method, grad, info), given + grad
    torch.testing.assert_close(sent + method.flush(info, given), given, rtol=0, atol=1e-6)
    again = method.flush(info, given)
    assert again is None or not again.any(), "the held gradient was handed over, not kept"


def test_powersgd_hands_its_error_over_laid_out_in_the_bucket(group):  # needs the low-rank family
    model = torch.nn.Linear(30, 20)
    method = gcomp.create("powersgd", rank=1, min_compression_rate=1.0)
    method.bind(model, group, {})
    info = BucketInfo.from_layout(0, torch.float32, ["weight", "bias"], [600, 20])
    grad = torch.randn(620, generator=torch.Generator().manual_seed(1))
    assert method.flush(info, grad) is None
    sent = _reduced(method, grad, info)
    held = method.flush(info, grad)
    torch.testing.assert_close(held + sent, grad, rtol=1e-5, atol=1e-5)
    assert held[:600].abs().sum() > 0 and not held[600:].any()
    assert not method.flush(info, grad).any()


def test_dgc_hands_its_velocity_over_and_starts_again(group):  # needs the sparse family
    method = gcomp.create("dgc", ratio=0.1, warmup_steps=0)
    info = BucketInfo.single(torch.zeros(100))
    grad = torch.randn(100, generator=torch.Generator().manual_seed(2))
    sent = _reduced(method, grad, info)
    torch.testing.assert_close(method.flush(info, grad) + sent, grad)  # momentum 0.9 of a first step: u = g, v = g
    assert not method.flush(info, grad).any()


# --- decisions ------------------------------------------------------------------------------------------------

class FakeLink:
    def __init__(self, *networks):
        self.networks, self.calls = list(networks), 0

    def __call__(self, group, device, bucket_bytes=0):
        self.calls += 1
        return self.networks[min(self.calls, len(self.networks)) - 1]


def _stats(auto) -> dict:
    keys = ("steps", "encode_s", "decode_s", "round_work_s", "rounds", "allreduce_calls", "allreduce_bytes",
            "allgather_calls", "allgather_bytes") + AUTO_KEYS
    return {k: 0.0 for k in keys}


# a 4 MB bucket: identity all-reduces it for free, topk all-gathers 2% of it for 5 ms of codec
FAKE = {"identity": {"encode_s": 0.0, "rounds": 1, "allreduce_calls": 1, "allreduce_bytes": 4 * MB},
        "topk:ratio=0.02": {"encode_s": 5e-3, "rounds": 1, "allgather_calls": 1, "allgather_bytes": 0.08 * MB}}


def _run_step(auto, stats, info, wait_s, fakes=FAKE) -> str:
    """One step of one bucket: the decisions at its start, then the candidate's fake measurements (``wait_s``:
    seconds, or seconds per spec)."""
    auto.step_started(None, torch.device("cpu"), stats)
    record = auto.record(info)
    index = auto.candidate_for(record)
    record.last = index  # as AutoMethod.reduce does
    spec = auto.specs[index]
    fake = fakes[spec]
    wait = wait_s[spec] if isinstance(wait_s, dict) else wait_s
    auto.after_bucket(info, None, torch.device("cpu"), stats)
    record.observe(index, fake, fake["encode_s"] + wait)
    auto.now += COMPUTE_S + fake["encode_s"] + wait  # the whole step: compute, then this one bucket
    return spec


COMPUTE_S = 2e-3


def _no_collectives(monkeypatch, link) -> None:
    """``link`` as the probe; the agreements pass this rank's values through (one fake rank speaks for all)."""
    monkeypatch.setattr(auto_chooser, "probe_network", link)
    monkeypatch.setattr(auto_chooser, "launch_max", lambda values, group, device: lambda: list(values))


def _small_bucket(topk_encode_s: float) -> dict:
    """identity all-reducing the 1.2 MB bucket of the bench's MLP, topk all-gathering 24 KB of it."""
    return {"identity": {"encode_s": 0.0, "rounds": 1, "allreduce_calls": 1, "allreduce_bytes": 1.2 * MB},
            "topk:ratio=0.02": {"encode_s": topk_encode_s, "rounds": 1, "allgather_calls": 1,
                                "allgather_bytes": 24e3}}


def _auto(allow, probe_every=10, trials=5, margin=0.1, reprobe_above=2.0):
    """``auto``'s chooser (its defaults) on 4 fake ranks, on a clock that the fake steps move; the specs are only
    labels here (no method is created)."""
    auto = AutoChooser(allow, probe_every, trials, margin, reprobe_above)
    auto.workers, auto.now = 4, 0.0
    auto.clock = lambda: auto.now
    return auto


def test_explores_then_picks_the_fastest_and_switches_when_the_link_drops(monkeypatch):
    link = FakeLink(Network.parse("100gbit"), Network.parse("100mbit"))
    _no_collectives(monkeypatch, link)
    auto = _auto(allow=list(FAKE), trials=2, probe_every=3, reprobe_above=1.0)
    stats = _stats(auto)
    info = BucketInfo.single(torch.zeros(MB))
    fast_wait = 1e-3
    ran = [_run_step(auto, stats, info, fast_wait) for _ in range(10)]
    assert ran[:4] == ["identity", "identity", "topk:ratio=0.02", "topk:ratio=0.02"]  # trials each, in order
    assert ran[4:] == ["identity"] * 6 and stats["auto_explore_steps"] == 4 and link.calls == 1
    # the link drops: identity's waits grow tenfold; the next check sees the drift, probes, and switches
    ran = [_run_step(auto, stats, info, 10 * fast_wait) for _ in range(7)]
    assert link.calls == 2 and stats["auto_switches"] == 1 and stats["auto_probes"] == 2
    assert ran[-1] == "topk:ratio=0.02" and auto.choices() == {info.key: "topk:ratio=0.02"}
    switches = [e for e in auto.events if "to" in e]
    assert switches == [{"step": 0, "bucket": 0, "from": "identity", "to": "topk:ratio=0.02"}]  # no hook: step 0
    assert [e["probe_bps"] for e in auto.events if "probe_bps" in e] == [1e11, 1e8]


def test_steady_waits_never_probe_again(monkeypatch):
    link = FakeLink(Network.parse("100gbit"))
    _no_collectives(monkeypatch, link)
    auto = _auto(allow=list(FAKE), trials=1, probe_every=2)
    stats = _stats(auto)
    info = BucketInfo.single(torch.zeros(MB))
    for _ in range(40):
        _run_step(auto, stats, info, 1e-3)
    assert link.calls == 1 and stats["auto_switches"] == 0


def test_a_layout_seen_after_the_decision_is_measured_again(monkeypatch):
    _no_collectives(monkeypatch, FakeLink(Network.parse("100gbit")))
    auto = _auto(allow=list(FAKE), trials=1)
    stats = _stats(auto)
    first, rebuilt = BucketInfo.single(torch.zeros(MB)), BucketInfo.single(torch.zeros(MB), name="other")
    for _ in range(3):
        _run_step(auto, stats, first, 1e-3)
    assert auto.decided
    _run_step(auto, stats, rebuilt, 1e-3)
    assert _run_step(auto, stats, rebuilt, 1e-3) == "identity" and not auto.decided  # exploring again
    assert _run_step(auto, stats, rebuilt, 1e-3) == "topk:ratio=0.02"
    assert auto.records[first.key].last is not None  # what it last ran there is still handed over


def test_layout_record_keeps_the_fastest_sample_after_the_first():
    record = LayoutRecord(BucketInfo.single(torch.zeros(4)), 2)
    for seconds in (9.0, 3.0, 4.0):
        record.observe(1, {"encode_s": seconds}, seconds)
    assert record.codec_s(1) == 3.0 and record.codec_s(0) == 0.0


def test_the_waits_measured_while_measuring_correct_the_price(monkeypatch):
    """Unshaped loopback as measured on 4 ranks on 2 cores: the probe saw 2.8 Gbit/s and 0.7 ms per message, so
    the formulas price topk's all-gather of 24 KB at about 2 ms and identity's 1.2 MB all-reduce at about 9 ms,
    but topk's buckets waited 13.4 ms (peers still encoding on shared cores) and identity's 11.5 ms: identity."""
    _no_collectives(monkeypatch, FakeLink(Network(2.8e9, 0.7e-3)))
    fakes = _small_bucket(topk_encode_s=3e-3)
    waits = {"identity": 11.5e-3, "topk:ratio=0.02": 13.4e-3}
    auto = _auto(allow=list(fakes), trials=2)
    stats = _stats(auto)
    info = BucketInfo.single(torch.zeros(MB // 4))
    ran = [_run_step(auto, stats, info, waits, fakes) for _ in range(5)]
    assert ran[-1] == "identity"
    costs = auto.records[info.key].costs
    assert costs[1].overhead_s > 0.01 and costs[0].overhead_s < 0.005
    without = {auto.specs[i]: gcomp.auto.BucketCost(c.codec_s, c.launched) for i, c in costs.items()}
    assert gcomp.auto.choose(without, 4, auto.network).method == "topk:ratio=0.02"  # the formulas alone


def test_whole_steps_measured_while_measuring_count_what_the_buckets_do_not_see(monkeypatch):
    """Both candidates' buckets take 10 ms from encode to result, but topk's steps last 6 ms longer (peers that
    encode late on shared cores hold the next step back): the steps decide, identity."""
    _no_collectives(monkeypatch, FakeLink(Network(1e10, 1e-4)))
    fakes = _small_bucket(topk_encode_s=2e-3)
    waits = {"identity": 10e-3, "topk:ratio=0.02": 8e-3}
    auto = _auto(allow=list(fakes), trials=3)
    stats = _stats(auto)
    info = BucketInfo.single(torch.zeros(MB // 4))
    for _ in range(7):
        spec = _run_step(auto, stats, info, waits, fakes)
        auto.now += 6e-3 if spec == "topk:ratio=0.02" else 0.0
    assert auto.choices() == {info.key: "identity"}
    predicted = [e["predicted_s"] for e in auto.events if "predicted_s" in e][0]
    assert predicted["topk:ratio=0.02"] - predicted["identity"] == pytest.approx(6e-3)
