"""The link model that ``auto`` and ``gcomp bench`` share: what a collective costs on a link of ``alpha`` seconds
per message and ``beta`` seconds per byte, and a link's rate as text (``costs``), and the timed probe that measures
``alpha`` and ``beta`` on a process group (``probe``).

It imports only ``gcomp.core`` and torch: nothing of the methods, the hook, ``auto`` or the benchmark
(``tests/test_layout.py`` checks that).
"""
from gcomp.link.costs import (DEFAULT_ALPHA_S, P2P_METHODS, RATE_FORMS, RATE_UNITS, Launched, Network, bandwidth_label,
                              comm_time, gtopk_s, hierarchical_s, launched_s, p2p_byte_share, p2p_depth, parse_rate,
                              point_to_point_s, ring_allgather_s, ring_allreduce_s, rounds, spardl_s,
                              tree_broadcast_s)
from gcomp.link.probe import PROBE_LARGE_BYTES, PROBE_SMALL_BYTES, link_from_timings, timed_allreduce_s

__all__ = ["DEFAULT_ALPHA_S", "Launched", "Network", "P2P_METHODS", "PROBE_LARGE_BYTES", "PROBE_SMALL_BYTES",
           "RATE_FORMS", "RATE_UNITS", "bandwidth_label", "comm_time", "gtopk_s", "hierarchical_s", "launched_s",
           "link_from_timings", "p2p_byte_share", "p2p_depth", "parse_rate", "point_to_point_s", "ring_allgather_s",
           "ring_allreduce_s", "rounds", "spardl_s", "timed_allreduce_s", "tree_broadcast_s"]
