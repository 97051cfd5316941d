"""The one method unit: every state talks to ``MethodUnit`` only; composites are units made of units; the run state
is written once; FSDP2 capability is declared at registration; checkpoints of the earlier format still load."""
from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist

import gcomp
import gcomp.core
import gcomp.pruning
import gcomp.sharding
from gcomp import checkpoint
from gcomp.auto.method import AutoMethod
from gcomp.composite import Composite
from gcomp.compressors.hierarchical import HierarchicalMethod
from gcomp.compressors.randomk import RandomKCompressor
from gcomp.fsdp import FSDPState, ReplicaState
from gcomp.hook import HookState
from gcomp.run_state import RunState
from gcomp.sharding import RowStrategy, ShardLayout
from tests.distributed import run_ranks
from tests.models import ddp, mlp, train

FSDP_METHODS = ["bf16", "fp16", "fp8", "identity", "mx", "pactrain", "randomk", "spardl"]


def test_every_registered_method_is_a_unit_and_composites_pass_no_tensor_through():
    for name in gcomp.available():
        method = gcomp.create(name)
        assert isinstance(method, gcomp.MethodUnit), name
        assert method.collective in gcomp.core.COLLECTIVES or isinstance(method, AutoMethod), (name, method.collective)
    for name in ("auto", "hierarchical", "prunex"):
        method = gcomp.create(name)
        assert isinstance(method, Composite) and not isinstance(method, gcomp.Method), name
        assert not hasattr(type(method), "compress") and not hasattr(type(method), "exchange"), name


def test_a_composite_takes_its_traits_from_its_parts():
    exact = gcomp.create("auto")  # identity (and pactrain on a pruned model): lossless
    assert exact.lossless and exact.stateful and exact.collective is None
    lossy = gcomp.create("auto", allow=["identity", "topk"])
    assert not lossy.lossless and lossy.error_feedback
    inner = gcomp.create("hierarchical", inner="topk:ratio=0.05")
    assert isinstance(inner, HierarchicalMethod) and inner.inner.name == "topk"
    assert not inner.lossless and inner.error_feedback and not inner.decodes_alone and inner.stateful
    assert inner.stat_keys[-2:] == ("inter_bytes", "inter_bytes_dense")
    with pytest.warns(DeprecationWarning, match="no compressor"):
        assert inner.compressor is inner  # what HierarchicalCompressor held is on the method now


def test_the_three_states_share_one_run_state():
    for cls in (HookState, FSDPState, ReplicaState):
        assert issubclass(cls, RunState)
        for name in ("state_dict", "gather_state_dict", "load_state_dict", "join", "count_step"):
            assert name not in vars(cls), f"{cls.__name__} redefines {name}"


def test_fsdp_capability_is_declared_at_registration():
    assert gcomp.available(fsdp=True) == FSDP_METHODS
    assert set(gcomp.available(fsdp=True)) < set(gcomp.available())
    for name in gcomp.available():
        method, text = gcomp.create(name), gcomp.describe(name)
        if name in FSDP_METHODS:
            assert isinstance(method.row_strategy, RowStrategy), name
            assert f"FSDP2: serves fully_shard's reduce-scatter ({type(method.row_strategy).__name__})" in text
        else:
            assert method.row_strategy is None and "FSDP2: no (DDP only)" in text, name


def test_a_method_registered_with_a_row_strategy_serves_fsdp(monkeypatch):
    saved = dict(gcomp.registry._REGISTRY)
    try:
        @gcomp.register("plain_rows_test", fsdp=gcomp.sharding.EntrywiseRows)
        def plain():
            return gcomp.create("identity")
        assert "plain_rows_test" in gcomp.available(fsdp=True)
        assert isinstance(gcomp.create("plain_rows_test").row_strategy, gcomp.sharding.EntrywiseRows)
    finally:
        gcomp.registry._REGISTRY.clear()
        gcomp.registry._REGISTRY.update(saved)


def test_randomk_rows_reuse_the_codec_and_its_memory_update():
    """One rank: FSDP's rows through the method's own compressor and memory, decoded to this rank's row; what was
    not sent is the residual, exactly (a lossless check of the rows layout without processes)."""
    layout = ShardLayout(0, ("a", "b"), (torch.Size([6, 2]), torch.Size([5])), 3, 1, torch.float64)
    method = gcomp.create("randomk", ratio=0.5, seed=4)
    x = torch.randn(layout.numel, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    compensated = method.memory.compensate(x.clone(), layout.pieces)
    payload = method.row_strategy.compress(method.compressor, compensated, layout)
    wire, = payload.tensors
    k = max(1, int(layout.shard_numel * 0.5))
    assert wire.shape == (3, k + 1) and not wire[:, -1].any()  # k values and the flag per destination row
    method.memory.update(compensated, layout.pieces, method.compressor, payload)
    out = torch.empty(layout.shard_numel, dtype=torch.float64)
    method.row_strategy.decode(method.compressor, [wire[1]], payload, layout, out)
    sent = method.compressor.decompress(payload.tensors, payload.ctx)
    assert torch.equal(out, sent.view(3, -1)[1])  # this rank's row of what it sent (one rank: its own sum)
    residual = method.memory.compensate(torch.zeros_like(x), layout.pieces)
    assert torch.equal(sent + residual, x)


def test_entrywise_rows_refuse_a_payload_that_is_not_entry_for_entry():
    layout = ShardLayout(0, ("a",), (torch.Size([8]),), 2, 0, torch.float32)
    with pytest.raises(RuntimeError, match="entry for entry"):
        gcomp.sharding.EntrywiseRows().compress(RandomKCompressor(0.25), torch.ones(8), layout)


def _parts_format(state: dict, method) -> dict:
    """``state`` (today's format) written as the second format did: each rank's part held the memory's and the
    compressor's states side by side (a composite's memory empty, its state the compressor's)."""
    ranks = {}
    for key, blob in state["ranks"].items():
        part = torch.load(io.BytesIO(blob), weights_only=True)
        own = part["method"]
        old = own if isinstance(method, gcomp.Method) else {"memory": {}, "compressor": own}
        ranks[key] = checkpoint.pack({"stats": part["stats"], **old})
    return {**state, "format": checkpoint.PARTS_FORMAT, "ranks": ranks}


def _resume_from_the_second_format(name: str) -> dict:
    model = ddp(mlp(0))
    state = gcomp.install(model, name)
    train(model, 3)
    saved = state.state_dict()
    old = _parts_format(saved, state.method)
    out = {}
    for label, checkpoint_state in (("today", saved), ("second", old)):
        fresh = gcomp.install(ddp(mlp(0)), name)
        fresh.load_state_dict(checkpoint_state)
        out[label] = fresh.state_dict()["ranks"][f"rank{dist.get_rank()}"]
    return out


@pytest.mark.parametrize("name", ["topk", "auto", "hierarchical"])
def test_a_checkpoint_of_the_second_format_loads_as_todays(name):
    for rank, r in enumerate(run_ranks(2, _resume_from_the_second_format, name)):
        today = torch.load(io.BytesIO(r["today"]), weights_only=True)
        second = torch.load(io.BytesIO(r["second"]), weights_only=True)
        assert repr(today["method"]) == repr(second["method"]), (rank, name)


def test_old_names_say_where_they_went():
    with pytest.raises(AttributeError, match="gcomp.Method"):
        gcomp.core.Method  # noqa: B018
    with pytest.raises(AttributeError, match="gcomp.packing.GroupSupport"):
        gcomp.pruning.GroupSupport  # noqa: B018
    with pytest.warns(DeprecationWarning, match="method_from"):
        assert gcomp.attach.make_method("topk", {"ratio": 0.1}).params["ratio"] == 0.1



def test_the_old_replicated_state_name_warns():
    with pytest.warns(DeprecationWarning, match="'replicated_state' is now 'replicated'"):
        class Shared(gcomp.Memory):
            replicated_state = True

            def compensate(self, tensor, bucket):
                return tensor

            def update(self, tensor, bucket, compressor, payload):
                pass
    assert Shared().replicated


def _install_by_old_keyword() -> str:
    model = ddp(mlp(0))
    with pytest.warns(DeprecationWarning, match="install\\(model="):
        state = gcomp.install(ddp_model=model, name_or_method="fp16")
    return state.method.name


def test_install_still_takes_its_old_keyword():
    assert run_ranks(1, _install_by_old_keyword) == ["fp16"]
