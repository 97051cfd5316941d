"""``hierarchical``: dense reduction inside each node, any other method between the nodes' leaders, broadcast back."""
from __future__ import annotations

import copy
import warnings
from typing import Annotated

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.collectives.futures import launched, when_done
from gcomp.composite import Composite
from gcomp.core import HIERARCHICAL
from gcomp.method import MethodUnit
from gcomp.params import Range
from gcomp.registry import Nested, from_spec, register
from gcomp.topology import Topology

INTER_KEYS = ("inter_bytes", "inter_bytes_dense")


class HierarchicalMethod(Composite):
    """A method made of another: on the wire, per bucket, a SUM all-reduce of the whole bucket on the intra-node
    group (waited for: the leader sends the node's sum); on each node's leader, the ``inner`` method's own
    reduction across the leaders' group (its ``reduce``, waited for: its encode and decode time count in
    ``encode_s`` and ``decode_s``, its bytes in ``bytes_sent`` and, apart, in ``inter_bytes``;
    ``inter_bytes_dense`` counts what a dense all-reduce of the bucket would have sent there); then an
    asynchronous broadcast of the result from the leader on the intra-node group, whose future is returned.
    Followers send nothing across nodes.

    ``intra`` (this rank's node group) and ``inter`` (the leaders' group, None on a follower) are set by
    ``bind``; ``label`` is the method's name in messages (``prunex`` is one of these)."""

    collective = HIERARCHICAL
    decodes_alone = False  # the inner method sees node sums, not each rank's payload

    def __init__(self, inner: MethodUnit, ranks_per_node: int, label: str = "hierarchical"):
        self.inner, self.ranks_per_node, self.label = inner, ranks_per_node, label
        self.name, self.params = label, {}
        self.intra: dist.ProcessGroup | None = None
        self.inter: dist.ProcessGroup | None = None

    @property
    def parts(self) -> list[MethodUnit]:
        return [self.inner]

    @property
    def stat_keys(self) -> tuple[str, ...]:
        return tuple(k for k in self.inner.stat_keys if k not in INTER_KEYS) + INTER_KEYS

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
            self.inner.bind(model, self.inter, stats)

    def reduce(self, buffer: torch.Tensor, bucket: BucketInfo, group, stats: dict) -> torch.futures.Future:
        stats["bytes_sent"] += buffer.numel() * buffer.element_size()  # the whole bucket, inside the node
        dist.all_reduce(buffer, group=self.intra)
        if self.inter is not None:
            before = stats["bytes_sent"]
            buffer.copy_(self.inner.reduce(buffer, bucket, self.inter, stats).wait())
            stats["inter_bytes"] += stats["bytes_sent"] - before
            stats["inter_bytes_dense"] += buffer.numel() * buffer.element_size()
        source = dist.get_global_rank(self.intra, 0)
        work = dist.broadcast(buffer, src=source, group=self.intra, async_op=True)
        return when_done(launched(work), buffer)

    def flush(self, bucket, like):
        return self.inner.flush(bucket, like) if self.inter is not None else None

    def __deepcopy__(self, memo):  # process groups are handles: a copy shares them, and copies the rest
        clone = copy.copy(self)
        memo[id(self)] = clone
        for name, value in vars(self).items():
            if name not in ("intra", "inter"):
                setattr(clone, name, copy.deepcopy(value, memo))
        return clone

    # checkpoints: the inner method's state, as it is (``Composite``)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def parameter_state(self, state: dict) -> dict:
        return self.inner.parameter_state(state)

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        if self.keeps_state:
            raise ValueError(f"{self.label}: its inner method's state lives on the node leaders, which another number "
                             "of ranks regroups")
        return {}


@register("hierarchical", paper="leader-follower reduction as in PruneX (Olama et al., arXiv 2512.14628)")
def hierarchical(
    inner: Annotated[str, Nested(), "method run between the nodes' leaders (not a hierarchical one)"] = "identity",
    ranks_per_node: Annotated[int, Range(0, None), "ranks per node; 0: from torchrun or host names"] = 0,
) -> HierarchicalMethod:
    """Dense SUM inside each node, the ``inner`` method (``"topk:ratio=0.05"``, or a ``Method`` from
    ``gcomp.create``) between node leaders only, then a broadcast inside each node: only leaders cross the
    (slow) network between nodes."""
    try:
        method = from_spec(inner)
    except ValueError as err:
        raise ValueError(f"hierarchical: parameter 'inner': {err}") from None
    if method.collective == HIERARCHICAL:
        raise ValueError(f"hierarchical: parameter 'inner' cannot be a hierarchical method itself; got {inner!r}")
    return HierarchicalMethod(method, ranks_per_node)
