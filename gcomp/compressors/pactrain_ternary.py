"""PacTrain's ternary codec: the kept entries of a packed bucket as stochastic ternary codes in integer lanes.

``TernaryCodec`` is a component: ``PacTrainCompressor`` (``gcomp.compressors.pactrain``) holds one, which FSDP2's
row strategy (``gcomp.compressors.pactrain_rows``) calls too, on its row layout. It is made with its configuration (``clip``,
``error_feedback``, ``rounds``, its own ``RankGenerator``) and bound once with the world size (the lanes' width)
and a counter of its statistics (``bind``); everything else comes in per call: a support's face of the values
(``kept`` entries in per-parameter ``segments``, and ``gather``), and the layout's state (``LayoutState``:
its ``Carry`` and its ``TernaryWork``, both in ``gcomp.packing.state``).

Per step: ``gather_values``, ``local_scales`` and ``carried_scale``; then, against the shared scale,
``code_words`` (two rounds, after the scales' MAX) or ``one_round_lanes`` (one); after the SUM,
``receive_scales`` or ``receive_lanes`` (the next step's scale, the flags), ``decode_values`` and the support's
scatter. ``gcomp.bench.pactrain_codec`` times the parts. A caller that lays the codes out otherwise (FSDP2: one row
per destination shard) passes its own ``pack``. The wire format and why one round is enough: the class docstring
of ``PacTrainCompressor`` and docs/algorithms.md §9.4.

The one-round lanes (``fill_lanes``, ``split_lanes``): code words, then counting-lane words, then ``FLAGS`` int64
counts (ranks with a non-finite value, with changed masks, asking a resync), for one flat lane vector (DDP) or
alike in every row of a ``(world, ...)`` matrix (FSDP2).
"""
from __future__ import annotations

from typing import Callable

import torch

from gcomp.collectives import bitpack
from gcomp.compressors import bernoulli, scale_grid
from gcomp.compressors.quantise import RankGenerator, per_segment_, segment_scales
from gcomp.kernels import on_device
from gcomp.packing import lanes as lanes_
from gcomp.packing.host_flags import flag_set
from gcomp.packing.state import Carry, LayoutState, TernaryWork
from gcomp.packing.support import Support

FLAGS = 3  # the one-round lanes' last int64 words: ranks with a non-finite value, with changed masks, asking a resync
NONFINITE, CHANGED, RESYNC = -3, -2, -1  # where each is, counted from the end


def fill_lanes(words: torch.Tensor, hist: torch.Tensor, scales: torch.Tensor, resync: torch.Tensor) -> torch.Tensor:
    """The one-round int64 lanes: ``words`` (``(W,)``, or ``(world, W)`` one row per destination), then the counting
    lanes ``hist`` (H words) and the 3 counts, from ``scales``' flag slots (``local_scales``: non-finite, changed)
    and ``resync``; shape ``words.shape[:-1] + (W + H + FLAGS,)``, ``hist`` and the counts alike in every row."""
    width = words.shape[-1]
    lanes = torch.empty(*words.shape[:-1], width + hist.numel() + FLAGS, dtype=torch.int64, device=words.device)
    lanes[..., :width] = words
    lanes[..., width:-FLAGS] = hist
    lanes[..., NONFINITE] = scales[-1].to(torch.int64)
    lanes[..., CHANGED] = scales[-2].to(torch.int64)
    lanes[..., RESYNC] = resync
    return lanes


def split_lanes(lanes: torch.Tensor, words: int) -> tuple[torch.Tensor, ...]:
    """A received lane vector (``fill_lanes``' row, summed over ranks) as ``(codes, hist, nonfinite, changed,
    resync)``: ``words`` code words, the counting lanes, then the counts (0-d, then (1,) each)."""
    return lanes[:words], lanes[words:-FLAGS], lanes[NONFINITE], lanes[CHANGED:RESYNC], lanes[RESYNC:]


def split_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``local_scales``' tensor (after the MAX) as ``(shared scales, nonfinite (0-d), changed ((1,)))``."""
    return scales[:-2], scales[-1], scales[-2:-1]


def _uncounted(key: str) -> None:
    pass


class TernaryCodec:
    """The ternary codec of a packed bucket: kept entries to lanes and back (module docstring).

    ``clip``: cap each segment's scale at ``clip * std`` (0: off); ``error_feedback``: keep what the codes did not
    carry for the next step; ``rounds``: 1, the scale carried from the step before, or 2, the exact scale first;
    ``random``: this codec's draws (``bind`` its rank: ``random.bind(rank)``).
    """

    def __init__(self, clip: float = 0.0, error_feedback: bool = False, rounds: int = 1,
                 random: RankGenerator | None = None):
        if rounds not in (1, 2):
            raise ValueError(f"rounds must be 1 or 2, got {rounds!r}")
        self.clip, self.error_feedback, self.rounds = clip, error_feedback, rounds
        self.random = random if random is not None else RankGenerator(0, "pactrain")
        self.world_size = 1
        self.count: Callable[[str], None] = _uncounted

    def bind(self, world_size: int, count: Callable[[str], None] | None = None) -> None:
        """The ranks whose codes a lane field sums (its width, ``bitpack.lane_bits``) and what counts this codec's
        statistics (``scale_resyncs``, ``one_round_buckets``): a callable taking the key."""
        self.world_size = world_size
        self.count = count if count is not None else _uncounted

    @property
    def bits(self) -> int:
        """The width of a lane field: holds the sum of ``world_size`` codes t + 1 in {0, 1, 2}."""
        return bitpack.lane_bits(self.world_size)

    def words(self, kept: int) -> int:
        """int64 words of ``kept`` codes."""
        return bitpack.packed_words(kept, self.bits)

    def pack(self, codes: torch.Tensor) -> torch.Tensor:
        """The codes (uint8, zero-padded to whole words) packed into int64 lane words."""
        return lanes_.pack(codes, self.bits)

    # --- encode -----------------------------------------------------------------------------------------------

    def carried_scale(self, carry: Carry) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared scale the last step left for this one, as (grid exponents, scale), counted as a one-round
        bucket; or None when this step must take two rounds (``rounds=2``, the first packed step, or a rank asked
        for a resync, counted)."""
        pending, carry.resync = carry.resync, None
        if pending is not None and flag_set(pending):  # read with the tracker's flags (host_flags.Slot)
            self.count("scale_resyncs")
            carry.exponents = carry.scale = None
        if self.rounds != 1 or carry.exponents is None:
            return None
        if carry.scale is None:  # exponents restored from a checkpoint
            carry.scale = scale_grid.grid_scale(carry.exponents)
        self.count("one_round_buckets")
        return carry.exponents, carry.scale

    def work(self, support: Support, state: LayoutState, device) -> TernaryWork:
        """The layout's work buffers (``TernaryWork``), allocated at the first call on its support."""
        if state.ternary is None:
            k = support.kept
            fields = self.words(k) * bitpack.fields_per_word(self.bits)
            draws = torch.empty(k, dtype=torch.float32, device=device)
            state.ternary = TernaryWork(
                values=torch.empty(k, dtype=torch.float32, device=device), draws=draws,
                prob=torch.empty(fields, dtype=torch.float32, device=device),
                hit=torch.empty(k, dtype=torch.bool, device=device),
                codes=torch.zeros(fields, dtype=torch.uint8, device=device), bernoulli={"draws": draws})
        return state.ternary

    def gather_values(self, support: Support, state: LayoutState, tensor: torch.Tensor) -> torch.Tensor:
        """The kept entries as fp32 (error feedback, or the excess a carried scale clipped, added), and their
        magnitudes in the ``prob`` buffer."""
        work, carry = self.work(support, state, tensor.device), state.carry
        values = work.values
        if tensor.dtype == torch.float32:
            support.gather(tensor, values)
        else:  # a 16-bit bucket: gather into the draws buffer's storage (free until the draws), then widen
            values.copy_(support.gather(tensor, self._narrow(work.draws, tensor.dtype, support.kept)))
        held = carry.residual
        if not self.error_feedback:  # a carried excess is added once
            carry.residual = None
        if held is not None:
            values += held
        torch.abs(values, out=work.prob[:values.numel()])
        return values

    def local_scales(self, support: Support, state: LayoutState, changed: bool = False) -> torch.Tensor:
        """max |value| per parameter segment (capped at clip * std with clipping, TernGrad's rule:
        ``quantise.segment_scales``), then two flag slots: ``changed`` (this rank's masks), non-finite."""
        work, segments = state.ternary, support.segments
        values = work.values
        scales = torch.zeros(len(segments) + 2, dtype=torch.float32, device=values.device)
        segment_scales(values, segments, self.clip, work.prob[:values.numel()], out=scales[:-2])
        # A NaN scale might be lost in a MAX all-reduce (max(a, NaN) depends on the order), so a flag slot
        # carries the fact itself: a non-finite gradient on any rank decodes to non-finite on every rank.
        scales[-1] = (~torch.isfinite(scales[:-2])).any()
        scales[-2] = changed  # a bool, or the device path's tensor (gcomp.packing.mask_check)
        return scales

    def draw_codes(self, support: Support, state: LayoutState, shared: torch.Tensor) -> torch.Tensor:
        """t + 1 in {0, 1, 2} per kept entry, with E[shared * t] = value where |value| <= shared (``shared``:
        one scale per parameter segment), then the zero padding of the lanes' last word (uint8: t = -1 is
        (0 * 2 - 1) mod 256 = 255, and 255 + 1 wraps to 0). Error feedback keeps what the codes do not carry."""
        work, segments, k = state.ternary, support.segments, support.kept
        values, hit = work.values, work.hit
        prob, codes = work.prob[:k], work.codes[:k]  # past k: the lanes' zero padding
        # |value| / shared scale, in [0, 1] unless clipped, times bernoulli.SCALE (divided into the scale: exact)
        per_segment_(prob, shared / bernoulli.SCALE, segments, torch.Tensor.div_)
        # a NaN probability never hits: t = 0; above 1 always hits: +-scale
        bernoulli.draw_hits(hit, prob, self.random(values.device), work.bernoulli)
        # codes = t + 1 = (2 * (value > 0) - 1) * hit + 1, in {0, 1, 2}; the bool views avoid temporaries
        torch.gt(values, 0, out=codes.view(torch.bool))
        codes.mul_(2).sub_(1).mul_(hit.view(torch.uint8)).add_(1)
        if self.error_feedback:
            sent = prob.copy_(codes).sub_(1)  # prob is free again: reuse it for what was sent
            per_segment_(sent, shared, segments, torch.Tensor.mul_)
            residual = torch.sub(values, sent, out=state.carry.residual)
            state.carry.residual = residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return work.codes

    def code_words(self, support: Support, state: LayoutState, shared: torch.Tensor,
                   pack: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Two rounds, after the scales' MAX: the codes drawn against the exact shared scale, packed (by ``pack``,
        default ``self.pack``)."""
        return (pack or self.pack)(self.draw_codes(support, state, shared))

    def one_round_codes(self, support: Support, state: LayoutState, scales: torch.Tensor, exponents: torch.Tensor,
                        shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``one_round_lanes`` before its packing: the codes (``draw_codes``' buffer) against the carried scale, the
        excess above it kept for the rank's next step, this rank's counting lanes (int64 words) and its resync
        flag (``scale_grid.marks``)."""
        local = scales[:-2]
        codes = self.draw_codes(support, state, shared)
        if not self.error_feedback and self.clip == 0:
            # some value above the carried scale went as +-scale: its excess is carried (a free check on the host;
            # the device path never waits on it)
            if on_device(local) or bool((local > shared).any()):
                self._carry_excess(support, state, shared)
        hist, resync = scale_grid.marks(local, exponents, self.world_size)
        return codes, hist, resync

    def one_round_lanes(self, support: Support, state: LayoutState, scales: torch.Tensor, exponents: torch.Tensor,
                        shared: torch.Tensor, pack: Callable[[torch.Tensor], torch.Tensor] | None = None
                        ) -> torch.Tensor:
        """The one all-reduce's int64 tensor (``fill_lanes``): the codes drawn against the carried scale ``shared``
        (of grid ``exponents``) packed by ``pack`` (default ``self.pack``; FSDP2's gives one row per shard), the
        counting lanes of this rank's largest values, and the 3 counts."""
        codes, hist, resync = self.one_round_codes(support, state, scales, exponents, shared)
        return fill_lanes((pack or self.pack)(codes), hist, scales, resync)

    def _carry_excess(self, support: Support, state: LayoutState, shared: torch.Tensor) -> None:
        """Keep ``value - clamp(value, -scale, scale)`` for this rank's next step (``gather_values`` adds it)."""
        values = state.ternary.values
        excess = torch.empty_like(values)  # becomes the residual: the next clip takes a fresh one
        excess.copy_(values)
        per_segment_(excess, shared, support.segments, lambda view, s: view.clamp_(-s, s))
        residual = torch.sub(values, excess, out=excess)
        state.carry.residual = residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)

    # --- decode -----------------------------------------------------------------------------------------------

    @staticmethod
    def carry_scale(carry: Carry, exponents: torch.Tensor) -> None:
        """Keep the next step's shared scale (its grid exponents, and the scale itself)."""
        carry.exponents, carry.scale = exponents, scale_grid.grid_scale(exponents)

    def receive_scales(self, carry: Carry, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Two rounds: the scales' MAX as ``split_scales`` gives it; the exact shared max, on the grid, is kept as
        the next step's scale (if it goes in one round)."""
        shared, nonfinite, changed = split_scales(scales)
        self.carry_scale(carry, scale_grid.grid_exponent(shared))
        return shared, nonfinite, changed

    def receive_lanes(self, carry: Carry, lanes: torch.Tensor, words: int, exponents: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One round: the summed lanes (``split_lanes``, ``words`` code words), encoded against grid ``exponents``.
        Keeps the next step's scale (from the counting lanes) and the resync count; returns ``(code words,
        nonfinite, changed)``."""
        codes, hist, nonfinite, changed, resync = split_lanes(lanes, words)
        self.carry_scale(carry, scale_grid.next_exponent(hist, exponents, self.world_size))
        carry.resync = resync > 0  # sent to the host with the tracker's flags (host_flags.receive_changed)
        return codes, nonfinite, changed

    def decode_values(self, support: Support, state: LayoutState, shared: torch.Tensor, nonfinite: torch.Tensor,
                      lanes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The summed lanes as values: shared scale * (field - N), per parameter segment; every entry NaN when
        ``nonfinite`` (the ranks' count or flag of non-finite values) is above 0. In fp32 (the ``prob`` buffer),
        or a 16-bit ``dtype`` (in the ``draws`` buffer's storage, free again after the draws)."""
        work = state.ternary
        values = lanes_.unpack(lanes, support.kept, self.bits, out=work.prob)  # as long as the lanes' fields
        values.sub_(self.world_size)
        # A non-finite gradient on any rank: every scale becomes NaN, and so every decoded entry.
        shared = shared + torch.where(nonfinite > 0, torch.nan, 0.0)
        per_segment_(values, shared, support.segments, torch.Tensor.mul_)
        if dtype != torch.float32:
            values = self._narrow(work.draws, dtype, support.kept).copy_(values)
        return values

    @staticmethod
    def _narrow(buffer: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
        """The first ``n`` entries of an fp32 buffer's storage seen as a 16-bit ``dtype``."""
        return buffer.view(dtype)[:n]
