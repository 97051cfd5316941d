"""All-gather of payloads whose length differs from rank to rank: sizes first, then zero-padded payloads."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp.collectives.counting import count_collectives, count_round
from gcomp.collectives.futures import launched, when_all_done
from gcomp.collectives.gather_flat import all_gather_flat
from gcomp.core import ALLGATHER, Communicator, Compressor, Payload


class SizedAllgatherCommunicator(Communicator):
    """Two rounds per bucket. First every rank's payload length (one int64 each) by all-gather, waited for
    here in ``exchange`` (the padding depends on it); then each payload tensor, zero-padded along its first
    dimension to the longest rank's length (at least 1, so no collective is empty), by asynchronous
    all-gather into a ``(world, longest, ...)`` tensor, which ``aggregate`` receives.

    All payload tensors of a rank share their first dimension. The codec must read zero padding as adding
    nothing (a zero value at position 0 does). The size round and the padding are sent too: their bytes are
    added to ``stats["bytes_sent"]`` and counted in ``stats["padding_bytes"]``.
    """

    collective = ALLGATHER
    stat_keys = ("padding_bytes",)
    host_syncs = 1  # the longest length, read to pad

    def exchange(self, payload: Payload, compressor: Compressor, group: dist.ProcessGroup | None,
                 stats: dict | None = None) -> torch.futures.Future:
        world = dist.get_world_size(group)
        tensors = payload.tensors
        length = tensors[0].shape[0]
        mine = torch.full((1,), length, dtype=torch.int64, device=tensors[0].device)
        sizes = mine.new_empty(world)
        all_gather_flat(sizes, mine, group)  # synchronous: the width is needed to pad
        count_collectives(stats, "allgather", [mine])
        count_round(stats)
        width = max(1, int(sizes.max()))
        outputs, futures, padding = [], [], mine.numel() * mine.element_size()
        for t in tensors:
            padded = t.new_zeros(width, *t.shape[1:])
            padded[:length] = t
            padding += (padded.numel() - t.numel()) * t.element_size()
            out = t.new_empty(world * padded.numel())  # gloo wants the flat form
            futures.append(launched(all_gather_flat(out, padded, group, async_op=True)))
            outputs.append(out.view(world, *padded.shape))
            count_collectives(stats, "allgather", [padded])
        count_round(stats)
        if stats is not None:
            stats["padding_bytes"] += padding
            stats["bytes_sent"] += padding
        return when_all_done(futures, outputs)
