"""Random streams of the methods: every draw made on the tensor's device, from a generator the method owns, seeded
alike on every rank that must draw alike.

A stream's i-th draw comes from a generator seeded with ``stream_seed(seed, tag, rank, "draw <i>")``: a 63-bit hash
of the user's seed, the method's tag, the rank (None: a stream every rank shares, such as randomk's positions) and
the draw's number. A plain formula such as ``seed * C + rank`` would make seed 0 on rank r replay
``torch.Generator().manual_seed(r)``, which a user's own code may draw from too. The seed and the number of draws
made are the whole state, the same on any device: a checkpoint keeps those two numbers, and a resume on any device
of the same kind draws the same, bit for bit.
"""
from __future__ import annotations

import hashlib

import torch

from gcomp.state_checks import check_state, generator_state

_SEED_BITS = 63  # torch seeds are 64-bit; staying below the sign bit keeps every API happy


def stream_seed(seed: int, tag: str, rank: int | None = None, key: str = "") -> int:
    """The seed of one random stream: a hash of ``seed``, the method ``tag``, the ``rank`` (None: shared by every
    rank) and an optional ``key`` (a parameter's name, a draw's number)."""
    text = f"gcomp|{tag}|{int(seed)}|{'shared' if rank is None else int(rank)}|{key}"
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << _SEED_BITS) - 1)


class Stream:
    """One random stream: ``next(device)`` is a generator on ``device`` seeded for the next draw (on the host: no
    kernel, no synchronisation). ``rank`` None draws alike on every rank; ``bind(rank)`` gives a per-rank stream
    its rank. ``draws`` counts the draws made; ``state_dict`` is ``{"seed", "draws"}``."""

    def __init__(self, seed: int, tag: str, rank: int | None = None):
        self.seed, self.tag, self.rank = seed, tag, rank
        self.draws = 0
        self._generators: dict[str, torch.Generator] = {}

    def bind(self, rank: int) -> None:
        self.rank = rank

    def next(self, device: torch.device | str) -> torch.Generator:
        key = str(torch.device(device))
        generator = self._generators.get(key)
        if generator is None:
            generator = self._generators[key] = torch.Generator(device)
        generator.manual_seed(stream_seed(self.seed, self.tag, self.rank, f"draw {self.draws}"))
        self.draws += 1
        return generator

    def state_dict(self) -> dict:
        return {"seed": self.seed, "draws": self.draws}

    def load_state_dict(self, state) -> None:
        """``state_dict()``'s form; a per-device generator state of gcomp 0.1 (a tensor, or a dict of them by
        device), or ``{}`` (a resized run), starts the stream afresh."""
        if isinstance(state, torch.Tensor) or isinstance(state, dict) and "seed" not in state:
            for device, value in ({"cpu": state} if isinstance(state, torch.Tensor) else state).items():
                generator_state(self.tag, device, value)  # a bad one is named at load, not ignored
            self.draws = 0
            return
        check_state(f"{self.tag} random stream", state, {"seed": int, "draws": int})
        if state["seed"] < 0 or state["draws"] < 0:
            raise ValueError(f"{self.tag} random stream: 'seed' and 'draws' must be at least 0, got {state}")
        self.seed, self.draws = state["seed"], state["draws"]
