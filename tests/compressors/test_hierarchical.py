"""``hierarchical``: 4 ranks as 2 nodes x 2 and 6 ranks as 3 x 2 (``ranks_per_node``): with ``inner="identity"``
the result is the dense mean; only leaders send across nodes (``inter_bytes``), and they send exactly the inner
method's payload; replicas stay identical in DDP training with a lossy inner method; the inner method runs
through the hook's own pipeline and timers. The nodes themselves: tests/test_topology.py."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import gcomp
import gcomp.core
from gcomp.collectives import AllreduceCommunicator
from gcomp.compressors.identity import IdentityCompressor
from tests.contracts_jobs import FakeBucket
from tests.distributed import run_ranks
from tests.models import ddp, flat_params, mlp, train


def reduce_job(params: dict, numel: int = 3000) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = gcomp.HookState(gcomp.create("hierarchical", **params), ddp(mlp(0)), None)
    state.warmup = 0
    param = torch.nn.Parameter(torch.zeros(numel))
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(r), dtype=torch.float64).float()
             for r in range(world)]
    result = state.reduce(FakeBucket(grads[rank].clone(), 0, True, [param])).wait()
    dense = torch.stack(grads).sum(0) / world
    return {"result": result.clone(), "dense": dense, "stats": dict(state.stats)}


def train_job(params: dict, steps: int = 6) -> dict:
    model = ddp(mlp(0))
    state = gcomp.install(model, "hierarchical", **params)
    train(model, steps)
    mine = flat_params(model.module)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {"same": all(torch.equal(p, mine) for p in every), "stats": dict(state.stats)}


@pytest.mark.parametrize("world", [4, 6])
def test_identity_inner_is_the_dense_mean_and_only_leaders_cross_nodes(world):
    ranks = run_ranks(world, reduce_job, {"inner": "identity", "ranks_per_node": 2})
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(r["result"], r["dense"], rtol=1e-6, atol=1e-6)
        assert torch.equal(r["result"], ranks[0]["result"]), f"rank {rank} differs"
        leader = rank % 2 == 0
        assert r["stats"]["inter_bytes"] == (3000 * 4 if leader else 0), (rank, r["stats"])
        # the whole bucket inside the node, plus the inner payload on leaders
        assert r["stats"]["bytes_sent"] == 3000 * 4 + r["stats"]["inter_bytes"], (rank, r["stats"])


@pytest.mark.parametrize("world", [4, 6])
def test_a_lossy_inner_method_keeps_replicas_identical_and_cuts_inter_node_bytes(world):
    ranks = run_ranks(world, train_job, {"inner": "topk", "ranks_per_node": 2})
    dense = ranks[0]["stats"]["bytes_dense"]
    for rank, r in enumerate(ranks):
        assert r["same"], f"rank {rank}: replicas differ"
        if rank % 2:
            assert r["stats"]["inter_bytes"] == 0, r["stats"]
        else:  # past the dense warm-up step, top-k's 1% (values and positions) crosses the nodes
            assert 0 < r["stats"]["inter_bytes"] < dense / 2, r["stats"]


class _Clock:
    """Stands in for the ``time`` module of ``gcomp.core``: it moves only when the codec below says so, so the
    hook's encode and decode timers count the codec's calls exactly."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


class _TickingIdentity(IdentityCompressor):
    def compress(self, tensor, bucket):
        _Clock.now += 1.0
        return super().compress(tensor, bucket)

    def decompress(self, tensors, ctx):
        _Clock.now += 10.0
        return super().decompress(tensors, ctx)


def timed_inner_job(steps: int = 3) -> dict:
    rank = dist.get_rank()
    method = gcomp.create("hierarchical", ranks_per_node=2)
    method.compressor.inner = gcomp.Method(_TickingIdentity(), gcomp.NoMemory(), AllreduceCommunicator())
    state = gcomp.HookState(method, ddp(mlp(0)), None)
    state.warmup = 0
    param = torch.nn.Parameter(torch.zeros(100))
    real_time, gcomp.core.time = gcomp.core.time, _Clock
    try:
        for step in range(steps):
            state.reduce(FakeBucket(torch.full((100,), float(rank + step)), 0, True, [param])).wait()
    finally:
        gcomp.core.time = real_time
    return dict(state.stats)


def test_the_inner_method_runs_through_the_hook_pipeline_and_its_timers():
    """On leaders the inner method's compress and decode count in ``encode_s`` and ``decode_s`` (one tick and
    ten ticks of a clock that moves only inside the inner codec); followers run no inner codec."""
    for rank, stats in enumerate(run_ranks(4, timed_inner_job)):
        leader = rank % 2 == 0
        assert stats["encode_s"] == (3.0 if leader else 0.0), (rank, stats)
        assert stats["decode_s"] == (30.0 if leader else 0.0), (rank, stats)


def test_inner_must_be_another_registered_method():
    with pytest.raises(ValueError, match="'inner'"):
        gcomp.create("hierarchical", inner="hierarchical")
    with pytest.raises(ValueError, match="'inner' must name a registered method; got 'topkk'"):
        gcomp.create("hierarchical", inner="topkk")
