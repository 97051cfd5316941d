"""The local checks of a method's codec, run in this process on one example's inputs: homomorphism of
all-reduce codecs (contract 3), error-feedback conservation (contract 5), and whether the codec treats a
parameter's entries alike wherever the bucket lays them (which contract 7 needs of a resumed plain-DDP run).

They read ``method.compressor`` and ``method.memory``, so they apply to a ``gcomp.Method`` only; the two checks
raise ``Skip`` with the reason where they do not apply, and AssertionError with a message where the codec
fails; ``layout_dependence`` returns its answer.
``make`` is a callable with no arguments returning a fresh, configured method (``gcomp.create`` of a name).
"""
from __future__ import annotations

import copy
import random
from typing import Any, Callable

import torch

import gcomp
from gcomp.method import Composite
from gcomp.testing.buckets import DTYPES, dtype_name
from gcomp.testing.models import mlp
from gcomp.testing.report import Skip
from gcomp.testing.tolerance import require_within, sum_bound, wire_precision

# The ranges of one homomorphism example (the test suite draws from them with hypothesis, check_method with
# a seeded random sample): ranks, entries, seed, log10 of the scale, share of zeros, dtype.
WORLDS = (1, 8)
NUMELS = (1, 300)
SEEDS = (0, 2**31 - 1)
LOG_SCALES = (-3.0, 3.0)
ZEROS = (0.0, 0.5, 1.0)
CONSERVATION_STEPS = 6


def codec_of(method: Any) -> gcomp.Method:
    """``method`` when it is a ``gcomp.Method`` (with a compressor and a memory to run alone), else Skip."""
    if not isinstance(method, gcomp.Method):
        raise Skip(f"{type(method).__name__} is not a gcomp.Method (a composite method): it has no compressor and "
                   "memory of its own to run alone")
    return method


def homomorphism_examples(count: int, seed: int = 0) -> list[dict]:
    """``count`` examples for ``check_homomorphism`` (its keyword arguments), drawn with ``random.Random(seed)``
    from the ranges above; the first ones are the corners (1 and 8 ranks, 1 entry, all zeros)."""
    rng = random.Random(seed)
    corners = [dict(world=1, numel=1, zeros=0.0), dict(world=WORLDS[1], numel=NUMELS[1], zeros=1.0),
               dict(world=WORLDS[1], numel=1, zeros=0.5)]
    out = []
    for i in range(count):
        example = {"world": rng.randint(*WORLDS), "numel": rng.randint(*NUMELS), "seed": rng.randint(*SEEDS),
                   "log_scale": rng.uniform(*LOG_SCALES), "zeros": rng.choice(ZEROS), "dtype": DTYPES[i % len(DTYPES)]}
        out.append({**example, **(corners[i] if i < len(corners) else {})})
    return out


def example_label(world: int, numel: int, seed: int, log_scale: float, zeros: float, dtype: torch.dtype) -> str:
    return f"ws{world} numel={numel} seed={seed} log_scale={log_scale:.2f} zeros={zeros} {dtype_name(dtype)}"


def check_homomorphism(make: Callable[[], Any], world: int, numel: int, seed: int, log_scale: float, zeros: float,
                       dtype: torch.dtype) -> None:
    """Contract 3 on one example: decompress(elementwise sum of the payloads, in their dtype) == sum of
    decompress(payload), on ``world`` ranks' methods (one each, created alike as ranks do), two rounds (the
    second checks that per-rank state, a shared seed, stays in step). Exact for lossless codecs, within the
    rounding of the wire dtype otherwise."""
    methods = [make() for _ in range(world)]
    if methods[0].collective != gcomp.ALLREDUCE:
        raise Skip(f"homomorphism applies to methods whose collective is {gcomp.ALLREDUCE!r}; this one's is "
                   f"{methods[0].collective!r}")
    methods = [codec_of(m) for m in methods]
    g = torch.Generator().manual_seed(seed)
    for round_ in range(2):
        xs = []
        for _ in range(world):
            x = torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** log_scale
            x[torch.rand(numel, generator=g) < zeros] = 0.0
            xs.append(x.to(dtype))
        info = gcomp.BucketInfo.single(xs[0])
        payloads = [m.compressor.compress(x, info) for m, x in zip(methods, xs)]
        decoded = [m.compressor.decompress(p.tensors, p.ctx) for m, p in zip(methods, payloads)]
        summed = [sum(parts[1:], parts[0].clone()) for parts in zip(*(p.tensors for p in payloads))]
        total = sum(decoded[1:], decoded[0].clone())
        eps, tiny = wire_precision(payloads[0].tensors, dtype)
        bound = sum_bound(world, torch.stack(decoded).double().abs().sum(0), eps, tiny)
        for rank, (m, p) in enumerate(zip(methods, payloads)):  # each rank decodes the sum with its own ctx
            result = m.compressor.decompress([t.clone() for t in summed], p.ctx)
            if result.shape != xs[0].shape or result.dtype != dtype:
                raise AssertionError(f"round {round_}, rank {rank}: decoding the sum gave shape {tuple(result.shape)}"
                                     f" and {result.dtype} for a bucket of {tuple(xs[0].shape)} and {dtype}")
            if m.compressor.lossless:
                if not torch.equal(result, total):
                    raise AssertionError(f"round {round_}, rank {rank}: lossless codec not exact")
            else:
                require_within(result, total.double(), bound, f"round {round_}, rank {rank}")


def check_conservation(method: Any, dtype: torch.dtype) -> None:
    """Contract 5: decompress(payload) + new residual == gradient + old residual, step after step, across a
    re-layout (``method`` is used up: pass a fresh one).

    The residual is read by compensating a zero gradient on a copy of the memory. The only slack allowed is
    the rounding of the stored residual itself (none at all for codecs that send entries unchanged).
    """
    method = codec_of(method)
    if not method.error_feedback:
        raise Skip("conservation applies to methods with error feedback (method.error_feedback); this one's memory "
                   "keeps no residual")
    memory, compressor = method.memory, method.compressor
    numels = {"a.weight": 120, "a.bias": 7, "b.weight": 50}
    layouts = [gcomp.BucketInfo.from_layout(0, dtype, list(numels), list(numels.values())),
               gcomp.BucketInfo.from_layout(0, dtype, list(numels)[::-1], list(numels.values())[::-1])]
    g = torch.Generator().manual_seed(1)
    eps = torch.finfo(dtype).eps

    def residual(info):
        return copy.deepcopy(memory).compensate(torch.zeros(info.numel, dtype=dtype), info)

    for step in range(CONSERVATION_STEPS):
        info = layouts[step // 3]  # the second layout is DDP's rebuild: residuals must follow the parameters
        grad = (torch.randn(info.numel, generator=g, dtype=torch.float64) * 10.0 ** (step - 2)).to(dtype)
        old = residual(info)
        compensated = memory.compensate(grad, info)
        if not torch.equal(compensated, grad + old):
            raise AssertionError(f"step {step}: compensate is not gradient + residual")
        payload = compressor.compress(compensated, info)
        memory.update(compensated, info, compressor, payload)
        sent = compressor.decompress(payload.tensors, payload.ctx)
        new = residual(info)
        require_within(sent.double() + new.double(), compensated.double(), eps * new.double().abs(),
                       f"step {step}: sent + new residual vs gradient + old residual")
        if step == 2 and not new.abs().sum() > 0:
            raise AssertionError("a lossy error-feedback method kept no residual")


def layout_dependence(make: Callable[[], Any], label: str) -> str | None:
    """None when the method treats each parameter's entries alike wherever DDP places them in the bucket, else
    why a resumed plain-DDP run checkpointed before DDP's bucket rebuild cannot be held to the uninterrupted one
    (``label`` names the method).

    A checkpoint taken after the rebuild records the layouts, and the resumed run reduces the fresh DDP's first
    bucket as those (``gcomp.resume_layouts``); one taken before records none to go back to. Then only a
    layout-independent method lets the resumed run (on DDP's first bucket) follow the uninterrupted run (on the
    rebuilt layout) bit for bit. A method that says
    it ``depends_on_layout`` is not; others are checked on the MLP's parameters laid out in two orders, over a
    few error-feedback steps; a composite (``gcomp.composite.Composite``: ``auto``, ``hierarchical``) is when each
    of its parts is; another kind of method, neither, is unknown.
    """
    dependent = (f"{label} depends on where a parameter lies in the bucket, and a fresh DDP model starts from its "
                 "initial layout")
    first = make()
    if first.depends_on_layout:
        return dependent
    if isinstance(first, Composite):  # it hands each bucket, whole, to a part
        for i, part in enumerate(first.parts):
            why = layout_dependence(lambda i=i: make().parts[i], f"{label} (its part {part.name})")
            if why is not None:
                return why
        return None
    try:
        codec_of(first)
    except Skip as skip:
        return f"whether {label} depends on where a parameter lies in the bucket is unknown ({skip})"
    named = [(n, p.numel()) for n, p in mlp().named_parameters()]
    g = torch.Generator().manual_seed(5)
    grads = {n: torch.randn(k, generator=g) * 10.0 ** torch.randint(-3, 3, (), generator=g) for n, k in named}

    def run(order):
        method = make()
        info = gcomp.BucketInfo.from_layout(0, torch.float32, [n for n, _ in order], [k for _, k in order])
        decoded = []
        for step in range(3):
            flat = torch.cat([grads[n] for n, _ in order]) * (step + 1)
            compensated = method.memory.compensate(flat, info)
            payload = method.compressor.compress(compensated, info)
            method.memory.update(compensated, info, method.compressor, payload)
            d = method.compressor.decompress(payload.tensors, payload.ctx)
            decoded.append({n: d[o:o + k] for n, o, k in info.segments()})
        return decoded

    same = all(torch.equal(a[n], b[n]) for a, b in zip(run(named), run(named[::-1])) for n in a)
    return None if same else dependent
