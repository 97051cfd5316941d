"""Error-feedback memories (``gcomp.memory``): ``ResidualMemory`` keeps its residuals per parameter, so they move
with their parameters to a new bucket layout (DDP's rebuild, a fresh DDP after a checkpoint) and a checkpoint
does not depend on how DDP grouped them. ``topk`` is the codec that leaves residuals here; conservation of every
error-feedback method is in tests/test_contracts.py."""
from __future__ import annotations

import copy

import pytest
import torch

from gcomp import BucketInfo, NoMemory, ResidualMemory
from gcomp.compressors.randomk import RandomKCompressor
from gcomp.compressors.topk import TopKCompressor


def test_no_memory_passes_the_gradient_through_and_keeps_nothing():
    memory, comp = NoMemory(), TopKCompressor(0.1)
    info = BucketInfo.from_layout(0, torch.float32, ["a"], [20])
    grad = torch.randn(20, generator=torch.Generator().manual_seed(0))
    assert memory.compensate(grad, info) is grad
    memory.update(grad, info, comp, comp.compress(grad, info))
    assert memory.compensate(grad, info) is grad and memory.state_dict() == {} and not memory.stateful


# --- residuals across a change of bucket layout -------------------------------------------------------------


def _warm_memory(ratio: float = 0.2):
    """A ResidualMemory with residuals in layout A: parameters a (30) and b (12) in one bucket."""
    comp, memory = TopKCompressor(ratio), ResidualMemory()
    layout_a = BucketInfo.from_layout(0, torch.float32, ["a", "b"], [30, 12])
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        grad = torch.randn(42, generator=g)
        v = memory.compensate(grad, layout_a)
        memory.update(v, layout_a, comp, comp.compress(v, layout_a))
    return memory, layout_a


def test_residual_state_dict_is_per_parameter_name():
    memory, layout_a = _warm_memory()
    state = memory.state_dict()
    assert set(state) == {"residuals"}
    residuals = state["residuals"]
    assert set(residuals) == {"a", "b"}
    assert residuals["a"].numel() == 30 and residuals["b"].numel() == 12
    whole = memory.compensate(torch.zeros(42), layout_a)
    assert torch.equal(whole, torch.cat([residuals["a"], residuals["b"]]))
    assert residuals["a"].count_nonzero() > 0 and residuals["b"].count_nonzero() > 0


def _layout_b(kind: str) -> list[BucketInfo]:
    if kind == "reversed":
        return [BucketInfo.from_layout(0, torch.float32, ["b", "a"], [12, 30])]
    if kind == "split":
        return [BucketInfo.from_layout(0, torch.float32, ["b"], [12]),
                BucketInfo.from_layout(1, torch.float32, ["a"], [30])]
    assert kind == "with-new-parameter"
    return [BucketInfo.from_layout(0, torch.float32, ["c", "a"], [5, 30]),
            BucketInfo.from_layout(1, torch.float32, ["b"], [12])]


@pytest.mark.parametrize("via_checkpoint", [False, True], ids=["live", "checkpoint"])
@pytest.mark.parametrize("kind", ["reversed", "split", "with-new-parameter"])
def test_residuals_move_to_a_new_layout_parameter_by_parameter(kind, via_checkpoint):
    memory, _ = _warm_memory()
    before = {name: t.clone() for name, t in memory.state_dict()["residuals"].items()}
    if via_checkpoint:
        state = memory.state_dict()
        memory = ResidualMemory()
        memory.load_state_dict(state)

    comp = TopKCompressor(0.2)
    for info in _layout_b(kind):
        compensated = memory.compensate(torch.zeros(info.numel), info)
        for name, offset, numel in info.segments():
            expected = before.get(name, torch.zeros(numel))
            assert torch.equal(compensated[offset:offset + numel], expected), name
        memory.update(compensated, info, comp, comp.compress(compensated, info))

    # the residuals are now keyed by the new layout's parameters, the old ones included
    after = memory.state_dict()["residuals"]
    assert set(after) == {info_name for info in _layout_b(kind) for info_name in info.names}
    assert set(before) <= set(after)


def test_residuals_survive_a_real_ddp_rebuild_like_sequence():
    """Layout A, then B, then A again: each move keeps every parameter's residual exactly."""
    memory, layout_a = _warm_memory(ratio=0.1)
    comp = TopKCompressor(0.1)
    g = torch.Generator().manual_seed(11)
    layouts = [_layout_b("split"), [layout_a], _layout_b("reversed")]
    for buckets in layouts:
        before = {name: t.clone() for name, t in memory.state_dict()["residuals"].items()}
        for info in buckets:
            grad = torch.randn(info.numel, generator=g)
            v = memory.compensate(grad, info)
            for name, offset, numel in info.segments():
                assert torch.equal(v[offset:offset + numel], grad[offset:offset + numel] + before[name])
            payload = comp.compress(v, info)
            memory.update(v, info, comp, payload)
            sent = comp.decompress(payload.tensors, payload.ctx)
            after = memory.state_dict()["residuals"]
            for name, offset, numel in info.segments():
                assert torch.equal(sent[offset:offset + numel] + after[name], v[offset:offset + numel])


# --- the compensated buffer and the codec's fast update -----------------------------------------------------


def test_compensate_writes_into_one_buffer_per_layout_unless_it_is_still_held():
    memory, layout_a = _warm_memory()
    grad = torch.randn(42)
    first = memory.compensate(grad, layout_a)
    ptr, expected = first.data_ptr(), first.clone()
    second = memory.compensate(grad, layout_a)  # ``first`` is still held: a buffer of its own
    assert second.data_ptr() != ptr and torch.equal(first, expected) and torch.equal(second, expected)
    del first, second
    again = memory.compensate(grad, layout_a)
    assert torch.equal(again, expected)
    kept = {again.data_ptr()}
    del again
    assert memory.compensate(grad, layout_a).data_ptr() in kept  # the same buffer, step after step


class _Decoding(TopKCompressor):
    """Top-k without the fast update: the memory decodes the payload."""

    def residual_into(self, out, tensor, payload):
        return False


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_residual_into_leaves_exactly_what_decoding_leaves(dtype):
    """The sparse codecs' ``residual_into`` (copy, then the sent entries subtracted) against the general path
    (decompress, subtract), non-finite entries included: the same residuals bit for bit."""
    fast, slow = ResidualMemory(), ResidualMemory()
    comp, decoding = TopKCompressor(0.1), _Decoding(0.1)
    info = BucketInfo.from_layout(0, dtype, ["a", "b"], [300, 57])
    g = torch.Generator().manual_seed(12)
    for step in range(5):
        grad = torch.randn(info.numel, generator=g, dtype=torch.float64).to(dtype)
        if step == 3:  # more non-finite entries than k: some are sent, the rest must be dropped
            grad[torch.randperm(info.numel, generator=g)[:60]] = float("nan")
            grad[:5] = float("inf")
        for memory, c in ((fast, comp), (slow, decoding)):
            v = memory.compensate(grad, info)
            memory.update(v, info, c, c.compress(v, info))
        a, b = (m.compensate(torch.zeros_like(grad), info) for m in (fast, slow))
        assert torch.equal(a, b) and a.isfinite().all(), f"step {step}"


# --- the compensated bucket kept as the residual (``Compressor.sent_positions``: randomk on a CPU) -----------------


class _Counting(RandomKCompressor):
    """randomk counting the memory's calls of its slower update paths."""

    def __init__(self, ratio, seed=0):
        super().__init__(ratio, seed)
        self.calls = {"residual_into": 0, "decompress": 0}

    def residual_into(self, out, tensor, payload):
        self.calls["residual_into"] += 1
        return super().residual_into(out, tensor, payload)

    def decompress(self, tensors, ctx):
        self.calls["decompress"] += 1
        return super().decompress(tensors, ctx)


def _step(memory, comp, grad, info):
    v = memory.compensate(grad, info)
    payload = comp.compress(v, info)
    memory.update(v, info, comp, payload)
    return v, payload


def _residual(memory, info, dtype=torch.float32):
    return copy.deepcopy(memory).compensate(torch.zeros(info.numel, dtype=dtype), info)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_a_finite_bucket_leaves_its_compensated_buffer_as_the_residual_with_no_pass(dtype):
    """No residual_into, no decode: the two kept buffers take the residual and the next sum in turn, and
    conservation stays exact: decoded payload + new residual == v, v unchanged by the update."""
    memory, comp = ResidualMemory(), _Counting(0.1)
    info = BucketInfo.from_layout(0, dtype, ["a", "b"], [300, 57])
    g = torch.Generator().manual_seed(2)
    _step(memory, comp, torch.randn(info.numel, generator=g).to(dtype), info)  # the first: no residual yet
    pointers = []
    for step in range(6):
        grad = torch.randn(info.numel, generator=g, dtype=torch.float64).to(dtype)
        old = _residual(memory, info, dtype)
        v, payload = _step(memory, comp, grad, info)
        before = v.clone()
        assert torch.equal(v, grad + old), step
        new = _residual(memory, info, dtype)
        assert torch.equal(comp.decompress(payload.tensors, payload.ctx) + new, v) and torch.equal(v, before)
        assert new[payload.ctx.index].count_nonzero() == 0 and new.count_nonzero() > 0.8 * info.numel
        pointers.append(v.data_ptr())
        del v
    assert comp.calls == {"residual_into": 1, "decompress": 6}  # the first step's update; the checks' decodes
    assert len(set(pointers)) == 2 and pointers[0::2] == [pointers[0]] * 3  # two buffers, in turn


def test_a_held_compensated_bucket_is_never_written_by_later_steps_checkpoints_or_layouts():
    """v handed out, kept as the residual, and still held by the caller: a second compensate, a non-finite
    step (the residual written over: into a fresh tensor, v is held), a checkpoint and a new layout all leave it
    as it was, and each of them sees the residual with the sent entries at zero."""
    memory, comp = ResidualMemory(), RandomKCompressor(0.1)
    info = BucketInfo.from_layout(0, torch.float32, ["a", "b"], [300, 57])
    g = torch.Generator().manual_seed(5)
    _step(memory, comp, torch.randn(info.numel, generator=g), info)
    v, payload = _step(memory, comp, torch.randn(info.numel, generator=g), info)
    held, sent = v.clone(), comp.decompress(payload.tensors, payload.ctx)
    residual = v - sent
    grad = torch.randn(info.numel, generator=g)
    a, b = memory.compensate(grad, info), memory.compensate(grad, info)  # twice: both the gradient + residual
    assert torch.equal(a, grad + residual) and torch.equal(b, grad + residual) and torch.equal(v, held)
    del a, b

    state = memory.state_dict()["residuals"]  # per parameter, the zeros written in
    assert torch.equal(torch.cat([state["a"], state["b"]]), residual) and torch.equal(v, held)

    bad = torch.randn(info.numel, generator=g)
    bad[3] = float("nan")
    w, payload = _step(memory, comp, bad, info)  # not finite: the residual is written over, not v
    assert comp.sent_positions(payload) is None and torch.equal(v, held)
    after = _residual(memory, info)
    expected = torch.nan_to_num(w - comp.decompress(payload.tensors, payload.ctx), nan=0.0, posinf=0.0,
                                neginf=0.0)
    assert torch.equal(after, expected) and after.isfinite().all()

    u, payload = _step(memory, comp, torch.randn(info.numel, generator=g), info)  # finite again: u kept
    kept = u - comp.decompress(payload.tensors, payload.ctx)
    layout = BucketInfo.from_layout(0, torch.float32, ["b", "a"], [57, 300])  # DDP's rebuild
    moved = memory.compensate(torch.zeros(layout.numel), layout)
    assert torch.equal(moved, torch.cat([kept[300:], kept[:300]])) and torch.equal(v, held)


def test_checkpointed_residuals_resume_with_the_sent_entries_at_zero():
    memory, comp = ResidualMemory(), RandomKCompressor(0.2, 1)
    info = BucketInfo.from_layout(0, torch.float32, ["a"], [200])
    g = torch.Generator().manual_seed(8)
    for _ in range(3):
        v, payload = _step(memory, comp, torch.randn(info.numel, generator=g), info)
    expected = v - comp.decompress(payload.tensors, payload.ctx)
    resumed = ResidualMemory()
    resumed.load_state_dict(memory.state_dict())
    assert torch.equal(resumed.compensate(torch.zeros(info.numel), info), expected)
    assert torch.equal(memory.compensate(torch.zeros(info.numel), info), expected)
