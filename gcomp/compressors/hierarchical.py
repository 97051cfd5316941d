"""``hierarchical``: dense reduction inside each node, any other method between the nodes' leaders, broadcast back."""
from __future__ import annotations

import copy
from typing import Annotated, Any

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.core import Communicator, Compressor, Method, Payload
from gcomp.memory import NoMemory
from gcomp.params import Range
from gcomp.registry import create, register
from gcomp.topology import Topology

HIERARCHICAL = "hierarchical"


class HierarchicalCompressor(Compressor):
    """Holds the inner method and the topology; the bucket itself is sent whole inside the node.

    On the wire, per bucket: a SUM all-reduce of the whole bucket on the intra-node group; on each node's
    leader, the inner method's payload across the leaders' group (counted in ``bytes_sent`` and, apart, in
    ``inter_bytes``); then a broadcast of the result from the leader on the intra-node group. Followers
    send nothing across nodes.
    """

    collective = HIERARCHICAL
    decodes_alone = False  # the inner method sees node sums, not each rank's payload

    def __init__(self, inner: Method, ranks_per_node: int):
        self.inner, self.ranks_per_node = inner, ranks_per_node
        self.stateful = inner.stateful
        self.lossless = inner.compressor.lossless
        self.stat_keys = ("inter_bytes",) + tuple(k for k in inner.compressor.stat_keys if k != "inter_bytes")
        self.stats: dict = {}
        self.intra = self.inter = None
        self.leader_rank = 0  # the node leader's rank in the intra-node group

    def bind(self, model, group, stats) -> None:
        self.stats = stats
        world = dist.get_world_size(group)
        topology = (Topology.regular(world, self.ranks_per_node) if self.ranks_per_node
                    else Topology.discover(group))
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
        self.inner.memory.load_state_dict(state["memory"])
        self.inner.compressor.load_state_dict(state["compressor"])


class HierarchicalCommunicator(Communicator):
    """Intra-node SUM (waited: the leader compresses the node's sum), the inner method on the leaders (waited:
    the broadcast sends its result), then an asynchronous intra-node broadcast, whose future is returned."""

    collective = HIERARCHICAL

    def exchange(self, payload: Payload, compressor: HierarchicalCompressor, group) -> torch.futures.Future:
        buffer, bucket = payload.tensors[0], payload.ctx
        dist.all_reduce(buffer, group=compressor.intra)
        if compressor.inter is not None:
            inner, stats = compressor.inner, compressor.stats
            before = stats.get("bytes_sent", 0)
            compensated = inner.memory.compensate(buffer, bucket)
            sent = inner.compressor.compress(compensated, bucket)
            inner.memory.update(compensated, bucket, inner.compressor, sent)
            received = inner.communicator.exchange(sent, inner.compressor, compressor.inter).wait()
            buffer.copy_(inner.communicator.decode(received, inner.compressor, sent.ctx))
            if stats:
                stats["bytes_sent"] += sent.nbytes
                stats["inter_bytes"] += stats["bytes_sent"] - before
        source = dist.get_global_rank(compressor.intra, 0)
        work = dist.broadcast(buffer, src=source, group=compressor.intra, async_op=True)
        return work.get_future().then(lambda _: [buffer])

    def decode(self, received: list[torch.Tensor], compressor: Compressor, ctx: Any) -> torch.Tensor:
        return received[0]


@register("hierarchical", paper="leader-follower reduction as in PruneX (Olama et al., arXiv 2512.14628)")
def hierarchical(inner: Annotated[str, None, "method run between the nodes' leaders"] = "identity",
                 ranks_per_node: Annotated[int, Range(0, None), "ranks per node; 0: from torchrun or host names"] = 0
                 ) -> Method:
    """Dense SUM inside each node, the ``inner`` method (by name, its defaults) between node leaders only, then
    a broadcast inside each node: only leaders cross the (slow) network between nodes."""
    if inner == "hierarchical":
        raise ValueError("hierarchical: parameter 'inner' cannot be 'hierarchical' itself")
    try:
        method = create(inner)
    except ValueError as err:
        raise ValueError(f"hierarchical: parameter 'inner' must name a registered method; got {inner!r} ({err})"
                         ) from err
    return Method(HierarchicalCompressor(method, ranks_per_node), NoMemory(), HierarchicalCommunicator())
