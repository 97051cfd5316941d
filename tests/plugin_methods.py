"""Two small methods written outside gcomp, as another package would write its own, for
tests/test_testing_kit.py (which registers them by entry point and checks them with
``gcomp.testing.check_method``). Only gcomp's public types are used.

- ``reversed_method``: the bucket goes on the wire reversed and is reversed back; lossless, by all-reduce.
- ``dropping_method``: the same, but decoding drops the last entry (sets it to zero) while still claiming to be
  lossless: it must fail the lossless contract.
"""
from __future__ import annotations

from gcomp import Compressor, Method, NoMemory, Payload
from gcomp.collectives import AllreduceCommunicator


class ReversedCompressor(Compressor):
    """Sends the bucket reversed, by SUM all-reduce (a reversal commutes with the sum: exact)."""

    def encode(self, x, state, layout):
        return Payload([x.flip(0)]), state

    def decode(self, received, ctx):
        return received[0].flip(0)


class DroppingCompressor(ReversedCompressor):
    """``ReversedCompressor`` whose decode loses the last entry: a bug the contracts must catch."""

    def decode(self, received, ctx):
        out = received[0].flip(0)  # a copy: the received tensor is left alone
        out[-1] = 0
        return out


def reversed_method() -> Method:
    """The bucket sent reversed and reversed back: lossless."""
    return Method(ReversedCompressor(), NoMemory(), AllreduceCommunicator())


def dropping_method() -> Method:
    """The bucket sent reversed, its last entry dropped on decoding: claims lossless, is not."""
    return Method(DroppingCompressor(), NoMemory(), AllreduceCommunicator())
