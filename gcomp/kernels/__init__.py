"""Which path a codec takes: its device path on an accelerator (bucket-wide kernels, a bounded number of them
whatever the bucket's size and number of parameters, no host synchronisation a method does not declare), or its
CPU path (blocking where one thread measured faster).

``on_device(tensor)`` is the one test every codec makes. ``forced("cuda")`` makes it true for every tensor, so
that the device path runs, and is tested, on a machine without one (the suite counts its operations and its
synchronisations: ``gcomp.testing.ops``); the environment variable ``GCOMP_FORCE_DEVICE_PATH=cuda`` does the same
for a whole process (worker processes of a test, a script).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

KINDS = ("cuda",)
ENV = "GCOMP_FORCE_DEVICE_PATH"
_forced: list[str] = []


def _from_env() -> str | None:
    kind = os.environ.get(ENV, "").strip()
    if kind and kind not in KINDS:
        raise ValueError(f"{ENV}={kind!r}: the device paths are {', '.join(KINDS)} (or unset it)")
    return kind or None


def forced_kind() -> str | None:
    """The device path forced on every tensor, if any (``forced``, else ``GCOMP_FORCE_DEVICE_PATH``)."""
    return _forced[-1] if _forced else _from_env()


def on_device(tensor: torch.Tensor) -> bool:
    """Whether a codec takes its device path for ``tensor``: on CUDA, or anywhere while ``forced``."""
    return tensor.device.type == "cuda" or forced_kind() is not None


@contextmanager
def forced(kind: str = "cuda") -> Iterator[None]:
    """Every codec takes its ``kind`` device path inside the block, whatever device its tensors are on."""
    if kind not in KINDS:
        raise ValueError(f"gcomp.kernels.forced: the device paths are {', '.join(KINDS)}; got {kind!r}")
    _forced.append(kind)
    try:
        yield
    finally:
        _forced.pop()
