"""``prunex``: 4 ranks as 2 nodes x 2 and 6 ranks as 3 x 2 (``ranks_per_node``). On a filter-pruned CNN the
result is the masked dense mean; once the layout is compacted, leaders send exactly the kept entries (plus one
flag entry per bucket) across nodes, at most (1 - structured sparsity) of dense (``inter_bytes_dense``), and
followers send nothing across nodes. ADMM pruning under DDP with prunex installed from the start: the hard prune
mid-training is noticed, every rank holds the same masks, and the compacted layout takes over. pactrain's ternary
options (``clip``, ``error_feedback``, ``seed``) reach the inter-node stage, validated, with a warning where they
do nothing; one node is warned about."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gcomp
from gcomp.pruning import StructuredADMM, mask_of
from gcomp.compressors.pactrain.support import bucket_support
from gcomp.randomness import stream_seed
from gcomp.testing.buckets import FakeBucket
from tests.distributed import run_ranks
from tests.models import ddp, flat_params

RANKS_PER_NODE = 2


def cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))


def structured_cnn(seed: int = 0) -> nn.Module:
    """``cnn`` with half the filters of both convolutions (and their biases) pruned by norm."""
    model = cnn(seed)
    StructuredADMM(model, sparsity=0.5).prune()
    return model


def images(step: int, rank: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(size, 1, 8, 8, generator=g)
    return x, (x.mean(dim=(1, 2, 3)) > 0).long() + 2 * (x[:, 0, 0, 0] > 0).long()


def _support(model: nn.Module, params: list[nn.Parameter]) -> torch.Tensor:
    names = {id(p): n for n, p in model.named_parameters()}
    layout = [(p.size(), p.stride(), mask_of(model, names[id(p)])) for p in params]
    support = bucket_support(layout, sum(p.numel() for p in params), "cpu")
    return torch.zeros(support.numel, dtype=torch.bool).index_fill_(0, support.positions.long(), True)


def reduce_job(steps: int = 5) -> dict:
    """One bucket of the whole model, reduced ``steps`` times with masked random gradients."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = structured_cnn()
    state = gcomp.HookState(gcomp.create("prunex", ranks_per_node=RANKS_PER_NODE, stable_steps=1), ddp(model), None)
    state.warmup = 0
    params = list(model.parameters())[::-1]
    support = _support(model, params)
    out = []
    for step in range(steps):
        grads = [torch.randn(support.numel(), generator=torch.Generator().manual_seed(100 * step + r)) * support
                 for r in range(world)]
        before, before_dense = state.stats["inter_bytes"], state.stats["inter_bytes_dense"]
        result = state.reduce(FakeBucket(grads[rank].clone(), 0, True, params)).wait()
        out.append({"result": result.clone(), "expected": torch.stack(grads).sum(0) / world,
                    "inter": state.stats["inter_bytes"] - before, "packed": state.stats["packed_buckets"],
                    "inter_dense": state.stats["inter_bytes_dense"] - before_dense})
    return {"steps": out, "kept": int(support.sum()), "numel": support.numel()}


@pytest.mark.parametrize("world", [4, 6])
def test_prunex_is_the_masked_dense_mean_and_sends_only_kept_filters_across_nodes(world):
    ranks = run_ranks(world, reduce_job)
    kept, numel = ranks[0]["kept"], ranks[0]["numel"]
    assert kept == 40 + 292 + 90 and numel == 754  # half of each conv's filters with their biases; the Linear whole
    for rank, r in enumerate(ranks):
        leader = rank % RANKS_PER_NODE == 0
        for step, s in enumerate(r["steps"]):
            torch.testing.assert_close(s["result"], s["expected"], rtol=1e-6, atol=1e-6)
            assert torch.equal(s["result"], ranks[0]["steps"][step]["result"]), (rank, step)
            # what a dense all-reduce of the fp32 bucket between leaders would have sent
            assert s["inter_dense"] == (numel * 4 if leader else 0), (rank, step, s)
            if not leader:
                assert s["inter"] == 0
            elif step < 1:  # one tracking step (masks as installed): the bucket and the tracker's 5 int64 flags
                assert s["inter"] == numel * 4 + 5 * 8, (rank, step, s)
            else:  # compacted: the kept filters and one entry counting ranks whose masks changed
                assert s["inter"] == (kept + 1) * 4, (rank, step, s)
                assert s["inter"] <= (kept / numel) * numel * 4 + 4  # (1 - structured sparsity) of dense + 4
        assert r["steps"][-1]["packed"] == (4 if leader else 0)  # every step after the first


def train_job(method: str | None, steps: int = 10, **params) -> dict:
    model = ddp(structured_cnn(), bucket_cap_mb=0.001)
    state = gcomp.install(model, method, ranks_per_node=RANKS_PER_NODE, stable_steps=2, **params) if method else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x, y = images(step, dist.get_rank())
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    mine = flat_params(model.module)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    return {"params": mine, "same": all(torch.equal(p, mine) for p in every),
            "stats": None if state is None else dict(state.stats)}


@pytest.mark.parametrize("world", [4, 6])
def test_training_equals_plain_ddp_on_the_pruned_model(world):
    runs = run_ranks(world, train_job, "prunex")
    plain = run_ranks(world, train_job, None)
    for rank, (r, p) in enumerate(zip(runs, plain)):
        assert r["same"], f"rank {rank}: replicas differ"
        torch.testing.assert_close(r["params"], p["params"], rtol=1e-5, atol=1e-6)  # sums in another order
        if rank % RANKS_PER_NODE:
            assert r["stats"]["inter_bytes"] == 0 and r["stats"]["packed_buckets"] == 0
        else:
            assert r["stats"]["packed_buckets"] > 0 and r["stats"]["mask_mismatches"] == 0, r["stats"]


def test_ternary_keeps_replicas_identical_and_sends_about_2_bits_per_kept_entry():
    lossless = run_ranks(4, train_job, "prunex")
    ternary = run_ranks(4, train_job, "prunex", ternary=True)
    for rank, r in enumerate(ternary):
        assert r["same"], f"rank {rank}: replicas differ"
    # same steps, same dense and tracking phases: the packed steps' payload shrinks from 32 to 2 bits
    # per kept entry, plus per-parameter scales
    assert ternary[0]["stats"]["packed_buckets"] == lossless[0]["stats"]["packed_buckets"] > 0
    assert ternary[0]["stats"]["inter_bytes"] < lossless[0]["stats"]["inter_bytes"]
    assert ternary[1]["stats"]["inter_bytes"] == 0


def admm_job(prune_at: int = 12, steps: int = 24) -> dict:
    """prunex installed on an unpruned CNN; ADMM during training; the hard prune at step ``prune_at``."""
    model = cnn()
    net = ddp(model, bucket_cap_mb=0.001)
    state = gcomp.install(net, "prunex", ranks_per_node=RANKS_PER_NODE, stable_steps=2)
    admm = StructuredADMM(model, sparsity=0.6, rho=0.05, interval=4)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    history, digest = [], None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the tracker's "masks changed" warning at the prune
        for step in range(steps):
            if step == prune_at:
                digest = admm.prune(opt).digest
            x, y = images(step, dist.get_rank())
            loss = nn.functional.cross_entropy(net(x), y)
            if not admm.pruned:
                loss = loss + admm.penalty()
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not admm.pruned:
                admm.step()
            history.append(dict(state.stats))
    kept = sum(p.numel() if mask_of(model, n) is None else int(mask_of(model, n).count_nonzero())
               for n, p in model.named_parameters())
    mine = flat_params(model)
    every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    pruned_zero = all(t.weight[~t.keep].eq(0).all() and t.bias[~t.keep].eq(0).all() for t in admm.targets)
    return {"digest": digest, "history": history, "kept": kept, "pruned_zero": bool(pruned_zero),
            "total": sum(p.numel() for p in model.parameters()),
            "same": all(torch.equal(p, mine) for p in every)}


def test_admm_hard_prune_mid_training_is_compacted_with_the_same_masks_on_every_rank():
    ranks = run_ranks(4, admm_job)
    for rank, r in enumerate(ranks):
        assert r["digest"] == ranks[0]["digest"], "masks differ across ranks"
        assert r["same"] and r["pruned_zero"], rank
    leader = ranks[0]["history"]
    assert ranks[1]["history"][-1]["inter_bytes"] == 0
    last, before = leader[-1], leader[-2]
    assert last["unfreezes"] >= 1 and last["mask_mismatches"] == 0, last  # the prune was noticed
    # the last step is compacted: every bucket sends its kept entries and one flag entry
    buckets = last["buckets"] - before["buckets"]
    assert last["packed_buckets"] - before["packed_buckets"] == buckets
    assert last["inter_bytes"] - before["inter_bytes"] == (ranks[0]["kept"] + buckets) * 4
    sparsity = 1 - ranks[0]["kept"] / ranks[0]["total"]
    assert sparsity > 0.4, sparsity  # the 60% of both convolutions' filters is most of this model
    assert last["inter_bytes"] - before["inter_bytes"] <= (1 - sparsity) * ranks[0]["total"] * 4 + 4 * buckets


# --- pactrain's ternary options, and one node --------------------------------------------------------------------

def test_ternary_options_reach_the_inter_node_stage():
    method = gcomp.create("prunex", ternary=True, clip=2.5, error_feedback=True, seed=3)
    packer = method.inner.compressor
    assert (packer.ternary, packer.clip, packer.error_feedback, packer.stream.seed) == (True, 2.5, True, 3)
    assert method.params["clip"] == 2.5 and method.params["seed"] == 3 and method.params["error_feedback"]
    # the draws come from the seed given: each leader's stream as pactrain seeds it
    assert packer.stream.next("cpu").initial_seed() == stream_seed(3, "pactrain", 0, "draw 0") \
        != stream_seed(0, "pactrain", 0, "draw 0")


@pytest.mark.parametrize("params, message", [
    ({"clip": -1.0}, r"prunex: parameter 'clip' must be in \[0, inf\); got -1.0"),
    ({"clip": "2.5"}, "prunex: parameter 'clip' must be a float"),
    ({"error_feedback": "yes"}, "prunex: parameter 'error_feedback' must be a bool; got 'yes'"),
    ({"seed": -1}, r"prunex: parameter 'seed' must be in \[0, inf\); got -1"),
    ({"seed": 1.5}, "prunex: parameter 'seed' must be an int"),
    ({"rounds": 3}, r"prunex: parameter 'rounds' must be in \[1, 2\]; got 3"),
])
def test_ternary_options_are_validated_at_create(params, message):
    with pytest.raises(ValueError, match=message):
        gcomp.create("prunex", ternary=True, **params)


@pytest.mark.parametrize("params, idle", [({"clip": 2.5}, "'clip'"), ({"error_feedback": True}, "'error_feedback'"),
                                          ({"seed": 3}, "'seed'"), ({"rounds": 2}, "'rounds'")])
def test_ternary_options_warn_once_without_ternary(params, idle):
    with pytest.warns(UserWarning, match=f"prunex: parameter {idle} has no effect without ternary=True") as caught:
        gcomp.create("prunex", **params)
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gcomp.create("prunex", ternary=True, **params)


def one_node_job() -> list[str]:
    """prunex installed with the nodes found from host names: every rank of this test is on one host."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gcomp.install(ddp(structured_cnn()), "prunex")
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning)]


def test_one_node_is_warned_about():
    for rank, said in enumerate(run_ranks(4, one_node_job)):
        assert any(m.startswith("prunex: all 4 ranks are on one node") and "ranks_per_node" in m
                   and "(pactrain)" in m for m in said), (rank, said)
