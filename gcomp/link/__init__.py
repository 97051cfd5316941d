"""The link model ``auto`` and ``gcomp bench`` share: a collective's alpha-beta cost and a link's rate as text
(``costs``), and the timed probe of ``alpha`` and ``beta`` (``probe``); it imports only ``gcomp.core`` and torch."""
from gcomp.link.costs import (DEFAULT_ALPHA_S, P2P_METHODS, RATE_FORMS, RATE_UNITS, Launched, Network, bandwidth_label,
                              comm_time, gtopk_s, hierarchical_s, launched_s, p2p_byte_share, p2p_depth, parse_rate,
                              point_to_point_s, ring_allgather_s, ring_allreduce_s, rounds, spardl_s,
                              tree_broadcast_s)
from gcomp.link.probe import PROBE_LARGE_BYTES, PROBE_SMALL_BYTES, link_from_timings, timed_allreduce_s

__all__ = ["DEFAULT_ALPHA_S", "Launched", "Network", "P2P_METHODS", "PROBE_LARGE_BYTES", "PROBE_SMALL_BYTES",
           "RATE_FORMS", "RATE_UNITS", "bandwidth_label", "comm_time", "gtopk_s", "hierarchical_s", "launched_s",
           "link_from_timings", "p2p_byte_share", "p2p_depth", "parse_rate", "point_to_point_s", "ring_allgather_s",
           "ring_allreduce_s", "rounds", "spardl_s", "timed_allreduce_s", "tree_broadcast_s"]
