"""``bernoulli.draw_hits``: exact, independent Bernoulli draws from one random byte per entry (CPU)."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.compressors import bernoulli

N = 200_000


def _hits(p: torch.Tensor, seed: int = 0, work: dict | None = None) -> torch.Tensor:
    hit = torch.empty(p.numel(), dtype=torch.bool)
    return bernoulli.draw_hits(hit, p * bernoulli.SCALE, torch.Generator().manual_seed(seed), {} if work is None
                               else work)


@pytest.mark.parametrize("p", [1 / 512, 1 / 256 + 1e-4, 0.3717, 0.5, 127.5 / 256, 0.999])
def test_the_frequency_is_p_even_between_byte_steps(p):
    """Within 5 binomial standard deviations of p over N draws. p = 1/512 lies inside the first byte step, so
    only the refined entries can hit: one random byte alone would give 0 or 1/256."""
    hits = _hits(torch.full((N,), p))
    sd = math.sqrt(p * (1 - p) / N)
    assert abs(hits.float().mean().item() - p) <= 5 * sd


def test_certain_impossible_and_nan():
    p = torch.tensor([0.0, 1.0, 1.7, float("nan"), float("inf"), -0.0] * 1000)
    hits = _hits(p).view(-1, 6)
    assert (~hits[:, 0]).all() and hits[:, 1].all() and hits[:, 2].all()
    assert (~hits[:, 3]).all() and hits[:, 4].all() and (~hits[:, 5]).all()


def test_entries_are_independent():
    """Pairs of neighbours (which share a random word) hit together with probability p**2."""
    p = 0.3
    hits = _hits(torch.full((N,), p)).view(-1, 2)
    both = (hits[:, 0] & hits[:, 1]).float().mean().item()
    sd = math.sqrt(p * p * (1 - p * p) / (N // 2))
    assert abs(both - p * p) <= 5 * sd


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2**31 - 1))
def test_same_stream_same_hits_and_buffers_reused(n, seed):
    p = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    work: dict = {}
    first = _hits(p, seed, work).clone()
    held = {k: v.data_ptr() for k, v in work.items()}
    assert torch.equal(_hits(p, seed, work), first)
    assert {k: v.data_ptr() for k, v in work.items()} == held


def test_sparse_nonzero_equals_nonzero_and_gives_way_past_its_limit():
    from gcomp.compressors.bernoulli import sparse_nonzero
    g = torch.Generator().manual_seed(9)
    for n in (0, 1, 7, 8, 9, 1000, 4099):
        for density in (0.0, 0.004, 0.3, 1.0):
            flags = torch.rand(n, generator=g) < density
            for view in (flags, flags.view(torch.uint8)):
                assert torch.equal(sparse_nonzero(view), view.nonzero().reshape(-1))
            if n >= 8:  # an offset view: not on a word boundary
                assert torch.equal(sparse_nonzero(flags[1:]), flags[1:].nonzero().reshape(-1))
    many = torch.ones(64, dtype=torch.bool)
    assert sparse_nonzero(many, most=7) is None and sparse_nonzero(many, most=8).numel() == 64
