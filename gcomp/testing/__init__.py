"""gcomp.testing: check any compression method, a built-in one or another package's, against the contracts every
gcomp method keeps (``CONTRACTS``; docs/add-a-method.md).

    import gcomp.testing
    report = gcomp.testing.check_method("mymethod", world_sizes=(1, 2, 3))   # raises ContractError on a failure
    print(report)                                                           # every (contract, configuration)

``check`` (``check_method``), ``report`` (``Report``, ``Result``, ``ContractError``, ``CONTRACTS``), ``source`` (a
method the worker processes rebuild), ``ranks`` (gloo ranks on 127.0.0.1, pooled), ``models`` and ``buckets`` (what
the jobs train and reduce), ``fidelity`` (the error models and rounding bounds), the rank jobs (``reduce_jobs``,
``train_jobs``, ``fsdp_jobs``) and the checks (``process_checks``, ``codec_checks``, ``config_checks``; gcomp's
own suites, tests/test_contracts.py and tests/fsdp/test_contracts.py, run them through pytest). Neither pytest nor
hypothesis is needed here.
"""
from gcomp.testing.check import check_method
from gcomp.testing.ranks import close_pools, free_port, run_ranks, run_ranks_once
from gcomp.testing.report import CONTRACTS, ContractError, Report, Result, Skip
from gcomp.testing.source import MethodSource

__all__ = ["CONTRACTS", "ContractError", "MethodSource", "Report", "Result", "Skip", "check_method", "close_pools",
           "free_port", "run_ranks", "run_ranks_once"]
