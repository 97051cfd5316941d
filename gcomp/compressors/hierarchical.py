"""``hierarchical``: dense reduction inside each node, any other method between the nodes' leaders, broadcast back."""
from __future__ import annotations

import copy
import warnings
from typing import Annotated

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.collectives.futures import launched, when_done
from gcomp.core import HIERARCHICAL, Communicator, Compressor, Method, Payload, check_state
from gcomp.memory import NoMemory
from gcomp.params import Range
from gcomp.registry import Nested, from_spec, register
from gcomp.topology import Topology


class HierarchicalCompressor(Compressor):
    """Holds the inner method and the topology; the bucket itself is sent whole inside the node.

    On the wire, per bucket: a SUM all-reduce of the whole bucket on the intra-node group; on each node's
    leader, the inner method's payload across the leaders' group (counted in ``bytes_sent`` and, apart, in
    ``inter_bytes``; ``inter_bytes_dense`` counts what a dense all-reduce of the bucket would have sent there);
    then a broadcast of the result from the leader on the intra-node group. Followers send nothing across nodes.

    ``inner`` (the method run between leaders), ``intra`` (this rank's node group) and ``inter`` (the leaders'
    group, None on a follower) are what ``HierarchicalCommunicator`` reads; ``bind`` sets the groups.
    """

    collective = HIERARCHICAL
    decodes_alone = False  # the inner method sees node sums, not each rank's payload
    label = "hierarchical"  # the method's name in messages

    def __init__(self, inner: Method, ranks_per_node: int):
        self.inner, self.ranks_per_node = inner, ranks_per_node
        self.stateful = inner.stateful
        self.reads_model = inner.compressor.reads_model
        self.lossless = inner.compressor.lossless
        self.stat_keys = tuple(k for k in inner.stat_keys if k not in HierarchicalCommunicator.stat_keys)
        self.intra: dist.ProcessGroup | None = None
        self.inter: dist.ProcessGroup | None = None

    def watch(self, ddp) -> None:
        self.inner.compressor.watch(ddp)

    def bind(self, model, group, stats) -> None:
        world = dist.get_world_size(group)
        topology = (Topology.regular(world, self.ranks_per_node) if self.ranks_per_node
                    else Topology.discover(group))
        if len(topology.nodes) == 1:
            warnings.warn(f"{self.label}: all {world} ranks are on one node, so the inner method runs on a "
                          "one-rank group of leaders and compresses nothing; set ranks_per_node to split them, or "
                          f"install the inner method ({self.inner.name}) itself", UserWarning, stacklevel=3)
        self.intra, self.inter = topology.groups(group)
        if self.inter is not None:
            self.inner.compressor.bind(model, self.inter, stats)

    def __deepcopy__(self, memo):  # process groups are handles: a copy shares them, and copies the rest
        clone = copy.copy(self)
        memo[id(self)] = clone
        for name, value in vars(self).items():
            if name not in ("intra", "inter"):
                setattr(clone, name, copy.deepcopy(value, memo))
        return clone

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Payload:
        return Payload([tensor], bucket)

    def decompress(self, tensors, ctx) -> torch.Tensor:
        return tensors[0]

    def state_dict(self) -> dict:
        return {"memory": self.inner.memory.state_dict(), "compressor": self.inner.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"memory": dict, "compressor": dict})
        self.inner.memory.load_state_dict(state["memory"])
        self.inner.compressor.load_state_dict(state["compressor"])

    @property
    def replicated(self) -> bool:
        return self.inner.memory.replicated and self.inner.compressor.replicated

    def parameter_state(self, state: dict) -> dict:
        return {**self.inner.memory.parameter_state(state["memory"]),
                **self.inner.compressor.parameter_state(state["compressor"])}


class HierarchicalCommunicator(Communicator):
    """Intra-node SUM (waited: the leader compresses the node's sum), the inner method on the leaders through
    ``Method.reduce``, the hook's own pipeline (waited: the broadcast sends its result; its encode and decode
    time count in ``encode_s`` and ``decode_s``), then an asynchronous intra-node broadcast, whose future is
    returned. Needs the hook's ``stats``.

    On leaders only, ``inter_bytes`` counts what the inner method sends between nodes and ``inter_bytes_dense``
    what a dense all-reduce of the same buckets, in their own dtype, would have sent: their quotient is the
    inter-node compression ratio."""

    collective = HIERARCHICAL
    stat_keys = ("inter_bytes", "inter_bytes_dense")

    def exchange(self, payload: Payload, compressor: HierarchicalCompressor, group: dist.ProcessGroup | None,
                 stats: dict | None = None) -> torch.futures.Future:
        if stats is None:
            raise ValueError("hierarchical: the inner method's statistics need the hook's stats dict")
        buffer, bucket = payload.tensors[0], payload.ctx
        dist.all_reduce(buffer, group=compressor.intra)
        if compressor.inter is not None:
            before = stats["bytes_sent"]
            buffer.copy_(compressor.inner.reduce(buffer, bucket, compressor.inter, stats).wait())
            stats["inter_bytes"] += stats["bytes_sent"] - before
            stats["inter_bytes_dense"] += buffer.numel() * buffer.element_size()
        source = dist.get_global_rank(compressor.intra, 0)
        work = dist.broadcast(buffer, src=source, group=compressor.intra, async_op=True)
        return when_done(launched(work), [buffer])


@register("hierarchical", paper="leader-follower reduction as in PruneX (Olama et al., arXiv 2512.14628)")
def hierarchical(
    inner: Annotated[str, Nested(), "method run between the nodes' leaders (not a hierarchical one)"] = "identity",
    ranks_per_node: Annotated[int, Range(0, None), "ranks per node; 0: from torchrun or host names"] = 0,
) -> Method:
    """Dense SUM inside each node, the ``inner`` method (``"topk:ratio=0.05"``, or a ``Method`` from
    ``gcomp.create``) between node leaders only, then a broadcast inside each node: only leaders cross the
    (slow) network between nodes."""
    try:
        method = from_spec(inner)
    except ValueError as err:
        raise ValueError(f"hierarchical: parameter 'inner': {err}") from None
    if method.communicator.collective == HIERARCHICAL:
        raise ValueError(f"hierarchical: parameter 'inner' cannot be a hierarchical method itself; got {inner!r}")
    return Method(HierarchicalCompressor(method, ranks_per_node), NoMemory(), HierarchicalCommunicator())
