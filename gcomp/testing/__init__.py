"""gcomp.testing: check any compression method, a built-in one or another package's, against the eight
contracts every gcomp method keeps (docs/design.md, "The eight contracts the suite checks").

    import gcomp.testing
    report = gcomp.testing.check_method("mymethod", world_sizes=(1, 2, 3))   # raises ContractError on a failure
    print(report)                                                           # every (contract, configuration)

The parts, one idea per file: ``check`` (``check_method``), ``report`` (``Report``, ``Result``,
``ContractError``, ``CONTRACTS``), ``source`` (a method the worker processes can rebuild), ``ranks`` (gloo ranks
on 127.0.0.1, pooled), ``models`` (the small model trained), ``buckets`` (fake DDP buckets), ``tolerance``
(rounding bounds), ``reduce_jobs`` and ``train_jobs`` (the rank jobs), ``process_checks``, ``codec_checks`` and
``config_checks`` (the checks, one configuration or example at a time; gcomp's own test suite,
tests/test_contracts.py, runs them through pytest and hypothesis). Neither pytest nor hypothesis is needed here.
"""
from gcomp.testing.check import check_method
from gcomp.testing.ranks import close_pools, free_port, run_ranks, run_ranks_once
from gcomp.testing.report import CONTRACTS, ContractError, Report, Result, Skip
from gcomp.testing.source import MethodSource

__all__ = ["CONTRACTS", "ContractError", "MethodSource", "Report", "Result", "Skip", "check_method", "close_pools",
           "free_port", "run_ranks", "run_ranks_once"]
