"""Point-to-point codecs: a message schedule of their own (SparDL, gTop-k), and a residual known only after it."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.collectives.p2p import Program, run_locally, run_program
from gcomp.core import POINT_TO_POINT, Communicator, Compressor, Payload, check_state
from gcomp.memory import ResidualMemory


@dataclass
class ScheduledCtx:
    """One bucket in flight: its layout and the gradient plus the residual held back for it."""

    bucket: BucketInfo
    compensated: torch.Tensor


class ScheduledCompressor(Compressor):
    """Base of the point-to-point methods. ``compress`` only adds the residual; the selection happens inside
    the rounds (``program``), because what a rank sends depends on what it has received; the program
    returns the mean gradient and stores the new residual itself (``self.memory.store``), which is why the
    method's ``Memory`` is ``NoMemory``. Residuals are kept per parameter across bucket rebuilds and
    checkpoints, as ``ResidualMemory`` keeps them.

    Decoded alone (``decompress`` of a payload that was never exchanged), a rank's payload is what the
    method does on one worker: the top entries of its compensated bucket. Nothing is stored then.
    """

    collective = POINT_TO_POINT
    decodes_alone = False  # the result depends on every rank's gradient jointly
    stateful = True

    def __init__(self):
        self.memory = ResidualMemory()
        self.world = 1

    def bind(self, model, group, stats) -> None:
        self.world = dist.get_world_size(group)

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Payload:
        return Payload([], ScheduledCtx(bucket, self.memory.compensate(tensor, bucket)))

    @abstractmethod
    def program(self, ctx: ScheduledCtx, rank: int, world: int, keep: bool = True) -> Program:
        """This rank's rounds for one bucket (``gcomp.collectives.p2p``); returns the mean gradient (the
        bucket's shape and dtype). With ``keep`` the new residual (and any adaptive state) is stored; without,
        nothing is touched. Called by ``ProgramCommunicator.exchange``, once per bucket and step."""

    def decompress(self, tensors, ctx: ScheduledCtx) -> torch.Tensor:
        return run_locally([self.program(ctx, 0, 1, keep=False)])[0]

    def state_dict(self) -> dict:
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"memory": dict})
        self.memory.load_state_dict(state["memory"])

    def parameter_state(self, state: dict) -> dict:
        return self.memory.parameter_state(state["memory"])

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return {"memory": self.memory.merge_states([s["memory"] for s in assigned], [], rank)}


class ProgramCommunicator(Communicator):
    """Runs the compressor's round program (``compressor.program(ctx, rank, world)``) on the process group.

    The rounds run, and are waited for, in ``exchange`` itself: each round's messages depend on the last
    one's, and gloo's point-to-point work has no future to chain on. The future it returns is already
    complete and holds ``[result]``. The bytes of every message this rank sends are added to
    ``stats["bytes_sent"]`` (the payload itself is empty), and their count to ``stats["messages"]``.
    """

    collective = POINT_TO_POINT
    stat_keys = ("messages",)

    def exchange(self, payload: Payload, compressor: ScheduledCompressor, group: dist.ProcessGroup | None,
                 stats: dict | None = None) -> torch.futures.Future:
        ctx: ScheduledCtx = payload.ctx
        program = compressor.program(ctx, dist.get_rank(group), dist.get_world_size(group))
        result, sent, messages = run_program(program, group, device=ctx.compensated.device, stats=stats)
        if stats is not None:
            stats["bytes_sent"] += sent
            stats["messages"] += messages
        future = torch.futures.Future()
        future.set_result([result])
        return future
