"""``RowStrategy``: how a method lays its payload out for FSDP2's reduce-scatter, and ``exchange_rows``, the one
exchange every strategy's payload goes through unless the method runs a schedule of its own.

``Method.reduce_scatter`` runs the pipeline (``gcomp.method``); the strategy supplies its three steps, each
calling the method's own compressor: ``compress`` (the compensated input to a payload of rows), ``exchange`` and
``decode`` (this rank's reduced row into its output shard). A method declares its strategy when it is
registered (``gcomp.register(name, fsdp=...)``); ``gcomp.available(fsdp=True)`` lists those that have one.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.distributed as dist

from gcomp.collectives.allreduce import all_reduce_all
from gcomp.collectives.chained import ChainedCompressor
from gcomp.collectives.counting import count_collectives, count_round, round_work
from gcomp.collectives.reduce_scatter import reduce_scatter_sum
from gcomp.core import Compressor, Payload
from gcomp.sharding.layout import ShardLayout


class RowStrategy(ABC):
    """How one method serves FSDP2's reduce-scatter: FSDP's flat, shard-major input (``ShardLayout``: row r is what
    shard r receives) becomes a payload whose tensors are rows, ``(world, m)``, row r for destination r
    (``Payload.whole`` names the tensors all-reduced whole instead: flags, scales), reduce-scattered, and this
    rank's reduced row is decoded into its output shard. What goes on the wire: the strategy's docstring.

    ``variants``: parameter sets of the method that put something else on the wire under FSDP2 (``fsdp_configs``
    lists them, so the FSDP contract suite runs each).

    Checkpoints: ``FSDPState`` binds the strategy to the model's parameters (``bind_sizes``), which tells
    ``gcomp.checkpoint`` that the method's state is laid out by the shards. ``reshards``: a checkpoint of the
    method resumes on another number of shards: true when it keeps nothing laid out by the shards but
    per-parameter state keyed ``"<parameter>[<shard>]"`` (``layout.pieces``: residuals), which is re-sharded by
    parameter (``gcomp.sharding.resize``). Otherwise such a resize is refused on every rank, saying that the
    method keeps ``shard_state``.
    """

    variants: ClassVar[tuple[dict, ...]] = ()
    reshards: ClassVar[bool] = False
    shard_state: ClassVar[str] = "state laid out by the shards of its reduce-scatter input"
    sizes: dict[str, torch.Size] | None = None  # bound under FSDP2: each sharded parameter's unsharded size

    def bind_sizes(self, sizes: dict[str, torch.Size]) -> None:
        """The unsharded size of every parameter the method's FSDP2 state covers, by name (``FSDPState``, once)."""
        self.sizes = dict(sizes)

    def check(self, method) -> None:
        """Raise ValueError, at install, for a configuration of ``method`` (the ``gcomp.Method`` being installed)
        this strategy cannot serve."""

    @abstractmethod
    def compress(self, compressor: Compressor, tensor: torch.Tensor, layout: ShardLayout) -> Payload:
        """The payload of the compensated input ``tensor`` (flat, ``layout.numel`` entries), as rows."""

    def exchange(self, payload: Payload, compressor: Compressor, layout: ShardLayout, group: dist.ProcessGroup,
                 stats: dict) -> list[torch.Tensor]:
        """What this rank receives, one tensor per payload tensor (``exchange_rows``); waited for."""
        return exchange_rows(payload, compressor, group, stats)

    @abstractmethod
    def decode(self, compressor: Compressor, received: list[torch.Tensor], payload: Payload, layout: ShardLayout,
               output: torch.Tensor) -> None:
        """Write this rank's reduced row, decoded, into ``output`` (its shard, flat)."""


def exchange_rows(payload: Payload, compressor: Compressor, group: dist.ProcessGroup, stats: dict
                  ) -> list[torch.Tensor]:
    """Every row tensor SUM reduce-scattered (``gcomp.collectives.reduce_scatter``: rank r receives the sum of row
    r), every ``whole`` tensor all-reduced with its op; a chained codec's two-round payload (``ChainedCompressor``)
    first all-reduces its first tensor, waited for, then fills the rest with ``second_round``, as DDP's chained
    communicator does. Returns, per payload tensor, this rank's reduced row or the reduced whole tensor; waits
    for all (FSDP reads the output when its reduce-scatter call returns). Bytes on the wire are counted by the
    pipeline (``Payload.nbytes``); calls and rounds here."""
    received: list[torch.Tensor | None] = [None] * len(payload.tensors)
    start = 0
    if isinstance(compressor, ChainedCompressor) and compressor.chained(payload):
        first = received[0] = payload.tensors[0]
        dist.all_reduce(first, payload.op(0), group=group)
        count_collectives(stats, "allreduce", [first])
        count_round(stats)
        with round_work(stats):
            compressor.second_round(payload)
        start = 1
    whole = [i for i in range(start, len(payload.tensors)) if i in payload.whole]
    pending = None
    if whole:
        pending = all_reduce_all(Payload([payload.tensors[i] for i in whole], ops=tuple(payload.op(i) for i in whole)),
                                 group, stats=stats)
    for i in range(start, len(payload.tensors)):
        if i not in payload.whole:
            rows = payload.tensors[i]
            received[i] = reduce_scatter_sum(rows.new_empty(rows.shape[1:]), rows.reshape(-1), group, stats)
    if pending is not None:
        for i, t in zip(whole, pending.wait()):
            received[i] = t
    return received


class EntrywiseRows(RowStrategy):
    """For codecs that encode entry for entry (``identity``: FSDP's reduce dtype, 32 bits per entry for fp32;
    ``fp16`` / ``bf16``: 16 bits): the whole input as the compressor encodes it, one SUM reduce-scatter per payload
    tensor (an all-to-all on gloo), and the compressor's own decode of this rank's row into the output shard.

    The compressor's payload tensors must be as long as its input (checked), and its ``ctx`` None or the tensor it
    decodes into (the casts'): here the output shard takes that place."""

    def compress(self, compressor, tensor, layout):
        payload = compressor.compress(tensor, layout.pieces)
        for t in payload.tensors:
            if t.numel() != tensor.numel():
                raise RuntimeError(f"{type(compressor).__name__}: its payload of {t.numel()} entries is not the "
                                   f"input's {tensor.numel()}, entry for entry, so it cannot be reduce-scattered")
        return Payload([t.view(layout.world, -1) for t in payload.tensors], payload.ctx, payload.ops)

    def decode(self, compressor, received, payload, layout, output):
        result = compressor.decompress(received, None if payload.ctx is None else output)
        if result.data_ptr() != output.data_ptr():
            output.copy_(result.reshape(output.shape))
