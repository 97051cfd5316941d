"""``onebit``: 1-bit SGD (Seide et al. 2014), one bit per entry plus two means per parameter, error feedback."""
from __future__ import annotations

import torch

from gcomp.bucket import BucketInfo
from gcomp.collectives import AllgatherCommunicator, bitpack
from gcomp.compressors import onebit_device
from gcomp.compressors.sign import BLOCK, ROW, Buffers, row_plan, sum_rows, work_block
from gcomp.compressors.sign_rows import AlignedRows
from gcomp.core import ALLGATHER, Compressor, Payload
from gcomp.kernels import on_device
from gcomp.memory import ResidualMemory
from gcomp.method import Method
from gcomp.registry import register


class _Layout:
    """What one bucket layout needs, kept across steps: ``row_plan``'s segments and rows, and for the decode the
    parameter of each of the 8 entries of every byte of sign bits, as table classes: class j < P is "all 8 in
    parameter j"; a byte holding a parameter boundary gets a class of its own. ``base`` (int32, one per byte,
    class * 256; None for one parameter) picks each byte's 256-row table in ``bitpack.unpack_table``."""

    def __init__(self, bucket: BucketInfo, n: int, device):
        self.plan, self.rows = row_plan(bucket, n)
        self.numels = torch.tensor([k for _, k, _ in self.plan], dtype=torch.float64, device=device)
        parts = len(self.plan)
        self.classes = torch.arange(parts, device=device)[:, None].expand(parts, 8)
        self.base = None
        if parts > 1:
            starts = torch.tensor([o for o, _, _ in self.plan], device=device)
            first = torch.arange(0, n, 8, device=device)
            owner = torch.searchsorted(starts, first, right=True) - 1  # empty parameters own no entry
            last = torch.searchsorted(starts, (first + 7).clamp_(max=n - 1), right=True) - 1
            mixed = (owner != last).nonzero().reshape(-1)
            entries = (mixed[:, None] * 8 + torch.arange(8, device=device)).clamp_(max=n - 1)
            self.classes = torch.cat([self.classes, torch.searchsorted(starts, entries, right=True) - 1])
            owner[mixed] = parts + torch.arange(mixed.numel(), device=device)
            self.base = owner.mul_(256).to(torch.int32)


class OneBitCompressor(Compressor):
    """Sends one bit per entry (1 for ``x >= 0``, zeros included; 0 for ``x < 0`` and NaN) in int64 words,
    ``ceil(n / 64) * 8`` bytes (entry i at bit i % 64 of word i // 64), plus two fp32 numbers per parameter of
    the bucket: the mean of its entries with bit 0, then (after every parameter's) the mean of those with bit 1
    (0 for an empty side). Each entry decodes to its side's mean. All-gather; the ranks' decodes are summed.

    A NaN or infinity lands in its side's mean, so it decodes non-finite and surfaces on every rank.

    The means do not depend on where DDP put each parameter in the bucket: each side of a parameter is summed in
    fp32 rows of ``sign.ROW`` entries from the parameter's own start, the rows added in float64 and rounded once.
    Memory: decoded buckets go into ``sign.Buffers`` kept per layout; the encoder's work buffers are block-sized.
    On a device (``gcomp.kernels.on_device``) the same wire comes from ``onebit_device``'s bucket-wide kernels.
    """

    collective = ALLGATHER

    def __init__(self):
        self._layouts: dict[tuple, _Layout] = {}  # a cache, not state
        self._device_layouts: dict[tuple, onebit_device.DeviceLayout] = {}  # the device path's
        self._buffers = Buffers(slots=6)

    def _layout(self, bucket: BucketInfo, n: int, device) -> _Layout:
        key = (bucket.key, n, str(device))
        layout = self._layouts.get(key)
        if layout is None:
            for old in [k for k in self._layouts if k[0] == bucket.key]:
                del self._layouts[old]
            layout = self._layouts[key] = _Layout(bucket, n, device)
        return layout

    def _device_layout(self, bucket: BucketInfo, n: int, device) -> onebit_device.DeviceLayout:
        key = (bucket.key, n, str(device))
        layout = self._device_layouts.get(key)
        if layout is None:
            for old in [k for k in self._device_layouts if k[0] == bucket.key]:
                del self._device_layouts[old]
            # the byte classes are built on the host (their boundaries are found by ``nonzero``), once
            layout = onebit_device.DeviceLayout(_Layout(bucket, n, "cpu"), AlignedRows(bucket, n, ROW), device)
            self._device_layouts[key] = layout
        return layout

    def compress(self, tensor, bucket):
        n = tensor.numel()
        if on_device(tensor):
            layout = self._device_layout(bucket, n, tensor.device)
            return Payload(list(onebit_device.encode(tensor, layout)), ctx=(n, tensor.dtype, bucket, layout))
        layout = self._layout(bucket, n, tensor.device)
        work = torch.promote_types(tensor.dtype, torch.float32)
        positive, negative = (torch.empty(layout.rows, dtype=work, device=tensor.device) for _ in range(2))
        positives = torch.zeros(len(layout.plan), dtype=torch.int64, device=tensor.device)
        sums = torch.empty(2, len(layout.plan), dtype=torch.float64, device=tensor.device)
        side, copied = work_block(tensor, work), work_block(tensor, work) if tensor.dtype != work else None
        flags = self._buffers.take(bucket, n, torch.bool, tensor.device)  # every sign, packed at the end
        for j, (offset, numel, row) in enumerate(layout.plan):
            for start in range(0, numel, BLOCK):  # BLOCK is a whole number of rows
                stop = min(start + BLOCK, numel)
                block = tensor[offset + start:offset + stop]
                plus = torch.ge(block, 0, out=flags[offset + start:offset + stop])  # NaN: False
                positives[j] += torch.count_nonzero(plus)
                if copied is not None:
                    block = copied[:block.numel()].copy_(block)
                t = torch.clamp(block, min=0, out=side[:block.numel()])  # NaN stays NaN, and is skipped here
                sum_rows(t, positive[row + start // ROW:], nan_as_zero=True)
                sum_rows(torch.clamp(block, max=0, out=t), negative[row + start // ROW:])
            rows = slice(row, row + -(-numel // ROW))
            torch.sum(negative[rows], 0, dtype=torch.float64, out=sums[0, j])
            torch.sum(positive[rows], 0, dtype=torch.float64, out=sums[1, j])
        words = bitpack.pack_flags_(flags)
        del flags  # its buffer is free for the next step
        counts = torch.stack([layout.numels - positives, positives.to(torch.float64)])
        # flat (negatives' means, then positives'): gloo all-gathers 1-D tensors only
        means = sums.div_(counts.clamp_(min=1)).to(torch.float32).reshape(-1)
        return Payload([words, means], ctx=(n, tensor.dtype, bucket, layout))

    @staticmethod
    def _decode(words, means, layout: _Layout, out: torch.Tensor) -> torch.Tensor:
        """One rank's ``words`` and ``means`` (``2 * parts``) decoded into ``out`` (``n`` entries)."""
        per_class = means.view(2, -1)[:, layout.classes]  # (2, classes, 8)
        table = bitpack.bit_table(per_class[0, :, None, :], per_class[1, :, None, :]).to(out.dtype)
        return bitpack.unpack_table(words, out.numel(), table.view(-1, 8), out=out, base=layout.base)

    def decompress(self, tensors, ctx):
        words, means = tensors
        n, dtype, bucket, layout = ctx
        if on_device(words):
            return onebit_device.decode(words, means, layout, n, dtype)
        return self._decode(words, means, layout, self._buffers.take(bucket, n, dtype, words.device))

    def aggregate(self, gathered, ctx):
        words, means = gathered  # (world, n_words) int64, (world, 2 * parts) fp32
        n, dtype, bucket, layout = ctx
        if on_device(words):
            return onebit_device.aggregate(words, means, layout, n, dtype)
        world, device, take = words.shape[0], words.device, self._buffers.take
        if world == 1:
            return self._decode(words[0], means[0], layout, take(bucket, n, dtype, device))
        total, part = take(bucket, n, torch.float32, device), take(bucket, n, torch.float32, device)
        self._decode(words[0], means[0], layout, total)
        for r in range(1, world):
            total.add_(self._decode(words[r], means[r], layout, part))
        del part
        return total if dtype == torch.float32 else take(bucket, n, dtype, device).copy_(total)


@register("onebit", paper="Seide et al. 2014, 1-bit stochastic gradient descent and its application to "
                          "data-parallel distributed training of speech DNNs")
def onebit() -> Method:
    """1-bit SGD: one bit per entry, decoded to the mean of its side (per parameter), with error feedback."""
    return Method(OneBitCompressor(), ResidualMemory(), AllgatherCommunicator())
