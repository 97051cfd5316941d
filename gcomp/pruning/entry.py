"""Before a collective helper's first collective (``prune``): every rank of the group entered it, with the same
arguments, asked through the group's store (no collective, alike on gloo and NCCL), so a missing rank is named at a
short timeout instead of a wait until the group's (30 minutes by default).

Keys are numbered per group, epoch and call. A call every rank entered moves the call number on (its keys are
deleted at the next call, when every rank has surely read them). A call that timed out moves the group's epoch on
(a counter in the store): every rank's next call starts afresh, and a rank late to the failed one waits for keys no
one writes any more, and says so at its own timeout, instead of going on alone.
"""
from __future__ import annotations

import json
import numbers
from datetime import timedelta

import torch.distributed as dist

_calls: dict[str, tuple[int, int]] = {}  # per (helper, group): (epoch, calls every rank entered in it)


def check_entered(what: str, group, fields: dict[str, object], timeout: float) -> None:
    """Return once every rank of ``group`` (None: the world) called ``what`` with equal ``fields``; else a
    RuntimeError naming the ranks missing after ``timeout`` seconds, or a ValueError naming the field that differs."""
    group = group if group is not None else dist.distributed_c10d._get_default_group()
    ranks, me = dist.get_process_group_ranks(group), dist.get_rank()
    store = _store(group)
    name = f"gcomp/{what}/{group.group_name}"
    epoch = store.add(f"{name}/epoch", 0)
    last, call = _calls.get(name, (epoch, 0))
    call = call if last == epoch else 0
    keys = [f"{name}/{epoch}/{call}/{r}" for r in ranks]
    store.set(keys[ranks.index(me)], json.dumps({k: _said(v) for k, v in fields.items()}))
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except dist.DistStoreError:
        missing = [r for r, k in zip(ranks, keys) if not store.check([k])]
        if not missing:
            raise
        store.compare_set(f"{name}/epoch", str(epoch), str(epoch + 1))
        raise RuntimeError(f"{what}: rank(s) {', '.join(map(str, missing))} of the group (ranks "
                           f"{', '.join(map(str, ranks))}) did not enter {what.rpartition('.')[2]} within "
                           f"{timeout:g} s: call it on every rank of the group") from None
    said = [json.loads(store.get(k)) for k in keys]
    _calls[name] = (epoch, call + 1)
    if call:
        store.delete_key(f"{name}/{epoch}/{call - 1}/{me}")
    for field in fields:
        values = [s.get(field) for s in said]
        if len(set(values)) > 1:
            sides: dict[str, list[str]] = {}
            for rank, value in zip(ranks, values):
                sides.setdefault(value, []).append(str(rank))
            told = "; ".join(f"{value} on rank(s) {', '.join(on)}" for value, on in sides.items())
            raise ValueError(f"{what}: the ranks disagree on {field!r} ({told}); pass the same {field} on every "
                             "rank of the group")


def _said(value) -> str:
    """A field as compared: a number by its value (``200``, ``200.0`` and NumPy's alike), anything else by ``repr``."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = float(value)
        return repr(int(value)) if value.is_integer() else repr(value)
    return repr(value)


def _store(group) -> dist.Store:
    """The group's own store (its keys prefixed by the group), or the default group's."""
    try:
        return dist.distributed_c10d._get_process_group_store(group)
    except (AttributeError, KeyError):
        return dist.distributed_c10d._get_default_store()
