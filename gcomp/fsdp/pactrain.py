"""``pactrain`` under FSDP2: each destination shard's kept entries, packed into equal rows, reduce-scattered."""
from __future__ import annotations

import time

import torch

from gcomp.bucket import BucketInfo
from gcomp.collectives.allreduce import all_reduce_all
from gcomp.collectives.reduce_scatter import reduce_scatter_sum
from gcomp.compressors import scale_grid
from gcomp.compressors.pactrain_ternary import FLAGS
from gcomp.core import MAX, Payload
from gcomp.fsdp.codec import ShardedCodec
from gcomp.fsdp.layout import ShardLayout
from gcomp.fsdp.support import ShardSupport
from gcomp.packing.host_flags import host_flag
from gcomp.packing.tracker import DENSE, ENTRIES, PACKED, TRACKING, BucketTrack, MaskTracker


class ShardMaskTracker(MaskTracker):
    """PacTrain's mask tracker (``gcomp.packing.tracker``: when a group's masks are stable and agreed on) whose
    supports are FSDP's rows (``ShardSupport``) instead of a DDP bucket's."""

    def __init__(self, stable_steps: int, dense_above: float, check_every: int):
        super().__init__(stable_steps, dense_above, ENTRIES, check_every)
        self.layouts: dict[str, ShardLayout] = {}  # ``ShardLayout.params.key`` -> layout

    def _build(self, info: BucketInfo, device, masks: list | None = None) -> ShardSupport:
        masks = self._masks(info) if masks is None else masks
        return ShardSupport(self.layouts[info.key], masks, device)


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

    ``ternary=True`` (packed steps; tracking and dense as above), DDP's ternary codec
    (``gcomp.compressors.pactrain_ternary``) on the kept entries of the whole input, one shared scale per
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
        old = compressor.tracker
        if old.granularity != ENTRIES:
            raise ValueError("pactrain under FSDP2 packs single entries: granularity='groups' is not supported with "
                             "fully_shard")
        self.prescale = bool(compressor.ternary)
        # the compressor keeps it, so its state_dict and load_state_dict save and restore this tracker
        self.tracker = compressor.tracker = ShardMaskTracker(old.stable_steps, old.dense_above, old.check_every)

    def bind(self, model, group, stats) -> None:
        self.method.compressor.bind(model, group, stats)  # the tracker, the rank's draws, the counters
        self.stats = stats

    def install_flags(self) -> torch.Tensor:
        return self.tracker.install_flags()

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        self.tracker.receive_install_flags(flags)

    def reduce_scatter(self, output, input, layout, group, stats) -> None:
        start = time.perf_counter()
        info = layout.params
        self.tracker.layouts[info.key] = layout
        track, changed_here = self.tracker.decide(info, input.device)
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
        wire = track.buffers.get("wire")
        if wire is None:
            wire = track.buffers["wire"] = input.new_empty(layout.world, support.width + 1)
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
        """A packed step with ``ternary=True`` (the class docstring): DDP's ternary codec, rows per shard."""
        compressor, support = self.method.compressor, track.support
        rows = support.ternary
        # TernaryPath reads the support and the buffers of a track: the values' face of this support, this
        # track's buffers (where the residual and the carried scale live, saved with the tracker)
        values = BucketTrack(mode=PACKED, support=rows.values, buffers=track.buffers)
        compressor.gather_values(values, input)
        scales = compressor.local_scales(values)
        scales[-2] = float(changed_here)
        carried = compressor.carried_scale(values)
        fields = track.buffers.get("rows")
        if fields is None:  # codes laid out per row; the padding fields stay zero
            fields = track.buffers["rows"] = torch.zeros(rows.world, rows.fields, dtype=torch.uint8,
                                                         device=input.device)
        if carried is None:  # two rounds: the exact shared scale first
            stats["encode_s"] += time.perf_counter() - start
            all_reduce_all(Payload([scales], ops=(MAX,)), group, stats=stats).wait()
            stats["bytes_sent"] += scales.numel() * scales.element_size()
            start = time.perf_counter()
            shared, nonfinite, changed = scales[:-2], scales[-1], scales[-2:-1]
            wire = rows.rows(compressor.draw_codes(values, shared), fields)
        else:
            compressor._count("one_round_buckets")
            exponents, shared = carried
            codes, hist, resync = compressor.one_round_codes(values, scales, exponents, shared)
            wire = torch.empty(rows.world, rows.words + hist.numel() + FLAGS, dtype=torch.int64,
                               device=input.device)
            wire[:, :rows.words] = rows.rows(codes, fields)
            wire[:, rows.words:-FLAGS] = hist  # alike in every row: every rank receives the sum
            wire[:, -3] = scales[-1].to(torch.int64)
            wire[:, -2] = scales[-2].to(torch.int64)
            wire[:, -1] = resync
        stats["encode_s"] += time.perf_counter() - start
        row = wire.new_empty(wire.shape[1])
        reduce_scatter_sum(row, wire.view(-1), group, stats)
        stats["bytes_sent"] += wire.numel() * wire.element_size()
        start = time.perf_counter()
        if carried is None:
            compressor.carry_scale(values, scale_grid.grid_exponent(shared))
        else:
            nonfinite, changed = row[-3], row[-2:-1]
            compressor.carry_scale(values, scale_grid.next_exponent(row[rows.words:-FLAGS], exponents,
                                                                     rows.world))
            track.buffers["resync"] = host_flag(row[-1:] > 0)
        MaskTracker.receive_changed(track, changed)
        own = BucketTrack(mode=PACKED, support=rows.own, buffers=track.buffers)
        decoded = compressor.decode_values(own, shared, nonfinite, row[:rows.words])
        support.unpack_own(decoded if decoded.dtype == output.dtype else decoded.to(output.dtype), output)
        stats["decode_s"] += time.perf_counter() - start
