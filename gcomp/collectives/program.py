"""Point-to-point methods (SparDL, gTop-k): a codec whose rounds are a program of messages, written once, run on a
process group (``ProgramCommunicator``) or simulated for every rank in one process (``run_locally``).

A *program* is a generator, one per rank. Each ``yield Round(sends, recvs)`` is one latency round: at most
one message to each peer and one from each peer, every message a flat uint8 tensor whose size both sides
know in advance (so no size travels on the wire). The generator is resumed with ``{peer: received message}``
and finally returns its result. ``run_program`` runs one rank's program over torch.distributed
(``batch_isend_irecv``: gloo and NCCL alike, one message per peer per round); ``run_locally`` runs all ranks'
programs in lockstep inside one process, which is how schedules are tested for any number of workers.
"""
from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Generator, Sequence

import torch
import torch.distributed as dist

from gcomp.collectives.launch import count_p2p_round, round_work
from gcomp.core import POINT_TO_POINT, Communicator, Compressor, Payload

_ALIGN = 8  # every section starts at a multiple of 8 bytes, so any dtype can be viewed in place


@dataclass
class Round:
    """One latency round of a program: ``sends`` maps a peer (rank in the group) to the message for it,
    ``recvs`` maps a peer to the number of bytes expected from it. Either may be empty."""

    sends: dict[int, torch.Tensor] = field(default_factory=dict)
    recvs: dict[int, int] = field(default_factory=dict)


Program = Generator[Round, dict, Any]


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def message_nbytes(sections: Sequence[tuple[torch.dtype, int]]) -> int:
    """Size of a message packed from tensors of these ``(dtype, numel)``."""
    return sum(_padded(numel * dtype.itemsize) for dtype, numel in sections)


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One flat uint8 message holding ``tensors`` (flattened), each section aligned to 8 bytes."""
    device = tensors[0].device if tensors else None
    out = torch.zeros(message_nbytes([(t.dtype, t.numel()) for t in tensors]), dtype=torch.uint8, device=device)
    start = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        out[start:start + nbytes].view(t.dtype).copy_(t.reshape(-1))
        start += _padded(nbytes)
    return out


def unpack(message: torch.Tensor, sections: Sequence[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """The flat tensors of a ``pack``-ed message, as views into it."""
    out, start = [], 0
    for dtype, numel in sections:
        nbytes = numel * dtype.itemsize
        out.append(message[start:start + nbytes].view(dtype))
        start += _padded(nbytes)
    if start != message.numel():
        raise ValueError(f"message of {message.numel()} bytes, sections need {start}")
    return out


def run_program(program: Program, group: dist.ProcessGroup | None = None,
                device: torch.device | str = "cpu", stats: dict | None = None) -> tuple[Any, int, int]:
    """Run one rank's program on ``group``; returns ``(its result, bytes this rank sent, messages sent)``.

    Receive buffers are allocated on ``device``. Each round with traffic on this rank is counted in ``stats``
    (``gcomp.collectives.launch.count_p2p_round``), and the program's own work between rounds (selections,
    merges) is timed as ``round_work_s``. Each round posts all its sends and receives at once and
    waits for them (gloo's point-to-point work has no future, and the next round depends on this one).
    Zero-byte messages are skipped on both sides.
    """
    sent = messages = 0
    try:
        with round_work(stats):
            plan = next(program)
        while True:
            ops, received, round_sent = [], {}, 0
            for peer, message in plan.sends.items():
                if message.numel():
                    ops.append(dist.P2POp(dist.isend, message, group=group, group_peer=peer))
                    round_sent += message.numel()
                    messages += 1
            for peer, nbytes in plan.recvs.items():
                buffer = received[peer] = torch.empty(nbytes, dtype=torch.uint8, device=device)
                if nbytes:
                    ops.append(dist.P2POp(dist.irecv, buffer, group=group, group_peer=peer))
            sent += round_sent
            count_p2p_round(stats, round_sent, sum(plan.recvs.values()))
            if ops:
                for work in dist.batch_isend_irecv(ops):
                    work.wait()
            with round_work(stats):
                plan = program.send(received)
    except StopIteration as done:
        return done.value, sent, messages


def run_locally(programs: Sequence[Program]) -> list[Any]:
    """Run every rank's program (``programs[r]`` is rank r's) in lockstep in this process; returns their
    results in rank order. A message nobody receives, a receive nobody sends, or a size mismatch raises:
    this is where schedules are checked. All programs must take the same number of rounds."""
    world = len(programs)
    plans: list[Round | None] = [None] * world
    results: list[Any] = [None] * world
    finished = [False] * world
    for r, p in enumerate(programs):
        try:
            plans[r] = next(p)
        except StopIteration as done:  # a program with no rounds (one worker)
            results[r], finished[r] = done.value, True
    round_index = 0
    while not all(finished):
        if any(finished):
            raise RuntimeError(f"round {round_index}: ranks {[r for r in range(world) if finished[r]]} finished, "
                               "the others did not")
        mail = {(src, dst): m for src, plan in enumerate(plans) for dst, m in plan.sends.items()}
        for src, dst in mail:
            if not 0 <= dst < world or dst == src:
                raise RuntimeError(f"round {round_index}: rank {src} sends to rank {dst}")
        for dst, plan in enumerate(plans):
            received = {}
            for src, nbytes in plan.recvs.items():
                message = mail.pop((src, dst), None)
                if message is None:
                    raise RuntimeError(f"round {round_index}: rank {dst} waits for rank {src}, which sends nothing")
                if message.numel() != nbytes:
                    raise RuntimeError(f"round {round_index}: rank {src} sends {message.numel()} bytes to rank {dst}, "
                                       f"which expects {nbytes}")
                received[src] = message.clone()
            try:
                plans[dst] = programs[dst].send(received)
            except StopIteration as done:
                results[dst], finished[dst] = done.value, True
        if mail:
            raise RuntimeError(f"round {round_index}: messages {sorted(mail)} (src, dst) were never received")
        round_index += 1
    return results


@dataclass
class ProgramCtx:
    """One bucket in flight: its layout, the gradient plus the residual held back for it (``compensated``), and the
    layout's state, which the program updates in place (its new residual)."""

    bucket: Any
    compensated: torch.Tensor
    state: dict


class ScheduledCompressor(Compressor):
    """A point-to-point codec: what a rank sends depends on what it has received, so the selection happens inside
    the rounds (``program``), and the program writes the new residual into the layout's ``"residuals"`` slot itself
    (declare ``slots=("residuals",), held=("residuals",)``; the method's ``Memory`` is ``NoMemory``). ``encode``
    adds the residual; one rank's payload decoded alone is what the method does on one worker."""

    def encode(self, x, state, layout):
        return Payload([], ProgramCtx(layout, x + state["residuals"].view_as(x), state)), state

    @abstractmethod
    def program(self, ctx: ProgramCtx, rank: int, world: int, keep: bool = True) -> Program:
        """This rank's rounds for one bucket; returns the mean gradient. With ``keep`` the new residual (and any
        adaptive state) is stored; without, nothing is touched."""

    def decode(self, received, ctx: ProgramCtx) -> torch.Tensor:
        if received:  # the exchange's result
            return received[0]
        return run_locally([self.program(ctx, 0, 1, keep=False)])[0]


class ProgramCommunicator(Communicator):
    """Runs the compressor's program on the group, its rounds waited for in ``exchange`` (each round's messages
    depend on the last one's; gloo's point-to-point work has no future to chain on): a completed future of
    ``[result]``. Every message's bytes go to ``bytes_sent`` (the payload is empty), their count to ``messages``."""

    collective = POINT_TO_POINT
    codec = ScheduledCompressor
    stat_keys = ("messages",)

    def exchange(self, payload, compressor: ScheduledCompressor, group, stats=None):
        ctx = payload.ctx
        program = compressor.program(ctx, dist.get_rank(group), dist.get_world_size(group))
        result, sent, messages = run_program(program, group, device=ctx.compensated.device, stats=stats)
        if stats is not None:
            stats["bytes_sent"] += sent
            stats["messages"] += messages
        future = torch.futures.Future()
        future.set_result([result])
        return future
