"""GraSP: the Hessian-gradient product, the score's sign, the class-balanced sample, and what gets removed."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gcomp.pruning import mask_of, prune
from gcomp.pruning.grasp import class_balanced_sample, grasp_scores, hessian_gradient_product


def tiny(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double()


def balanced(per_class: int = 4, classes: int = 3, features: int = 5, seed: int = 1, dtype=torch.float64):
    """Exactly ``per_class`` examples of each class, ordered by class: its own class-balanced sample."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(per_class * classes, features, generator=g, dtype=dtype)
    y = torch.arange(classes).repeat_interleave(per_class)
    return x, y


def weights_of(model: nn.Module) -> list[torch.Tensor]:
    return [getattr(m, "weight_orig", m.weight) for m in model if isinstance(m, nn.Linear)]


def total_loss(model, x, y, t):
    n = x.shape[0]
    return sum(F.cross_entropy(model(x[a:b]) / t, y[a:b]) for a, b in ((0, n // 2), (n // 2, n)))


def grad_at(model, weights, x, y, t):
    return torch.autograd.grad(total_loss(model, x, y, t), weights)


@pytest.mark.parametrize("temperature", [1.0, 200.0])
def test_hessian_gradient_product_matches_finite_differences(temperature):
    model = tiny()
    weights = weights_of(model)
    x, y = balanced()
    hg = hessian_gradient_product(model, weights, x, y, temperature)
    g = grad_at(model, weights, x, y, temperature)
    eps = 1e-4 * temperature
    with torch.no_grad():
        for w, gi in zip(weights, g):
            w.add_(eps * gi)
    plus = grad_at(model, weights, x, y, temperature)
    with torch.no_grad():
        for w, gi in zip(weights, g):
            w.sub_(2 * eps * gi)
    minus = grad_at(model, weights, x, y, temperature)
    scale = max(h.abs().max() for h in hg)
    assert scale > 0
    for h, p, m in zip(hg, plus, minus):
        torch.testing.assert_close(h, (p - m) / (2 * eps), rtol=1e-5, atol=1e-6 * scale)


def test_hessian_gradient_product_equals_exact_hessian_times_gradient():
    model = tiny(3)
    weights = weights_of(model)
    x, y = balanced(per_class=3, seed=4)
    shapes = [w.shape for w in weights]
    sizes = [w.numel() for w in weights]
    flat0 = torch.cat([w.detach().reshape(-1) for w in weights])

    def loss_of(flat):
        params = dict(model.named_parameters())
        for (name, _), piece, shape in zip([(n, p) for n, p in params.items() if n.endswith("weight")],
                                           flat.split(sizes), shapes):
            params[name] = piece.reshape(shape)
        n = x.shape[0]
        return sum(F.cross_entropy(torch.func.functional_call(model, params, (x[a:b],)) / 2.0, y[a:b])
                   for a, b in ((0, n // 2), (n // 2, n)))

    hessian = torch.autograd.functional.hessian(loss_of, flat0)
    grad = torch.func.grad(loss_of)(flat0)
    expected = hessian @ grad
    got = torch.cat([h.reshape(-1) for h in hessian_gradient_product(model, weights, x, y, 2.0)])
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12)


def test_scores_are_minus_theta_times_hg():
    model = tiny(5)
    weights = weights_of(model)
    x, y = balanced(per_class=2, seed=6)
    scores = grasp_scores(model, weights, (x, y), 200.0, samples_per_class=2)
    hg = hessian_gradient_product(model, weights, x, y, 200.0)
    for s, w, h in zip(scores, weights, hg):
        torch.testing.assert_close(s, -w.detach() * h, rtol=0, atol=0)
        assert not s.requires_grad
    assert all(w.grad is None for w in weights)  # autograd.grad only


def test_class_balanced_sample_takes_the_first_of_each_class_then_orders_by_class():
    x = torch.arange(10.0).reshape(10, 1)
    y = torch.tensor([2, 0, 2, 1, 0, 2, 0, 1, 1, 0])
    sx, sy = class_balanced_sample((x, y), 2, 3)
    assert sy.tolist() == [0, 0, 1, 1, 2, 2]
    assert sx.reshape(-1).tolist() == [1.0, 4.0, 3.0, 7.0, 0.0, 2.0]


def test_class_balanced_sample_reads_batches_only_until_every_class_is_full():
    read = []

    def batches():
        for i in range(10):
            read.append(i)
            yield torch.full((3, 1), float(i)), torch.tensor([0, 1, 0])

    sx, sy = class_balanced_sample(batches(), 2, 2)
    assert read == [0, 1]
    assert sy.tolist() == [0, 0, 1, 1]
    assert sx.reshape(-1).tolist() == [0.0, 0.0, 0.0, 1.0]


def test_class_balanced_sample_uses_what_a_short_data_set_has():
    sx, sy = class_balanced_sample([(torch.zeros(3, 2), torch.tensor([1, 1, 1]))], 2, 4)
    assert sy.tolist() == [1, 1]


@pytest.mark.parametrize("bad", [torch.tensor([0.0, 1.0]), torch.tensor([0, 5]), torch.tensor([[0, 1]])])
def test_class_balanced_sample_rejects_bad_targets(bad):
    with pytest.raises(ValueError, match="targets"):
        class_balanced_sample((torch.zeros(bad.shape[-1], 2), bad), 2, 3)


def flat_scores(model, data, spc=4):
    with torch.no_grad():  # a pruned module's `weight` must be a leaf for deepcopy
        model(data[0])
    twin = copy.deepcopy(model).eval()
    weights = weights_of(twin)
    return torch.cat([s.reshape(-1) for s in grasp_scores(twin, weights, data, 200.0, spc)])


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.9])
def test_prune_removes_the_largest_scores(ratio):
    model = tiny(7)
    data = balanced(per_class=4, seed=8)
    scores = flat_scores(model, data)
    result = prune(model, ratio, "grasp", data=data, samples_per_class=4)
    removed = torch.cat([(m == 0).reshape(-1) for m in result.masks.values()])
    assert int(removed.sum()) == round(ratio * scores.numel())
    assert scores[removed].min() >= scores[~removed].max()


def test_grasp_leaves_the_model_untouched_apart_from_the_masks():
    model = nn.Sequential(nn.Linear(5, 6), nn.Dropout(0.5), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 3)).double()
    before = copy.deepcopy(model.state_dict())
    model.train()
    data = balanced(per_class=5, seed=2)
    result = prune(model, 0.5, "grasp", data=data, samples_per_class=5)
    assert model.training and all(m.training for m in model.modules())
    for i in (0, 4):
        mask = result.masks[f"{i}.weight_orig"]
        orig = getattr(model[i], "weight_orig")
        torch.testing.assert_close(orig.detach(), before[f"{i}.weight"] * mask, rtol=0, atol=0)
        assert orig.grad is None
    for key in ("2.running_mean", "2.running_var", "2.num_batches_tracked", "2.weight", "0.bias"):
        torch.testing.assert_close(model.state_dict()[key], before[key], rtol=0, atol=0)


def test_grasp_is_deterministic_with_dropout_and_reads_an_iterator_once():
    model = nn.Sequential(nn.Linear(5, 16), nn.Dropout(0.5), nn.Tanh(), nn.Linear(16, 3)).double().train()
    x, y = balanced(per_class=6, seed=9)
    one = prune(copy.deepcopy(model), 0.6, "grasp", data=(x, y), samples_per_class=6)
    two = prune(copy.deepcopy(model), 0.6, "grasp", data=iter([(x[:7], y[:7]), (x[7:], y[7:])]),
                samples_per_class=6)
    assert one.digest == two.digest
    for name in one.masks:
        assert torch.equal(one.masks[name], two.masks[name])


def test_grasp_on_an_already_pruned_model_keeps_old_zeros_and_ranks_the_rest_by_score():
    model = tiny(11)
    data = balanced(per_class=4, seed=12)
    first = {k: v.clone() for k, v in prune(model, 0.3, "magnitude").masks.items()}
    scores = flat_scores(model, data)
    model(data[0]).sum().backward()  # leaves a non-leaf `weight` behind, which deepcopy alone refuses
    second = prune(model, 0.7, "grasp", data=data, samples_per_class=4)
    old = torch.cat([(m == 0).reshape(-1) for m in first.values()])
    new = torch.cat([(mask_of(model, k) == 0).reshape(-1) for k in first])
    assert bool((old <= new).all())
    assert int(new.sum()) == second.removed == round(0.7 * new.numel())
    fresh = new & ~old
    assert scores[fresh].min() >= scores[~new].max()
    assert bool((scores[old] == 0).all())  # no gradient reaches a pruned weight, so H g is 0 there too
