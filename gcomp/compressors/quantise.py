"""What the stochastic quantisers (``terngrad``, ``qsgd``, ``natural``, ``pactrain``'s ternary path) share: random
streams per rank, per-parameter segments of a bucket and their scales, the work dtype, the wire form of a scale.

Random streams: a method's stream is seeded with ``stream_seed(seed, tag, rank)``, a 63-bit hash of the user's
seed, the method's tag and the rank (and, where a stream belongs to a parameter, its name). A plain formula such
as ``seed * C + rank`` makes seed 0 on rank r replay ``torch.Generator().manual_seed(r)``, which a user's own
code may draw from too (data order, initialisation): two streams meant to be independent would then be one.
"""
from __future__ import annotations

import hashlib
from abc import abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.core import Compressor, check_state
from gcomp.state_checks import generator_state
from gcomp.kernels import on_device, segments

_SEED_BITS = 63  # torch seeds are 64-bit; staying below the sign bit keeps every API happy


def stream_seed(seed: int, tag: str, rank: int | None = None, key: str = "") -> int:
    """The seed of one random stream: a hash of ``seed``, the method ``tag``, the ``rank`` (None: a stream every
    rank shares, such as ``randomk``'s positions) and an optional ``key`` (a parameter name)."""
    text = f"gcomp|{tag}|{int(seed)}|{'shared' if rank is None else int(rank)}|{key}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << _SEED_BITS) - 1)


class RankGenerator:
    """A compressor's random source: one ``torch.Generator`` per device, seeded ``stream_seed(seed, tag, rank)``.

    Ranks draw independently once ``bind(rank)`` is called (the same stream everywhere would round every
    rank's entries alike); the state of every generator used so far goes into ``state_dict``, and one loaded
    before its device is first used is applied when it is.
    """

    def __init__(self, seed: int, tag: str):
        self.seed, self.tag, self.rank = seed, tag, 0
        self._generators: dict[str, torch.Generator] = {}
        self._pending: dict[str, torch.Tensor] = {}

    def bind(self, rank: int) -> None:
        self.rank = rank
        self._generators.clear()

    def __call__(self, device: torch.device | str) -> torch.Generator:
        key = str(torch.device(device))
        generator = self._generators.get(key)
        if generator is None:
            generator = torch.Generator(device).manual_seed(stream_seed(self.seed, self.tag, self.rank))
            pending = self._pending.pop(key, None)
            if pending is not None:
                generator.set_state(pending)
            self._generators[key] = generator
        return generator

    def state_dict(self) -> dict:
        return {**self._pending, **{key: g.get_state() for key, g in self._generators.items()}}

    def load_state_dict(self, state: dict | torch.Tensor) -> None:
        if isinstance(state, torch.Tensor):  # a checkpoint from before per-device generators: the CPU one's
            state = {"cpu": state}
        if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
            raise ValueError(f"{self.tag}: the random generator state must map devices to generator states "
                             "(uint8 tensors)")
        for device, value in state.items():  # a wrong size must fail here, not at the first draw
            generator_state(self.tag, device, value)
        self._generators.clear()
        self._pending = {key: value.clone() for key, value in state.items()}


class SeededState:
    """Checkpointing for a codec whose only state is its random streams (``self.random``, a ``RankGenerator``):
    per rank; after a resize every rank starts its own stream afresh. Put it before ``Compressor`` in the bases."""

    random: RankGenerator

    def state_dict(self) -> dict:
        return {"generator": self.random.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"generator": (dict, torch.Tensor)})
        self.random.load_state_dict(state["generator"])

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return {"generator": {}}


def rank_and_world(group) -> tuple[int, int]:
    """This rank and the world size of ``group``; (0, 1) outside torch.distributed."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for 16-bit buckets (and fp32), fp64 for fp64 buckets."""
    return torch.promote_types(dtype, torch.float32)


def segment_lengths(bucket: BucketInfo, n: int) -> tuple[int, ...]:
    """The bucket's parameter sizes, or one segment when the layout does not describe the tensor."""
    return tuple(bucket.numels) if bucket.numel == n and bucket.numels else (n,)


def per_segment_(x: torch.Tensor, scales: torch.Tensor, lengths: tuple[int, ...], op) -> torch.Tensor:
    """``op(segment, its scale)`` in place for each segment along the last dimension of ``x`` (``scales``:
    one per segment along its last dimension). On the CPU a loop over parameters, not entries: it needs no
    per-entry index tensor (as large as the bucket), and ``repeat_interleave`` is far slower there; on the device
    path one operation for every segment (``gcomp.kernels.segments``)."""
    if on_device(x):
        return segments.per_segment_(x, scales, lengths, op)
    for view, scale in zip(torch.split(x, lengths, dim=-1), scales.unbind(-1)):
        if view.numel():
            op(view, scale.unsqueeze(-1))
    return x


def segment_scales(values: torch.Tensor, lengths: tuple[int, ...], clip: float = 0.0,
                   magnitudes: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """max |value| per segment, capped at ``clip * std`` (std about the mean, TernGrad's) where that cap is
    positive: a constant segment (one entry, say) has std 0 and keeps its max, so it is neither zeroed nor,
    with ``clip = inf``, turned into NaN. ``magnitudes`` may hold ``|values|`` already; ``out`` the result.
    Without ``magnitudes`` the max is ``max(max, -min)``, read straight from ``values`` (no ``|values|``
    temporary as large as the bucket); NaN stays NaN. On the device path: segment reductions
    (``gcomp.kernels.segments``)."""
    if on_device(values):
        return segments.segment_scales(values, lengths, clip, magnitudes, out)
    out = torch.zeros(len(lengths), dtype=values.dtype, device=values.device) if out is None else out
    start = 0
    for j, n in enumerate(lengths):  # a loop over parameters, not entries
        if n:
            if magnitudes is None:  # one pass for both ends (vector_norm with ord=inf is some 10x slower)
                low, high = torch.aminmax(values[start:start + n])
                torch.maximum(high, low.neg(), out=out[j])
            else:
                torch.amax(magnitudes[start:start + n], dim=0, out=out[j])
            if clip > 0:
                cap = clip * torch.std(values[start:start + n], correction=0)
                out[j] = torch.where(cap > 0, torch.minimum(out[j], cap), out[j])
            start += n
    return out


def wire_scale(scale: torch.Tensor) -> torch.Tensor:
    """``scale`` as fp32, rounded up where fp32 rounding would make it smaller (fp64 buckets), so that
    ``|value| / wire_scale <= 1`` still holds for every entry the scale bounds. NaN stays NaN."""
    wire = scale.to(torch.float32)
    if scale.dtype == torch.float64:
        wire = torch.where(wire.double() < scale, torch.nextafter(wire, torch.full_like(wire, torch.inf)), wire)
    return wire


class Scratch:
    """Work buffers kept per bucket layout (``BucketInfo.key``) and name, allocated at a layout's first step
    and reused at every later one: a fresh allocation as large as a bucket costs several copies of it in page
    faults on a CPU, more than the arithmetic done in it. Scratch, not state: never checkpointed, and a
    buffer's contents mean nothing from one step to the next."""

    def __init__(self):
        self._buffers: dict[tuple[str, str], torch.Tensor] = {}

    def __getstate__(self) -> dict:
        return {}  # memory, not state: a copy (deepcopy, pickle) starts with no buffers, and never iterates
        # a dict that a decode on the backend's threads may be adding to

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def get(self, key: str, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buffer = self._buffers.get((key, name))
        if buffer is None or buffer.numel() != numel or buffer.dtype != dtype or buffer.device != device:
            buffer = self._buffers[(key, name)] = torch.empty(numel, dtype=dtype, device=device)
        return buffer


_UNIT = {torch.float32: (torch.int32, 23, 0x3F800000), torch.float64: (torch.int64, 52, 0x3FF0000000000000)}


def draw_units(words: torch.Tensor, n: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    """``n`` independent draws uniform on the grid ``1 + j / 2^m`` of [1, 2) (m = 23 for fp32, 52 for fp64),
    written into ``words``, an int64 buffer of at least ``n * itemsize / 8`` words, and returned as a view.

    Each word is one full 64-bit draw of ``generator`` (two fp32 draws per word): the cheapest way found to take
    random bits from a CPU generator (about two thirds of the time of ``uniform_`` on as many floats). The
    mantissa bits of a draw become the fraction, the exponent those of 1.0: no int-to-float conversion.
    """
    ints, bits, one = _UNIT[dtype]
    words.random_(-2**63, None, generator=generator)  # the full 64-bit range: every bit uniform
    view = words.view(ints)[:n]
    return view.bitwise_and_((1 << bits) - 1).bitwise_or_(one).view(dtype)


def add_scaled_(draws: torch.Tensor, values: torch.Tensor, factors: torch.Tensor, lengths: tuple[int, ...],
                divide: bool = False) -> torch.Tensor:
    """``draws += values * factor`` (``/ factor`` with ``divide``) per segment, in place: the stochastic
    rounding ``floor(z + w)`` of the scaled values ``z`` against draws ``w`` uniform on [1, 2) (``draw_units``).

    ``floor(z + w)`` is ``floor(z) + 1`` or ``floor(z) + 2``, the latter with probability equal to the
    fractional part of ``z`` (for either sign of ``z``): one add instead of a floor, a subtraction and a
    comparison with draws on [0, 1). Up to rounding: the draws sit on a 2^-23 grid (fp32), and ``z + w`` is
    rounded to fp32, which adds at most half an fp32 ulp of the boundary ``floor(z) + 2`` to that probability
    (none while ``|floor(z) + 2| <= 2``; 2^-18 for QSGD's top levels near 128), the precision ``z`` itself has.
    """
    op = torch.addcdiv if divide else torch.addcmul
    for d, v, f in zip(torch.split(draws, lengths), torch.split(values, lengths), factors.unbind(-1)):
        if d.numel():
            op(d, v, f, out=d)
    return draws


@dataclass
class RankwiseCtx:
    """A ``RankwiseDecoder``'s payload context: ``n`` entries of ``dtype``, per-parameter segment ``lengths``
    (empty for a codec without per-parameter scales), ``key`` (the bucket layout: its scratch buffers), ``tensor``
    (what was compressed: ``aggregate``, the hook's decode, writes the result into it) and ``values`` (the entries
    in the work dtype, when the codec keeps them)."""

    n: int
    dtype: torch.dtype
    lengths: tuple[int, ...]
    key: str
    tensor: torch.Tensor
    values: torch.Tensor | None = None


class RankwiseDecoder(Compressor):
    """An all-gather codec that decodes the ranks' payloads one after the other into one sum (``decode``): one
    payload alone decodes into a fresh tensor, the gathered payloads into the bucket itself. Its ``ctx`` is a
    ``RankwiseCtx``."""

    def decompress(self, tensors, ctx):
        out = torch.empty(ctx.n, dtype=ctx.dtype, device=tensors[0].device)
        return self.decode([t.unsqueeze(0) for t in tensors], ctx, out)

    def aggregate(self, gathered, ctx):
        return self.decode(gathered, ctx, ctx.tensor.reshape(-1)).view_as(ctx.tensor)

    @abstractmethod
    def decode(self, gathered, ctx, out: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of the payloads ``gathered`` (each tensor stacked by rank) written into ``out``."""
