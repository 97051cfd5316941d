"""``bernoulli.draw_hits``: exact, independent Bernoulli draws from one random byte per entry (CPU); and its device
variant ``draw_hits_device``, one uniform per entry, with the same frequencies and special values."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.compressors import bernoulli

N = 200_000


def _hits(p: torch.Tensor, seed: int = 0, work: dict | None = None, draw=bernoulli.draw_hits) -> torch.Tensor:
    hit = torch.empty(p.numel(), dtype=torch.bool)
    return draw(hit, p * bernoulli.SCALE, torch.Generator().manual_seed(seed), {} if work is None else work)


DRAWS = pytest.mark.parametrize("draw", [bernoulli.draw_hits, bernoulli.draw_hits_device], ids=["bytes", "device"])


@DRAWS
@pytest.mark.parametrize("p", [1 / 512, 1 / 256 + 1e-4, 0.3717, 0.5, 127.5 / 256, 0.999])
def test_the_frequency_is_p_even_between_byte_steps(draw, p):
    """Within 5 binomial standard deviations of p over N draws. p = 1/512 lies inside the first byte step, so
    only the refined entries can hit: one random byte alone would give 0 or 1/256."""
    hits = _hits(torch.full((N,), p), draw=draw)
    sd = math.sqrt(p * (1 - p) / N)
    assert abs(hits.float().mean().item() - p) <= 5 * sd


@DRAWS
def test_certain_impossible_and_nan(draw):
    p = torch.tensor([0.0, 1.0, 1.7, float("nan"), float("inf"), -0.0] * 1000)
    hits = _hits(p, draw=draw).view(-1, 6)
    assert (~hits[:, 0]).all() and hits[:, 1].all() and hits[:, 2].all()
    assert (~hits[:, 3]).all() and hits[:, 4].all() and (~hits[:, 5]).all()


@DRAWS
def test_entries_are_independent(draw):
    """Pairs of neighbours (which share a random word) hit together with probability p**2."""
    p = 0.3
    hits = _hits(torch.full((N,), p), draw=draw).view(-1, 2)
    both = (hits[:, 0] & hits[:, 1]).float().mean().item()
    sd = math.sqrt(p * p * (1 - p * p) / (N // 2))
    assert abs(both - p * p) <= 5 * sd


@DRAWS
@settings(max_examples=30, deadline=None)
@given(st.integers(1, 300), st.integers(0, 2**31 - 1))
def test_same_stream_same_hits_and_buffers_reused(draw, n, seed):
    p = torch.rand(n, generator=torch.Generator().manual_seed(seed))
    work: dict = {}
    first = _hits(p, seed, work, draw).clone()
    held = {k: v.data_ptr() for k, v in work.items()}
    assert torch.equal(_hits(p, seed, work, draw), first)
    assert {k: v.data_ptr() for k, v in work.items()} == held


def test_the_device_variant_is_bucket_wide_and_reads_nothing_on_the_host():
    """Two operations on the probabilities' whole length (a uniform draw, a comparison), whatever it is; the byte
    draws refine their ties at the cost of a ``nonzero``, a host synchronisation on a device."""
    from gcomp.testing.ops import counting
    for n in (1000, 100_000):
        with counting() as counter:
            _hits(torch.full((n,), 0.3), draw=bernoulli.draw_hits_device)
        assert counter.ops["uniform_"] == 1 and counter.ops["lt"] == 1 and not counter.syncs
    with counting() as counter:
        _hits(torch.full((1000,), 0.3))
    assert counter.syncs["nonzero"]


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
