"""Structured ADMM pruning (``gcomp.pruning.StructuredADMM``): the projection and dual update by hand, the
penalty and its gradient, ADMM driving the targeted filters to zero on a small CNN trained on the digits, the
hard prune, channel structure, checkpoints, agreement across ranks, and the errors."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gcomp.pruning import StructuredADMM, kept_fraction, mask_of
from tests.distributed import run_ranks


def two_layers() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[3.0, 0.0], [0.0, 1.0], [2.0, 2.0]]))  # filter norms^2: 9, 1, 8
        model[0].bias.copy_(torch.tensor([0.0, 0.0, 1.0]))  # with the bias: 9, 1, 9 -> keep 0 and 2 (tie: 0)
    return model


def test_projection_keeps_the_largest_filters_with_their_bias_and_the_dual_takes_the_rest():
    model = two_layers()
    admm = StructuredADMM(model, sparsity=0.5, rho=0.5)  # 3 filters: keep round(1.5) = 2; the last layer is left
    [t] = admm.targets
    assert t.name == "0" and t.kappa == 2 and t.keep.tolist() == [True, False, True]
    w = model[0].weight.detach()
    assert torch.equal(t.z_weight, w * torch.tensor([[1.0], [0.0], [1.0]]))
    assert torch.equal(t.u_weight, torch.zeros_like(w))  # U starts at 0
    # the penalty and its gradient: rho/2 ||W - Z + U||^2 -> rho (W - Z + U)
    penalty = admm.penalty()
    assert penalty.item() == pytest.approx(0.25 * 1.0)  # only filter 1 differs from Z: ||(0, 1)||^2 = 1, bias 0
    penalty.backward()
    assert torch.equal(model[0].weight.grad, 0.5 * (w - t.z_weight))
    # the next projection: X = W + U = W; Z = proj(X); U = X - Z (the pruned filter's values)
    with torch.no_grad():
        model[0].weight[1] = torch.tensor([5.0, 5.0])  # now filters 0 and 1 are the largest
    for _ in range(admm.interval - 1):
        assert not admm.step()
    assert admm.step()
    assert t.keep.tolist() == [True, True, False]
    assert torch.equal(t.u_weight[2], torch.tensor([2.0, 2.0])) and torch.equal(t.u_bias, torch.tensor([0.0, 0, 1]))
    assert (t.u_weight[:2] == 0).all()


def test_hard_prune_installs_filter_masks_and_zeroes_their_gradients():
    model = two_layers()
    result = StructuredADMM(model, sparsity=0.5).prune()
    assert set(result.masks) == {"0.weight_orig", "0.bias_orig"}
    assert torch.equal(mask_of(model, "0.weight_orig"), torch.tensor([[1.0, 1], [0, 0], [1, 1]]))
    assert (result.removed, result.total) == (3, 9)
    assert model[0].weight[1].eq(0).all() and model[0].bias[1] == 0
    model(torch.randn(4, 2)).sum().backward()
    assert model[0].weight_orig.grad[1].eq(0).all() and model[0].bias_orig.grad[1] == 0
    assert kept_fraction(model) == pytest.approx((6 + 8) / (9 + 8))


@pytest.mark.parametrize("pass_optimizer", [False, True])
def test_momentum_moves_pruned_entries_unless_the_optimizer_is_passed(pass_optimizer):
    model = two_layers()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    admm = StructuredADMM(model, sparsity=0.5)
    for _ in range(2):
        opt.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
    admm.prune(opt if pass_optimizer else None)
    opt.zero_grad()
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    assert model[0].weight[1].eq(0).all()  # the model's weight is masked either way
    assert model[0].weight_orig[1].eq(0).all() == pass_optimizer


def test_channels_prune_input_channels_and_leave_the_first_layer():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Conv2d(4, 6, 3), nn.Flatten(), nn.Linear(6, 10))
    admm = StructuredADMM(model, sparsity=0.5, structure="channels")
    assert [(t.name, t.kappa) for t in admm.targets] == [("1", 2), ("3", 3)]
    result = admm.prune()
    mask = mask_of(model, "1.weight_orig")
    assert set(result.masks) == {"1.weight_orig", "3.weight_orig"}  # no bias: it belongs to no input channel
    kept = mask.sum(dim=(0, 2, 3)) > 0
    assert int(kept.sum()) == 2 and torch.equal(mask, kept.view(1, -1, 1, 1).expand_as(mask).float())


def _digits():
    from sklearn.datasets import load_digits
    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32).view(-1, 1, 8, 8) / 16.0
    return x, torch.tensor(y)


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(128, 10))


def test_admm_drives_the_targeted_filters_to_zero_on_a_small_cnn():
    x, y = _digits()
    model = _cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    admm = StructuredADMM(model, sparsity=0.6, rho=0.05, interval=20, rho_growth=1.1)
    start = admm.pruned_norm()
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    for epoch in range(4):
        for i in range(0, len(y) - 31, 32):
            idx = order[i:i + 32]
            loss = nn.functional.cross_entropy(model(x[idx]), y[idx]) + admm.penalty()
            opt.zero_grad()
            loss.backward()
            opt.step()
            admm.step()
    end = admm.pruned_norm()
    assert start > 0.4 and end < start / 5, (start, end)  # what the hard prune cuts has nearly vanished
    with torch.no_grad():
        before = (model(x).argmax(1) == y).float().mean().item()
    admm.prune()
    with torch.no_grad():
        after = (model(x).argmax(1) == y).float().mean().item()
    assert after > 0.8 and after > before - 0.05, (before, after)
    for t in admm.targets:
        assert t.weight[~t.keep].eq(0).all() and t.bias[~t.keep].eq(0).all()
        assert int(t.keep.sum()) == round(0.4 * t.weight.size(0))


def test_state_dict_resumes_the_same_projections():
    def run(split: bool) -> StructuredADMM:
        model = two_layers()
        admm = StructuredADMM(model, 0.5, interval=2)
        for step in range(6):
            if split and step == 3:
                state = admm.state_dict()
                admm = StructuredADMM(model, 0.5, interval=2)
                admm.load_state_dict(state)
            with torch.no_grad():
                model[0].weight.add_(torch.randn(3, 2, generator=torch.Generator().manual_seed(step)))
            admm.step()
        return admm

    a, b = run(False), run(True)
    assert a.steps == b.steps == 6
    for ta, tb in zip(a.targets, b.targets):
        assert torch.equal(ta.z_weight, tb.z_weight) and torch.equal(ta.u_weight, tb.u_weight)
        assert torch.equal(ta.keep, tb.keep)


def _differing_ranks_job() -> tuple:
    torch.manual_seed(dist.get_rank())  # deliberately different weights: the projection is rank 0's
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    result = StructuredADMM(model, 0.5).prune()
    return result.digest, mask_of(model, "0.weight_orig")


def test_masks_agree_across_ranks_even_from_different_weights():
    ranks = run_ranks(3, _differing_ranks_job)
    for digest, mask in ranks:
        assert digest == ranks[0][0] and torch.equal(mask, ranks[0][1])


@pytest.mark.parametrize("kwargs, message", [
    ({"sparsity": 1.0}, "sparsity must be a real number in \\[0, 1\\), got 1.0"),
    ({"sparsity": True}, "sparsity"),
    ({"rho": 0.0}, "rho must be a finite number > 0"),
    ({"interval": 0}, "interval must be an integer >= 1"),
    ({"structure": "rows"}, "unknown structure 'rows'; choose one of filters, channels"),
    ({"rho_growth": 0.5}, "rho_growth must be a finite number >= 1"),
    ({"layers": ["9"]}, "'layers' names no Conv/Linear module: \\['9'\\]"),
])
def test_bad_arguments_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StructuredADMM(two_layers(), **kwargs)


def test_misuse_is_refused():
    with pytest.raises(ValueError, match="at least two Conv/Linear layers"):
        StructuredADMM(nn.Linear(3, 3))
    model = two_layers()
    admm = StructuredADMM(model)
    admm.prune()
    for call in (admm.penalty, admm.step, admm.prune):
        with pytest.raises(RuntimeError, match="prune"):
            call()
    with pytest.raises(ValueError, match="already pruned"):
        StructuredADMM(model)
