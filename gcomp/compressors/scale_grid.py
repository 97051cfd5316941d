"""One-round ternary: a shared scale every rank knows before the step, carried forward by the step before.

A ternary code needs a scale that every rank shares before it draws (``E[scale * t] = value`` needs
``|value| <= scale``), and the exact one, the MAX over ranks of each segment's largest ``|value|``, is only
known after a collective: a second round. Here the scale of each parameter segment is a point of an
eighth-octave grid, ``2**(K/8)`` for an integer exponent ``K`` (made exactly, through ``ldexp``), and ``K`` is
carried from one step to the next inside the step's own SUM all-reduce:

- every rank marks, in one of ``SLOTS`` counting lanes per segment (``bitpack`` fields of ``lane_bits(N, 1)``
  bits, so the SUM counts ranks per slot and no carry crosses a field), where its own largest ``|value|`` lies
  on the grid relative to this step's ``K``;
- the highest slot any rank marked is the grid point at or just above the step's largest ``|value|`` over
  all ranks: the MAX, from a SUM, to an eighth of an octave (at most 9% above it). Every rank decodes the same
  counts, so every rank takes the same next ``K``, with integer arithmetic only.

A value above this step's scale (the segment's largest value grew since the last step) is sent as ``+-scale``
and the excess is kept by its rank for its next step, so what every rank sends adds up to its gradients over
the steps (``PacTrainCompressor`` keeps that carry). A rank whose largest value outgrew the scale by more than
the slots span, or a segment with no scale yet (it was zero on every rank), asks for a resync: one flag in the
same all-reduce, and the next step takes the exact two-round scale again.
"""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack
from gcomp.packing import lanes

PER_OCTAVE = 8  # grid points per octave
SLOTS = 64  # K moves by -CENTRE .. SLOTS - 1 - CENTRE grid points (-4 .. +3.875 octaves) from one step to the next
CENTRE = SLOTS // 2  # the slot of a rank whose largest value sits at this step's grid point
UNSET = -(1 << 30)  # a segment with no scale yet: zero on every rank when its scale was last shared
K_MIN, K_MAX = PER_OCTAVE * -126, PER_OCTAVE * 127  # fp32's normal range
_FRACTIONS = tuple(2.0 ** (j / PER_OCTAVE) for j in range(PER_OCTAVE))
_FRACTIONS_ON: dict[str, torch.Tensor] = {}  # per device: a copy from the host each call would wait for the device


def _fractions(device) -> torch.Tensor:
    found = _FRACTIONS_ON.get(str(device))
    if found is None:
        found = _FRACTIONS_ON[str(device)] = torch.tensor(_FRACTIONS, dtype=torch.float32, device=device)
    return found


def grid_scale(k: torch.Tensor) -> torch.Tensor:
    """``2**(k/8)`` in fp32 (the same bits on every rank: a constant times an exact power of two), 0 where
    ``k`` is ``UNSET``."""
    q = torch.div(k, PER_OCTAVE, rounding_mode="floor")
    base = _fractions(k.device)[(k - PER_OCTAVE * q).clamp(0, PER_OCTAVE - 1).long()]
    return torch.where(k == UNSET, 0.0, torch.ldexp(base, q.clamp(-200, 200)))


def grid_exponent(m: torch.Tensor) -> torch.Tensor:
    """The smallest ``K`` (int64) with ``grid_scale(K) >= m``, clamped to fp32's normal range; ``UNSET`` where
    ``m`` is 0 or not finite."""
    wide = m.double()
    valid = (wide > 0) & torch.isfinite(wide)
    k = torch.ceil(PER_OCTAVE * torch.log2(torch.where(valid, wide, 1.0))).clamp(K_MIN, K_MAX).long()
    k = torch.where((grid_scale(k) < m) & (k < K_MAX), k + 1, k)  # log2's rounding may land one point low
    return torch.where(valid, k, UNSET)


def hist_words(segments: int, world: int) -> int:
    """int64 words of the counting lanes of ``segments`` segments on ``world`` ranks."""
    return bitpack.packed_words(segments * SLOTS, bitpack.lane_bits(world, 1))


def marks(local_max: torch.Tensor, k: torch.Tensor, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's counting lanes (int64 words) for its segments' largest ``|value|`` ``local_max`` against the
    shared exponents ``k``, and its resync flag (int64, 0 or 1): some segment outgrew the slots, or has a
    value but no scale yet. A zero or non-finite segment marks nothing (the non-finite flag travels apart)."""
    mine = grid_exponent(local_max)
    valid, known = mine != UNSET, k != UNSET
    slot = mine - k + CENTRE
    resync = (valid & (~known | (slot > SLOTS - 1))).any().to(torch.int64)
    fields = torch.zeros(local_max.numel(), SLOTS, dtype=torch.uint8, device=local_max.device)
    fields.scatter_(1, slot.clamp(0, SLOTS - 1).unsqueeze(1), (valid & known).to(torch.uint8).unsqueeze(1))
    return lanes.pack(fields.reshape(-1), bitpack.lane_bits(world, 1)), resync


def next_exponent(words: torch.Tensor, k: torch.Tensor, world: int) -> torch.Tensor:
    """The shared exponents of the next step from the summed counting lanes: the highest slot any rank marked,
    per segment; a segment nobody marked keeps its exponent."""
    segments = k.numel()
    counts = lanes.unpack(words, segments * SLOTS, bitpack.lane_bits(world, 1)).view(segments, SLOTS)
    slots = torch.arange(SLOTS, device=k.device)
    top = torch.where(counts > 0, slots, -1).amax(1)
    moved = (k + top - CENTRE).clamp(K_MIN, K_MAX)
    return torch.where((top >= 0) & (k != UNSET), moved, k)
