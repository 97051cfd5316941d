"""``all_gather_flat``: the flat all-gather under torch's new name (2.13) or its old one (up to 2.12)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import gcomp
from gcomp.collectives.launch import all_gather_flat
from tests import models
from tests.distributed import run_ranks


def _gather_both_ways() -> dict:
    """The flat all-gather of ``[rank, rank + 10]`` with torch's name as it is, then with
    ``all_gather_single`` removed (as on torch up to 2.12), and a method that gathers (``topk``) trained
    through the hook that way."""
    rank = dist.get_rank()
    mine = torch.tensor([rank, rank + 10.0])
    out = {"as_is": torch.empty(2 * dist.get_world_size())}
    all_gather_flat(out["as_is"], mine)
    new = getattr(dist, "all_gather_single", None)
    if new is not None:
        delattr(dist, "all_gather_single")
    try:
        out["old_name"] = torch.empty(2 * dist.get_world_size())
        all_gather_flat(out["old_name"], mine, async_op=True).wait()
        model = models.mlp(0)
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        gcomp.install(ddp, "topk")
        x, y = models.batch(0, rank)
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        out["grad_finite"] = all(bool(torch.isfinite(p.grad).all()) for p in model.parameters())
    finally:
        if new is not None:
            dist.all_gather_single = new
    return out


def test_gathers_under_either_name_of_torch():
    ranks = run_ranks(3, _gather_both_ways)
    expected = torch.tensor([0, 10, 1, 11, 2, 12.0])
    for r in ranks:
        assert torch.equal(r["as_is"], expected) and torch.equal(r["old_name"], expected)
        assert r["grad_finite"]


def test_takes_the_old_name_when_the_new_one_is_missing(monkeypatch):
    calls = []
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    monkeypatch.setattr(dist, "all_gather_into_tensor", lambda *a, **k: calls.append((a, k)))
    out, t = torch.empty(4), torch.ones(2)
    all_gather_flat(out, t, None, async_op=True)
    assert calls == [((out, t), {"group": None, "async_op": True})]
