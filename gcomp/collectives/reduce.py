"""Payloads that add up on the wire: all-reduce (a DDP bucket), reduce-scatter (FSDP2's rows), and the chained
codecs whose second round is computed from the first one's sum."""
from __future__ import annotations

from abc import abstractmethod

import torch
import torch.distributed as dist

from gcomp.collectives.launch import add, count_collectives, count_round, launched, round_work
from gcomp.core import ALLREDUCE, Communicator, Compressor, Payload

REDUCE_SCATTER_KEYS = ("reduce_scatter_calls", "reduce_scatter_bytes")


def all_reduce_all(payload: Payload, group: dist.ProcessGroup | None, start: int = 0,
                   stats: dict | None = None, indices=None) -> torch.futures.Future:
    """Asynchronous in-place all-reduce of ``payload.tensors[start:]`` (or those at ``indices``), each with its op;
    a future of their list. Counted as one round of that many all-reduces."""
    indices = range(start, len(payload.tensors)) if indices is None else indices
    chosen = [payload.tensors[i] for i in indices]
    futures = [launched(dist.all_reduce(payload.tensors[i], payload.op(i), group=group, async_op=True))
               for i in indices]
    count_collectives(stats, "allreduce", chosen)
    count_round(stats)
    if len(futures) == 1:
        return futures[0]  # its value is already the one-element list [result]
    return torch.futures.collect_all(futures).then(lambda f: [x.value()[0] for x in f.value()])


def reduce_scatter_sum(output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup | None,
                       stats: dict | None = None) -> torch.Tensor:
    """Into ``output`` the SUM over ranks of this rank's row of the flat ``input`` (``world`` rows); waited for.

    gloo's own reduce-scatter runs an all-reduce and keeps a slice (4 ranks, 40 MB input on loopback: 60 MB sent per
    rank against 30 MB for an all-to-all), so on gloo it is one ``all_to_all_single`` and a local sum in rank order:
    (world - 1) / world of the input leaves the rank, as in an ideal reduce-scatter. Elsewhere the backend's own."""
    world = dist.get_world_size(group)
    if input.numel() != output.numel() * world:
        raise ValueError(f"reduce-scatter: an input of {input.numel()} entries does not split into {world} rows of "
                         f"{output.numel()}")
    add(stats, "reduce_scatter_calls", 1)
    add(stats, "reduce_scatter_bytes", input.numel() * input.element_size())
    count_round(stats)
    if dist.get_backend(group) != "gloo":
        native = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor  # torch <= 2.12
        native(output, input, group=group)
        return output
    received = torch.empty_like(input)
    dist.all_to_all_single(received, input.contiguous(), group=group)
    torch.sum(received.view(world, -1), dim=0, out=output.view(-1))
    return output


class AllreduceCommunicator(Communicator):
    """One asynchronous in-place all-reduce per payload tensor (SUM unless ``payload.ops`` says MAX). A rows payload
    (FSDP2) is reduce-scattered row by row instead, its ``whole`` tensors all-reduced whole, and waited for."""

    collective = ALLREDUCE

    def exchange(self, payload, compressor, group, stats=None):
        if payload.rows:
            return _done(self.rows_of(payload, range(len(payload.tensors)), group, stats))
        return all_reduce_all(payload, group, stats=stats)

    @staticmethod
    def rows_of(payload: Payload, indices, group, stats) -> list[torch.Tensor | None]:
        """``payload.tensors[i]`` for ``i`` in ``indices``: this rank's reduced row, or the whole tensor reduced
        (``payload.whole``); None elsewhere. Waited for."""
        received: list[torch.Tensor | None] = [None] * len(payload.tensors)
        whole = [i for i in indices if i in payload.whole]
        pending = all_reduce_all(payload, group, stats=stats, indices=whole) if whole else None
        for i in indices:
            if i not in payload.whole:
                rows = payload.tensors[i]
                received[i] = reduce_scatter_sum(rows.new_empty(rows.shape[1:]), rows.reshape(-1), group, stats)
        if pending is not None:
            for i, value in zip(whole, pending.wait()):
                received[i] = value
        return received


class ChainedCompressor(Compressor):
    """An all-reduce codec whose payload may take two rounds: ``tensors[0]`` all-reduced first (MAX of shared
    scales, SUM of PowerSGD's P), waited for; then ``second_round`` fills ``tensors[1:]`` from it, and those are
    all-reduced. ``encode`` makes the second round's tensors at their final size (``bytes_sent`` counts them);
    ``decode`` receives ``[first round's result, *second round's]``."""

    def chained(self, payload: Payload) -> bool:
        """Whether this payload takes the two rounds (by default: whenever it has more than one tensor)."""
        return len(payload.tensors) > 1

    @abstractmethod
    def second_round(self, payload: Payload) -> None:
        """With ``payload.tensors[0]`` holding its reduction over ranks: fill ``payload.tensors[1:]`` (in place, or
        by tensors of the same size)."""


class ChainedAllreduceCommunicator(AllreduceCommunicator):
    """The first all-reduce runs, and is waited for, inside ``exchange`` (never inside a ``.then`` callback, which
    deadlocks gloo with several buckets); then ``second_round``, and the rest all-reduced (rows: reduce-scattered)."""

    codec = ChainedCompressor

    def exchange(self, payload, compressor: ChainedCompressor, group, stats=None):
        if not compressor.chained(payload):
            return super().exchange(payload, compressor, group, stats)
        first = payload.tensors[0]
        dist.all_reduce(first, payload.op(0), group=group)
        count_collectives(stats, "allreduce", [first])
        count_round(stats)
        with round_work(stats):
            compressor.second_round(payload)
        if payload.rows:
            rest = self.rows_of(payload, range(1, len(payload.tensors)), group, stats)
            return _done([first, *rest[1:]])
        return all_reduce_all(payload, group, start=1, stats=stats).then(lambda f: [first, *f.value()])


def _done(value) -> torch.futures.Future:
    future = torch.futures.Future()
    future.set_result(value)
    return future
