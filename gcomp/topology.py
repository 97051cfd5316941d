"""Which ranks of a process group share a node, and the intra-node and leaders' groups built from that."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """``nodes[i]`` lists the ranks (in the hook's process group) of node i, its leader first."""

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def regular(cls, world: int, ranks_per_node: int) -> "Topology":
        """Consecutive ranks in nodes of ``ranks_per_node`` (one machine can play several nodes this way)."""
        if ranks_per_node < 1 or world % ranks_per_node:
            raise ValueError(f"parameter 'ranks_per_node' must divide the number of workers ({world}); "
                             f"got {ranks_per_node!r}")
        return cls(tuple(tuple(range(s, s + ranks_per_node)) for s in range(0, world, ranks_per_node)))

    @classmethod
    def discover(cls, group: dist.ProcessGroup | None = None) -> "Topology":
        """Nodes from torchrun's GROUP_RANK where it is set, else from host names, exchanged over ``group``."""
        key = os.environ.get("GROUP_RANK") if "LOCAL_WORLD_SIZE" in os.environ else None
        keys: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(keys, key if key is not None else socket.gethostname(), group=group)
        nodes: dict = {}
        for rank, k in enumerate(keys):
            nodes.setdefault(k, []).append(rank)
        sizes = sorted({len(v) for v in nodes.values()})
        if len(sizes) > 1:
            raise ValueError(f"nodes of unequal size ({', '.join(f'{k}: {len(v)}' for k, v in nodes.items())}): "
                             "hierarchical methods need the same number of ranks on every node; "
                             "pass 'ranks_per_node' to choose the nodes yourself")
        return cls(tuple(tuple(v) for v in nodes.values()))

    @property
    def leaders(self) -> tuple[int, ...]:
        return tuple(node[0] for node in self.nodes)

    def node_of(self, rank: int) -> int:
        for i, node in enumerate(self.nodes):
            if rank in node:
                return i
        raise ValueError(f"rank {rank} is on no node of {self.nodes}")

    def groups(self, group: dist.ProcessGroup | None = None
               ) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
        """``(this rank's intra-node group, the leaders' group or None on a follower)``; a collective (``new_group``
        for every node and the leaders, on every rank of ``group``)."""
        def global_ranks(ranks):
            return [r if group is None else dist.get_global_rank(group, r) for r in ranks]

        me = dist.get_rank(group)
        timeout = group_timeout(group)  # a dead peer must fail the subgroups as soon as it fails ``group``
        key = (tuple(global_ranks(range(dist.get_world_size(group)))), self.nodes, timeout)
        cached = _made.get(key)
        if cached is not None and all(_alive(g) for g in cached):
            return cached  # every rank installs alike, so every rank takes this branch alike
        intra = None
        for node in self.nodes:
            made = dist.new_group(global_ranks(node), timeout=timeout)
            if me in node:
                intra = made
        inter = dist.new_group(global_ranks(self.leaders), timeout=timeout)
        _made[key] = (intra, inter if me in self.leaders else None)
        return _made[key]


# Node groups made so far, by (parent group's ranks, nodes, timeout): an install again reuses them rather than make
# new ones, each with threads of its own that would stay for the life of the process.
_made: dict[tuple, tuple] = {}


def _alive(group: dist.ProcessGroup | None) -> bool:
    """False for a group destroyed since it was made (``destroy_process_group``), or of a world since ended."""
    if group is None:
        return True
    try:
        dist.get_process_group_ranks(group)
    except (KeyError, RuntimeError, ValueError):
        return False
    return True


def group_timeout(group: dist.ProcessGroup | None = None) -> timedelta | None:
    """The timeout ``group``'s collectives run under (the default group's for None), or None where its backend
    does not say (then subgroups take torch's default)."""
    group = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (AttributeError, RuntimeError, ValueError):
            continue
    return None
