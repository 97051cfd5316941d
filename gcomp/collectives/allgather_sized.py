"""All-gather of payloads whose length differs from rank to rank: sizes first, then zero-padded payloads."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gcomp.collectives.counting import count_collectives, count_round
from gcomp.collectives.futures import launched, when_all_done
from gcomp.collectives.gather_flat import all_gather_flat
from gcomp.core import ALLGATHER, Communicator, Compressor, Payload


@dataclass
class SizedPayload(Payload):
    """A payload whose length is known on the device only (a codec's device path, ``gcomp.kernels``): its tensors
    are buffers of a fixed capacity along their first dimension, of which the first ``length`` rows (a 0-d int64
    tensor on their device, never read by the codec) are the payload and the rest zero padding that decodes to
    nothing. ``nbytes`` is the capacity's; ``SizedAllgatherCommunicator`` sends, and counts, only the rows the
    longest rank needs."""

    length: torch.Tensor | None = None


class SizedAllgatherCommunicator(Communicator):
    """Two rounds per bucket. First every rank's payload length (one int64 each) by all-gather, waited for
    here in ``exchange`` (the padding depends on it); then each payload tensor, zero-padded along its first
    dimension to the longest rank's length (at least 1, so no collective is empty), by asynchronous
    all-gather into a ``(world, longest, ...)`` tensor, which ``aggregate`` receives.

    All payload tensors of a rank share their first dimension. The codec must read zero padding as adding
    nothing (a zero value at position 0 does). The size round and the padding are sent too: their bytes are
    added to ``stats["bytes_sent"]`` and counted in ``stats["padding_bytes"]``.

    A ``SizedPayload`` (a device path) gives its length as a device tensor and is padded already: the sizes are
    read on the host once, after their all-gather (the one host synchronisation of the bucket), and the first
    longest-length rows of each tensor go as they are. The same bytes go and are counted as for a payload cut
    to its length.
    """

    collective = ALLGATHER
    stat_keys = ("padding_bytes",)
    host_syncs = 1  # the longest length, read to pad

    def exchange(self, payload: Payload, compressor: Compressor, group: dist.ProcessGroup | None,
                 stats: dict | None = None) -> torch.futures.Future:
        if isinstance(payload, SizedPayload):
            return self._exchange_sized(payload, group, stats)
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
            futures.append(launched(all_gather_flat(out, padded.view(-1), group, async_op=True)))
            outputs.append(out.view(world, *padded.shape))
            count_collectives(stats, "allgather", [padded])
        count_round(stats)
        if stats is not None:
            stats["padding_bytes"] += padding
            stats["bytes_sent"] += padding
        return when_all_done(futures, outputs)

    def _exchange_sized(self, payload: SizedPayload, group: dist.ProcessGroup | None,
                        stats: dict | None) -> torch.futures.Future:
        """``exchange`` of a payload whose length is a device tensor and whose tensors are padded buffers."""
        world = dist.get_world_size(group)
        tensors = payload.tensors
        mine = payload.length.reshape(1).to(torch.int64)
        sizes = mine.new_empty(world)
        all_gather_flat(sizes, mine, group)  # synchronous: the width is needed to cut
        count_collectives(stats, "allgather", [mine])
        count_round(stats)
        lengths = sizes.tolist()  # the bucket's one host synchronisation
        width, own = max(1, max(lengths)), lengths[dist.get_rank(group)]
        outputs, futures, row_bytes = [], [], 0
        for t in tensors:
            part = t[:width]
            if part.shape[0] < width:  # a capacity below the longest length: zeros past it
                part = torch.cat([part, t.new_zeros(width - part.shape[0], *t.shape[1:])])
            row_bytes += part[0].numel() * t.element_size()
            out = t.new_empty(world * part.numel())  # gloo wants the flat form
            futures.append(launched(all_gather_flat(out, part.reshape(-1), group, async_op=True)))
            outputs.append(out.view(world, *part.shape))
            count_collectives(stats, "allgather", [part])
        count_round(stats)
        if stats is not None:
            padding = mine.numel() * mine.element_size() + (width - own) * row_bytes
            stats["padding_bytes"] += padding
            # the pipeline counted the capacity (``payload.nbytes``): what went is this rank's rows and the padding
            stats["bytes_sent"] += padding + own * row_bytes - payload.nbytes
        return when_all_done(futures, outputs)
