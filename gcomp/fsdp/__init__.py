"""gcomp under FSDP2 (``fully_shard``): the methods that can serve its reduce-scatter, installed by ``gcomp.install``.

A method serves FSDP2 through the row strategy it declares at registration (``gcomp.sharding``): its own memory
and compressor, run by ``Method.reduce_scatter``. Here:

- ``methods``: which methods have one (``fsdp_methods``; with the parameter sets that change the wire,
  ``fsdp_configs``), and the check at install;
- ``comm``: the ``ReduceScatter`` put on each FSDP module; ``state``: ``FSDPState`` (a ``gcomp.run_state.RunState``);
- ``install``: ``install_fsdp``, which ``gcomp.install`` calls for an ``FSDPModule`` (once per model);
- ``hsdp``: ``replicate``, the cross-replica all-reduce of HSDP through a gcomp method.
"""
from gcomp.fsdp.hsdp import ReplicaState, replicate
from gcomp.fsdp.install import install_fsdp
from gcomp.fsdp.methods import fsdp_configs, fsdp_methods
from gcomp.fsdp.state import FSDPState

__all__ = ["FSDPState", "ReplicaState", "fsdp_configs", "fsdp_methods", "install_fsdp", "replicate"]
