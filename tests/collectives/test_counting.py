"""``gcomp.collectives.counting``: what each communicator launches, counted in the hook's stats (collectives and
bytes per kind, sequential rounds, point-to-point rounds and their busier direction, codec work between
rounds). One job on 2 gloo ranks runs a bucket through every kind of communicator."""
from __future__ import annotations

import torch
import torch.distributed as dist

import gcomp
from gcomp import BucketInfo, Payload
from gcomp.collectives import launch as counting
from gcomp.collectives.gather import AllgatherCommunicator
from gcomp.collectives.program import Round, run_program
from gcomp.collectives.reduce import ChainedAllreduceCommunicator, ChainedCompressor
from gcomp.collectives.sized import SizedAllgatherCommunicator, SizedCompressor
from gcomp.core import MAX, SUM
from gcomp.run_state import STAT_KEYS as _STAT_KEYS
from tests.distributed import run_ranks

N = 1000  # entries of the fp32 bucket


def _fresh() -> dict:
    return {key: 0.0 if key.endswith("_s") else 0 for key in _STAT_KEYS}


def _launched(stats: dict) -> dict:
    return {key: stats[key] for key in counting.COUNTER_KEYS if key != "round_work_s"}


class _TwoRounds(ChainedCompressor):
    """Round 1: one scale (MAX); round 2: the bucket over it (SUM)."""

    def encode(self, tensor, state, bucket):
        return Payload([tensor.abs().amax().reshape(1), tensor.clone()], ctx=tensor, ops=(MAX, SUM)), state

    def second_round(self, payload):
        payload.tensors[1] = payload.ctx / payload.tensors[0]

    def decode(self, tensors, ctx):
        return tensors[1] * tensors[0]


class _Rows(SizedCompressor):
    """A sized codec whose one tensor is ``count`` rows long."""

    traits = gcomp.Traits(collective=gcomp.ALLGATHER)

    def encode(self, tensor, state, bucket):
        return Payload([tensor]), state

    def rows(self, ctx, count):
        return [count]

    def decode(self, received, ctx):
        return received


def _uneven(rank: int):
    """A 2-rank program: rank 0 sends 16 bytes and receives 40, then an empty round, then rank 1 sends 8."""
    peer = 1 - rank
    mine, theirs = (16, 40) if rank == 0 else (40, 16)
    yield Round({peer: torch.zeros(mine, dtype=torch.uint8)}, {peer: theirs})
    yield Round()
    if rank == 1:
        yield Round({0: torch.zeros(8, dtype=torch.uint8)})
    else:
        yield Round(recvs={1: 8})


def _job() -> dict:
    rank = dist.get_rank()
    grad = torch.arange(N, dtype=torch.float32) + rank
    info = BucketInfo.single(grad)
    out = {}
    for name in ("identity", "fp16"):
        stats = _fresh()
        gcomp.create(name).reduce(grad.clone(), info, None, stats).wait()
        out[name] = _launched(stats)
    stats = _fresh()
    comp, comm = _TwoRounds(), ChainedAllreduceCommunicator()
    payload, _ = comp.encode(grad.clone(), {}, info)
    comm.exchange(payload, comp, None, stats).wait()
    out["chained"] = _launched(stats)
    stats = _fresh()
    AllgatherCommunicator().exchange(Payload([grad[:10].clone(), grad[:4].to(torch.int64)]), comp, None,
                                     stats).wait()
    out["allgather"] = _launched(stats)
    stats = {**_fresh(), "padding_bytes": 0}
    SizedAllgatherCommunicator().exchange(Payload([grad[:3 + 2 * rank].clone()]), _Rows(), None, stats).wait()
    out["sized"] = _launched(stats)
    stats = _fresh()
    run_program(_uneven(rank), stats=stats)
    out["p2p"] = _launched(stats)
    out["p2p_work"] = stats["round_work_s"]
    return out


def _counts(rounds=0, allreduce=(0, 0), allgather=(0, 0), p2p=(0, 0)) -> dict:
    return {"rounds": rounds, "allreduce_calls": allreduce[0], "allreduce_bytes": allreduce[1],
            "allgather_calls": allgather[0], "allgather_bytes": allgather[1], "p2p_rounds": p2p[0],
            "p2p_bytes": p2p[1]}


def test_each_communicator_counts_what_it_launches():
    ranks = run_ranks(2, _job)
    for rank, out in enumerate(ranks):
        assert out["identity"] == _counts(rounds=1, allreduce=(1, 4 * N)), f"rank {rank}"
        assert out["fp16"] == _counts(rounds=1, allreduce=(1, 2 * N)), f"rank {rank}"
        # a waited MAX of one scale, then the bucket: two rounds, two all-reduces
        assert out["chained"] == _counts(rounds=2, allreduce=(2, 4 + 4 * N)), f"rank {rank}"
        assert out["allgather"] == _counts(rounds=1, allgather=(2, 4 * 10 + 8 * 4)), f"rank {rank}"
        # the size (one int64), waited; then rank 1's 5 entries, rank 0's 3 padded to 5
        assert out["sized"] == _counts(rounds=2, allgather=(2, 8 + 4 * 5)), f"rank {rank}"
        # the empty round is not one; each round counts its busier direction (40 bytes, then 8)
        assert out["p2p"] == _counts(rounds=2, p2p=(2, 40 + 8)), f"rank {rank}"
        assert isinstance(out["p2p_work"], float) and out["p2p_work"] >= 0.0


def test_counting_only_touches_declared_keys():
    stats = {"bytes_sent": 0, "allreduce_calls": 0}
    counting.count_collectives(stats, "allreduce", [torch.zeros(3), torch.zeros(2, dtype=torch.float16)])
    counting.count_round(stats)
    counting.count_p2p_round(stats, 8, 16)
    counting.count_collectives(None, "allgather", [torch.zeros(3)])  # outside a hook: nothing to count into
    assert stats == {"bytes_sent": 0, "allreduce_calls": 2}


def test_round_work_times_its_block_even_when_it_raises(monkeypatch):
    ticks = iter([10.0, 12.5, 20.0, 20.25])
    monkeypatch.setattr(counting.time, "perf_counter", lambda: next(ticks))
    stats = {"round_work_s": 0.0}
    with counting.round_work(stats):
        pass
    try:
        with counting.round_work(stats):
            raise StopIteration
    except StopIteration:
        pass
    assert stats["round_work_s"] == 2.75


def test_the_hook_declares_every_counter():
    assert set(counting.COUNTER_KEYS) <= set(_STAT_KEYS)
