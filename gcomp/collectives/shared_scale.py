"""Two rounds for codecs that quantise against a scale every rank shares: MAX of the scales, then SUM of lanes."""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gcomp.core import ALLREDUCE, Communicator, Compressor, Payload


class SharedScaleCommunicator(Communicator):
    """MAX all-reduce of ``payload.tensors[0]`` (the scales), then SUM all-reduce of ``payload.tensors[1]``.

    The codes depend on the shared scale, so the MAX round runs, and is waited for, in ``exchange`` itself
    (before the hook returns: never inside a ``.then`` callback, which deadlocks gloo with several buckets).
    ``compressor.ternarise(payload)`` then fills the integer lanes (``payload.tensors[1]``, already of their
    final size so ``bytes_sent`` counts them) from the shared scales, and their SUM runs asynchronously.
    ``decompress`` receives ``[shared scales, summed lanes]``.
    """

    collective = ALLREDUCE

    def exchange(self, payload: Payload, compressor: Compressor, group: dist.ProcessGroup | None
                 ) -> torch.futures.Future:
        scales = payload.tensors[0]
        dist.all_reduce(scales, dist.ReduceOp.MAX, group=group)
        compressor.ternarise(payload)
        return dist.all_reduce(payload.tensors[1], group=group, async_op=True).get_future().then(
            lambda f: [scales, f.value()[0]])

    def decode(self, received: list[torch.Tensor], compressor: Compressor, ctx: Any) -> torch.Tensor:
        return compressor.decompress(received, ctx)
