"""One rank of a two-process run that ends right after its last step (``tests/test_exit.py``).

    python tests/exit_jobs.py RANK WORLD PORT

Three training steps with ``topk``, then one reduction called by hand, outside a backward pass (as ``gcomp
bench``'s codec table does). Every all-gather's completion also runs a callback that sleeps a second on gloo's
worker thread after the future DDP waits for has completed: the widest form of the race in which the main
thread reaches interpreter shutdown while the worker still has Python objects to drop
(``gcomp.collectives.launch``). Prints how many collectives are in flight after the steps (the hook settles
them at the end of each backward pass: 0), then DONE.
"""
from __future__ import annotations

import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gcomp
from gcomp.collectives import gather as allgather, launch as futures


def _slow_when_all_done(futures, value):
    done = _when_all_done(futures, value)
    futures[-1].add_done_callback(lambda _: time.sleep(1.0))  # registered after the chain DDP waits on
    return done


_when_all_done = allgather.when_all_done


class _Bucket:
    """What the hook reads of a ``dist.GradBucket``."""

    def __init__(self, param: nn.Parameter):
        self._param = param

    def buffer(self) -> torch.Tensor:
        return torch.ones(self._param.numel())

    def parameters(self) -> list:
        return [self._param]

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


def main(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    allgather.when_all_done = _slow_when_all_done
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(8, 4))
    state = gcomp.install(ddp, "topk", ratio=0.5)
    for _ in range(3):  # past the dense warm-up step, so the last steps run the all-gather
        ddp(torch.randn(4, 8)).sum().backward()
    print(f"STEPPED rank={rank} in_flight={futures.in_flight()}", flush=True)
    state.reduce(_Bucket(ddp.module.weight)).wait()  # settled at exit only
    print(f"DONE rank={rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))
