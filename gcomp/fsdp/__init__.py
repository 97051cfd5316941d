"""gcomp under FSDP2 (``fully_shard``): the methods that can serve its reduce-scatter, installed by ``gcomp.install``.

- ``layout``: where each parameter lies in FSDP's flat, shard-major reduce-scatter input;
- ``codec``: the ``ShardedCodec`` interface and which methods have one (``fsdp_methods``; with the parameter
  sets that change the wire, ``fsdp_configs``);
- ``dense`` (identity, fp16, bf16), ``randomk``, ``spardl``, ``pactrain`` (+ ``support``): the codecs;
- ``comm``: the ``ReduceScatter`` put on each FSDP module; ``state``: ``FSDPState`` (stats, checkpoints);
- ``install``: ``install_fsdp``, which ``gcomp.install`` calls for an ``FSDPModule``;
- ``hsdp``: ``replicate``, the cross-replica all-reduce of HSDP through a gcomp method.
"""
from gcomp.fsdp.codec import fsdp_configs, fsdp_methods
from gcomp.fsdp.hsdp import ReplicaState, replicate
from gcomp.fsdp.install import install_fsdp
from gcomp.fsdp.state import FSDPState

__all__ = ["FSDPState", "ReplicaState", "fsdp_configs", "fsdp_methods", "install_fsdp", "replicate"]
