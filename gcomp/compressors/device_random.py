"""Random draws of a codec's device path (``gcomp.kernels``), made on the tensor's device, never on the host and
copied: a ``torch.Generator`` there, seeded afresh before each draw from the method's seed and the draw's number.

The seed and the draws a stream has made are then the whole of its state, the same whatever the device (a CUDA
generator's state and a CPU one's are not interchangeable, and a rank's device index is its own): a checkpoint
keeps those two numbers, and a resume on any device of the same kind draws the same, bit for bit.
"""
from __future__ import annotations

import torch

from gcomp.compressors.quantise import stream_seed
from gcomp.state_checks import check_state


class DeviceStream:
    """The device draws of one stream: ``stream_seed(seed, tag, rank, "draw <i>")`` seeds the i-th draw (``rank``
    None: a stream every rank shares, as randomk's positions). ``draws`` counts the draws made."""

    def __init__(self, seed: int, tag: str, rank: int | None = None):
        self.seed, self.tag, self.rank = seed, tag, rank
        self.draws = 0
        self._generators: dict[str, torch.Generator] = {}

    def next(self, device: torch.device | str) -> torch.Generator:
        """The generator for the next draw, on ``device``, seeded for it (on the host: no kernel, no sync)."""
        key = str(torch.device(device))
        generator = self._generators.get(key)
        if generator is None:
            generator = self._generators[key] = torch.Generator(device)
        generator.manual_seed(stream_seed(self.seed, self.tag, self.rank, f"draw {self.draws}"))
        self.draws += 1
        return generator

    def state_dict(self) -> dict:
        return {"seed": self.seed, "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        check_state(f"{self.tag} device stream", state, {"seed": int, "draws": int})
        if state["seed"] < 0 or state["draws"] < 0:
            raise ValueError(f"{self.tag} device stream: 'seed' and 'draws' must be at least 0, got {state}")
        self.seed, self.draws = state["seed"], state["draws"]


def uniform_subsets(rows: int, width: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``(rows, k)`` int64: for each row, ``k`` distinct positions of ``range(width)``, ascending, every k-subset
    equally likely; bucket-wide, on ``generator``'s device. They are the positions of the k largest of ``width``
    uniform random 63-bit keys (ties, which would favour some positions, have a probability of about
    ``width**2 / 2**64``), found by one torch.topk and ordered by one sort."""
    keys = torch.empty(rows, width, dtype=torch.int64, device=generator.device).random_(generator=generator)
    return torch.topk(keys, k, dim=1, sorted=False).indices.sort(dim=1).values
