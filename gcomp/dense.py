"""Parameters kept dense (``dense=``, ``dense_below=``): their entries of a bucket go in one all-reduce beside the
method, which reduces a sub-bucket of the others (docs/design.md §12)."""
from __future__ import annotations

import fnmatch
import warnings
from dataclasses import dataclass
from typing import Callable, Union

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.collectives.launch import then_on
from gcomp.collectives.reduce import all_reduce_all
from gcomp.core import Payload

DenseSpec = Union[str, list, tuple, Callable, None]
STAT_KEYS = ("dense_bytes", "dense_params")


class DenseRule:
    """Which parameters travel uncompressed: names or glob patterns (``fnmatch`` on ``model.named_parameters()``'s
    names), a predicate ``(name, param) -> bool``, and/or ``dense_below=N`` (parameters of fewer than N entries)."""

    def __init__(self, dense: DenseSpec = None, dense_below: int | None = None):
        if dense_below is not None and (isinstance(dense_below, bool) or not isinstance(dense_below, int)
                                        or dense_below <= 0):
            raise ValueError(f"gcomp: dense_below must be a positive number of entries (a parameter with fewer is "
                             f"kept dense), e.g. dense_below=4096; got {dense_below!r}")
        self.patterns: tuple[str, ...] = ()
        self.predicate: Callable | None = None
        if isinstance(dense, str):
            self.patterns = (dense,)
        elif isinstance(dense, (list, tuple)):
            if not dense:
                raise ValueError("gcomp: dense=[] names no parameter; leave dense= out, or name parameters or "
                                 "glob patterns (dense=['*.bias'])")
            bad = [p for p in dense if not isinstance(p, str)]
            if bad:
                raise TypeError(f"gcomp: dense= takes parameter names or glob patterns (str); got {bad[0]!r}")
            self.patterns = tuple(dense)
        elif callable(dense):
            self.predicate = dense
        elif dense is not None:
            raise TypeError("gcomp: dense= takes parameter names or glob patterns (a str or a list of them) or a "
                            f"predicate (name, param) -> bool; got {type(dense).__name__} ({dense!r}), which is "
                            "not callable")
        self.below = dense_below

    @classmethod
    def of(cls, dense: DenseSpec, dense_below: int | None) -> "DenseRule | None":
        """The rule, or None when neither is given."""
        return None if dense is None and dense_below is None else cls(dense, dense_below)

    def describe(self) -> str:
        parts = [f"dense={list(self.patterns)!r}"] if self.patterns else []
        parts += ["dense=<predicate>"] if self.predicate else []
        parts += [f"dense_below={self.below}"] if self.below is not None else []
        return ", ".join(parts)

    def select(self, named_parameters) -> tuple[str, ...]:
        """The names kept dense among ``named_parameters`` (those that train), in order; a pattern matching none is
        a ValueError, a rule keeping none, or all, warns once."""
        named = list(named_parameters)
        names = [n for n, _ in named]
        for pattern in self.patterns:
            if not fnmatch.filter(names, pattern):
                shown = ", ".join(names[:6]) + (", ..." if len(names) > 6 else "")
                raise ValueError(f"gcomp: dense= pattern {pattern!r} matches no trained parameter of the "
                                 f"model (requires_grad); they are named as model.named_parameters() names them "
                                 f"({shown}): fix the pattern or drop it")
        kept = tuple(n for n, p in named
                     if any(fnmatch.fnmatchcase(n, pat) for pat in self.patterns)
                     or (self.predicate is not None and self.predicate(n, p))
                     or (self.below is not None and p.numel() < self.below))
        if not kept:
            warnings.warn(f"gcomp: {self.describe()} keeps no parameter of the model dense: it has no effect",
                          UserWarning, stacklevel=4)
        elif len(kept) == len(named):
            warnings.warn(f"gcomp: {self.describe()} keeps every parameter dense: the method compresses nothing "
                          "(every bucket is a plain all-reduce)", UserWarning, stacklevel=4)
        return kept


@dataclass
class Split:
    """One bucket layout's split: the dense entries' positions, and the compressed parameters' sub-bucket."""

    sub: BucketInfo | None  # None: every parameter of the bucket is dense
    dense_index: torch.Tensor | None
    start: int
    stop: int
    comp_index: torch.Tensor | None  # None: the compressed entries are buffer[start:stop]


def split_of(info: BucketInfo, dense: frozenset, device: torch.device) -> Split | None:
    """The split of a layout; None when it holds no dense parameter (the bucket is reduced as it is)."""
    segments = list(info.segments())
    if not any(name in dense for name, _, _ in segments):
        return None
    kept = [(n, o, k) for n, o, k in segments if n not in dense]
    if not kept:
        return Split(None, None, 0, 0, None)
    sub = BucketInfo.from_layout(info.index, info.dtype, [n for n, _, _ in kept], [k for _, _, k in kept])

    def positions(parts):
        runs = [torch.arange(o, o + k, dtype=torch.int64) for _, o, k in parts]
        return torch.cat(runs).to(device)

    dense_index = positions([s for s in segments if s[0] in dense])
    start, stop = kept[0][1], kept[-1][1] + kept[-1][2]
    contiguous = stop - start == sub.numel
    return Split(sub, dense_index, start, stop, None if contiguous else positions(kept))


def reduce_split(buffer: torch.Tensor, split: Split, reduce_rest, group: dist.ProcessGroup | None,
                 stats: dict) -> torch.futures.Future:
    """Reduce a bucket (already divided by the world size) with dense parameters: theirs in one all-reduce, the
    rest through ``reduce_rest(flat, sub_info)``; a future of the buffer, filled with the mean."""
    dense = buffer if split.sub is None else buffer.index_select(0, split.dense_index)
    nbytes = dense.numel() * dense.element_size()
    stats["bytes_sent"] += nbytes
    stats["dense_bytes"] += nbytes
    sent = all_reduce_all(Payload([dense]), group, stats=stats)
    if split.sub is None:
        return then_on(sent, lambda f: f.value()[0], buffer.device)
    rest = buffer[split.start:split.stop] if split.comp_index is None else buffer.index_select(0, split.comp_index)
    reduced = reduce_rest(rest, split.sub)

    def assemble(done: torch.futures.Future) -> torch.Tensor:
        dense_fut, rest_fut = done.value()
        buffer.index_copy_(0, split.dense_index, dense_fut.wait()[0])  # wait: on CUDA, after the decode
        mean = rest_fut.wait().reshape(-1)
        if split.comp_index is None:
            buffer[split.start:split.stop].copy_(mean)
        else:
            buffer.index_copy_(0, split.comp_index, mean)
        return buffer

    return then_on(torch.futures.collect_all([sent, reduced]), assemble, buffer.device)
