"""``topk``: the k largest-magnitude entries of each bucket, with error feedback, by all-gather."""
from __future__ import annotations

import math
from typing import Annotated

import torch

from gcomp.collectives import AllgatherCommunicator
from gcomp.compressors.sparse import (PositionsParam, SparseCompressor, ValuesParam, magnitude_keys,
                                     positions_at_least)
from gcomp.kernels import on_device
from gcomp.memory import ResidualMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register

MIN_SAMPLED = 1 << 15  # smaller buckets, or k above n / 8: torch.topk of the whole bucket
_ABOVE = 256           # a sample of about 256 n / k entries: 256 of them expected among the top k
_SIGMAS = 4            # the bound is the sample's (256 + 4 * 16 + 1)-th largest: 1.25 k candidates expected

FULL, SAMPLED, FALLBACK = "full", "sampled", "fallback"


def largest_magnitudes(x: torch.Tensor, k: int, min_sampled: int = MIN_SAMPLED) -> tuple[torch.Tensor, str]:
    """The int64 positions of the ``k`` entries of the flat ``x`` with the largest magnitudes, NaN and
    infinities above every finite one: torch.topk's set, up to ties. Returns them and the path taken.

    ``sampled``: a lower bound on the k-th largest magnitude from a strided sample (deterministic, no random
    stream), every entry at or above it gathered in one pass, and torch.topk run on those candidates alone.
    When at least k pass, every entry of the top k is among them (the k-th largest is >= the bound), so the
    result is exact; when fewer pass (the sample was unlike the bucket: periodic data can do that, random
    data with probability under 1e-4) the ``fallback`` is torch.topk of the whole bucket, exact as well.
    """
    n = x.numel()
    if n < min_sampled or 8 * k > n:
        return torch.topk(magnitude_keys(x), k, sorted=False).indices, FULL
    stride = max(1, n // min(n // 4, math.ceil(_ABOVE * n / k)))
    sample = magnitude_keys(x[stride // 2::stride])
    expected = sample.numel() * k / n  # sampled entries expected among the top k
    rank = min(sample.numel(), math.ceil(expected + _SIGMAS * math.sqrt(expected)) + 1)
    bound = torch.topk(sample, rank, sorted=False).values.min()  # 0-d: no host sync
    candidates = positions_at_least(x, bound)  # the count sizes the candidates: the one host sync
    if candidates.numel() < k:
        return torch.topk(magnitude_keys(x), k, sorted=False).indices, FALLBACK
    best = torch.topk(magnitude_keys(x[candidates]), k, sorted=False).indices
    return candidates[best], SAMPLED


class TopKCompressor(SparseCompressor):
    """Sends the ``k = max(1, int(ratio * n))`` entries of largest magnitude by all-gather, entries several
    ranks chose summed: k values (``values``: the bucket's dtype, or bf16/fp16 16 bits, fp8_e4m3 8 bits plus
    one fp32 scale) and k positions, coded by default: sorted, as the smaller of a bitmap (n bits) and
    Elias-Fano (L = max(0, floor(log2(n / k))): k L + k + ceil(n / 2**L) bits), in whole bytes; about
    L + 1 + n / (k 2**L) bits a position, 8.6 at ratio 0.01; ``positions=raw``: 32 bits (64 past 2**31).

    NaN and infinities rank above every finite magnitude, so a non-finite gradient is always sent. The
    selection is exact (``largest_magnitudes``): on a large bucket torch.topk runs on about 1.25 k candidates
    above a sampled bound instead of on all n entries. ``paths`` counts the selections by path taken.

    On the device path (``gcomp.kernels.on_device``) it is one torch.topk of the whole bucket's magnitude keys
    (counted as ``full``): the candidates above a sampled bound are as many as the data makes them, which only a
    host synchronisation would tell. The same set, up to ties; the same wire.
    """

    min_sampled = MIN_SAMPLED

    def __init__(self, ratio: float, positions: str = "raw", values: str = "fp32"):
        self.ratio = ratio
        self.wire(positions, values)
        self.paths = {FULL: 0, SAMPLED: 0, FALLBACK: 0}

    def compress(self, tensor, bucket):
        n = tensor.numel()
        k = max(1, int(n * self.ratio))
        flat = tensor.reshape(-1)
        if on_device(flat):
            index, path = torch.topk(magnitude_keys(flat), k, sorted=False).indices, FULL
        else:
            index, path = largest_magnitudes(flat, k, self.min_sampled)
        self.paths[path] += 1
        return self.sparse_payload(flat[index], index, tensor, bucket)


@register("topk", paper="Aji & Heafield 2017 (gradient dropping); Stich et al. 2018 (error feedback)")
def topk(ratio: Annotated[float, Range(0, 1, low_open=True), "fraction of the bucket's entries sent"] = 0.01,
         positions: PositionsParam = "coded", values: ValuesParam = "fp32") -> Method:
    """Top-k sparsification with error feedback: the largest entries go by all-gather, the rest wait."""
    return Method(TopKCompressor(ratio, positions, values), ResidualMemory(), AllgatherCommunicator())
