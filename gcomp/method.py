"""A method: ``MethodUnit``, the one protocol every state talks to, and ``Method``, the unit built from the three
parts of ``gcomp.core`` (almost every registered method is one).

The DDP hook (``gcomp.hook``), FSDP2's and HSDP's states (``gcomp.fsdp``) and the composites (``hierarchical``,
``prunex``, ``auto``, which are units made of other units) call a unit's methods and nothing else: bind it to a
model and a process group, run its install-time agreement, reduce a flat gradient, flush what it holds back,
checkpoint it. ``Method`` runs its parts in the one pipeline of ``gcomp.core``'s docstring, for a DDP bucket
(``reduce``) and for FSDP2's reduce-scatter (``reduce_scatter``, through the row strategy its registration
declares), each timed by ``gcomp.collectives.counting.timed``.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.collectives.counting import timed
from gcomp.core import Checkpointed, Communicator, Compressor, Memory
from gcomp.device_future import then_on
from gcomp.kernels import streams
from gcomp.sharding import RowStrategy, ShardLayout


class MethodUnit(Checkpointed, ABC):
    """A configured method, as every state sees it: traits, binding, one reduction, flush, checkpoints.

    Traits (read at install and by the contract suite, ``gcomp.testing``):

    - ``collective``: how ranks' payloads combine, one of ``gcomp.core.COLLECTIVES``; None for a composite that
      picks another method per bucket (``auto``: the chosen one's);
    - ``lossless``: the result is the dense mean, up to summation order; ``stateful``: it keeps per-bucket state
      across steps, so the hook waits for DDP's final buckets; ``reads_model``: it reads the model it is bound
      to (pruning masks); ``decodes_alone``: the result is the sum of each rank's payload decoded alone;
      ``depends_on_layout``: the result depends on where DDP lays each parameter; ``error_feedback``: it keeps
      what it did not send and adds it to a later step; ``stat_keys``: counters it adds to the state's stats;
      ``host_syncs``: host synchronisations one bucket may make on the device path (``gcomp.kernels``);
    - ``row_strategy``: how it serves FSDP2's reduce-scatter (``gcomp.sharding``), None when it cannot.

    Checkpoints: ``gcomp.core.Checkpointed``'s protocol (``state_dict``, ``load_state_dict``, ``replicated``,
    ``parameter_state``, ``merge_states``).
    """

    name: str = "custom"
    params: dict
    collective: ClassVar[str | None] = None
    lossless: bool = False
    stateful: bool = False
    reads_model: bool = False
    decodes_alone: bool = True
    depends_on_layout: bool = False
    error_feedback: bool = False
    stat_keys: tuple[str, ...] = ()
    host_syncs: int = 0
    row_strategy: RowStrategy | None = None

    def watch(self, ddp: torch.nn.Module) -> None:
        """Called with the DDP model when installed on one, before ``bind`` (PacTrain's tracker tells DDP's buffer
        broadcasts from edits of its masks)."""

    def bind(self, model: torch.nn.Module | None, group: dist.ProcessGroup | None, stats: dict) -> None:
        """Called once, when the state joins its process group: the model (None when the state knows none), the
        group, and the state's ``stats`` dict (holding ``stat_keys``, to be counted up in place)."""

    def install_flags(self) -> torch.Tensor | None:
        """int64 flags to MAX all-reduce over the group once, right after ``bind`` (the state runs that collective:
        a method never does); None for none. Whether it returns flags must not depend on the rank or model."""
        return None

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        """The MAX over the ranks of ``install_flags`` (on the CPU), the same on every rank."""

    @abstractmethod
    def reduce(self, buffer: torch.Tensor, bucket: BucketInfo, group: dist.ProcessGroup | None, stats: dict
               ) -> torch.futures.Future:
        """Reduce one flat bucket over ``group`` (already divided by the world size); a future of the mean
        gradient. Adds to ``stats``: ``encode_s``, ``bytes_sent``, ``decode_s`` and its own counters."""

    def flush(self, bucket: BucketInfo, like: torch.Tensor) -> torch.Tensor | None:
        """The gradient it holds back for ``bucket`` (flat, laid out like it, of ``like``'s dtype and device),
        removed from its state, so that another method can send it (``auto`` switching); None when none."""
        return None


@dataclass(eq=False)
class Method(MethodUnit):
    """A method built from three parts: a ``Compressor`` (the local codec), a ``Memory`` (error feedback) and a
    ``Communicator`` (the collectives), plus the name and parameters it was created with. What goes on the wire
    and by which collective: its compressor's and communicator's docstrings (``gcomp describe NAME``)."""

    compressor: Compressor
    memory: Memory
    communicator: Communicator
    name: str = "custom"
    params: dict = field(default_factory=dict)
    row_strategy: RowStrategy | None = None

    def __post_init__(self):
        if self.compressor.collective != self.communicator.collective:
            raise ValueError(
                f"{self.name}: {type(self.compressor).__name__} needs the '{self.compressor.collective}' collective "
                f"but {type(self.communicator).__name__} runs '{self.communicator.collective}'")

    # --- traits, from the parts ---------------------------------------------------------------------------------

    @property
    def collective(self) -> str:
        return self.communicator.collective

    @property
    def stateful(self) -> bool:
        return self.memory.stateful or self.compressor.stateful

    @property
    def lossless(self) -> bool:
        return self.compressor.lossless

    @property
    def reads_model(self) -> bool:
        return self.compressor.reads_model

    @property
    def decodes_alone(self) -> bool:
        return self.compressor.decodes_alone

    @property
    def depends_on_layout(self) -> bool:
        return self.compressor.depends_on_layout

    @property
    def error_feedback(self) -> bool:
        """True when its ``Memory`` keeps what was not sent (a residual per bucket)."""
        return self.memory.stateful

    @property
    def host_syncs(self) -> int:
        return self.compressor.host_syncs + self.communicator.host_syncs

    @property
    def stat_keys(self) -> tuple[str, ...]:
        """Its compressor's counters, then its communicator's."""
        keys = tuple(self.compressor.stat_keys)
        return keys + tuple(k for k in self.communicator.stat_keys if k not in keys)

    # --- binding ----------------------------------------------------------------------------------------------------

    def watch(self, ddp) -> None:
        self.compressor.watch(ddp)

    def bind(self, model, group, stats) -> None:
        self.compressor.bind(model, group, stats)

    def install_flags(self) -> torch.Tensor | None:
        return self.compressor.install_flags()

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        self.compressor.receive_install_flags(flags)

    # --- the pipelines ------------------------------------------------------------------------------------------

    def reduce(self, buffer, bucket, group, stats):
        """Compensate, compress, update the memory, exchange, decode (``gcomp.core``'s pipeline); on CUDA with
        side streams enabled, encode and decode on the device's codec stream (``gcomp.kernels.streams``)."""
        if streams.applies(buffer):
            return self._reduce_beside(buffer, bucket, group, stats)
        with timed(stats, "encode_s"):
            compensated = self.memory.compensate(buffer, bucket)
            payload = self.compressor.compress(compensated, bucket)
            self.memory.update(compensated, bucket, self.compressor, payload)
        stats["bytes_sent"] += payload.nbytes
        communicator, compressor = self.communicator, self.compressor

        def decode(fut: torch.futures.Future) -> torch.Tensor:
            with timed(stats, "decode_s"):
                return communicator.decode(fut.value(), compressor, payload.ctx)

        return then_on(communicator.exchange(payload, compressor, group, stats), decode, buffer.device)

    def _reduce_beside(self, buffer, bucket, group, stats):
        """``reduce`` with its encode and decode on the codec stream, ordered by events
        (``gcomp.kernels.streams`` says how)."""
        device, reader = buffer.device, torch.cuda.current_stream(buffer.device)
        side = streams.side_stream(device)
        side.wait_stream(reader)  # the bucket's gradients are ready
        with torch.cuda.stream(side):
            with timed(stats, "encode_s"):
                compensated = self.memory.compensate(buffer, bucket)
                payload = self.compressor.compress(compensated, bucket)
                self.memory.update(compensated, bucket, self.compressor, payload)
            stats["bytes_sent"] += payload.nbytes
            exchanged = self.communicator.exchange(payload, self.compressor, group, stats)  # NCCL waits for side
        communicator, compressor = self.communicator, self.compressor

        def decode(fut: torch.futures.Future) -> torch.Tensor:
            here = torch.cuda.current_stream(device)  # waited for the collective
            side.wait_stream(here)
            with torch.cuda.stream(side), timed(stats, "decode_s"):
                out = communicator.decode(fut.value(), compressor, payload.ctx)
            here.wait_stream(side)  # the future's event, recorded on ``here``, covers the decode
            out.record_stream(reader)
            return out

        return then_on(exchanged, decode, device)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, layout: ShardLayout,
                       group: dist.ProcessGroup, stats: dict) -> None:
        """FSDP2's reduce-scatter of ``input`` (flat, shard-major: ``layout``) into ``output`` (this rank's shard):
        the same memory and compressor as ``reduce``, the payload in rows by ``row_strategy``; waits for it.
        Per-parameter state (residuals) is kept per ``"<parameter>[<shard>]"`` piece (``layout.pieces``)."""
        rows = self.row_strategy
        if rows is None:
            raise ValueError(f"{self.name} declares no FSDP2 row strategy; the methods that have one: "
                             "gcomp.available(fsdp=True)")
        with timed(stats, "encode_s"):
            compensated = self.memory.compensate(input, layout.pieces)
            payload = rows.compress(self.compressor, compensated, layout)
            self.memory.update(compensated, layout.pieces, self.compressor, payload)
        stats["bytes_sent"] += payload.nbytes
        received = rows.exchange(payload, self.compressor, layout, group, stats)
        with timed(stats, "decode_s"):
            rows.decode(self.compressor, received, payload, layout, output)

    def flush(self, bucket, like):
        """What the memory and the compressor hold back for ``bucket``, summed."""
        held = [h for h in (self.memory.flush(bucket, like), self.compressor.flush(bucket, like)) if h is not None]
        if not held:
            return None
        return held[0] if len(held) == 1 else held[0].reshape(like.shape) + held[1].reshape(like.shape)

    # --- checkpoints: ``{"memory": ..., "compressor": ...}`` -------------------------------------------------

    def state_dict(self) -> dict:
        return {"memory": self.memory.state_dict(), "compressor": self.compressor.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        from gcomp.state_checks import check_state
        check_state(self.name, state, {"memory": dict, "compressor": dict})
        self.memory.load_state_dict(state["memory"])
        self.compressor.load_state_dict(state["compressor"])

    @property
    def keeps_state(self) -> bool:
        return self.memory.keeps_state or self.compressor.keeps_state

    @property
    def replicated(self) -> bool:
        return self.memory.replicated and self.compressor.replicated

    def parameter_state(self, state: dict) -> dict:
        slots: dict = {}
        for key in ("memory", "compressor"):
            part = getattr(self, key)
            try:
                own = part.parameter_state(state[key])
            except KeyError as err:
                raise ValueError(f"gcomp checkpoint: the {key} state of {self.name} ({type(part).__name__}) has no "
                                 f"{err.args[0]!r}") from err
            slots.update({f"{key} {slot}" if slot in slots else slot: tensors for slot, tensors in own.items()})
        return slots

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return {part: getattr(self, part).merge_states([s[part] for s in assigned], [s[part] for s in every], rank)
                for part in ("memory", "compressor")}
