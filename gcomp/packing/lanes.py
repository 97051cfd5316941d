"""PacTrain's integer lanes (its ternary codes, its counting lanes) packed into int64 words and unpacked, in
``gcomp.collectives.bitpack``'s layout exactly, so both paths send the same words: ``bitpack`` itself on the CPU
(a pass per field of a word, over narrow dtypes: fastest on one thread), ``gcomp.collectives.bitpack_device`` on
the device path (the same few whole-tensor operations at every width)."""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack, bitpack_device
from gcomp.kernels import on_device


def pack(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``bitpack.pack(values, bits)``: entries in ``[0, 2**bits)`` into int64 words."""
    return bitpack_device.pack(values, bits) if on_device(values) else bitpack.pack(values, bits)


def unpack(words: torch.Tensor, n: int, bits: int, dtype: torch.dtype = torch.int64,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``bitpack.unpack(words, n, bits, dtype, out)``: the ``n`` fields packed in ``words`` (each field's value, or
    its sum over ranks); ``out``, if given, a flat buffer that receives them (on the CPU every field of the words:
    ``bitpack``'s rule), the first ``n`` returned."""
    if on_device(words):
        return bitpack_device.unpack(words, n, bits, dtype, out)
    return bitpack.unpack(words, n, bits, dtype, out)
