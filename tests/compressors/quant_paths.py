"""The two paths of the quantisers' tests (``qsgd``, ``terngrad``, ``natural``): a property the CPU path has is
checked on the device path too (``gcomp.kernels.forced``), and a test that pins a CPU path's exact draws says so.

Under ``GCOMP_FORCE_DEVICE_PATH=cuda`` every codec takes its device path whatever a test asks: ``"cpu"`` then runs
the device path as well, and ``cpu_draws`` skips.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Iterator

import pytest

from gcomp import kernels

PATHS = pytest.mark.parametrize("path", ["cpu", "device"])

cpu_draws = pytest.mark.skipif(kernels.forced_kind() is not None,
                               reason="pins the CPU path's exact draws; GCOMP_FORCE_DEVICE_PATH puts every codec on "
                                      "its device path, which draws otherwise (its own test pins those)")


@contextmanager
def on_path(path: str) -> Iterator[None]:
    """The block on ``path``: ``"device"`` forces every codec's device path, ``"cpu"`` leaves it as it is."""
    with kernels.forced("cuda") if path == "device" else nullcontext():
        yield
