"""Packing: reducing a pruned model's buckets on what their masks keep (``pactrain`` and ``prunex`` use it).

- ``support``: ``Support``, the interface; ``SupportIndex`` keeps single entries (contiguous slices plus int32
  positions) and ``bucket_support`` builds a bucket's flat support from its parameters' masks;
- ``groups``: ``GroupSupport`` keeps whole filters and channels (one index per group, none per entry);
- ``positions``: both supports' device path (``gcomp.kernels.on_device``): one int32 index of every kept position,
  one ``index_select`` to pack and one ``index_add_`` to unpack; ``lanes``: PacTrain's integer lanes packed in a
  few whole-tensor operations there; ``mask_check``: the in-place mask check, with no host read there;
- ``tracker``: ``MaskTracker``, the per-bucket state machine that decides, from what every rank shares,
  when a bucket's support is stable and agreed on, so that it may travel packed; ``host_flags``: the flags
  it receives, read at the next step; ``sync_bumps``: DDP's buffer broadcasts told from mask edits;
  ``checkpoint``: its checkpoint entries, written, checked and taken up;
- ``state``: ``BucketTrack``, the tracker's state per bucket layout, and ``LayoutState``, what the method keeps
  with the frozen support, typed: ``Carry`` (carried to the next step, checkpointed), ``TernaryWork`` (the
  ternary codec's work buffers) and the lossless packed buffer.

The masks themselves come from ``gcomp.pruning`` (the floor below: it imports nothing from here).
"""
from gcomp.packing.groups import GroupSupport
from gcomp.packing.support import Support, SupportIndex, bucket_support
from gcomp.packing.state import Carry, LayoutState, TernaryWork
from gcomp.packing.tracker import DENSE, ENTRIES, GROUPS, PACKED, TRACKING, BucketTrack, MaskTracker

__all__ = ["BucketTrack", "Carry", "DENSE", "ENTRIES", "GROUPS", "GroupSupport", "LayoutState", "MaskTracker",
           "PACKED", "Support", "SupportIndex", "TRACKING", "TernaryWork", "bucket_support"]
