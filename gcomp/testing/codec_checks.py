"""The local checks of a method's codec, run in this process: homomorphism of all-reduce codecs (contract 3), and
whether the method treats a parameter's entries alike wherever the bucket lays them (which contract 7 needs of a
resumed plain-DDP run). ``make``: a callable with no arguments returning a fresh, configured method."""
from __future__ import annotations

import collections
import random
from typing import Any, Callable

import torch

import gcomp
from gcomp.collectives.reduce import ChainedCompressor
from gcomp.method import Composite
from gcomp.testing.buckets import DTYPES, dtype_name
from gcomp.testing.fidelity import mismatch, precision, sum_bound
from gcomp.testing.models import mlp
from gcomp.testing.reduce_jobs import decode_alone
from gcomp.testing.report import Skip

# The ranges of one homomorphism example (the test suite draws from them with hypothesis, check_method with a
# seeded random sample): ranks, entries, seed, log10 of the scale, share of zeros.
WORLDS = (1, 8)
NUMELS = (1, 300)
SEEDS = (0, 2**31 - 1)
LOG_SCALES = (-3.0, 3.0)
ZEROS = (0.0, 0.5, 1.0)


def codec_of(method: Any) -> gcomp.Method:
    """``method`` when it is a ``gcomp.Method`` (with a compressor and a memory to run alone), else Skip."""
    if not isinstance(method, gcomp.Method):
        raise Skip(f"{type(method).__name__} is not a gcomp.Method (a composite method): it has no compressor and "
                   "memory of its own to run alone")
    return method


def homomorphism_examples(count: int, seed: int = 0) -> list[dict]:
    """``count`` examples for ``check_homomorphism`` (its keyword arguments), drawn with ``random.Random(seed)``;
    the first ones are the corners (1 and 8 ranks, 1 entry, all zeros)."""
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
    """Contract 3 on one example: decoding the payloads reduced element-wise in their dtype (each tensor by its op)
    is the sum of the payloads decoded alone, on ``world`` ranks' methods, two rounds (the second checks that
    per-rank state stays in step). Exact for lossless codecs, within the rounding of the wire dtype otherwise."""
    methods = [make() for _ in range(world)]
    if methods[0].collective != gcomp.ALLREDUCE:
        raise Skip(f"homomorphism applies to methods whose collective is {gcomp.ALLREDUCE!r}; this one's is "
                   f"{methods[0].collective!r}")
    methods = [codec_of(m) for m in methods]
    if not methods[0].decodes_alone:
        raise Skip("its result is not the sum of the payloads decoded alone (traits.decodes_alone is False)")
    g = torch.Generator().manual_seed(seed)
    for round_ in range(2):
        xs = []
        for _ in range(world):
            x = torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** log_scale
            x[torch.rand(numel, generator=g) < zeros] = 0.0
            xs.append(x.to(dtype))
        info = gcomp.BucketInfo.single(xs[0])
        payloads = [m._send(x, info, collections.defaultdict(float)) for m, x in zip(methods, xs)]
        if isinstance(methods[0].compressor, ChainedCompressor) and methods[0].compressor.chained(payloads[0]):
            raise Skip("a chained payload's second round is made from the first round's reduction")
        summed = [torch.stack(parts).amax(0) if payloads[0].op(i) == gcomp.core.MAX else sum(parts[1:], parts[0].clone())
                  for i, parts in enumerate(zip(*(p.tensors for p in payloads)))]
        decoded = [decode_alone(m, p) for m, p in zip(methods, payloads)]
        total = sum(decoded[1:], decoded[0].clone())
        eps, tiny = precision([dtype, *(t.dtype for t in payloads[0].tensors)])
        bound = sum_bound(world, torch.stack(decoded).double().abs().sum(0), eps, tiny)
        for rank, (m, p) in enumerate(zip(methods, payloads)):  # each rank decodes the sum with its own ctx
            result = m.compressor.decode([t.clone() for t in summed], p.ctx)
            if result.shape != xs[0].shape or result.dtype != dtype:
                raise AssertionError(f"round {round_}, rank {rank}: decoding the sum gave shape {tuple(result.shape)}"
                                     f" and {result.dtype} for a bucket of {tuple(xs[0].shape)} and {dtype}")
            if m.lossless and not torch.equal(result, total):
                raise AssertionError(f"round {round_}, rank {rank}: lossless codec not exact")
            off = None if m.lossless else mismatch(result, total.double(), bound, f"round {round_}, rank {rank}")
            if off is not None:
                raise AssertionError(off)


def layout_dependence(make: Callable[[], Any], label: str) -> str | None:
    """None when the method treats each parameter's entries alike, bit for bit, wherever DDP places them in the
    bucket; else why a resumed plain-DDP run checkpointed before DDP's bucket rebuild (its first resumed step on
    DDP's first bucket, the uninterrupted run's on the rebuilt one) cannot be held to the uninterrupted one.

    A method that says it ``depends_on_layout`` does; others are run, three error-feedback steps, on the MLP's
    parameters in one bucket, in several orders (forward, backward, shuffled: DDP's rebuilt order is the gradients'),
    and compared bit for bit (a per-bucket sum differs in its last bits); a composite does when a part does."""
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
    g, rng = torch.Generator().manual_seed(5), random.Random(5)
    grads = {n: torch.randn(k, generator=g) * 10.0 ** torch.randint(-3, 3, (), generator=g) for n, k in named}

    def run(order):
        method, info = make(), gcomp.BucketInfo.from_layout(0, torch.float32, [n for n, _ in order],
                                                            [k for _, k in order])
        decoded = []
        for step in range(3):
            flat = torch.cat([grads[n] for n, _ in order]) * (step + 1)
            d = decode_alone(method, method._send(flat, info, collections.defaultdict(float)))
            decoded.append({n: d[o:o + k] for n, o, k in info.segments()})
        return decoded

    try:
        base = run(named)
        for order in [named[::-1]] + [rng.sample(named, len(named)) for _ in range(4)]:
            if not all(torch.equal(a[n], b[n]) for a, b in zip(base, run(order)) for n in a):
                return dependent
    except Exception as err:  # noqa: BLE001 -- a codec that cannot run alone here: the resumes will say
        return f"whether {label} depends on where a parameter lies in the bucket is unknown ({type(err).__name__}: {err})"
    return None
