"""gcomp under FSDP2 (``fully_shard``): the methods that can serve its reduce-scatter, installed by ``gcomp.install``.

A method serves FSDP2 when its compressor meets FSDP's rows (``Traits.rows``): ``Method.reduce`` with a
``gcomp.sharding.ShardLayout``, the DDP hook's pipeline. Here:

- ``state``: ``FSDPState`` (a ``gcomp.run_state.RunState``) and the ``ReduceScatter`` put on each FSDP module;
- ``install``: ``install_fsdp``, which ``gcomp.install`` calls for an ``FSDPModule`` (once per model), and which
  methods serve FSDP2 (``fsdp_methods``; with the parameter sets that change the wire, ``fsdp_configs``);
- ``hsdp``: ``replicate``, the cross-replica all-reduce of HSDP through a gcomp method.
"""
from gcomp.fsdp.hsdp import ReplicaState, replicate
from gcomp.fsdp.install import fsdp_configs, fsdp_methods, install_fsdp
from gcomp.fsdp.state import FSDPState

__all__ = ["FSDPState", "ReplicaState", "fsdp_configs", "fsdp_methods", "install_fsdp", "replicate"]
