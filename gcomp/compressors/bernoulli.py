"""Independent Bernoulli draws with per-entry probabilities, from one random byte per entry on a CPU.

``torch.rand`` spends one 32-bit draw of the CPU generator (mt19937) per entry, which on a large bucket costs
more than all the arithmetic around it. Here each entry takes one random byte ``u`` (eight per 64-bit draw)
and the decision ``hit = (u + U) / 256 < p`` with ``U`` uniform in [0, 1) is taken in two stages:
``r = 256 p - u``; ``r >= 1`` hits whatever ``U`` is, ``r < 0`` misses whatever ``U`` is, and only the entries
with ``0 <= r < 1`` (one in 256) draw their own ``U`` (fp32) and hit when ``U < r``. Since ``u + U`` is uniform
in [0, 256), ``P(hit) = p`` exactly (to ``U``'s 24 bits within that 1/256: finer than one fp32 uniform), and
the entries stay independent. On other devices the generator is a fast counter-based one: one uniform each
(``draw_hits_device``, also every codec's device path: ``gcomp.kernels.on_device``).
"""
from __future__ import annotations

import torch

from gcomp.kernels import on_device

SCALE = 256  # the caller's probabilities come multiplied by this (a power of two: exact)


def draw_hits(hit: torch.Tensor, scaled: torch.Tensor, generator: torch.Generator, work: dict) -> torch.Tensor:
    """``hit[i]`` (bool) True with probability ``scaled[i] / SCALE`` (above ``SCALE``: always; NaN: never), each
    entry independently, from ``generator``. ``scaled`` (fp32) is overwritten; ``work`` holds this caller's
    buffers across calls (kept per bucket by the caller: no allocation of the entries' size per call)."""
    n = scaled.numel()
    if on_device(scaled):
        return draw_hits_device(hit, scaled, generator, work)
    words = _buffer(work, "bytes", -(-n // 8), torch.int64, scaled.device)
    words.random_(-2**63, None, generator=generator)  # every bit uniform: eight random bytes a word
    draws = _buffer(work, "draws", n, torch.float32, scaled.device)
    draws.copy_(words.view(torch.uint8)[:n])
    r = scaled.sub_(draws)
    torch.ge(r, 1, out=hit)
    tie = _buffer(work, "tie", n, torch.bool, scaled.device)
    torch.ge(r, 0, out=tie).logical_xor_(hit)  # 0 <= r < 1: the byte did not decide
    undecided = sparse_nonzero(tie)
    if undecided.numel():
        hit[undecided] = torch.rand(undecided.numel(), generator=generator, device=r.device) < r[undecided]
    return hit


def draw_hits_device(hit: torch.Tensor, scaled: torch.Tensor, generator: torch.Generator, work: dict
                     ) -> torch.Tensor:
    """``draw_hits`` in two whole-bucket operations and no host read: one fp32 uniform on [0, ``SCALE``) per entry,
    a hit where it is below ``scaled`` (``P(hit) = scaled / SCALE`` to the uniform's resolution, 2^-24 at worst).
    NaN never hits, ``SCALE`` and above always do; ``scaled`` is left as it is."""
    draws = _buffer(work, "draws", scaled.numel(), torch.float32, scaled.device)
    draws.uniform_(0, SCALE, generator=generator)
    return torch.lt(draws, scaled, out=hit)


def sparse_nonzero(flags: torch.Tensor, most: int | None = None) -> torch.Tensor | None:
    """``flags.nonzero().reshape(-1)`` of a flat bool or uint8 tensor with few set entries, in the same order:
    the set entries are looked for among the int64 words of 8 flags that are not zero (one scan of an eighth
    as many elements: ``nonzero`` over every flag costs some 2.5 copies of an fp32 bucket of that length).
    None when more than ``most`` (if given) words of 8 flags hold a set one: the caller takes a dense path."""
    n = flags.numel()
    whole = n // 8 if flags.is_contiguous() and flags.storage_offset() % 8 == 0 else 0
    found = flags.new_empty(0, dtype=torch.int64)
    if whole:
        bytes_ = flags[:whole * 8].view(torch.uint8)
        words = bytes_.view(torch.int64).nonzero().reshape(-1)
        if most is not None and words.numel() > most:
            return None
        # the 8 flags of each such word by a row gather (advanced indexing is several times slower)
        row, column = bytes_.view(-1, 8).index_select(0, words).nonzero(as_tuple=True)
        found = torch.index_select(words, 0, row).mul_(8).add_(column)
    if n > whole * 8:
        found = torch.cat([found, flags[whole * 8:].nonzero().reshape(-1) + whole * 8])
    return found


def _buffer(work: dict, key: str, n: int, dtype: torch.dtype, device) -> torch.Tensor:
    held = work.get(key)
    if held is None or held.numel() < n or held.dtype != dtype:
        held = work[key] = torch.empty(n, dtype=dtype, device=device)
    return held[:n]
