"""pactrain's codec: a layout's payload by its mask tracker's mode and the ternary lanes of its packed entries, whose
scale is carried from the step before (``scale_grid``) so that ternary goes in one all-reduce."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from gcomp.bucket import expand, segment_scales
from gcomp.collectives import bitpack
from gcomp.collectives.reduce import ChainedCompressor
from gcomp.compressors.pactrain.scale_grid import grid_exponent, grid_scale, hist_words, marks, next_exponent
from gcomp.compressors.pactrain.support import ShardSupport, bucket_support
from gcomp.compressors.pactrain.tracker import (DENSE, ENTRIES, GROUPS, PACKED, TRACKING, BucketTrack, Carry,
                                               MaskTracker, flag_set, receive_changed, receive_flags,
                                               tracking_flags)
from gcomp.core import EXACT, MAX, SUM, UNBIASED, Fidelity, Keeps, Payload, Traits
from gcomp.pruning.masks import parameter_of
from gcomp.randomness import Stream
from gcomp.sharding import ShardLayout
from gcomp.state_checks import check_state

TERNARY, ONE_ROUND = "ternary", "ternary1"  # two rounds (the exact shared scale first), or one (a carried scale)
FLAGS = 3  # the one-round lanes' last words: ranks with a non-finite value, with changed masks, asking a resync
NONFINITE, CHANGED, RESYNC = -3, -2, -1
STAT_KEYS = ("packed_buckets", "freezes", "unfreezes", "mask_mismatches", "one_round_buckets", "scale_resyncs")
_INTS = {2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class PackedCtx:
    """One payload's context: the ``mode`` it went in, the layout's ``track``, the result's ``numel`` and ``dtype``
    (the bucket's, or this rank's shard's), and for ternary the ``face`` of the support the codes follow, the values
    (two rounds: drawn in ``second_round``) and, in one round, the carried scale they were drawn against."""

    mode: str
    track: BucketTrack
    numel: int
    dtype: torch.dtype
    rows: bool = False
    face: object = None
    values: torch.Tensor | None = None
    exponents: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    words: int = 0


class PacTrainCompressor(ChainedCompressor):
    """Mask-packed all-reduce of a pruned model's buckets (lossless), optionally ternarised.

    On the wire, per bucket and step, by the mask tracker's mode (``tracker``), in one all-reduce round except for
    ternary's two-round steps (``ChainedAllreduceCommunicator``):

    - tracking / dense: the bucket as it is (SUM), and while tracking 5 int64 flags (MAX);
    - packed: the kept entries in the bucket's dtype plus one entry counting ranks whose masks changed (SUM): a
      dense all-reduce on the support, bit for bit on 2 ranks, and zero elsewhere;
    - ternary: the codes t + 1 of t in {-1, 0, 1}, drawn so that E[scale * t] = value, in
      ``bitpack.lane_bits(N)``-bit fields of int64 words (SUM: a field sums to at most 2N, no carry crosses),
      against one scale per parameter that every rank shares:

      - ``rounds=1``, one all-reduce with the scale carried from the step before: one int64 tensor (SUM) of the
        code words, ``hist_words(P, N)`` words of counting lanes that give the next step's scale, and 3 counts
        (ranks with a non-finite value, with changed masks, asking a resync). A value above the carried scale goes
        as +-scale and its excess is added to its rank's next step. The first packed step, and one after a
        resync, take two rounds;
      - ``rounds=2``: first the P fp32 scales and two flags (MAX: the exact shared scale, max |value| over ranks),
        then the code words (SUM). Unbiased at every step.

    Under FSDP2 (``rows="native"``), row r for destination shard r (``ShardSupport``): tracking / dense, the input
    by SUM reduce-scatter and the flags by MAX all-reduce; packed, a (world, K + 1) matrix by SUM reduce-scatter,
    each row the K_r entries shard r keeps zero-padded to K = max_r K_r and the changed entry; ternary, the codes
    of the whole input laid into each destination's row of lanes, (world, W) words by SUM reduce-scatter (one
    round: (world, W + H + 3), the counting lanes and counts alike in every row; two rounds: the scales first by
    MAX all-reduce). ``granularity="groups"`` (``prunex``) packs whole filters and channels."""

    def __init__(self, stable_steps: int = 5, dense_above: float = 0.9, ternary: bool = False, clip: float = 0.0,
                 error_feedback: bool = False, seed: int = 0, granularity: str = ENTRIES, check_every: int = 10,
                 rounds: int = 1):
        if rounds not in (1, 2):
            raise ValueError(f"rounds must be 1 or 2, got {rounds!r}")
        self.tracker = MaskTracker(stable_steps, dense_above, granularity, check_every)
        self.ternary, self.clip, self.error_feedback, self.rounds = ternary, clip, error_feedback, rounds
        self.stream = Stream(seed, "pactrain", 0)
        self.world, self.sharded, self.stats = 1, False, {}
        # one host read per step: the flags the step before received, copied to the host then (``HostFlags``); they
        # decide which collective this step makes, so every rank must know them on the host
        # clipping at c std biases at most a share 1 / c**2 of a parameter's entries (Chebyshev)
        fidelity = EXACT if not ternary else Fidelity("unbiased", min(1.0, 1 / clip ** 2)) if clip > 0 else UNBIASED
        self.traits = Traits(fidelity=fidelity, keeps=Keeps.LAYOUT, rows="native",
                             reads_model=True, host_syncs=1, stat_keys=STAT_KEYS)

    def bind(self, model, group, stats) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.tracker.bind(model, stats)
        self.stats, self.sharded = stats, isinstance(model, FSDPModule)
        if dist.is_available() and dist.is_initialized():
            self.world = dist.get_world_size(group)
            self.stream.bind(dist.get_rank(group))  # independent draws per rank

    def _count(self, key: str) -> None:
        if key in self.stats:
            self.stats[key] += 1

    def _support(self, layout, masks: list, device):
        """The support of ``layout`` (a bucket, or FSDP2's rows) from its masks: the tracker's ``build``."""
        if isinstance(layout, ShardLayout):
            return ShardSupport(layout, masks, device)
        params = []
        for name, numel, mask in zip(layout.names, layout.numels, masks):
            p = None if mask is None else parameter_of(self.tracker.model, name)
            params.append((torch.Size([numel]), (1,), None) if p is None else (p.size(), p.stride(), mask))
        return bucket_support(params, layout.numel, device, self.tracker.granularity == GROUPS)

    # --- encode ----------------------------------------------------------------------------------------------------

    def encode(self, x, state, layout):
        rows = layout if isinstance(layout, ShardLayout) else None
        track, changed = self.tracker.decide(layout if rows is None else rows.params,
                                             lambda masks: self._support(layout, masks, x.device))
        ctx = PackedCtx(track.mode, track, x.numel() if rows is None else rows.shard_numel, x.dtype, rows is not None)
        dense = x if rows is None else x.view(rows.world, -1)
        if track.mode == TRACKING:
            return Payload([dense, tracking_flags(track, changed, x.device)], ctx, ops=(SUM, MAX), whole=(1,),
                           rows=ctx.rows), state
        if track.mode == DENSE:
            return Payload([dense], ctx, rows=ctx.rows), state
        self._count("packed_buckets")
        support = track.support
        if not self.ternary:
            if rows is None:
                packed = x.new_empty(support.kept + 1)
                torch.index_select(x, 0, support.positions, out=packed[:-1])
            else:
                packed = x.new_empty(rows.world, support.width + 1)
                packed[:, :-1] = torch.gather(dense, 1, support.index).masked_fill_(~support.valid, 0)
            packed[..., -1] = changed  # a bool, or a 0-d tensor of the mask check
            return Payload([packed], ctx, rows=ctx.rows), state
        return self._encode_ternary(x, track, changed, ctx), state

    def _encode_ternary(self, x: torch.Tensor, track: BucketTrack, changed, ctx: PackedCtx) -> Payload:
        face = track.support if not ctx.rows else track.support.ternary
        carry = track.carry
        values = x.index_select(0, face.positions).float()
        held = carry.residual
        if not self.error_feedback:  # a carried excess is added once
            carry.residual = None
        if held is not None:
            values += held
        # A NaN scale might be lost in a MAX all-reduce (max(a, NaN) depends on the order), so a flag slot carries
        # the fact: a non-finite gradient on any rank decodes to non-finite on every rank.
        local = segment_scales(values, face.segments, self.clip)
        scales = torch.cat([local, local.new_zeros(2)])
        scales[CHANGED] = changed
        scales[-1] = (~torch.isfinite(local)).any()
        ctx.face, ctx.values = face, values
        ctx.words = face.words if ctx.rows else bitpack.packed_words(track.support.kept, self.bits)
        carried = self._carried(carry)
        if carried is None:
            ctx.mode = TERNARY
            lanes = x.new_empty(ctx.words if not ctx.rows else (face.world, ctx.words), dtype=torch.int64)
            return Payload([scales, lanes], ctx, ops=(MAX, SUM), whole=(0,), rows=ctx.rows)
        ctx.mode, (ctx.exponents, ctx.scale) = ONE_ROUND, carried
        words = self._lanes(ctx, self._codes(ctx, carry, ctx.scale))
        if not self.error_feedback and self.clip == 0:  # what went above the carried scale goes next step
            bound = expand(ctx.scale, face.segments, values.numel())
            carry.residual = (values - values.clamp(-bound, bound)).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        hist, resync = marks(local, ctx.exponents, self.world)
        lanes = torch.empty(*words.shape[:-1], ctx.words + hist.numel() + FLAGS, dtype=torch.int64, device=x.device)
        lanes[..., :ctx.words] = words
        lanes[..., ctx.words:NONFINITE] = hist
        lanes[..., NONFINITE] = scales[-1].to(torch.int64)
        lanes[..., CHANGED] = scales[CHANGED].to(torch.int64)
        lanes[..., RESYNC] = resync
        return Payload([lanes], ctx, rows=ctx.rows)

    @property
    def bits(self) -> int:
        """The width of a lane field: the sum of ``world`` codes t + 1 in {0, 1, 2}."""
        return bitpack.lane_bits(self.world)

    def _carried(self, carry: Carry) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The scale the last step left for this one (grid exponents, scale), counted as a one-round bucket; None
        when this step takes two rounds (``rounds=2``, the first packed step, or a rank asked a resync)."""
        pending, carry.resync = carry.resync, None
        if pending is not None and flag_set(pending):  # read with the tracker's flags
            self._count("scale_resyncs")
            carry.exponents = carry.scale = None
        if self.rounds != 1 or carry.exponents is None:
            return None
        if carry.scale is None:  # exponents restored from a checkpoint
            carry.scale = grid_scale(carry.exponents)
        self._count("one_round_buckets")
        return carry.exponents, carry.scale

    def _codes(self, ctx: PackedCtx, carry: Carry, shared: torch.Tensor) -> torch.Tensor:
        """t + 1 in {0, 1, 2} (uint8) per value, with E[shared * t] = value where |value| <= shared (one scale per
        segment): a NaN probability never hits (t = 0), one above 1 always does. Error feedback keeps what the
        codes do not carry."""
        values = ctx.values
        scale = expand(shared, ctx.face.segments, values.numel())
        hit = torch.rand(values.shape, generator=self.stream.next(values.device), device=values.device) \
            < values.abs() / scale
        # (2 * (value > 0) - 1) * hit + 1 in uint8: t = -1 is 255, and 255 + 1 wraps to 0
        codes = torch.gt(values, 0).to(torch.uint8).mul_(2).sub_(1).mul_(hit).add_(1)
        if self.error_feedback:
            sent = codes.float().sub_(1).mul_(scale)
            carry.residual = (values - sent).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return codes

    def _lanes(self, ctx: PackedCtx, codes: torch.Tensor) -> torch.Tensor:
        """The codes packed into int64 lane words: flat, or under FSDP2 each laid into its destination's row."""
        if not ctx.rows:
            return bitpack.pack(codes, self.bits)
        face = ctx.face
        fields = codes.new_zeros(face.world * face.fields).index_copy_(0, face.dest, codes)
        return bitpack.pack(fields, self.bits).view(face.world, face.words)

    def chained(self, payload: Payload) -> bool:
        return payload.ctx.mode == TERNARY

    def second_round(self, payload: Payload) -> None:
        """Draw the codes against the shared scales (``tensors[0]`` after its MAX) into the lanes."""
        ctx = payload.ctx
        payload.tensors[1] = self._lanes(ctx, self._codes(ctx, ctx.track.carry, payload.tensors[0][:-2]))

    # --- decode ----------------------------------------------------------------------------------------------------

    def decode(self, received, ctx: PackedCtx) -> torch.Tensor:
        track, mode = ctx.track, ctx.mode
        if mode in (TRACKING, DENSE):
            if mode == TRACKING:
                receive_flags(track, received[1])
            return received[0]
        if mode == PACKED:
            receive_changed(track, received[0][-1:])
            return _scatter(received[0][:track.support.own.numel()], track.support.own, ctx.numel)
        carry, face = track.carry, ctx.face
        if mode == TERNARY:
            shared, nonfinite, changed = received[0][:-2], received[0][-1], received[0][CHANGED:-1]
            carry.exponents = grid_exponent(shared)
            lanes = received[1]
        else:
            shared, lanes, nonfinite, changed = ctx.scale, received[0][:ctx.words], received[0][NONFINITE], \
                received[0][CHANGED:RESYNC]
            carry.exponents = next_exponent(received[0][ctx.words:NONFINITE], ctx.exponents, self.world)
            carry.resync = received[0][RESYNC:] > 0  # sent to the host with the tracker's flags
        carry.scale = grid_scale(carry.exponents)
        receive_changed(track, changed)
        kept = face.own.numel()
        values = bitpack.unpack(lanes, kept, self.bits, dtype=torch.float32).sub_(self.world)
        # a non-finite gradient on any rank: every scale NaN, and so every decoded entry
        shared = shared + torch.where(nonfinite > 0, torch.nan, 0.0)
        values.mul_(expand(shared, face.own_segments, kept))
        return _scatter(values.to(ctx.dtype), face.own, ctx.numel)

    # --- checkpoints: {"generator": the rank's draws, "tracker": one entry per layout} --------------------------

    def state_dict(self) -> dict:
        return {"generator": self.stream.state_dict(), "tracker": self.tracker.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"generator": (dict, torch.Tensor), "tracker": dict})
        self.stream.load_state_dict(state["generator"])
        self.tracker.load_state_dict(state["tracker"])

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        """Every rank tracks alike: any old rank's tracker goes on, the residuals (per rank) summed per layout,
        the new rank's draws a fresh stream. Under FSDP2 the tracker is laid out by the shards: refused."""
        if self.sharded:
            raise ValueError(f"{self.tracker.label} under FSDP2 keeps its mask tracker and ternary state (residuals, "
                             "carried scales) per FSDP module, keyed and ordered by its shards, which no other "
                             "number of shards can take up")
        tracker = {}
        for key, entry in every[0]["tracker"].items():
            entry = {k: v for k, v in entry.items() if k != "residual"}
            held = [s["tracker"][key]["residual"] for s in assigned if "residual" in s["tracker"].get(key, {})]
            if held:
                entry["residual"] = torch.stack(held).sum(0)
            tracker[key] = entry
        return {"generator": {}, "tracker": tracker}


def _scatter(values: torch.Tensor, index: torch.Tensor, numel: int) -> torch.Tensor:
    """``numel`` zeros with ``values`` at ``index``: their bits added onto zero bits (a copy that keeps a negative
    zero's sign and takes int32 positions, which ``index_copy_`` does not)."""
    ints = _INTS[values.element_size()]
    return values.new_zeros(numel).view(ints).index_add_(0, index, values.view(ints)).view(values.dtype)
