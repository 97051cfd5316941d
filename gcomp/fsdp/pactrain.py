"""``pactrain`` under FSDP2: each destination shard's kept entries, packed into equal rows, reduce-scattered."""
from __future__ import annotations

import time

import torch

from gcomp.collectives.allreduce import all_reduce_all
from gcomp.collectives.reduce_scatter import reduce_scatter_sum
from gcomp.compressors.pactrain_ternary import split_scales
from gcomp.core import MAX, Payload
from gcomp.fsdp.codec import ShardedCodec
from gcomp.fsdp.support import ShardSupport
from gcomp.packing.tracker import DENSE, ENTRIES, TRACKING, BucketTrack, MaskTracker


class PacTrainCodec(ShardedCodec):
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
    layout's ``ShardSupport`` (``decide``'s ``build``); what the method keeps on a frozen support is the track's
    ``state`` (``gcomp.packing.state.LayoutState``), as under DDP.

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
      words by SUM reduce-scatter: 4 * (P + 2) + 8 * world * W bytes per rank and call.

    The division by FSDP's divisor comes before encoding with ternary (``prescale``: as DDP's hook, so residuals and
    carried scales are in the mean's units). Error feedback, and the excess a carried scale clipped, are DDP's
    residual of the rank's own kept entries (its whole unsharded input), saved with the tracker.
    """

    prescale = False
    variants = ({"ternary": True}, {"ternary": True, "rounds": 2}, {"ternary": True, "error_feedback": True})

    def __init__(self, method):
        super().__init__(method)
        compressor = method.compressor
        if compressor.tracker.granularity != ENTRIES:
            raise ValueError("pactrain under FSDP2 packs single entries: granularity='groups' is not supported with "
                             "fully_shard")
        self.prescale = bool(compressor.ternary)
        self.tracker = compressor.tracker  # the compressor's: its state_dict and load_state_dict save and restore it

    def bind(self, model, group, stats) -> None:
        self.method.compressor.bind(model, group, stats)  # the tracker, the rank's draws, the counters
        self.stats = stats

    def install_flags(self) -> torch.Tensor:
        return self.tracker.install_flags()

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        self.tracker.receive_install_flags(flags)

    def reduce_scatter(self, output, input, layout, group, stats) -> None:
        start = time.perf_counter()
        track, changed_here = self.tracker.decide(layout.params, input.device,
                                                  lambda masks: ShardSupport(layout, masks, input.device))
        if track.mode in (TRACKING, DENSE):
            flags = MaskTracker.flags(track, changed_here, input.device) if track.mode == TRACKING else None
            stats["encode_s"] += time.perf_counter() - start
            reduce_scatter_sum(output, input, group, stats)
            stats["bytes_sent"] += input.numel() * input.element_size()
            if flags is not None:
                all_reduce_all(Payload([flags], ops=(MAX,)), group, stats=stats).wait()
                stats["bytes_sent"] += flags.numel() * flags.element_size()
                MaskTracker.receive_flags(track, flags)
            return
        stats["packed_buckets"] += 1
        if self.method.compressor.ternary:
            self._ternary(output, input, track, changed_here, group, stats, start)
            return
        support: ShardSupport = track.support
        wire = track.state.packed
        if wire is None:
            wire = track.state.packed = input.new_empty(layout.world, support.width + 1)
        support.pack(input, wire)
        wire[:, -1] = float(changed_here)
        stats["encode_s"] += time.perf_counter() - start
        row = wire.new_empty(support.width + 1)
        reduce_scatter_sum(row, wire.view(-1), group, stats)
        stats["bytes_sent"] += wire.numel() * wire.element_size()
        start = time.perf_counter()
        MaskTracker.receive_changed(track, row[-1:])
        support.unpack_own(row, output)
        stats["decode_s"] += time.perf_counter() - start

    def _ternary(self, output, input, track: BucketTrack, changed_here: bool, group, stats, start: float) -> None:
        """A packed step with ``ternary=True`` (the class docstring): DDP's ternary codec, rows per shard. The codec
        reads the support's ``TernaryRows`` faces: ``values`` (the whole input's kept entries, to encode) and
        ``own`` (this rank's row, to decode); its codes go to their rows (``TernaryRows.rows``) before packing."""
        codec, support, state = self.method.compressor.codec, track.support, track.state
        rows = support.ternary
        codec.gather_values(rows.values, state, input)
        scales = codec.local_scales(rows.values, state, changed_here)
        carried = codec.carried_scale(state.carry)
        if state.ternary.rows is None:  # codes laid out per row; the padding fields stay zero
            state.ternary.rows = torch.zeros(rows.world, rows.fields, dtype=torch.uint8, device=input.device)
        fields = state.ternary.rows

        def lay_out(codes: torch.Tensor) -> torch.Tensor:
            return rows.rows(codes, fields)

        if carried is None:  # two rounds: the exact shared scale first
            stats["encode_s"] += time.perf_counter() - start
            all_reduce_all(Payload([scales], ops=(MAX,)), group, stats=stats).wait()
            stats["bytes_sent"] += scales.numel() * scales.element_size()
            start = time.perf_counter()
            wire = codec.code_words(rows.values, state, split_scales(scales)[0], lay_out)
        else:  # the lanes' counting words and flags alike in every row: every rank receives their sum
            exponents, shared = carried
            wire = codec.one_round_lanes(rows.values, state, scales, exponents, shared, lay_out)
        stats["encode_s"] += time.perf_counter() - start
        row = wire.new_empty(wire.shape[1])
        reduce_scatter_sum(row, wire.view(-1), group, stats)
        stats["bytes_sent"] += wire.numel() * wire.element_size()
        start = time.perf_counter()
        if carried is None:
            shared, nonfinite, changed = codec.receive_scales(state.carry, scales)
            lanes = row
        else:
            lanes, nonfinite, changed = codec.receive_lanes(state.carry, row, rows.words, exponents)
        MaskTracker.receive_changed(track, changed)
        decoded = codec.decode_values(rows.own, state, shared, nonfinite, lanes)
        support.unpack_own(decoded if decoded.dtype == output.dtype else decoded.to(output.dtype), output)
        stats["decode_s"] += time.perf_counter() - start
