"""The value + position codec that top-k, threshold and DGC share: what differs is which entries they pick."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import torch

from gcomp.bucket import BucketInfo, index_dtype
from gcomp.bucket_state import Scratch
from gcomp.collectives import coded_positions, narrow_values
from gcomp.core import ALLGATHER, Compressor, Payload
from gcomp.params import OneOf

_KEY_DTYPES = {2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK = 1 << 18  # entries per pass of ``positions_at_least``: its keys stay in the cache


def magnitude_keys(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Integers that order like ``|x|``, with NaN above infinity (a float's bits less its sign bit), in the
    signed integer dtype of ``x``'s width. One pass, no float compare: NaN needs no special case."""
    ints = x.view(_KEY_DTYPES[x.element_size()])
    return torch.bitwise_and(ints, torch.iinfo(ints.dtype).max, out=out)


def positions_at_least(x: torch.Tensor, bound: torch.Tensor, dtype: torch.dtype = torch.int64,
                       strict: bool = False) -> torch.Tensor:
    """The positions (``dtype``, ascending) of ``x``'s entries whose ``magnitude_keys`` are >= ``bound`` (> with
    ``strict``), a 0-d key tensor. In cache-sized chunks, so no bucket-sized temporary: the keys of one chunk,
    its mask, its positions. The count sizes the result, so this is a host synchronisation (``nonzero``)."""
    flat = x.reshape(-1)
    keys = torch.empty(min(flat.numel(), CHUNK), dtype=_KEY_DTYPES[x.element_size()], device=x.device)
    compare = torch.gt if strict else torch.ge
    parts = []
    for start in range(0, flat.numel(), CHUNK):  # chunks, not elements: 64 rounds for 16M entries
        piece = flat[start:start + CHUNK]
        hit = compare(magnitude_keys(piece, out=keys[:piece.numel()]), bound).nonzero().squeeze(1)
        parts.append(hit.add_(start).to(dtype))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


POSITIONS = ("coded", "raw")
PositionsParam = Annotated[str, OneOf(*POSITIONS), "positions sorted and coded (Elias-Fano or bitmap, the smaller; "
                           "lossless), or raw int32 (int64 past 2**31 entries)"]
ValuesParam = Annotated[str, OneOf(*narrow_values.VALUE_DTYPES), "values on the wire: fp32 (the bucket's dtype), "
                        "bf16, fp16, fp8_e4m3 (one fp32 scale per payload); rounding stays in the residual"]


def check_wire(positions: str, values: str) -> tuple[str, str]:
    """``positions`` (coded or raw) and ``values`` (``gcomp.collectives.narrow_values``) checked."""
    if positions not in POSITIONS:
        raise ValueError(f"positions must be one of {', '.join(POSITIONS)}; got {positions!r}")
    return positions, narrow_values.check(values)


def entry_bits(n: int, k: int, positions: str, values: str, dtype: torch.dtype = torch.float32) -> float:
    """Bits on the wire per sent entry of a payload of ``k`` entries out of ``n``: the value's bits, fp8's scale
    shared among the k, and the position's (32, 64 past 2**31 entries, or ``coded_positions``')."""
    if not k:
        return 0.0
    value = narrow_values.value_bits(values, dtype) + 8 * narrow_values.scale_bytes(values) / k
    if positions == "raw":
        return value + 8 * index_dtype(n).itemsize
    return value + coded_positions.bits_per_position(n, k)


@dataclass
class SparseCtx:
    """One sparse payload's context: its bucket (``n`` entries of ``dtype``), ``k`` entries sent, the wire's
    forms, the decoder's buffers, and what the encoder sent, for the residual: ``index`` (positions, in the
    payload's order) and ``sent`` (their values as decoded, in the bucket's dtype)."""

    n: int
    dtype: torch.dtype
    bucket: BucketInfo | None
    scratch: Any
    k: int
    positions: str
    values: str
    index: torch.Tensor
    sent: torch.Tensor


class SparseCompressor(Compressor):
    """Sends chosen entries as values and positions by all-gather. Subclasses pick the entries in ``compress``
    and return ``sparse_payload``; entries several ranks sent are summed, and a zero value at position 0
    (padding) adds nothing.

    The wire (``positions``, ``values``, set by ``wire``): raw positions are int32 (int64 past 2**31 entries) in
    the order chosen; coded ones (``gcomp.collectives.coded_positions``) are sorted, the values permuted alike,
    and sent as one code of ``coded_positions.coded_bytes(n, k)`` bytes, the same on every rank (threshold: its own
    k per rank, ``ThresholdCompressor.aggregate_counts``), decoded for all ranks at once. Values go in the
    bucket's dtype (``fp32``) or narrower (``bf16``, ``fp16``, ``fp8_e4m3`` with one fp32 scale:
    ``gcomp.collectives.narrow_values``); what rounding takes off stays in the residual.

    Decoding writes into one of two buffers kept per bucket layout (``gcomp.bucket_state.Scratch``: DDP holds
    the last step's result while the next is decoded), cleared and added into, not a fresh zeroed bucket. With
    error feedback, ``residual_into`` copies the compensated bucket and subtracts the sent entries (as decoded):
    nothing is decoded for the memory. That needs distinct positions (``distinct_positions``), which top-k and
    threshold select; a codec that pads with repeated positions sets it False and the memory decodes as usual.
    """

    collective = ALLGATHER
    distinct_positions = True
    positions = "raw"
    values = "fp32"

    def wire(self, positions: str, values: str) -> None:
        """Send positions ``coded`` or ``raw`` and values as ``values``."""
        self.positions, self.values = check_wire(positions, values)

    @property
    def _decoded(self) -> Scratch:
        scratch = self.__dict__.get("_decoded_scratch")
        if scratch is None:  # subclasses need not call a base __init__
            scratch = self.__dict__["_decoded_scratch"] = Scratch(slots=2)
        return scratch

    def sparse_payload(self, values: torch.Tensor, index: torch.Tensor, like: torch.Tensor,
                       bucket: BucketInfo | None = None, positions: str | None = None) -> Payload:
        """``values`` at positions ``index`` of ``bucket``'s layout (a bucket shaped like ``like``); ``bucket``
        lets the decoder reuse its output buffer. The buffers travel in the context, made here, by the encode on
        the caller's thread: a decode, on the backend's threads, never adds to this object. ``positions``
        overrides the wire's form (``raw``: a device path that codes its positions later)."""
        n, k = like.numel(), index.numel()
        positions = positions or self.positions
        if positions == "coded":
            index, values = coded_positions.sort_pairs(index, values, n)
            code = coded_positions.encode(index, n)
        else:
            index = code = index.to(index_dtype(n))
        wire, scale, sent = narrow_values.narrow(values, self.values)
        tensors = [wire, code] if scale is None else [wire, code, scale]
        ctx = SparseCtx(n, like.dtype, bucket, None if bucket is None else self._decoded, k, positions,
                        self.values, index, sent)
        return Payload(tensors, ctx=ctx)

    def _unwire(self, tensors, ctx: SparseCtx) -> tuple[torch.Tensor, torch.Tensor]:
        """Values (bucket dtype) and int positions of a payload's tensors, or of a stack of them (flattened)."""
        wire, code = tensors[0], tensors[1]
        scale = tensors[2][..., :1] if len(tensors) > 2 else None  # (1,), or (world, 1) gathered (sized: padded)
        values = narrow_values.widen(wire, ctx.values, scale, ctx.dtype)
        index = coded_positions.decode(code, ctx.n, ctx.k) if ctx.positions == "coded" else code
        return values.reshape(-1), index.reshape(-1)

    def decompress(self, tensors, ctx):
        values, index = self._unwire(tensors, ctx)
        if ctx.scratch is None:
            out = torch.zeros(ctx.n, dtype=ctx.dtype, device=values.device)
        else:
            out = ctx.scratch.take(ctx.bucket, ctx.n, ctx.dtype, values.device).zero_()
        return out.index_add_(0, index, values)

    def aggregate(self, gathered, ctx):
        return self.decompress(gathered, ctx)  # a (world, ...) stack: every rank's decoded at once

    def residual_into(self, out, tensor, payload):
        if not self.distinct_positions:
            return False
        index, sent = payload.ctx.index, payload.ctx.sent
        flat = tensor.reshape(-1)
        torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0, out=out.view(-1))
        # at a sent position: the entry less what was sent, as compensated - decompress(payload) gives it
        left = torch.nan_to_num_(flat[index] - sent, nan=0.0, posinf=0.0, neginf=0.0)
        out.view(-1).index_put_((index,), left)
        return True
