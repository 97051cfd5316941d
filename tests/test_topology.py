"""``gcomp.topology``: nodes of consecutive ranks (``ranks_per_node``), node discovery from torchrun's environment
and host names, and its errors."""
from __future__ import annotations

import pytest
import torch.distributed as dist

from gcomp.topology import Topology
from tests.distributed import run_ranks


def test_ranks_per_node_must_divide_the_workers():
    with pytest.raises(ValueError, match="'ranks_per_node' must divide the number of workers \\(6\\); got 4"):
        Topology.regular(6, 4)
    assert Topology.regular(6, 3).nodes == ((0, 1, 2), (3, 4, 5))
    assert Topology.regular(6, 3).leaders == (0, 3)
    assert Topology.regular(6, 3).node_of(4) == 1


def discover_job(local: str) -> tuple:
    import os
    if local == "torchrun":
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        os.environ["GROUP_RANK"] = str(dist.get_rank() // 2)
    elif local == "unequal":
        os.environ["LOCAL_WORLD_SIZE"] = "2"
        os.environ["GROUP_RANK"] = "0" if dist.get_rank() == 0 else "1"
    try:
        return Topology.discover().nodes
    except ValueError as err:
        return ("error", str(err))
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        os.environ.pop("GROUP_RANK", None)


def test_nodes_are_discovered_from_torchrun_or_host_names():
    assert run_ranks(4, discover_job, "torchrun") == [((0, 1), (2, 3))] * 4
    assert run_ranks(4, discover_job, "hosts") == [((0, 1, 2, 3),)] * 4  # one machine: one node
    for r in run_ranks(3, discover_job, "unequal"):
        assert r[0] == "error" and "unequal size" in r[1] and "'ranks_per_node'" in r[1], r


def subgroup_timeout_job() -> list:
    from datetime import timedelta

    from gcomp.topology import group_timeout
    group = dist.new_group([0, 1, 2, 3], timeout=timedelta(seconds=7))
    intra, inter = Topology.regular(4, 2).groups(group)
    made = [intra] + ([inter] if inter is not None else [])
    out = [group_timeout(g).total_seconds() for g in made]
    for g in made + [group]:
        dist.destroy_process_group(g)
    return out


def test_node_groups_fail_as_soon_as_the_parent_group_would():
    """The intra-node and leaders' groups take the parent group's timeout, not torch's 30-minute default: a
    dead peer must end a hierarchical step within the process group's timeout."""
    for rank, timeouts in enumerate(run_ranks(4, subgroup_timeout_job)):
        assert timeouts == ([7.0, 7.0] if rank % 2 == 0 else [7.0]), (rank, timeouts)


def reuse_job() -> list:
    first = Topology.regular(4, 2).groups()
    again = Topology.regular(4, 2).groups()
    for g in {g for g in first if g is not None}:
        dist.destroy_process_group(g)
    fresh = Topology.regular(4, 2).groups()  # the old ones are gone: made anew, on every rank alike
    out = [all(a is b for a, b in zip(first, again)), all(a is not b for a, b in zip(first, fresh) if a)]
    for g in {g for g in fresh if g is not None}:
        dist.destroy_process_group(g)
    return out


def test_a_second_install_reuses_the_node_groups():
    """Each process group keeps threads for the life of the process: installing a hierarchical hook again (a
    new DDP model, a resumed run) must not make new ones, unless the old ones were destroyed."""
    assert run_ranks(4, reuse_job) == [[True, True]] * 4
