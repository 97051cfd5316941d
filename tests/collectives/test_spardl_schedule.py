"""SparDL's and gTop-k's round schedules (gcomp.compressors.spardl.schedule, gcomp.compressors.sparse.gtopk; docs/algorithms.md
§7.2-7.3): the Spar-Reduce-Scatter round plan (round count, block counts, worked examples), a symbolic
simulation showing every block is reduced exactly once, exact numerical sums through ``run_locally``, the
Bruck all-gather, multi-team agreement, and gTop-k's ``merge_top`` and tree program."""
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gcomp.collectives.program import run_locally
from gcomp.collectives.sparse_wire import SparseWire
from gcomp.compressors.spardl.schedule import bruck_allgather, bruck_rounds, reduce_scatter_rounds, spardl_program
from gcomp.compressors.sparse.gtopk import merge_top, tree_program

SETTINGS = settings(max_examples=80, deadline=None)


# ---- round plans ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("size", range(1, 18))
def test_reduce_scatter_rounds_count_and_total(size):
    schedule = reduce_scatter_rounds(size)
    expected_rounds = math.ceil(math.log2(size)) if size > 1 else 0
    assert len(schedule) == expected_rounds, f"Q={size}: {len(schedule)} rounds, expected {expected_rounds}"
    assert sum(count for _, count in schedule) == size - 1, f"Q={size}: counts {schedule} do not sum to Q-1"
    for gap, count in schedule:
        assert 0 < gap < size and 0 < count <= gap, f"Q={size}: round (gap {gap}, count {count}) out of range"
    gaps = [gap for gap, _ in schedule]
    assert gaps == [2 ** i for i in reversed(range(len(schedule)))], f"Q={size}: gaps {gaps} do not halve to 1"


@pytest.mark.parametrize("size, sizes, gaps", [
    (8, [4, 2, 1], [4, 2, 1]),
    (6, [2, 2, 1], [4, 2, 1]),
    (5, [1, 2, 1], [4, 2, 1]),
    (2, [1], [1]),
    (3, [1, 1], [2, 1]),
])
def test_reduce_scatter_rounds_worked_examples(size, sizes, gaps):
    schedule = reduce_scatter_rounds(size)
    assert [c for _, c in schedule] == sizes, f"Q={size}: sizes {[c for _, c in schedule]}, expected {sizes}"
    assert [g for g, _ in schedule] == gaps, f"Q={size}: gaps {[g for g, _ in schedule]}, expected {gaps}"


def test_reduce_scatter_rounds_rejects_empty_team():
    with pytest.raises(ValueError):
        reduce_scatter_rounds(0)


@pytest.mark.parametrize("size", range(1, 18))
def test_bruck_rounds_count_and_total(size):
    schedule = bruck_rounds(size)
    expected_rounds = math.ceil(math.log2(size)) if size > 1 else 0
    assert len(schedule) == expected_rounds, f"size {size}: {len(schedule)} rounds, expected {expected_rounds}"
    assert sum(count for _, count in schedule) == size - 1, f"size {size}: counts {schedule} do not sum to size-1"


# ---- symbolic simulation of Spar-Reduce-Scatter -----------------------------------------------------------

@pytest.mark.parametrize("size", range(2, 18))
def test_reduce_scatter_schedule_covers_every_block_exactly_once(size):
    """Every member's contribution to block q reaches member q exactly once (with k = B, nothing dropped)."""
    held = {(q, b): Counter({q: 1}) for q in range(size) for b in range(size)}  # contributions in block b at q
    sent_log = {q: [] for q in range(size)}
    for rnd, (gap, count) in enumerate(reduce_scatter_rounds(size)):
        messages, sends, recvs = {}, {}, {}
        for q in range(size):
            dest = (q + gap) % size
            blocks = [(q + gap + j) % size for j in range(count)]
            sends[q] = set(blocks)
            messages[dest] = [(b, held[q, b]) for b in blocks]
            for b in blocks:
                held[q, b] = Counter()  # sent away in full: what stays is the (empty) residual
            sent_log[q].extend(blocks)
        for q in range(size):
            src = (q - gap) % size
            blocks = [(q + j) % size for j in range(count)]
            recvs[q] = set(blocks)
            assert not recvs[q] & sends[q], f"Q={size} round {rnd}: member {q} sends and receives {recvs[q] & sends[q]}"
            incoming = messages[q]
            assert [b for b, _ in incoming] == blocks, \
                f"Q={size} round {rnd}: member {q} expects blocks {blocks} from {src}, which sends {incoming}"
            for b, contribution in incoming:
                assert b not in sent_log[q], \
                    f"Q={size} round {rnd}: member {q} receives into block {b} after sending it (data lost)"
                held[q, b] = held[q, b] + contribution
    everyone = Counter({m: 1 for m in range(size)})
    for q in range(size):
        assert held[q, q] == everyone, f"Q={size}: member {q}'s block holds {dict(held[q, q])}, expected each once"
        assert len(sent_log[q]) == len(set(sent_log[q])), f"Q={size}: member {q} sends a block twice: {sent_log[q]}"
        assert set(sent_log[q]) == set(range(size)) - {q}, \
            f"Q={size}: member {q} sends blocks {sorted(sent_log[q])}, expected every block but its own"


# ---- numerical runs ---------------------------------------------------------------------------------------

def _run_spardl(blocks_per_rank, teams, k, h):
    world = len(blocks_per_rank)
    programs = [spardl_program(blocks_per_rank[r], r, world, teams, k, h) for r in range(world)]
    return run_locally(programs)


@pytest.mark.parametrize("world", range(2, 18))
def test_spardl_one_team_sums_every_contribution_exactly(world):
    width = 3
    blocks = [torch.full((world, width), 2.0 ** r, dtype=torch.float64) for r in range(world)]
    total = float(sum(2 ** r for r in range(world)))  # a missing or doubled power of two would show
    results = _run_spardl(blocks, teams=1, k=width, h=width)
    for r, sel in enumerate(results):
        assert sel.valid is None and sel.union is None, f"rank {r}: one team has no valid mask or union"
        assert sel.values.shape == (world, width) and sel.index.shape == (world, width), \
            f"rank {r}: selection of shape {tuple(sel.values.shape)}"
        for q in range(world):
            assert sorted(sel.index[q].tolist()) == list(range(width)), \
                f"rank {r}, block {q}: positions {sel.index[q].tolist()} are not all of the block"
            assert torch.all(sel.values[q] == total), \
                f"P={world}, rank {r}, block {q}: values {sel.values[q].tolist()}, expected {total}"
        assert torch.count_nonzero(blocks[r]) == 0, f"rank {r}: with k = B everything is sent, residual not zero"


@pytest.mark.parametrize("world, teams", [(4, 2), (6, 3), (8, 4), (9, 3), (6, 6)])
def test_spardl_teams_sum_every_contribution_exactly_when_nothing_is_dropped(world, teams):
    size, width = world // teams, 3
    blocks = [torch.full((size, width), 2.0 ** r, dtype=torch.float64) for r in range(world)]
    total = float(sum(2 ** r for r in range(world)))
    results = _run_spardl(blocks, teams=teams, k=width, h=width)
    for r, sel in enumerate(results):
        assert sel.valid is not None and bool(sel.valid.all()), f"rank {r}: every entry should be valid"
        assert torch.all(sel.values == total), f"P={world}, teams={teams}, rank {r}: values {sel.values.tolist()}"
        assert int(sel.union) == width, f"rank {r}: union of {int(sel.union)}, expected {width}"


@pytest.mark.parametrize("world, teams", [(4, 2), (4, 4), (6, 2), (6, 3), (6, 6), (8, 2), (8, 4), (8, 8), (9, 3),
                                          (9, 9)])
def test_spardl_teams_agree_on_the_selection(world, teams):
    size, width, k, h = world // teams, 8, 3, 2
    g = torch.Generator().manual_seed(world * 100 + teams)
    blocks = [torch.randn(size, width, generator=g, dtype=torch.float64) for _ in range(world)]
    results = _run_spardl(blocks, teams=teams, k=k, h=h)
    first = results[0]
    for r, sel in enumerate(results):
        assert torch.equal(sel.index, first.index), f"rank {r}: index differs from rank 0's"
        assert torch.equal(sel.values, first.values), f"rank {r}: values differ from rank 0's"
        assert torch.equal(sel.valid, first.valid), f"rank {r}: valid differs from rank 0's"
        assert sel.valid.dtype == torch.bool and sel.valid.shape == (size, k), f"rank {r}: valid {sel.valid}"
    valid = first.valid
    counts = valid.sum(dim=1)
    assert bool((counts <= k).all()) and bool((counts >= 1).all()), f"valid counts {counts.tolist()} out of range"
    prefix = torch.arange(k)[None, :] < counts[:, None]
    assert torch.equal(valid, prefix), f"valid entries do not come first: {valid.tolist()}"
    assert bool((first.values[~valid] == 0).all()), "padding entries must carry value 0"
    for q in range(size):
        pos = first.index[q][valid[q]].tolist()
        assert len(set(pos)) == len(pos) and all(0 <= p < width for p in pos), f"block {q}: positions {pos}"


@pytest.mark.parametrize("size", range(1, 18))
def test_bruck_allgather_gathers_every_member_in_order(size):
    results = run_locally([bruck_allgather([torch.tensor([[m]])], m, size, lambda x: x) for m in range(size)])
    expected = torch.arange(size)[:, None]
    for m, out in enumerate(results):
        assert torch.equal(out[0], expected), f"size {size}, member {m}: got {out[0].reshape(-1).tolist()}"


# ---- gTop-k -----------------------------------------------------------------------------------------------

def _sparse(draw_positions, draw_values):
    return torch.tensor(draw_positions, dtype=torch.int64), torch.tensor(draw_values, dtype=torch.float64)


@st.composite
def _two_sets(draw):
    width = draw(st.integers(1, 24))
    k = draw(st.integers(1, width))
    sets = []
    for _ in range(2):
        pos = draw(st.permutations(range(width)))[:k]
        vals = draw(st.lists(st.integers(-9, 9).filter(bool), min_size=k, max_size=k))
        sets.append(_sparse(pos, [float(v) for v in vals]))
    return width, k, sets


@SETTINGS
@given(case=_two_sets())
def test_merge_top_keeps_a_top_k_of_the_sum(case):
    width, k, ((ia, va), (ib, vb)) = case
    dense = torch.zeros(width, dtype=torch.float64)
    dense.index_add_(0, ia, va)
    dense.index_add_(0, ib, vb)
    union = set(ia.tolist()) | set(ib.tolist())

    index, values = merge_top(ia, va, ib, vb, k)

    kept = index.tolist()
    assert len(kept) == k and len(set(kept)) == k, f"kept positions {kept} are not k={k} distinct ones"
    assert set(kept) <= union, f"kept positions {kept} outside the union {sorted(union)}"
    assert torch.equal(values, dense[index]), f"values {values.tolist()} are not the sums {dense[index].tolist()}"
    dropped = union - set(kept)
    if dropped:
        smallest_kept = dense[index].abs().min().item()
        largest_dropped = max(abs(dense[p].item()) for p in dropped)
        assert smallest_kept >= largest_dropped, \
            f"dropped |{largest_dropped}| while keeping |{smallest_kept}|: not a top-{k}"


def test_merge_top_distinct_magnitudes_matches_reference():
    ia, va = _sparse([0, 1, 2, 3], [5.0, -1.0, 2.0, 7.0])
    ib, vb = _sparse([2, 3, 4, 5], [2.5, -13.0, -3.0, 0.5])
    index, values = merge_top(ia, va, ib, vb, 3)
    # sums: 0:5, 1:-1, 2:4.5, 3:-6, 4:-3, 5:0.5 -> top 3 by magnitude: 3, 0, 2
    got = dict(zip(index.tolist(), values.tolist()))
    assert got == {3: -6.0, 0: 5.0, 2: 4.5}, f"merge_top kept {got}"


def _gtopk_inputs(world, width, k, seed):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(world):
        pos = torch.randperm(width, generator=g)[:k]
        vals = torch.randint(-50, 51, (k,), generator=g).to(torch.float64)
        out.append((pos, vals))
    return out


@pytest.mark.parametrize("world", range(1, 10))
def test_gtopk_program_every_rank_gets_the_same_set(world):
    width, k = 20, 4
    inputs = _gtopk_inputs(world, width, k, seed=world)
    results = run_locally([tree_program(i.clone(), v.clone(), r, world, width) for r, (i, v) in enumerate(inputs)])
    index0, values0 = results[0]
    assert index0.numel() == k and len(set(index0.tolist())) == k, f"rank 0 kept {index0.tolist()}"
    union = set().union(*(set(i.tolist()) for i, _ in inputs))
    assert set(index0.tolist()) <= union, f"kept positions {index0.tolist()} were never proposed"
    for r, (index, values) in enumerate(results):
        assert torch.equal(index, index0) and torch.equal(values, values0), \
            f"P={world}: rank {r} ended with {index.tolist()}/{values.tolist()}, rank 0 with {index0.tolist()}"
    if world == 1:
        assert torch.equal(index0, inputs[0][0]) and torch.equal(values0, inputs[0][1]), "one rank keeps its own set"
    if world == 2:
        (ia, va), (ib, vb) = inputs
        ref_index, ref_values = merge_top(ia, va, ib, vb, k)
        assert torch.equal(index0, ref_index) and torch.equal(values0, ref_values), \
            "P=2: the result should be merge_top of both ranks' sets"


@pytest.mark.parametrize("wire", [SparseWire("raw"), SparseWire("coded"), SparseWire("coded", "bf16")])
def test_gtopk_program_ends_with_rank_0s_message_on_every_rank(wire):
    """Positions come back int64 whatever the wire; every rank holds the bits rank 0 sent (narrow values rounded
    alike everywhere, rank 0 too)."""
    world, width, k = 5, 16, 3
    inputs = _gtopk_inputs(world, width, k, seed=7)
    results = run_locally([tree_program(i, v, r, world, width, wire) for r, (i, v) in enumerate(inputs)])
    for r, (index, values) in enumerate(results):
        assert index.dtype == torch.int64, f"rank {r}: index dtype {index.dtype}"
        assert torch.equal(index, results[0][0]) and torch.equal(values, results[0][1]), f"rank {r} disagrees"
