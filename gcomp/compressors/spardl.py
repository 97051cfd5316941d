"""``spardl``: SparDL (Zhao et al., arXiv 2304.00737): sparse reduce-scatter and all-gather with global residual
collection, for any number of workers (schedules in ``gcomp.collectives.spardl``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import torch

from gcomp.bucket import BucketInfo
from gcomp.collectives.p2p import run_program
from gcomp.collectives.scheduled import ProgramCommunicator, ScheduledCompressor, ScheduledCtx
from gcomp.collectives.sparse_wire import SparseWire
from gcomp.collectives.spardl import spar_reduce_scatter, spardl_program
from gcomp.compressors.sparse import PositionsParam, ValuesParam, check_wire
from gcomp.memory import NoMemory
from gcomp.method import Method
from gcomp.params import Range
from gcomp.registry import register
from gcomp.sharding import RowStrategy
from gcomp.state_checks import check_state


@dataclass
class _Budget:
    """Spar-All-Gather's adaptive per-team budget h for one bucket layout (docs/algorithms.md §7.2). The union size of a
    step is read on the host at the next step, so the step itself never waits for it; every member of a
    Spar-All-Gather group merges the same union, so they all move h alike. On a GPU it is copied to the host
    without waiting, and read after that copy's event: a value a step old, whose read waits for nothing queued
    since."""

    h: int
    step: int
    inertia: bool = False
    union: torch.Tensor | None = None  # last step's union size, not read yet
    copied: Any = None  # the CUDA event after ``union``'s copy to the host, while it may be in flight

    def remember(self, union: torch.Tensor) -> None:
        """Keep this step's union size for the next step's ``adapt``."""
        if union.is_cuda:
            union = union.to("cpu", non_blocking=True)  # into pinned memory
            self.copied = torch.cuda.Event()
            self.copied.record()
        self.union = union

    def settled(self) -> torch.Tensor | None:
        """``union``, its copy to the host finished."""
        if self.copied is not None:
            self.copied.synchronize()
            self.copied = None
        return self.union

    def adapt(self, k: int, floor: int) -> None:
        if self.union is None:
            return
        union, self.union = int(self.settled()), None
        if (union > k) != (self.step > 0):  # moving the right way: speed up every second step
            if self.inertia:
                self.step *= 2
            self.inertia = not self.inertia
        else:  # overshot: turn round at half the speed
            self.step = int(-0.5 * self.step) if abs(self.step) > 1 else -self.step
            self.inertia = False
        self.h = min(max(self.h + self.step, floor), k)


class SparDLCompressor(ScheduledCompressor):
    """SparDL, per bucket. With P workers in ``teams`` teams of Q, the bucket is zero-padded and cut into Q
    blocks of B entries, and each block is reduced sparsely (``gcomp.collectives.spardl``).

    On the wire, point-to-point only, one message per peer per round: messages of k = max(1, int(density * B))
    entries per block, positions coded (``positions=coded``, the default: per message one code of its blocks'
    positions, ``gcomp.collectives.coded_positions``, the smaller of a bitmap and Elias-Fano's k L + k +
    ceil(n / 2**L) bits, L = max(0, floor(log2(n / k)))) or raw (int32, int64 past 2**31 entries), values in
    ``values`` (the bucket's dtype, bf16, fp16, fp8_e4m3 with one fp32 scale per message or final block);
    2 ceil(log2 Q) rounds (plus ceil(log2 teams) for Spar-All-Gather), and 2 (Q - 1) k entries sent per worker
    and step with one team, about 2 (P - 1) / P * density * n: independent of P. With several teams each final
    block also carries its length (an int32), the teams' messages carry h pairs, and block messages are padded
    to k pairs; Spar-All-Gather and the final all-gather then send raw positions and the bucket's dtype.

    Global residual collection: off a block's final support every rank keeps its own compensated entry; on
    it, what it did not pass on (a partial sum it cut, or 0). So the residuals of all ranks plus the result
    add up to the sum of the compensated buckets (the hook has divided each by P), exactly for any number of teams;
    with narrow values what rounding takes off a sent entry stays with its sender, so that still holds.
    """

    depends_on_layout = True  # blocks are ranges of the flat bucket

    def __init__(self, density: float, teams: int, positions: str = "raw", values: str = "fp32"):
        super().__init__()
        self.density, self.teams = density, teams
        self.wire = SparseWire(*check_wire(positions, values))
        self._budgets: dict[str, _Budget] = {}

    def bind(self, model, group, stats) -> None:
        super().bind(model, group, stats)
        if self.world % self.teams:
            raise ValueError(f"spardl: parameter 'teams' must divide the number of workers ({self.world}); "
                             f"got {self.teams!r}")

    def geometry(self, numel: int, world: int) -> tuple[int, int, int]:
        """``(blocks Q, block size B, entries per block k)`` of a bucket of ``numel`` on ``world`` workers."""
        size = world // self.teams if world % self.teams == 0 else world
        width = max(1, -(-numel // size))
        return size, width, max(1, int(width * self.density))

    def program(self, ctx: ScheduledCtx, rank: int, world: int, keep: bool = True):
        teams = self.teams if world % self.teams == 0 else 1  # a codec decoded alone runs as one worker
        size, width, k = self.geometry(ctx.compensated.numel(), world)
        budget = self._budget(ctx.bucket.key, k, teams) if teams > 1 else None
        h = budget.h if budget is not None else k
        original = ctx.compensated.new_zeros(size * width)
        original[:ctx.compensated.numel()] = ctx.compensated
        blocks = original.clone()
        selection = yield from spardl_program(blocks.view(size, width), rank, world, teams, k, h, self.wire)
        positions = (torch.arange(size, device=blocks.device)[:, None] * width + selection.index).reshape(-1)
        values = selection.values.reshape(-1)
        result = torch.zeros_like(original).index_add_(0, positions, values)  # positions are distinct
        if keep:
            # Global residual collection: the original entry off the final support, the provisional residual on it
            kept = blocks[positions]
            if selection.valid is not None:
                kept = torch.where(selection.valid.reshape(-1), kept, original[positions])
            original[positions] = kept
            self.memory.store(original[:ctx.compensated.numel()], ctx.bucket)
            if budget is not None:
                budget.remember(selection.union)
        return result[:ctx.compensated.numel()]

    def store_residual(self, residual: torch.Tensor, bucket: BucketInfo) -> None:
        """Keep ``residual`` (flat, laid out like ``bucket``) as what this rank did not pass on (FSDP2's rows)."""
        self.memory.store(residual, bucket)

    def _budget(self, key: str, k: int, teams: int) -> _Budget:
        floor = min(max(1, k // teams), k)
        budget = self._budgets.get(key)
        if budget is None:
            budget = self._budgets[key] = _Budget(floor, max(1, (k - floor) // 100) if k > floor else 0)
        budget.adapt(k, floor)
        return budget

    def state_dict(self) -> dict:
        budgets = {key: {"h": b.h, "step": b.step, "inertia": b.inertia, "union": b.settled()}
                   for key, b in self._budgets.items()}
        return {**super().state_dict(), "budgets": budgets}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"memory": dict}, {"budgets": dict})
        budgets = state.get("budgets", {})  # none after a resize: the budgets adapt afresh
        for key, b in budgets.items():
            check_state(f"spardl budget {key!r}", b, {"h": int, "step": int, "inertia": bool},
                        {"union": (torch.Tensor, type(None))})
            if b["h"] < 1:
                raise ValueError(f"spardl budget {key!r}: 'h' must be at least 1, got {b['h']}")
            union = b.get("union")
            if union is not None and (union.numel() != 1 or union.is_floating_point() or union.is_complex()):
                raise ValueError(f"spardl budget {key!r}: 'union' must be one integer (the last step's union size), "
                                 f"got a {union.dtype} tensor of {union.numel()} entries")
        super().load_state_dict({"memory": state["memory"]})
        self._budgets = {key: _Budget(b["h"], b["step"], b["inertia"], b.get("union")) for key, b in budgets.items()}


class SparDLRows(RowStrategy):
    """Under FSDP2, SparDL's Spar-Reduce-Scatter *is* the reduce-scatter. On the wire, point-to-point only
    (``gcomp.collectives.spardl.spar_reduce_scatter``, run by ``gcomp.collectives.p2p.run_program``): FSDP's input
    viewed as (world, S) is SparDL's blocks, block r being rank r's shard. In ceil(log2 world) rounds every block
    but a rank's own is sent once, as the top k = max(1, int(density * S)) of what has accumulated in it,
    (position, value) pairs as ``positions`` and ``values`` make them (coded and fp32 by default, as under DDP):
    (world - 1) k pairs per rank and call, each message's sections padded to 8 bytes. The rank's own block, its partial sums added in, is its output shard, dense: SparDL's final top-k and
    all-gather are not needed, since FSDP wants only the shard.

    Error feedback on the rank's full unsharded input (the compressor's own memory, per (parameter, shard)
    piece): what it did not pass on of the other blocks (its own entries and the partial sums it cut) is its
    residual. The residuals of all ranks plus the shards add up to the sum of the inputs, exactly. ``teams`` must
    be 1 (Spar-All-Gather has no place in a reduce-scatter). On another number of shards the residuals are
    re-sharded by parameter; the adaptive budgets, kept per layout, adapt afresh (as after a resize under DDP).
    """

    reshards = True

    def check(self, method) -> None:
        if method.compressor.teams != 1:
            raise ValueError(f"spardl under FSDP2 takes teams=1 (its Spar-All-Gather across teams has no place in a "
                             f"reduce-scatter); got teams={method.compressor.teams}")

    def compress(self, compressor: SparDLCompressor, tensor, layout):
        return compressor.compress(tensor, layout.pieces)  # the input plus this rank's residual

    def exchange(self, payload, compressor: SparDLCompressor, layout, group, stats):
        width = layout.shard_numel
        blocks = payload.ctx.compensated.reshape(layout.world, width).clone()
        program = spar_reduce_scatter(blocks, layout.rank, max(1, int(width * compressor.density)), lambda m: m,
                                      compressor.wire)
        _, sent, messages = run_program(program, group, device=blocks.device, stats=stats)
        stats["bytes_sent"] += sent
        stats["messages"] += messages
        return [blocks]

    def decode(self, compressor: SparDLCompressor, received, payload, layout, output):
        blocks, = received
        output.copy_(blocks[layout.rank])
        blocks[layout.rank].zero_()
        compressor.store_residual(blocks.view(-1), payload.ctx.bucket)  # what this rank did not pass on


@register("spardl", paper="Zhao et al., SparDL, arXiv 2304.00737 (2023)", fsdp=SparDLRows)
def spardl(density: Annotated[float, Range(0, 1, low_open=True), "fraction of each block's entries sent"] = 0.01,
           teams: Annotated[int, Range(1, None), "teams for Spar-All-Gather (must divide the workers)"] = 1,
           positions: PositionsParam = "coded", values: ValuesParam = "fp32") -> Method:
    """SparDL: top-k per block by Spar-Reduce-Scatter (any worker count), optional Spar-All-Gather across
    teams, Bruck all-gather, and global residual collection; point-to-point messages only."""
    return Method(SparDLCompressor(density, teams, positions, values), NoMemory(), ProgramCommunicator())
