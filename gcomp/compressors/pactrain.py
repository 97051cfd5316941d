"""``pactrain``: all-reduce of only the entries a pruned model keeps, packed densely; ternary on top if asked.

PacTrain (Wang, Wu, Li, Kutscher, 2025). Prune first (``gcomp.pruning.prune``), build DDP, install this.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Annotated

import torch

from gcomp.collectives import bitpack
from gcomp.collectives.chained import ChainedAllreduceCommunicator, ChainedCompressor
from gcomp.compressors.quantise import RankGenerator, per_segment_, rank_and_world, segment_scales
from gcomp.core import ALLREDUCE, MAX, SUM, Method, Payload, check_state
from gcomp.memory import NoMemory
from gcomp.params import Range
from gcomp.packing.tracker import DENSE, ENTRIES, PACKED, TRACKING, BucketTrack, MaskTracker
from gcomp.registry import register

TERNARY = "ternary"


@dataclass
class _Ctx:
    mode: str  # tracking, dense, packed or ternary
    track: BucketTrack
    bucket: torch.Tensor  # the gradient buffer the result is written into


class PacTrainCompressor(ChainedCompressor):
    """Mask-packed all-reduce of a pruned model's buckets (lossless), optionally ternarised.

    On the wire, per bucket and step, by the mask tracker's state (``gcomp.packing.tracker``), in one
    all-reduce round except for ternary (``ChainedAllreduceCommunicator``):

    - tracking / dense: the bucket as it is (SUM), and while tracking 5 int64 flags (MAX);
    - packed: the kept entries in the bucket's dtype plus one entry counting ranks whose masks changed (SUM);
      the result equals a dense all-reduce on the support, bit for bit on 2 ranks, and is zero elsewhere;
    - ternary, two chained rounds: first one fp32 scale per parameter segment plus two flags (MAX, so every
      rank shares the scale), then the codes t + 1 of t in {-1, 0, 1}, drawn so that E[scale * t] = value, in
      ``bitpack.lane_bits(N)``-bit fields of int64 words (SUM: each field sums to at most 2N, no carry crosses).

    ``granularity="groups"`` (``prunex``'s inter-node stage) packs whole filters and channels
    (``gcomp.packing.groups``) instead of single entries: no per-entry index, even in memory.
    """

    collective = ALLREDUCE
    stateful = True
    reads_model = True  # the pruning masks
    stat_keys = ("packed_buckets", "freezes", "unfreezes", "mask_mismatches")

    def __init__(self, stable_steps: int = 5, dense_above: float = 0.9, ternary: bool = False,
                 clip: float = 0.0, error_feedback: bool = False, seed: int = 0, granularity: str = ENTRIES,
                 check_every: int = 10):
        self.tracker = MaskTracker(stable_steps, dense_above, granularity, check_every)
        self.ternary, self.clip, self.error_feedback, self.seed = ternary, clip, error_feedback, seed
        self.lossless = not ternary
        self.world_size, self.rank = 1, 0
        self.random = RankGenerator(seed, "pactrain")
        self.stats: dict = {}

    def bind(self, model, group, stats) -> None:
        self.tracker.bind(model, stats)
        self.stats = stats
        self.rank, self.world_size = rank_and_world(group)
        self.random.bind(self.rank)  # independent draws per rank

    # --- encode ---------------------------------------------------------------------------------------------

    def compress(self, tensor, bucket):
        track, changed_here = self.tracker.decide(bucket, tensor.device)
        if track.mode == TRACKING:
            return Payload([tensor, MaskTracker.flags(track, changed_here, tensor.device)],
                           _Ctx(TRACKING, track, tensor), ops=(SUM, MAX))
        if track.mode == DENSE:
            return Payload([tensor], _Ctx(DENSE, track, tensor))
        if "packed_buckets" in self.stats:
            self.stats["packed_buckets"] += 1
        support = track.support
        if not self.ternary:
            packed = track.buffers.get("packed")
            if packed is None:
                packed = track.buffers["packed"] = tensor.new_empty(support.kept + 1)
            support.gather(tensor, packed)
            packed[-1] = float(changed_here)
            return Payload([packed], _Ctx(PACKED, track, tensor))
        self.gather_values(track, tensor)
        scales = self.local_scales(track)
        scales[-2] = float(changed_here)
        bits = bitpack.lane_bits(self.world_size)
        lanes = torch.empty(bitpack.packed_words(support.kept, bits), dtype=torch.int64, device=tensor.device)
        return Payload([scales, lanes], _Ctx(TERNARY, track, tensor), ops=(MAX, SUM))

    def chained(self, payload: Payload) -> bool:
        return payload.ctx.mode == TERNARY

    def _ternary_buffers(self, track: BucketTrack, like: torch.Tensor) -> dict:
        """Per-bucket work buffers, allocated once per frozen support (fresh allocations of tens of MB cost
        more in page faults than the arithmetic done in them). ``codes`` and ``prob`` are as long as the
        lanes' fields: codes are packed in place (zero padding), prob receives every unpacked field."""
        buffers = track.buffers
        if "values" not in buffers:
            k, device = track.support.kept, like.device
            bits = bitpack.lane_bits(self.world_size)
            fields = bitpack.packed_words(k, bits) * bitpack.fields_per_word(bits)
            buffers["values"] = torch.empty(k, dtype=torch.float32, device=device)
            buffers["draws"] = torch.empty(k, dtype=torch.float32, device=device)
            buffers["prob"] = torch.empty(fields, dtype=torch.float32, device=device)
            buffers["hit"] = torch.empty(k, dtype=torch.bool, device=device)
            buffers["codes"] = torch.zeros(fields, dtype=torch.uint8, device=device)
        return buffers

    # The ternary path in its parts (``gcomp.bench.pactrain_codec`` times each): gather_values, local_scales, then,
    # with the shared scales, draw_codes and bitpack.pack; after the SUM, decode_values and support.scatter.

    def gather_values(self, track: BucketTrack, tensor: torch.Tensor) -> torch.Tensor:
        """The kept entries as fp32 (error feedback added), and their magnitudes in the ``prob`` buffer."""
        buffers, support = self._ternary_buffers(track, tensor), track.support
        values = buffers["values"]
        if tensor.dtype == torch.float32:
            support.gather(tensor, values)
        else:  # a 16-bit bucket: gather into the draws buffer's storage (free until the draws), then widen
            values.copy_(support.gather(tensor, self._narrow(buffers["draws"], tensor.dtype, support.kept)))
        if self.error_feedback and "residual" in buffers:
            values += buffers["residual"]
        torch.abs(values, out=buffers["prob"][:values.numel()])
        return values

    def local_scales(self, track: BucketTrack) -> torch.Tensor:
        """max |value| per parameter segment (capped at clip * std with clipping, TernGrad's rule:
        ``quantise.segment_scales``), then two flag slots."""
        values, magnitudes, segments = track.buffers["values"], track.buffers["prob"], track.support.segments
        scales = torch.zeros(len(segments) + 2, dtype=torch.float32, device=values.device)
        segment_scales(values, segments, self.clip, magnitudes[:values.numel()], out=scales[:-2])
        # A NaN scale might be lost in a MAX all-reduce (max(a, NaN) depends on the order), so a flag slot
        # carries the fact itself: a non-finite gradient on any rank decodes to non-finite on every rank.
        scales[-1] = (~torch.isfinite(scales[:-2])).any()
        return scales

    def second_round(self, payload: Payload) -> None:
        """Ternarise: fill the lanes from the shared scales (``payload.tensors[0]`` after its MAX all-reduce)."""
        codes = self.draw_codes(payload.ctx.track, payload.tensors[0])
        payload.tensors[1] = bitpack.pack(codes, bitpack.lane_bits(self.world_size))

    def draw_codes(self, track: BucketTrack, scales: torch.Tensor) -> torch.Tensor:
        """t + 1 in {0, 1, 2} per kept entry, with E[scale * t] = value, then the zero padding of the lanes'
        last word (uint8: t = -1 is (0 * 2 - 1) mod 256 = 255, and 255 + 1 wraps to 0). Error feedback keeps
        what the codes do not carry."""
        buffers, segments, k = track.buffers, track.support.segments, track.support.kept
        values, draws, hit = buffers["values"], buffers["draws"], buffers["hit"]
        prob, codes = buffers["prob"][:k], buffers["codes"][:k]  # past k: the lanes' zero padding
        per_segment_(prob, scales[:-2], segments, torch.Tensor.div_)  # |value| / shared scale, in [0, 1]
        if self.clip > 0:
            prob.clamp_(max=1.0)
        draws.uniform_(generator=self.random(values.device))
        torch.lt(draws, prob, out=hit)  # a NaN probability never hits: t = 0
        # codes = t + 1 = (2 * (value > 0) - 1) * hit + 1, in {0, 1, 2}; the bool views avoid temporaries
        torch.gt(values, 0, out=codes.view(torch.bool))
        codes.mul_(2).sub_(1).mul_(hit.view(torch.uint8)).add_(1)
        if self.error_feedback:
            sent = prob.copy_(codes).sub_(1)  # prob is free again: reuse it for what was sent
            per_segment_(sent, scales[:-2], segments, torch.Tensor.mul_)
            residual = torch.sub(values, sent, out=buffers.get("residual"))
            buffers["residual"] = residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return buffers["codes"]

    # --- decode ---------------------------------------------------------------------------------------------

    def decompress(self, tensors, ctx: _Ctx):
        track, support = ctx.track, ctx.track.support
        if ctx.mode == TRACKING:
            MaskTracker.receive_flags(track, tensors[1])
            return tensors[0]
        if ctx.mode == DENSE:
            return tensors[0]
        if ctx.mode == PACKED:
            MaskTracker.receive_changed(track, tensors[0][-1:])
            return support.scatter(tensors[0], ctx.bucket)
        scales, lanes = tensors
        MaskTracker.receive_changed(track, scales[-2:-1])
        values, dtype = self.decode_values(track, scales, lanes), ctx.bucket.dtype
        if dtype != torch.float32:
            values = self._narrow(track.buffers["draws"], dtype, support.kept).copy_(values)
        return support.scatter(values, ctx.bucket)

    @staticmethod
    def _narrow(buffer: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
        """The first ``n`` entries of an fp32 buffer's storage seen as a 16-bit ``dtype``."""
        return buffer.view(dtype)[:n]

    def decode_values(self, track: BucketTrack, scales: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
        """The summed lanes as fp32 values: shared scale * (field - N), per parameter segment."""
        support = track.support
        prob = track.buffers["prob"]  # as long as the lanes' fields, free again after the draws
        values = bitpack.unpack(lanes, support.kept, bitpack.lane_bits(self.world_size), out=prob)
        values.sub_(self.world_size)
        # A non-finite gradient on any rank: every scale becomes NaN, and so every decoded entry.
        shared = scales[:-2] + torch.where(scales[-1] > 0, torch.nan, 0.0)
        per_segment_(values, shared, support.segments, torch.Tensor.mul_)
        return values

    # --- checkpoint -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"generator": self.random.state_dict(), "tracker": self.tracker.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"generator": (dict, torch.Tensor), "tracker": dict})
        self.random.load_state_dict(state["generator"])
        self.tracker.load_state_dict(state["tracker"])

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        """Every rank tracks alike: any old rank's tracker goes on; the ternary residuals (error feedback,
        per rank) are summed per bucket layout; the new rank's draws start its own stream."""
        tracker = {}
        for key, entry in every[0]["tracker"].items():
            entry = {k: v for k, v in entry.items() if k != "residual"}
            held = [s["tracker"][key]["residual"] for s in assigned if "residual" in s["tracker"].get(key, {})]
            if held:
                entry["residual"] = torch.stack(held).sum(0)
            tracker[key] = entry
        return {"generator": {}, "tracker": tracker}


@register("pactrain", paper="Wang, Wu, Li, Kutscher 2025 (PacTrain, arXiv 2505.18563)")
def pactrain(
    ternary: Annotated[bool, "ternarise the packed entries (shared per-parameter scale, integer lanes)"] = False,
    stable_steps: Annotated[int, Range(1, None), "steps a bucket's masks must stay unchanged before packing "
                                             "(masks changed after install; those of install pack after one step)"] = 5,
    dense_above: Annotated[float, Range(0, 1), "keep a bucket dense when its support keeps more than this"] = 0.9,
    clip: Annotated[float, Range(0, None), "ternary: clip at clip * std per parameter (TernGrad: 2.5; 0 off)"] = 0.0,
    error_feedback: Annotated[bool, "ternary: add what ternarising lost to the next step"] = False,
    seed: Annotated[int, Range(0, None), "seed of the ternary draws (each rank draws its own stream from it)"] = 0,
    check_every: Annotated[int, Range(0, None), "compare a packed bucket's masks with those it froze on every this "
                                                "many steps (edits through .data; 0: never)"] = 10,
) -> Method:
    """PacTrain: only the entries the pruning masks keep are all-reduced, packed densely, once stable."""
    warn_unused_ternary_options("pactrain", ternary, clip=clip > 0, error_feedback=error_feedback)
    return Method(PacTrainCompressor(stable_steps, dense_above, ternary, clip, error_feedback, seed,
                                     check_every=check_every), NoMemory(),
                  ChainedAllreduceCommunicator())


def warn_unused_ternary_options(method: str, ternary: bool, **set_options: bool) -> None:
    """Warn that the ternary path's options set (``set_options[name]`` true) do nothing without ``ternary``."""
    idle = [name for name, on in set_options.items() if on]
    if idle and not ternary:
        warnings.warn(f"{method}: parameter {' and '.join(map(repr, idle))} has no effect without ternary=True",
                      UserWarning, stacklevel=4)
