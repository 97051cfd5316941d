"""prune(): exact counts, determinism, errors, masks through torch's prune, optimizers, channels_last, ranks."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import prune as torch_prune

from gcomp.pruning import PruneResult, kept_fraction, mask_of, masks_digest, named_masks, prune
from tests.distributed import run_ranks
from tests.pruning import prune_jobs as jobs

METHODS = ("grasp", "magnitude", "random")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 8), nn.ReLU(), nn.Linear(8, 3))


def data(n: int = 30, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=g), torch.arange(n) % 3


def removed_per_layer(result: PruneResult) -> list[int]:
    return [int((m == 0).sum()) for m in result.masks.values()]


def same_masks(a: PruneResult, b: PruneResult) -> bool:
    return a.masks.keys() == b.masks.keys() and all(torch.equal(a.masks[k], b.masks[k]) for k in a.masks)


# --- exact counts and determinism --------------------------------------------------------------------------------

LAYER = st.one_of(
    st.tuples(st.just("linear"), st.integers(1, 9), st.integers(1, 9)),
    st.tuples(st.just("conv1d"), st.integers(1, 4), st.integers(1, 4)),
    st.tuples(st.just("conv2d"), st.integers(1, 4), st.integers(1, 4)),
    st.tuples(st.just("conv3d"), st.integers(1, 3), st.integers(1, 3)),
)
KINDS = {"linear": nn.Linear, "conv1d": lambda i, o: nn.Conv1d(i, o, 3), "conv2d": lambda i, o: nn.Conv2d(i, o, 2),
         "conv3d": lambda i, o: nn.Conv3d(i, o, 2)}


@settings(max_examples=60, deadline=None)
@given(layers=st.lists(LAYER, min_size=1, max_size=4), ratio=st.floats(0, 1, exclude_max=True),
       method=st.sampled_from(["magnitude", "random"]), scope=st.sampled_from(["global", "layer"]),
       seed=st.integers(0, 2**31), ties=st.booleans())
def test_exact_count_over_random_shapes(layers, ratio, method, scope, seed, ties):
    torch.manual_seed(seed)
    model = nn.Sequential(*[KINDS[kind](i, o) for kind, i, o in layers])
    if ties:  # many equal magnitudes: the tie rule alone must give the count
        with torch.no_grad():
            for m in model:
                m.weight.copy_(torch.sign(m.weight) * 0.5)
    sizes = [m.weight.numel() for m in model]
    groups = [sum(sizes)] if scope == "global" else sizes
    if any(round(ratio * n) >= n for n in groups):  # the ratio rounds up to every weight: refused, as 1.0 is
        with pytest.raises(ValueError, match="rounds up to all"):
            prune(model, ratio, method, scope=scope, seed=seed)
        return
    result = prune(model, ratio, method, scope=scope, seed=seed)
    if scope == "global":
        assert result.removed == round(ratio * sum(sizes))
    else:
        assert removed_per_layer(result) == [round(ratio * n) for n in sizes]
        assert result.removed == sum(round(ratio * n) for n in sizes)
    assert result.total == sum(sizes)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scope", ["global", "layer"])
@pytest.mark.parametrize("ratio", [0.0, 0.37, 0.9])
def test_exact_count_for_each_method(method, scope, ratio):
    model = mlp()
    sizes = [m.weight.numel() for m in model if isinstance(m, nn.Linear)]
    result = prune(model, ratio, method, data=data(), scope=scope)
    if scope == "global":
        assert result.removed == round(ratio * sum(sizes))
    else:
        assert removed_per_layer(result) == [round(ratio * n) for n in sizes]
    assert math.isclose(result.kept_fraction, 1 - result.removed / sum(sizes))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scope", ["global", "layer"])
def test_same_call_gives_same_masks(method, scope):
    one = prune(mlp(), 0.6, method, data=data(), scope=scope, seed=3)
    two = prune(mlp(), 0.6, method, data=data(), scope=scope, seed=3)
    assert same_masks(one, two) and one.digest == two.digest


def test_random_depends_on_seed_and_magnitude_removes_the_smallest():
    assert prune(mlp(), 0.5, "random", seed=1).digest != prune(mlp(), 0.5, "random", seed=2).digest
    model = mlp()
    flat = torch.cat([m.weight.detach().abs().reshape(-1) for m in model if isinstance(m, nn.Linear)])
    result = prune(model, 0.5, "magnitude")
    removed = torch.cat([(m == 0).reshape(-1) for m in result.masks.values()])
    assert flat[removed].max() <= flat[~removed].min()


def test_global_scope_ranks_across_layers():
    model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
    with torch.no_grad():
        model[0].weight.fill_(0.1)
        model[1].weight.fill_(1.0)
    assert removed_per_layer(prune(copy.deepcopy(model), 0.5, "magnitude")) == [16, 0]
    assert removed_per_layer(prune(model, 0.5, "magnitude", scope="layer")) == [8, 8]


# --- errors ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", [-0.1, 1.0, 1.5, float("nan"), float("inf"), True, False, "0.5", None,
                                   torch.tensor(0.5)])
def test_bad_ratio(ratio):
    with pytest.raises(ValueError, match=r"ratio .*\[0, 1\).*got") as info:
        prune(mlp(), ratio, "magnitude")
    assert repr(ratio) in str(info.value)


def test_unknown_method_and_scope_list_the_choices():
    with pytest.raises(ValueError, match="grasp, magnitude, random"):
        prune(mlp(), 0.5, "snip")
    with pytest.raises(ValueError, match="global, layer"):
        prune(mlp(), 0.5, "magnitude", scope="channel")


def test_grasp_works_under_no_grad():
    with torch.no_grad():
        inside = prune(mlp(), 0.5, "grasp", data=data())
    assert inside.digest == prune(mlp(), 0.5, "grasp", data=data()).digest


def test_grasp_needs_data_and_the_model_is_left_alone():
    model = mlp()
    with pytest.raises(ValueError, match="data"):
        prune(model, 0.5, "grasp")
    assert named_masks(model) == {}


@pytest.mark.parametrize("model", [nn.Sequential(nn.ReLU()), nn.BatchNorm1d(3), nn.Embedding(4, 2)])
def test_no_prunable_layer(model):
    with pytest.raises(ValueError, match="no prunable layer"):
        prune(model, 0.5, "magnitude")


@pytest.mark.parametrize("kwargs", [{"temperature": 0.0}, {"temperature": float("nan")}, {"samples_per_class": 0},
                                    {"samples_per_class": 2.5}])
def test_bad_grasp_settings(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        prune(mlp(), 0.5, "grasp", data=data(), **kwargs)


def test_tied_weights_are_refused():
    emb, head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    with pytest.raises(ValueError, match="share one weight"):
        prune(nn.ModuleDict({"emb": emb, "head": head}), 0.5, "magnitude", include_embeddings=True)


# --- what is pruned, and how -------------------------------------------------------------------------------------

def test_result_names_masks_and_digest():
    model = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.Flatten(), nn.Linear(12, 2))
    result = prune(model, 0.5, "magnitude")
    assert list(result.masks) == ["0.weight_orig", "3.weight_orig"]
    assert result.masks.keys() == named_masks(model).keys()
    assert all(result.masks[k] is mask_of(model, k) for k in result.masks)
    assert result.digest == tuple(masks_digest(result.masks.values()).tolist())
    names = [n for n, _ in model.named_parameters()]
    assert "0.bias" in names and "1.weight" in names and "0.weight" not in names
    with pytest.raises(Exception):
        result.removed = 0  # frozen


def test_embeddings_only_when_asked():
    def model():
        torch.manual_seed(0)
        return nn.ModuleDict({"emb": nn.Embedding(10, 4), "fc": nn.Linear(4, 3)})

    assert list(prune(model(), 0.5, "magnitude").masks) == ["fc.weight_orig"]
    assert list(prune(model(), 0.5, "magnitude", include_embeddings=True).masks) == ["emb.weight_orig",
                                                                                     "fc.weight_orig"]


def test_attention_out_proj_is_not_pruned():
    # MultiheadAttention reads out_proj.weight directly, so a mask there would never be applied
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(4, 2), "fc": nn.Linear(4, 2)})
    assert list(prune(model, 0.5, "magnitude").masks) == ["fc.weight_orig"]


def test_kept_fraction_counts_every_parameter():
    model = nn.Sequential(nn.Linear(10, 10), nn.BatchNorm1d(10), nn.Linear(10, 2, bias=False))
    assert kept_fraction(model) == 1.0
    result = prune(model, 0.5, "random")
    total = 110 + 20 + 20
    assert result.removed == 60
    assert kept_fraction(model) == pytest.approx((total - 60) / total)
    assert result.kept_fraction == pytest.approx(0.5)


def test_pruned_weights_are_zero_in_weight_orig_and_after_remove():
    model = mlp()
    result = prune(model, 0.7, "random")
    for name, mask in result.masks.items():
        module = model.get_submodule(name.rpartition(".")[0])
        assert bool((module.weight_orig[mask == 0] == 0).all())
        torch_prune.remove(module, "weight")
        assert bool((module.weight[mask == 0] == 0).all())


def test_pruning_again_combines_masks():
    model = mlp()
    x, _ = data()
    first = {k: v.clone() for k, v in prune(model, 0.4, "magnitude").masks.items()}
    second = prune(model, 0.8, "random", seed=5)
    n = second.total
    assert second.removed == round(0.8 * n)
    for name, old in first.items():
        module = model.get_submodule(name.rpartition(".")[0])
        hook = next(h for h in module._forward_pre_hooks.values() if isinstance(h, torch_prune.BasePruningMethod))
        assert isinstance(hook, torch_prune.PruningContainer)
        new = module.weight_mask
        assert new is second.masks[name]
        assert bool(((old == 0) <= (new == 0)).all())  # old zeros stay
        assert set(new.unique().tolist()) <= {0.0, 1.0}
    ref = x
    for m in model:
        ref = F.linear(ref, m.weight_orig * m.weight_mask, m.bias) if isinstance(m, nn.Linear) else m(ref)
    torch.testing.assert_close(model(x), ref, rtol=0, atol=0)


def test_torch_pruned_weights_stay_pruned_and_get_zeroed():
    model = mlp()
    torch_prune.l1_unstructured(model[0], "weight", amount=0.5)  # leaves weight_orig nonzero under the mask
    old = model[0].weight_mask.clone()
    result = prune(model, 0.5, "random", seed=1)
    assert bool(((old == 0) <= (result.masks["0.weight_orig"] == 0)).all())
    assert bool((model[0].weight_orig[old == 0] == 0).all())
    assert result.removed == round(0.5 * result.total)


def test_asking_for_less_than_is_already_pruned_warns_and_keeps_them():
    model = mlp()
    prune(model, 0.6, "magnitude")
    with pytest.warns(UserWarning, match="already pruned"):
        result = prune(model, 0.2, "magnitude")
    assert result.removed == round(0.6 * result.total)


@pytest.mark.parametrize("make_opt", [
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=5e-4),
    lambda ps: torch.optim.Adam(ps, lr=0.01),
    lambda ps: torch.optim.AdamW(ps, lr=0.01, weight_decay=0.01),
], ids=["sgd", "adam", "adamw"])
def test_pruned_weights_stay_exactly_zero_under_optimizers(make_opt):
    model = mlp()
    result = prune(model, 0.5, "magnitude")
    opt = make_opt(model.parameters())
    g = torch.Generator().manual_seed(0)
    modules = {name: model.get_submodule(name.rpartition(".")[0]) for name in result.masks}
    for _ in range(20):
        x, y = torch.randn(16, 6, generator=g), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for name, module in modules.items():
            pruned = result.masks[name] == 0
            assert bool((module.weight_orig.grad[pruned] == 0).all())
            assert bool((module.weight_orig.grad[~pruned] != 0).any())
        opt.step()
    model(x)  # refresh the effective weights
    for name, module in modules.items():
        pruned = result.masks[name] == 0
        assert bool((module.weight_orig[pruned] == 0).all()) and bool((module.weight[pruned] == 0).all())
        assert bool((module.weight_orig[~pruned] != 0).all())


def conv_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 6, 3), nn.ReLU(), nn.Conv2d(6, 4, 3), nn.Flatten(), nn.Linear(16, 3))


@pytest.mark.parametrize("method", METHODS)
def test_channels_last_twin_gets_the_same_masks(method):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(12, 3, 6, 6, generator=g), torch.arange(12) % 3
    plain = conv_model()
    last = copy.deepcopy(plain).to(memory_format=torch.channels_last)
    assert last[0].weight.is_contiguous(memory_format=torch.channels_last) and not last[0].weight.is_contiguous()
    a = prune(plain, 0.6, method, data=(x, y), samples_per_class=4)
    b = prune(last, 0.6, method, data=(x.to(memory_format=torch.channels_last), y), samples_per_class=4)
    assert same_masks(a, b) and a.digest == b.digest
    assert last[0].weight_orig.is_contiguous(memory_format=torch.channels_last)
    out_a = plain(x)
    out_b = last(x.to(memory_format=torch.channels_last))
    torch.testing.assert_close(out_a, out_b)
    F.cross_entropy(out_b, y).backward()
    for name, mask in b.masks.items():
        orig = last.get_submodule(name.rpartition(".")[0]).weight_orig
        assert bool((orig.grad[mask == 0] == 0).all()) and bool((orig[mask == 0] == 0).all())


# --- ranks -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_ends_with_the_src_ranks_masks(world):
    configs = [(m, s, r, src) for m in METHODS for s, r, src in (("global", 0.5, 0), ("layer", 0.8, world - 1))]
    per_rank = run_ranks(world, jobs.prune_with_rank_noise, configs)
    for i, (method, scope, ratio, src) in enumerate(configs):
        # what rank `src` alone would compute from its own model, data and seed
        expected = prune(jobs.noisy_model(src, src), ratio, method, scope=scope, **jobs.rank_kwargs(src, src, method))
        for rank in range(world):
            digest, masks, zeroed = per_rank[rank][i]
            assert digest == expected.digest, (method, scope, rank)
            assert all(torch.equal(masks[k], expected.masks[k]) for k in expected.masks)
            assert zeroed
        other = 1 if src != 1 else 0  # the noise matters: another rank alone would choose differently
        own = prune(jobs.noisy_model(other, src), ratio, method, scope=scope,
                    **jobs.rank_kwargs(other, src, method) | {"data": jobs.rank_data(other, src)})
        assert own.digest != expected.digest


@pytest.mark.parametrize("world", [2, 3])
def test_rank_disagreements_raise_on_every_rank(world):
    out = run_ranks(world, jobs.disagreements)
    for rank, res in enumerate(out):
        assert res["same"] == out[0]["same"]
        assert "masks differ across ranks" in res["different"]
        assert "number of prunable weights" in res["sizes"]
        if rank == 0:
            assert res["src_failed"].startswith("ValueError") and "data" in res["src_failed"]
        else:
            assert res["src_failed"].startswith("RuntimeError") and "rank 0 failed" in res["src_failed"]



@pytest.mark.parametrize("world, skip", [(2, 1), (3, 1)])
def test_a_rank_that_never_enters_prune_is_named_within_the_entry_timeout(world, skip):
    out = run_ranks(world, jobs.one_rank_skips, skip, 1.0)
    for rank, res in enumerate(out):
        if rank != skip:  # an error well before the group's own timeout, naming the rank and the fix
            assert res["skipped"].startswith("RuntimeError"), res["skipped"]
            for words in (f"rank(s) {skip} of the group", "did not enter prune within 1 s",
                          "call it on every rank of the group"):
                assert words in res["skipped"], res["skipped"]
            assert res["seconds"] < 20
        assert res["all"] == out[0]["all"]  # then every rank in step again: one set of masks
        assert res["disagree"].startswith("ValueError") and "disagree on 'ratio'" in res["disagree"], res["disagree"]
        assert f"0.6 on rank(s) {skip}" in res["disagree"] and "0.5 on rank(s) 0" in res["disagree"]
        assert res["after"] == out[0]["after"]

def test_a_name_taken_before_pruning_still_finds_the_mask_and_the_parameter():
    from gcomp.pruning.masks import parameter_of
    model = nn.Sequential(nn.Linear(3, 2))
    param = model[0].weight
    assert mask_of(model, "0.weight") is None and parameter_of(model, "0.weight") is param
    torch_prune.random_unstructured(model[0], "weight", amount=0.5)
    assert mask_of(model, "0.weight") is model[0].weight_mask is mask_of(model, "0.weight_orig")
    assert parameter_of(model, "0.weight") is param is model[0].weight_orig
    assert mask_of(model, "0.bias") is None and mask_of(model, "1.weight") is None
