"""The mask tracker's checkpoint, one entry per bucket layout: written (``track_entry``), checked at load
(``check_track``), and taken up when the layout comes back (``carry_of``; ``MaskTracker._restore`` rebuilds the
support from the masks and compares digests).

An entry is a dict: ``mode`` (str), ``stable`` (int), and where they apply ``pending`` (the flags received
last: bool (2,)), ``digest`` (int64 (2,), of the frozen or candidate support), ``residual`` (the method's carried
residual, ``Carry.residual``) and ``exponents`` (int64, the carried ternary scale's grid exponents,
``Carry.exponents``; left out while a resync is pending: the next step takes the exact scale then).
"""
from __future__ import annotations

import torch

from gcomp.core import check_state
from gcomp.packing.host_flags import flag_set, read_host_flag
from gcomp.packing.state import DENSE, PACKED, TRACKING, BucketTrack, Carry


def track_entry(track: BucketTrack) -> dict:
    """The checkpoint entry of one track (the module docstring)."""
    entry = {"mode": track.mode, "stable": track.stable}
    if track.pending is not None:
        entry["pending"] = read_host_flag(track.pending)[:2].clone()  # a resync flag riding with them: below
    support = track.support if track.support is not None else track.candidate
    if support is not None:
        entry["digest"] = support.digest.cpu()
    carry = track.state.carry
    if carry.residual is not None:
        entry["residual"] = carry.residual
    resync = carry.resync is not None and flag_set(carry.resync)
    if carry.exponents is not None and not resync:
        entry["exponents"] = carry.exponents.cpu()
    return entry


def carry_of(saved: dict, device) -> Carry:
    """What a checkpointed track carried, on ``device`` (the scale follows from the exponents when needed)."""
    carry = Carry()
    if "residual" in saved:
        carry.residual = saved["residual"].to(device)
    if "exponents" in saved:
        carry.exponents = saved["exponents"].to(device)
    return carry


def check_track(where: str, entry) -> None:
    """A checkpointed track, checked before it is kept: a bad one must fail at load, not at a later step."""
    check_state(where, entry, {"mode": str, "stable": int},
                {"pending": torch.Tensor, "digest": torch.Tensor, "residual": torch.Tensor,
                 "exponents": torch.Tensor})
    if entry["mode"] not in (TRACKING, PACKED, DENSE):
        raise ValueError(f"{where}: 'mode' must be one of {TRACKING!r}, {PACKED!r}, {DENSE!r}; got {entry['mode']!r}")
    if entry["stable"] < 0:
        raise ValueError(f"{where}: 'stable' must be at least 0, got {entry['stable']}")
    if entry["mode"] != TRACKING and "digest" not in entry:
        raise ValueError(f"{where}: a {entry['mode']} track needs the 'digest' of its support")
    for key, shape, dtype in (("digest", (2,), torch.int64), ("pending", (2,), torch.bool)):
        if key in entry and (tuple(entry[key].shape) != shape or entry[key].dtype != dtype):
            raise ValueError(f"{where}: {key!r} must be a {dtype} tensor of shape {shape}")
    if "exponents" in entry and (entry["exponents"].dim() != 1 or entry["exponents"].dtype != torch.int64):
        raise ValueError(f"{where}: 'exponents' must be a 1-D torch.int64 tensor")
    if "residual" in entry and not bool(torch.isfinite(entry["residual"]).all()):
        raise ValueError(f"{where}: 'residual' holds non-finite values")
