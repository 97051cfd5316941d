"""Which ranks a state reduces over: this rank must be one of them, and they must be the ranks its model
reduces over (DDP's own group): over fewer or others, the replicas drift apart without a word."""
from __future__ import annotations

import torch.distributed as dist


def check_member(group, who: str, ddp_ranks: list[int] | None = None) -> None:
    """A ``ValueError`` if this rank is not in ``group`` (``new_group`` hands non-members a placeholder)."""
    if group is None:
        return
    if group == dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        ddp = "" if ddp_ranks is None else f", while the DDP model's group has {len(ddp_ranks)} ranks {ddp_ranks}"
        raise ValueError(f"{who}: this rank (global rank {dist.get_rank()}) is not in process_group, which has "
                         f"ranks {_ranks_or_unknown(group)}{ddp}; pass a group this rank belongs to (every rank its "
                         "DDP model's own), or process_group=None for the DDP model's group")


def check_same_ranks(who: str, hook_group, ddp_group) -> None:
    """The hook must reduce over exactly the ranks DDP reduces over (``None`` is the default group)."""
    world = dist.group.WORLD
    ddp_ranks = dist.get_process_group_ranks(ddp_group if ddp_group is not None else world)
    check_member(hook_group, who, ddp_ranks)
    hook_ranks = dist.get_process_group_ranks(hook_group if hook_group is not None else world)
    if sorted(hook_ranks) != sorted(ddp_ranks):
        raise ValueError(f"{who}: process_group has {len(hook_ranks)} ranks {hook_ranks} but the DDP model's "
                         f"group has {len(ddp_ranks)} {ddp_ranks}; the hook must reduce over the same ranks as DDP "
                         "(pass process_group=None, or build DDP with process_group=...)")


def _ranks_or_unknown(group) -> str:
    try:
        return str(dist.get_process_group_ranks(group))
    except (RuntimeError, ValueError):
        return "unknown to this rank"
