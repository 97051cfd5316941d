"""The block-float family: ``fp8`` and ``mx``, block-scaled low-precision reductions in two phases (every sum in
fp32, fp64 for an fp64 bucket), with error feedback. The formats: ``formats`` and ``minifloat``; the collectives:
``gcomp.collectives.two_phase``."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Annotated

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gcomp.collectives.two_phase import TwoPhaseCommunicator, TwoPhaseCompressor
from gcomp.compressors.blockfloat.formats import BlockFormat, block_format
from gcomp.compressors.blockfloat.minifloat import ROUNDINGS
from gcomp.core import ALLGATHER, Keeps, NoMemory, Payload, ResidualMemory, Traits, relative
from gcomp.method import Method
from gcomp.params import OneOf, Range
from gcomp.randomness import Stream
from gcomp.registry import register
from gcomp.sharding import ShardLayout
from gcomp.state_checks import check_state

FP8_FORMATS = ("e4m3", "e5m2")
MX_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4", "nvfp4")


@dataclass
class _Ctx:
    """One encoded bucket: chunks of ``width`` entries, of which the first ``numel`` read flat are the bucket's
    (DDP), or the first ``valid`` of each row (FSDP2's rows). ``owner``: the owner error slot, this rank's chunk
    ``[low, high)`` of it filled by ``second_phase``; ``stray``: owner error outside that chunk, sent along in this
    payload (not part of what the payload carries of the bucket)."""

    numel: int
    width: int
    dtype: torch.dtype
    valid: int | None = None
    owner: torch.Tensor | None = None
    low: int = 0
    high: int = 0
    stray: torch.Tensor | None = None


def _bound(fmt: BlockFormat, rounding: str) -> float:
    """The error of the two roundings over the block's largest magnitude summed over the ranks, u + u (1 + u),
    from one rounding's u: half a step of the element's top binade (a whole step stochastically), or, for MX, the
    saturation of a block whose amax lies up to ``2^(emax + 1)`` in the element's units, or for NVFP4 the whole
    block (one 2^19 times below its row's largest has a zero scale)."""
    u = 2.0 ** -(fmt.element.mbits + (rounding == "nearest")) if fmt.kind != "nvfp4" else 1.0
    if fmt.kind == "mx":
        u = max(u, 1 - fmt.element.max / 2.0 ** (fmt.element.emax + 1))
    return u + u * (1 + u)


class BlockScaledCompressor(TwoPhaseCompressor):
    """On the wire, in two phases (``TwoPhaseCommunicator``): the bucket, padded with zeros to N chunks of c
    entries (c the smallest multiple of the format's block with N c >= n), each chunk encoded on its own (element
    codes, bit-packed, then the block scales: ``fmt.wire_bytes(c)`` bytes) and chunk r sent to rank r by
    all-to-all; rank r decodes the N chunks it received, sums them in fp32 (fp64 for an fp64 bucket), adds its
    own second-phase error, re-encodes the sum, and every rank's encoded sum goes to every rank by all-gather;
    each rank decodes the N sums. Per rank and step N + 1 encoded chunks are handed to the collectives, of which
    2 (N - 1) leave it. Under FSDP2, phase one alone: each of FSDP's N rows (S entries) padded to a multiple of
    the block and encoded on its own, row r to rank r by all-to-all, rank r's shard the sum of the rows it
    received, decoded (no second rounding, no owner error).

    Error feedback (``error_feedback=True``): the method's ``ResidualMemory`` keeps each rank's first-phase
    rounding error (``payload.residual``, from the encode's own decode); the owner's second-phase error is the
    held slot ``owner_error`` (zero outside the rank's chunk; what lies outside after DDP moved the parameters, or
    a resize, goes out with the next first phase). Stochastic rounding draws from a stream seeded alike on every
    rank."""

    def __init__(self, fmt_name: str, fmt: BlockFormat, rounding: str, error_feedback: bool, seed: int = 0):
        self.fmt, self.rounding, self.error_feedback = fmt, rounding, error_feedback
        self.stream = Stream(seed, f"block-scaled {fmt_name}")
        self.world, self.rank = 1, 0
        # the owner errors it handed back, by id: zero outside this rank's chunk
        self._placed: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        slots = ("owner_error",) if error_feedback else ()
        self.traits = Traits(ALLGATHER, relative(_bound(fmt, rounding), fmt.block), Keeps.SHARED, slots=slots,
                             held=slots, rows="native",
                             wire_bytes=lambda b, world: (world + 1) * fmt.wire_bytes(self.width(b.numel, world)),
                             decodes_alone=False,  # the owners' re-encoded sums, not the sum of what ranks sent
                             depends_on_layout=True)  # blocks span neighbouring parameters

    def bind(self, model, group, stats) -> None:
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)

    def width(self, numel: int, rows: int) -> int:
        """Entries per chunk: ``numel`` split in ``rows``, rounded up to the block (at least one block)."""
        return max(1, -(-numel // (rows * self.fmt.block))) * self.fmt.block

    def _encode(self, rows: torch.Tensor, decoded: bool):
        generator = self.stream.next(rows.device) if self.rounding == "stochastic" else None
        return self.fmt.encode(rows, self.rounding, generator, decoded)

    def encode(self, x, state, layout):
        wide = torch.promote_types(torch.float32, x.dtype)
        if isinstance(layout, ShardLayout):
            rows = x.view(layout.world, -1)
            width = self.width(rows.shape[1], 1)
            tensors, decoded = self._encode(F.pad(rows.float(), (0, width - rows.shape[1])), self.error_feedback)
            residual = None if decoded is None else (rows - decoded[:, :rows.shape[1]]).view(-1).to(x.dtype)
            return Payload(tensors, _Ctx(x.numel(), width, layout.dtype, rows.shape[1]), rows=True,
                           residual=residual), state
        numel, v = x.numel(), x.reshape(-1)
        width = self.width(numel, self.world)
        ctx = _Ctx(numel, width, layout.dtype)
        if self.error_feedback:
            owner = state["owner_error"].to(wide)
            ctx.owner, ctx.low, ctx.high = owner, self.rank * width, min(numel, (self.rank + 1) * width)
            if self._placed.get(id(owner)) is not owner:  # a layout taken up (DDP's rebuild, a load, a resize)
                ctx.stray = owner.clone()
                ctx.stray[ctx.low:ctx.high] = 0
                owner[:ctx.low] = 0
                owner[ctx.high:] = 0
                v = v + ctx.stray
                self._placed[id(owner)] = owner
            state = {"owner_error": owner}
        tensors, decoded = self._encode(F.pad(v.float(), (0, self.world * width - numel)).view(self.world, width),
                                        self.error_feedback)
        residual = None if decoded is None else (v - decoded.view(-1)[:numel]).to(x.dtype)
        return Payload(tensors, ctx, residual=residual), state

    def _sum(self, received, ctx: _Ctx) -> torch.Tensor:
        """The sum of the ``(N, ...)`` chunks received, decoded."""
        return self.fmt.decode(received, ctx.width).to(torch.promote_types(torch.float32, ctx.dtype)).sum(0)

    def second_phase(self, received, ctx: _Ctx) -> list[torch.Tensor]:
        """This rank's chunk: the sum of what every rank sent for it, plus the owner's kept error, re-encoded; the
        new error (the sum less its decode) goes into the slot."""
        total, mine = self._sum(received, ctx), slice(0, max(0, ctx.high - ctx.low))
        if ctx.owner is not None:
            total[mine] += ctx.owner[ctx.low:ctx.high]
        tensors, sent = self._encode(total.float().view(1, -1), ctx.owner is not None)
        if ctx.owner is not None:
            error = torch.sub(total[mine], sent[0, mine], out=ctx.owner[ctx.low:ctx.high])
            error.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return tensors

    def decode(self, received, ctx: _Ctx):
        """Every owner's re-encoded sum, decoded: the mean (the hook divided by N before); under FSDP2 the sum of
        the rows received. A rank's own payload (a one-rank stack) decodes to what it carries of the bucket."""
        if received[0].dim() == 3:
            rows = self.fmt.decode([t[0] for t in received], ctx.width)
            if ctx.valid is not None:
                return rows[:, :ctx.valid].reshape(-1).to(ctx.dtype)
            flat = rows.view(-1)[:ctx.numel]
            return (flat if ctx.stray is None else flat - ctx.stray).to(ctx.dtype)
        if ctx.valid is not None:
            return self._sum(received, ctx)[:ctx.valid].to(ctx.dtype)
        return self.fmt.decode(received, ctx.width).view(-1)[:ctx.numel].to(ctx.dtype)

    def state_dict(self) -> dict:
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"stream": dict})
        self.stream.load_state_dict(state["stream"])


def _method(fmt_name: str, fmt: BlockFormat, rounding: str, error_feedback: bool) -> Method:
    return Method(BlockScaledCompressor(fmt_name, fmt, rounding, error_feedback),
                  ResidualMemory() if error_feedback else NoMemory(), TwoPhaseCommunicator())


@register("fp8", paper="Micikevicius et al. 2022 (FP8 formats for deep learning, arXiv 2209.05433)",
          variants=({"format": "e5m2", "block": 32, "rounding": "stochastic"},))
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


@register("mx", paper="OCP Microscaling Formats (MX) v1.0 (2023); NVIDIA NVFP4 (2025)",
          variants=({"format": "mxfp6_e3m2"}, {"format": "nvfp4"}))
def mx(format: Annotated[str, OneOf(*MX_FORMATS), "element and block format"] = "mxfp8_e4m3",
       error_feedback: Annotated[bool, "keep both phases' rounding errors for later steps"] = True,
       rounding: Annotated[str, OneOf(*ROUNDINGS), "round to nearest even, or stochastically (unbiased)"
                           ] = "nearest") -> Method:
    """OCP Microscaling (MXFP8, MXFP6, MXFP4: 32-entry blocks, a power-of-two scale each) or NVFP4 (16-entry
    blocks, an E4M3 scale each), reduced in two phases with error feedback: 4.25 to 8.25 bits per entry per phase."""
    return _method(format, block_format(format), rounding, error_feedback)
