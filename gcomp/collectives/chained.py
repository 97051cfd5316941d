"""Two chained all-reduces for codecs whose second payload depends on the first one's result."""
from __future__ import annotations

from abc import abstractmethod
import torch
import torch.distributed as dist

from gcomp.collectives.allreduce import AllreduceCommunicator, all_reduce_all
from gcomp.collectives.counting import count_collectives, count_round, round_work
from gcomp.core import ALLREDUCE, Compressor, Payload


class ChainedCompressor(Compressor):
    """An all-reduce codec whose payload may take two rounds: ``tensors[0]`` is all-reduced first with
    ``payload.op(0)`` (MAX of the scales every rank must share, for the shared-scale quantisers; SUM of P, for
    PowerSGD), then ``second_round`` fills ``tensors[1:]`` from that result, and those are all-reduced.

    ``compress`` returns the second round's tensors already at their final size (so ``bytes_sent`` counts
    them); ``decompress`` receives ``[first round's result, *second round's results]``. A payload for which
    ``chained`` is false (a codec's other modes) is all-reduced in one round, each tensor with its op.
    """

    collective = ALLREDUCE

    def chained(self, payload: Payload) -> bool:
        """Whether this payload takes the two rounds (by default: whenever it has more than one tensor)."""
        return len(payload.tensors) > 1

    @abstractmethod
    def second_round(self, payload: Payload) -> None:
        """Called between the rounds, ``payload.tensors[0]`` holding its reduction over ranks: fill
        ``payload.tensors[1:]`` (in place, or by replacing them with tensors of the same size)."""


class ChainedAllreduceCommunicator(AllreduceCommunicator):
    """The first all-reduce runs, and is waited for, in ``exchange`` itself (before the hook returns: never
    inside a ``.then`` callback, which deadlocks gloo with several buckets); then ``second_round`` and the
    asynchronous all-reduce of the rest, whose future is returned."""

    def exchange(self, payload: Payload, compressor: ChainedCompressor, group: dist.ProcessGroup | None,
                 stats: dict | None = None) -> torch.futures.Future:
        if not compressor.chained(payload):
            return all_reduce_all(payload, group, stats=stats)
        first = payload.tensors[0]
        dist.all_reduce(first, payload.op(0), group=group)
        count_collectives(stats, "allreduce", [first])
        count_round(stats)
        with round_work(stats):
            compressor.second_round(payload)
        return all_reduce_all(payload, group, start=1, stats=stats).then(lambda f: [first, *f.value()])
