"""Payloads seen rank by rank: all-gather (a DDP bucket) and all-to-all of rows (FSDP2's, and the first phase of
the two-phase codecs)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from gcomp.collectives.launch import all_gather_flat, count_collectives, count_round, launched, when_all_done
from gcomp.core import ALLGATHER, Communicator


def all_to_all_rows(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, stats: dict | None
                    ) -> list[torch.Tensor]:
    """Row r of every ``(N, ...)`` tensor to rank r; per tensor, the ``(N, ...)`` rows received (row s from rank s).
    Launched together and waited for: one round, counted as one all-gather of one row per tensor (the same N - 1
    messages of that size leave the rank as in a ring all-gather of it)."""
    received, works = [], []
    for t in tensors:
        out = torch.empty_like(t)
        works.append(dist.all_to_all_single(out, t.contiguous(), group=group, async_op=True))
        received.append(out)
    for work in works:
        work.wait()
    count_collectives(stats, "allgather", [t[0] for t in tensors])
    count_round(stats)
    return received


class AllgatherCommunicator(Communicator):
    """One asynchronous all-gather per payload tensor into ``(world, *shape)``; a rows payload (FSDP2) goes by
    all-to-all instead, rank r receiving row r of every rank's, and is waited for. Payload tensors have the same
    shape on every rank (gloo and NCCL need it); each rank receives ``world - 1`` payloads."""

    collective = ALLGATHER

    def exchange(self, payload, compressor, group, stats=None):
        if payload.rows:
            future = torch.futures.Future()
            future.set_result(all_to_all_rows(payload.tensors, group, stats))
            return future
        world = dist.get_world_size(group)
        outputs, futures = [], []
        for t in payload.tensors:
            out = t.new_empty(world * t.numel())  # gloo wants the flat form
            futures.append(launched(all_gather_flat(out, t.reshape(-1), group, async_op=True)))
            outputs.append(out.view(world, *t.shape))
        count_collectives(stats, "allgather", payload.tensors)
        count_round(stats)
        return when_all_done(futures, outputs)
