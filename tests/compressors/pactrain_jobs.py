"""Rank jobs for tests/compressors/test_pactrain.py: pruned models trained under DDP, with and without pactrain.

One job per world size runs many configurations (``CONFIGS``) in one call, the pattern of
gcomp/testing/train_jobs.py: each trains a pruned model under ``pactrain`` and, where the test compares against it,
the same model under plain DDP with no hook (a dense all-reduce of the masked gradients), with the same masks
and the same mask edits at the same steps.
"""
from __future__ import annotations

import io
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import prune

import gcomp
from gcomp.pruning import named_masks, no_buffer_sync
from tests import models

STEPS = 12
EDIT_AT = 6  # a mask edit happens just before the forward of this step (after a freeze at step 4 or 7)
BUCKET_MB = 0.001  # 250 fp32 entries: the pruned MLP splits into 3 buckets after DDP's rebuild, the CNN into 2
LR, MOMENTUM = 0.1, 0.9
STAT_KEYS = ("steps", "buckets", "bytes_sent", "bytes_dense", "warmup_steps", "layouts",
             "packed_buckets", "freezes", "unfreezes", "mask_mismatches", "one_round_buckets", "scale_resyncs")


@dataclass(frozen=True)
class Config:
    """One training run: the model, DDP's options, pactrain's parameters and what happens to the masks."""

    model: str = "mlp"  # "mlp", "cnn" (contiguous) or "cnn_cl" (the same net in channels_last)
    ddp: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    steps: int = STEPS
    reference: bool = True  # also train the plain DDP twin
    edit: str | None = None  # an EDITS entry, applied before the forward of step edit_at
    edit_at: int = EDIT_AT
    differ: bool = False  # rank 1 holds other masks from the start (needs NO_SYNC)
    no_warmup: bool = False  # the hook's warm-up cut to 0: the tracker sees DDP's initial layout and its rebuild


NO_SYNC = no_buffer_sync()  # masks that differ between ranks stay so (DDP would broadcast rank 0's every forward)
CONFIGS = {
    "basic": Config(),
    "static": Config(ddp={"static_graph": True}),
    "view": Config(ddp={"gradient_as_bucket_view": True}),
    "ternary": Config(params={"ternary": True}, reference=False),
    "cnn": Config(model="cnn", reference=False),
    "cnn_cl": Config(model="cnn_cl"),
    "rebuild": Config(params={"stable_steps": 2}, no_warmup=True),
    "mismatch": Config(ddp=NO_SYNC, params={"stable_steps": 2}, differ=True),
    "diverge": Config(ddp=NO_SYNC, params={"stable_steps": 2}, edit="prune_more_on_rank_1", steps=14),
    "reprune": Config(params={"stable_steps": 2}, edit="reprune_everywhere", steps=14),
    # rank 1 prunes more during DDP's warm-up, after install agreed on the masks
    "early_edit": Config(ddp=NO_SYNC, params={"stable_steps": 2}, edit="prune_more_on_rank_1", edit_at=0, steps=8),
}


# --- models, data and mask edits --------------------------------------------------------------------------------

def pruned_mlp(seed: int = 0) -> nn.Module:
    """``tests.models.mlp`` with its first two Linear weights pruned by magnitude at ratio 0.5; the last layer
    is left whole, so its bucket keeps everything and stays a plain all-reduce (pactrain's ``dense`` mode)."""
    model = models.mlp(seed)
    for i in (0, 2):
        prune.l1_unstructured(model[i], "weight", amount=0.5)
    return model


def pruned_cnn(seed: int = 0, channels_last: bool = False) -> nn.Module:
    """A small CNN with both convolutions pruned at 0.5 (pruned first, then moved to channels_last if asked)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 10))
    for i in (0, 2):
        prune.l1_unstructured(model[i], "weight", amount=0.5)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model


def cnn_batch(step: int, rank: int, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank + 7)
    x = torch.randn(8, 3, 6, 6, generator=g)
    y = torch.randint(0, 10, (8,), generator=g)
    return (x.contiguous(memory_format=torch.channels_last) if channels_last else x), y


def prune_more(mask: torch.Tensor, count: int) -> None:
    """Zero the first ``count`` kept entries of ``mask`` in place (which bumps its ``_version``)."""
    flat = mask.view(-1)
    flat[flat.nonzero().reshape(-1)[:count]] = 0


def _prune_more_on_rank_1(model: nn.Module) -> None:
    if dist.get_rank() == 1:
        for i in (0, 2):
            prune_more(model[i].weight_mask, 5)


def _reprune_everywhere(model: nn.Module) -> None:
    prune_more(model[0].weight_mask, 10)  # in place
    prune.l1_unstructured(model[2], "weight", amount=0.2)  # a new mask object (torch's PruningContainer)


EDITS = {"prune_more_on_rank_1": _prune_more_on_rank_1, "reprune_everywhere": _reprune_everywhere}


def _flip_first_entry_on_rank_1(model: nn.Module) -> None:
    if dist.get_rank() == 1:
        for i in (0, 2):
            flat = model[i].weight_mask.view(-1)
            flat[0] = 1 - flat[0]


# --- training ---------------------------------------------------------------------------------------------------

def _build(config: Config, hook: bool) -> tuple[nn.Module, gcomp.HookState | None]:
    model = pruned_mlp() if config.model == "mlp" else pruned_cnn(channels_last=config.model == "cnn_cl")
    ddp_model = models.ddp(model, bucket_cap_mb=BUCKET_MB, **config.ddp)
    if config.differ:  # after DDP is built: with forward_sync_buffers=False (torch 2.13) it still broadcasts
        _flip_first_entry_on_rank_1(model)  # rank 0's buffers, the masks, once at construction
    state = gcomp.install(ddp_model, "pactrain", **config.params) if hook else None
    if state is not None and config.no_warmup:
        state.warmup = 0
    return ddp_model, state


def _batch(config: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    if config.model == "mlp":
        return models.batch(step, dist.get_rank())
    return cnn_batch(step, dist.get_rank(), config.model == "cnn_cl")


def _optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _steps(config: Config, ddp_model, opt, state, start: int, stop: int, history: list) -> None:
    for step in range(start, stop):
        if config.edit is not None and step == config.edit_at:
            EDITS[config.edit](ddp_model.module)
        x, y = _batch(config, step)
        opt.zero_grad()
        nn.functional.cross_entropy(ddp_model(x), y).backward()
        opt.step()
        if state is not None:
            history.append({k: state.stats[k] for k in STAT_KEYS})


def _masks(module: nn.Module) -> dict:
    return {n: m.detach().clone() for n, m in named_masks(module).items()}


def _snapshot(ddp_model, state, init: tuple[dict, dict], history: list, caught: list) -> dict:
    module = ddp_model.module
    return {
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "grads": {n: p.grad.detach().clone() for n, p in module.named_parameters()},
        "init": init[0],
        "init_masks": init[1],
        "masks": _masks(module),
        "history": history,
        # what the hook saw: (names, numels) per bucket layout, in the order first seen
        "layouts": [(info.names, info.numels) for info in state._layouts.values()] if state is not None else None,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)],
    }


def train(config: Config, hook: bool) -> dict:
    """Train one configuration; returns parameters, last gradients, initial parameters and masks, final masks,
    the hook's stats after every step, the bucket layouts it saw and the RuntimeWarnings raised (this rank)."""
    ddp_model, state = _build(config, hook)
    init = ({n: p.detach().clone() for n, p in ddp_model.module.named_parameters()}, _masks(ddp_model.module))
    history: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _steps(config, ddp_model, _optimizer(ddp_model), state, 0, config.steps, history)
    return _snapshot(ddp_model, state, init, history, caught)


def job_train(names: list[str]) -> dict:
    """Every named ``CONFIGS`` entry: ``{name: {"pactrain": run, "reference": run or None}}`` (see ``train``)."""
    out = {}
    for name in names:
        config = CONFIGS[name]
        out[name] = {"pactrain": train(config, hook=True),
                     "reference": train(config, hook=False) if config.reference else None}
    return out


# --- resuming ---------------------------------------------------------------------------------------------------

def _resumed_run(params: dict, ddp_kwargs: dict, schedule: list[int], load_hook: bool = True) -> tuple[dict, dict]:
    """Train ``schedule[0]`` steps, then for each later entry: checkpoint model, optimizer and hook (torch.save,
    torch.load with weights_only=True), build a fresh pruned model, DDP and hook from it (the hook state loaded
    unless ``load_hook`` is False), train that many more."""
    config = Config(params=params, ddp=ddp_kwargs)
    ddp_model, state = _build(config, hook=True)
    opt = _optimizer(ddp_model)
    history: list = []
    _steps(config, ddp_model, opt, state, 0, schedule[0], history)
    done = schedule[0]
    for steps in schedule[1:]:
        buf = io.BytesIO()
        torch.save({"model": ddp_model.module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict()},
                   buf)
        buf.seek(0)
        checkpoint = torch.load(buf, weights_only=True)
        fresh = pruned_mlp(seed=1)  # other weights and masks: everything must come from the checkpoint
        fresh.load_state_dict(checkpoint["model"])
        ddp_model = models.ddp(fresh, bucket_cap_mb=BUCKET_MB, **ddp_kwargs)
        state = gcomp.install(ddp_model, "pactrain", **params)
        if load_hook:
            state.load_state_dict(checkpoint["hook"])
        opt = _optimizer(ddp_model)
        opt.load_state_dict(checkpoint["opt"])
        _steps(config, ddp_model, opt, state, done, done + steps, history)
        done += steps
    return {n: p.detach().clone() for n, p in ddp_model.module.named_parameters()}, dict(state.stats)


def job_resume(cases: dict, steps: int) -> dict:
    """Each ``{name: (pactrain params, DDP options, checkpoint step, load the hook state)}`` trained ``steps``
    steps straight through and with a checkpoint at that step: ``{name: {"straight": params, "resumed": params,
    "straight_stats", "resumed_stats"}}``."""
    out = {}
    for name, (params, ddp_kwargs, first, load_hook) in cases.items():
        straight, straight_stats = _resumed_run(params, ddp_kwargs, [steps])
        resumed, resumed_stats = _resumed_run(params, ddp_kwargs, [first, steps - first], load_hook)
        out[name] = {"straight": straight, "resumed": resumed, "straight_stats": straight_stats,
                     "resumed_stats": resumed_stats}
    return out
