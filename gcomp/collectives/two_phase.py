"""Two-phase reduction of encoded chunks (``fp8``, ``mx``): an all-to-all of each destination's chunk, the owner's
local sum and re-encode (the codec's ``second_phase``), an all-gather of the owners' encoded sums."""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from gcomp.collectives.counting import count_collectives, count_round, round_work
from gcomp.collectives.futures import launched, when_all_done
from gcomp.collectives.gather_flat import all_gather_flat
from gcomp.core import ALLGATHER, Communicator, Compressor, Payload


def all_to_all_rows(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup | None, stats: dict | None
                    ) -> list[torch.Tensor]:
    """Row r of every ``(N, m)`` tensor to rank r; returns, per tensor, the ``(N, m)`` rows received (row s from
    rank s). Launched together and waited for: one round. Counted as one all-gather per tensor of one row's bytes
    (``gcomp.collectives.counting``): the same N - 1 messages of that size leave the rank as in a ring all-gather
    of it, so the cost model and ``auto`` price it right."""
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


class TwoPhaseCommunicator(Communicator):
    """Phase one: the payload's tensors, each ``(N, m)`` (row r: the encoded chunk rank r owns), by
    ``all_to_all_single``, waited for in ``exchange`` (never inside a ``.then`` callback, which deadlocks gloo
    with several buckets); the codec's ``second_phase(received, ctx)`` then decodes, sums and re-encodes this
    rank's chunk (timed as ``round_work_s``). Phase two: those tensors (``(1, m)`` each) by asynchronous
    all-gather into ``(N, m)``, which ``aggregate`` decodes.

    Bytes, by the project's convention (a collective's input as this rank hands it over): the payload, all N
    chunks (``Method.reduce`` counts it, as a reduce-scatter's whole input is counted), plus the one re-encoded
    chunk handed to the all-gather, added here: ``(N + 1) * chunk_bytes`` per bucket; of these, ``2 (N - 1)``
    chunks leave the rank. Both phases are counted as all-gathers of one chunk (``allgather_calls``,
    ``allgather_bytes``: ``all_to_all_rows``), two rounds."""

    collective = ALLGATHER

    def exchange(self, payload: Payload, compressor: Compressor, group: dist.ProcessGroup | None,
                 stats: dict | None = None) -> torch.futures.Future:
        world = dist.get_world_size(group)
        received = all_to_all_rows(payload.tensors, group, stats)
        with round_work(stats):
            mine = [t.reshape(-1).contiguous() for t in compressor.second_phase(received, payload.ctx)]
        outputs, futures = [], []
        for t in mine:
            out = t.new_empty(world * t.numel())  # gloo wants the flat form
            futures.append(launched(all_gather_flat(out, t, group, async_op=True)))
            outputs.append(out.view(world, t.numel()))
        count_collectives(stats, "allgather", mine)
        count_round(stats)
        if stats is not None:
            stats["bytes_sent"] += sum(t.numel() * t.element_size() for t in mine)
        return when_all_done(futures, outputs)

    def decode(self, received: list[torch.Tensor], compressor: Compressor, ctx: Any) -> torch.Tensor:
        return compressor.aggregate(received, ctx)
