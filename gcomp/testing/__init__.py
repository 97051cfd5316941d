"""gcomp.testing: check any compression method, a built-in one or another package's, against the contracts every
gcomp method keeps (``CONTRACTS``; docs/add-a-method.md), on gloo ranks of this machine::

    report = gcomp.testing.check_method("mymethod", world_sizes=(1, 2, 3))   # raises ContractError on a failure

gcomp's own suites (tests/test_contracts.py, tests/fsdp/test_contracts.py) run the same jobs and checks through
pytest; neither pytest nor hypothesis is needed here."""
from gcomp.testing.check import check_method
from gcomp.testing.ranks import close_pools, free_port, run_ranks, run_ranks_once
from gcomp.testing.report import CONTRACTS, ContractError, Report, Result, Skip
from gcomp.testing.source import MethodSource

__all__ = ["CONTRACTS", "ContractError", "MethodSource", "Report", "Result", "Skip", "check_method", "close_pools",
           "free_port", "run_ranks", "run_ranks_once"]
