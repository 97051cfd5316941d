"""PacTrain's ternary path: the kept entries of a packed bucket as stochastic ternary codes in integer lanes.

A mixin of ``PacTrainCompressor`` (``gcomp.compressors.pactrain``), which keeps the mask tracker, picks the mode
of each bucket and step, and builds the payloads: here are the parts of the ternary codec it calls, per bucket
(``gcomp.bench.pactrain_codec`` times each): ``gather_values``, ``local_scales``, then, against the shared scale,
``draw_codes`` and ``bitpack.pack`` (``second_round`` in two rounds, ``one_round_lanes`` in one); after the SUM,
``decode_values`` and the support's scatter. The wire format and why one round is enough: the class docstring
of ``PacTrainCompressor`` and docs/algorithms.md §9.4.

It reads from the compressor: ``clip``, ``error_feedback``, ``rounds``, ``world_size``, ``random`` (the rank's
stream) and ``_count`` (its statistics).
"""
from __future__ import annotations

import torch

from gcomp.collectives import bitpack
from gcomp.compressors import bernoulli, scale_grid
from gcomp.compressors.quantise import per_segment_, segment_scales
from gcomp.core import Payload
from gcomp.packing.host_flags import read_host_flag
from gcomp.packing.tracker import BucketTrack

FLAGS = 3  # the one-round payload's last int64 words: ranks with a non-finite value, with changed masks, asking a resync


class TernaryPath:
    """The ternary codec of a packed bucket: kept entries to lanes and back (module docstring)."""

    def carried_scale(self, track: BucketTrack) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The shared scale the last step left for this one, as (grid exponents, scale), or None when this step
        must take two rounds (``rounds=2``, the first packed step, or a rank asked for a resync)."""
        # the keys stay (None when empty): a decode on the backend's threads may be writing to this dict
        buffers = track.buffers
        pending, buffers["resync"] = buffers.get("resync"), None
        if pending is not None and bool(read_host_flag(pending)):
            self._count("scale_resyncs")
            buffers["exponents"] = buffers["scale"] = None
        exponents = buffers.get("exponents")
        if self.rounds != 1 or exponents is None:
            return None
        if buffers.get("scale") is None:  # exponents restored from a checkpoint
            buffers["scale"] = scale_grid.grid_scale(exponents)
        return exponents, buffers["scale"]

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
            for key in ("exponents", "scale", "resync"):  # the carried scale, set by decodes
                buffers.setdefault(key, None)
        return buffers

    # The ternary path in its parts (``gcomp.bench.pactrain_codec`` times each): gather_values, local_scales, then,
    # with the shared scales, draw_codes and bitpack.pack; after the SUM, decode_values and support.scatter.

    def gather_values(self, track: BucketTrack, tensor: torch.Tensor) -> torch.Tensor:
        """The kept entries as fp32 (error feedback, or the excess a carried scale clipped, added), and their
        magnitudes in the ``prob`` buffer."""
        buffers, support = self._ternary_buffers(track, tensor), track.support
        values = buffers["values"]
        if tensor.dtype == torch.float32:
            support.gather(tensor, values)
        else:  # a 16-bit bucket: gather into the draws buffer's storage (free until the draws), then widen
            values.copy_(support.gather(tensor, self._narrow(buffers["draws"], tensor.dtype, support.kept)))
        held = buffers.get("residual") if self.error_feedback else buffers.pop("residual", None)
        if held is not None:
            values += held
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
        codes = self.draw_codes(payload.ctx.track, payload.tensors[0][:-2])
        payload.tensors[1] = bitpack.pack(codes, bitpack.lane_bits(self.world_size))

    def one_round_lanes(self, track: BucketTrack, scales: torch.Tensor, exponents: torch.Tensor,
                        shared: torch.Tensor) -> torch.Tensor:
        """The one all-reduce's int64 tensor: the codes drawn against the carried scale ``shared`` (of grid
        ``exponents``), the counting lanes of this rank's largest values, and the 3 counts (see the class
        docstring)."""
        codes, hist, resync = self.one_round_codes(track, scales, exponents, shared)
        words = bitpack.pack(codes, bitpack.lane_bits(self.world_size))
        lanes = torch.empty(words.numel() + hist.numel() + FLAGS, dtype=torch.int64, device=words.device)
        lanes[:words.numel()] = words
        lanes[words.numel():-FLAGS] = hist
        lanes[-3] = scales[-1].to(torch.int64)
        lanes[-2] = scales[-2].to(torch.int64)
        lanes[-1] = resync
        return lanes

    def one_round_codes(self, track: BucketTrack, scales: torch.Tensor, exponents: torch.Tensor,
                        shared: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``one_round_lanes`` before its packing (FSDP2's codec lays the codes out per destination shard first):
        the codes (``draw_codes``'s buffer) against the carried scale, the excess above it kept for the rank's
        next step, this rank's counting lanes (int64 words) and its resync flag (``scale_grid.marks``)."""
        local = scales[:-2]
        codes = self.draw_codes(track, shared)
        if not self.error_feedback and self.clip == 0:
            over = local > shared  # some value above the carried scale went as +-scale: its excess is carried
            if local.device.type != "cpu" or bool(over.any()):  # a free check on the host; a GPU never waits
                self._carry_excess(track, shared)
        hist, resync = scale_grid.marks(local, exponents, self.world_size)
        return codes, hist, resync

    def _carry_excess(self, track: BucketTrack, shared: torch.Tensor) -> None:
        """Keep ``value - clamp(value, -scale, scale)`` for this rank's next step (``gather_values`` adds it)."""
        buffers = track.buffers
        values = buffers["values"]
        carry = buffers.get("carry")
        if carry is None:
            carry = buffers["carry"] = torch.empty_like(values)
        carry.copy_(values)
        per_segment_(carry, shared, track.support.segments, lambda view, s: view.clamp_(-s, s))
        buffers["residual"] = torch.sub(values, carry, out=carry).nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        buffers.pop("carry")  # its storage now holds the residual: the next clip takes a fresh one

    def draw_codes(self, track: BucketTrack, shared: torch.Tensor) -> torch.Tensor:
        """t + 1 in {0, 1, 2} per kept entry, with E[shared * t] = value where |value| <= shared (``shared``:
        one scale per parameter segment), then the zero padding of the lanes' last word (uint8: t = -1 is
        (0 * 2 - 1) mod 256 = 255, and 255 + 1 wraps to 0). Error feedback keeps what the codes do not carry."""
        buffers, segments, k = track.buffers, track.support.segments, track.support.kept
        values, hit = buffers["values"], buffers["hit"]
        prob, codes = buffers["prob"][:k], buffers["codes"][:k]  # past k: the lanes' zero padding
        # |value| / shared scale, in [0, 1] unless clipped, times bernoulli.SCALE (divided into the scale: exact)
        per_segment_(prob, shared / bernoulli.SCALE, segments, torch.Tensor.div_)
        # a NaN probability never hits: t = 0; above 1 always hits: +-scale
        work = buffers.setdefault("bernoulli", {"draws": buffers["draws"]})
        bernoulli.draw_hits(hit, prob, self.random(values.device), work)
        # codes = t + 1 = (2 * (value > 0) - 1) * hit + 1, in {0, 1, 2}; the bool views avoid temporaries
        torch.gt(values, 0, out=codes.view(torch.bool))
        codes.mul_(2).sub_(1).mul_(hit.view(torch.uint8)).add_(1)
        if self.error_feedback:
            sent = prob.copy_(codes).sub_(1)  # prob is free again: reuse it for what was sent
            per_segment_(sent, shared, segments, torch.Tensor.mul_)
            residual = torch.sub(values, sent, out=buffers.get("residual"))
            buffers["residual"] = residual.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        return buffers["codes"]

    @staticmethod
    def carry_scale(track: BucketTrack, exponents: torch.Tensor) -> None:
        """Keep the next step's shared scale (its grid exponents, and the scale itself)."""
        track.buffers["exponents"], track.buffers["scale"] = exponents, scale_grid.grid_scale(exponents)

    @staticmethod
    def _narrow(buffer: torch.Tensor, dtype: torch.dtype, n: int) -> torch.Tensor:
        """The first ``n`` entries of an fp32 buffer's storage seen as a 16-bit ``dtype``."""
        return buffer.view(dtype)[:n]

    def decode_values(self, track: BucketTrack, shared: torch.Tensor, nonfinite: torch.Tensor,
                      lanes: torch.Tensor) -> torch.Tensor:
        """The summed lanes as fp32 values: shared scale * (field - N), per parameter segment; every entry NaN
        when ``nonfinite`` (the ranks' count or flag of non-finite values) is above 0."""
        support = track.support
        prob = track.buffers["prob"]  # as long as the lanes' fields, free again after the draws
        values = bitpack.unpack(lanes, support.kept, bitpack.lane_bits(self.world_size), out=prob)
        values.sub_(self.world_size)
        # A non-finite gradient on any rank: every scale becomes NaN, and so every decoded entry.
        shared = shared + torch.where(nonfinite > 0, torch.nan, 0.0)
        per_segment_(values, shared, support.segments, torch.Tensor.mul_)
        return values
