"""Streaming DiLoCo's fragments and schedule (gcomp.outer.fragments), and DiLoCo's argument checks, on one
process."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import gcomp
from gcomp.outer import fragments as fr
from tests import models


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 1000), min_size=1, max_size=40), st.data())
def test_fragments_cover_every_parameter_once_in_order(numels, data):
    count = data.draw(st.integers(1, len(numels)))
    parts = fr.split(numels, count)
    assert len(parts) == count and all(len(p) for p in parts)
    assert [i for p in parts for i in p] == list(range(len(numels)))  # each once, contiguous, in model order
    total, biggest = sum(numels), max(numels)
    for p in parts[:-1]:  # balanced: no fragment but the last exceeds its share by more than one parameter
        assert sum(numels[i] for i in p) <= total / count + biggest


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 60), st.integers(1, 8))
def test_each_fragment_syncs_once_every_sync_every_steps(sync_every, count):
    seen = [s for s in range(1, 2 * sync_every + 1) for _ in fr.due(s, count, sync_every)]
    assert len(seen) == 2 * count
    for f in range(count):
        steps = [s for s in range(1, 3 * sync_every + 1) if f in fr.due(s, count, sync_every)]
        assert steps[0] == fr.offset(f, count, sync_every) or steps[0] == sync_every
        assert all(b - a == sync_every for a, b in zip(steps, steps[1:]))


def test_buckets_split_a_fragment_by_size_and_dtype():
    params = [torch.zeros(100), torch.zeros(100), torch.zeros(10, dtype=torch.float64), torch.zeros(5)]
    made = fr.buckets(["a", "b", "c", "d"], params, range(4), 3, bucket_mb=500 / 2 ** 20)
    assert [b.params for b in made] == [(0,), (1,), (2,), (3,)]
    assert [b.info.index for b in made] == [3, 4, 5, 6]
    assert made[2].info.dtype == torch.float64 and made[0].info.dtype == torch.float32
    assert fr.outer_dtype(torch.bfloat16) == torch.float32


@pytest.mark.parametrize("kw, words", [
    ({"sync_every": 0}, "sync_every must be at least 1"),
    ({"sync_every": -3}, "sync_every must be at least 1"),
    ({"fragments": 7}, "between 1 and the number of trained parameters (6)"),
    ({"fragments": 0}, "fragments must be at least 1"),
    ({"sync_every": 10, "fragments": 2, "overlap": 5}, "overlap must satisfy"),
    ({"overlap": -1}, "overlap must satisfy"),
    ({"method": "pactrain"}, "cannot reduce a flat outer gradient"),
    ({"method": "prunex"}, "cannot reduce a flat outer gradient"),
    ({"method": "topk:ratio=2"}, "ratio"),
    ({"bucket_mb": 0}, "bucket_mb"),
    ({"alpha": 0}, "alpha"),
    ({"sync_every": 2.5}, "sync_every must be an int"),
])
def test_bad_arguments_are_clear_errors(kw, words):
    with pytest.raises(ValueError, match=None) as err:
        gcomp.outer.DiLoCo(models.mlp(0), **kw)
    assert words in str(err.value), str(err.value)


def test_it_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        gcomp.outer.DiLoCo(models.mlp(0), sync_every=4)
