"""HSDP through gcomp (docs/fsdp.md): native HSDP (``fully_shard`` on a 2-D mesh) all-reduces across replicas before
any hook, so gcomp's is built from its parts: shard on the shard dimension only, install, then ``replicate`` hooks
every FSDP module (``set_all_reduce_hook``) to average its reduced shard over the replicate group through a method.
"""
from __future__ import annotations

from functools import partial
from typing import Union

import torch
import torch.distributed as dist

from gcomp.fsdp.state import FSDPState
from gcomp.method import MethodUnit
from gcomp.registry import method_from
from gcomp.run_state import RunState


class ReplicaState(RunState):
    """The cross-replica all-reduce of an HSDP run: on the wire, what the method sends for the reduced shard as one
    bucket, per FSDP module and step, over the replicate group (``buckets`` counts shard reductions)."""

    kind = "hsdp"

    def __init__(self, shard_state: FSDPState, group: dist.ProcessGroup, method: MethodUnit):
        if method.reads_model:
            raise ValueError(f"{method.name} reads the model's masks by DDP's bucket layout and cannot reduce a "
                             "shard across replicas; pick a method that does not (identity, fp16, bf16, topk, ...)")
        super().__init__(method, group)
        self.shard_state = shard_state
        for comm in shard_state.comms:
            layout = comm.static_layout
            self._numels.update(zip(layout.own.names, layout.own.numels))
        self.join(None)

    def reduce(self, comm, shard: torch.Tensor) -> None:
        """Average ``shard`` (FSDP's reduced shard of ``comm``'s module, in place) over the replicas."""
        self.count_step_of_backward()
        info = comm.layout.own
        self.stats["buckets"] += 1
        self.stats["bytes_dense"] += shard.numel() * shard.element_size()
        flat = shard.view(-1)
        flat.div_(self.world_size)  # the sum over replicas is then the mean, as DDP's hook does it
        result = self.method.reduce(flat, info, self.group, self.stats).wait()
        if result.data_ptr() != flat.data_ptr():
            flat.copy_(result.reshape(-1))


def replicate(state: FSDPState, group: dist.ProcessGroup, name_or_method: Union[str, MethodUnit],
              **params) -> ReplicaState:
    """Average every FSDP module's reduced shard over ``group`` (the replicate dimension) through a gcomp method;
    returns its state. ``state`` is the shard method's (``gcomp.install`` on a model sharded on one dimension)."""
    if getattr(state, "replica", None) is not None:
        raise RuntimeError("a replica method is already installed on this model")
    replica = ReplicaState(state, group, method_from(name_or_method, params))
    for comm in state.comms:
        comm.module.set_all_reduce_hook(partial(replica.reduce, comm))
    state.replica = replica
    return replica
