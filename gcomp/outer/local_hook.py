"""A DDP model whose steps stay local: the communication hook a trainer's DDP model runs under DiLoCo.

A trainer (Lightning, Accelerate) wraps the model in DDP over every process, which would all-reduce each inner
step's gradient across nodes and leave DiLoCo nothing to save. ``keep_local`` registers this hook instead: each
bucket is averaged over ``inner_group`` only (a node's ranks: one all-reduce on that group), or, with no inner
group, left as this rank's own gradient (nothing on the wire).

No ``from __future__ import annotations`` here: DDP compares the hook's return annotation with
``torch.futures.Future[torch.Tensor]`` itself.
"""
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gcomp.collectives.launch import launched


def local_hook(inner_group, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The bucket's gradient averaged over ``inner_group``; with None, this rank's own, as it is."""
    buffer = bucket.buffer()
    if inner_group is None:
        done = torch.futures.Future()
        done.set_result(buffer)
        return done
    buffer.div_(dist.get_world_size(inner_group))
    return launched(dist.all_reduce(buffer, group=inner_group, async_op=True)).then(lambda fut: fut.value()[0])


def keep_local(ddp: torch.nn.Module, inner_group=None) -> None:
    """Register ``local_hook`` on a DDP model (before its first step); anything else is refused."""
    if not isinstance(ddp, DistributedDataParallel):
        raise TypeError(f"gcomp.outer.keep_local takes a DistributedDataParallel model; got {type(ddp).__name__}")
    if getattr(ddp, "_gcomp_state", None) is not None:
        raise RuntimeError("a gcomp hook is already installed on this DDP model: under DiLoCo the inner steps stay "
                           "local (or within inner_group), and the outer loop is where the method sits")
    ddp.register_comm_hook(inner_group, local_hook)
    ddp._gcomp_state = "gcomp.outer local steps"
