"""GraSP scores (Wang, Zhang, Grosse, ICLR 2020) of a pre-trained model: ``score = -theta * (H g)``.

As the reference code does (docs/algorithms.md §10.2): a class-balanced sample split into two halves, logits divided
by a temperature in both passes, ``g`` the sum of the two half-batch gradients, ``H g`` by double backprop
(Pearlmutter). Unlike the reference, nothing is re-initialised: the weights are pre-trained (PacTrain).
Removing the weights with the *largest* scores reduces the gradient flow ``g^T g`` the least.
"""
from __future__ import annotations

import itertools
from typing import Iterable, Sequence, Union

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]
Data = Union[Batch, Iterable[Batch]]


def _is_batch(data) -> bool:
    return (isinstance(data, (tuple, list)) and len(data) == 2
            and all(isinstance(t, torch.Tensor) for t in data))


def _batches(data: Data) -> Iterable[Batch]:
    if _is_batch(data):
        return [tuple(data)]
    try:
        return iter(data)
    except TypeError:
        raise ValueError(f"data must be a tuple (inputs, targets) of tensors or an iterable of them, "
                         f"got {type(data).__name__}") from None


def _occurrence(y: torch.Tensor) -> torch.Tensor:
    """For each element of ``y``, how many earlier elements of ``y`` hold the same class."""
    order = torch.argsort(y, stable=True)
    ys = y[order]
    rank_sorted = torch.arange(y.numel(), device=y.device) - torch.searchsorted(ys, ys, side="left")
    rank = torch.empty_like(rank_sorted)
    rank[order] = rank_sorted
    return rank


def class_balanced_sample(data: Data, samples_per_class: int, num_classes: int) -> Batch:
    """The first ``samples_per_class`` examples of every class (read until all are full or the data ends), then
    ordered by class, as the reference ``GraSP_fetch_data`` (its two halves hold different classes)."""
    counts = torch.zeros(num_classes, dtype=torch.int64)
    xs, ys = [], []
    for batch in _batches(data):
        if not _is_batch(batch):
            raise ValueError(f"every batch of data must be a tuple (inputs, targets) of tensors, "
                             f"got {type(batch).__name__}")
        x, y = batch
        if y.dtype.is_floating_point or y.dtype.is_complex or y.dtype == torch.bool or y.dim() != 1:
            raise ValueError(f"targets must be a 1-D tensor of class indices, got {y.dtype} of shape "
                             f"{tuple(y.shape)}")
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"inputs and targets differ in length: {x.shape[0]} vs {y.shape[0]}")
        y = y.cpu().to(torch.int64)
        if y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes):
            raise ValueError(f"targets must lie in [0, {num_classes}) (the model's output width), "
                             f"got [{int(y.min())}, {int(y.max())}]")
        take = (counts[y] + _occurrence(y)) < samples_per_class
        counts += torch.bincount(y, minlength=num_classes)
        xs.append(x[take.to(x.device)])
        ys.append(y[take])
        if bool((counts >= samples_per_class).all()):
            break
    if not ys or sum(t.numel() for t in ys) == 0:
        raise ValueError("data holds no examples for GraSP")
    x, y = torch.cat(xs), torch.cat(ys)
    order = torch.argsort(y, stable=True)
    return x[order.to(x.device)], y[order]


def _output_width(model: nn.Module, batch, device: torch.device) -> int:
    if not _is_batch(batch) or batch[0].shape[0] == 0:
        raise ValueError("the first batch of data must be a non-empty tuple (inputs, targets) of tensors")
    with torch.no_grad():
        try:
            out = model(batch[0][:1].to(device))
        except (RuntimeError, ValueError, TypeError) as err:
            raise ValueError(f"GraSP data: the model cannot take inputs of shape {tuple(batch[0].shape[1:])} "
                             f"(per example) ({err}); give data=(inputs, targets) as the model is fed in "
                             "training") from err
    if not isinstance(out, torch.Tensor) or out.dim() != 2:
        raise ValueError("GraSP needs a model whose output is a (batch, classes) tensor of logits")
    return out.shape[1]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, temperature: float) -> torch.Tensor:
    return F.cross_entropy(model(x) / temperature, y)


def _grads(out: torch.Tensor, weights: Sequence[torch.Tensor], create_graph: bool) -> list[torch.Tensor]:
    grads = torch.autograd.grad(out, weights, create_graph=create_graph, allow_unused=True)
    return [torch.zeros_like(w) if g is None else g for w, g in zip(weights, grads)]


def hessian_gradient_product(model: nn.Module, weights: Sequence[torch.Tensor], inputs: torch.Tensor,
                             targets: torch.Tensor, temperature: float) -> list[torch.Tensor]:
    """``H g`` of the loss ``CE(model(X1)/T, y1) + CE(model(X2)/T, y2)`` over the batch's two halves, for
    ``weights`` (``g`` detached); ``.grad`` is untouched."""
    n = inputs.shape[0]
    halves = [(inputs[a:b], targets[a:b]) for a, b in ((0, n // 2), (n // 2, n)) if b > a]
    g = [torch.zeros_like(w) for w in weights]
    for x, y in halves:
        for acc, gr in zip(g, _grads(_loss(model, x, y, temperature), weights, create_graph=False)):
            acc.add_(gr)
    hg = [torch.zeros_like(w) for w in weights]
    for x, y in halves:
        grads = _grads(_loss(model, x, y, temperature), weights, create_graph=True)
        terms = [(gi * gr).sum() for gi, gr in zip(g, grads) if gr.requires_grad]
        if not terms:  # the gradient does not depend on the weights: H g = 0
            continue
        for acc, h in zip(hg, _grads(torch.stack(terms).sum(), weights, create_graph=False)):
            acc.add_(h)
    return hg


def grasp_scores(model: nn.Module, weights: Sequence[torch.Tensor], data: Data, temperature: float,
                 samples_per_class: int) -> list[torch.Tensor]:
    """``-theta * (H g)`` for each of ``weights`` on a class-balanced sample of ``data`` (the class count is the
    model's output width); runs ``model`` as it is: callers that must not disturb it pass a copy."""
    device = weights[0].device
    batches = iter(_batches(data))  # read once: data may be a one-shot iterator
    first = next(batches, None)
    if first is None:
        raise ValueError("data holds no batches for GraSP")
    num_classes = _output_width(model, first, device)
    x, y = class_balanced_sample(itertools.chain([first], batches), samples_per_class, num_classes)
    hg = hessian_gradient_product(model, weights, x.to(device), y.to(device), temperature)
    return [-(w.detach() * h) for w, h in zip(weights, hg)]
