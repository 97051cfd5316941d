"""Flags a step receives, on their way to the host, to be read at the next step: the per-step path never waits
on a collective's result (on a GPU an asynchronous copy into pinned memory, behind an event).

What a tracking step sends (``tracking_flags``), and what a step keeps of what it received (``receive_flags``,
``receive_changed``), for ``gcomp.packing.tracker.MaskTracker``. One copy per bucket and step: a packed step's
flags (the tracker's, and the ternary codec's resync flag riding with them, ``Slot``) are read on the host once,
at the next step, and that read is kept (``HostFlags.values``): the one host synchronisation
``PacTrainCompressor.host_syncs`` declares.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from gcomp.packing.state import BucketTrack

FLAGS = 5  # a tracking step's: changed, digest hash, digest count, -hash, -count: MAX of both signs gives max and min


class HostFlags:
    """``flags`` on their way to the host: on a GPU an asynchronous copy into pinned memory with an event to wait
    on, so that the step that receives them never waits on it; elsewhere the tensor itself. One per bucket and step,
    replacing the last: slotted, it holds nothing beyond its copy, its event and its values once read."""

    __slots__ = ("event", "_values", "host")

    def __init__(self, flags: torch.Tensor):
        self.event = None
        self._values: list | None = None
        if flags.device.type != "cuda":
            self.host = flags
            return
        self.host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
        self.host.copy_(flags, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()

    def tensor(self) -> torch.Tensor:
        """The host copy, once its copy is done (waits for that one copy, not for the current stream)."""
        if self.event is not None:
            self.event.synchronize()
        return self.host

    def values(self) -> list:
        """The flags as Python values, read once (``tolist``) and kept: a second reader costs nothing."""
        if self._values is None:
            self._values = self.tensor().tolist()
        return self._values


@dataclass(frozen=True)
class Slot:
    """Entry ``index`` of a ``HostFlags`` another reader copied to the host (the ternary resync flag, riding with
    the tracker's flags)."""

    flags: HostFlags
    index: int


def host_flag(flags: torch.Tensor) -> HostFlags:
    """``flags`` on their way to the host (``read_host_flag`` reads them)."""
    return HostFlags(flags)


def read_host_flag(pending: HostFlags) -> torch.Tensor:
    """The host copy of what ``host_flag`` sent, once its copy is done."""
    return pending.tensor()


def flag_set(flag: HostFlags | Slot | torch.Tensor) -> bool:
    """Whether a flag is set: any of a ``HostFlags``, a ``Slot``'s entry, or a tensor not yet sent (a standalone
    codec's resync flag: read here, a host synchronisation on a device)."""
    if isinstance(flag, Slot):
        return bool(flag.flags.values()[flag.index])
    if isinstance(flag, HostFlags):
        return any(bool(v) for v in flag.values())
    return bool(flag.any())


def tracking_flags(track: BucketTrack, changed_here: bool | torch.Tensor, device) -> torch.Tensor:
    """The int64 flags a tracking step sends with MAX: [changed, hash, count, -hash, -count]."""
    out = torch.zeros(FLAGS, dtype=torch.int64, device=device)
    out[0] = changed_here
    if track.candidate is not None:
        digest = track.candidate.digest.to(device)
        out[1:3] = digest
        out[3:5] = -digest
    return out


def receive_flags(track: BucketTrack, flags: torch.Tensor) -> None:
    """Keep what a tracking step received (MAX over ranks), to be read at the next step."""
    agree = (flags[1:3] == -flags[3:5]).all()
    # a rank that offered no candidate (count 0) beside one that did: its masks changed since install,
    # so this counts as a change (tracking restarts), not as ranks holding different masks
    offered_by_some = (flags[2] > 0) & (flags[4] == 0)
    track.pending = HostFlags(torch.stack([(flags[0] > 0) | offered_by_some, agree]))


def receive_changed(track: BucketTrack, changed: torch.Tensor) -> None:
    """Keep a packed step's count of ranks whose masks changed (digests agreed when it froze). A resync flag the
    ternary codec left in the carry, not yet sent to the host (a tensor), goes in the same copy (a ``Slot``)."""
    carry = track.state.carry
    some = changed.reshape(()) > 0
    flags = [some, torch.ones_like(some)]
    resync = carry.resync if isinstance(carry.resync, torch.Tensor) else None
    if resync is not None:
        flags.append(resync.reshape(()) > 0)
    track.pending = HostFlags(torch.stack(flags))
    if resync is not None:
        carry.resync = Slot(track.pending, 2)
