"""Error feedback in the pipeline (``gcomp.core.ResidualMemory``, ``Method``): the residual is what the payload does
not carry, kept per parameter, so it moves with its parameters to a new bucket layout (DDP's rebuild, a fresh DDP
after a checkpoint) and a checkpoint does not depend on how DDP grouped them; a codec that knows its residual hands
it over (``Payload.residual``) and leaves exactly what decoding would; non-finite residual entries are dropped.
Conservation of every error-feedback method is in tests/test_contracts.py."""
from __future__ import annotations

import pytest
import torch

from gcomp import BucketInfo, Compressor, Method, NoMemory, Payload, ResidualMemory, Traits, contraction
from gcomp.collectives import AllreduceCommunicator


class _Halves(Compressor):
    """Sends every other entry (the rest as zeros) by all-reduce; ``hand_over``: the residual in the payload."""

    traits = Traits(fidelity=contraction())

    def __init__(self, hand_over: bool = False):
        self.hand_over = hand_over

    def encode(self, x, state, layout):
        sent = x.clone()
        sent[1::2] = 0
        return Payload([sent], residual=x - sent if self.hand_over else None), state

    def decode(self, received, ctx):
        return received[0].clone()


def _method(hand_over: bool = False) -> Method:
    return Method(_Halves(hand_over), ResidualMemory(), AllreduceCommunicator())


def _step(method: Method, grad: torch.Tensor, info: BucketInfo) -> torch.Tensor:
    """One encode of ``grad`` with its residual kept (no collective: the payload decoded alone)."""
    payload = method._send(grad, info, {"bytes_sent": 0})
    return method.compressor.decode(payload.tensors, payload.ctx)


def _held(method: Method, info: BucketInfo) -> torch.Tensor:
    return method.memory.compensate(torch.zeros(info.numel), info)


def test_no_memory_passes_the_gradient_through_and_keeps_nothing():
    memory = NoMemory()
    info = BucketInfo.from_layout(0, torch.float32, ["a"], [20])
    grad = torch.randn(20, generator=torch.Generator().manual_seed(0))
    assert memory.compensate(grad, info) is grad
    memory.update(grad, info, torch.ones(20))
    assert memory.compensate(grad, info) is grad and memory.state_dict() == {} and not memory.stateful


def test_the_residual_is_what_the_payload_does_not_carry_and_a_handed_over_one_is_the_same():
    info = BucketInfo.from_layout(0, torch.float32, ["a", "b"], [30, 12])
    g = torch.Generator().manual_seed(3)
    decoding, handing = _method(), _method(hand_over=True)
    for _ in range(3):
        grad = torch.randn(42, generator=g)
        old = _held(decoding, info)
        sent = _step(decoding, grad, info)
        _step(handing, grad, info)
        assert torch.equal(sent + _held(decoding, info), grad + old)  # conservation, exactly
        assert torch.equal(_held(decoding, info), _held(handing, info))


def _warm(ratio_seed: int = 3) -> tuple[Method, BucketInfo]:
    """A method with residuals in layout A: parameters a (30) and b (12) in one bucket."""
    method = _method()
    layout_a = BucketInfo.from_layout(0, torch.float32, ["a", "b"], [30, 12])
    g = torch.Generator().manual_seed(ratio_seed)
    for _ in range(3):
        _step(method, torch.randn(42, generator=g), layout_a)
    return method, layout_a


def test_residual_state_dict_is_per_parameter_name():
    method, layout_a = _warm()
    state = method.memory.state_dict()
    assert set(state) == {"residuals"} and set(state["residuals"]) == {"a", "b"}
    residuals = state["residuals"]
    assert torch.equal(_held(method, layout_a), torch.cat([residuals["a"], residuals["b"]]))
    assert residuals["a"].count_nonzero() > 0 and residuals["b"].count_nonzero() > 0


def _layout_b(kind: str) -> list[BucketInfo]:
    if kind == "reversed":
        return [BucketInfo.from_layout(0, torch.float32, ["b", "a"], [12, 30])]
    if kind == "split":
        return [BucketInfo.from_layout(0, torch.float32, ["b"], [12]),
                BucketInfo.from_layout(1, torch.float32, ["a"], [30])]
    return [BucketInfo.from_layout(0, torch.float32, ["c", "a"], [5, 30]),
            BucketInfo.from_layout(1, torch.float32, ["b"], [12])]


@pytest.mark.parametrize("via_checkpoint", [False, True], ids=["live", "checkpoint"])
@pytest.mark.parametrize("kind", ["reversed", "split", "with-new-parameter"])
def test_residuals_move_to_a_new_layout_parameter_by_parameter(kind, via_checkpoint):
    method, _ = _warm()
    before = {name: t.clone() for name, t in method.memory.state_dict()["residuals"].items()}
    if via_checkpoint:
        state = method.state_dict()
        method = _method()
        method.load_state_dict(state)
    for info in _layout_b(kind):
        compensated = method.memory.compensate(torch.zeros(info.numel), info)
        for name, offset, numel in info.segments():
            assert torch.equal(compensated[offset:offset + numel], before.get(name, torch.zeros(numel))), name
        _step(method, torch.zeros(info.numel), info)
    after = method.memory.state_dict()["residuals"]
    assert set(after) == {name for info in _layout_b(kind) for name in info.names} and set(before) <= set(after)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_non_finite_residual_entries_are_dropped(dtype):
    method = _method()
    info = BucketInfo.from_layout(0, dtype, ["a"], [8])
    grad = torch.arange(8.0, dtype=dtype)
    grad[1], grad[3] = float("nan"), float("inf")
    _step(method, grad, info)
    held = method.memory.compensate(torch.zeros(8, dtype=dtype), info)
    assert held.isfinite().all() and held[1] == 0 and held[3] == 0 and held[5] == 5


def test_flush_hands_back_what_is_held_and_starts_over():
    method, layout_a = _warm()
    held = _held(method, layout_a)
    flushed = method.flush(layout_a, torch.zeros(42))
    assert torch.equal(flushed, held) and not _held(method, layout_a).any()
    assert _method().flush(layout_a, torch.zeros(42)) is None
