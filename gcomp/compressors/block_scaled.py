"""``fp8`` and ``mx``: block-scaled low-precision reductions in two phases (every sum in fp32), with error feedback.

The formats themselves (element codes, block scales, rounding) are ``gcomp.compressors.block_formats``'s; this
module lays a bucket out in one chunk per rank, encodes and decodes those chunks, sums what a rank owns, and
keeps the owner's rounding error. The collectives: ``gcomp.collectives.two_phase``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.bucket_state import BucketState, Scratch
from gcomp.collectives.two_phase import TwoPhaseCommunicator
from gcomp.compressors.block_formats import block_format
from gcomp.compressors.block_scaled_rows import TwoPhaseRows
from gcomp.compressors.device_random import DeviceStream
from gcomp.core import ALLGATHER, Compressor, Payload, check_state, sum_by_name
from gcomp.memory import NoMemory, ResidualMemory
from gcomp.method import Method
from gcomp.params import OneOf, Range
from gcomp.registry import register

FP8_FORMATS = ("e4m3", "e5m2")
MX_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4")
ROUNDINGS = ("nearest", "stochastic")


@dataclass
class RowsCtx:
    """One encoded bucket: ``rows`` chunks of ``width`` entries (a multiple of the block), of which the first
    ``valid`` of each row are the input's (FSDP's rows) or, with ``valid`` None, the first ``numel`` of the rows
    read flat (a DDP bucket padded at its end). ``stray``: owner error sent along in this payload (see
    ``BlockScaledCompressor.compress``), which ``decompress`` does not count as sent."""

    bucket: BucketInfo
    shape: torch.Size
    dtype: torch.dtype
    numel: int
    rows: int
    width: int
    valid: int | None = None
    stray: torch.Tensor | None = None


class BlockScaledCompressor(Compressor):
    """On the wire, in two phases (``gcomp.collectives.two_phase.TwoPhaseCommunicator``): the bucket, padded with
    zeros to N chunks of c entries (c the smallest multiple of the format's block with N c >= n), each chunk
    encoded on its own (element codes, bit-packed, then the block scales: ``fmt.wire_bytes(c)`` bytes) and
    chunk r sent to rank r by all-to-all; rank r decodes the N chunks it received, sums them in fp32 (fp64 for an
    fp64 bucket), adds its own second-phase error, re-encodes the sum, and every rank's encoded sum goes to
    every rank by all-gather; each rank decodes the N sums. Per rank and step N + 1 encoded chunks are handed
    to the collectives (``bytes_sent``), of which 2 (N - 1) leave it.

    Error feedback (``error_feedback=True``): the method's ``ResidualMemory`` keeps each rank's first-phase
    rounding error; this compressor keeps the owner's second-phase error, one flat tensor per bucket layout
    (zero outside the rank's chunk), per parameter in checkpoints, handed back by ``flush``. Stochastic
    rounding draws from a generator seeded alike on every rank (``DeviceStream``), its draws in ``state_dict``.
    """

    collective = ALLGATHER
    decodes_alone = False  # the result is the owners' re-encoded sums, not the sum of what ranks sent
    depends_on_layout = True  # blocks span neighbouring parameters

    def __init__(self, fmt_name: str, fmt, rounding: str, error_feedback: bool, seed: int = 0):
        self.fmt_name, self.fmt, self.rounding = fmt_name, fmt, rounding
        self.error_feedback = error_feedback
        self.stateful = self.holds_gradient = error_feedback
        self.stream = DeviceStream(seed, f"block-scaled {fmt_name}")
        self._owner = BucketState(("owner_error",), owner=f"{fmt_name} owner error")
        # memory, not state: the padded fp32 bucket encoded from, the own payload decoded for the residual, and
        # the results (DDP holds one into the next step: two kept)
        self._rows, self._decoded, self._results = Scratch(slots=1), Scratch(slots=1), Scratch(slots=2)
        self._sums, self._row = Scratch(slots=1), Scratch(slots=1)  # the owner's sum, a chunk decoded into it
        self._codes, self._owner_codes = Scratch(slots=2), Scratch(slots=2)  # the two phases' element codes
        self.world, self.rank = 1, 0

    def bind(self, model, group, stats) -> None:
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)

    # --- chunks ----------------------------------------------------------------------------------------------

    def width(self, numel: int, rows: int) -> int:
        """Entries per chunk: ``numel`` split in ``rows``, rounded up to the block (at least one block)."""
        block = self.fmt.block
        return max(1, -(-numel // (rows * block))) * block

    def _generator(self, device) -> torch.Generator | None:
        return self.stream.next(device) if self.rounding == "stochastic" else None

    def encode_rows(self, rows: torch.Tensor, bucket: BucketInfo | None = None, kept: Scratch | None = None
                    ) -> list[torch.Tensor]:
        """Each row of ``rows`` (fp32, ``(R, c)``) encoded on its own, stacked: tensor i is ``(R, len_i)``. With
        ``kept``, the element codes are written straight into its buffer for ``bucket`` (no stack, no fresh
        pages): it hands out only buffers nobody holds, so a payload still in flight keeps its own."""
        codes = None
        if kept is not None:
            size = rows.shape[1] * self.fmt.element_bits // 8
            codes = kept.take(bucket, rows.shape[0] * size, torch.uint8, rows.device).view(rows.shape[0], size)
        encoded = [self.fmt.encode(row, rounding=self.rounding, generator=self._generator(rows.device),
                                   codes=None if codes is None else codes[r]) for r, row in enumerate(rows)]
        if len(encoded) == 1:  # one row: its tensors as they are, no copy
            return [part.unsqueeze(0) for part in encoded[0]]
        first = codes if codes is not None else torch.stack([e[0] for e in encoded])
        return [first, *(torch.stack(parts) for parts in list(zip(*encoded))[1:])]

    def decode_rows(self, tensors, width: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """The ``(R, width)`` fp32 decode of stacked rows, each decoded straight into its place (in ``out``)."""
        rows = tensors[0].shape[0]
        out = torch.empty(rows, width, dtype=torch.float32, device=tensors[0].device) if out is None else out
        for r in range(rows):
            self.fmt.decode([t[r] for t in tensors], width, out=out[r])
        return out

    # --- the first phase -------------------------------------------------------------------------------------

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Payload:
        """The bucket in ``self.world`` chunks, each encoded. Owner error that lies outside this rank's chunk
        (after DDP moved the parameters, or a resize) is added here, sent now, and not counted as sent by
        ``decompress``, so the memory keeps it as residual if rounding loses it: nothing is lost."""
        flat, numel = tensor.reshape(-1), tensor.numel()
        width = self.width(numel, self.world)
        stray = self._stray(bucket, flat, width)
        if stray is None and flat.dtype == torch.float32 and numel == self.world * width:
            rows = flat  # encoded as it is: no padding, no cast
        else:
            rows = self._rows.take(bucket, self.world * width, torch.float32, flat.device)
            rows[numel:].zero_()
            if stray is None:
                rows[:numel].copy_(flat)
            else:
                torch.add(flat, stray, out=rows[:numel])
        ctx = RowsCtx(bucket, tensor.shape, tensor.dtype, numel, self.world, width, stray=stray)
        return Payload(self.encode_rows(rows.view(self.world, width), bucket, self._codes), ctx)

    def compress_rows(self, tensor: torch.Tensor, bucket: BucketInfo, rows: int) -> Payload:
        """FSDP2's input (flat, ``rows`` shard-major rows of S entries) with each row padded to the block and
        encoded on its own."""
        valid = tensor.numel() // rows
        width = self.width(valid, 1)
        padded = torch.zeros(rows, width, dtype=torch.float32, device=tensor.device)
        padded[:, :valid].copy_(tensor.reshape(rows, valid))
        ctx = RowsCtx(bucket, tensor.shape, tensor.dtype, tensor.numel(), rows, width, valid=valid)
        return Payload(self.encode_rows(padded, bucket, self._codes), ctx)

    def decompress(self, tensors, ctx: RowsCtx) -> torch.Tensor:
        """What this rank's payload carries of the tensor it was compressed from (its own rounding, before any
        exchange): what the error-feedback memory subtracts."""
        kept = self._decoded.take(ctx.bucket, ctx.rows * ctx.width, torch.float32, tensors[0].device)
        out = self.decode_rows(tensors, ctx.width, kept.view(ctx.rows, ctx.width))
        flat = out[:, :ctx.valid].reshape(-1) if ctx.valid is not None else out.view(-1)[:ctx.numel]
        if ctx.stray is not None:
            flat = flat - ctx.stray
        return flat.to(ctx.dtype).view(ctx.shape)

    def residual_into(self, out: torch.Tensor, tensor: torch.Tensor, payload: Payload) -> bool:
        """``tensor - decompress(payload)``, non-finite entries 0, into ``out``, fused slab by slab with the decode
        (``BlockFormat.decode``'s ``minuend``): the decoded bucket is never written out. fp32 DDP buckets with no
        stray owner error only; else False (the memory decompresses and subtracts)."""
        ctx = payload.ctx
        if ctx.valid is not None or ctx.stray is not None or tensor.dtype != torch.float32 \
                or out.dtype != torch.float32:
            return False
        flat, into = tensor.reshape(-1), out.view(-1)
        for r in range(ctx.rows):
            low, high = r * ctx.width, min(ctx.numel, (r + 1) * ctx.width)
            if high > low:
                self.fmt.decode([t[r] for t in payload.tensors], ctx.width, out=into[low:high],
                                minuend=flat[low:high])
        return True

    # --- the second phase and the result ---------------------------------------------------------------------

    def sum_received(self, received, width: int, dtype: torch.dtype, bucket: BucketInfo) -> torch.Tensor:
        """The fp32 (fp64 for fp64 buckets) sum of the ``(N, width)`` received chunks, decoded, in rank order."""
        device = received[0].device
        total = self.fmt.decode([t[0] for t in received], width,
                                out=self._sums.take(bucket, width, torch.float32, device))
        total = total.to(torch.promote_types(torch.float32, dtype))
        row = self._row.take(bucket, width, torch.float32, device) if received[0].shape[0] > 1 else None
        for r in range(1, received[0].shape[0]):
            total += self.fmt.decode([t[r] for t in received], width, out=row)
        return total

    def second_phase(self, received, ctx: RowsCtx) -> list[torch.Tensor]:
        """This rank's chunk: the sum of what every rank sent for it, plus the owner's kept error, re-encoded;
        the new error (the sum less its decode) is kept."""
        total = self.sum_received(received, ctx.width, ctx.dtype, ctx.bucket)
        low, high = self.rank * ctx.width, min(ctx.numel, (self.rank + 1) * ctx.width)
        error = None
        if self.error_feedback and high > low:
            error = self._owner.get(ctx.bucket, self._like(ctx, total.device))["owner_error"]
            total[:high - low] += error[low:high]
        encoded = self.encode_rows(total.float().view(1, -1), ctx.bucket, self._owner_codes)
        if error is not None:
            sent = self.fmt.decode([t[0] for t in encoded], ctx.width,
                                   out=self._row.take(ctx.bucket, ctx.width, torch.float32, total.device))[:high - low]
            mine = torch.sub(total[:high - low], sent, out=error[low:high])
            torch.nan_to_num_(mine, nan=0.0, posinf=0.0, neginf=0.0)
        return encoded

    def aggregate(self, gathered, ctx: RowsCtx) -> torch.Tensor:
        """Every owner's re-encoded sum, decoded: the mean gradient (the hook divided by N before)."""
        kept = self._results.take(ctx.bucket, gathered[0].shape[0] * ctx.width, torch.float32, gathered[0].device)
        out = self.decode_rows(gathered, ctx.width, kept.view(-1, ctx.width)).view(-1)[:ctx.numel]
        return out.to(ctx.dtype).view(ctx.shape)

    # --- the owner's error: state ----------------------------------------------------------------------------

    def _like(self, ctx: RowsCtx, device: torch.device) -> torch.Tensor:
        """A tensor of the bucket's size, in the dtype the owner error is kept in, with no memory of its own."""
        return torch.zeros(1, dtype=torch.promote_types(torch.float32, ctx.dtype), device=device).expand(ctx.numel)

    def _stray(self, bucket: BucketInfo, flat: torch.Tensor, width: int) -> torch.Tensor | None:
        """Owner error outside this rank's chunk, taken out of the state (only on a layout seen for the first
        time: a rebuilt bucket, a resumed or resized run); None when there is none."""
        if not self.error_feedback or self._owner.has(bucket):
            return None
        held = self._owner.find(bucket, self._like(RowsCtx(bucket, flat.shape, flat.dtype, flat.numel(), 1, width),
                                                   flat.device))
        if held is None:
            return None
        error = held["owner_error"]
        low, high = self.rank * width, min(flat.numel(), (self.rank + 1) * width)
        stray = error.clone()
        stray[low:high] = 0
        error[:low] = 0
        error[high:] = 0
        return stray

    def flush(self, bucket: BucketInfo, like: torch.Tensor) -> torch.Tensor | None:
        if not self.error_feedback:
            return None
        held = self._owner.find(bucket, like.reshape(-1).to(torch.promote_types(torch.float32, like.dtype)))
        if held is None:
            return None
        error = held["owner_error"]
        out = error.to(like.dtype).clone()
        error.zero_()
        return out

    def state_dict(self) -> dict:
        state = {"stream": self.stream.state_dict()}
        if self.error_feedback:
            state["owner"] = self._owner.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"stream": dict, **({"owner": dict} if self.error_feedback else {})})
        self.stream.load_state_dict(state["stream"])
        if self.error_feedback:
            self._owner.load_state_dict(state["owner"])

    @property
    def replicated(self) -> bool:
        return not self.error_feedback  # the stream is every rank's; the owner error is a rank's own

    def parameter_state(self, state: dict) -> dict:
        return {"owner_error": state["owner"]["owner_error"]} if self.error_feedback else {}

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        state = {"stream": dict(every[0]["stream"])}
        if self.error_feedback:  # summed: what lies outside the new chunk goes out with the next first phase
            state["owner"] = {"owner_error": sum_by_name([s["owner"]["owner_error"] for s in assigned])}
        return state


def _method(fmt_name: str, fmt, rounding: str, error_feedback: bool) -> Method:
    compressor = BlockScaledCompressor(fmt_name, fmt, rounding, error_feedback)
    return Method(compressor, ResidualMemory() if error_feedback else NoMemory(), TwoPhaseCommunicator())


@register("fp8", paper="Micikevicius et al. 2022 (FP8 formats for deep learning, arXiv 2209.05433)", fsdp=TwoPhaseRows)
def fp8(format: Annotated[str, OneOf(*FP8_FORMATS), "element format"] = "e4m3",
        block: Annotated[int, Range(4, 4096), "entries per fp32 scale (a multiple of 4)"] = 128,
        error_feedback: Annotated[bool, "keep both phases' rounding errors for later steps"] = True,
        rounding: Annotated[str, OneOf(*ROUNDINGS), "round to nearest even, or stochastically (unbiased)"
                            ] = "nearest") -> Method:
    """FP8 (E4M3 or E5M2) with one fp32 scale per block, reduced in two phases (all-to-all, fp32 sum,
    all-gather) with error feedback: about 8 + 32/block bits per entry per phase."""
    if block % 4:
        raise ValueError(f"fp8: block must be a multiple of 4; got {block}")
    return _method(format, block_format(f"fp8_{format}", block=block), rounding, error_feedback)


@register("mx", paper="OCP Microscaling Formats (MX) v1.0 (2023); NVIDIA NVFP4 (2025)", fsdp=TwoPhaseRows)
def mx(format: Annotated[str, OneOf(*MX_FORMATS), "element and block format"] = "mxfp8_e4m3",
       error_feedback: Annotated[bool, "keep both phases' rounding errors for later steps"] = True,
       rounding: Annotated[str, OneOf(*ROUNDINGS), "round to nearest even, or stochastically (unbiased)"
                           ] = "nearest") -> Method:
    """OCP Microscaling (MXFP8, MXFP6, MXFP4: 32-entry blocks, a power-of-two scale each) or NVFP4 (16-entry
    blocks, an E4M3 scale each), reduced in two phases with error feedback: 4.25 to 8.25 bits per entry per phase."""
    return _method(format, block_format(format), rounding, error_feedback)
