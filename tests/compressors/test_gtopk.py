"""``gtopk``: the global set is the same on every rank and has k entries, error feedback keeps exactly what a rank's
choice did not put into the global set, density 1 is the dense sum, and on 5 gloo ranks every rank sends the
messages the binomial tree gives it. Convergence on 2, 3, 5, 6 and 7 ranks runs in test_spardl.py, next to
spardl's; the merge itself is tested in tests/collectives/test_spardl_schedule.py."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gcomp
from gcomp.collectives.program import message_nbytes
from tests.compressors import spardl_jobs
from tests.distributed import run_ranks

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _simulate(world: int, density: float, steps: list[list[torch.Tensor]]):
    """Per step: every rank's result, the compensated inputs and the residuals after the step."""
    compressors = [gcomp.create("gtopk", density=density).compressor for _ in range(world)]
    info = gcomp.BucketInfo.single(steps[0][0])
    states = spardl_jobs.slots(world, info.numel, steps[0][0].dtype)
    out = []
    for xs in steps:
        results, compensated = spardl_jobs.simulate(compressors, states, xs, info)
        out.append((results, compensated, [s["residuals"].clone() for s in states]))
    return out


@PROPERTY
@given(world=st.integers(1, 9), n=st.integers(1, 300), density=st.floats(0.001, 1.0),
       seed=st.integers(0, 2**31 - 1))
def test_every_rank_gets_the_same_k_entries_and_keeps_the_rest(world, n, density, seed):
    g = torch.Generator().manual_seed(seed)
    steps = [[torch.randint(-30, 31, (n,), generator=g).float() for _ in range(world)] for _ in range(3)]
    k = max(1, int(n * density))
    for step, (results, compensated, residuals) in enumerate(_simulate(world, density, steps)):
        for rank, result in enumerate(results):
            assert torch.equal(result, results[0]), f"step {step}: rank {rank} differs from rank 0"
        assert int((results[0] != 0).sum()) <= k
        for rank, (x, residual) in enumerate(zip(compensated, residuals)):
            local = torch.topk(x.abs(), k, sorted=False).indices
            sent = torch.zeros(n, dtype=torch.bool)
            sent[local] = True
            # what this rank counts as sent lies in its own choice, and there it is the whole entry
            moved = x - residual
            assert torch.equal(moved[~sent], torch.zeros(int((~sent).sum()))), f"step {step}, rank {rank}"
            assert torch.equal(moved[sent] * (moved[sent] - x[sent]), torch.zeros(int(sent.sum()))), (
                f"step {step}, rank {rank}: a chosen entry was half kept")
        if world == 1:  # one worker: plain top-k with error feedback
            assert torch.equal(results[0] + residuals[0], compensated[0])


@pytest.mark.parametrize("world", [1, 2, 3, 6, 8])
def test_density_one_is_the_dense_sum(world):
    g = torch.Generator().manual_seed(world)
    steps = [[torch.randn(97, generator=g, dtype=torch.float64) for _ in range(world)] for _ in range(2)]
    for (results, compensated, residuals), xs in zip(_simulate(world, 1.0, steps), steps):
        torch.testing.assert_close(results[0], torch.stack(xs).sum(0), rtol=0, atol=1e-13)
        assert all(torch.equal(r, torch.zeros(97, dtype=torch.float64)) for r in residuals)


def _tree_messages(rank: int, world: int) -> int:
    """Messages a rank sends: one up the tree (all but rank 0), one to each child on the way down."""
    up = int(rank != 0)
    gap, down = 1, 0
    while gap < world:
        if rank % (2 * gap) == 0 and rank + gap < world:
            down += 1
        gap *= 2
    return up + down


def test_on_five_gloo_ranks_each_rank_sends_its_tree_messages():
    numel, density = 20_000, 0.01
    ranks = run_ranks(5, spardl_jobs.bytes_job, "gtopk", {"density": density, "positions": "raw"}, numel, 2)
    k = int(numel * density)
    size = message_nbytes([(torch.int32, k), (torch.float32, k)])
    assert [_tree_messages(r, 5) for r in range(5)] == [3, 1, 2, 1, 1]
    for rank, r in enumerate(ranks):
        assert r["same"], f"rank {rank}'s results differ"
        assert r["stats"]["messages"] == 2 * _tree_messages(rank, 5), (rank, r["stats"])
        assert r["stats"]["bytes_sent"] == 2 * _tree_messages(rank, 5) * size, (rank, r["stats"])
