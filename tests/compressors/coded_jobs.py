"""Rank jobs of tests/compressors/test_coded_wire.py: sparse methods run on fake buckets through their own
pipeline (``Method.reduce``), wire variants side by side."""
from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist

import gcomp
from gcomp.bucket import BucketInfo


def wire_job(cases: list[tuple[str, dict, str]], numel: int, steps: int) -> list[dict]:
    """For each ``(method, params, dtype)``: ``steps`` random buckets of ``numel`` entries (the same on every case
    of a rank), each divided by the world size as the hook does. Returns per case this rank's stats, its results,
    whether every rank got the same results, the conservation gap: the largest entry of |sum of results +
    every rank's residual - sum of every rank's inputs / world|, and (threshold) every rank's count per step,
    ``(world, steps)``, as its codec chose them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    found = []
    for name, params, dtype_name in cases:
        dtype = getattr(torch, dtype_name)
        info = BucketInfo.from_layout(0, dtype, ["w"], [numel])
        method = gcomp.create(name, **params)
        stats = defaultdict(int)
        method.bind(None, None, stats)
        counts = []
        if name == "threshold":  # its count per step, which sizes its wire
            encode = method.compressor.encode

            def recording(x, state, layout, encode=encode, counts=counts):
                payload, state = encode(x, state, layout)
                counts.append(int(payload.length))
                return payload, state
            method.compressor.encode = recording
        results, given = [], torch.zeros(numel, dtype=torch.float64)
        for step in range(steps):
            g = torch.randn(numel, generator=torch.Generator().manual_seed(1000 * step + rank), dtype=dtype)
            given += g.double() / world
            results.append(method.reduce(g / world, info, None, stats).wait().clone())
        held = method.flush(info, g)
        balance = held.double().reshape(-1) - given
        dist.all_reduce(balance)  # every rank's residual less every rank's input
        gap = (torch.stack(results).double().sum(0) + balance).abs().max().item()
        mine = torch.stack(results)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        ks = torch.tensor(counts, dtype=torch.int64)
        every_ks = [torch.empty_like(ks) for _ in range(world)]
        dist.all_gather(every_ks, ks)
        found.append({"bytes": stats["bytes_sent"], "messages": stats["messages"], "results": mine,
                      "same": all(torch.equal(t, mine) for t in every), "gap": gap, "counts": torch.stack(every_ks)})
    return found
