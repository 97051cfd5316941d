"""How ``gcomp.outer`` cuts the parameters: fragments (whole parameters, contiguous in model order, balanced by
entries), each fragment's flat buckets, the streaming schedule (docs/outer.md), and a reduction in flight."""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from itertools import accumulate

import torch

from gcomp.bucket import BucketInfo
from gcomp.collectives.launch import settle


def split(numels: list[int], fragments: int) -> list[range]:
    """``fragments`` contiguous, non-empty ranges of parameter indices covering ``range(len(numels))`` once, cut
    where the running number of entries first reaches ``f * total / fragments`` (each fragment keeps at least one
    parameter, and leaves one for each later fragment)."""
    n = len(numels)
    if not 1 <= fragments <= n:
        raise ValueError(f"gcomp.outer: fragments must be between 1 and the number of trained parameters ({n}), "
                         f"got {fragments}")
    prefix = list(accumulate(numels, initial=0))  # prefix[c]: entries of parameters 0 .. c-1
    cuts = [0]
    for f in range(1, fragments):
        cut = bisect_left(prefix, f * prefix[-1] / fragments)
        cuts.append(min(max(cut, cuts[-1] + 1), n - (fragments - f)))
    cuts.append(n)
    return [range(a, b) for a, b in zip(cuts, cuts[1:])]


def offset(fragment: int, fragments: int, sync_every: int) -> int:
    """The inner step, modulo ``sync_every``, at which ``fragment`` syncs: ``(fragment * sync_every) // fragments``."""
    return (fragment * sync_every) // fragments


def due(step: int, fragments: int, sync_every: int) -> list[int]:
    """The fragments that sync at inner step ``step`` (1 for the first step taken)."""
    here = step % sync_every
    return [f for f in range(fragments) if offset(f, fragments, sync_every) == here]


def outer_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the global copy and of the outer gradient's buckets: fp32, or the parameter's if wider."""
    return torch.promote_types(dtype, torch.float32)


@dataclass(frozen=True)
class Bucket:
    """One flat bucket of the outer gradient: its layout (keyed by the parameter names, so a method's per-bucket
    state carries across outer steps) and the indices of its parameters."""

    info: BucketInfo
    params: tuple[int, ...]


def buckets(names: list[str], params: list[torch.Tensor], members: range, first_index: int, bucket_mb: float
            ) -> list[Bucket]:
    """The buckets of one fragment: whole parameters in model order, a new bucket past ``bucket_mb`` megabytes
    (MiB) of the outer dtype or where that dtype changes."""
    cap = bucket_mb * 2 ** 20
    out, current, size, dtype = [], [], 0, None
    for i in members:
        d = outer_dtype(params[i].dtype)
        nbytes = params[i].numel() * d.itemsize
        if current and (d != dtype or size + nbytes > cap):
            out.append(current)
            current, size = [], 0
        current.append(i)
        size += nbytes
        dtype = d
    if current:
        out.append(current)
    made = []
    for k, group in enumerate(out):
        info = BucketInfo.from_layout(first_index + k, outer_dtype(params[group[0]].dtype),
                                      [names[i] for i in group], [params[i].numel() for i in group])
        made.append(Bucket(info, tuple(group)))
    return made


@dataclass
class Pending:
    """A fragment's reduction in flight (``future``: a future of its buckets' futures), or resolved (``means``,
    the reduced outer gradient per bucket, as a checkpoint holds it)."""

    fragment: int
    apply_at: int
    future: torch.futures.Future | None = None
    means: list[torch.Tensor] | None = None

    def result(self) -> list[torch.Tensor]:
        """The reduced outer gradient per bucket; waits for it, raising the collective's error (a dead peer)."""
        if self.means is None:
            self.means = [f.wait() for f in self.future.wait()]
            settle()
        return self.means
