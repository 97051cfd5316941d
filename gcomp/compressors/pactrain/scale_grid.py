"""pactrain's carried scale: the ternary codes' shared scale, carried to the next step inside the step's own SUM.

A ternary code needs a scale every rank shares before it draws (|value| <= scale), and the exact one, the MAX over
ranks of each parameter's largest |value|, is known only after a collective: a second round. Here a scale is a
point of an eighth-octave grid, 2**(K/8) for an integer K (made exactly, through ldexp), and K is carried to the
next step inside the step's own SUM: every rank marks, in one of SLOTS counting lanes per parameter
(``lane_bits(N, 1)``-bit fields: the SUM counts ranks per slot), where its own largest |value| lies relative to
this step's K; the highest slot any rank marked is the grid point at or just above the largest |value| over all
ranks (at most 9% above it), the same on every rank. A rank whose largest value outgrew the slots, or a parameter
with no scale yet (zero on every rank when it was last shared), asks a resync: the next step takes two rounds.
"""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack

PER_OCTAVE = 8
SLOTS = 64  # K moves by -CENTRE .. SLOTS - 1 - CENTRE grid points (-4 .. +3.875 octaves) from one step to the next
CENTRE = SLOTS // 2  # the slot of a rank whose largest value sits at this step's grid point
UNSET = -(1 << 30)  # a parameter with no scale yet
K_MIN, K_MAX = PER_OCTAVE * -126, PER_OCTAVE * 127  # fp32's normal range


def grid_scale(k: torch.Tensor) -> torch.Tensor:
    """``2**(k/8)`` in fp32 (the same bits on every rank: a constant times an exact power of two), 0 where unset."""
    q = torch.div(k, PER_OCTAVE, rounding_mode="floor")
    fraction = torch.exp2((k - PER_OCTAVE * q).clamp(0, PER_OCTAVE - 1).double() / PER_OCTAVE).float()
    return torch.where(k == UNSET, 0.0, torch.ldexp(fraction, q.clamp(-200, 200)))


def grid_exponent(m: torch.Tensor) -> torch.Tensor:
    """The smallest ``K`` (int64) with ``grid_scale(K) >= m``, clamped to fp32's normal range; ``UNSET`` where
    ``m`` is 0 or not finite."""
    wide = m.double()
    valid = (wide > 0) & torch.isfinite(wide)
    k = torch.ceil(PER_OCTAVE * torch.log2(torch.where(valid, wide, 1.0))).clamp(K_MIN, K_MAX).long()
    k = torch.where((grid_scale(k) < m) & (k < K_MAX), k + 1, k)  # log2's rounding may land one point low
    return torch.where(valid, k, UNSET)


def hist_words(segments: int, world: int) -> int:
    """int64 words of the counting lanes of ``segments`` parameters on ``world`` ranks."""
    return bitpack.packed_words(segments * SLOTS, bitpack.lane_bits(world, 1))


def marks(local_max: torch.Tensor, k: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's counting lanes (int64 words) for its parameters' largest ``|value|`` against the shared exponents
    ``k``, and its resync flag (0-d int64): some parameter outgrew the slots, or has a value but no scale yet. A
    zero or non-finite one marks nothing (the non-finite flag travels apart)."""
    mine = grid_exponent(local_max)
    valid, known = mine != UNSET, k != UNSET
    slot = mine - k + CENTRE
    resync = (valid & (~known | (slot > SLOTS - 1))).any().to(torch.int64)
    fields = torch.zeros(local_max.numel(), SLOTS, dtype=torch.uint8, device=local_max.device)
    fields.scatter_(1, slot.clamp(0, SLOTS - 1).unsqueeze(1), (valid & known).to(torch.uint8).unsqueeze(1))
    return bitpack.pack(fields.reshape(-1), bitpack.lane_bits(world, 1)), resync


def next_exponent(words: torch.Tensor, k: torch.Tensor, world: int) -> torch.Tensor:
    """The next step's exponents from the summed counting lanes: the highest slot any rank marked, per parameter;
    one nobody marked keeps its exponent."""
    counts = bitpack.unpack(words, k.numel() * SLOTS, bitpack.lane_bits(world, 1)).view(k.numel(), SLOTS)
    top = torch.where(counts > 0, torch.arange(SLOTS, device=k.device), -1).amax(1)
    moved = (k + top - CENTRE).clamp(K_MIN, K_MAX)
    return torch.where((top >= 0) & (k != UNSET), moved, k)
