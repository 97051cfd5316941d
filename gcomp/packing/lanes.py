"""PacTrain's integer lanes (its ternary codes, its counting lanes) packed into int64 words and unpacked, in
``gcomp.collectives.bitpack``'s layout exactly (field j of word w holds entry ``w * (64 // bits) + j`` at bit
``j * bits``), so both paths send the same words.

The CPU path is ``bitpack.pack`` / ``bitpack.unpack`` as they are (a pass per field of a word, over narrow
dtypes: fastest on one thread). On the device path (``gcomp.kernels.on_device``) that is up to 64 launches a
call, and ``unpack_table``'s chunks grow with the entries; here every width takes the same few whole-tensor
operations instead: the fields widened to int64, shifted into place by one broadcast shift and summed per word
(the fields do not overlap, so the sum is their OR, and no carry ever crosses a field); unpacked by one
broadcast shift and mask. The price is one int64 temporary per field: 8 bytes per packed entry while it runs.
"""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack
from gcomp.kernels import on_device

_SHIFTS: dict[tuple, torch.Tensor] = {}


def _shifts(bits: int, device) -> torch.Tensor:
    """int64 ``j * bits`` for every field j of a word, kept per width and device."""
    key = (bits, str(device))
    found = _SHIFTS.get(key)
    if found is None:
        found = _SHIFTS[key] = torch.arange(0, bitpack.fields_per_word(bits) * bits, bits, dtype=torch.int64,
                                            device=device)
    return found


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``bitpack.pack(values, bits)``: entries in ``[0, 2**bits)`` into int64 words."""
    if not on_device(values):
        return bitpack.pack(values, bits)
    per_word = bitpack.fields_per_word(bits)
    flat = values.reshape(-1)
    words = -(-flat.numel() // per_word)
    if flat.numel() != words * per_word:  # callers hand whole words; a ragged tail is padded, in the narrow dtype
        flat = torch.cat([flat, flat.new_zeros(words * per_word - flat.numel())])
    # shifted into an int64 copy (the type promotion: the input is never written, whatever its dtype)
    return torch.bitwise_left_shift(flat.view(words, per_word), _shifts(bits, values.device)).sum(1)


def unpack(words: torch.Tensor, n: int, bits: int, dtype: torch.dtype = torch.int64,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``bitpack.unpack(words, n, bits, dtype, out)``: the ``n`` fields packed in ``words`` (each field's value, or
    its sum over ranks); ``out``, if given, a flat buffer of at least ``words.numel() * (64 // bits)`` entries that
    receives every field, the first ``n`` returned."""
    if not on_device(words):
        return bitpack.unpack(words, n, bits, dtype, out)
    per_word = bitpack.fields_per_word(bits)
    total = words.numel() * per_word
    if total < n:
        raise ValueError(f"{words.numel()} words of {per_word} fields cannot hold {n} fields")
    # an arithmetic shift of a negative word fills with ones: the mask removes them
    fields = words.reshape(-1, 1).bitwise_right_shift(_shifts(bits, words.device)).bitwise_and_((1 << bits) - 1)
    if out is None:
        return fields.view(-1)[:n].to(dtype)
    if out.dim() != 1 or out.numel() < total:
        raise ValueError(f"out must be a flat tensor of at least {total} entries; got shape {tuple(out.shape)}")
    out[:total].copy_(fields.view(-1))
    return out[:n]
