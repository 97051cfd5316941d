"""``randomk``: k entries chosen at random, the same on every rank, so their values add up by all-reduce."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch

from gcomp.bucket import BucketInfo
from gcomp.bucket_state import Scratch
from gcomp.collectives import AllreduceCommunicator
from gcomp.compressors.device_random import DeviceStream, uniform_subsets
from gcomp.compressors.quantise import stream_seed
from gcomp.core import ALLREDUCE, Compressor, Payload
from gcomp.kernels import on_device
from gcomp.memory import ResidualMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register
from gcomp.sharding import RowStrategy
from gcomp.state_checks import check_state, generator_state


@dataclass
class Drawn:
    """What a randomk payload carries, kept local: the ``n`` entries compressed, the drawn ``index`` (ascending,
    distinct, int64 on the bucket's device), the ``bucket``, whether the bucket is known finite on the host
    (``finite``: a CPU bucket), and ``rows``: 0 for one flat payload ``[k values, flag]``, else the number of
    FSDP2 rows ``(rows, k + 1)``, each its k values then the flag (``index`` then holds every row's positions
    into the flat input, row after row)."""

    n: int
    index: torch.Tensor
    bucket: BucketInfo | None
    finite: bool
    rows: int = 0


class RandomKCompressor(Compressor):
    """Sends the values of ``k = max(1, int(ratio * n))`` distinct entries, in the bucket's dtype, plus one
    non-finite flag entry, by SUM all-reduce: k + 1 elements, no indices.

    The positions (ascending, ``uniform_subset``) come from a generator seeded alike on every rank and advanced
    by every compressed bucket, so all ranks pick the same k entries each step and the payloads add up
    element-wise. The flag is 0, or NaN when the rank's bucket holds a NaN or an infinity; it is added to every
    sent entry on decode, so a non-finite gradient on any rank surfaces on every rank even when its entry was
    not drawn.

    Per step beyond the draw: one pass for the flag (``all_finite``: a sum; min and max on a GPU). With error
    feedback on a CPU and a finite bucket, ``sent_positions``: the memory keeps the compensated bucket as the
    residual, the drawn entries read as 0, with no pass; otherwise (a GPU, where the flag stays on the device,
    or a non-finite bucket) one copy of the compensated bucket into the residual (``residual_into``: the drawn
    entries subtracted, non-finite entries dropped, nothing decoded). Decoding clears and fills one of two
    buffers kept per bucket layout instead of a fresh zeroed bucket.

    On the device path (``gcomp.kernels.on_device``) the positions are drawn on the bucket's device, bucket-wide
    (``device_random.uniform_subsets``: the k largest of random keys, sorted), from ``device_stream``, seeded
    alike on every rank from the same seed and advanced by every compressed bucket: other positions than the
    CPU's, as uniform, as much the same on every rank. The flag is found by min and max, on the device, and
    the memory takes ``residual_into``. A checkpoint holds the device stream (``device_stream``: its seed and the
    draws made) once it has drawn.
    """

    collective = ALLREDUCE

    def __init__(self, ratio: float, seed: int = 0):
        self.ratio, self.seed = ratio, seed
        self.generator = torch.Generator().manual_seed(stream_seed(seed, "randomk"))  # the same on every rank
        self.device_stream = DeviceStream(seed, "randomk")  # the device path's draws, alike on every rank
        self._decoded = Scratch(slots=2)  # decoded buckets: DDP holds the last one while the next is decoded

    def compress(self, tensor, bucket):
        n = tensor.numel()
        k = max(1, int(n * self.ratio))
        if on_device(tensor):
            index = uniform_subsets(1, n, k, self.device_stream.next(tensor.device)).view(-1)
        else:
            index = uniform_subset(n, k, self.generator).to(tensor.device, non_blocking=True)
        wire, finite = self._values(tensor.reshape(-1), index, 1)
        return Payload([wire.view(-1)], ctx=Drawn(n, index, bucket, finite))

    def compress_rows(self, tensor: torch.Tensor, bucket: BucketInfo, rows: int) -> Payload:
        """For FSDP2 (``RandomKRows``): ``tensor`` (flat) as ``rows`` rows of S entries, k = max(1, int(ratio * S))
        drawn per row (the generator advanced once per row), sent as a ``(rows, k + 1)`` matrix whose row r holds
        row r's values and the flag."""
        width = tensor.numel() // rows
        k = max(1, int(width * self.ratio))
        if on_device(tensor):  # every row at once, the stream advanced once
            index = uniform_subsets(rows, width, k, self.device_stream.next(tensor.device))
            index = index.add_(torch.arange(0, rows * width, width, device=tensor.device)[:, None]).view(-1)
        else:
            index = torch.stack([uniform_subset(width, k, self.generator) for _ in range(rows)])
            index = (index + torch.arange(rows)[:, None] * width).reshape(-1).to(tensor.device, non_blocking=True)
        wire, finite = self._values(tensor.reshape(-1), index, rows)
        return Payload([wire], ctx=Drawn(tensor.numel(), index, bucket, finite, rows))

    @staticmethod
    def _values(flat: torch.Tensor, index: torch.Tensor, rows: int) -> tuple[torch.Tensor, bool]:
        """``(rows, k + 1)``: the values at ``index``, row by row, then the flag (0, or NaN when ``flat`` holds a
        non-finite entry), and whether ``flat`` is known finite on the host."""
        k = index.numel() // rows
        wire = flat.new_empty(rows, k + 1)
        if rows == 1:  # straight into the wire
            torch.index_select(flat, 0, index, out=wire.view(-1)[:k])
        else:
            wire[:, :k] = flat.index_select(0, index).view(rows, k)
        if not on_device(flat):  # known on the host at no cost: the memory may skip its pass
            finite = all_finite(flat)
            wire[:, k] = 0.0 if finite else float("nan")
        else:  # no synchronisation: min and max (module ``all_finite``); the memory takes ``residual_into``
            wire[:, k] = torch.where(torch.isfinite(torch.stack(torch.aminmax(flat))).all(), 0.0, float("nan"))
            finite = False
        return wire, finite

    def decompress(self, tensors, ctx: Drawn):
        wire, = tensors
        bucket = ctx.bucket
        out = self._decoded.take(bucket, ctx.n, wire.dtype, wire.device) if bucket is not None else wire.new_empty(ctx.n)
        return out.zero_().index_copy_(0, ctx.index, self._sent(wire, ctx))

    def decode_row(self, row: torch.Tensor, ctx: Drawn, rank: int, out: torch.Tensor) -> torch.Tensor:
        """This rank's reduced row (``k + 1`` entries: the sums of its k values and of the flags) onto its k
        positions of ``out`` (the row's S entries), zero elsewhere (FSDP2)."""
        k = row.numel() - 1
        width = ctx.n // ctx.rows
        own = ctx.index[rank * k:(rank + 1) * k] - rank * width
        return out.zero_().index_copy_(0, own, row[:k] + row[k])

    @staticmethod
    def _sent(wire: torch.Tensor, ctx: Drawn) -> torch.Tensor:
        """The values at ``ctx.index``: each plus its row's flag, 0, or NaN if any rank's bucket was not finite."""
        rows = max(ctx.rows, 1)
        values = wire.view(rows, -1)
        return (values[:, :-1] + values[:, -1:]).reshape(-1)

    def sent_positions(self, payload):
        """The drawn positions when the bucket was finite (known on the host: on a CPU): there the decoded own
        payload is the entry plus a zero flag, the entry itself; elsewhere 0."""
        return payload.ctx.index if payload.ctx.finite else None

    def residual_into(self, out, tensor, payload):
        """The compensated bucket less the (distinct) drawn entries, without decoding a bucket."""
        wire, = payload.tensors
        index = payload.ctx.index
        flat = tensor.reshape(-1)
        torch.nan_to_num(flat, nan=0.0, posinf=0.0, neginf=0.0, out=out.view(-1))
        left = torch.nan_to_num_(flat[index] - self._sent(wire, payload.ctx), nan=0.0, posinf=0.0, neginf=0.0)
        out.view(-1).index_copy_(0, index, left)
        return True

    replicated = True  # one stream, the same on every rank

    def state_dict(self) -> dict:
        # the device stream only once it drew: the CPU path's checkpoint stays as it was
        device = {"device_stream": self.device_stream.state_dict()} if self.device_stream.draws else {}
        return {"generator": self.generator.get_state(), **device}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"generator": torch.Tensor}, {"device_stream": dict})
        generator_state("randomk", "cpu", state["generator"])  # checked before anything is loaded
        if "device_stream" in state:
            self.device_stream.load_state_dict(state["device_stream"])
        else:  # a checkpoint of the CPU path: the device path has not drawn yet
            self.device_stream = DeviceStream(self.seed, "randomk")
        self.generator.set_state(state["generator"])

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return every[0]


def all_finite(x: torch.Tensor) -> bool:
    """True when every entry of ``x`` is finite, in one cheap pass almost always: a finite sum means finite
    entries (a NaN or an infinity makes every partial sum after it non-finite); only a non-finite sum, a
    non-finite entry or an overflow of the sum, takes a second pass, by min and max (NaN propagates to
    both; far cheaper than ``isfinite(x).all()``, which builds a bucket-sized mask)."""
    wide = torch.float64 if x.dtype == torch.float64 else torch.float32  # fp16 and bf16 sums kept in fp32
    if bool(torch.isfinite(x.sum(dtype=wide))):
        return True
    return bool(torch.isfinite(torch.stack(torch.aminmax(x))).all())


def uniform_subset(n: int, k: int, generator: torch.Generator) -> torch.Tensor:
    """``k`` distinct positions of ``range(n)`` in ascending order, every k-subset equally likely, drawn from
    ``generator`` (the same state, the same positions: what keeps ranks in step).

    For ``4 k <= n`` the set is the first ``k`` distinct values of a stream of uniform draws with replacement
    (any k-subset is equally likely to be that set, by symmetry), found without ordering the stream: the
    first ``k`` draws are sorted (int32 below 2**31 positions) and deduplicated (about ``k^2 / 2n`` repeats),
    then further draws top the set up with their first new values in stream order, a few hundred entries to
    order, merged in by position. Returns int64.
    Denser: the first ``k`` entries of a permutation of ``range(n)``, sorted."""
    if 4 * k > n:
        return torch.randperm(n, generator=generator)[:k].sort().values
    dtype = torch.int32 if n <= torch.iinfo(torch.int32).max else torch.int64  # int32 sorts in half the time
    chosen = torch.unique_consecutive(torch.sort(torch.randint(n, (k,), generator=generator, dtype=dtype)).values)
    while chosen.numel() < k:  # rounds, not elements: one almost always
        need = k - chosen.numel()
        # about need * n / (n - chosen) draws are new; an eighth more so that one round almost always does
        more = torch.randint(n, (need * n // (n - chosen.numel()) * 9 // 8 + 16,), generator=generator,
                             dtype=dtype)
        at = torch.searchsorted(chosen, more).clamp_(max=chosen.numel() - 1)
        fresh = more[chosen[at] != more]  # not drawn before this round, in stream order
        values, inverse = torch.unique(fresh, return_inverse=True)
        first = torch.full((values.numel(),), fresh.numel(), dtype=torch.int64)
        first.scatter_reduce_(0, inverse, torch.arange(fresh.numel()), "amin")
        if values.numel() > need:  # the ``need`` whose first draw came first, back in ascending order
            values = values[first.argsort()[:need]].sort().values
        chosen = _merge(chosen, values)
    return chosen.long()


def _merge(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The ascending union of the ascending, disjoint ``a`` and ``b`` (``b`` short): no sort of ``a``."""
    out = torch.empty(a.numel() + b.numel(), dtype=a.dtype)
    at = torch.searchsorted(a, b).add_(torch.arange(b.numel()))  # where each of ``b`` lands
    rest = torch.ones(out.numel(), dtype=torch.bool).index_fill_(0, at, False)
    return out.index_copy_(0, at, b).masked_scatter_(rest, a)


class RandomKRows(RowStrategy):
    """Under FSDP2: for each destination shard of S entries, the values of k = max(1, int(ratio * S)) of its entries
    plus one flag entry (0, or NaN when this rank's input is not finite), in the reduce dtype: a (world, k + 1)
    matrix by one SUM reduce-scatter, world * (k + 1) entries per rank and call, no indices
    (``RandomKCompressor.compress_rows``: the positions of each shard from the method's own generator, seeded
    alike on every rank and advanced world times per call, so every rank sends the same positions of a shard).
    Error feedback: the method's ``ResidualMemory`` on the rank's full unsharded input, per (parameter, shard)
    piece, re-sharded by parameter on another number of shards (its positions' stream is every rank's alike)."""

    reshards = True

    def compress(self, compressor: RandomKCompressor, tensor, layout):
        return compressor.compress_rows(tensor, layout.pieces, layout.world)

    def decode(self, compressor: RandomKCompressor, received, payload, layout, output):
        compressor.decode_row(received[0], payload.ctx, layout.rank, output)


@register("randomk", paper="Stich, Cordonnier, Jaggi 2018 (Sparsified SGD with memory: random-k)", fsdp=RandomKRows)
def randomk(ratio: Annotated[float, Range(0, 1, low_open=True), "fraction of the bucket's entries sent"] = 0.01,
            seed: Annotated[int, Range(0, None), "seed of the positions, the same on every rank"] = 0) -> Method:
    """Random-k sparsification with error feedback: shared random positions, values alone by all-reduce."""
    return Method(RandomKCompressor(ratio, seed), ResidualMemory(), AllreduceCommunicator())
