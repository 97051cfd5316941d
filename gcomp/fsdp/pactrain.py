"""``pactrain`` under FSDP2: each destination shard's kept entries, packed into equal rows, reduce-scattered."""
from __future__ import annotations

import time

import torch

from gcomp.bucket import BucketInfo
from gcomp.collectives.allreduce import all_reduce_all
from gcomp.collectives.reduce_scatter import reduce_scatter_sum
from gcomp.core import MAX, Payload
from gcomp.fsdp.codec import ShardedCodec
from gcomp.fsdp.layout import ShardLayout
from gcomp.fsdp.support import ShardSupport
from gcomp.packing.tracker import DENSE, ENTRIES, TRACKING, MaskTracker


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

    ``ternary=True`` is refused under FSDP2 (its integer lanes are built for a whole bucket's support).
    """

    prescale = False

    def __init__(self, method):
        super().__init__(method)
        compressor = method.compressor
        if compressor.ternary:
            raise ValueError("pactrain under FSDP2 packs losslessly only: ternary=True is not supported with "
                             "fully_shard (use it under DDP, or pactrain without ternary)")
        old = compressor.tracker
        # the compressor keeps it, so its state_dict and load_state_dict save and restore this tracker
        self.tracker = compressor.tracker = ShardMaskTracker(old.stable_steps, old.dense_above, old.check_every)

    def bind(self, model, group, stats) -> None:
        self.tracker.bind(model, stats)
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
