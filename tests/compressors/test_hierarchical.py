"""``hierarchical``: 4 ranks as 2 nodes x 2 and 6 ranks as 3 x 2 (``ranks_per_node``): with ``inner="identity"``
the result is the dense mean; only leaders send across nodes (``inter_bytes``), and they send exactly the inner
method's payload, beside what a dense all-reduce of the bucket in its dtype would have sent (``inter_bytes_dense``);
replicas stay identical in DDP training with a lossy inner method; the inner method runs through the hook's own
pipeline and timers. ``inner`` is a spec string with parameters or a ``Method`` from ``gcomp.create``, checked at
create with the inner method's own messages. The nodes themselves: tests/test_topology.py."""
from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

import gcomp
from gcomp.bench.methods import parse_method
from gcomp.collectives import AllreduceCommunicator, launch
from gcomp.compressors.cast import CastCompressor
from gcomp.testing.buckets import FakeBucket
from tests.distributed import run_ranks
from tests.models import ddp, flat_params, mlp, train


def reduce_job(params: dict, numel: int = 3000, dtype: torch.dtype = torch.float32) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    state = gcomp.HookState(gcomp.create("hierarchical", **params))  # no model: the fake bucket's parameter
    state.warmup = 0
    param = torch.nn.Parameter(torch.zeros(numel, dtype=dtype))
    grads = [torch.randn(numel, generator=torch.Generator().manual_seed(r), dtype=torch.float64).to(dtype)
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
        assert r["stats"]["inter_bytes_dense"] == r["stats"]["inter_bytes"], (rank, r["stats"])  # identity: 1:1
        # the whole bucket inside the node, plus the inner payload on leaders
        assert r["stats"]["bytes_sent"] == 3000 * 4 + r["stats"]["inter_bytes"], (rank, r["stats"])


@pytest.mark.parametrize("world", [4, 6])
def test_a_lossy_inner_method_keeps_replicas_identical_and_cuts_inter_node_bytes(world):
    ranks = run_ranks(world, train_job, {"inner": "topk", "ranks_per_node": 2})
    dense = ranks[0]["stats"]["bytes_dense"]
    for rank, r in enumerate(ranks):
        assert r["same"], f"rank {rank}: replicas differ"
        if rank % 2:
            assert r["stats"]["inter_bytes"] == r["stats"]["inter_bytes_dense"] == 0, r["stats"]
        else:  # past the dense warm-up step, top-k's 1% (values and positions) crosses the nodes
            assert 0 < r["stats"]["inter_bytes"] < dense / 2, r["stats"]
            assert r["stats"]["inter_bytes_dense"] > 2 * r["stats"]["inter_bytes"], r["stats"]


def test_leaders_count_the_inner_payload_and_the_dense_bucket_in_its_own_dtype():
    """float64 buckets of 3000 entries, ``inner="topk:ratio=0.05,positions=raw"``: a leader sends top-k's 150
    float64 values and 150 int32 positions between nodes (not the default ratio's 30), where a dense all-reduce
    would have sent 3000 float64 entries; followers count neither."""
    ranks = run_ranks(4, reduce_job, {"inner": "topk:ratio=0.05,positions=raw", "ranks_per_node": 2},
                      dtype=torch.float64)
    for rank, r in enumerate(ranks):
        leader = rank % 2 == 0
        assert r["result"].dtype == torch.float64 and torch.equal(r["result"], ranks[0]["result"]), rank
        assert r["stats"]["inter_bytes"] == (150 * (8 + 4) if leader else 0), (rank, r["stats"])
        assert r["stats"]["inter_bytes_dense"] == (3000 * 8 if leader else 0), (rank, r["stats"])


class _Clock:
    """Stands in for the ``time`` module of ``gcomp.collectives.launch``: it moves only when the codec below says
    so, so the hook's encode and decode timers count the codec's calls exactly."""

    now = 0.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


class _TickingIdentity(CastCompressor):
    def encode(self, x, state, layout):
        _Clock.now += 1.0
        return super().encode(x, state, layout)

    def decode(self, received, ctx):
        _Clock.now += 10.0
        return super().decode(received, ctx)


def timed_inner_job(steps: int = 3) -> dict:
    rank = dist.get_rank()
    method = gcomp.create("hierarchical", ranks_per_node=2)
    method.inner = gcomp.Method(_TickingIdentity(), gcomp.NoMemory(), AllreduceCommunicator())
    state = gcomp.HookState(method)  # no model: the fake bucket's parameter is its own
    state.warmup = 0
    param = torch.nn.Parameter(torch.zeros(100))
    real_time, launch.time = launch.time, _Clock
    try:
        for step in range(steps):
            state.reduce(FakeBucket(torch.full((100,), float(rank + step)), 0, True, [param])).wait()
    finally:
        launch.time = real_time
    return dict(state.stats)


def test_the_inner_method_runs_through_the_hook_pipeline_and_its_timers():
    """On leaders the inner method's encode and decode count in ``encode_s`` and ``decode_s`` (one tick and
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


def test_an_inner_spec_with_parameters_reaches_the_inner_method():
    method = gcomp.create("hierarchical", inner="randomk:seed=3,ratio=0.05", ranks_per_node=2)
    inner = method.inner
    assert (inner.name, inner.params) == ("randomk", {"ratio": 0.05, "seed": 3})
    assert inner.compressor.ratio == 0.05
    # the parameter keeps the canonical spec: declared order, only what differs from the defaults
    assert method.params == {"inner": "randomk:ratio=0.05,seed=3", "ranks_per_node": 2}
    assert gcomp.create("hierarchical", inner="topk:ratio=0.01").params["inner"] == "topk"
    ternary = gcomp.create("hierarchical", inner="pactrain:ternary=true,clip=2.5").inner.compressor
    assert ternary.ternary and ternary.clip == 2.5


def test_an_inner_method_object_is_created_again_from_its_name_and_parameters():
    given = gcomp.create("topk", ratio=0.05)
    method = gcomp.create("hierarchical", inner=given)
    inner = method.inner
    assert inner is not given and (inner.name, inner.compressor.ratio) == ("topk", 0.05)
    assert method.params == gcomp.create("hierarchical", inner="topk:ratio=0.05").params
    buffer = io.BytesIO()  # plain text in params: a checkpoint's header reads back with weights_only
    torch.save(method.params, buffer)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True) == {"inner": "topk:ratio=0.05",
                                                                         "ranks_per_node": 0}


def test_a_method_object_not_made_by_create_is_refused():
    identity = gcomp.create("identity")
    custom = gcomp.Method(identity.compressor, identity.memory, identity.communicator)
    with pytest.raises(ValueError, match="'inner' takes a Method made by gcomp.create.*'custom'"):
        gcomp.create("hierarchical", inner=custom)


@pytest.mark.parametrize("inner, message", [
    ("topkk:ratio=0.1", "hierarchical: parameter 'inner' must name a registered method; got 'topkk:ratio=0.1' "
                        r"\(unknown gradient-compression method 'topkk'; did you mean 'topk'"),
    ("topk:ratio=2", r"hierarchical: parameter 'inner': topk: parameter 'ratio' must be in \(0, 1\]; got 2.0"),
    ("topk:ratio=abc", "hierarchical: parameter 'inner': 'topk:ratio=abc': parameter 'ratio' of topk must be a "
                       "float: got 'abc'"),
    ("topk:ratio", "hierarchical: parameter 'inner': 'topk:ratio': expected key=value with a parameter of topk "
                   r"\(ratio, positions, values\); got 'ratio'"),
    ("topk:rate=0.1", "expected key=value with a parameter of topk"),
    ("prunex", "hierarchical: parameter 'inner' cannot be a hierarchical method itself; got 'prunex'"),
    ("hierarchical:inner=topk", "cannot be a hierarchical method itself"),
    (3, r"hierarchical: parameter 'inner' must be a method spec \(name or name:key=value,...\) or a Method from "
        "gcomp.create; got 3"),
])
def test_a_bad_inner_spec_fails_at_create_with_the_inner_message(inner, message):
    with pytest.raises(ValueError, match=message):
        gcomp.create("hierarchical", inner=inner)


def test_a_bench_method_spec_nests_the_inner_spec():
    bench = parse_method("hierarchical:inner=topk:ratio=0.05,ranks_per_node=2")
    assert (bench.name, bench.params) == ("hierarchical", {"inner": "topk:ratio=0.05", "ranks_per_node": 2})
    with pytest.raises(ValueError, match="'inner': topk: parameter 'ratio' must be in"):
        parse_method("hierarchical:inner=topk:ratio=0")
