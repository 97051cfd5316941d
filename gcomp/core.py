"""The three small abstract types a method is built from, the payload they pass, and every call between them.

A method is a ``gcomp.method.MethodUnit``: what the DDP hook, FSDP2's and HSDP's states and ``auto`` talk to.
``gcomp.method.Method``, the triple of parts defined here, is the unit almost every method is; one bucket
flows through ``Method.reduce``, the one pipeline (DDP's hook, HSDP's replicas, a composite's inner method)::

    flat grads -> Memory.compensate -> Compressor.compress -> Payload -> Memory.update
               -> Communicator.exchange (collectives, chained futures)
               -> Communicator.decode (by the collective kind: Compressor.decompress or .aggregate)
               -> mean gradient returned to DDP

and under FSDP2 through ``Method.reduce_scatter``: the same memory and compressor, the payload laid out in one
row per destination shard by the method's row strategy (``gcomp.sharding``).

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

import warnings
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.state_checks import check_state, check_state_keys, sum_by_name, tensor_dict  # noqa: F401 (their home)

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

    Under FSDP2 (``gcomp.sharding``) a payload's tensors are rows: ``(world, m)``, row r for destination shard r,
    reduce-scattered (SUM); ``whole`` lists the indices of tensors all-reduced whole instead (flags, scales).
    """

    tensors: list[torch.Tensor]
    ctx: Any = None
    ops: tuple = ()
    whole: tuple[int, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def op(self, i: int):
        """The all-reduce op of ``tensors[i]``."""
        return self.ops[i] if self.ops else SUM


class Checkpointed:
    """The checkpoint protocol of every part and every method: by default, no state.

    ``state_dict`` holds tensors and plain values only (``torch.load(weights_only=True)`` reads it back), keyed
    by parameter name or layout, never by DDP's bucket index alone. ``load_state_dict`` checks what it is given
    (``check_state``) and raises ValueError naming the key. What is kept says how it travels between ranks:

    - ``replicated``: the state is the same on every rank (a shared random stream, a tracker every rank runs
      alike), so a checkpoint of any one rank loads on every rank; true for what keeps no state. A part whose
      state is shared sets ``replicated = True``;
    - ``merge_states``: the state of a rank of a resized world, from the old ranks' states.
    """

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if "replicated_state" in cls.__dict__:  # its name until 0.1: kept working for one release
            warnings.warn(f"{cls.__name__}: 'replicated_state' is now 'replicated'", DeprecationWarning, stacklevel=2)
            cls.replicated = cls.__dict__["replicated_state"]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got keys {sorted(state)}")

    @property
    def keeps_state(self) -> bool:
        """Whether it checkpoints anything (it overrides ``state_dict``)."""
        return type(self).state_dict is not Checkpointed.state_dict

    @property
    def replicated(self) -> bool:
        """Whether any rank's state is every rank's (see the class docstring)."""
        return not self.keeps_state

    def parameter_state(self, state: dict) -> dict[str, dict[str, torch.Tensor]]:
        """The tensors of a checkpointed ``state`` that each belong to one parameter and have its number of
        entries, as ``{slot: {parameter name: tensor}}`` (residuals, momenta): the run state checks, before
        loading, that their parameters exist, that their sizes match and that they are finite."""
        return {}

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        """This state for ``rank`` of a resized world, from the states of the old ranks ``assigned`` to it
        (old rank j goes to new rank j mod new world size; none when the world grew past j) and of ``every`` old
        rank. Error feedback must keep its total: residuals are summed. Raise ValueError where a resize has no
        meaning for the method. What keeps no state has nothing to merge."""
        if self.keeps_state:
            raise ValueError(f"{type(self).__name__} keeps a state per rank that can be neither summed nor shared")
        return {}


class Compressor(Checkpointed, ABC):
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
    # Host synchronisations one bucket's encode and decode may make on the device path (``gcomp.kernels``): none,
    # but where the payload's size depends on the data (``gcomp.testing.ops`` counts them).
    host_syncs: ClassVar[int] = 0

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


class Memory(Checkpointed, ABC):
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
        """What is held back for ``bucket`` (flat, laid out like it and like ``like``, its gradient), removed, so that
        another method sends it (``auto`` switching methods); None when nothing is held, the default."""
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
    host_syncs: ClassVar[int] = 0  # as ``Compressor.host_syncs``: a size read on the host before a collective

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



def __getattr__(name: str):
    if name in ("Method", "MethodUnit"):  # one floor up since 0.2: the parts know nothing of what assembles them
        raise AttributeError(f"gcomp.core.{name} is gcomp.{name} now (defined in the module one floor up)")
    raise AttributeError(f"module 'gcomp.core' has no attribute {name!r}")
