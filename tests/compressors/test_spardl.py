"""``spardl``: global residual collection conserves every entry exactly (any worker count, any number of teams,
blocks whose final choice is empty or all zero), density 1 is the dense sum, Spar-All-Gather's adaptive budget,
checkpoints, and on 2, 3, 5, 6 and 7 gloo ranks: identical replicas, a falling loss, and bytes per step that
match the cost model. The schedules themselves are tested in tests/collectives/test_spardl_schedule.py.

The hook divides each bucket by the world size P before the method sees it, so the method's result is the sum
over ranks of what it is given; the issue's identity  sum(residuals) + P * mean == sum(G0)  reads
sum(residuals) + result == sum(compensated) here. Integer-valued inputs make every sum exact, so it is
checked with ``torch.equal``.
"""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gcomp
from gcomp.collectives.program import message_nbytes, run_locally
from gcomp.compressors.spardl.codec import Budget, SparDLCompressor
from gcomp.compressors.spardl.schedule import bruck_rounds, reduce_scatter_rounds
from gcomp.sharding import ShardLayout
from tests.compressors import spardl_jobs
from tests.compressors.test_randomk import converge_job
from tests.distributed import run_ranks

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


class _Ranks:
    """``world`` simulated ranks of spardl (``cls``: the compressor), each with its ``residuals`` slot."""

    def __init__(self, world: int, params: dict, info: gcomp.BucketInfo, cls=None):
        self.compressors = [gcomp.create("spardl", **params).compressor if cls is None else cls(**params)
                            for _ in range(world)]
        self.states, self.info = spardl_jobs.slots(world, info.numel, info.dtype), info

    def step(self, xs):
        """One simulated step: every rank's results, the sum of the residuals after it, and of what was given."""
        results, compensated = spardl_jobs.simulate(self.compressors, self.states, xs, self.info)
        return results, torch.stack([s["residuals"] for s in self.states]).sum(0), torch.stack(compensated).sum(0)


def _inputs(world: int, n: int, dtype, kind: str, g: torch.Generator) -> list[torch.Tensor]:
    xs = [torch.randint(-20, 21, (n,), generator=g).to(dtype) for _ in range(world)]
    if kind == "cancel":  # pairs of ranks send opposite values: partial sums and whole blocks become 0
        for r in range(0, world - 1, 2):
            xs[r + 1] = -xs[r]
    elif kind == "sparse":
        for x in xs:
            x[torch.rand(n, generator=g) < 0.9] = 0
    return xs


def _teams(world: int) -> st.SearchStrategy:
    return st.sampled_from([d for d in range(1, world + 1) if world % d == 0])


@PROPERTY
@given(data=st.data(), world=st.integers(1, 9), n=st.integers(1, 400),
       density=st.one_of(st.floats(0.001, 1.0), st.sampled_from([1.0, 1e-9, 0.5])),
       dtype=st.sampled_from([torch.float32, torch.float64]), kind=st.sampled_from(["ints", "cancel", "sparse"]),
       seed=st.integers(0, 2**31 - 1))
def test_global_residual_collection_conserves_exactly(data, world, n, density, dtype, kind, seed):
    teams = data.draw(_teams(world), label="teams")
    ranks = _Ranks(world, {"density": density, "teams": teams}, gcomp.BucketInfo.single(torch.zeros(n, dtype=dtype)))
    g = torch.Generator().manual_seed(seed)
    for step in range(3):
        results, residuals, compensated = ranks.step(_inputs(world, n, dtype, kind, g))
        for rank, result in enumerate(results):
            assert result.shape == (n,) and result.dtype == dtype
            assert torch.equal(result, results[0]), f"step {step}: rank {rank}'s result differs from rank 0's"
        assert torch.equal(residuals + results[0], compensated), (
            f"step {step}: sum of residuals + result != sum of compensated gradients "
            f"(max error {(residuals + results[0] - compensated).abs().max()})")
        size, width, k = ranks.compressors[0].geometry(n, world)
        assert int((results[0] != 0).sum()) <= size * k


class _EmptySelection(SparDLCompressor):
    """SparDL with nothing chosen in any block (k = 0): the case where the reference code skips its residual
    rule for a block, and so loses or double counts what was forwarded."""

    def geometry(self, numel, world):
        size, width, _ = super().geometry(numel, world)
        return size, width, 0


@pytest.mark.parametrize("world, teams", [(1, 1), (3, 1), (5, 1), (6, 2), (4, 4)])
def test_an_empty_final_selection_keeps_every_entry(world, teams):
    ranks = _Ranks(world, {"density": 0.5, "teams": teams}, gcomp.BucketInfo.single(torch.zeros(37)), _EmptySelection)
    g = torch.Generator().manual_seed(world)
    given = [torch.zeros(37) for _ in range(world)]
    for step in range(2):
        xs = _inputs(world, 37, torch.float32, "ints", g)
        results, residuals, compensated = ranks.step(xs)
        assert all(torch.equal(r, torch.zeros(37)) for r in results)
        assert torch.equal(residuals, compensated), f"step {step}: a residual was lost or counted twice"
        for rank, (state, x) in enumerate(zip(ranks.states, xs)):  # and each rank keeps exactly its own entries
            given[rank] += x
            assert torch.equal(state["residuals"], given[rank]), f"step {step}, rank {rank}"


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7, 8, 9])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_density_one_is_the_dense_sum(world, dtype):
    """With one team (with several, Spar-All-Gather's budget h starts at k / teams, as the spec has it, and
    only grows to k over the steps, so the first steps hold entries back even at density 1)."""
    ranks = _Ranks(world, {"density": 1.0, "teams": 1}, gcomp.BucketInfo.single(torch.zeros(301, dtype=dtype)))
    g = torch.Generator().manual_seed(world)
    for step in range(2):
        xs = [torch.randn(301, generator=g, dtype=torch.float64).to(dtype) for _ in range(world)]
        results, residuals, _ = ranks.step(xs)
        exact = torch.stack(xs).double().sum(0)
        eps = torch.finfo(dtype).eps
        for result in results:
            torch.testing.assert_close(result.double(), exact, rtol=0, atol=world * eps * 10)
        assert torch.equal(residuals, torch.zeros_like(residuals)), "density 1 sends everything: no residual"


def test_geometry_pads_the_bucket_into_blocks():
    c = SparDLCompressor(density=0.1, teams=2)
    assert c.geometry(1000, 8) == (4, 250, 25)
    assert c.geometry(1001, 8) == (4, 251, 25)
    assert c.geometry(3, 8) == (4, 1, 1)  # fewer entries than blocks: blocks of one, at least one entry each
    assert SparDLCompressor(density=1e-9, teams=1).geometry(50, 2) == (2, 25, 1)


def test_adaptive_budget_moves_h_toward_a_union_of_k():
    k, floor = 100, 25
    budget = Budget(floor, 1)
    seen = []
    for _ in range(12):  # unions below k: h grows, faster every second step
        budget.union = torch.tensor(60)
        budget.adapt(k, floor)
        seen.append(budget.h)
    assert seen == sorted(seen) and seen[-1] > seen[0] + 10, seen
    assert all(b - a <= 64 for a, b in zip(seen, seen[1:]))
    step_before = budget.step
    budget.union = torch.tensor(150)  # overshoot: turn round at half the speed
    budget.adapt(k, floor)
    assert budget.step == int(-0.5 * step_before) and not budget.inertia
    for _ in range(50):  # a union far above k drives h down, never under the floor
        budget.union = torch.tensor(400)
        budget.adapt(k, floor)
        assert floor <= budget.h <= k
    assert budget.h == floor
    budget.adapt(k, floor)  # nothing new to read: nothing moves
    assert budget.h == floor and budget.union is None


def test_teams_share_one_budget_per_block_and_checkpoint_it():
    """4 simulated ranks in 2 teams: the two members holding the same block move h alike; a checkpoint taken
    after 3 steps resumes to the same next 2 steps, residuals and budgets included."""
    world, params = 4, {"density": 0.2, "teams": 2}
    info = gcomp.BucketInfo.single(torch.zeros(200))
    g = torch.Generator().manual_seed(3)
    steps = [[torch.randn(200, generator=g) for _ in range(world)] for _ in range(5)]
    straight = _Ranks(world, params, info)
    for xs in steps[:3]:
        straight.step(xs)
    saved = [(c.state_dict(), s["residuals"].clone()) for c, s in zip(straight.compressors, straight.states)]
    after = [straight.step(xs)[0][0] for xs in steps[3:]]
    budgets = [c.budgets[info.key].h for c in straight.compressors]
    assert budgets[0] == budgets[2] and budgets[1] == budgets[3], budgets  # ranks q and q + Q hold block q
    resumed = _Ranks(world, params, info)
    for c, s, (state, residual) in zip(resumed.compressors, resumed.states, saved):
        c.load_state_dict(state)
        s["residuals"].copy_(residual)
    assert all(torch.equal(a, resumed.step(xs)[0][0]) for a, xs in zip(after, steps[3:]))
    assert resumed.compressors[0].merge_states([saved[0][0]], [saved[0][0]], 0) == {}  # a resize: budgets adapt afresh


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_under_fsdp2_spar_reduce_scatter_is_the_reduce_scatter_and_conserves(world):
    """FSDP2's input (world rows, row r rank r's shard) reduced by Spar-Reduce-Scatter alone: rank r's result is its
    shard, and every rank's residual (the other blocks, what it did not pass on) plus the shards add up to the sum
    of the inputs, exactly; (world - 1) k pairs leave each rank per call."""
    rows, cols = 4 * world, 7
    layouts = [ShardLayout(0, ("w",), (torch.Size([rows, cols]),), world, r, torch.float64) for r in range(world)]
    width = layouts[0].shard_numel
    compressors = [gcomp.create("spardl", density=0.2, positions="raw").compressor for _ in range(world)]
    states = spardl_jobs.slots(world, world * width, torch.float64)
    g = torch.Generator().manual_seed(world)
    for step in range(2):
        xs = [torch.randint(-20, 21, (world * width,), generator=g).double() for _ in range(world)]
        ctxs = [c.encode(x, s, layout)[0].ctx for c, x, s, layout in zip(compressors, xs, states, layouts)]
        shards = run_locally([c.program(ctx, r, world) for r, (c, ctx) in enumerate(zip(compressors, ctxs))])
        assert all(shard.shape == (width,) for shard in shards)
        residuals = torch.stack([s["residuals"] for s in states]).sum(0)
        compensated = torch.stack([ctx.compensated for ctx in ctxs]).sum(0)
        assert torch.equal(residuals + torch.cat(shards), compensated), f"step {step}"
        for r, s in enumerate(states):  # a rank keeps nothing of its own shard
            assert not s["residuals"].view(world, width)[r].any()


# --- on gloo process groups --------------------------------------------------------------------------------------

def _expected_bytes(world: int, teams: int, numel: int, density: float) -> tuple[int, int]:
    """Bytes and messages one rank sends per step: every round sends exactly one message of a known size."""
    c = SparDLCompressor(density, teams)
    size, width, k = c.geometry(numel, world)
    h = min(max(1, k // teams), k)
    pair = [(torch.int32, 1), (torch.float32, 1)]

    def nbytes(count, per, extra=()):
        return message_nbytes([(dt, count * per * n) for dt, n in pair] + [(dt, count * n) for dt, n in extra])

    total = sum(nbytes(count, k) for _, count in reduce_scatter_rounds(size))
    messages = len(reduce_scatter_rounds(size)) + len(bruck_rounds(size))
    if teams == 1:
        total += sum(nbytes(count, k) for _, count in bruck_rounds(size))
    else:
        total += sum(nbytes(count, h) for _, count in bruck_rounds(teams))
        total += sum(nbytes(count, k, [(torch.int32, 1)]) for _, count in bruck_rounds(size))
        messages += len(bruck_rounds(teams))
    return total, messages


SPARDL_WORLDS = [2, 3, 5, 6]  # non-powers of two with and without teams; 7 ranks cost 30 s on 2 cores for no new path


@pytest.mark.parametrize("world", SPARDL_WORLDS)
def test_on_gloo_ranks_bytes_match_the_cost_model_and_training_converges(world):
    numel, density = 60_000, 0.01
    teams_options = [d for d in (1, 2) if world % d == 0]
    for teams in teams_options:
        steps = 2 if teams == 1 else 1  # with teams, h adapts after the first step
        ranks = run_ranks(world, spardl_jobs.bytes_job, "spardl",
                          {"density": density, "teams": teams, "positions": "raw"}, numel, steps)
        expected, messages = _expected_bytes(world, teams, numel, density)
        for rank, r in enumerate(ranks):
            assert r["same"], f"teams={teams}: rank {rank}'s results differ"
            assert r["stats"]["bytes_sent"] == steps * expected, (teams, rank, r["stats"])
            assert r["stats"]["messages"] == steps * messages, (teams, rank, r["stats"])
            assert r["stats"]["messages"] == steps * (2 * math.ceil(math.log2(world // teams))
                                                      + math.ceil(math.log2(teams)))
        if teams == 1:  # the volume of docs/algorithms.md §7.2: 2 (P - 1) / P * k (value + index) bytes, k = density * n
            model = 2 * (world - 1) / world * density * numel * (4 + 4)
            per_step = ranks[0]["stats"]["bytes_sent"] / steps
            assert abs(per_step - model) <= 0.05 * model, (per_step, model)
    configs = [("spardl", {"density": 0.1, "teams": d}) for d in teams_options] + [("gtopk", {"density": 0.1})]
    ranks = run_ranks(world, converge_job, [("identity", {})] + configs)
    dense = ranks[0][0]
    for i, (name, params) in enumerate(configs, start=1):
        run = ranks[0][i]
        assert all(r[i]["same"] for r in ranks), f"{name}{params} on {world} ranks: replicas differ"
        assert run["first"] == dense["first"]
        assert run["first"] - run["last"] >= 0.3, (f"{name}{params} on {world} ranks: held-out loss "
                                                    f"{run['first']:.3f} -> {run['last']:.3f}")
        assert run["stats"]["bytes_sent"] < run["stats"]["bytes_dense"], run["stats"]


def test_teams_that_do_not_divide_the_workers_fail_at_install():
    (message, _, _) = run_ranks(3, spardl_jobs.install_job, "spardl", {"teams": 2})
    assert message is not None and "'teams'" in message and "3" in message, message
    assert run_ranks(3, spardl_jobs.install_job, "spardl", {"teams": 3}) == [None] * 3
