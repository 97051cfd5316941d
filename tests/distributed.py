"""The rank runner the tests share: ``gcomp.testing.ranks`` (gloo ranks on 127.0.0.1, pooled per world size),
re-exported here under the name the tests import it by."""
from gcomp.testing.ranks import COLLECTIVE_TIMEOUT_S, RankPool, close_pools, free_port, run_ranks, run_ranks_once

__all__ = ["COLLECTIVE_TIMEOUT_S", "RankPool", "close_pools", "free_port", "run_ranks", "run_ranks_once"]
