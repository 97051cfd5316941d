"""``auto``'s choice for one bucket, against a fake link and fake codec timings."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.auto import BucketCost, choose, link_network, predict_s
from gcomp.link import Launched, Network

MB = 1_000_000


def allreduce(nbytes: float, calls: int = 1, workers: int = 4) -> Launched:
    return Launched(workers, rounds=calls, allreduce_calls=calls, allreduce_bytes=nbytes, buckets=1)


def allgather(nbytes: float, workers: int = 4) -> Launched:
    return Launched(workers, rounds=1, allgather_calls=1, allgather_bytes=nbytes, buckets=1)


# a 4 MB fp32 bucket: identity sends it all for free; fp16 half of it for 1 ms of codec; topk 1% by all-gather
COSTS = {"identity": BucketCost(0.0, allreduce(4 * MB)),
         "fp16": BucketCost(1e-3, allreduce(2 * MB)),
         "topk:ratio=0.01": BucketCost(8e-3, allgather(0.08 * MB))}


def test_a_slow_link_picks_the_fewest_bytes_and_a_fast_one_the_cheapest_codec():
    slow, fast = Network.parse("100mbit"), Network.parse("100gbit")
    assert choose(COSTS, 4, slow).method == "topk:ratio=0.01"
    assert choose(COSTS, 4, fast).method == "identity"
    # in between, half the bytes for 1 ms of codec wins
    assert choose(COSTS, 4, Network.parse("10gbit")).method == "fp16"


def test_predictions_are_codec_time_plus_the_priced_collectives():
    network = Network(1e9, alpha_s=1e-4)
    got = choose(COSTS, 4, network).predicted_s
    # ring all-reduce of 2 MB on 4 ranks: 6 messages and 3/2 of the bytes at 8 ns a byte, plus 1 ms of codec
    assert got["fp16"] == pytest.approx(1e-3 + 6 * 1e-4 + 1.5 * 2 * MB * 8e-9)
    # ring all-gather of 80 kB: 3 messages, 3 times the bytes
    assert got["topk:ratio=0.01"] == pytest.approx(8e-3 + 3 * 1e-4 + 3 * 0.08 * MB * 8e-9)
    assert got == {name: predict_s(cost, 4, network) for name, cost in COSTS.items()}


def test_the_current_method_stays_unless_the_gain_beats_the_margin():
    network = Network.parse("10gbit")
    predicted = choose(COSTS, 4, network).predicted_s
    gain = 1 - predicted["fp16"] / predicted["identity"]
    kept = choose(COSTS, 4, network, current="identity", margin=gain + 0.01)
    assert kept.method == "identity" and not kept.switched
    moved = choose(COSTS, 4, network, current="identity", margin=gain - 0.01)
    assert moved.method == "fp16" and moved.switched
    assert not choose(COSTS, 4, network, current="fp16").switched


def test_a_drop_in_bandwidth_moves_the_choice():
    before = choose(COSTS, 4, Network.parse("100gbit"))
    after = choose(COSTS, 4, Network.parse("100mbit"), current=before.method)
    assert (before.method, after.method, after.switched) == ("identity", "topk:ratio=0.01", True)


def test_equal_predictions_go_to_the_earlier_candidate_on_every_rank():
    same = BucketCost(1e-3, allreduce(MB))
    assert choose({"b": same, "a": same}, 2, Network.parse("1gbit")).method == "b"


def test_bad_arguments_fail():
    with pytest.raises(ValueError, match="no candidate"):
        choose({}, 2, Network.parse("1gbit"))
    with pytest.raises(ValueError, match="margin"):
        choose(COSTS, 2, Network.parse("1gbit"), margin=1.0)
    with pytest.raises(ValueError, match="codec_s"):
        BucketCost(float("nan"), allreduce(MB))


def test_a_measured_link_reads_as_a_network():
    net = link_network(alpha_s=2e-4, beta_s=8e-8)
    assert net.alpha_s == 2e-4 and net.beta_s == pytest.approx(8e-8)
    assert link_network(alpha_s=1e-5, beta_s=0.0).bandwidth_bps == pytest.approx(1e12)


costs_strategy = st.dictionaries(
    st.sampled_from(["a", "b", "c", "d"]),
    st.builds(lambda codec, nbytes: BucketCost(codec, allreduce(nbytes)),
              st.floats(0, 1e-1), st.floats(0, 1e8)), min_size=1)


@settings(max_examples=200, deadline=None)
@given(costs_strategy, st.floats(1e6, 1e11), st.floats(0, 0.5), st.sampled_from(["a", "b", "c", "d", None]))
def test_the_choice_is_the_fastest_or_the_current_within_the_margin(costs, bandwidth, margin, current):
    network = Network(bandwidth, alpha_s=5e-5)
    choice = choose(costs, 4, network, current=current, margin=margin)
    predicted = choice.predicted_s
    fastest = min(predicted.values())
    if current in costs and choice.method == current:
        assert fastest >= (1 - margin) * predicted[current]
    else:
        assert predicted[choice.method] == fastest
    assert choice.switched == (current is not None and choice.method != current)  # off a method dropped too
