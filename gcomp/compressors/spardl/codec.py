"""SparDL's codec: blocks, global residual collection, Spar-All-Gather's adaptive budget, FSDP2's rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gcomp.collectives.program import ProgramCtx, ScheduledCompressor
from gcomp.collectives.sparse_wire import SparseWire
from gcomp.compressors.spardl.schedule import spar_reduce_scatter, spardl_program
from gcomp.core import POINT_TO_POINT, Keeps, Traits
from gcomp.sharding import ShardLayout
from gcomp.state_checks import check_state


@dataclass
class Budget:
    """Spar-All-Gather's adaptive per-team budget h for one bucket layout (docs/algorithms.md §7.2). A step's union
    size is read on the host at the next step, so the step never waits for it; every member of a Spar-All-Gather
    group merges the same union, so they all move h alike. On a GPU it is copied to the host without waiting and read
    after that copy's event: a value a step old, whose read waits for nothing queued since."""

    h: int
    step: int
    inertia: bool = False
    union: torch.Tensor | None = None  # last step's union size, not read yet
    copied: Any = None  # the CUDA event after ``union``'s copy to the host, while it may be in flight

    def remember(self, union: torch.Tensor) -> None:
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
    """SparDL, per bucket (``gcomp.compressors.spardl.schedule``). With P workers in ``teams`` teams of Q, the bucket is
    zero-padded and cut into Q blocks of B entries, and each block is reduced sparsely.

    On the wire, point-to-point only, one message per peer per round: messages of k = max(1, int(density * B)) entries
    per block, positions coded (per message one code of its blocks' positions, the smaller of a bitmap and
    Elias-Fano) or raw (int32, int64 past 2**31 entries), values in ``values`` (the bucket's dtype, bf16, fp16,
    fp8_e4m3 with one fp32 scale per message or final block); 2 ceil(log2 Q) rounds (plus ceil(log2 teams) for
    Spar-All-Gather), and 2 (Q - 1) k entries sent per worker and step with one team, about 2 (P - 1) / P * density
    * n: independent of P. With several teams each final block also carries its length (an int32), the teams'
    messages carry h pairs (h adapts per layout, ``Budget``), block messages are padded to k pairs, and
    Spar-All-Gather and the final all-gather send raw positions and the bucket's dtype.

    Global residual collection (the ``residuals`` slot): off a block's final support every rank keeps its own
    compensated entry; on it, what it did not pass on (a partial sum it cut, or 0). So the residuals of all ranks plus
    the result add up to the sum of the compensated buckets, exactly for any number of teams; with narrow values what
    rounding takes off a sent entry stays with its sender.

    Under FSDP2 Spar-Reduce-Scatter *is* the reduce-scatter (``teams`` must be 1): the input viewed as (world, S) is
    the blocks, block r being rank r's shard, each other block sent once as the top k = max(1, int(density * S)) of
    what has accumulated in it: (world - 1) k pairs per rank and call. The own block, its partial sums added in, is
    the output shard, dense; what the rank did not pass on of the other blocks is its residual."""

    def __init__(self, density: float, teams: int, positions: str = "raw", values: str = "fp32"):
        self.density, self.teams = density, teams
        self.wire = SparseWire(positions, values)
        self.budgets: dict[str, Budget] = {}
        self.traits = Traits(POINT_TO_POINT, self.wire.fidelity, Keeps.LAYOUT, slots=("residuals",), held=("residuals",),
                             rows="native" if teams == 1 else None, decodes_alone=False, depends_on_layout=True)

    def bind(self, model, group, stats) -> None:
        world = dist.get_world_size(group)
        if world % self.teams:
            raise ValueError(f"spardl: parameter 'teams' must divide the number of workers ({world}); "
                             f"got {self.teams!r}")

    def geometry(self, numel: int, world: int) -> tuple[int, int, int]:
        """``(blocks Q, block size B, entries per block k)`` of a bucket of ``numel`` on ``world`` workers."""
        size = world // self.teams if world % self.teams == 0 else world
        width = max(1, -(-numel // size))
        return size, width, max(1, int(width * self.density))

    def program(self, ctx: ProgramCtx, rank: int, world: int, keep: bool = True):
        if isinstance(ctx.bucket, ShardLayout):
            return (yield from self._rows(ctx, world, keep))
        x = ctx.compensated.reshape(-1)
        n = x.numel()
        teams = self.teams if world % self.teams == 0 else 1  # a payload decoded alone runs as one worker
        size, width, k = self.geometry(n, world)
        budget = self._budget(ctx.bucket.key, k, teams) if teams > 1 else None
        original = x.new_zeros(size * width)
        original[:n] = x
        blocks = original.clone()
        selection = yield from spardl_program(blocks.view(size, width), rank, world, teams, k,
                                              budget.h if budget is not None else k, self.wire)
        positions = (torch.arange(size, device=x.device)[:, None] * width + selection.index).reshape(-1)
        result = torch.zeros_like(original).index_add_(0, positions, selection.values.reshape(-1))  # distinct
        if keep:  # the original entry off the final support, the provisional residual on it
            kept = blocks[positions]
            if selection.valid is not None:
                kept = torch.where(selection.valid.reshape(-1), kept, original[positions])
            original[positions] = kept
            torch.nan_to_num(original[:n], nan=0.0, posinf=0.0, neginf=0.0, out=ctx.state["residuals"].view(-1))
            if budget is not None:
                budget.remember(selection.union)
        return result[:n]

    def _rows(self, ctx: ProgramCtx, world: int, keep: bool):
        """FSDP2: this rank's shard, the input's blocks reduced by Spar-Reduce-Scatter (decoded alone: its own)."""
        layout = ctx.bucket
        blocks = ctx.compensated.reshape(layout.world, -1).clone()
        if world > 1:
            k = max(1, int(blocks.shape[1] * self.density))
            yield from spar_reduce_scatter(blocks, layout.rank, k, lambda m: m, self.wire)
        out = blocks[layout.rank].clone()
        if keep:
            blocks[layout.rank].zero_()
            torch.nan_to_num(blocks.view(-1), nan=0.0, posinf=0.0, neginf=0.0, out=ctx.state["residuals"].view(-1))
        return out

    def _budget(self, key: str, k: int, teams: int) -> Budget:
        floor = min(max(1, k // teams), k)
        budget = self.budgets.get(key)
        if budget is None:
            budget = self.budgets[key] = Budget(floor, max(1, (k - floor) // 100) if k > floor else 0)
        budget.adapt(k, floor)
        return budget

    def state_dict(self) -> dict:
        return {"budgets": {key: {"h": b.h, "step": b.step, "inertia": b.inertia, "union": b.settled()}
                            for key, b in self.budgets.items()}}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {}, {"budgets": dict})
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
        self.budgets = {key: Budget(b["h"], b["step"], b["inertia"], b.get("union")) for key, b in budgets.items()}

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        """The residuals are summed by the method; the budgets adapt afresh."""
        return {}
