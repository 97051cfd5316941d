"""Coded positions: a sorted list of ``k`` positions into ``n`` entries as the smaller of two bit strings, chosen
from ``(n, k)`` alone, so every rank's code of a bucket has the same size (a plain all-gather, no sizes round).

- ``bitmap``: bit ``p`` set for each position ``p`` (n bits). A set: repeated positions appear once.
- ``elias_fano``: with ``L = max(0, floor(log2(n / k)))``, each position's low ``L`` bits, bit-packed (k L
  bits), then its high part ``p >> L`` in unary: bit ``(p >> L) + i`` set for the i-th position, sorted
  (k + ceil(n / 2**L) bits). Any non-decreasing sequence, repeats included, decodes exactly.

Bits are laid out least significant first within each byte; a code is ``coded_bytes(n, k)`` uint8. Encode and
decode are whole-tensor operations (shifts, a cumulative sum, a scatter), with no host synchronisation: ``n``
and ``k`` come from shapes. ``decode`` takes a stack of codes (``(..., bytes)``: every rank's, gathered) at once.
Values travel beside the positions in the same sorted order: ``sort_pairs`` permutes them alike, and
``merge_repeats`` folds repeated positions into one (their values summed) where the bitmap is chosen.
"""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack

BITMAP, ELIAS_FANO = "bitmap", "elias_fano"
_BYTE_WEIGHTS: dict[str, torch.Tensor] = {}


def low_bits(n: int, k: int) -> int:
    """Elias–Fano's ``L = max(0, floor(log2(n / k)))`` (integers only: exact for any size)."""
    return max(0, (n // k).bit_length() - 1) if k else 0


def _ef_bits_exact(n: int, k: int) -> int:
    if not k:
        return 0
    low = low_bits(n, k)
    return k * low + k + -(-n // (1 << low))


def form(n: int, k: int) -> str:
    """The form of the code of ``k`` positions into ``n`` entries: the bitmap where it is strictly smaller."""
    if n < 0 or k < 0:
        raise ValueError(f"coded positions need n >= 0 and k >= 0; got n={n}, k={k}")
    return BITMAP if k and -(-n // 8) < -(-_ef_bits_exact(n, k) // 8) else ELIAS_FANO


def coded_bytes(n: int, k: int) -> int:
    """Bytes of the code of ``k`` positions into ``n`` entries: ``ceil(n / 8)`` for the bitmap,
    ``ceil((k L + k + ceil(n / 2**L)) / 8)`` for Elias–Fano, whichever ``form`` chooses; 0 for ``k = 0``."""
    if form(n, k) == BITMAP:
        return -(-n // 8)
    return -(-_ef_bits_exact(n, k) // 8)


def bits_per_position(n: int, k: int) -> float:
    """``8 coded_bytes(n, k) / k``: what each position costs on the wire."""
    return 8 * coded_bytes(n, k) / k if k else 0.0


def _weights(device) -> torch.Tensor:
    key = str(device)
    found = _BYTE_WEIGHTS.get(key)
    if found is None:
        found = _BYTE_WEIGHTS[key] = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8, device=device)
    return found


def _to_bytes(bits: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Flat 0/1 uint8 ``bits`` (scratch: overwritten) into ``nbytes`` uint8, least significant bit first, zero
    past the end (``bitpack.pack_flags_``'s words, cut to the code's bytes)."""
    return bitpack.pack_flags_(bits).view(torch.uint8)[:nbytes]


def _from_bytes(code: torch.Tensor, nbits: int) -> torch.Tensor:
    """The first ``nbits`` bits of ``(..., bytes)`` uint8 codes, as ``(..., nbits)`` 0/1 uint8."""
    bits = code.unsqueeze(-1).bitwise_and(_weights(code.device)).ne_(0).view(torch.uint8)
    return bits.reshape(*code.shape[:-1], -1)[..., :nbits]


def sort_pairs(positions: torch.Tensor, values: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``positions`` (int64) sorted ascending and ``values`` permuted alike: the order the code sends and
    ``decode`` gives back. Where the bitmap is chosen, repeated positions are merged (``merge_repeats``)."""
    ordered, order = torch.sort(positions.long(), stable=True)
    ordered, values = ordered, values[order]
    if form(n, positions.numel()) == BITMAP:
        return merge_repeats(ordered, values)
    return ordered, values


def merge_repeats(positions: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted ``positions`` with each run of a repeated position folded into its first slot (the run's values
    summed there, in order), the slots freed at the end as position 0 with value 0: the same sum by
    ``index_add_``, and distinct positions first, which is what the bitmap can carry."""
    k = positions.numel()
    if k < 2:
        return positions, values
    first = torch.ones(k, dtype=torch.bool, device=positions.device)
    torch.ne(positions[1:], positions[:-1], out=first[1:])
    run = torch.cumsum(first, 0).sub_(1)
    merged_values = torch.zeros_like(values).index_add_(0, run, values)
    merged = torch.zeros_like(positions).scatter_(0, run, positions)  # a run's slots all hold its position
    return merged, merged_values


def encode(positions: torch.Tensor, n: int) -> torch.Tensor:
    """The code (``coded_bytes(n, k)`` uint8) of the sorted (non-decreasing) ``positions`` in ``[0, n)``. In the
    bitmap form repeated positions appear once (``merge_repeats`` first keeps the sum); trailing positions 0
    after larger ones (``merge_repeats``' freed slots) are skipped by it too."""
    k = positions.numel()
    nbytes = coded_bytes(n, k)
    device = positions.device
    if form(n, k) == BITMAP:
        p = positions.long()
        real = torch.ones(k, dtype=torch.bool, device=device)
        torch.gt(p[1:], p[:-1], out=real[1:])  # a repeat, or a freed slot's 0: not set again
        bits = torch.zeros(nbytes * 8 + 1, dtype=torch.uint8, device=device)
        bits.index_fill_(0, torch.where(real, p, nbytes * 8), 1)
        return _to_bytes(bits[:-1], nbytes)
    if not k:
        return torch.zeros(0, dtype=torch.uint8, device=device)
    low = low_bits(n, k)
    p = positions.long()
    high_bits = k + -(-n // (1 << low))
    bits = torch.zeros(k * low + high_bits, dtype=torch.uint8, device=device)
    if low:
        shifts = torch.arange(low, dtype=torch.int64, device=device)
        bits[:k * low] = p.unsqueeze(1).bitwise_right_shift(shifts).bitwise_and_(1).view(-1).to(torch.uint8)
    unary = p.bitwise_right_shift(low).add_(torch.arange(k, dtype=torch.int64, device=device)).add_(k * low)
    bits.index_fill_(0, unary, 1)
    return _to_bytes(bits, nbytes)


def _ranks_of_set_bits(bits: torch.Tensor, k: int) -> torch.Tensor:
    """For ``(..., m)`` 0/1 ``bits``: ``(..., k)`` int64 indices of the first ``k`` set bits in order (0 in slots
    past the last set bit), by a cumulative sum and a scatter: no ``nonzero``, no host synchronisation."""
    m = bits.shape[-1]
    wide = torch.int32 if m < 2**31 else torch.int64
    rank = torch.cumsum(bits, -1, dtype=wide)
    slot = torch.where(bits.bool(), rank - 1, k).clamp_(max=k).long()  # unset bits, and any past k: the spare slot
    out = torch.zeros(*bits.shape[:-1], k + 1, dtype=torch.int64, device=bits.device)
    where = torch.arange(m, dtype=torch.int64, device=bits.device).expand_as(slot)
    return out.scatter_(-1, slot, where)[..., :k]


def decode(code: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The ``k`` int64 positions of ``code`` (``(..., coded_bytes(n, k))`` uint8: one code, or a stack of them),
    as ``(..., k)``: sorted, repeats kept (Elias–Fano); the set bits ascending, then 0 (bitmap)."""
    nbytes = coded_bytes(n, k)
    if code.shape[-1] != nbytes:
        raise ValueError(f"a code of {k} positions into {n} entries has {nbytes} bytes; got {code.shape[-1]}")
    if form(n, k) == BITMAP:
        return _ranks_of_set_bits(_from_bytes(code, n), k)
    if not k:
        return torch.zeros(*code.shape[:-1], 0, dtype=torch.int64, device=code.device)
    low = low_bits(n, k)
    high_bits = k + -(-n // (1 << low))
    bits = _from_bytes(code, k * low + high_bits)
    slots = _ranks_of_set_bits(bits[..., k * low:], k)
    high = slots.sub_(torch.arange(k, dtype=torch.int64, device=code.device)).bitwise_left_shift_(low)
    if low:
        shifts = torch.arange(low, dtype=torch.int64, device=code.device)
        fields = bits[..., :k * low].reshape(*code.shape[:-1], k, low).long().bitwise_left_shift_(shifts)
        high.add_(fields.sum(-1))
    return high
