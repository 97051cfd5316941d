"""A method as every state sees it (``MethodUnit``), the method made of the three parts of ``gcomp.core``
(``Method``: almost every registered one) with the one pipeline for a DDP bucket and for FSDP2's rows, and the
method made of methods (``Composite``: ``hierarchical``, ``prunex``, ``auto``)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.collectives.launch import side_stream, then_on, timed
from gcomp.core import ALLGATHER, Checkpointed, Communicator, Compressor, Keeps, LayoutState, Memory, Payload
from gcomp.sharding import ShardLayout


class MethodUnit(Checkpointed, ABC):
    """A configured method, as the DDP hook, FSDP2's and HSDP's states, DiLoCo and the composites see it.

    Traits: ``collective`` (None for a composite that picks a method per bucket), ``lossless``, ``stateful`` (it
    keeps state per bucket layout: the hook waits for DDP's final buckets), ``reads_model``, ``decodes_alone``,
    ``depends_on_layout``, ``error_feedback`` (it holds back what it did not send), ``stat_keys``, ``host_syncs``,
    ``serves_fsdp`` (it reduces FSDP2's rows). Calls: ``watch(ddp)`` at install, ``bind`` and the install flags
    when the state joins its group, ``reduce`` per bucket, ``flush`` when ``auto`` switches, and the checkpoint
    protocol of ``gcomp.core.Checkpointed``."""

    name: str = "custom"
    params: dict
    collective: str | None = None
    lossless: bool = False
    stateful: bool = False
    reads_model: bool = False
    decodes_alone: bool = True
    depends_on_layout: bool = False
    error_feedback: bool = False
    stat_keys: tuple[str, ...] = ()
    host_syncs: int = 0
    serves_fsdp: bool = False

    def watch(self, ddp: torch.nn.Module) -> None:
        """The DDP model, when installed on one, before ``bind``."""

    def bind(self, model: torch.nn.Module | None, group: dist.ProcessGroup | None, stats: dict) -> None:
        """Once, when the state joins its group: the model (None when unknown), the group, the state's stats."""

    def install_flags(self) -> torch.Tensor | None:
        """int64 flags the state MAX all-reduces over the group once, right after ``bind`` (a method never calls a
        collective); None for none. Whether it returns flags must not depend on the rank or the model."""
        return None

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        """The MAX over the ranks of ``install_flags``, the same on every rank."""

    @abstractmethod
    def reduce(self, buffer: torch.Tensor, layout, group: dist.ProcessGroup | None, stats: dict
               ) -> torch.futures.Future:
        """The mean over ``group`` of the flat ``buffer`` (already divided by the world size) laid out by
        ``layout`` (a ``BucketInfo``; a ``ShardLayout`` under FSDP2, whose result is this rank's row): a future.
        Adds ``encode_s``, ``bytes_sent``, ``decode_s`` and its own counters to ``stats``."""

    def flush(self, bucket: BucketInfo, like: torch.Tensor) -> torch.Tensor | None:
        """The gradient it holds back for ``bucket`` (flat, laid out like it), removed; None when none."""
        return None


@dataclass(eq=False)
class Method(MethodUnit):
    """A ``Compressor``, a ``Memory`` and a ``Communicator``, and the name and parameters it was created with. On the
    wire and by which collective: the compressor's docstring (``gcomp describe NAME``)."""

    compressor: Compressor
    memory: Memory
    communicator: Communicator
    name: str = "custom"
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        traits, comm = self.compressor.traits, self.communicator
        if not isinstance(self.compressor, comm.codec) or traits.collective != comm.collective:
            raise TypeError(f"{self.name}: {type(comm).__name__} runs '{comm.collective}' and takes a "
                            f"{comm.codec.__name__}; {type(self.compressor).__name__} is a "
                            f"'{traits.collective}' codec{'' if isinstance(self.compressor, comm.codec) else ' of another protocol'}")
        self._slots = LayoutState(traits.slots, owner=type(self.compressor).__name__) if traits.slots else None

    @property
    def traits(self):
        return self.compressor.traits

    @property
    def collective(self) -> str:
        return self.communicator.collective

    @property
    def lossless(self) -> bool:
        return self.traits.lossless

    @property
    def stateful(self) -> bool:
        return self.memory.stateful or bool(self.traits.slots) or self.traits.keeps is Keeps.LAYOUT

    @property
    def error_feedback(self) -> bool:
        return self.memory.stateful or bool(self.traits.held)

    @property
    def reads_model(self) -> bool:
        return self.traits.reads_model

    @property
    def decodes_alone(self) -> bool:
        return self.traits.decodes_alone

    @property
    def depends_on_layout(self) -> bool:
        return self.traits.depends_on_layout

    @property
    def host_syncs(self) -> int:
        return self.traits.host_syncs + self.communicator.host_syncs

    @property
    def stat_keys(self) -> tuple[str, ...]:
        keys = self.traits.stat_keys
        return keys + tuple(k for k in self.communicator.stat_keys if k not in keys)

    @property
    def serves_fsdp(self) -> bool:
        return self.traits.rows is not None and self.communicator.rows

    def bind(self, model, group, stats) -> None:
        self.compressor.bind(model, group, stats)

    # --- the pipeline ---------------------------------------------------------------------------------------------

    def reduce(self, buffer, layout, group, stats):
        """Compensate, encode, keep the residual, exchange, decode (``gcomp.core``'s pipeline); on CUDA with the
        codec stream on (``gcomp.collectives.launch.codec_stream``), encode and decode on that stream."""
        side = side_stream(buffer) if buffer.is_cuda else None
        if side is not None:
            return self._reduce_beside(side, buffer, layout, group, stats)
        payload = self._send(buffer, layout, stats)
        future = self.communicator.exchange(payload, self.compressor, group, stats)

        def decode(done: torch.futures.Future) -> torch.Tensor:
            with timed(stats, "decode_s"):
                return self._decode(done.value(), payload, layout)

        return then_on(future, decode, buffer.device)

    def _send(self, buffer: torch.Tensor, layout, stats: dict) -> Payload:
        """The payload of ``buffer`` with its residual kept (timed as ``encode_s``; its bytes counted)."""
        rows = layout if isinstance(layout, ShardLayout) else None
        if rows is not None and not self.serves_fsdp:
            raise ValueError(f"{self.name} cannot serve FSDP2's reduce-scatter; the methods that can: "
                             "gcomp.available(fsdp=True)")
        bucket = rows.pieces if rows is not None else layout
        with timed(stats, "encode_s"):
            v = self.memory.compensate(buffer, bucket)
            state = self._slots.get(bucket, v) if self._slots is not None else {}
            payload, state = self._encode(v, state, rows if rows is not None else bucket)
            if self._slots is not None:
                self._slots.put(bucket, state)
            if self.memory.stateful:
                self.memory.update(v, bucket, self._residual(v, payload, rows))
        stats["bytes_sent"] += payload.nbytes
        return payload

    def _encode(self, v: torch.Tensor, state: dict, layout) -> tuple[Payload, dict]:
        """``Compressor.encode``, for FSDP2's rows as ``traits.rows`` says: each row encoded on its own and the
        payloads stacked row by row, the whole input viewed as rows, or the codec's own."""
        how = self.traits.rows
        if not isinstance(layout, ShardLayout) or how == "native":
            return self.compressor.encode(v, state, layout)
        world = layout.world
        if how == "whole":
            payload, state = self.compressor.encode(v, state, layout.pieces)
            payload.tensors = [t.view(world, -1) for t in payload.tensors]
            payload.rows = True
            return payload, state
        parts = [self.compressor.encode(v.view(world, -1)[r], {k: t.view(world, -1)[r] for k, t in state.items()},
                                        layout.row(r)) for r in range(world)]
        first = parts[0][0]
        residuals = [p.residual for p, _ in parts]
        payload = Payload([torch.stack(ts) for ts in zip(*(p.tensors for p, _ in parts))], EachRow([p.ctx for p, _ in parts]),
                          first.ops, first.whole, rows=True,
                          residual=None if residuals[0] is None else torch.cat([r.reshape(-1) for r in residuals]))
        return payload, {k: torch.cat([s[k].reshape(-1) for _, s in parts]) for k in state}

    def _own(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """A payload's tensors as the collective would deliver them from this rank alone."""
        return [t.unsqueeze(0) for t in tensors] if self.collective == ALLGATHER else list(tensors)

    def _residual(self, v: torch.Tensor, payload: Payload, rows: ShardLayout | None) -> torch.Tensor:
        """What ``payload`` does not carry of ``v``: the encode's own word, else ``v`` less the payload decoded."""
        if payload.residual is not None:
            return payload.residual
        decode = self.compressor.decode
        if rows is None or not isinstance(payload.ctx, EachRow):
            flat = payload.tensors if rows is None else [t.reshape(-1) for t in payload.tensors]
            return v.reshape(-1) - decode(self._own(flat), payload.ctx).reshape(-1)
        sent = [decode(self._own([t[r] for t in payload.tensors]), ctx).reshape(-1)
                for r, ctx in enumerate(payload.ctx.ctxs)]
        return v.reshape(-1) - torch.cat(sent)

    def _decode(self, received, payload: Payload, layout) -> torch.Tensor:
        ctx = payload.ctx
        if isinstance(ctx, EachRow):
            ctx = ctx.ctxs[layout.rank]
        return self.compressor.decode(received, ctx)

    def _reduce_beside(self, side, buffer, layout, group, stats):
        """``reduce`` with its encode and decode on the codec stream ``side``, ordered by events: the side stream
        waits for the bucket's producer; NCCL waits for the side stream; the decode waits for the collective's
        stream, which then waits for it; the result is recorded on the reader's stream."""
        device, reader = buffer.device, torch.cuda.current_stream(buffer.device)
        side.wait_stream(reader)
        with torch.cuda.stream(side):
            payload = self._send(buffer, layout, stats)
            exchanged = self.communicator.exchange(payload, self.compressor, group, stats)

        def decode(fut: torch.futures.Future) -> torch.Tensor:
            here = torch.cuda.current_stream(device)
            side.wait_stream(here)
            with torch.cuda.stream(side), timed(stats, "decode_s"):
                out = self._decode(fut.value(), payload, layout)
            here.wait_stream(side)
            out.record_stream(reader)
            return out

        return then_on(exchanged, decode, device)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, layout: ShardLayout,
                       group: dist.ProcessGroup, stats: dict) -> None:
        """FSDP2's reduce-scatter: ``reduce`` of the shard-major ``input`` (``layout``) into ``output``, this
        rank's shard; waits for it (FSDP reads the output when its call returns)."""
        output.view(-1).copy_(self.reduce(input, layout, group, stats).wait().reshape(-1))

    def flush(self, bucket, like):
        """What the memory and the compressor's held slots hold back for ``bucket``, summed; those slots start over."""
        held = self.memory.flush(bucket, like)
        found = self._slots.find(bucket, like) if self._slots is not None else None
        if found is not None:
            for slot in self.traits.held:
                held = found[slot].clone() if held is None else held.reshape(-1) + found[slot]
            self._slots.put(bucket, {k: torch.zeros_like(t) for k, t in found.items()})
        return held

    # --- checkpoints: {"memory": ..., "compressor": {its own state, its slots}} ----------------------------------

    def state_dict(self) -> dict:
        own = self.compressor.state_dict()
        return {"memory": self.memory.state_dict(),
                "compressor": own if self._slots is None else {**own, **self._slots.state_dict()}}

    def load_state_dict(self, state: dict) -> None:
        from gcomp.state_checks import check_state
        check_state(self.name, state, {"memory": dict, "compressor": dict})
        own, slots = self._split(state["compressor"])
        self.memory.load_state_dict(state["memory"])
        if self._slots is not None:
            self._slots.load_state_dict(slots)
        self.compressor.load_state_dict(own)

    def _split(self, state: dict) -> tuple[dict, dict]:
        """A compressor state as its own state and its slots (gcomp 0.1 nested them under one key: ``"memory"``,
        the point-to-point codecs' residuals; ``"owner"``, fp8/mx's owner error: read as the slots, the same dicts)."""
        slots = self.traits.slots
        if slots and not set(slots) & set(state):
            nested = [k for k, v in state.items() if isinstance(v, dict) and set(slots) <= set(v)]
            if nested:
                state = {**{k: v for k, v in state.items() if k != nested[0]}, **state[nested[0]]}
        return {k: v for k, v in state.items() if k not in slots}, {k: v for k, v in state.items() if k in slots}

    @property
    def keeps_state(self) -> bool:
        return self.memory.keeps_state or self.compressor.keeps_state or self._slots is not None

    @property
    def replicated(self) -> bool:
        return self.memory.replicated and self.compressor.replicated and self._slots is None

    def parameter_state(self, state: dict) -> dict:
        slots: dict = {}
        for key, part in (("memory", self.memory), ("compressor", self.compressor)):
            try:
                if key == "compressor":
                    mine, held = self._split(state[key])
                    own = {**part.parameter_state(mine), **{s: held[s] for s in self.traits.slots}}
                else:
                    own = part.parameter_state(state[key])
            except KeyError as err:
                raise ValueError(f"gcomp checkpoint: the {key} state of {self.name} ({type(part).__name__}) has no "
                                 f"{err.args[0]!r}") from err
            slots.update({f"{key} {slot}" if slot in slots else slot: tensors for slot, tensors in own.items()})
        return slots

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        from gcomp.state_checks import sum_by_name
        memory = self.memory.merge_states([s["memory"] for s in assigned], [s["memory"] for s in every], rank)
        split = [[self._split(s["compressor"]) for s in states] for states in (assigned, every)]
        own = self.compressor.merge_states([o for o, _ in split[0]], [o for o, _ in split[1]], rank)
        slots = {slot: sum_by_name([s[slot] for _, s in split[0]]) for slot in self.traits.slots}
        return {"memory": memory, "compressor": {**own, **slots}}


@dataclass
class EachRow:
    """The contexts of a rows payload whose rows were encoded one by one (``Traits.rows == "each"``)."""

    ctxs: list


def _over_parts(trait: str, combine) -> property:
    """A composite's ``trait``, ``combine`` (``all``, ``any``, ``sum``) of its parts' own."""
    return property(lambda self: combine(getattr(p, trait) for p in self.parts))


class Composite(MethodUnit):
    """A method whose ``parts`` are methods: lossless when all are, stateful (reading the model, depending on the
    layout, holding back gradient) when any is, decoded alone when all are, replicated when all are. A subclass
    says how a bucket goes through its parts (``reduce``) and how their states are filed."""

    @property
    @abstractmethod
    def parts(self) -> list[MethodUnit]:
        """The methods it is made of."""

    # each trait follows from the parts': all of them, any of them, or their sum
    decodes_alone = _over_parts("decodes_alone", all)
    lossless = _over_parts("lossless", all)
    replicated = _over_parts("replicated", all)
    stateful = _over_parts("stateful", any)
    reads_model = _over_parts("reads_model", any)
    depends_on_layout = _over_parts("depends_on_layout", any)
    error_feedback = _over_parts("error_feedback", any)
    keeps_state = _over_parts("keeps_state", any)
    host_syncs = _over_parts("host_syncs", sum)

    def watch(self, ddp) -> None:
        for part in self.parts:
            part.watch(ddp)
