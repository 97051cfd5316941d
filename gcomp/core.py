"""The three roles every method is made of (GRACE's ``Compressor``, ``Memory`` and ``Communicator``), the
``Payload`` that passes between them, the ``Traits`` a compressor declares, and the state a method keeps per
bucket layout (``LayoutState``) with the error feedback kept in it (``NoMemory``, ``ResidualMemory``).

One bucket goes through ``gcomp.method.Method.reduce``, the one pipeline, flat (a DDP bucket) or in rows (FSDP2's
reduce-scatter input, one row per destination shard)::

    v = memory.compensate(x)                                  # x plus what error feedback held back
    payload, state = compressor.encode(v, state, layout)      # pure: wire tensors, the layout's new state
    memory.update(v, residual)                                # what the payload does not carry of v
    received = communicator.exchange(payload, compressor)     # the collectives: a future
    mean = compressor.decode(received, payload.ctx)           # the mean gradient (this rank's row)

The hook divides the bucket by the world size first, as PyTorch's own hooks do: every sum over ranks is the mean.
A compressor never calls a collective; a communicator calls only what the codec protocol it declares
(``Communicator.codec``) defines.
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.state_checks import check_state, sum_by_name, tensor_dict

ALLREDUCE = "allreduce"            # payloads add up element-wise on the wire
ALLGATHER = "allgather"            # every rank's payload is seen apart, and decoded together
POINT_TO_POINT = "point-to-point"  # a schedule of messages of its own (gcomp.collectives.program)
HIERARCHICAL = "hierarchical"      # inside nodes, then between their leaders (a composite)
COLLECTIVES = (ALLREDUCE, ALLGATHER, POINT_TO_POINT, HIERARCHICAL)

SUM, MAX = dist.ReduceOp.SUM, dist.ReduceOp.MAX


class Keeps(enum.Enum):
    """What a compressor keeps across steps of its own (besides the per-layout ``Traits.slots`` the method keeps
    for it), which says how a checkpoint of it travels between ranks."""

    NOTHING = "nothing"  # no state
    SHARED = "shared"    # the same on every rank (a stream seeded alike): any rank's checkpoint loads on every rank
    RANK = "rank"        # this rank's own (its random stream): a resized run starts it afresh per rank
    LAYOUT = "layout"    # kept per bucket layout (a tracker, a plan): the hook waits for DDP's final buckets


@dataclass(frozen=True)
class Fidelity:
    """How far the decoded mean may lie from the exact mean: the error model ``gcomp.testing.check_method`` holds
    a method to on its own inputs ``v_r`` (each rank's bucket divided by the world size, plus what error feedback
    held back), beside the rounding of a sum in the bucket's and payload's dtypes:

    - ``exact``: the exact mean, up to summation order;
    - ``relative``: each entry within ``bound (world + 1) M`` of the exact mean, ``M`` the largest sum over ranks
      of ``|v_r|`` of any ``block`` consecutive entries holding it (``block=0``: the whole bucket): a wire dtype's
      rounding (fp16: ``2**-11``), block-scaled formats;
    - ``unbiased``: the mean of many draws is the exact mean within 6 standard deviations, except on at most a
      share ``bound`` of the entries per rank (clipped outliers: TernGrad's clip at c std leaves ``1 / c**2``);
    - ``largest``: each rank's bucket reduced on that rank alone carries some entries of its input (within
      ``bound`` of them relatively: narrowed values) and zeros elsewhere, no entry left out larger in magnitude
      than one sent (top-k, thresholds);
    - ``contraction``: each rank's bucket reduced on that rank alone, C(x), has ``|x - C(x)|^2 <= (1 - bound)
      |x|^2`` (low rank, signs, random subsets; ``bound`` may be 0).
    """

    kind: str
    bound: float = 0.0
    block: int = 1

    KINDS: ClassVar[tuple[str, ...]] = ("exact", "relative", "unbiased", "largest", "contraction")

    def __post_init__(self):
        if self.kind not in self.KINDS:
            raise ValueError(f"Fidelity kind must be one of {', '.join(self.KINDS)}; got {self.kind!r}")


EXACT = Fidelity("exact")
UNBIASED = Fidelity("unbiased")
LARGEST = Fidelity("largest")


def relative(bound: float, block: int = 1) -> Fidelity:
    """Each entry within ``bound (world + 1)`` times the largest sum over ranks of magnitudes in a block of
    ``block`` entries holding it (0: the whole bucket)."""
    return Fidelity("relative", bound, block)


def contraction(bound: float = 0.0) -> Fidelity:
    """``|x - C(x)|^2 <= (1 - bound) |x|^2`` for each rank's payload decoded alone."""
    return Fidelity("contraction", bound)


@dataclass(frozen=True)
class Traits:
    """What a compressor declares, read by the pipeline, the states and the contract suite.

    - ``collective``: how the ranks' payloads combine (``COLLECTIVES``);
    - ``fidelity``: its error model (``Fidelity``; ``EXACT`` makes the method lossless);
    - ``keeps``: what it keeps across steps of its own (``Keeps``); ``slots``: per-layout tensors of the bucket's
      length the method keeps for it and hands to ``encode`` as ``state`` (zeros at first, moved across DDP's bucket
      rebuilds, per parameter in checkpoints, summed over the old ranks when the world size changes); ``held``:
      those slots that hold gradient not sent yet, handed back by ``Method.flush``;
    - ``rows``: how it meets FSDP2's rows (one per destination shard): ``"each"`` row encoded on its own,
      ``"whole"`` (an entry-for-entry codec: its payload of the whole input, viewed as rows), ``"native"``
      (``encode`` takes the ``ShardLayout`` itself) or None (DDP only);
    - ``wire_bytes(bucket, world)``: the bytes one rank hands to the collectives for a bucket laid out as
      ``bucket`` (a ``BucketInfo``: its entries, dtype and parameters), None where the data decides;
    - ``decodes_alone``: the result is the sum of each rank's payload decoded alone (False for a majority vote, a
      shared basis); ``depends_on_layout``: the result depends on where DDP lays each parameter in the bucket;
      ``reads_model``: it reads the model it is bound to (pruning masks); ``host_syncs``: host synchronisations
      one bucket may make; ``stat_keys``: counters it adds to the state's ``stats``.
    """

    collective: str = ALLREDUCE
    fidelity: Fidelity = EXACT
    keeps: Keeps = Keeps.NOTHING
    slots: tuple[str, ...] = ()
    held: tuple[str, ...] = ()
    rows: str | None = "each"
    wire_bytes: Callable[[BucketInfo, int], int] | None = None
    decodes_alone: bool = True
    depends_on_layout: bool = False
    reads_model: bool = False
    host_syncs: int = 0
    stat_keys: tuple[str, ...] = ()

    def __post_init__(self):
        if self.collective not in COLLECTIVES:
            raise ValueError(f"Traits: collective must be one of {', '.join(COLLECTIVES)}; got {self.collective!r}")
        if self.rows not in ("each", "whole", "native", None):
            raise ValueError(f"Traits: rows must be 'each', 'whole', 'native' or None; got {self.rows!r}")
        if not set(self.held) <= set(self.slots):
            raise ValueError(f"Traits: held {self.held} must be among the slots {self.slots}")

    @property
    def lossless(self) -> bool:
        return self.fidelity.kind == "exact"


@dataclass
class Payload:
    """What one rank hands to the collectives for one bucket.

    ``tensors`` go on the wire (``bytes_sent`` counts them); ``ctx`` stays local, whatever ``decode`` needs;
    ``ops``, for all-reduce, the op of each tensor (SUM for all when empty; MAX for flags and scales); ``whole``,
    under FSDP2, the tensors all-reduced whole instead of row by row; ``rows``: the tensors are ``(world, ...)``,
    row r for destination r (FSDP2); ``residual``: what the payload does not carry of the compensated bucket, where
    the encode knows it at no cost (else error feedback decodes the payload to find it).
    """

    tensors: list[torch.Tensor]
    ctx: Any = None
    ops: tuple = ()
    whole: tuple[int, ...] = ()
    rows: bool = False
    residual: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def op(self, i: int):
        """The all-reduce op of ``tensors[i]``."""
        return self.ops[i] if self.ops else SUM


class Checkpointed:
    """The checkpoint protocol of every part and method; by default no state.

    ``state_dict`` holds tensors and plain values only (``torch.load(weights_only=True)`` reads it), keyed by
    parameter name or layout, never by DDP's bucket index alone; ``load_state_dict`` checks what it is given and
    raises ValueError naming the key; ``merge_states`` makes a rank's state of a resized world from the old ranks'
    (old rank j goes to new rank j mod N); ``replicated``: any rank's state is every rank's."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state, got keys {sorted(state)}")

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return {}

    @property
    def keeps_state(self) -> bool:
        return type(self).state_dict is not Checkpointed.state_dict

    @property
    def replicated(self) -> bool:
        return not self.keeps_state

    def parameter_state(self, state: dict) -> dict[str, dict[str, torch.Tensor]]:
        """``{slot: {parameter name: tensor}}`` of a checkpointed ``state``: checked against the model at load."""
        return {}


class Compressor(Checkpointed, ABC):
    """A pure local codec (GRACE's Compressor): it never calls a collective.

    What an author defines: ``traits`` (``Traits``), ``encode`` and ``decode``; where needed ``bind`` (the model,
    the group), and for state of its own ``state_dict``, ``load_state_dict`` and ``merge_states``. Randomness
    comes from a generator it owns, seeded alike on every rank (``gcomp.randomness``); no host synchronisation
    beyond ``traits.host_syncs``.
    """

    traits: ClassVar[Traits] = Traits()

    @abstractmethod
    def encode(self, x: torch.Tensor, state: dict[str, torch.Tensor], layout) -> tuple[Payload, dict]:
        """The payload of the flat ``x`` (a bucket laid out by ``layout``, a ``BucketInfo``; a ``ShardLayout`` for
        ``traits.rows == "native"``) and the layout's new ``state`` (its ``traits.slots``; ``{}`` without)."""

    @abstractmethod
    def decode(self, received: Sequence[torch.Tensor], ctx: Any) -> torch.Tensor:
        """The mean gradient from what the collective delivered: the reduced payload (all-reduce), every rank's
        payload stacked on a leading dimension (all-gather; one rank's stack decodes it alone), or the result
        (point-to-point). It has the bucket's size and dtype (this rank's row under FSDP2) and never writes into
        ``received``."""

    def bind(self, model: torch.nn.Module | None, group: dist.ProcessGroup | None, stats: dict) -> None:
        """Once, when the state joins its group: the model (None when unknown), the group, and the state's
        ``stats`` (holding ``traits.stat_keys``, counted up in place)."""

    @property
    def keeps_state(self) -> bool:
        return self.traits.keeps is not Keeps.NOTHING

    @property
    def replicated(self) -> bool:
        return self.traits.keeps in (Keeps.NOTHING, Keeps.SHARED)

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        """Its own state for ``rank`` of a resized world (old rank j goes to new rank j mod N): by default nothing
        to merge, or any old rank's when ``traits.keeps`` is SHARED; a compressor that keeps RANK or LAYOUT state
        says how, or the resize is refused (a ValueError)."""
        if self.traits.keeps is Keeps.NOTHING:
            return {}
        if self.traits.keeps is Keeps.SHARED:
            return every[0]
        raise ValueError(f"{type(self).__name__} keeps a state per rank that can be neither summed nor shared")


class Memory(Checkpointed, ABC):
    """Error feedback (GRACE's Memory). Conservation, exact: after ``v = compensate(x)`` and ``update(v, r)``,
    the payload decoded plus the new residual ``r`` is ``v``."""

    stateful: ClassVar[bool] = False

    @abstractmethod
    def compensate(self, x: torch.Tensor, bucket) -> torch.Tensor:
        """``x`` plus what was held back for ``bucket``'s layout (a new tensor when anything was)."""

    def update(self, v: torch.Tensor, bucket, residual: torch.Tensor) -> None:
        """Keep ``residual`` for the layout's next ``compensate``."""

    def flush(self, bucket, like: torch.Tensor) -> torch.Tensor | None:
        """What is held back for ``bucket``, removed; None when nothing is."""
        return None


# --- state kept per bucket layout --------------------------------------------------------------------------------
# DDP regroups parameters into other buckets after its first step, and a resumed run builds a fresh DDP whose
# buckets may be grouped otherwise: per-bucket tensors (residuals, a compressor's slots) are one flat tensor per
# layout, moved parameter by parameter onto a new layout, and stored per parameter name in checkpoints.

class LayoutState:
    """Named slots (``"residuals"``; a compressor's ``Traits.slots``), each one flat tensor per bucket layout.

    A layout seen for the first time takes its slots over from the pieces of the layouts it shares a parameter
    with, or from a loaded checkpoint (zeros where a parameter has none); ``state_dict`` is
    ``{slot: {parameter name: flat tensor}}``."""

    def __init__(self, slots: Sequence[str], owner: str = "state"):
        self.slots, self.owner = tuple(slots), owner
        self._live: dict[str, tuple[BucketInfo, dict[str, torch.Tensor]]] = {}
        self._pieces: dict[str, dict[str, torch.Tensor]] = {s: {} for s in self.slots}  # not placed yet

    def find(self, bucket: BucketInfo, like: torch.Tensor) -> dict[str, torch.Tensor] | None:
        """The slots of ``bucket``'s layout (built from known pieces on first sight); None when none is held."""
        entry = self._live.get(bucket.key)
        if entry is not None:
            return entry[1]
        self._split_stale(set(bucket.names))
        if not any(name in self._pieces[s] for s in self.slots for name in bucket.names):
            return None
        return self._adopt(bucket, like)

    def get(self, bucket: BucketInfo, like: torch.Tensor) -> dict[str, torch.Tensor]:
        """``find``, or zeros shaped like ``like``, kept for the layout from now on."""
        found = self.find(bucket, like)
        return found if found is not None else self._adopt(bucket, like)

    def put(self, bucket: BucketInfo, tensors: dict[str, torch.Tensor]) -> None:
        """Keep ``tensors`` (every slot, flat, laid out like ``bucket``; taken over, not copied)."""
        self._live[bucket.key] = (bucket, tensors)

    def _adopt(self, bucket: BucketInfo, like: torch.Tensor) -> dict[str, torch.Tensor]:
        tensors = {}
        for slot in self.slots:
            dtype = like.dtype  # a slot kept wider than the bucket (fp32 momentum of a bf16 model) stays so
            for name in bucket.names:
                if name in self._pieces[slot]:
                    dtype = torch.promote_types(dtype, self._pieces[slot][name].dtype)
            flat = like.new_zeros(like.numel(), dtype=dtype)
            for name, offset, numel in bucket.segments():
                piece = self._pieces[slot].pop(name, None)
                if piece is not None:
                    if piece.numel() != numel:
                        raise ValueError(f"{self.owner}: the {slot} of parameter '{name}' hold {piece.numel()} "
                                         f"elements, the bucket holds {numel} of it: this state (or the checkpoint "
                                         "it loaded) was made for another model. One state serves one model; make "
                                         "a fresh one for this model (gcomp.install)")
                    flat[offset:offset + numel].copy_(piece.reshape(-1))
            tensors[slot] = flat
        self.put(bucket, tensors)
        return tensors

    def _split_stale(self, names: set[str]) -> None:
        """Cut the layouts that share a parameter with ``names`` into per-parameter pieces (views)."""
        for key in [k for k, (layout, _) in self._live.items() if names.intersection(layout.names)]:
            layout, tensors = self._live.pop(key)
            for slot in self.slots:
                for name, offset, numel in layout.segments():
                    self._pieces[slot][name] = tensors[slot][offset:offset + numel]

    def state_dict(self) -> dict:
        out = {slot: dict(self._pieces[slot]) for slot in self.slots}
        for layout, tensors in self._live.values():
            for slot in self.slots:
                for name, offset, numel in layout.segments():
                    out[slot][name] = tensors[slot][offset:offset + numel].clone()
        return out

    def load_state_dict(self, state: dict) -> None:
        check_state(self.owner, state, {slot: dict for slot in self.slots})
        for slot in self.slots:
            tensor_dict(self.owner, slot, state[slot])
        self._live.clear()
        self._pieces = {s: {name: t.clone() for name, t in state[s].items()} for s in self.slots}


class NoMemory(Memory):
    """No error feedback: the gradient is compressed as it is."""

    def compensate(self, x, bucket):
        return x


class ResidualMemory(Memory):
    """Keeps ``residual = v - decode(payload)`` per bucket layout (``LayoutState``) and adds it to the next
    gradient. Non-finite residual entries are dropped: one overflowing step (which AMP skips) must not poison every
    later one."""

    stateful = True

    def __init__(self):
        self._state = LayoutState(("residuals",), owner="ResidualMemory")

    def compensate(self, x, bucket):
        held = self._state.find(bucket, x)
        return x if held is None else x + held["residuals"].view_as(x)

    def update(self, v, bucket, residual):
        self._state.put(bucket, {"residuals": torch.nan_to_num(residual.reshape(-1), nan=0.0, posinf=0.0,
                                                               neginf=0.0)})

    def flush(self, bucket, like):
        held = self._state.find(bucket, like)
        if held is None:
            return None
        residual = held["residuals"]
        self._state.put(bucket, {"residuals": torch.zeros_like(residual)})
        return residual

    def state_dict(self) -> dict:
        return self._state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self._state.load_state_dict(state)

    def parameter_state(self, state: dict) -> dict:
        return {"residuals": state["residuals"]}

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return {"residuals": sum_by_name([s["residuals"] for s in assigned])}


class Communicator(ABC):
    """Runs the collectives of one payload on a group (GRACE's Communicator) and returns a future of what
    ``Compressor.decode`` takes; never blocks beyond the rounds that must be waited for (a round whose result the
    next one needs runs inside ``exchange``: waiting inside a ``.then`` callback deadlocks gloo).

    ``codec``: the codec protocol it takes (``Compressor`` or a subclass declaring what more it calls);
    ``rows``: it exchanges FSDP2's rows payloads too. Bytes it sends beyond the payload go to
    ``stats["bytes_sent"]``."""

    collective: ClassVar[str] = ALLREDUCE
    codec: ClassVar[type] = Compressor
    rows: ClassVar[bool] = True
    stat_keys: ClassVar[tuple[str, ...]] = ()
    host_syncs: ClassVar[int] = 0

    @abstractmethod
    def exchange(self, payload: Payload, compressor: Compressor, group: dist.ProcessGroup | None,
                 stats: dict | None = None) -> torch.futures.Future:
        """Launch the collectives for ``payload``; ``stats`` is None outside a state (nothing is counted)."""
