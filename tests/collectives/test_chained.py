"""``gcomp.collectives.reduce``'s chained rounds: the two chained all-reduce rounds (the first reduced with its op and waited for,
``second_round`` computed from its result, then the rest), and one round with per-tensor ops when a payload is
not chained. 3 gloo ranks, several buckets in flight as DDP has them."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp import BucketInfo, Payload
from gcomp.collectives.reduce import ChainedAllreduceCommunicator, ChainedCompressor
from gcomp.core import MAX, SUM
from tests.distributed import run_ranks


class _ScaledByMax(ChainedCompressor):
    """Round 1: MAX of each rank's value; round 2: each rank's value divided by that shared maximum (SUM).
    ``ctx`` True: two rounds; False: one round of [value (SUM), value (MAX)]."""

    def __init__(self):
        self.seen = []

    def encode(self, tensor, state, bucket):
        two = bool(bucket.index % 2 == 0)
        if two:
            return Payload([tensor.clone(), torch.zeros_like(tensor)], ctx=(two, tensor), ops=(MAX, SUM)), state
        return Payload([tensor.clone(), tensor.clone()], ctx=(two, tensor), ops=(SUM, MAX)), state

    def chained(self, payload):
        return payload.ctx[0]

    def second_round(self, payload):
        self.seen.append(payload.tensors[0].clone())  # the shared maximum, already reduced
        payload.tensors[1] = payload.ctx[1] / payload.tensors[0]

    def decode(self, tensors, ctx):
        return torch.cat(tensors)


def _job() -> dict:
    rank = dist.get_rank()
    comp, comm = _ScaledByMax(), ChainedAllreduceCommunicator()
    futures = []
    for index in range(4):  # all launched before any is waited for
        x = torch.tensor([1.0 + rank, 10.0 - rank]) * (index + 1)
        payload, _ = comp.encode(x, {}, BucketInfo.single(x, index=index))
        futures.append((comm.exchange(payload, comp, None, {"bytes_sent": 0}), payload))
    return {"results": [comp.decode(f.wait(), p.ctx) for f, p in futures], "seen": comp.seen}


def test_two_rounds_share_the_first_result_and_one_round_keeps_each_tensors_op():
    ranks = run_ranks(3, _job)
    for r in ranks:
        for index, result in enumerate(r["results"]):
            values = torch.tensor([[1.0 + k, 10.0 - k] for k in range(3)]) * (index + 1)
            if index % 2 == 0:  # MAX, then the SUM of every rank's value over that maximum
                top = values.amax(0)
                torch.testing.assert_close(result, torch.cat([top, (values / top).sum(0)]))
            else:  # one round: SUM of the first tensor, MAX of the second
                assert torch.equal(result, torch.cat([values.sum(0), values.amax(0)]))
        assert [s.tolist() for s in r["seen"]] == [[3.0, 10.0], [9.0, 30.0]]  # buckets 0 and 2
