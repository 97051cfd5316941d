"""gcomp under FSDP2 (``fully_shard``, docs/fsdp.md): ``state`` (``FSDPState`` and the reduce-scatter on each FSDP
module), ``install`` (``install_fsdp``, which ``gcomp.install`` calls, and the methods that serve FSDP2) and ``hsdp``
(``replicate``: HSDP's cross-replica all-reduce through a gcomp method)."""
from gcomp.fsdp.hsdp import ReplicaState, replicate
from gcomp.fsdp.install import fsdp_configs, fsdp_methods, install_fsdp
from gcomp.fsdp.state import FSDPState

__all__ = ["FSDPState", "ReplicaState", "fsdp_configs", "fsdp_methods", "install_fsdp", "replicate"]
