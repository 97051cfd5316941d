"""Ranks that must agree: one all-gather of a digest per field, and a ``ValueError`` on every rank naming the first
field that differs, before any gradient moves; and the checks that a state reduces over its model's ranks."""
from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist

MAX_FIELDS = 16  # a fixed width, so ranks of two gcomp versions with different field lists still exchange alike
_SHOWN = 240  # characters of a differing value shown in the message


def digest(text: str) -> int:
    """A 63-bit digest of ``text`` (blake2b), the same on every rank and every run."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def collective_device(group) -> torch.device:
    """Where a small tensor must live for a collective on ``group``: NCCL reduces CUDA tensors only."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(what: str, fields: dict[str, str], group, fixes: dict[str, str] | None = None) -> None:
    """Every rank of ``group`` holds the same ``fields`` (name -> text), or a ``ValueError`` on every rank: ``"<what>:
    the ranks disagree on <field>: ranks 0, 1 have ...; rank 2 has .... <fixes[field]>"``."""
    if len(fields) > MAX_FIELDS:
        raise ValueError(f"gcomp.agreement: at most {MAX_FIELDS} fields, got {len(fields)}")
    world = dist.get_world_size(group)
    if world == 1:
        return
    names = list(fields)
    codes = torch.zeros(MAX_FIELDS, dtype=torch.int64)
    codes[:len(names)] = torch.tensor([digest(fields[n]) for n in names], dtype=torch.int64)
    device = collective_device(group)
    table = torch.empty(world * MAX_FIELDS, dtype=torch.int64, device=device)
    _all_gather_single(table, codes.to(device), group=group)
    table = table.cpu().view(world, MAX_FIELDS)
    differs = (table != table[0]).any(dim=0).tolist()
    column = next((i for i, d in enumerate(differs) if d), None)
    if column is None:
        return
    # every rank saw the same table, so every rank is here: this second collective is matched
    field = names[column] if column < len(names) else f"field {column} (gcomp versions differ?)"
    values: list = [None] * world
    dist.all_gather_object(values, fields.get(field, ""), group=group)
    fix = (fixes or {}).get(field, "")
    raise ValueError(f"{what}: the ranks disagree on {field}: {sides(values, group)}" + (f". {fix}" if fix else ""))


def sides(values: list, group) -> str:
    """``"rank 0 has 'a'; ranks 1, 2 have 'b'"`` (global ranks; a value of several lines is a list, shown from its
    first differing line)."""
    ranks = global_ranks(group)
    lines = [v.split("\n") for v in values]
    if any(len(x) > 1 for x in lines):  # a list, one item a line: show each side from the first item where they part
        first = next((i for i in range(max(map(len, lines))) if len({tuple(x[i:i + 1]) for x in lines}) > 1), 0)
        values = [f"item {first}: {x[first]}" if first < len(x) else f"{len(x)} items" for x in lines]
    by_value: dict[str, list[int]] = {}
    for rank, value in zip(ranks, values):
        by_value.setdefault(value, []).append(rank)
    parts = []
    for value, held in by_value.items():
        shown = value if len(value) <= _SHOWN else value[:_SHOWN] + "..."
        who = f"rank {held[0]} has" if len(held) == 1 else f"ranks {', '.join(map(str, held))} have"
        parts.append(f"{who} {shown!r}")
    return "; ".join(parts)


# torch 2.13 renames all_gather_into_tensor, the only name before 2.12
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def global_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)


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
