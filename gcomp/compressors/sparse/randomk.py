"""``randomk``: k entries drawn at random, the same on every rank, so their values add up by all-reduce."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gcomp.core import ALLREDUCE, Compressor, Keeps, Payload, Traits, contraction
from gcomp.randomness import Stream
from gcomp.state_checks import check_state


def uniform_subset(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct positions of ``range(n)``, ascending (int64), every k-subset equally likely, on ``generator``'s
    device: those of the k largest of n uniform 63-bit keys (a tie, which would favour some positions, has a
    probability of about ``n**2 / 2**64``)."""
    keys = torch.empty(n, dtype=torch.int64, device=generator.device).random_(generator=generator)
    return torch.topk(keys, k, sorted=False).indices.sort().values


@dataclass
class Drawn:
    """A payload's bucket of ``n`` entries and its drawn positions (``index``)."""

    n: int
    index: torch.Tensor


class RandomKCompressor(Compressor):
    """Sends the values of ``k = max(1, int(ratio * n))`` distinct entries, in the bucket's dtype, plus one non-finite
    flag entry, by SUM all-reduce: k + 1 entries, no positions. The positions come from ``stream``, seeded alike on
    every rank and advanced by every bucket, so every rank draws the same k and the payloads add up entry for entry.
    The flag is 0, or NaN when the rank's bucket holds a NaN or an infinity (found by min and max); it is added to every
    sent entry on decode, so a non-finite gradient on any rank surfaces on every rank even where it was not drawn.
    Under FSDP2 each destination row draws its own k of its S entries: a ``(world, k + 1)`` matrix by one SUM
    reduce-scatter, world * (k + 1) entries per rank and call."""

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio, self.seed = ratio, seed
        self.stream = Stream(seed, "randomk")
        self.traits = Traits(ALLREDUCE, contraction(0), Keeps.SHARED,
                             wire_bytes=lambda bucket, world: (self.count(bucket.numel) + 1) * bucket.dtype.itemsize)

    def count(self, n: int) -> int:
        return max(1, int(n * self.ratio))

    def encode(self, x, state, layout):
        flat = x.reshape(-1)
        k = self.count(flat.numel())
        index = uniform_subset(flat.numel(), k, self.stream.next(flat.device))
        wire = flat.new_empty(k + 1)
        torch.index_select(flat, 0, index, out=wire[:k])
        wire[k] = torch.where(torch.isfinite(torch.stack(torch.aminmax(flat))).all(), 0.0, float("nan"))
        # the drawn entries are sent whole; a non-finite bucket's residual is dropped by the memory
        return Payload([wire], Drawn(flat.numel(), index), residual=flat.index_fill(0, index, 0)), state

    def decode(self, received, ctx: Drawn) -> torch.Tensor:
        wire = received[0].reshape(-1)
        return wire.new_zeros(ctx.n).index_copy_(0, ctx.index, wire[:-1] + wire[-1])

    def state_dict(self) -> dict:
        return {"generator": self.stream.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Also gcomp 0.1's: ``generator`` a CPU generator's state and ``device_stream`` the stream's (if drawn)."""
        check_state(self, state, {"generator": (torch.Tensor, dict)}, {"device_stream": dict})
        self.stream.load_state_dict(state.get("device_stream", state["generator"]))
