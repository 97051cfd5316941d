"""``pactrain``: all-reduce of only the entries a pruned model keeps, packed densely; ternary on top if asked.

PacTrain (Wang, Wu, Li, Kutscher, 2025). Prune first (``gcomp.pruning.prune``), build DDP, install this.
"""
from __future__ import annotations

import warnings
from typing import Annotated

import torch

from gcomp.collectives.chained import ChainedAllreduceCommunicator, ChainedCompressor
from gcomp.compressors.pactrain_payload import FLAT, ONE_ROUND, TERNARY, PackedCtx
from gcomp.compressors.pactrain_rows import PacTrainRows
from gcomp.compressors.pactrain_ternary import TernaryCodec
from gcomp.compressors.quantise import RankGenerator, rank_and_world
from gcomp.core import ALLREDUCE, MAX, SUM, Payload, check_state
from gcomp.method import Method
from gcomp.memory import NoMemory
from gcomp.params import Range
from gcomp.packing.tracker import DENSE, ENTRIES, PACKED, TRACKING, MaskTracker
from gcomp.registry import register

class PacTrainCompressor(ChainedCompressor):
    """Mask-packed all-reduce of a pruned model's buckets (lossless), optionally ternarised.

    On the wire, per bucket and step, by the mask tracker's state (``gcomp.packing.tracker``), in one
    all-reduce round except for ternary's first packed step (``ChainedAllreduceCommunicator``):

    - tracking / dense: the bucket as it is (SUM), and while tracking 5 int64 flags (MAX);
    - packed: the kept entries in the bucket's dtype plus one entry counting ranks whose masks changed (SUM);
      the result equals a dense all-reduce on the support, bit for bit on 2 ranks, and is zero elsewhere;
    - ternary, the codes t + 1 of t in {-1, 0, 1}, drawn so that E[scale * t] = value, in
      ``bitpack.lane_bits(N)``-bit fields of int64 words (SUM: each field sums to at most 2N, no carry
      crosses), against a scale per parameter segment that every rank shares:

      - ``rounds=1`` (the default), one all-reduce: the scale is carried from the step before
        (``gcomp.compressors.scale_grid``): one int64 tensor (SUM) of the code words, then
        ``scale_grid.hist_words`` words of counting lanes that give the next step's scale, then 3 counts
        (ranks with a non-finite value, with changed masks, asking a resync). A value above the carried scale
        goes as +-scale and its excess is added to its rank's next step (kept with the tracker's state), so
        every rank's sends add up to its gradients; the first packed step, and a step after a resync, take
        the two rounds below;
      - ``rounds=2``: first one fp32 scale per parameter segment plus two flags (MAX: the exact shared
        scale, max |value| over ranks), then the code words (SUM). Unbiased at every step.

    ``granularity="groups"`` (``prunex``'s inter-node stage) packs whole filters and channels
    (``gcomp.packing.groups``) instead of single entries: no per-entry index, even in memory.

    Its parts: ``tracker`` (``MaskTracker``: the mode of each bucket and step, and per layout a ``BucketTrack``
    whose ``state`` holds what the method keeps on the frozen support) and ``codec`` (``TernaryCodec``, in
    ``gcomp.compressors.pactrain_ternary``: the ternary path, given the support and that state at every call).
    """

    collective = ALLREDUCE
    stateful = True
    reads_model = True  # the pruning masks
    stat_keys = ("packed_buckets", "freezes", "unfreezes", "mask_mismatches", "one_round_buckets", "scale_resyncs")
    # The tracker reads, at each step, the flags the step before received (some rank's masks changed; with them
    # the ternary resync flag): one ``tolist`` of a pinned host copy whose asynchronous copy was issued a step
    # earlier behind an event (``gcomp.packing.host_flags``). It waits for that one copy only, long finished
    # unless the host runs a whole step ahead of the device; it decides which collective this step makes (dense
    # or packed), so every rank must know it on the host.
    host_syncs = 1

    def __init__(self, stable_steps: int = 5, dense_above: float = 0.9, ternary: bool = False,
                 clip: float = 0.0, error_feedback: bool = False, seed: int = 0, granularity: str = ENTRIES,
                 check_every: int = 10, rounds: int = 1):
        if rounds not in (1, 2):
            raise ValueError(f"rounds must be 1 or 2, got {rounds!r}")
        self.tracker = MaskTracker(stable_steps, dense_above, granularity, check_every)
        self.codec = TernaryCodec(clip, error_feedback, rounds, RankGenerator(seed, "pactrain"))
        self.ternary = ternary
        self.holds_gradient = ternary and error_feedback  # residuals of the packed entries (no flush yet)
        self.lossless = not ternary
        self.rank = 0
        self.stats: dict = {}
        self.codec.bind(1, self.count)

    # the ternary options are the codec's, read here as the method's parameters

    @property
    def clip(self) -> float:
        return self.codec.clip

    @property
    def error_feedback(self) -> bool:
        return self.codec.error_feedback

    @property
    def rounds(self) -> int:
        return self.codec.rounds

    @property
    def seed(self) -> int:
        return self.codec.random.seed

    @property
    def random(self) -> RankGenerator:
        """The rank's stream of ternary draws (the codec's; saved as ``generator``)."""
        return self.codec.random

    @property
    def world_size(self) -> int:
        return self.codec.world_size

    @world_size.setter
    def world_size(self, world: int) -> None:
        """The lanes' width for ``world`` ranks (``bind`` sets it from the group; a test or a benchmark may set
        it to simulate ranks in one process)."""
        self.codec.bind(world, self.count)

    def bind(self, model, group, stats) -> None:
        self.tracker.bind(model, stats)
        self.stats = stats
        self.rank, self.world_size = rank_and_world(group)
        self.random.bind(self.rank)  # independent draws per rank

    def watch(self, ddp) -> None:
        self.tracker.watch(ddp)

    def install_flags(self) -> torch.Tensor:
        return self.tracker.install_flags()

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        self.tracker.receive_install_flags(flags)

    def count(self, key: str) -> None:
        """Add one to the statistic ``key`` when the hook state keeps it (``stat_keys``)."""
        if key in self.stats:
            self.stats[key] += 1

    # --- encode, for DDP's flat bucket and FSDP2's rows alike (the view says how it is laid out) -------------

    def compress(self, tensor, bucket):
        return self.encode(tensor, bucket, FLAT)

    def encode(self, tensor: torch.Tensor, info, view=FLAT) -> Payload:
        """The payload of ``tensor`` (the layout ``info``: its parameters' names find their masks) by the tracker's
        mode for it, laid out by ``view`` (``FlatView``; FSDP2's ``RowsView``)."""
        track, changed_here = self.tracker.decide(info, tensor.device, view.build(tensor.device))
        if track.mode == TRACKING:
            return Payload([view.dense(tensor), MaskTracker.flags(track, changed_here, tensor.device)],
                           PackedCtx(TRACKING, track, tensor, view), ops=(SUM, MAX), whole=(1,) if view.in_rows else ())
        if track.mode == DENSE:
            return Payload([view.dense(tensor)], PackedCtx(DENSE, track, tensor, view))
        self.count("packed_buckets")
        support, state, codec = track.support, track.state, self.codec
        if not self.ternary:
            packed = view.packed(support, state, tensor)
            packed[..., -1] = changed_here  # a bool, or on the device path a tensor (gcomp.packing.mask_check)
            return Payload([packed], PackedCtx(PACKED, track, tensor, view))
        face, _, words = view.ternary(support, codec)
        codec.gather_values(face, state, tensor)
        scales = codec.local_scales(face, state, changed_here)
        carried = codec.carried_scale(state.carry)
        lay_out = view.lay_out(support, state, tensor.device)
        if carried is None:
            return Payload([scales, view.lanes(words, tensor.device)],
                           PackedCtx(TERNARY, track, tensor, view, face=face, lay_out=lay_out, words=words),
                           ops=(MAX, SUM), whole=(0,) if view.in_rows else ())
        return Payload([codec.one_round_lanes(face, state, scales, *carried, lay_out)],
                       PackedCtx(ONE_ROUND, track, tensor, view, *carried, face=face, lay_out=lay_out, words=words))

    def chained(self, payload: Payload) -> bool:
        return payload.ctx.mode == TERNARY

    def second_round(self, payload: Payload) -> None:
        """Ternarise: fill the lanes from the shared scales (``payload.tensors[0]`` after its MAX all-reduce)."""
        ctx = payload.ctx
        payload.tensors[1] = self.codec.code_words(ctx.face, ctx.track.state, payload.tensors[0][:-2], ctx.lay_out)

    # --- decode ---------------------------------------------------------------------------------------------

    def decompress(self, tensors, ctx: PackedCtx):
        return self.decode(tensors, ctx, ctx.bucket)

    def decode(self, received, ctx: PackedCtx, out: torch.Tensor) -> torch.Tensor:
        """What was received (reduced over the ranks: the bucket's tensors, or this rank's rows under FSDP2) into
        ``out`` (the bucket, or this rank's shard), by the payload's mode."""
        track, view = ctx.track, ctx.view
        if ctx.mode in (TRACKING, DENSE):
            if ctx.mode == TRACKING:
                MaskTracker.receive_flags(track, received[1])
            return view.result(received[0], out)
        support = track.support
        if ctx.mode == PACKED:
            MaskTracker.receive_changed(track, received[0][-1:])
            return view.unpack(support, received[0], out)
        state, codec = track.state, self.codec
        if ctx.mode == TERNARY:
            shared, nonfinite, changed = codec.receive_scales(state.carry, received[0])
            lanes = received[1]
        else:
            shared = ctx.scale
            lanes, nonfinite, changed = codec.receive_lanes(state.carry, received[0], ctx.words, ctx.exponents)
        MaskTracker.receive_changed(track, changed)
        _, own, _ = view.ternary(support, codec)
        return view.unpack(support, codec.decode_values(own, state, shared, nonfinite, lanes, out.dtype), out)

    # --- checkpoint -------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"generator": self.random.state_dict(), "tracker": self.tracker.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"generator": (dict, torch.Tensor), "tracker": dict})
        self.random.load_state_dict(state["generator"])
        self.tracker.load_state_dict(state["tracker"])

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        """Every rank tracks alike: any old rank's tracker goes on; the ternary residuals (error feedback,
        per rank) are summed per bucket layout; the new rank's draws start its own stream."""
        tracker = {}
        for key, entry in every[0]["tracker"].items():
            entry = {k: v for k, v in entry.items() if k != "residual"}
            held = [s["tracker"][key]["residual"] for s in assigned if "residual" in s["tracker"].get(key, {})]
            if held:
                entry["residual"] = torch.stack(held).sum(0)
            tracker[key] = entry
        return {"generator": {}, "tracker": tracker}


ROUNDS_HELP = ("ternary: 1, one all-reduce with the scale carried from the step before (a value above it is "
               "clipped and its excess carried to the rank's next step); 2, the exact shared scale first, unbiased "
               "at every step")


@register("pactrain", paper="Wang, Wu, Li, Kutscher 2025 (PacTrain, arXiv 2505.18563)", fsdp=PacTrainRows)
def pactrain(
    ternary: Annotated[bool, "ternarise the packed entries (shared per-parameter scale, integer lanes)"] = False,
    stable_steps: Annotated[int, Range(1, None), "steps a bucket's masks must stay unchanged before packing "
                                             "(masks changed after install; those of install pack after one step)"] = 5,
    dense_above: Annotated[float, Range(0, 1), "keep a bucket dense when its support keeps more than this"] = 0.9,
    clip: Annotated[float, Range(0, None), "ternary: clip at clip * std per parameter (TernGrad: 2.5; 0 off)"] = 0.0,
    error_feedback: Annotated[bool, "ternary: add what ternarising lost to the next step"] = False,
    seed: Annotated[int, Range(0, None), "seed of the ternary draws (each rank draws its own stream from it)"] = 0,
    check_every: Annotated[int, Range(0, None), "compare a packed bucket's masks with those it froze on every this "
                                                "many steps (edits through .data; 0: never)"] = 10,
    rounds: Annotated[int, Range(1, 2), ROUNDS_HELP] = 1,
) -> Method:
    """PacTrain: only the entries the pruning masks keep are all-reduced, packed densely, once stable."""
    warn_unused_ternary_options("pactrain", ternary, clip=clip > 0, error_feedback=error_feedback, rounds=rounds != 1)
    return Method(PacTrainCompressor(stable_steps, dense_above, ternary, clip, error_feedback, seed,
                                     check_every=check_every, rounds=rounds), NoMemory(),
                  ChainedAllreduceCommunicator())


def warn_unused_ternary_options(method: str, ternary: bool, **set_options: bool) -> None:
    """Warn that the ternary path's options set (``set_options[name]`` true) do nothing without ``ternary``."""
    idle = [name for name, on in set_options.items() if on]
    if idle and not ternary:
        warnings.warn(f"{method}: parameter {' and '.join(map(repr, idle))} has no effect without ternary=True",
                      UserWarning, stacklevel=4)
