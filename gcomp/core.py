"""The three small abstract types every method is built from, the payload they pass, and every call between them.

One bucket flows through ``Method.reduce``, the one pipeline (the hook's, and ``hierarchical``'s for its inner
method between node leaders)::

    flat grads -> Memory.compensate -> Compressor.compress -> Payload -> Memory.update
               -> Communicator.exchange (collectives, chained futures)
               -> Communicator.decode (by the collective kind: Compressor.decompress or .aggregate)
               -> mean gradient returned to DDP

The hook divides the bucket by the world size before (as PyTorch's own hooks do), so every sum over ranks
that follows is already the mean.

Who calls what, and nothing else: ``Method.reduce`` calls the parts in that order; ``Memory.update`` calls
``Compressor.sent_positions``, ``Compressor.residual_into`` and, where those decline, ``Compressor.decompress``;
a ``Communicator`` calls the collectives and the compressor methods declared here or on the codec base class it
takes by type (``ChainedCompressor.second_round`` in ``gcomp.collectives.chained``,
``ScheduledCompressor.program`` in ``gcomp.collectives.scheduled``). Statistics reach a communicator as an
argument; a compressor gets the same dict once, in ``bind``, for its own ``stat_keys``.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar, Sequence

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.device_future import then_on

# The collective kinds: how payloads of several ranks are combined (a compressor's and its communicator's
# ``collective`` must match).
ALLREDUCE = "allreduce"
ALLGATHER = "allgather"
POINT_TO_POINT = "point-to-point"
HIERARCHICAL = "hierarchical"
COLLECTIVES = (ALLREDUCE, ALLGATHER, POINT_TO_POINT, HIERARCHICAL)

SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX


@dataclass
class Payload:
    """What one rank hands to the collectives for one bucket.

    ``tensors`` go on the wire (their bytes are counted in ``bytes_sent``); ``ctx`` stays local and is
    whatever the compressor needs to decode (shape, dtype, selected indices, ...). ``ops`` is, for all-reduce
    payloads, the reduce op of each tensor (``SUM`` for every tensor when empty; ``MAX`` for flags and scales).
    """

    tensors: list[torch.Tensor]
    ctx: Any = None
    ops: tuple = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def op(self, i: int):
        """The all-reduce op of ``tensors[i]``."""
        return self.ops[i] if self.ops else SUM


def check_state_keys(owner: object, state: dict, allowed: Sequence[str]) -> None:
    """Raise a clear error when a checkpoint holds keys ``owner`` does not know."""
    unknown = set(state) - set(allowed)
    if unknown:
        raise ValueError(f"{owner if isinstance(owner, str) else type(owner).__name__}: unexpected keys "
                         f"{sorted(unknown)}")


def check_state(owner: object, state: Any, required: dict[str, Any], optional: dict[str, Any] | None = None
                ) -> None:
    """A checkpoint's dict for ``owner``: every key of ``required`` present, no key outside ``required`` and
    ``optional``, each value of the type its key maps to (a type or a tuple of types). Raises ValueError naming
    the key: a bad state fails at ``load_state_dict``, never at the first backward."""
    name = owner if isinstance(owner, str) else type(owner).__name__
    if not isinstance(state, dict):
        raise ValueError(f"{name}: the state must be a dict, got {type(state).__name__}")
    known = {**required, **(optional or {})}
    check_state_keys(name, state, known)
    missing = [k for k in required if k not in state]
    if missing:
        raise ValueError(f"{name}: the state has no {', '.join(repr(k) for k in missing)}")
    for key, value in state.items():
        if not isinstance(value, known[key]) or isinstance(value, bool) and known[key] in (int, (int, float)):
            expected = known[key].__name__ if isinstance(known[key], type) else " or ".join(
                t.__name__ for t in known[key])
            article = "an" if expected[0] in "aeiou" else "a"
            raise ValueError(f"{name}: {key!r} must be {article} {expected}, got {type(value).__name__}")


def tensor_dict(owner: str, key: str, value: Any) -> dict[str, torch.Tensor]:
    """``value``, checked to be a ``{name: tensor}`` dict (per-parameter state)."""
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(t, torch.Tensor)
                                              for k, t in value.items()):
        raise ValueError(f"{owner}: {key!r} must map parameter names to tensors")
    return value


def sum_by_name(states: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Per-parameter tensors of several ranks added up, name by name (error feedback kept across a resize)."""
    total: dict[str, torch.Tensor] = {}
    for state in states:
        for name, t in state.items():
            total[name] = t.clone() if name not in total else total[name] + t
    return total


class _Checkpointed:
    """Default checkpointing for a part that keeps no state; stateful parts override ``state_dict`` and
    ``load_state_dict``, and say how their state travels between ranks (below).

    ``state_dict`` holds tensors and plain values only (``torch.load(weights_only=True)`` reads it back), keyed
    by parameter name or layout, never by DDP's bucket index alone. ``load_state_dict`` checks what it is given
    (``check_state``) and raises ValueError naming the key."""

    # True when the state is the same on every rank (a shared random stream, a tracker every rank runs alike):
    # a checkpoint of any one rank then loads on every rank. A part that keeps no state counts as replicated.
    replicated_state: ClassVar[bool] = False

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got keys {sorted(state)}")

    @property
    def keeps_state(self) -> bool:
        return type(self).state_dict is not _Checkpointed.state_dict

    @property
    def replicated(self) -> bool:
        """Whether any rank's state is every rank's (``replicated_state``, or no state at all)."""
        return self.replicated_state or not self.keeps_state

    def parameter_state(self, state: dict) -> dict[str, dict[str, torch.Tensor]]:
        """The tensors of a checkpointed ``state`` that each belong to one parameter and have its number of
        entries, as ``{slot: {parameter name: tensor}}`` (residuals, momenta): the hook checks, before loading,
        that their parameters exist, that their sizes match and that they are finite."""
        return {}

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        """This part's state for ``rank`` of a resized world, from the states of the old ranks ``assigned`` to it
        (old rank j goes to new rank j mod new world size; none when the world grew past j) and of ``every`` old
        rank. Error feedback must keep its total: residuals are summed. Raise ValueError where a resize has no
        meaning for the method. Stateless parts have nothing to merge."""
        if self.keeps_state:
            raise ValueError(f"{type(self).__name__}: its state cannot move to another number of ranks; resume "
                             "with the world size it was saved with, or start this method's state afresh")
        return {}


class Compressor(_Checkpointed, ABC):
    """A pure local codec: it never calls a collective itself.

    Contract:
    - ``collective`` says how payloads of several ranks may be combined: ``"allreduce"`` when they can be
      reduced element-wise on the wire (then ``decompress(sum of payloads) == sum of decompress(payload)``,
      exactly for lossless codecs, in expectation for stochastic ones), ``"allgather"`` when each rank's
      payload must be seen separately and combined by ``aggregate``, ``"point-to-point"`` when the method
      runs a schedule of messages of its own (``gcomp.collectives.scheduled.ScheduledCompressor``), or
      ``"hierarchical"`` (``gcomp.compressors.hierarchical``).
    - ``decompress(compress(x).tensors, ctx)`` has the shape and dtype of ``x``.
    - ``lossless`` is true only when that round trip is exact.
    - Randomness comes from a ``torch.Generator`` the compressor owns, saved in ``state_dict``.
    - No host synchronisation (``.item()``, ``.tolist()``) in ``compress`` / ``decompress``.
    """

    collective: ClassVar[str] = ALLREDUCE
    lossless: ClassVar[bool] = False
    # True when the codec keeps per-bucket state across steps (momentum, a tracker, residuals of its own):
    # the hook then waits for DDP's final bucket layout before compressing.
    stateful: ClassVar[bool] = False
    stat_keys: ClassVar[tuple[str, ...]] = ()  # extra counters this method adds to ``HookState.stats``
    # True when the result is the sum over ranks of each rank's payload decoded on its own. False where it
    # depends on all payloads jointly (PowerSGD's shared basis, a majority vote); the contract suite then
    # checks those methods against their own tests instead of that sum.
    decodes_alone: ClassVar[bool] = True
    # True when the result depends on where DDP lays each parameter in the bucket (SparDL cuts the flat bucket
    # into blocks): a checkpoint resumed on another bucket layout then goes on along another trajectory.
    depends_on_layout: ClassVar[bool] = False
    # True when the codec reads the model it is bound to (PacTrain reads its pruning masks): a hook state that
    # knows no model (``gcomp.comm_hook`` without ``model=``) warns, since the codec then sends dense.
    reads_model: ClassVar[bool] = False
    # True when the codec itself keeps gradient it did not send, for later steps (error feedback inside the
    # codec: PowerSGD's error, DGC's velocity); ``flush`` then hands it back.
    holds_gradient: ClassVar[bool] = False

    def bind(self, model: torch.nn.Module | None, group: dist.ProcessGroup | None, stats: dict) -> None:
        """Called once when the hook is set up, with the DDP model's module, the process group and the hook's
        ``stats`` dict (holding this codec's ``stat_keys``, to be counted up in place).

        Codecs that read the model (PacTrain reads its pruning masks) or need their rank keep what they need;
        the default keeps nothing. A codec used outside a hook is never bound.
        """

    def watch(self, ddp: torch.nn.Module) -> None:
        """Called with the DDP model when the hook is installed on one, before ``bind``; the default does
        nothing (PacTrain's tracker tells DDP's buffer broadcasts from edits of its masks)."""

    def install_flags(self) -> torch.Tensor | None:
        """int64 flags this codec wants MAX all-reduced over its process group once, right after ``bind`` (the
        hook state runs that collective: a codec never does); None, the default, for none. Whether a codec
        returns flags must not depend on its rank or model: every rank must join the collective or none."""
        return None

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        """The MAX over the ranks of ``install_flags`` (on the CPU), the same on every rank."""

    @abstractmethod
    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Payload:
        """Encode a flat gradient into the tensors that go on the wire."""

    @abstractmethod
    def decompress(self, tensors: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """Decode one payload, or for ``allreduce`` codecs the element-wise reduction of all ranks' payloads."""

    def flush(self, bucket: BucketInfo, like: torch.Tensor) -> torch.Tensor | None:
        """The gradient this codec holds back for ``bucket`` (flat, laid out like it and of ``like``'s dtype and
        device, ``like`` being the bucket's gradient), removed from its state, so
        that another method can send it (``auto`` switching methods); None when it holds none. Codecs with
        ``holds_gradient`` override it."""
        return None

    def residual_into(self, out: torch.Tensor, tensor: torch.Tensor, payload: Payload) -> bool:
        """Optional fast path of ``Memory.update``: write ``tensor - decompress(payload)`` into ``out`` (``tensor``'s
        shape, dtype and device; never ``tensor`` itself) with non-finite entries set to zero, and return True.
        Codecs that know which few entries they sent do it without decoding a whole bucket. The default writes
        nothing and returns False: the memory then decompresses the payload and subtracts it."""
        return False

    def sent_positions(self, payload: Payload) -> torch.Tensor | None:
        """Optional fastest path of ``Memory.update``: distinct positions (1-d, on the bucket's device) where
        ``decompress(payload)`` is the compressed bucket exactly, it being 0 elsewhere; only when that bucket is
        all finite and knowing so costs no device synchronisation. The memory may then keep the compressed
        bucket itself as the residual, those positions read as 0. The default: None, no such positions."""
        return None

    def aggregate(self, gathered: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """Sum over ranks of the decoded payloads (``allgather`` codecs).

        ``gathered[j]`` stacks every rank's ``tensors[j]`` along a new leading dimension. This default decodes
        rank by rank; codecs override it with one vectorised decode.
        """
        world = gathered[0].shape[0]
        total = self.decompress([g[0] for g in gathered], ctx)
        for r in range(1, world):
            total = total + self.decompress([g[r] for g in gathered], ctx)
        return total


class Memory(_Checkpointed, ABC):
    """Error feedback: what a lossy compressor did not send is added to the next gradient.

    Contract (conservation, exact): after ``v = compensate(g, b)``, ``p = compressor.compress(v, b)`` and
    ``update(v, b, compressor, p)``, the decoded payload plus the new residual equals ``v``, which is ``g``
    plus the old residual. ``update`` may keep ``v`` (a buffer its ``compensate`` handed out) as the residual:
    the caller may read ``v`` afterwards, never write it.
    """

    stateful: ClassVar[bool] = False

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, bucket: BucketInfo) -> torch.Tensor:
        """Return the gradient plus whatever was held back for this bucket."""

    @abstractmethod
    def update(self, tensor: torch.Tensor, bucket: BucketInfo, compressor: Compressor, payload: Payload) -> None:
        """Store what ``payload`` does not carry of ``tensor`` (``compressor.residual_into``, or else
        ``compressor.decompress`` of it, tells)."""

    def flush(self, bucket: BucketInfo, like: torch.Tensor) -> torch.Tensor | None:
        """What is held back for ``bucket`` (flat, laid out like it and like ``like``, its gradient), removed, so that another method sends it
        (``auto`` switching methods); None when nothing is held, the default."""
        return None


class Communicator(ABC):
    """Runs the collectives for one payload on a process group; never blocks the autograd thread.

    ``exchange`` returns a ``torch.futures.Future`` whose value is the list of received tensors (reduced for
    all-reduce, stacked per rank for all-gather, ``[mean gradient]`` for point-to-point and hierarchical);
    ``decode`` turns that list into the mean gradient. A multi-round scheme launches its rounds from
    ``exchange`` itself, never by waiting on a new collective inside a ``.then`` callback (that deadlocks on
    gloo with several buckets).
    """

    collective: ClassVar[str] = ALLREDUCE
    stat_keys: ClassVar[tuple[str, ...]] = ()  # extra counters this communicator adds to ``HookState.stats``

    @abstractmethod
    def exchange(self, payload: Payload, compressor: Compressor, group: dist.ProcessGroup | None,
                 stats: dict | None = None) -> torch.futures.Future:
        """Launch the collectives for ``payload.tensors``. Bytes sent beyond the payload (sizes, padding,
        point-to-point messages) are added to ``stats["bytes_sent"]``, and counted in this communicator's own
        ``stat_keys``; ``stats`` is None outside a hook (nothing is counted then)."""

    def decode(self, received: list[torch.Tensor], compressor: Compressor, ctx: Any) -> torch.Tensor:
        """The mean gradient from what ``exchange`` received; the collective kind decides how: all-reduce
        payloads go through ``compressor.decompress``, all-gathered ones through ``compressor.aggregate``;
        point-to-point and hierarchical exchanges already hold the result."""
        if self.collective == ALLREDUCE:
            return compressor.decompress(received, ctx)
        if self.collective == ALLGATHER:
            return compressor.aggregate(received, ctx)
        return received[0]


@dataclass
class Method:
    """A configured compression method: the three parts plus the name and parameters it was created with."""

    compressor: Compressor
    memory: Memory
    communicator: Communicator
    name: str = "custom"
    params: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.compressor.collective != self.communicator.collective:
            raise ValueError(
                f"{self.name}: {type(self.compressor).__name__} needs the '{self.compressor.collective}' collective "
                f"but {type(self.communicator).__name__} runs '{self.communicator.collective}'")

    @property
    def stateful(self) -> bool:
        """True when the method keeps per-bucket state across steps (and so waits for DDP's final buckets)."""
        return self.memory.stateful or self.compressor.stateful

    @property
    def collective(self) -> str:
        """How ranks' payloads are combined (one of ``COLLECTIVES``): the communicator's."""
        return self.communicator.collective

    @property
    def lossless(self) -> bool:
        return self.compressor.lossless

    @property
    def decodes_alone(self) -> bool:
        return self.compressor.decodes_alone

    @property
    def depends_on_layout(self) -> bool:
        return self.compressor.depends_on_layout

    @property
    def reads_model(self) -> bool:
        return self.compressor.reads_model

    @property
    def error_feedback(self) -> bool:
        """True when the method's ``Memory`` keeps what was not sent (a residual per bucket)."""
        return self.memory.stateful

    def reduce(self, buffer: torch.Tensor, bucket: BucketInfo, group: dist.ProcessGroup | None, stats: dict
               ) -> torch.futures.Future:
        """Reduce one flat bucket over ``group`` (already divided by the world size): compensate, compress,
        update the memory, exchange, decode. Returns a future of the mean gradient.

        Adds to ``stats``: ``encode_s`` (compensate, compress and memory update, host seconds), ``bytes_sent``
        (the payload's bytes; the communicator adds what else it sends), ``decode_s``, and the communicator's
        own ``stat_keys``. ``stats`` must hold those keys (``HookState.stats`` does).
        """
        start = time.perf_counter()
        compensated = self.memory.compensate(buffer, bucket)
        payload = self.compressor.compress(compensated, bucket)
        self.memory.update(compensated, bucket, self.compressor, payload)
        stats["encode_s"] += time.perf_counter() - start
        stats["bytes_sent"] += payload.nbytes
        communicator, compressor = self.communicator, self.compressor

        def decode(fut: torch.futures.Future) -> torch.Tensor:
            begin = time.perf_counter()
            out = communicator.decode(fut.value(), compressor, payload.ctx)
            stats["decode_s"] += time.perf_counter() - begin
            return out

        return then_on(communicator.exchange(payload, compressor, group, stats), decode, buffer.device)

    @property
    def stat_keys(self) -> tuple[str, ...]:
        """The counters the method adds to the hook's statistics: its compressor's, then its communicator's."""
        keys = tuple(self.compressor.stat_keys)
        return keys + tuple(k for k in self.communicator.stat_keys if k not in keys)
