"""1-bit SGD's codec: one bit per entry and the mean of each side of every parameter."""
from __future__ import annotations

from bisect import bisect_right
from functools import lru_cache
from itertools import accumulate

import torch

from gcomp.bucket import BucketInfo, expand, lengths_tensor, segment_reduce
from gcomp.collectives import bitpack
from gcomp.compressors.sign.wire import by_name, pack_signs, rows_by_name, sum_decodes
from gcomp.core import ALLGATHER, Compressor, Payload, Traits, contraction


@lru_cache(maxsize=256)
def byte_classes(layout: BucketInfo, n: int) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """The parameter of each of the 8 entries of a byte of sign bits, as classes: class j < P is "all 8 in parameter
    j"; a byte holding a parameter boundary is a class of its own (entries past ``n`` take the last one's parameter).
    Returns the classes' parameters (8 per class, flat) and the classes of the bytes in runs: classes times 256, and
    the bytes each run holds."""
    sizes = by_name(layout, n)[0]
    offsets = [0, *accumulate(sizes)]
    held = [j for j, k in enumerate(sizes) if k]  # an empty parameter owns no entry
    starts = [offsets[j] for j in held]
    classes, runs, counts, done = [j for j in range(len(sizes)) for _ in range(8)], [], [], 0
    for j in held:
        start, end = offsets[j], offsets[j] + sizes[j]
        if start % 8 and start // 8 >= done:  # a byte shared with the parameters before
            runs.append(len(classes) // 8 * 256)
            counts.append(1)
            classes += [held[bisect_right(starts, min(start // 8 * 8 + t, n - 1)) - 1] for t in range(8)]
            done = start // 8 + 1
        last = -(-n // 8) if end == n else end // 8
        if last > done:
            runs.append(j * 256)
            counts.append(last - done)
            done = last
    return tuple(classes), tuple(runs), tuple(counts)


class OneBitCompressor(Compressor):
    """Sends one bit per entry (``pack_signs``: ``ceil(n / 64) * 8`` bytes) and two fp32 numbers per parameter: the
    mean of its entries with bit 0, then (after every parameter's) the mean of those with bit 1 (0 for an empty
    side), by all-gather. Each entry decodes to its side's mean; the ranks' decodes are summed in fp32, in rank order.

    A NaN is sent with bit 0 and an infinity on its side: its side's mean is not finite, on every rank. Each side of a
    parameter is summed in the rows of ``rows_by_name``, the rows added in fp64 and rounded once: the means do not
    depend on where DDP put the parameter in the bucket."""

    # the decode is the projection onto each parameter's two sides: |x - C(x)|^2 = |x|^2 - |C(x)|^2
    traits = Traits(ALLGATHER, contraction(0.0),
                    wire_bytes=lambda bucket, world: 8 * -(-bucket.numel // 64) + 8 * len(bucket.names))

    def encode(self, x, state, layout):
        n, work, device = x.numel(), torch.promote_types(x.dtype, torch.float32), x.device
        sizes, _, rows, place = by_name(layout, n)  # (``lengths_tensor`` keeps a layout's constants per device)
        y = rows_by_name(x, layout)
        sums = torch.stack([torch.clamp(y, max=0).sum(-1, dtype=work),  # NaN stays NaN: it lands in bit 0's side
                            torch.clamp(y, min=0).nansum(-1, dtype=work),  # (and is skipped in bit 1's)
                            torch.ge(y, 0).logical_not_().sum(-1, dtype=work)])
        per = segment_reduce(sums.to(torch.float64), rows, "sum", initial=0.0).index_select(
            1, lengths_tensor(place, device))  # (3, parameters), bucket order
        counts = torch.stack([per[2], lengths_tensor(sizes, device) - per[2]]).clamp_(min=1)
        classes, runs, spans = byte_classes(layout, n)
        base = None if len(classes) == 8 else expand(lengths_tensor(runs, device), spans, -(-n // 8)).int()
        ctx = (n, x.dtype, lengths_tensor(classes, device).view(-1, 8), base)
        return Payload([pack_signs(x), per[:2].div_(counts).to(torch.float32).reshape(-1)], ctx), state

    def decode(self, received, ctx):
        words, means = received  # (world, words) int64, (world, 2 * parameters) fp32
        n, dtype, classes, base = ctx

        def tables(a: int, b: int) -> torch.Tensor:
            per = means[a:b].view(b - a, 2, -1)[:, :, classes]  # (ranks, 2, classes, 8)
            return bitpack.bit_table(per[:, 0, :, None], per[:, 1, :, None])

        return sum_decodes(words, n, tables, classes.shape[0], base).to(dtype)
