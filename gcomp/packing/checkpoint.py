"""The mask tracker's checkpoint, one entry per bucket layout: written (``track_entry``), checked at load
(``check_track``), and taken up when the layout comes back (``carry_of``; ``MaskTracker._restore`` rebuilds the
support from the masks and compares digests).

An entry is a dict: ``mode`` (str), ``stable`` (int), and where they apply ``pending`` (the flags received
last: bool (2,)), ``digest`` (int64 (2,), of the frozen or candidate support: a hash and the count of its kept
entries), ``residual`` (the method's carried residual, ``Carry.residual``: fp32, one per kept entry),
``exponents`` (int64, the carried ternary scale's grid exponents, ``Carry.exponents``, one per parameter; left out
while a resync is pending: the next step takes the exact scale then) and ``names`` (the layout's parameters, in
its order; absent from checkpoints saved before it was added).

``check_track`` holds every size to what the entry says of its layout (the residual to the support's count, the
exponents to the parameters), so a bad entry fails at load; ``MaskTracker._restore`` then compares the support
with the one the live masks give, and ``check_restored`` the exponents with the live layout.
"""
from __future__ import annotations

import torch

import zlib

from gcomp.core import check_state
from gcomp.packing.host_flags import flag_set, read_host_flag
from gcomp.packing.state import DENSE, PACKED, TRACKING, BucketTrack, Carry


def track_entry(track: BucketTrack) -> dict:
    """The checkpoint entry of one track (the module docstring)."""
    entry = {"mode": track.mode, "stable": track.stable}
    if track.names:
        entry["names"] = list(track.names)
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


def check_track(where: str, entry, key: str | None = None) -> None:
    """A checkpointed track (of layout ``key``), checked before it is kept: a bad one must fail at load, not at a
    later step."""
    check_state(where, entry, {"mode": str, "stable": int},
                {"pending": torch.Tensor, "digest": torch.Tensor, "residual": torch.Tensor,
                 "exponents": torch.Tensor, "names": list})
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
    if "residual" in entry and (entry["residual"].dim() != 1 or entry["residual"].dtype != torch.float32):
        raise ValueError(f"{where}: 'residual' must be a 1-D torch.float32 tensor, got {entry['residual'].dtype} "
                         f"of shape {tuple(entry['residual'].shape)}")
    if "residual" in entry and not bool(torch.isfinite(entry["residual"]).all()):
        raise ValueError(f"{where}: 'residual' holds non-finite values")
    _check_sizes(where, entry, key)


def _check_sizes(where: str, entry: dict, key: str | None) -> None:
    """The residual holds one entry per kept entry of the support (the digest's count), the exponents one per
    parameter of the layout (``names``, which must be the layout ``key``'s)."""
    names = entry.get("names")
    if names is not None:
        if not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where}: 'names' must list the layout's parameter names (str)")
        if key is not None and key.count(":") == 3 and key.rsplit(":", 1)[1] != f"{_names_crc(names):08x}":
            raise ValueError(f"{where}: its 'names' are not those of layout {key!r} (a hand-edited checkpoint?)")
        where = f"{where} (parameters {', '.join(names[:4])}{', ...' if len(names) > 4 else ''})"
    if "residual" in entry:
        if "digest" not in entry:
            raise ValueError(f"{where}: a 'residual' needs the 'digest' of the support it was kept on")
        kept = int(entry["digest"][1])
        if entry["residual"].numel() != kept:
            raise ValueError(f"{where}: 'residual' holds {entry['residual'].numel()} entries, its support keeps "
                             f"{kept}: it belongs to another support (another model or masks?)")
    if "exponents" in entry and names is not None and entry["exponents"].numel() != len(names):
        raise ValueError(f"{where}: 'exponents' holds {entry['exponents'].numel()} entries, one per parameter of "
                         f"the layout, which has {len(names)}")


def check_restored(where: str, saved: dict, names: tuple[str, ...]) -> None:
    """A checkpointed track taken up by the live layout (its parameters ``names``): the exponents one per
    parameter (what ``check_track`` could not check at load for an entry without ``names``)."""
    if "exponents" in saved and saved["exponents"].numel() != len(names):
        raise ValueError(f"{where}: 'exponents' holds {saved['exponents'].numel()} entries, one per parameter of "
                         f"the layout, which has {len(names)} ({', '.join(names[:4])}"
                         f"{', ...' if len(names) > 4 else ''}): the checkpoint is of another model")


def _names_crc(names) -> int:
    return zlib.crc32("\0".join(names).encode())  # as ``BucketInfo.from_layout`` keys a layout
