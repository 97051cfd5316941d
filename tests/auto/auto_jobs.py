"""Rank jobs of tests/auto/test_auto_hook.py (module level, so that worker processes can import them), and the
hand-built methods the auto tests list beside the cast family's: ``test-strided`` (every 16th entry sent, 1/16 of
the bytes; error feedback keeps the rest) and ``test-late`` (each bucket sent a step late: a held slot, as DGC's
velocity)."""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

import gcomp
from gcomp import registry
from gcomp.collectives import AllreduceCommunicator
from tests import models


class Strided(gcomp.Compressor):
    traits = gcomp.Traits(fidelity=gcomp.contraction(), rows=None)

    def encode(self, x, state, layout):
        rest = x.clone()
        rest[0::16] = 0
        return gcomp.Payload([x[0::16].contiguous()], ctx=x.numel(), residual=rest), state

    def decode(self, received, ctx):
        out = received[0].new_zeros(ctx)
        out[0::16] = received[0]
        return out


class Late(gcomp.Compressor):
    traits = gcomp.Traits(fidelity=gcomp.contraction(), slots=("held",), held=("held",), rows=None)

    def encode(self, x, state, layout):
        return gcomp.Payload([state["held"]]), {"held": x.clone()}

    def decode(self, received, ctx):
        return received[0].clone()


HAND_BUILT = {"test-strided": lambda: gcomp.Method(Strided(), gcomp.ResidualMemory(), AllreduceCommunicator()),
              "test-late": lambda: gcomp.Method(Late(), gcomp.NoMemory(), AllreduceCommunicator())}


@contextmanager
def hand_built():
    """The hand-built methods registered inside the block only (other tests go through every registered method)."""
    for name, factory in HAND_BUILT.items():
        registry.register(name)(factory)
    try:
        yield
    finally:
        for name in HAND_BUILT:
            registry._REGISTRY.pop(name, None)


def _trained(name: str | None, steps: int, seed: int = 0, **params) -> tuple[torch.nn.Module, object]:
    ddp_model = models.ddp(models.mlp(seed), bucket_cap_mb=models.SEVERAL_BUCKETS_MB)
    state = gcomp.install(ddp_model, name, **params) if name else None
    models.train(ddp_model, steps)
    return ddp_model, state


def job_train(allow, steps: int, **params) -> dict:
    """Train with ``auto``; this rank's parameters, statistics and choices."""
    ddp_model, state = _trained("auto", steps, allow=allow, **params)
    return {"params": models.flat_params(ddp_model.module).clone(), "stats": dict(state.stats),
            "choices": state.method.choices(), "rank": dist.get_rank()}


class AlternatingLink:
    """A fake probe: a very slow link and a very fast one in turn, so that every new probe moves the choice."""

    def __init__(self):
        self.calls = 0

    def __call__(self, group, device, bucket_bytes=0):
        from gcomp.link import Network

        self.calls += 1
        return Network(1e6 if self.calls % 2 else 1e12, 0.0)


def job_switching(allow, steps: int, prune: bool = False) -> dict:
    """Train with ``auto`` on a link that a fake probe makes alternate, and every check probe again."""
    with hand_built():
        return _switching(allow, steps, prune)


def _switching(allow, steps: int, prune: bool) -> dict:
    import gcomp.auto.chooser as auto_chooser

    auto_chooser.probe_network = AlternatingLink()
    model = models.mlp(0)
    if prune:
        for module in model.modules():
            if isinstance(module, torch.nn.Linear):
                torch.nn.utils.prune.l1_unstructured(module, "weight", amount=0.5)
    ddp_model = models.ddp(model, bucket_cap_mb=models.SEVERAL_BUCKETS_MB)
    state = gcomp.install(ddp_model, "auto", allow=allow, trials=2, probe_every=2, reprobe_above=1e-9)
    models.train(ddp_model, steps)
    auto = state.method
    return {"params": models.flat_params(ddp_model.module).clone(), "stats": dict(state.stats),
            "choices": state.method.choices(), "active": [auto.specs[i] for i in auto.chooser.active],
            "lossless": [auto.methods[i].lossless for i in auto.chooser.active]}


def job_conservation(allow, steps: int) -> dict:
    """Fake float64 buckets through the hook with ``auto`` switching methods: what came out, what went in (over
    every rank), and what the candidates still hold back (over every rank), per bucket."""
    with hand_built():
        return _conservation(allow, steps)


def _conservation(allow, steps: int) -> dict:
    import gcomp.auto.chooser as auto_chooser
    from gcomp.testing.buckets import FakeBucket, bucket_groups

    auto_chooser.probe_network = AlternatingLink()
    rank = dist.get_rank()
    ddp_model = models.ddp(models.mlp(0).to(torch.float64))
    state = gcomp.HookState(gcomp.create("auto", allow=allow, trials=1, probe_every=1, reprobe_above=1e-9),
                            ddp_model)
    state.warmup = 0
    groups = bucket_groups(ddp_model.module, "several")
    sent = [torch.zeros(sum(p.numel() for p in g), dtype=torch.float64) for g in groups]
    given = [s.clone() for s in sent]
    for step in range(steps):
        futures = []
        for index, params in enumerate(groups):
            g = torch.Generator().manual_seed(1000 * step + 10 * rank + index)
            grad = torch.randn(given[index].numel(), generator=g, dtype=torch.float64)
            given[index] += grad
            futures.append(state.reduce(FakeBucket(grad.clone(), index, index == len(groups) - 1, params)))
        for index, fut in enumerate(futures):
            sent[index] += fut.wait()
    auto = state.method
    held = [torch.zeros_like(s) for s in sent]
    parked = 0.0  # held back by a method that is not the layout's last: a switch left it behind
    for record in auto.chooser.records.values():
        for i, method in enumerate(auto.methods):
            part = method.flush(record.bucket, held[record.bucket.index])  # its memory's and its held slots'
            if part is not None:
                held[record.bucket.index] += part
                parked += float(part.abs().sum()) if i != record.last else 0.0
    for t in given + held:
        dist.all_reduce(t)
    return {"sent": sent, "given": given, "held": held, "parked": parked, "switches": state.stats["auto_switches"],
            "world": dist.get_world_size()}


def job_one_slow_rank(steps: int) -> dict:
    """``identity``'s codec made slower than ``fp16``'s on the last rank only (20 ms against 10 ms everywhere), on a
    link that costs nothing: alone, the other ranks would keep identity; agreeing on the slowest rank's seconds,
    every rank takes fp16."""
    import time

    import gcomp.auto.chooser as auto_chooser
    from gcomp.link import Network

    auto_chooser.probe_network = lambda group, device, bucket_bytes=0: Network(1e12, 0.0)
    ddp_model = models.ddp(models.mlp(0), bucket_cap_mb=models.SEVERAL_BUCKETS_MB)
    state = gcomp.install(ddp_model, "auto", allow=["identity", "fp16"], trials=2)
    identity, fp16 = (m.compressor for m in state.method.methods)

    def slowed(codec, seconds):
        encode = codec.encode

        def slow(x, state, layout):
            time.sleep(seconds)
            return encode(x, state, layout)

        codec.encode = slow

    slowed(fp16, 0.01)
    if dist.get_rank() == dist.get_world_size() - 1:
        slowed(identity, 0.02)
    models.train(ddp_model, steps)
    return {"choices": state.method.choices(), "params": models.flat_params(ddp_model.module).clone()}
