"""Rank jobs for tests/test_peer_failure.py: a peer that dies mid-training, for every registered method."""
from __future__ import annotations

import gc
import os
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

import gcomp
from tests.models import batch, mlp

DIE_AT = 3
STEPS = 6
GROUP_TIMEOUT_S = 3  # the bound on any wait: a survivor must fail by then, not hang


def _new_groups(before: set) -> list:
    return [g for g in distributed_c10d._world.pg_map if g not in before]


def _train_until_a_peer_dies(name: str, groups: list, rank: int, dying: int, die) -> dict:
    """``groups`` holds the group to train on, and its only reference: the dying rank drops it before it
    leaves, so that the group's connections close."""
    model = torch.nn.parallel.DistributedDataParallel(mlp(0), process_group=groups[0])
    state = gcomp.install(model, name)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = {"steps": 0, "error": None, "finite": True}
    for step in range(STEPS):
        if step == DIE_AT and rank == dying:
            del model, state, opt
            groups.clear()
            gc.collect()
            die()
            out["died"] = True
            return out
        x, y = batch(step, rank)
        try:
            torch.nn.functional.cross_entropy(model(x), y).backward()
        except Exception as err:  # noqa: BLE001 -- what the survivor saw is the result
            out["error"] = f"{type(err).__name__}: {err}"
            return out
        opt.step()
        opt.zero_grad()
        out["steps"] += 1
        out["finite"] &= all(bool(torch.isfinite(p).all()) for p in model.parameters())
    return out


def every_method_loses_a_peer(names: list[str]) -> dict:
    """For each method, on a fresh subgroup of every rank: the last rank leaves at step ``DIE_AT`` (it closes
    its connections, as a process that exits does); what each survivor saw."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for name in names:
        before = set(distributed_c10d._world.pg_map)
        groups = [dist.new_group(list(range(world)), timeout=timedelta(seconds=GROUP_TIMEOUT_S))]

        def leave():
            for g in _new_groups(before):  # the method's own subgroups too (hierarchical's nodes)
                dist.destroy_process_group(g)

        start = time.monotonic()
        results[name] = _train_until_a_peer_dies(name, groups, rank, world - 1, leave)
        groups.clear()
        results[name]["seconds"] = time.monotonic() - start
        gc.collect()
        for g in _new_groups(before):
            dist.destroy_process_group(g)
        dist.barrier()  # on the world group, which is intact: the next method starts together
    return results


def a_peer_process_exits(name: str) -> dict:
    """The last rank's process really exits at step ``DIE_AT`` (half a second after handing back its result)."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def exit_soon():
        threading.Timer(0.5, os._exit, args=(0,)).start()

    return _train_until_a_peer_dies(name, [None], rank, world - 1, exit_soon)
