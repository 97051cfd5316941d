"""What SparDL and gTop-k share: a message schedule of their own, and a residual known only after it."""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gcomp.bucket import BucketInfo
from gcomp.collectives.p2p import Program, run_locally
from gcomp.core import POINT_TO_POINT, Compressor, Payload
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
        self.stats: dict = {}
        self.world = 1

    def bind(self, model, group, stats) -> None:
        self.stats = stats
        self.world = dist.get_world_size(group)

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Payload:
        return Payload([], ScheduledCtx(bucket, self.memory.compensate(tensor, bucket)))

    @abstractmethod
    def program(self, ctx: ScheduledCtx, rank: int, world: int, keep: bool = True) -> Program:
        """This rank's rounds for one bucket; returns the mean gradient (the bucket's shape and dtype). With
        ``keep`` the new residual (and any adaptive state) is stored; without, nothing is touched."""

    def decompress(self, tensors, ctx: ScheduledCtx) -> torch.Tensor:
        return run_locally([self.program(ctx, 0, 1, keep=False)])[0]

    def device(self, ctx: ScheduledCtx) -> torch.device:
        return ctx.compensated.device

    def state_dict(self) -> dict:
        return {"memory": self.memory.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state) - {"memory"}
        if unknown:
            raise ValueError(f"{type(self).__name__}: unexpected keys {sorted(unknown)}")
        self.memory.load_state_dict(state["memory"])


def keep_top(values: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest magnitudes of a flat tensor (NaN and infinities first), unsorted."""
    return torch.topk(values.abs(), k, sorted=False).indices
