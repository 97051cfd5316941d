"""``onebit``: 1-bit SGD (Seide et al. 2014), one bit per entry plus two means per parameter, error feedback."""
from __future__ import annotations

import torch

from gcomp.collectives import AllgatherCommunicator
from gcomp.compressors.sign import pack_signs, unpack_signs
from gcomp.core import ALLGATHER, Compressor, Method, Payload
from gcomp.memory import ResidualMemory
from gcomp.registry import register


class OneBitCompressor(Compressor):
    """Sends one bit per entry (1 for ``x >= 0``, zeros included; 0 for ``x < 0`` and NaN) in int64 words,
    ``ceil(n / 64) * 8`` bytes, plus two fp32 numbers per parameter of the bucket: the mean of its entries
    with bit 1 and the mean of those with bit 0 (0 for an empty side). Each entry decodes to its side's mean.
    All-gather; the ranks' decodes are summed.

    A NaN or infinity lands in its side's mean, so it decodes non-finite and surfaces on every rank.
    """

    collective = ALLGATHER

    def __init__(self):
        self._segments: dict[tuple, torch.Tensor] = {}  # a cache, not state: layout -> parameter index per entry

    def _segment_ids(self, bucket, n: int, device) -> tuple[torch.Tensor, int]:
        numels = bucket.numels if bucket.numel == n else (n,)  # a bare tensor: one segment
        key = (numels, str(device))
        ids = self._segments.get(key)
        if ids is None:
            counts = torch.tensor(numels, device=device)
            ids = self._segments[key] = torch.repeat_interleave(torch.arange(len(numels), device=device), counts)
        return ids, len(numels)

    def compress(self, tensor, bucket):
        n = tensor.numel()
        ids, parts = self._segment_ids(bucket, n, tensor.device)
        x = tensor.to(torch.float32)
        negative = ~(x >= 0)  # NaN with the negatives, as pack_signs sends it
        # Sums in float64, rounded once to fp32: an fp32 running sum would drift with the bucket's size and
        # order (DDP's rebuilt buckets order parameters differently, and a resumed run must decode alike).
        wide = tensor.to(torch.float64)
        zeros = wide.new_zeros(parts)
        neg_sum = zeros.index_add(0, ids, torch.where(negative, wide, 0.0))
        pos_sum = zeros.index_add(0, ids, torch.where(negative, 0.0, wide))
        neg_count = zeros.index_add(0, ids, negative.to(torch.float64))
        pos_count = torch.bincount(ids, minlength=parts).to(torch.float64) - neg_count
        # flat (negatives' means, then positives'): gloo all-gathers 1-D tensors only
        means = torch.cat([neg_sum / neg_count.clamp(min=1), pos_sum / pos_count.clamp(min=1)]).to(torch.float32)
        return Payload([pack_signs(x), means], ctx=(n, tensor.dtype, ids))

    @staticmethod
    def _decode(bits: torch.Tensor, means: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``bits`` (..., n) 0/1 and ``means`` (..., 2 * parts): each entry's side mean, fp32."""
        per_entry = means.unflatten(-1, (2, -1))[..., ids]  # (..., 2, n)
        return torch.where(bits.bool(), per_entry[..., 1, :], per_entry[..., 0, :])

    def decompress(self, tensors, ctx):
        words, means = tensors
        n, dtype, ids = ctx
        return self._decode(unpack_signs(words, n), means, ids).to(dtype)

    def aggregate(self, gathered, ctx):
        words, means = gathered  # (world, n_words) int64, (world, 2 * parts) fp32
        n, dtype, ids = ctx
        world = words.shape[0]
        bits = unpack_signs(words, words.numel() * 64).view(world, -1)[:, :n]
        return self._decode(bits, means, ids).sum(0).to(dtype)


@register("onebit", paper="Seide et al. 2014, 1-bit stochastic gradient descent and its application to "
                          "data-parallel distributed training of speech DNNs")
def onebit() -> Method:
    """1-bit SGD: one bit per entry, decoded to the mean of its side (per parameter), with error feedback."""
    return Method(OneBitCompressor(), ResidualMemory(), AllgatherCommunicator())
