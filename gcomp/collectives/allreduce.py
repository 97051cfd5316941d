"""Element-wise SUM all-reduce of every payload tensor."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp.core import ALLREDUCE, Communicator, Compressor, Payload


class AllreduceCommunicator(Communicator):
    """One asynchronous SUM all-reduce per payload tensor (reduced in place), then ``decompress`` of the sums.

    Needs codecs whose payloads can be added on the wire (``collective = "allreduce"``).
    """

    collective = ALLREDUCE

    def exchange(self, payload: Payload, compressor: Compressor, group: dist.ProcessGroup | None
                 ) -> torch.futures.Future:
        futures = [dist.all_reduce(t, group=group, async_op=True).get_future() for t in payload.tensors]
        if len(futures) == 1:
            return futures[0]  # its value is already the one-element list [sum]
        return torch.futures.collect_all(futures).then(lambda f: [x.value()[0] for x in f.value()])

    def decode(self, received: list[torch.Tensor], compressor: Compressor, ctx) -> torch.Tensor:
        return compressor.decompress(received, ctx)
