"""The one method unit and its parts: every state talks to ``MethodUnit`` only; a compressor is a small pure pair
with declared traits; a communicator calls only what its codec protocol declares; composites are units made of
units; FSDP2 capability follows from the codec; checkpoints of the earlier format still load."""
from __future__ import annotations

import ast
import inspect
import io
import textwrap

import pytest
import torch
import torch.distributed as dist

import gcomp
import gcomp.collectives.gather
import gcomp.collectives.program
import gcomp.collectives.reduce
import gcomp.collectives.sized
import gcomp.collectives.two_phase
from gcomp import checkpoint
from gcomp.core import COLLECTIVES, Communicator, Compressor
from gcomp.fsdp import FSDPState, ReplicaState
from gcomp.hook import HookState
from gcomp.method import Composite
from gcomp.run_state import RunState
from gcomp.sharding import ShardLayout
from tests.distributed import run_ranks
from tests.models import ddp, mlp, train

# what a method author may define on a compressor: the ceiling is 8
AUTHOR_MEMBERS = {"traits", "encode", "decode", "bind", "state_dict", "load_state_dict", "merge_states"}
COMMUNICATORS = [gcomp.collectives.reduce.AllreduceCommunicator, gcomp.collectives.reduce.ChainedAllreduceCommunicator,
                 gcomp.collectives.gather.AllgatherCommunicator, gcomp.collectives.two_phase.TwoPhaseCommunicator,
                 gcomp.collectives.sized.SizedAllgatherCommunicator, gcomp.collectives.program.ProgramCommunicator]


def test_a_compressor_has_at_most_eight_members_an_author_defines():
    base = {name for name in vars(Compressor) if not name.startswith("_")} | {
        name for name in vars(gcomp.core.Checkpointed) if not name.startswith("_")}
    derived = {"keeps_state", "replicated", "parameter_state"}  # follow from traits; not for authors to define
    assert base - derived == AUTHOR_MEMBERS and len(AUTHOR_MEMBERS) <= 8
    for name in gcomp.available():
        method = gcomp.create(name)
        if isinstance(method, gcomp.Method):
            cls = type(method.compressor)
            extra = {n for klass in cls.__mro__[:cls.__mro__.index(Compressor)] for n in vars(klass)
                     if n in derived}
            assert not extra, f"{name}: {cls.__name__} overrides {extra}, which follow from its traits"


@pytest.mark.parametrize("communicator", COMMUNICATORS, ids=lambda c: c.__name__)
def test_a_communicator_calls_only_what_its_codec_protocol_declares(communicator):
    called = set()
    for klass in communicator.__mro__:
        if klass is object or not issubclass(klass, Communicator):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        called |= {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
                   and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                   and node.func.value.id == "compressor"}
    missing = {name for name in called if not hasattr(communicator.codec, name)}
    assert not missing, f"{communicator.__name__} calls {missing}, which {communicator.codec.__name__} lacks"


class _Plain(Compressor):
    """A bare all-reduce codec, for the checks below."""

    def encode(self, x, state, layout):
        return gcomp.Payload([x]), state

    def decode(self, received, ctx):
        return received[0]


def test_a_communicator_refuses_a_codec_of_another_protocol_or_collective():
    with pytest.raises(TypeError, match="takes a ChainedCompressor"):
        gcomp.Method(_Plain(), gcomp.NoMemory(), gcomp.collectives.reduce.ChainedAllreduceCommunicator())
    with pytest.raises(TypeError, match="'allreduce' codec"):
        gcomp.Method(_Plain(), gcomp.NoMemory(), gcomp.collectives.gather.AllgatherCommunicator())


def test_every_registered_method_is_a_unit_and_composites_pass_no_tensor_through():
    for name in gcomp.available():
        method = gcomp.create(name)
        assert isinstance(method, gcomp.MethodUnit), name
        assert method.collective in COLLECTIVES or isinstance(method, Composite), (name, method.collective)
        if isinstance(method, Composite):
            assert not isinstance(method, gcomp.Method) and not hasattr(method, "compressor"), name


def test_the_three_states_share_one_run_state():
    for cls in (HookState, FSDPState, ReplicaState):
        assert issubclass(cls, RunState)
        for name in ("state_dict", "gather_state_dict", "load_state_dict", "join", "count_step"):
            assert name not in vars(cls), f"{cls.__name__} redefines {name}"


def test_fsdp_capability_follows_from_the_codec():
    for name in gcomp.available():
        method, text = gcomp.create(name), gcomp.describe(name)
        serves = isinstance(method, gcomp.Method) and method.traits.rows is not None and method.communicator.rows
        assert (name in gcomp.available(fsdp=True)) == serves == method.serves_fsdp, name
        assert ("FSDP2: serves fully_shard's reduce-scatter" in text) == serves, name
    assert {"identity", "fp16", "bf16"} <= set(gcomp.available(fsdp=True))


class _Signs(Compressor):
    """Signs and one scale per payload, by all-gather: a codec built by hand."""

    traits = gcomp.Traits(collective=gcomp.ALLGATHER, fidelity=gcomp.contraction())

    def encode(self, x, state, layout):
        return gcomp.Payload([x >= 0, x.abs().mean().reshape(1)]), state

    def decode(self, received, ctx):
        signs, scales = received
        return torch.where(signs, scales, -scales).sum(0)


def _rows_of_a_hand_built_method(world_rank_input) -> dict:
    """One reduce-scatter call of FSDP's rows through a hand-built all-gather method with error feedback."""
    layout = ShardLayout(0, ("a", "b"), (torch.Size([6, 2]), torch.Size([5])), dist.get_world_size(),
                         dist.get_rank(), torch.float32)
    method = gcomp.Method(_Signs(), gcomp.ResidualMemory(), gcomp.collectives.gather.AllgatherCommunicator())
    stats = {k: 0 for k in ("bytes_sent", "encode_s", "decode_s")}
    inputs = [torch.randn(layout.numel, generator=torch.Generator().manual_seed(r)) for r in range(layout.world)]
    out = torch.empty(layout.shard_numel)
    method.reduce_scatter(out, inputs[layout.rank].clone(), layout, dist.group.WORLD, stats)
    rows = [x.view(layout.world, -1)[layout.rank] for x in inputs]
    expected = sum(torch.where(r >= 0, r.abs().mean(), -r.abs().mean()) for r in rows)
    residual = method.memory.compensate(torch.zeros(layout.numel), layout.pieces)
    sent = torch.cat([torch.where(r >= 0, r.abs().mean(), -r.abs().mean())
                      for r in inputs[layout.rank].view(layout.world, -1)])
    return {"out": out, "expected": expected, "conserved": residual + sent, "input": inputs[layout.rank],
            "bytes": stats["bytes_sent"], "serves": method.serves_fsdp}


@pytest.mark.parametrize("world", [2, 3])
def test_a_hand_built_method_serves_fsdp_when_its_codec_does(world):
    for r in run_ranks(world, _rows_of_a_hand_built_method, None):
        assert r["serves"]
        torch.testing.assert_close(r["out"], r["expected"])  # each row encoded on its own, all-to-all, decoded
        torch.testing.assert_close(r["conserved"], r["input"])  # error feedback over every row of the input
        assert r["bytes"] == world * ((r["input"].numel() // world) + 4)  # per row: a bool each and one fp32


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
