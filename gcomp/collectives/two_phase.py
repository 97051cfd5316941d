"""Two-phase reduction of encoded chunks (``fp8``, ``mx``): an all-to-all of each destination's chunk, the owner's
local sum and re-encode (the codec's ``second_phase``), an all-gather of the owners' encoded sums."""
from __future__ import annotations

from abc import abstractmethod
from typing import Any, Sequence

import torch

from gcomp.collectives.gather import AllgatherCommunicator, all_to_all_rows
from gcomp.collectives.launch import all_gather_flat, count_collectives, count_round, launched, round_work, \
    when_all_done
from gcomp.core import Compressor


class TwoPhaseCompressor(Compressor):
    """An all-gather codec whose payload is one encoded chunk per destination, ``(N, m)`` tensors: rank r owns
    chunk r. ``second_phase`` decodes, sums and re-encodes what this rank received; ``decode`` takes every owner's
    re-encoded sum, stacked. Under FSDP2 (a rows payload) the first phase alone is the reduce-scatter: ``decode``
    then takes the chunks this rank received and returns their sum."""

    @abstractmethod
    def second_phase(self, received: Sequence[torch.Tensor], ctx: Any) -> list[torch.Tensor]:
        """This rank's encoded sum, from the ``(N, m)`` chunks it received (row s from rank s)."""


class TwoPhaseCommunicator(AllgatherCommunicator):
    """Phase one: the payload's ``(N, m)`` tensors by ``all_to_all_single``, waited for in ``exchange``; the codec's
    ``second_phase`` (timed as ``round_work_s``). Phase two: its tensors by asynchronous all-gather into
    ``(N, m)``. A rows payload (FSDP2) takes phase one only.

    Bytes, by the project's convention (a collective's input as this rank hands it over): the payload, all N
    chunks, plus the re-encoded chunk handed to the all-gather, added here: ``(N + 1)`` chunks per bucket, of which
    ``2 (N - 1)`` leave the rank. Both phases count as all-gathers of one chunk, two rounds."""

    codec = TwoPhaseCompressor

    def exchange(self, payload, compressor: TwoPhaseCompressor, group, stats=None):
        if payload.rows:
            return super().exchange(payload, compressor, group, stats)
        world = torch.distributed.get_world_size(group)
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
