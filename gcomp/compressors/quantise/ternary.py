"""TernGrad's codecs: stochastic ternary codes {-1, 0, 1} times one scale per parameter, gathered (each rank's own
scales) or summed in integer lanes (a scale shared by MAX first)."""
from __future__ import annotations

from dataclasses import replace

import torch

from gcomp.bucket import expand, segment_scales
from gcomp.collectives import ChainedCompressor, bitpack
from gcomp.core import ALLGATHER, ALLREDUCE, MAX, SUM, UNBIASED, Fidelity, Keeps, Payload, Traits
from gcomp.compressors.quantise.rounding import (StochasticCompressor, pack_fields, scaled_sum, unpack_rows,
                                                 wire_scale, work_values)


class TernGradCompressor(StochasticCompressor):
    """Ternary codes by all-gather: per parameter one fp32 scale ``s`` (max |g|, or with clipping
    ``min(max |g|, clip * std)`` where that cap is positive) and per entry ``t`` in {-1, 0, 1} drawn with
    ``P(t = sign g) = min(1, |g| / s)``, sent as ``t + 1`` in 2-bit fields (32 per int64 word): 2 bits per entry
    plus 32 per parameter. Decoded as ``s t`` and summed over the ranks: unbiased without clipping; clipping
    trades a bias on the outliers for a smaller scale. A non-finite entry makes its scale non-finite, and so every
    entry of its parameter on every rank."""

    def __init__(self, clip: float = 2.5, seed: int = 0):
        super().__init__(seed, "terngrad")
        self.clip = clip
        # clipped at c std: at most 1 / c^2 of a parameter's entries are (Chebyshev), which are biased
        fidelity = Fidelity("unbiased", min(1.0, 1 / clip ** 2)) if clip > 0 else UNBIASED
        self.traits = Traits(ALLGATHER, fidelity, Keeps.RANK, rows=None,
                             wire_bytes=lambda b, world: 4 * len(b.numels) + 8 * bitpack.packed_words(b.numel, 2))

    def scales(self, v: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        return wire_scale(segment_scales(v, lengths, self.clip))

    def codes(self, v: torch.Tensor, scales: torch.Tensor, lengths: tuple[int, ...]) -> torch.Tensor:
        """``t + 1`` (uint8) with ``P(t = sign v) = min(1, |v| / scale)``; ``t = 0`` where that ratio is NaN (a zero
        entry of a zero scale, or a non-finite entry or scale: its scale decodes it as non-finite anyway)."""
        ratio = v.abs().div_(expand(scales.to(v.dtype), lengths, v.numel()))
        hit = torch.rand(v.shape, generator=self.stream.next(v.device), dtype=v.dtype, device=v.device) < ratio
        return torch.where(hit, (v > 0).to(torch.uint8) * 2, 1)

    def encode(self, x, state, layout):
        v, lengths = work_values(x, layout)
        scales = self.scales(v, lengths)
        return Payload([scales, pack_fields(self.codes(v, scales, lengths), 2)], (lengths, x.dtype, v.numel())), state

    def decode(self, received, ctx):
        scales, words = received  # (ranks, parameters) fp32, (ranks, words) int64
        lengths, dtype, n = ctx
        return scaled_sum(unpack_rows(words, n, 2), 1, scales, lengths, dtype)


class SharedScaleTernGradCompressor(TernGradCompressor, ChainedCompressor):
    """Ternary codes by integer SUM all-reduce, in two chained rounds (``ChainedAllreduceCommunicator``): first the
    fp32 scales per parameter plus one flag slot (MAX, so every rank uses the largest scale), then ``t + 1`` drawn
    against that shared scale in ``bitpack.lane_bits(N)``-bit fields of int64 words (SUM: a field sums to at most
    2N, no carry crosses; 4 bits per entry on 4 ranks, 12 on 1024). Decoded as ``(field - N) * scale``. The flag is
    1 when a rank's scale is non-finite: MAX may drop a NaN, the flag makes every rank decode that bucket as NaN
    all the same."""

    def __init__(self, clip: float = 2.5, seed: int = 0):
        super().__init__(clip, seed)
        self.traits = replace(self.traits, collective=ALLREDUCE, decodes_alone=False,  # lanes offset by the world
                              wire_bytes=lambda b, world: 4 * len(b.numels) + 4
                              + 8 * bitpack.packed_words(b.numel, bitpack.lane_bits(world)))

    def encode(self, x, state, layout):
        v, lengths = work_values(x, layout)
        scales = self.scales(v, lengths)
        flagged = torch.cat([scales, (~scales.isfinite()).any().to(scales.dtype).view(1)])
        lanes = torch.zeros(bitpack.packed_words(v.numel(), bitpack.lane_bits(self.world)), dtype=torch.int64,
                            device=v.device)
        return Payload([flagged, lanes], (lengths, x.dtype, v.numel(), v), ops=(MAX, SUM)), state

    def second_round(self, payload: Payload) -> None:
        """The codes drawn against the shared scales (``tensors[0]`` after MAX), packed into the lanes."""
        lengths, _, _, v = payload.ctx
        codes = self.codes(v, payload.tensors[0][:-1], lengths)
        payload.tensors[1].copy_(pack_fields(codes, bitpack.lane_bits(self.world)))

    def decode(self, received, ctx):
        shared, lanes = received
        lengths, dtype, n, _ = ctx
        scales = shared[:-1] + torch.where(shared[-1] > 0, torch.nan, 0.0)
        fields = unpack_rows(lanes.view(1, -1), n, bitpack.lane_bits(self.world))
        return scaled_sum(fields, self.world, scales.view(1, -1), lengths, dtype)
