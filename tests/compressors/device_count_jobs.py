"""Rank jobs that count one bucket's operations for pactrain and prunex with the same masks on every rank.

``gcomp.testing.ops.count_reduction`` prunes each rank from the same seed; ``job_packed_counts`` seeds the global
stream alike on every rank first too, so that the counted step is a packed one (one round for ``ternary=true``)."""
from __future__ import annotations

import torch

from gcomp.testing.ops import CONFIGS, count_reduction, spec_maker

# smaller than the (4 and 64 parameters of 64 K entries, 4 of 16 M): the same growth shows
SMALL = ((4, 1 << 14), (64, 1 << 14), (4, 1 << 18))


def job_packed_counts(specs: list[str], configs=CONFIGS, seed: int = 1234) -> dict:
    """``gcomp.testing.ops.job_device_counts`` with the same masks on every rank."""
    out = {}
    for spec in specs:
        for params, numel in configs:
            torch.manual_seed(seed)  # random_unstructured draws from the global stream: alike on every rank
            counts = count_reduction(spec_maker(spec), params, numel, warm_steps=4)
            out[(spec, params, numel)] = {"ops": dict(counts["ops"]), "syncs": dict(counts["syncs"])}
    return out
