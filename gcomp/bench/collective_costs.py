"""Moved: the alpha-beta cost of each collective is ``gcomp/link/costs.py`` and the rate parsing
``gcomp/link/rates.py`` (both exported by ``gcomp.link``). The names stay importable from here for one release;
new code, and every module of ``gcomp``, imports them from ``gcomp.link``."""
from gcomp.core import ALLREDUCE, COLLECTIVES, HIERARCHICAL, POINT_TO_POINT  # noqa: F401
from gcomp.link.costs import (DEFAULT_ALPHA_S, P2P_METHODS, Launched, Network, comm_time, gtopk_s,  # noqa: F401
                              hierarchical_s, launched_s, p2p_byte_share, p2p_depth, point_to_point_s,
                              ring_allgather_s, ring_allreduce_s, rounds, spardl_s, tree_broadcast_s)
from gcomp.link.rates import RATE_UNITS, bandwidth_label, parse_rate  # noqa: F401
