"""PacTrain's mask tracker: when a layout's support is stable and agreed on, so that it may travel packed.

Per layout it runs a small state machine, every decision taken from what all ranks share, so ranks never disagree
on which collective comes next:

- ``tracking``: the bucket goes dense, plus 5 int64 flags by MAX: did this rank's masks change since the last
  step, and on a candidate step the digest of the support it would freeze. After ``stable_steps`` steps in which
  no rank's masks changed, the support is built from the masks (never from a rank's gradient zeros) and its
  digest sent; the next step freezes it if every rank's digest matched, else warns and tracks on. Masks every
  rank held alike at bind time (``install_flags``, one MAX all-reduce the state runs) freeze at a layout's first
  step; masks as installed but not agreed there skip the waiting: the first step sends the candidate. A rank
  whose masks changed since install offers none; the others see a count of 0 beside theirs and count a change.
- ``packed``: only the support goes, with one entry counting ranks whose masks changed (ternary: a flag slot of
  the MAX-reduced scales, or a count in the lanes). Any change sends every rank back to ``tracking`` at the next
  step (a warning, ``unfreezes``), dropping the support and what the codec carried on it (``Carry``).
- ``dense``: the frozen support keeps more than ``dense_above`` of the layout: packing would save little.

A change is noticed on the host for free: each mask's identity and ``_version`` (less the bumps of DDP's own buffer
broadcast, ``gcomp.pruning.masks.SyncBumps``); every ``check_every`` packed steps the masks' contents are compared on the device too
(an edit through ``.data`` keeps the version). The flags a step receives are read at the next step, when their
collective has long finished (``HostFlags``: the one host synchronisation); until then the step in which a rank's
masks changed is reduced on the support every rank agreed on.
"""
from __future__ import annotations

import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from gcomp.bucket import BucketInfo
from gcomp.pruning.masks import SyncBumps, mask_of, masks_digest, named_masks
from gcomp.state_checks import check_state

TRACKING, PACKED, DENSE = "tracking", "packed", "dense"
ENTRIES, GROUPS = "entries", "groups"  # a support of kept entries, or of whole filters and channels
FLAGS = 5  # a tracking step's: changed, digest hash, digest count, -hash, -count (MAX of both signs: max and min)


@dataclass
class Carry:
    """What the ternary path carries from one step of a frozen support to the next; ``residual`` and ``exponents``
    are checkpointed. ``residual``: fp32, one per kept value, added to the next step's values (error feedback, or
    the excess a carried scale clipped); ``exponents``: int64, one per parameter, the grid exponents of the scale
    the next step encodes against in one round (None before the first shared scale and after a resync);
    ``scale``: theirs; ``resync``: a one-round step's "some rank asks a resync", read at the next step."""

    residual: torch.Tensor | None = None
    exponents: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    resync: Any = None


@dataclass
class BucketTrack:
    """The tracker's state for one layout."""

    mode: str = TRACKING
    stable: int = 0  # consecutive steps in which no rank's masks changed
    signature: tuple | None = None
    pending: Any = None  # [any rank changed, digests agree(, resync)] on their way to the host (``HostFlags``)
    candidate: Any = None
    support: Any = None
    carry: Carry = field(default_factory=Carry)  # the codec's, dropped with the support
    masks: torch.Tensor | None = None  # a packed layout's masks as they froze (bool, mask after mask)
    unchecked: int = 0  # packed steps since the masks were last compared with ``masks``
    fresh: bool = False  # made for a new layout, not restored: its first step may send a candidate at once
    names: tuple[str, ...] = ()

    def unfreeze(self) -> None:
        self.mode, self.stable, self.support, self.carry = TRACKING, 0, None, Carry()


class MaskTracker:
    """Decides, per layout and step, whether the bucket goes dense or packed (the module docstring). ``decide``
    takes a ``build(masks) -> support`` of the codec's (one mask per name of the layout, None where unmasked)."""

    label = "pactrain"  # the method named in warnings

    def __init__(self, stable_steps: int = 5, dense_above: float = 0.9, granularity: str = ENTRIES,
                 check_every: int = 10):
        if granularity not in (ENTRIES, GROUPS):
            raise ValueError(f"granularity must be {ENTRIES!r} or {GROUPS!r}, got {granularity!r}")
        self.stable_steps, self.dense_above = stable_steps, dense_above
        self.granularity, self.check_every = granularity, check_every
        self.model: nn.Module | None = None
        self.stats: dict = {}
        self.tracks: dict[str, BucketTrack] = {}
        self._restored: dict[str, dict] = {}  # checkpointed tracks, taken up when their layout comes back
        self._installed: dict[str, tuple] = {}  # each mask's (identity, version) at bind
        self._agreed: dict[str, torch.Tensor] | None = None  # bool copies of the masks every rank held at bind
        self.sync_bumps = SyncBumps()

    def watch(self, ddp: nn.Module) -> None:
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
        """``[hash, count, -hash, -count]`` of the digest of every mask at bind (zeros without), MAX-reduced."""
        digest = masks_digest(named_masks(self.model).values() if self.model is not None else []).cpu()
        return torch.cat([digest, -digest])

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        """Every rank held the same masks at bind: keep bool copies, on which each layout freezes at once."""
        if self.model is None or flags[1] <= 0 or not torch.equal(flags[:2], -flags[2:]):
            return
        self._agreed = {name: mask.detach() != 0 for name, mask in named_masks(self.model).items()}

    def _masks(self, info: BucketInfo) -> list[torch.Tensor | None]:
        return [None if self.model is None else mask_of(self.model, name) for name in info.names]

    def _signature(self, info: BucketInfo) -> tuple:
        return tuple(None if m is None else self.sync_bumps.version_of(m) for m in self._masks(info))

    def decide(self, info: BucketInfo, build: Callable[[list], Any]) -> tuple[BucketTrack, bool | torch.Tensor]:
        """This step's track for the layout, and whether this rank's masks changed since the last step (a 0-d
        bool tensor on a step that compares the masks' contents)."""
        track = self.tracks.get(info.key)
        if track is None:
            track = self.tracks[info.key] = self._restore(info, build)
            track.names = info.names
        signature = self._signature(info)
        changed_here = track.signature is not None and signature != track.signature
        track.signature = signature
        installed = tuple(self._installed.get(n) for n in info.names)
        if track.fresh:
            track.fresh = False
            if self._agreed is not None and any(n in self._agreed for n in info.names):
                self._freeze(track, build([self._agreed.pop(n, None) for n in info.names]), info)
                return track, signature != installed
            if any(s is not None for s in signature) and signature == installed:
                track.candidate = build(self._masks(info))  # its digest goes with this step's flags
                return track, changed_here
        if track.mode == DENSE:
            return track, changed_here
        if track.mode == PACKED and self.check_every:
            changed_here |= self._edited_in_place(info, track)
        pending, track.pending = track.pending, None
        any_changed, agree = True, False
        if pending is not None:  # its copy was issued a step ago: the read ``host_syncs`` declares
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
            else:
                track.stable = 0 if any_changed else track.stable + 1
            if track.stable >= self.stable_steps:
                track.candidate = build(self._masks(info))
        return track, changed_here

    def _edited_in_place(self, info: BucketInfo, track: BucketTrack) -> bool | torch.Tensor:
        """Every ``check_every`` packed steps: whether the masks differ from those the layout froze on, as a 0-d
        bool tensor that rides in the packed payload's changed entry (nothing waits for it)."""
        track.unchecked += 1
        if track.unchecked < self.check_every:
            return False
        track.unchecked = 0
        now = self._mask_copy(info)
        if track.masks is None:  # a track made by hand (a benchmark) starts from the masks it sees
            track.masks = now
        return True if now.shape != track.masks.shape else now.ne(track.masks).any()

    def _mask_copy(self, info: BucketInfo) -> torch.Tensor:
        masks = [m.detach().reshape(-1) for m in self._masks(info) if m is not None]
        return torch.cat(masks).ne(0) if masks else torch.zeros(0, dtype=torch.bool)

    def _freeze(self, track: BucketTrack, support, info: BucketInfo) -> None:
        self._count("freezes")
        track.support, track.masks, track.unchecked = support, self._mask_copy(info), 0
        track.mode = DENSE if support.kept > self.dense_above * support.numel else PACKED
        if track.mode == DENSE and any(m is not None for m in self._masks(info)):
            warnings.warn(f"{self.label}: bucket {info.index} keeps {support.kept / support.numel:.0%} of its "
                          f"entries after pruning, more than dense_above={self.dense_above}: it travels as a plain "
                          "dense all-reduce, neither packed nor ternarised; prune more or raise dense_above to pack "
                          "it", UserWarning, stacklevel=3)

    def _count(self, key: str) -> None:
        if key in self.stats:
            self.stats[key] += 1

    # --- checkpoints: one entry per layout ---------------------------------------------------------------------

    def _restore(self, info: BucketInfo, build) -> BucketTrack:
        """A new track, or the checkpointed one when the support it froze (or had out as a candidate), rebuilt
        from the masks, is still the same: every rank loads the same checkpoint and holds the same masks, so
        every rank decides alike without a collective."""
        saved = self._restored.pop(info.key, None)
        if saved is None:
            return BucketTrack(fresh=True)
        where = f"{self.label}: tracker entry {info.key!r}"
        if "exponents" in saved and saved["exponents"].numel() != len(info.names):
            raise ValueError(f"{where}: 'exponents' holds {saved['exponents'].numel()} entries, one per parameter "
                             f"of the layout, which has {len(info.names)} ({_names(info.names)}): the checkpoint is "
                             "of another model")
        support = build(self._masks(info)) if "digest" in saved else None
        if support is not None and not torch.equal(support.digest.cpu(), saved["digest"].cpu()):
            return BucketTrack()
        track = BucketTrack(mode=saved["mode"], stable=saved["stable"],
                            pending=HostFlags(saved["pending"]) if "pending" in saved else None)
        if track.mode == TRACKING:
            track.candidate = support
        else:
            track.support, track.masks = support, self._mask_copy(info)
        device = support.digest.device if support is not None else "cpu"
        track.carry = Carry(*(saved[k].to(device) if k in saved else None for k in ("residual", "exponents")))
        return track

    def state_dict(self) -> dict:
        """Per layout: ``mode``, ``stable``, ``names`` (its parameters), and where they apply ``pending`` (the
        flags received last, bool (2,)), ``digest`` (int64 (hash, count) of the frozen or candidate support),
        ``residual`` and ``exponents`` (``Carry``; no exponents while a resync is pending). Entries a load left for
        layouts not seen since are saved as they were."""
        return {**self._restored, **{key: _entry(t) for key, t in self.tracks.items()}}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict):
            raise ValueError(f"{self.label}: the tracker state must be a dict, got {type(state).__name__}")
        for key, entry in state.items():
            _check_entry(f"{self.label}: tracker entry {key!r}", entry, key)
        self.tracks, self._restored = {}, dict(state)


def _names(names) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _entry(track: BucketTrack) -> dict:
    entry = {"mode": track.mode, "stable": track.stable}
    if track.names:
        entry["names"] = list(track.names)
    if track.pending is not None:
        entry["pending"] = track.pending.tensor()[:2].clone()  # a resync flag riding with them: below
    support = track.support if track.support is not None else track.candidate
    if support is not None:
        entry["digest"] = support.digest.cpu()
    carry = track.carry
    if carry.residual is not None:
        entry["residual"] = carry.residual
    if carry.exponents is not None and not (carry.resync is not None and flag_set(carry.resync)):
        entry["exponents"] = carry.exponents.cpu()
    return entry


def _check_entry(where: str, entry, key: str) -> None:
    """A checkpointed track, checked before it is kept (a bad one fails at load): types, shapes, and sizes against
    the layout (the residual one per kept entry, the exponents one per parameter)."""
    check_state(where, entry, {"mode": str, "stable": int},
                {"pending": torch.Tensor, "digest": torch.Tensor, "residual": torch.Tensor,
                 "exponents": torch.Tensor, "names": list})
    if entry["mode"] not in (TRACKING, PACKED, DENSE):
        raise ValueError(f"{where}: 'mode' must be one of {TRACKING!r}, {PACKED!r}, {DENSE!r}; got {entry['mode']!r}")
    if entry["stable"] < 0:
        raise ValueError(f"{where}: 'stable' must be at least 0, got {entry['stable']}")
    if entry["mode"] != TRACKING and "digest" not in entry:
        raise ValueError(f"{where}: a {entry['mode']} track needs the 'digest' of its support")
    for name, shape, dtype in (("digest", (2,), torch.int64), ("pending", (2,), torch.bool)):
        if name in entry and (tuple(entry[name].shape) != shape or entry[name].dtype != dtype):
            raise ValueError(f"{where}: {name!r} must be a {dtype} tensor of shape {shape}")
    if "exponents" in entry and (entry["exponents"].dim() != 1 or entry["exponents"].dtype != torch.int64):
        raise ValueError(f"{where}: 'exponents' must be a 1-D torch.int64 tensor")
    residual = entry.get("residual")
    if residual is not None:
        if residual.dim() != 1 or residual.dtype != torch.float32:
            raise ValueError(f"{where}: 'residual' must be a 1-D torch.float32 tensor, got {residual.dtype} of "
                             f"shape {tuple(residual.shape)}")
        if not bool(torch.isfinite(residual).all()):
            raise ValueError(f"{where}: 'residual' holds non-finite values")
    names = entry.get("names")
    if names is not None:
        if not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where}: 'names' must list the layout's parameter names (str)")
        if key.count(":") == 3 and key.rsplit(":", 1)[1] != f"{zlib.crc32(chr(0).join(names).encode()):08x}":
            raise ValueError(f"{where}: its 'names' are not those of layout {key!r} (a hand-edited checkpoint?)")
        where = f"{where} (parameters {_names(names)})"
    if residual is not None:
        if "digest" not in entry:
            raise ValueError(f"{where}: a 'residual' needs the 'digest' of the support it was kept on")
        if residual.numel() != int(entry["digest"][1]):
            raise ValueError(f"{where}: 'residual' holds {residual.numel()} entries, its support keeps "
                             f"{int(entry['digest'][1])}: it belongs to another support (another model or masks?)")
    if "exponents" in entry and names is not None and entry["exponents"].numel() != len(names):
        raise ValueError(f"{where}: 'exponents' holds {entry['exponents'].numel()} entries, one per parameter of "
                         f"the layout, which has {len(names)}")


# --- the flags a step receives, read on the host at the next step -----------------------------------------------

class HostFlags:
    """``flags`` on their way to the host: on a GPU an asynchronous copy into pinned memory behind an event, so the
    step that receives them never waits; elsewhere the tensor itself. ``values`` reads them once (``tolist``)."""

    __slots__ = ("event", "_values", "host")

    def __init__(self, flags: torch.Tensor):
        self.event, self._values, self.host = None, None, flags
        if flags.device.type == "cuda":
            self.host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self.host.copy_(flags, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def tensor(self) -> torch.Tensor:
        if self.event is not None:
            self.event.synchronize()
        return self.host

    def values(self) -> list:
        if self._values is None:
            self._values = self.tensor().tolist()
        return self._values


@dataclass(frozen=True)
class Slot:
    """Entry ``index`` of a ``HostFlags`` (the ternary resync flag, riding with the tracker's flags)."""

    flags: HostFlags
    index: int


def flag_set(flag: HostFlags | Slot | torch.Tensor) -> bool:
    if isinstance(flag, Slot):
        return bool(flag.flags.values()[flag.index])
    if isinstance(flag, HostFlags):
        return any(bool(v) for v in flag.values())
    return bool(flag.any())  # a flag not sent yet (a codec driven by hand): a host synchronisation


def tracking_flags(track: BucketTrack, changed_here: bool | torch.Tensor, device) -> torch.Tensor:
    """The int64 flags a tracking step sends by MAX: [changed, hash, count, -hash, -count]."""
    out = torch.zeros(FLAGS, dtype=torch.int64, device=device)
    out[0] = changed_here
    if track.candidate is not None:
        digest = track.candidate.digest.to(device)
        out[1:3] = digest
        out[3:5] = -digest
    return out


def receive_flags(track: BucketTrack, flags: torch.Tensor) -> None:
    """Keep what a tracking step received (the MAX over ranks), to be read at the next step. A rank that offered
    no candidate (count 0) beside one that did changed its masks since install: a change, not a mismatch."""
    agree = (flags[1:3] == -flags[3:5]).all()
    offered_by_some = (flags[2] > 0) & (flags[4] == 0)
    track.pending = HostFlags(torch.stack([(flags[0] > 0) | offered_by_some, agree]))


def receive_changed(track: BucketTrack, changed: torch.Tensor) -> None:
    """Keep a packed step's count of ranks whose masks changed; a resync flag the ternary codec left in the carry
    goes to the host in the same copy (then a ``Slot`` of it)."""
    some = changed.reshape(()) > 0
    flags = [some, torch.ones_like(some)]
    resync = track.carry.resync if isinstance(track.carry.resync, torch.Tensor) else None
    if resync is not None:
        flags.append(resync.reshape(()) > 0)
    track.pending = HostFlags(torch.stack(flags))
    if resync is not None:
        track.carry.resync = Slot(track.pending, 2)
