"""The sparse sets in point-to-point messages (gTop-k, SparDL): ``count`` sets of ``k`` distinct positions into
``n`` entries each, with their values, as message sections (``gcomp.collectives.p2p``).

``raw`` positions go as int32 (int64 past 2**31 entries) in the order given; ``coded`` ones as one code
(``gcomp.collectives.coded_positions``) of the sets' positions offset by ``set * n``: sorted, so set by set, and
the values permuted alike. Values as ``gcomp.collectives.narrow_values`` makes them (fp8: one scale per message).
Both sides know ``(n, k, count)``, so a message's size is known before it arrives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gcomp.bucket import index_dtype
from gcomp.collectives import coded_positions, narrow_values


@dataclass(frozen=True)
class SparseWire:
    """How a method's sparse messages carry positions (``coded`` or ``raw``) and values (``fp32``: the bucket's
    dtype, ``bf16``, ``fp16``, ``fp8_e4m3``)."""

    positions: str = "raw"
    values: str = "fp32"

    @property
    def plain(self) -> bool:
        """Raw positions and values as they are: the messages of before coding, exactly."""
        return self.positions == "raw" and self.values == "fp32"

    def sections(self, n: int, k: int, count: int, dtype: torch.dtype) -> list[tuple[torch.dtype, int]]:
        """The ``(dtype, numel)`` sections of a message of ``count`` sets of ``k`` entries into ``n``."""
        if self.positions == "coded":
            where = (torch.uint8, coded_positions.coded_bytes(count * n, count * k))
        else:
            where = (index_dtype(n), count * k)
        if self.values == "fp32":
            return [where, (dtype, count * k)]
        width = narrow_values.value_bits(self.values, dtype) // 8
        scale = [(torch.float32, 1)] if narrow_values.scale_bytes(self.values) else []
        return [where, (torch.uint8, count * k * width), *scale]

    def encode(self, index: torch.Tensor, values: torch.Tensor, n: int):
        """``(tensors, index, exact, sent)`` for ``count`` sets (``index``, ``values``: ``(count, k)``): the message's
        tensors in ``sections`` order, then the positions, the values and the values as decoded, ``(count, k)``
        each in the order the message carries them (so ``exact - sent`` is what rounding took off)."""
        count, k = index.shape
        if self.positions == "coded":
            offsets = torch.arange(count, dtype=torch.int64, device=index.device)[:, None] * n
            flat, values = coded_positions.sort_pairs((index.long() + offsets).reshape(-1), values.reshape(-1),
                                                      count * n)
            where = coded_positions.encode(flat, count * n)
            index, values = (flat.view(count, k) - offsets), values.view(count, k)
        else:
            where = index.to(index_dtype(n))
        wire, scale, sent = narrow_values.narrow(values, self.values)
        tensors = [where, wire] if scale is None else [where, wire, scale]
        return tensors, index, values, sent

    def decode(self, parts, n: int, k: int, count: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(positions, values)``, ``(count, k)`` each, of a message's sections (``parts``, as ``p2p.unpack`` cuts
        them)."""
        where, wire = parts[0], parts[1]
        if self.positions == "coded":
            flat = coded_positions.decode(where, count * n, count * k).view(count, k)
            index = flat - torch.arange(count, dtype=torch.int64, device=flat.device)[:, None] * n
        else:
            index = where.view(count, k)
        scale = parts[2] if len(parts) > 2 else None
        if self.values != "fp32":
            wire = wire.view(count * k, -1)  # a row of bytes per value
        return index, narrow_values.widen(wire, self.values, scale, dtype).view(count, k)
