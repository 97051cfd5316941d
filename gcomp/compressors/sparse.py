"""The value + position codec that top-k, threshold and DGC share: what differs is which entries they pick."""
from __future__ import annotations

import torch

from gcomp.bucket import BucketInfo, index_dtype
from gcomp.bucket_state import Scratch
from gcomp.core import ALLGATHER, Compressor, Payload

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


class SparseCompressor(Compressor):
    """Sends chosen entries as values (the bucket's dtype) and positions (int32; int64 past 2**31 entries), by
    all-gather. Subclasses pick the entries in ``compress`` and return ``sparse_payload``; entries several
    ranks sent are summed, and a zero value at position 0 (padding) adds nothing.

    Decoding writes into one of two buffers kept per bucket layout (``gcomp.bucket_state.Scratch``: DDP holds
    the last step's result while the next is decoded), cleared and added into, not a fresh zeroed bucket. With
    error feedback, ``residual_into`` copies the compensated bucket and subtracts the sent entries: nothing is
    decoded for the memory. That needs distinct positions (``distinct_positions``), which top-k and threshold
    select; a codec that pads with repeated positions sets it False and the memory decodes as usual.
    """

    collective = ALLGATHER
    distinct_positions = True

    @property
    def _decoded(self) -> Scratch:
        scratch = self.__dict__.get("_decoded_scratch")
        if scratch is None:  # subclasses need not call a base __init__
            scratch = self.__dict__["_decoded_scratch"] = Scratch(slots=2)
        return scratch

    def sparse_payload(self, values: torch.Tensor, index: torch.Tensor, like: torch.Tensor,
                       bucket: BucketInfo | None = None) -> Payload:
        """``values`` at positions ``index`` of ``bucket``'s layout (a bucket shaped like ``like``); ``bucket``
        lets the decoder reuse its output buffer. The buffers travel in the context, made here, by the encode on
        the caller's thread: a decode, on the backend's threads, never adds to this object."""
        n = like.numel()
        index = index.to(index_dtype(n))
        return Payload([values, index], ctx=(n, like.dtype, bucket, None if bucket is None else self._decoded))

    def decompress(self, tensors, ctx):
        values, index = tensors
        n, dtype, bucket, scratch = ctx
        if scratch is None:
            out = torch.zeros(n, dtype=dtype, device=values.device)
        else:
            out = scratch.take(bucket, n, dtype, values.device).zero_()
        return out.index_add_(0, index, values)

    def aggregate(self, gathered, ctx):
        values, index = gathered
        return self.decompress([values.reshape(-1), index.reshape(-1)], ctx)

    def residual_into(self, out, tensor, payload):
        if not self.distinct_positions:
            return False
        values, index = payload.tensors
        flat = tensor.reshape(-1)
        torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0, out=out.view(-1))
        # at a sent position: the entry less what was sent, as compensated - decompress(payload) gives it
        left = torch.nan_to_num_(flat[index] - values, nan=0.0, posinf=0.0, neginf=0.0)
        out.view(-1).index_put_((index,), left)
        return True
