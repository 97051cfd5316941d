"""Element-wise all-reduce of every payload tensor (SUM, or the op the payload names for a tensor)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp.collectives.counting import count_collectives, count_round
from gcomp.collectives.futures import launched
from gcomp.core import ALLREDUCE, Communicator, Compressor, Payload


def all_reduce_all(payload: Payload, group: dist.ProcessGroup | None, start: int = 0,
                   stats: dict | None = None) -> torch.futures.Future:
    """Asynchronous in-place all-reduce of ``payload.tensors[start:]``, each with its op; a future of their list.
    Counted in ``stats`` (``gcomp.collectives.counting``) as one round of that many all-reduces."""
    futures = [launched(dist.all_reduce(t, payload.op(i), group=group, async_op=True))
               for i, t in enumerate(payload.tensors) if i >= start]
    count_collectives(stats, "allreduce", payload.tensors[start:])
    count_round(stats)
    if len(futures) == 1:
        return futures[0]  # its value is already the one-element list [result]
    return torch.futures.collect_all(futures).then(lambda f: [x.value()[0] for x in f.value()])


class AllreduceCommunicator(Communicator):
    """One asynchronous all-reduce per payload tensor (reduced in place; SUM unless ``payload.ops`` says MAX),
    then ``decompress`` of the results.

    Needs codecs whose payloads can be added on the wire (``collective = "allreduce"``).
    """

    collective = ALLREDUCE

    def exchange(self, payload: Payload, compressor: Compressor, group: dist.ProcessGroup | None,
                 stats: dict | None = None) -> torch.futures.Future:
        return all_reduce_all(payload, group, stats=stats)
