"""The sign family: ``signsgd``, ``signum`` and ``efsignsgd``, 1 bit per element plus one fp32 scale, by all-gather.

Sign bits: an entry ``x >= 0`` (``+0.0`` and ``-0.0`` included) is sent as bit 1 and decodes to ``+1``; ``x < 0``
is bit 0 and decodes to ``-1``; a NaN compares false and goes as bit 0. One bit cannot carry a zero or a NaN, so
every rank also sends the scale ``mean(|x|)`` of what it signed (fp32): it is NaN or infinite as soon as one entry
is, and every rank multiplies by every rank's scale, so a non-finite gradient anywhere surfaces everywhere.

Scaling (why the update is a mean gradient): the hook divides each bucket by the world size N before
compressing, so rank r's scale ``a_r = mean|g_r| / N`` and the decoded payload ``a_r * sign(g_r)`` has the size of
rank r's share of the mean gradient. Two aggregations, the same on every rank:

- ``majority`` (the default of ``signsgd`` and ``signum``; Bernstein et al. 2018, signSGD with majority vote):
  ``(sum_r a_r) * sign(sum_r sign(g_r))``, ties (an even split) giving 0. The vote is not a sum of per-rank
  decodes (``decodes_alone`` is false), so the contract suite leaves its value to this module's tests;
- ``mean``: ``sum_r a_r * sign(g_r)``, the sum of the decoded payloads (the mean over ranks of what they sent).
"""
from __future__ import annotations

from typing import Annotated

import torch

from gcomp.bucket import BucketInfo
from gcomp.bucket_state import BucketState, KeptInBucketState, Scratch
from gcomp.collectives import AllgatherCommunicator, bitpack
from gcomp.compressors import sign_device
from gcomp.compressors.sign_rows import AlignedRows
from gcomp.core import ALLGATHER, Compressor, Payload
from gcomp.kernels import on_device
from gcomp.memory import NoMemory, ResidualMemory
from gcomp.method import Method
from gcomp.params import OneOf, Range
from gcomp.registry import register

AGGREGATES = ("mean", "majority")

BLOCK = 1 << 18  # entries per block of the sign pack and of the sums: their work buffers stay cache-sized
ROW = 1 << 12    # entries per fp32 partial sum (module ``row_sums``)


def pack_signs(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """One bit per entry (1 for ``x >= 0``, 0 for ``x < 0`` and NaN) in ``ceil(n / 64)`` int64 words (into
    ``out`` if given): entry i is bit ``i % 64`` of word ``i // 64``, the padding bits zero."""
    x = x.reshape(-1)
    n = x.numel()
    if out is None:
        out = torch.empty(bitpack.packed_words(n, 1), dtype=torch.int64, device=x.device)
    flags = torch.empty(min(BLOCK, n), dtype=torch.bool, device=x.device)
    for start in range(0, n, BLOCK):  # BLOCK is a whole number of words: each block fills its own words
        stop = min(start + BLOCK, n)
        block = torch.ge(x[start:stop], 0, out=flags[:stop - start])
        bitpack.pack_flags_(block, out=out[start // 64:-(-stop // 64)])
    return out


def unpack_signs(words: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` sign bits of the flat ``words`` (uint8, 0 or 1)."""
    return bitpack.unpack(words.reshape(-1), n, 1, dtype=torch.uint8)


def decode_signs(words: torch.Tensor, n: int, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (``n`` entries, any float dtype) set to ``+scale`` where the sign bit is 1 and ``-scale`` where
    it is 0, in one pass over the words (``scale``: fp32, one number; cast to ``out``'s dtype once)."""
    scale = scale.reshape(1, 1)
    return bitpack.unpack_table(words.reshape(-1), n, bitpack.bit_table(-scale, scale).to(out.dtype), out=out)


# --- sums that do not depend on the bucket layout -----------------------------------------------------------------

def row_plan(bucket: BucketInfo, n: int) -> tuple[tuple[tuple[int, int, int], ...], int]:
    """Each parameter segment's ``(offset, numel, first row)`` in bucket order, and the number of rows, for
    ``row_sums``: a segment's entries are summed ROW by ROW from its own start, and its rows take their place in
    the order of the parameters' names. A tensor the layout does not describe is one segment."""
    segments = list(bucket.segments()) if bucket.numel == n and bucket.numels else [("", 0, n)]
    first, rows = {}, 0
    for name, offset, numel in sorted(segments):
        first[offset] = rows
        rows += -(-numel // ROW)
    return tuple((offset, numel, first[offset]) for _, offset, numel in segments), rows


def sum_rows(t: torch.Tensor, out: torch.Tensor, nan_as_zero: bool = False) -> None:
    """``t`` (one block, starting on a row) summed ROW entries at a time into ``out[:ceil(len / ROW)]``."""
    full, reduce = t.numel() // ROW, torch.nansum if nan_as_zero else torch.sum
    if full:
        reduce(t[:full * ROW].view(full, ROW), 1, out=out[:full])
    if t.numel() > full * ROW:
        reduce(t[full * ROW:], 0, out=out[full])


def work_block(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A block-sized work buffer of ``dtype`` (fp32, fp64 for fp64 buckets) next to ``x``."""
    return torch.empty(min(BLOCK, x.numel()), dtype=dtype, device=x.device)


def abs_row_sums(x: torch.Tensor, plan, rows: int) -> torch.Tensor:
    """``|x|`` summed per ``row_plan`` row (fp32, fp64 for an fp64 ``x``): each row's sum is computed alike
    wherever its parameter lies in the bucket, so any fixed-order sum of the rows is layout-free."""
    work = torch.promote_types(x.dtype, torch.float32)
    sums, buffer = torch.empty(rows, dtype=work, device=x.device), work_block(x, work)
    for offset, numel, row in plan:
        for start in range(0, numel, BLOCK):  # BLOCK is a whole number of rows
            block = x[offset + start:offset + min(start + BLOCK, numel)]
            t = buffer[:block.numel()]
            torch.abs(block, out=t) if block.dtype == work else t.copy_(block).abs_()
            sum_rows(t, sums[row + start // ROW:])
    return sums


def mean_magnitude(x: torch.Tensor, bucket: BucketInfo, plans: dict) -> torch.Tensor:
    """``mean(|x|)`` as one fp32 number (shape (1,)), bit for bit the same whatever the order of the bucket's
    parameters: fp32 sums of ROW entries of each parameter (``row_sums``), added in float64 in the order of the
    parameters' names. ``plans`` caches ``row_plan`` per layout."""
    key = (bucket.key, x.numel())
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = row_plan(bucket, x.numel())
    sums = abs_row_sums(x, *plan)
    return sums.sum(dtype=torch.float64).div_(max(x.numel(), 1)).to(torch.float32).reshape(1)


# --- result buffers kept across steps -----------------------------------------------------------------------------

class Buffers(Scratch):
    """``Scratch`` for codecs that take buffers of several dtypes per layout (sign flags as bools beside
    decoded values): a fresh buffer is always kept, the oldest given up once every slot is full."""

    def __init__(self, slots: int = 4):
        super().__init__(slots)

    def _keep(self, kept: list[torch.Tensor], base: torch.Tensor) -> None:
        if len(kept) >= self.slots:
            kept.pop(0)
        kept.append(base)


class ScaledSignCompressor(Compressor):
    """Sends ``sign(x)`` as 1 bit per entry (int64 words, ``ceil(n / 64) * 8`` bytes, entry i at bit i % 64 of
    word i // 64) plus ``mean(|x|)`` as one fp32 number, by all-gather; decodes to ``mean(|x|) * sign(x)``.
    ``aggregate`` is ``mean`` (the sum of the decoded payloads) or ``majority`` (the summed scales times the
    sign of the vote, ties 0): see the module doc.

    Memory: decoded buckets go into ``Buffers`` kept per layout; the encoder's work buffers are block-sized.
    On a device (``gcomp.kernels.on_device``) the same wire comes from ``sign_device``'s bucket-wide kernels.
    """

    collective = ALLGATHER

    def __init__(self, aggregate: str = "mean"):
        if aggregate not in AGGREGATES:
            raise ValueError(f"aggregate must be one of {AGGREGATES}; got {aggregate!r}")
        self.aggregate_by = aggregate
        self.decodes_alone = aggregate == "mean"
        self._plans: dict = {}  # caches, not state: layout -> row_plan
        self._rows: dict = {}  # (the device path's) layout -> AlignedRows
        self._buffers = Buffers()

    def _encode(self, x: torch.Tensor, dtype: torch.dtype, bucket: BucketInfo) -> Payload:
        # The scale must not depend on where DDP put each parameter in the bucket (a resumed run starts on
        # DDP's first layout and must follow the run that never stopped bit for bit): mean_magnitude says how.
        if on_device(x):
            rows = self._rows.get((bucket.key, x.numel()))
            if rows is None:
                rows = self._rows[(bucket.key, x.numel())] = AlignedRows(bucket, x.numel(), ROW)
            return Payload([sign_device.pack_signs(x), sign_device.mean_magnitude(x, rows)],
                           ctx=(x.numel(), dtype, bucket))
        scale = mean_magnitude(x, bucket, self._plans)
        return Payload([pack_signs(x), scale], ctx=(x.numel(), dtype, bucket))

    def compress(self, tensor, bucket):
        return self._encode(tensor, tensor.dtype, bucket)

    def decompress(self, tensors, ctx):
        words, scale = tensors
        n, dtype, bucket = ctx
        if on_device(words):
            return sign_device.decode(words, n, scale, dtype)
        return decode_signs(words, n, scale, self._buffers.take(bucket, n, dtype, words.device))

    def aggregate(self, gathered, ctx):
        words, scales = gathered  # (world, n_words) int64, (world, 1) fp32
        n, dtype, bucket = ctx
        if on_device(words):
            return sign_device.aggregate(words, scales, n, dtype, self.aggregate_by)
        world, device = words.shape[0], words.device
        take = self._buffers.take
        if world == 1:  # one rank's vote is its sign: both rules decode its payload
            return decode_signs(words[0], n, scales.reshape(1), take(bucket, n, dtype, device))
        if self.aggregate_by == "majority":
            counts, ranks = take(bucket, n, torch.int32, device), take(bucket, n, torch.int32, device)
            one = torch.ones((), dtype=torch.int32, device=device)
            bit = bitpack.bit_table(torch.zeros_like(one), one)
            bitpack.unpack_table(words[0], n, bit, out=counts)
            for r in range(1, world):
                counts.add_(bitpack.unpack_table(words[r], n, bit, out=ranks))
            del ranks
            # count c of +1 votes: (#plus - #minus) = 2c - world, its sign the vote (ties 0)
            votes = torch.arange(world + 1, device=device).mul_(2).sub_(world).sign_()
            table = votes.to(torch.float32).mul_(scales.sum()).to(dtype)
            return torch.index_select(table, 0, counts, out=take(bucket, n, dtype, device))
        total, part = take(bucket, n, torch.float32, device), take(bucket, n, torch.float32, device)
        decode_signs(words[0], n, scales[0], total)
        for r in range(1, world):
            total.add_(decode_signs(words[r], n, scales[r], part))
        del part
        return total if dtype == torch.float32 else take(bucket, n, dtype, device).copy_(total)


class SignumCompressor(KeptInBucketState, ScaledSignCompressor):
    """Signum: keeps ``m = momentum * m + (1 - momentum) * g`` per bucket (fp32, per parameter in checkpoints)
    and sends ``sign(m)`` as 1 bit per entry plus ``mean(|m|)`` as one fp32 number, by all-gather.

    Non-finite momentum entries are reset to zero after being sent, so one overflowing step (which AMP skips)
    does not poison the later ones.
    """

    stateful = True

    def __init__(self, momentum: float, aggregate: str = "mean"):
        super().__init__(aggregate)
        self.momentum = momentum
        self._state = BucketState(("momentum",), owner="SignumCompressor")

    def compress(self, tensor, bucket):
        # (``find`` shapes a momentum it builds from checkpointed pieces like its second argument: fp32)
        like = tensor if tensor.dtype == torch.float32 else torch.empty(tensor.shape, device=tensor.device)
        old = self._state.find(bucket, like)
        if old is None:
            m = torch.empty(tensor.shape, dtype=torch.float32, device=tensor.device).copy_(tensor)
            m.mul_(1.0 - self.momentum)
        else:  # in place: the momentum of this layout is this compressor's own
            m = old["momentum"].mul_(self.momentum).add_(tensor, alpha=1.0 - self.momentum)
        payload = self._encode(m, tensor.dtype, bucket)
        self._state.put(bucket, {"momentum": torch.nan_to_num_(m, nan=0.0, posinf=0.0, neginf=0.0)})
        return payload


_AGGREGATE_HELP = "how ranks' signs combine: 'mean' of the scaled signs, or 'majority' vote (ties 0)"


@register("signsgd", paper="Bernstein et al. 2018, signSGD: compressed optimisation for non-convex problems "
                           "(majority vote: signSGD with majority vote is communication efficient and fault tolerant)")
def signsgd(aggregate: Annotated[str, OneOf(*AGGREGATES), _AGGREGATE_HELP] = "majority") -> Method:
    """signSGD: 1 bit per entry plus one fp32 scale per rank by all-gather; mean of scaled signs or majority vote."""
    return Method(ScaledSignCompressor(aggregate), NoMemory(), AllgatherCommunicator())


@register("signum", paper="Bernstein et al. 2018, signSGD (Signum: sign of the momentum)")
def signum(momentum: Annotated[float, Range(0, 1, high_open=True), "momentum of the signed running average"] = 0.9,
           aggregate: Annotated[str, OneOf(*AGGREGATES), _AGGREGATE_HELP] = "majority") -> Method:
    """Signum: the sign of a per-bucket momentum, 1 bit per entry plus one fp32 scale per rank by all-gather."""
    return Method(SignumCompressor(momentum, aggregate), NoMemory(), AllgatherCommunicator())


@register("efsignsgd", paper="Karimireddy et al. 2019, Error feedback fixes SignSGD and other gradient "
                             "compression schemes")
def efsignsgd() -> Method:
    """EF-signSGD: the scaled sign mean(|v|) * sign(v) of the compensated gradient, with error feedback."""
    return Method(ScaledSignCompressor("mean"), ResidualMemory(), AllgatherCommunicator())
