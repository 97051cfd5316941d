"""``pactrain`` under FSDP2: ``PacTrainRows``, the row strategy that lays its compressor's payload out one row per
destination shard (``gcomp.sharding``), each shard's kept entries packed into equal rows."""
from __future__ import annotations

import torch

from gcomp.compressors.pactrain_payload import ONE_ROUND, TERNARY, PackedCtx
from gcomp.core import MAX, SUM, Payload
from gcomp.packing.shard_support import ShardSupport
from gcomp.packing.tracker import DENSE, ENTRIES, PACKED, TRACKING, MaskTracker
from gcomp.sharding import RowStrategy


class PacTrainRows(RowStrategy):
    """On the wire, per FSDP parameter group and step, by the mask tracker's state:

    - tracking / dense: the input as it is by SUM reduce-scatter, and while tracking 5 int64 flags by MAX
      all-reduce (did this rank's masks change; the digest of the support it would freeze);
    - packed: a (world, K + 1) matrix by SUM reduce-scatter: row r holds the entries shard r keeps (K_r of them,
      the masks are global knowledge, so every rank packs alike), zero-padded to K = max_r K_r, then one entry
      counting ranks whose masks changed. world * (K + 1) entries of the reduce dtype per rank and call. Each rank
      scatters its reduced row onto its shard's kept entries: FSDP's own reduce-scatter on the support, bit for bit
      on two ranks (the division comes after the sum, as FSDP's), and zero off it, where every rank's gradient is
      zero anyway (``weight_orig * weight_mask``).

    The mask tracker is the compressor's (``compressor.tracker``, saved with its ``state_dict``), deciding on this
    layout's ``ShardSupport`` (``gcomp.packing.shard_support``; ``decide``'s ``build``); what the method keeps on a
    frozen support is the track's ``state`` (``gcomp.packing.state.LayoutState``), as under DDP.

    ``ternary=True`` (packed steps; tracking and dense as above), DDP's ternary codec (``compressor.codec``, a
    ``gcomp.compressors.pactrain_ternary.TernaryCodec``) on the kept entries of the whole input, one shared scale per
    parameter as under DDP, each destination shard's codes in its own row of integer lanes
    (``support.TernaryRows``): b = ``lane_bits(world)``-bit fields, ``W = packed_words(K, b)`` int64 words per row
    (K as above), so that the SUM reduce-scatter cuts the lanes between rows and each rank decodes its own row:

    - one round (``rounds=1``, once a scale was shared): a (world, W + H + 3) int64 matrix by SUM reduce-scatter,
      row r = shard r's code words, then, alike in every row (so every rank receives their sum, as an all-reduce
      would give), this rank's ``H = scale_grid.hist_words(P, world)`` words of counting lanes (P parameters in the
      module: the next step's scales) and its 3 flags (non-finite, masks changed, resync). 8 * world * (W + H + 3)
      bytes per rank and call;
    - two rounds (the first packed step, after a resync, every step with ``rounds=2``): the P per-parameter scales
      and 2 flags in fp32 by MAX all-reduce (the exact shared scale), then a (world, W) int64 matrix of the code
      words by SUM reduce-scatter: 4 * (P + 2) + 8 * world * W bytes per rank and call (a chained payload, as
      under DDP: ``PacTrainCompressor.second_round`` draws the codes between the rounds).

    The division by FSDP's divisor comes before encoding with ternary (lossy: as DDP's hook, so residuals and
    carried scales are in the mean's units), after the sum without (lossless). Error feedback, and the excess a carried scale clipped, are DDP's
    residual of the rank's own kept entries (its whole unsharded input), saved with the tracker.
    """

    variants = ({"ternary": True}, {"ternary": True, "rounds": 2}, {"ternary": True, "error_feedback": True})

    def check(self, method) -> None:
        if method.compressor.tracker.granularity != ENTRIES:
            raise ValueError("pactrain under FSDP2 packs single entries: granularity='groups' is not supported with "
                             "fully_shard")

    def compress(self, compressor, tensor, layout):
        world, device = layout.world, tensor.device
        track, changed_here = compressor.tracker.decide(layout.params, device,
                                                        lambda masks: ShardSupport(layout, masks, device))
        if track.mode == TRACKING:
            return Payload([tensor.view(world, -1), MaskTracker.flags(track, changed_here, device)],
                           PackedCtx(TRACKING, track, tensor), ops=(SUM, MAX), whole=(1,))
        if track.mode == DENSE:
            return Payload([tensor.view(world, -1)], PackedCtx(DENSE, track, tensor))
        compressor.count("packed_buckets")
        support: ShardSupport = track.support
        state, codec = track.state, compressor.codec
        if not compressor.ternary:
            if state.packed is None:
                state.packed = tensor.new_empty(world, support.width + 1)
            support.pack(tensor, state.packed)
            state.packed[:, -1] = float(changed_here)
            return Payload([state.packed], PackedCtx(PACKED, track, tensor))
        rows = support.ternary  # the values to encode (the whole input's kept entries) and where each code goes
        codec.gather_values(rows.values, state, tensor)
        scales = codec.local_scales(rows.values, state, changed_here)
        carried = codec.carried_scale(state.carry)
        if state.ternary.rows is None:  # codes laid out per row; the padding fields stay zero
            state.ternary.rows = torch.zeros(world, rows.fields, dtype=torch.uint8, device=device)
        fields = state.ternary.rows

        def lay_out(codes: torch.Tensor) -> torch.Tensor:
            return rows.rows(codes, fields)

        if carried is None:  # two rounds: the exact shared scale first, then the codes (``second_round``)
            lanes = torch.empty(world, rows.words, dtype=torch.int64, device=device)
            return Payload([scales, lanes], PackedCtx(TERNARY, track, tensor, face=rows.values, lay_out=lay_out),
                           ops=(MAX, SUM), whole=(0,))
        lanes = codec.one_round_lanes(rows.values, state, scales, *carried, lay_out)  # counts alike in every row
        return Payload([lanes], PackedCtx(ONE_ROUND, track, tensor, *carried, face=rows.values, lay_out=lay_out))

    def decode(self, compressor, received, payload, layout, output):
        ctx: PackedCtx = payload.ctx
        track = ctx.track
        if ctx.mode in (TRACKING, DENSE):
            if ctx.mode == TRACKING:
                MaskTracker.receive_flags(track, received[1])
            output.copy_(received[0])
            return
        support: ShardSupport = track.support
        if ctx.mode == PACKED:
            MaskTracker.receive_changed(track, received[0][-1:])
            support.unpack_own(received[0], output)
            return
        rows, state, codec = support.ternary, track.state, compressor.codec
        if ctx.mode == TERNARY:
            shared, nonfinite, changed = codec.receive_scales(state.carry, received[0])
            lanes = received[1]
        else:
            shared = ctx.scale
            lanes, nonfinite, changed = codec.receive_lanes(state.carry, received[0], rows.words, ctx.exponents)
        MaskTracker.receive_changed(track, changed)
        decoded = codec.decode_values(rows.own, state, shared, nonfinite, lanes)
        support.unpack_own(decoded if decoded.dtype == output.dtype else decoded.to(output.dtype), output)
