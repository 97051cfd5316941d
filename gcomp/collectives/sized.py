"""All-gather of payloads whose length differs from rank to rank: sizes first, then zero-padded payloads."""
from __future__ import annotations

import math
from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from gcomp.collectives.launch import all_gather_flat, count_collectives, count_round, launched, when_all_done
from gcomp.core import ALLGATHER, Communicator, Compressor, Payload


@dataclass
class SizedPayload(Payload):
    """A payload whose length is known on the device only (its length read on the device only): its tensors
    are buffers of a fixed capacity along their first dimension, of which the first ``length`` rows (a 0-d int64
    tensor on their device, never read by the codec) are the payload and the rest zero padding that decodes to
    nothing. ``nbytes`` is the capacity's; ``SizedAllgatherCommunicator`` sends, and counts, only the rows the
    longest rank needs."""

    length: torch.Tensor | None = None


class SizedCompressor(Compressor):
    """An all-gather codec whose tensors need not all be ``count`` rows long, ``count`` being the one length per
    rank the sizes round exchanges (threshold's coded positions: ``coded_bytes(n, count)`` bytes beside ``count``
    values). What ``SizedAllgatherCommunicator`` asks of it: ``rows``, ``finish``, and a ``decode`` that takes
    ``(gathered, counts)``: the gathered tensors, ``(world, widest rows of tensor j, ...)``, and every rank's
    ``count`` (host integers, from the sizes round), rank r's first ``rows(counts[r])[j]`` rows its own."""

    @abstractmethod
    def rows(self, ctx: Any, count: int) -> list[int]:
        """Rows along the first dimension of each tensor sent by a rank of length ``count``; the same function
        on every rank (it sizes the padding of everyone's tensors)."""

    def finish(self, payload: Payload, count: int) -> list[torch.Tensor]:
        """The tensors this rank sends, once its ``count`` is known on the host (after the sizes round: a device
        path's encode that needs it); each at least ``rows(count)`` rows, zeros past them. By default as given."""
        return payload.tensors


class SizedAllgatherCommunicator(Communicator):
    """Two rounds per bucket. First every rank's payload length (one int64 each) by all-gather, waited for
    here in ``exchange`` and read on the host (the padding depends on it: the bucket's one host synchronisation);
    then each payload tensor, zero-padded along its first dimension to the longest rank's rows of it (at least 1,
    so no collective is empty), by asynchronous all-gather into a ``(world, rows, ...)`` tensor.

    The codec (a ``SizedCompressor``) says each tensor's rows for a length (``rows``), may encode after the sizes
    round (``finish``), and decodes knowing every rank's length; it must read zero padding as adding nothing (a
    zero value at position 0 does). The future's value is ``(gathered tensors, lengths)``. No rows payloads.

    A ``SizedPayload`` (a device path) gives its length as a device tensor and is padded already: the first
    rows of each tensor go as they are. Bytes: the pipeline counted the payload's tensors; this adds what
    makes the bucket's ``bytes_sent`` what went, 8 bytes of size plus each tensor padded to its longest rows,
    and counts in ``stats["padding_bytes"]`` the size and the rows past this rank's own.
    """

    collective = ALLGATHER
    codec = SizedCompressor
    rows = False
    stat_keys = ("padding_bytes",)
    host_syncs = 1  # the lengths, read to pad

    def exchange(self, payload: Payload, compressor: SizedCompressor, group: dist.ProcessGroup | None,
                 stats: dict | None = None) -> torch.futures.Future:
        world = dist.get_world_size(group)
        first = payload.tensors[0]
        if isinstance(payload, SizedPayload):
            mine = payload.length.reshape(1).to(torch.int64)
        else:
            mine = torch.full((1,), first.shape[0], dtype=torch.int64, device=first.device)
        sizes = mine.new_empty(world)
        all_gather_flat(sizes, mine, group)  # synchronous: the widths are needed to pad
        count_collectives(stats, "allgather", [mine])
        count_round(stats)
        counts = sizes.tolist()  # the bucket's one host synchronisation
        own = counts[dist.get_rank(group)]
        tensors = compressor.finish(payload, own)
        widths = [max(1, max(r)) for r in zip(*(compressor.rows(payload.ctx, c) for c in counts))]
        outputs, futures, sent, content = [], [], 0, 0
        for t, width, own_rows in zip(tensors, widths, compressor.rows(payload.ctx, own)):
            part = t[:width]
            if part.shape[0] < width:  # zeros past this rank's rows
                part = torch.cat([part, t.new_zeros(width - part.shape[0], *t.shape[1:])])
            row_bytes = math.prod(t.shape[1:]) * t.element_size()
            sent, content = sent + width * row_bytes, content + own_rows * row_bytes
            out = t.new_empty(world * part.numel())  # gloo wants the flat form
            futures.append(launched(all_gather_flat(out, part.reshape(-1), group, async_op=True)))
            outputs.append(out.view(world, *part.shape))
            count_collectives(stats, "allgather", [part])
        count_round(stats)
        if stats is not None:
            size = mine.numel() * mine.element_size()
            stats["padding_bytes"] += size + sent - content
            stats["bytes_sent"] += size + sent - payload.nbytes  # the pipeline counted ``payload.nbytes``
        return when_all_done(futures, (outputs, counts))
