"""Every rank holds the same global copy after an outer step, bit for bit: one all-gather of a digest per bucket
(the int64 sum of its bit patterns), read on the host; where ranks differ, every rank saw the same table, so all
take a second all-gather of per-parameter digests to name the first parameter that differs."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp.agreement import _all_gather_single, collective_device, sides


def bits_digest(flat: torch.Tensor) -> torch.Tensor:
    """The int64 sum of ``flat``'s bit patterns (a 0-dim tensor on its device)."""
    flat = flat.detach().reshape(-1)
    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(width).sum(dtype=torch.int64)


def _gather(codes: torch.Tensor, group) -> torch.Tensor:
    world = dist.get_world_size(group)
    device = collective_device(group)
    table = torch.empty(world * codes.numel(), dtype=torch.int64, device=device)
    _all_gather_single(table, codes.to(device), group=group)
    return table.cpu().view(world, codes.numel())


def check_identical(what: str, flats: list[torch.Tensor], layouts: list, group) -> None:
    """``flats`` (one flat tensor per bucket, ``layouts`` their ``BucketInfo``) are the same on every rank of
    ``group``; else a ``RuntimeError`` on every rank naming the first parameter that differs."""
    if dist.get_world_size(group) == 1:
        return
    codes = torch.stack([bits_digest(f) for f in flats]).cpu()
    table = _gather(codes, group)
    if not bool((table == table[0]).all()):
        named = [(name, flat[o:o + n]) for flat, info in zip(flats, layouts) for name, o, n in info.segments()]
        per_param = _gather(torch.stack([bits_digest(t) for _, t in named]).cpu(), group)
        column = int((per_param != per_param[0]).any(dim=0).nonzero()[0])
        name = named[column][0]
        values = [f"digest {int(v):#x}" for v in per_param[:, column].tolist()]
        raise RuntimeError(f"{what}: the ranks' parameters differ after the outer step, first at {name!r}: "
                           f"{sides(values, group)}. Every rank must run the same method on the same outer "
                           "gradient; a method whose result differs by rank (or a rank that changed its "
                           "parameters outside the loop) breaks DiLoCo's replicas")
