"""PacTrain's mask tracker: when a bucket's support is stable and agreed on, so that it may travel packed.

Per bucket layout it runs a small state machine, with every decision taken from information all ranks share,
so ranks never disagree on which collective comes next:

- ``tracking``: the bucket goes as a dense all-reduce, plus one small int64 MAX all-reduce of this rank's
  flags: did its masks change since the last step, and, on a candidate step, the digest of the support it
  would freeze. After ``stable_steps`` steps in which no rank's masks changed, the support is built from the
  weight masks (never from a rank's own gradient zeros, which differ across ranks) and its digest is sent;
  the next step freezes it if every rank's digest matched, or warns and tracks on if not.
  Masks present when the tracker was bound (``install``) need neither the waiting nor that agreeing step when
  every rank's digest of them agreed there (``install_flags``: one MAX all-reduce the hook state runs at
  bind time; a codec never calls a collective): a bucket freezes at its first step on a bool copy of those
  masks, so it travels packed from the first step on DDP's final buckets (the second of training by
  default). A rank whose masks changed since install packs on the agreed copy that step and flags the
  change, as in ``packed`` below. Without that agreement (no process group at bind time, masks that
  differed), masks the very ones of install, unchanged since, still skip the waiting: a bucket's first step
  sends its candidate, so it travels packed from its second step. A rank whose masks changed since install
  offers no candidate; the others see a candidate count of 0 beside theirs, count it as a change, and every
  rank tracks as above.
- ``packed``: only the support goes, densely packed, with one extra entry: how many ranks saw their masks
  change (SUM; in ``pactrain``'s ternary path a flag slot of the MAX-reduced scales: whether any did). Any
  change sends every rank back to ``tracking`` at the next step (a warning, ``unfreezes``), and drops the support
  with what the method kept on it (``BucketTrack.state``, ``gcomp.packing.state``).
- ``dense``: the frozen support keeps more than ``dense_above`` of the bucket (say, a bucket of biases and
  norms): packing would save little, so it stays a plain all-reduce.

A change is noticed on the host, for free: each mask's identity and ``_version`` (re-pruning replaces a mask,
editing it in place bumps its version). The flags a step receives are read at the next step, when their
collective has long finished, so the per-step path never waits on one. Until then, the step in which a
rank's masks changed is reduced on the support every rank agreed on: replicas stay identical and nothing
is misaligned; the new masks take effect one step later.
"""
from __future__ import annotations

import warnings
from typing import Callable

import torch
from torch import nn

from gcomp.bucket import BucketInfo
from gcomp.packing.checkpoint import carry_of, check_restored, check_track, track_entry
from gcomp.packing.groups import GroupSupport
from gcomp.packing.mask_check import mask_state, masks_differ
from gcomp.pruning.masks import mask_of, masks_digest, named_masks, parameter_of
from gcomp.packing.support import Support, SupportIndex, bucket_support
from gcomp.packing.host_flags import FLAGS, HostFlags, receive_changed, receive_flags, tracking_flags
from gcomp.packing.state import DENSE, PACKED, TRACKING, BucketTrack
from gcomp.packing.sync_bumps import SyncBumps

ENTRIES, GROUPS = "entries", "groups"  # what a support is made of: kept entries, or whole filters and channels
# builds a layout's support from its masks (one per name of the bucket, None where unmasked): ``decide``'s
# ``build``, in place of the tracker's own (a DDP bucket's ``SupportIndex`` or ``GroupSupport``)
Builder = Callable[[list], Support]

__all__ = ["BucketTrack", "Builder", "DENSE", "ENTRIES", "FLAGS", "GROUPS", "MaskTracker", "PACKED", "TRACKING"]


class MaskTracker:
    """Decides, per bucket and step, whether the bucket goes dense or packed (see the module docstring)."""

    label = "pactrain"  # the method named in warnings

    def __init__(self, stable_steps: int = 5, dense_above: float = 0.9, granularity: str = ENTRIES,
                 check_every: int = 10):
        if granularity not in (ENTRIES, GROUPS):
            raise ValueError(f"granularity must be {ENTRIES!r} or {GROUPS!r}, got {granularity!r}")
        self.stable_steps = stable_steps
        self.check_every = check_every
        self.dense_above = dense_above
        self.granularity = granularity
        self.model: nn.Module | None = None
        self.stats: dict = {}
        self.tracks: dict[str, BucketTrack] = {}
        self._restored: dict[str, dict] = {}  # checkpointed tracks, taken up when their layout comes back
        self._installed: dict[str, tuple] = {}  # each mask's (identity, version) when the tracker was bound
        # the masks at bind time, as bools, once every rank's digest of them agreed (``receive_install_flags``):
        # a bucket freezes on them at its first step, and gives its parameters' copies back
        self._agreed: dict[str, torch.Tensor] | None = None
        self.sync_bumps = SyncBumps()  # DDP's buffer broadcasts, not counted as edits (``watch``)

    def watch(self, ddp: nn.Module) -> None:
        """Tell DDP's re-sending of the masks at each forward (an in-place copy on torch up to 2.12) from edits."""
        self.sync_bumps.watch(ddp)

    def bind(self, model: nn.Module | None, stats: dict) -> None:
        self.model, self.stats = model, stats
        masks = named_masks(model) if model is not None else {}
        self._installed = {name: self.sync_bumps.version_of(mask) for name, mask in masks.items()}
        # prunex is installed before its structured prune (ADMM's hard prune, mid-training): no warning there
        if model is not None and self.label == "pactrain" and not masks:
            warnings.warn(f"{self.label}: the model has no pruning masks (torch.nn.utils.prune), so every bucket "
                          "goes as a dense all-reduce until masks appear; prune it first (gcomp.pruning.prune)",
                          UserWarning, stacklevel=3)

    def install_flags(self) -> torch.Tensor:
        """``[hash, count, -hash, -count]`` of the digest of every mask the model holds at bind time (all zero
        without masks), to be MAX-reduced once over the ranks (the hook state does it)."""
        masks = named_masks(self.model) if self.model is not None else {}
        digest = masks_digest(m for m in masks.values()).cpu()
        return torch.cat([digest, -digest])

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        """Every rank held the same masks at bind time (the MAX of both signs agrees): keep a bool copy of them,
        so that each bucket freezes on them at its first step, with no agreeing step of its own. A rank whose
        masks changed since then packs on these agreed ones that step and flags the change (every rank then
        tracks again), as a packed step does."""
        if self.model is None or flags[1] <= 0 or not torch.equal(flags[:2], -flags[2:]):
            return
        self._agreed = {name: mask.detach() != 0 for name, mask in named_masks(self.model).items()}

    def _masks(self, info: BucketInfo) -> list[torch.Tensor | None]:
        if self.model is None:
            return [None] * len(info.names)
        return [mask_of(self.model, name) for name in info.names]

    def _signature(self, info: BucketInfo) -> tuple:
        return tuple(None if m is None else self.sync_bumps.version_of(m) for m in self._masks(info))

    def _build(self, info: BucketInfo, device, masks: list | None = None, build: Builder | None = None) -> Support:
        """The layout's support from ``masks`` (default: the model's, now), by ``build`` when given."""
        masks = self._masks(info) if masks is None else masks
        if build is not None:
            return build(masks)
        params = []
        for name, numel, mask in zip(info.names, info.numels, masks):
            if mask is None or self.model is None:
                params.append((torch.Size([numel]), (1,), None))
            else:
                p = parameter_of(self.model, name)
                params.append((p.size(), p.stride(), mask.to(device)))
        if self.granularity == GROUPS:
            return GroupSupport(params, info.numel, device)
        return SupportIndex(bucket_support(params, info.numel, device), info.numels)

    def decide(self, info: BucketInfo, device, build: Builder | None = None) -> tuple[BucketTrack, bool]:
        """This step's state for the bucket, and whether this rank's masks changed since the last step.

        ``build``: makes the layout's support from its masks (one per name of ``info``, None where unmasked), in
        place of the tracker's own (FSDP2's codec packs rows per destination shard); used for every support of
        the layout, the one a checkpoint is compared with included. Pass the same one at every step."""
        track = self.tracks.get(info.key)
        if track is None:
            track = self.tracks[info.key] = self._restore(info, device, build)
            track.names = info.names
        signature = self._signature(info)
        changed_here = track.signature is not None and signature != track.signature
        track.signature = signature
        if track.fresh:
            track.fresh = False
            if self._agreed is not None and any(n in self._agreed for n in info.names):
                agreed = [self._agreed.pop(n, None) for n in info.names]
                self._freeze(track, self._build(info, device, agreed, build), info)
                return track, signature != tuple(self._installed.get(n) for n in info.names)
            if any(s is not None for s in signature):  # a bucket of pruned parameters
                if signature == tuple(self._installed.get(n) for n in info.names):
                    track.candidate = self._build(info, device, build=build)  # its digest goes with the flags
                    return track, changed_here
        if track.mode == DENSE:
            return track, changed_here
        if track.mode == PACKED and self.check_every:
            changed_here |= self._edited_in_place(info, track)
        pending, track.pending = track.pending, None
        any_changed, agree = True, False
        if pending is not None:  # its copy was issued a step ago: this read is the one host_syncs declares
            any_changed, agree = (bool(v) for v in pending.values()[:2])

        if track.mode == PACKED and any_changed:
            self._count("unfreezes")
            warnings.warn(f"{self.label}: the masks of bucket {info.index} changed on some rank; sending it dense and "
                          "tracking its support again", RuntimeWarning, stacklevel=2)
            track.unfreeze()
        elif track.mode == TRACKING:
            if track.candidate is not None:
                candidate, track.candidate = track.candidate, None
                if not any_changed and agree:
                    self._freeze(track, candidate, info)
                    return track, changed_here
                if not any_changed:
                    self._count("mask_mismatches")
                    warnings.warn(f"{self.label}: ranks hold different masks for bucket {info.index} (their support "
                                  "digests differ); it stays a dense all-reduce and is checked again later",
                                  RuntimeWarning, stacklevel=2)
                track.stable = 0
            elif any_changed:
                track.stable = 0
            else:
                track.stable += 1
            if track.stable >= self.stable_steps:
                track.candidate = self._build(info, device, build=build)
        return track, changed_here

    def _edited_in_place(self, info: BucketInfo, track: BucketTrack) -> bool | torch.Tensor:
        """Every ``check_every`` packed steps: whether the masks differ from those the bucket froze on. An edit
        through ``mask.data`` leaves the mask's ``_version`` as it was, so only their contents tell; the answer
        rides in the packed payload's changed entry, so no rank packs on stale masks for longer than that. On the
        device path a 0-d bool tensor (``gcomp.packing.mask_check``): nothing waits for it."""
        track.unchecked += 1
        if track.unchecked < self.check_every:
            return False
        track.unchecked = 0
        now = self._mask_digest(info, track.mask_digest)
        if track.mask_digest is None:  # a track made by hand (a benchmark) starts from the masks it sees
            track.mask_digest = now
        return masks_differ(now, track.mask_digest)

    def _mask_digest(self, info: BucketInfo, like: torch.Tensor | None = None) -> torch.Tensor:
        return mask_state([m for m in self._masks(info) if m is not None], like)

    def _restore(self, info: BucketInfo, device, build: Builder | None = None) -> BucketTrack:
        """A new track, or the checkpointed one when the support it froze (or had out as a candidate),
        rebuilt from the masks, is still the same.

        Every rank loads the same checkpoint and (DDP broadcast the buffers) holds the same masks, so every
        rank takes the same decision here without a collective.
        """
        saved = self._restored.pop(info.key, None)
        if saved is None:
            return BucketTrack(fresh=True)
        check_restored(f"{self.label}: tracker entry {info.key!r}", saved, info.names)
        support = self._build(info, device, build=build) if "digest" in saved else None
        if support is not None and not torch.equal(support.digest.cpu(), saved["digest"].cpu()):
            return BucketTrack()
        track = BucketTrack(mode=saved["mode"], stable=saved["stable"],
                            pending=HostFlags(saved["pending"]) if "pending" in saved else None)
        if track.mode == TRACKING:
            track.candidate = support
        else:
            track.support = support
            track.mask_digest = self._mask_digest(info)
        track.state.carry = carry_of(saved, device)  # what the method carried on this support
        return track

    def state_dict(self) -> dict:
        """Per bucket layout: mode, stable count, the flags received last, the digest of the frozen (or
        candidate) support, and what the method carries with the support (``Carry``): the residual (error
        feedback, or a carried excess) and the exponents of the ternary scale carried to the next step (none
        when a resync is pending: the next step takes the exact scale then). ``gcomp.packing.checkpoint``.
        Entries a load left for layouts not seen since are saved as they were: a checkpoint taken right after
        ``load_state_dict`` holds everything the loaded one did."""
        return {**self._restored, **{key: track_entry(t) for key, t in self.tracks.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"{self.label}: the tracker state must be a dict, got {type(state).__name__}")
        for key, entry in state.items():
            check_track(f"{self.label}: tracker entry {key!r}", entry, key)
        self.tracks, self._restored = {}, dict(state)

    def _freeze(self, track: BucketTrack, support: Support, info: BucketInfo) -> None:
        self._count("freezes")
        track.support = support
        track.mask_digest, track.unchecked = self._mask_digest(info), 0
        track.mode = DENSE if support.kept > self.dense_above * support.numel else PACKED
        if track.mode == DENSE and any(m is not None for m in self._masks(info)):
            # a pruned bucket that still keeps too much to pack: said once, when its support freezes
            warnings.warn(f"{self.label}: bucket {info.index} keeps {support.kept / support.numel:.0%} of its "
                          f"entries after pruning, more than dense_above={self.dense_above}: it travels as a plain "
                          "dense all-reduce, neither packed nor ternarised; prune more or raise dense_above to pack "
                          "it", UserWarning, stacklevel=3)

    def _count(self, key: str) -> None:
        if key in self.stats:
            self.stats[key] += 1

    # what a step sends and receives besides the bucket (``gcomp.packing.host_flags``)
    flags = staticmethod(tracking_flags)
    receive_flags = staticmethod(receive_flags)
    receive_changed = staticmethod(receive_changed)
