"""The alpha-beta cost of each collective (``gcomp.link.costs``) against costs worked out by hand: the formulas
``gcomp simulate`` and ``auto`` price with."""
from __future__ import annotations

import pytest

from gcomp.core import COLLECTIVES
from gcomp.link import Launched, Network, bandwidth_label, comm_time, launched_s

ALPHA = 50e-6
MBIT100 = Network(1e8, ALPHA)  # beta = 8 / 1e8 = 8e-8 s/byte
GBIT = Network(1e9, ALPHA)  # beta = 8 / 1e9 = 8e-9 s/byte
INTRA = Network(1e10, 5e-6)  # beta = 8 / 1e10 = 8e-10 s/byte


def test_collective_names_are_gcomps():
    assert COLLECTIVES == ("allreduce", "allgather", "point-to-point", "hierarchical")


def test_ring_allreduce():
    # 2*3/4 * 1e6 * 8e-8 + 2*3 * 50e-6 = 1.5 * 0.08 + 0.0003 = 0.12 + 0.0003
    assert comm_time("allreduce", 1e6, 4, MBIT100) == pytest.approx(0.1203)
    assert comm_time("allreduce", 1e6, 1, MBIT100) == 0.0


def test_ring_allgather():
    # 3 * 1e6 * 8e-9 + 3 * 50e-6 = 0.024 + 0.00015
    assert comm_time("allgather", 1e6, 4, GBIT) == pytest.approx(0.02415)
    assert comm_time("allgather", 1e6, 1, GBIT) == 0.0


def test_spardl():
    # 2*7/8 * 1e6 * 8e-9 + 2*ceil(log2 8) * 50e-6 = 0.014 + 6 * 50e-6 = 0.014 + 0.0003
    assert comm_time("point-to-point", 1e6, 8, GBIT, method="spardl") == pytest.approx(0.0143)
    assert comm_time("point-to-point", 1e6, 1, GBIT, method="spardl") == 0.0


def test_gtopk():
    # ceil(log2 5) = 3 rounds up and 3 down: 6 * (1e5 * 8e-9 + 50e-6) = 6 * 8.5e-4
    assert comm_time("point-to-point", 1e5, 5, GBIT, method="gtopk") == pytest.approx(5.1e-3)
    assert comm_time("point-to-point", 1e5, 1, GBIT, method="gtopk") == 0.0


def test_hierarchical_two_nodes_of_two():
    # intra all-reduce (G=2): 2*1/2 * 1e6 * 8e-10 + 2*1 * 5e-6  = 8e-4 + 1e-5  = 8.1e-4
    # inner all-reduce (M=2): 2*1/2 * 1e5 * 8e-9  + 2*1 * 50e-6 = 8e-4 + 1e-4  = 9e-4
    # intra broadcast: ceil(log2 2) = 1 * (1e6 * 8e-10 + 5e-6)   = 8e-4 + 5e-6  = 8.05e-4
    got = comm_time("hierarchical", 1e5, 4, GBIT, ranks_per_node=2, intra=INTRA, dense_bytes=1e6)
    assert got == pytest.approx(8.1e-4 + 9e-4 + 8.05e-4)


def test_hierarchical_edge_cases():
    # Without an intra network the inter-node link is used inside the nodes too:
    # 2 * (8e-3 + 1e-4) [dense all-reduce over G=2 and the inner one over M=2, both 1e6 B at 1 Gbit/s] + 8e-3 + 5e-5
    got = comm_time("hierarchical", 1e6, 4, GBIT, ranks_per_node=2, dense_bytes=1e6)
    assert got == pytest.approx(2 * (8e-3 + 1e-4) + 8e-3 + 5e-5)
    # One rank per node: no intra stage, only the inner all-reduce over the 4 leaders.
    flat = comm_time("hierarchical", 1e6, 4, MBIT100, dense_bytes=1e6)
    assert flat == pytest.approx(comm_time("allreduce", 1e6, 4, MBIT100))
    # A point-to-point inner collective across the 2 leaders: 2*1/2 * 1e5 * 8e-9 + 2*1 * 50e-6 = 8e-4 + 1e-4.
    inner_spardl = comm_time("hierarchical", 1e5, 2, GBIT, method="spardl", dense_bytes=1e6, inner="point-to-point")
    assert inner_spardl == pytest.approx(9e-4)
    assert comm_time("hierarchical", 1e5, 1, GBIT, dense_bytes=1e6) == 0.0
    with pytest.raises(ValueError, match="dense_bytes"):
        comm_time("hierarchical", 1e5, 4, GBIT, ranks_per_node=2)
    with pytest.raises(ValueError, match="multiple of ranks_per_node"):
        comm_time("hierarchical", 1e5, 6, GBIT, ranks_per_node=4, dense_bytes=1e6)


@pytest.mark.parametrize("text, bps", [("100mbit", 1e8), ("1gbit", 1e9), ("100gbit", 1e11), ("10Gbit", 1e10),
                                       (" 2.5GBIT ", 2.5e9), ("500kbit", 5e5)])
def test_network_parse(text, bps):
    network = Network.parse(text, alpha_s=1e-6)
    assert network == Network(bps, 1e-6)
    assert network.beta_s == pytest.approx(8 / bps)


@pytest.mark.parametrize("text", ["", "1g", "100mb", "1gbps", "fast", "-1gbit", "0gbit", "1e9", "gbit", None])
def test_network_parse_rejects(text):
    with pytest.raises(ValueError):
        Network.parse(text)


def test_network_rejects_bad_numbers_and_labels_round_trip():
    with pytest.raises(ValueError):
        Network(0.0)
    with pytest.raises(ValueError):
        Network(1e9, alpha_s=-1.0)
    for text in ("100mbit", "1gbit", "10gbit", "100gbit", "2.5gbit"):
        assert bandwidth_label(Network.parse(text).bandwidth_bps) == text


def test_comm_time_errors():
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        comm_time("broadcast", 1e6, 4, GBIT)
    with pytest.raises(ValueError, match="unknown method 'topk'"):
        comm_time("point-to-point", 1e6, 4, GBIT, method="topk")
    for workers in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="workers"):
            comm_time("allreduce", 1e6, workers, GBIT)
    with pytest.raises(ValueError, match="nbytes"):
        comm_time("allreduce", -1.0, 4, GBIT)


def test_launched_prices_every_counted_collective():
    launched = Launched(4, rounds=3, allreduce_calls=2, allreduce_bytes=1e6, allgather_calls=1,
                        allgather_bytes=1e4)
    # all-reduces: 2 * 2*3 * 50e-6 = 6e-4 and 1e6 * 2*3/4 * 8e-8 = 0.12;
    # all-gather: 1 * 3 * 50e-6 = 1.5e-4 and 1e4 * 3 * 8e-8 = 2.4e-3
    assert launched_s(launched, 4, MBIT100) == pytest.approx(6e-4 + 0.12 + 1.5e-4 + 2.4e-3)
    # at 8 workers the same counts: 2 * 14 * 50e-6 + 1e6 * 14/8 * 8e-8 + 7 * 50e-6 + 1e4 * 7 * 8e-8
    assert launched_s(launched, 8, MBIT100) == pytest.approx(1.4e-3 + 0.14 + 3.5e-4 + 5.6e-3)
    assert launched_s(launched, 1, MBIT100) == 0.0


def test_launched_point_to_point_scales_its_schedule():
    launched = Launched(4, rounds=4, p2p_rounds=4, p2p_bytes=1e5)
    # as measured: 4 rounds of 50e-6 and 1e5 bytes of 8e-8
    assert launched_s(launched, 4, MBIT100, "spardl") == pytest.approx(2e-4 + 8e-3)
    # SparDL at 16: rounds 4 * (2*4)/(2*2) = 8; bytes 1e5 * (2*15/16) / (2*3/4) = 1.25e5
    assert launched_s(launched, 16, MBIT100, "spardl") == pytest.approx(8 * 50e-6 + 1.25e5 * 8e-8)
    # gTop-k's root: bytes scale with the rounds too, 1e5 * 8/4
    assert launched_s(launched, 16, MBIT100, "gtopk") == pytest.approx(8 * 50e-6 + 2e5 * 8e-8)
