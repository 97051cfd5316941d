"""``pactrain`` under FSDP2: ``PacTrainRows``, its row strategy (``gcomp.sharding``), runs the compressor's own
encoder and decoder (``PacTrainCompressor.encode``, ``.decode``, DDP's too) on ``RowsView``, one row per
destination shard, each shard's kept entries packed into equal rows."""
from __future__ import annotations

import torch

from gcomp.packing.shard_support import ShardSupport
from gcomp.packing.tracker import ENTRIES
from gcomp.sharding import RowStrategy, ShardLayout


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
    shard_state = ("its mask tracker and ternary state (residuals, carried scales) per FSDP module, keyed and "
                   "ordered by its shards")

    def check(self, method) -> None:
        if method.compressor.tracker.granularity != ENTRIES:
            raise ValueError("pactrain under FSDP2 packs single entries: granularity='groups' is not supported with "
                             "fully_shard")

    def compress(self, compressor, tensor, layout):
        return compressor.encode(tensor, layout.params, RowsView(layout))

    def decode(self, compressor, received, payload, layout, output):
        compressor.decode(received, payload.ctx, output)


class RowsView:
    """FSDP2's reduce-scatter input as ``PacTrainCompressor.encode`` lays it out: rows, one per destination shard
    (``layout``): while tracking or dense the input itself, (world, S); packed, each row's kept entries padded to
    the longest row and one changed entry, (world, K + 1) (``ShardSupport.pack``); ternary, the codec on the kept
    entries of the whole input (``TernaryRows.values``), each code laid into its destination's row of lanes, and
    this rank's row decoded (``TernaryRows.own``). What comes back is this rank's row, unpacked onto its shard."""

    in_rows = True

    def __init__(self, layout: ShardLayout):
        self.layout = layout

    def build(self, device):
        """This layout's supports are ``ShardSupport``s (the tracker builds one when it freezes)."""
        return lambda masks: ShardSupport(self.layout, masks, device)

    def dense(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.view(self.layout.world, -1)

    def packed(self, support: ShardSupport, state, tensor: torch.Tensor) -> torch.Tensor:
        if state.packed is None:
            state.packed = tensor.new_empty(self.layout.world, support.width + 1)
        return support.pack(tensor, state.packed)

    def ternary(self, support: ShardSupport, codec):
        rows = support.ternary
        return rows.values, rows.own, rows.words

    def lay_out(self, support: ShardSupport, state, device):
        rows = support.ternary
        if state.ternary.rows is None:  # codes laid out per row; the padding fields stay zero
            state.ternary.rows = torch.zeros(rows.world, rows.fields, dtype=torch.uint8, device=device)
        fields = state.ternary.rows
        return lambda codes: rows.rows(codes, fields)

    def lanes(self, words: int, device) -> torch.Tensor:
        return torch.empty(self.layout.world, words, dtype=torch.int64, device=device)

    def result(self, received: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out.copy_(received)

    def unpack(self, support: ShardSupport, row: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return support.unpack_own(row, out)
