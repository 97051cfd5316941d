"""``randomk``: k entries chosen at random, the same on every rank, so their values add up by all-reduce."""
from __future__ import annotations

from typing import Annotated

import torch

from gcomp.bucket_state import Scratch
from gcomp.collectives import AllreduceCommunicator
from gcomp.compressors.quantise import stream_seed
from gcomp.core import ALLREDUCE, Compressor, Method, Payload, check_state
from gcomp.memory import ResidualMemory
from gcomp.params import Range
from gcomp.registry import register


class RandomKCompressor(Compressor):
    """Sends the values of ``k = max(1, int(ratio * n))`` distinct entries, in the bucket's dtype, plus one
    non-finite flag entry, by SUM all-reduce: k + 1 elements, no indices.

    The positions come from a generator seeded alike on every rank and advanced by every compressed bucket,
    so all ranks pick the same k entries each step and the payloads add up element-wise. The flag is 0, or
    NaN when the rank's bucket holds a NaN or an infinity; it is added to every sent entry on decode, so a
    non-finite gradient on any rank surfaces on every rank even when its entry was not drawn.

    Per step beyond the draw: one pass for the flag (min and max), and with error feedback one copy of the
    compensated bucket into the residual (``residual_into``: the drawn entries subtracted, nothing decoded);
    decoding clears and fills one of two buffers kept per bucket layout instead of a fresh zeroed bucket.
    """

    collective = ALLREDUCE

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio = ratio
        self.generator = torch.Generator().manual_seed(stream_seed(seed, "randomk"))  # the same on every rank
        self._decoded = Scratch(slots=2)  # decoded buckets: DDP holds the last one while the next is decoded

    def compress(self, tensor, bucket):
        n = tensor.numel()
        k = max(1, int(n * self.ratio))
        index = uniform_subset(n, k, self.generator).to(tensor.device, non_blocking=True)
        wire = tensor.new_empty(k + 1)
        torch.index_select(tensor, 0, index, out=wire[:k])
        # min and max in one pass are finite exactly when every entry is (NaN propagates to both); far
        # cheaper than isfinite(tensor).all(), which builds a bucket-sized mask
        extremes = torch.stack(torch.aminmax(tensor))
        wire[k] = torch.where(torch.isfinite(extremes).all(), 0.0, float("nan"))
        return Payload([wire], ctx=(n, index, bucket))

    def decompress(self, tensors, ctx):
        wire, = tensors
        n, index, bucket = ctx
        out = self._decoded.take(bucket, n, wire.dtype, wire.device) if bucket is not None else wire.new_empty(n)
        return out.zero_().index_copy_(0, index, self._sent(wire, index))

    @staticmethod
    def _sent(wire: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The values at ``index``: each plus the flag, 0, or NaN if any rank's bucket was not finite."""
        k = index.numel()
        return wire[:k] + wire[k]

    def residual_into(self, out, tensor, payload):
        """The compensated bucket less the (distinct) drawn entries, without decoding a bucket."""
        wire, = payload.tensors
        index = payload.ctx[1]
        flat = tensor.reshape(-1)
        torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0, out=out.view(-1))
        left = torch.nan_to_num_(flat[index] - self._sent(wire, index), nan=0.0, posinf=0.0, neginf=0.0)
        out.view(-1).index_copy_(0, index, left)
        return True

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    replicated_state = True  # one stream, the same on every rank

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"generator": torch.Tensor})
        self.generator.set_state(state["generator"])

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return every[0]


def uniform_subset(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct positions of ``range(n)``, every k-subset (and every order of it) equally likely, drawn
    from ``generator``: the first ``k`` distinct values of a stream of uniform draws with replacement.
    For a small ``k`` this sorts about ``k`` draws instead of permuting all ``n`` positions."""
    if 4 * k > n:
        return torch.randperm(n, generator=generator)[:k]
    draws = torch.empty(0, dtype=torch.int64)
    while True:  # rounds, not elements: one round almost always (about k^2 / 2n repeats against k / 8 spare)
        draws = torch.cat([draws, torch.randint(n, (k + k // 8 + 16,), generator=generator)])
        values, inverse = torch.unique(draws, return_inverse=True)
        if values.numel() >= k:
            break
    first = torch.full((values.numel(),), draws.numel(), dtype=torch.int64)
    first.scatter_reduce_(0, inverse, torch.arange(draws.numel()), "amin")
    return values[first.argsort()[:k]]


@register("randomk", paper="Stich, Cordonnier, Jaggi 2018 (Sparsified SGD with memory: random-k)")
def randomk(ratio: Annotated[float, Range(0, 1, low_open=True), "fraction of the bucket's entries sent"] = 0.01,
            seed: Annotated[int, Range(0, None), "seed of the positions, the same on every rank"] = 0) -> Method:
    """Random-k sparsification with error feedback: shared random positions, values alone by all-reduce."""
    return Method(RandomKCompressor(ratio, seed), ResidualMemory(), AllreduceCommunicator())
