"""The scaled sign of ``signsgd``, ``signum`` and ``efsignsgd``: one bit per entry and one fp32 scale."""
from __future__ import annotations

from dataclasses import replace

import torch

from gcomp.collectives import bitpack
from gcomp.compressors.sign.wire import pack_signs, rows_by_name, sum_decodes
from gcomp.core import ALLGATHER, Compressor, Payload, Traits, contraction

AGGREGATES = ("mean", "majority")


def mean_magnitude(x: torch.Tensor, layout) -> torch.Tensor:
    """``mean|x|`` as one fp32 number (shape (1,)), bit for bit the same whatever the layout: the fp32 sums (fp64 for
    fp64) of the rows of ``rows_by_name``, added in fp64 and rounded once."""
    sums = rows_by_name(x, layout).abs_().sum(-1, dtype=torch.promote_types(x.dtype, torch.float32))
    return sums.sum(dtype=torch.float64).div_(max(x.numel(), 1)).to(torch.float32).reshape(1)


class ScaledSignCompressor(Compressor):
    """Sends ``sign(x)`` as 1 bit per entry (``pack_signs``: ``ceil(n / 64) * 8`` bytes) and ``mean|x|`` as one fp32
    number, by all-gather; one payload decodes to ``mean|x| * sign(x)``. ``aggregate``: ``"mean"``, the fp32 sum in
    rank order of every rank's decode; ``"majority"``, the summed scales times the sign of the vote (ties 0)."""

    def __init__(self, aggregate: str = "mean"):
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}; got {aggregate!r}")
        self.aggregate = aggregate
        # |x - C(x)|^2 = |x|^2 - |x|_1^2 / n: no bound above 0 holds for every n
        self.traits = Traits(ALLGATHER, contraction(0.0), decodes_alone=aggregate == "mean",
                             wire_bytes=lambda bucket, world: 8 * -(-bucket.numel // 64) + 4)

    def encode(self, x, state, layout):
        return Payload([pack_signs(x), mean_magnitude(x, layout)], ctx=(x.numel(), x.dtype)), state

    def decode(self, received, ctx):
        words, scales = received  # (world, words) int64, (world, 1) fp32
        n, dtype = ctx
        if self.aggregate == "majority":  # (#plus - #minus) per entry, exact in fp32: its sign is the vote
            one = torch.ones((), device=words.device)
            table = bitpack.bit_table(-one, one)
            votes = sum_decodes(words, n, lambda a, b: table.expand(b - a, 1, 256, 8))
            return votes.sign_().mul_(scales.sum()).to(dtype)
        s = scales.reshape(-1, 1, 1, 1)
        return sum_decodes(words, n, lambda a, b: bitpack.bit_table(-s[a:b], s[a:b])).to(dtype)


class SignumCompressor(ScaledSignCompressor):
    """Signum: sends the scaled sign, as ``ScaledSignCompressor``, of the momentum ``m = momentum * m + (1 -
    momentum) * x`` (an fp32 slot, ``"momentum"`` per parameter in checkpoints). Non-finite momentum entries are
    zeroed once sent: one overflowing step (which AMP skips) does not poison the later ones."""

    def __init__(self, momentum: float, aggregate: str = "mean"):
        super().__init__(aggregate)
        self.momentum = momentum
        self.traits = replace(self.traits, slots=("momentum",))

    def encode(self, x, state, layout):
        m = state["momentum"].float().mul(self.momentum).add_(x, alpha=1.0 - self.momentum)
        payload = Payload([pack_signs(m), mean_magnitude(m, layout)], ctx=(x.numel(), x.dtype))
        return payload, {"momentum": m.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)}

    def merge_states(self, assigned, every, rank):
        raise ValueError("each rank's momentum is of its own gradients: it can be neither summed nor shared")
