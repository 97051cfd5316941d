"""The checks, one configuration each: AssertionError naming the rank, step and bucket where the method fails,
``Skip`` where it does not apply, else a note or None. Most read the rank jobs' results (``ranks``: per rank, in
rank order); homomorphism (contract 3) and the layout probe (contract 7) run the method in this process (``make``:
a callable with no arguments returning a fresh, configured method)."""
from __future__ import annotations

import collections
import random
from typing import Any, Callable

import torch

import gcomp
from gcomp.collectives.reduce import ChainedCompressor
from gcomp.method import Composite
from gcomp.testing import models
from gcomp.testing.buckets import DTYPES, dtype_name
from gcomp.testing.fidelity import mismatch, precision, sum_bound
from gcomp.testing.reduce_jobs import decode_alone
from gcomp.testing.report import Skip
from gcomp.testing.train_jobs import LAYOUT_KEPT, TRAIN_STEPS


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def _reports(ranks: list[dict], path: str, layout: str):
    """``(where, report of rank 0, every rank's)`` of each bucket of each step and dtype."""
    for dtype in DTYPES:
        key = (path, layout, dtype_name(dtype))
        for step, buckets in enumerate(ranks[0][key]):
            for index, report in enumerate(buckets):
                yield f"{key} step {step} bucket {index}", report, [r[key][step][index] for r in ranks]


def check_reduce(ranks: list[dict], layout: str, path: str, decodes_alone: bool) -> str | None:
    """Contract 1: every rank's result has the bucket's shape, dtype and device, and is rank 0's: on the warm-up path
    the dense mean, on the compressing path the sum of the payloads decoded alone (``decodes_alone`` methods)."""
    note = None
    for where, report, mine in _reports(ranks, path, layout):
        for rank, r in enumerate(mine):
            got = (r["shape"], r["dtype"], r["device"])
            _require(got == r["bucket"], f"{where}: rank {rank} got shape, dtype, device {got} for a bucket of "
                                         f"{r['bucket']}")
        _require(not report["differ"], f"{where}: ranks {report['differ']} got another result than rank 0")
        if path == "warmup":
            _require(report["dense"] is None, str(report["dense"]))
        elif decodes_alone and report["mean"] == "not checked":
            note = "the mean of the payloads was not checked: the method has no codec to decode them alone"
        elif decodes_alone:
            _require(report["mean"] is None, str(report["mean"]))
    return note


def check_lossless_reduce(ranks: list[dict], layout: str) -> None:
    """Contract 4 with fake buckets: on the compressing path, the result is the dense mean of the buckets."""
    for _, report, _ in _reports(ranks, "compress", layout):
        _require(report["dense"] is None, str(report["dense"]))


def _traits(method):
    traits = getattr(getattr(method, "compressor", None), "traits", None)
    if traits is None:
        raise Skip(f"{type(method).__name__} is not a gcomp.Method (a composite method): it declares no traits")
    return traits


def check_fidelity(ranks: list[dict], layout: str, method) -> None:
    """Contract 9 on the compressing path (the draws of an unbiased method: ``check_unbiased``)."""
    if _traits(method).fidelity.kind == "unbiased":
        raise Skip("an unbiased method is held to the mean of its draws (the 'draws' configuration)")
    for where, _, mine in _reports(ranks, "compress", layout):
        for rank, r in enumerate(mine):
            _require(r["fidelity"] is None, f"{where}: rank {rank}: {r['fidelity']}")


def check_unbiased(ranks: list[dict], method) -> None:
    """Contract 9 for an unbiased method: the mean of many draws of one bucket's result is the exact mean."""
    kind = _traits(method).fidelity.kind
    if kind != "unbiased":
        raise Skip(f"applies to unbiased methods; this one's error model is {kind}")
    _require(ranks[0][("unbiased",)] is None, str(ranks[0][("unbiased",)]))


def check_conservation(ranks: list[dict], dtype: torch.dtype, method) -> None:
    """Contract 5, from the job's one-rank runs."""
    if not method.error_feedback:
        raise Skip("applies to methods with error feedback; this one's error_feedback is False")
    found = ranks[0].get(("conservation", dtype_name(dtype)), Skip)
    if found is Skip:
        raise Skip(f"{method.name} keeps slots besides those it holds back (momentum): what it sends is not the "
                   "gradient's; or it is a composite, whose parts are checked")
    _require(found is None, str(found))


def check_bytes(ranks: list[dict], layout: str, method) -> None:
    """Contract 10: every compressing bucket's ``bytes_sent`` is ``traits.wire_bytes(bucket, world)``."""
    if _traits(method).wire_bytes is None:
        raise Skip("the method declares no traits.wire_bytes: the data decides")
    for where, _, mine in _reports(ranks, "compress", layout):
        for rank, r in enumerate(mine):
            sent, said = r["bytes"]
            _require(sent == said, f"{where}: rank {rank} sent {sent} bytes; traits.wire_bytes says {said}")


def check_nonfinite(ranks: list[dict], path: str, kind: str) -> None:
    """Contract 6: the last rank's bucket holds one NaN (or +inf); every rank's result holds a non-finite value."""
    for rank, r in enumerate(ranks):
        _require(not r[("nonfinite", path, kind)], f"rank {rank}: a {kind} in rank {len(ranks) - 1}'s bucket vanished")


def check_replicas(ranks: list[dict], several: bool, static: bool) -> None:
    """Contract 2: after DDP training every rank holds the same, finite parameters, and training moved them."""
    runs = [r[(several, static)] for r in ranks]
    for rank, run in enumerate(runs):
        _require(torch.equal(run["params"], runs[0]["params"]), f"rank {rank}'s parameters differ from rank 0's")
        _require(bool(torch.isfinite(run["params"]).all() and torch.isfinite(run["losses"]).all()),
                 f"rank {rank}: non-finite parameters or losses")
    _require(not torch.equal(runs[0]["params"], runs[0]["init"]), "training did not change the parameters")


def check_stats(ranks: list[dict], several: bool, static: bool, stateful: bool) -> None:
    """Contract 2: the statistics count the steps, bytes, warm-up (1 step, 2 with ``static_graph``, for stateful
    methods) and buckets of the run."""
    numel = sum(p.numel() for p in models.mlp().parameters())
    steps = TRAIN_STEPS
    for rank, r in enumerate(ranks):
        stats = r[(several, static)]["stats"]
        _require(stats["steps"] == steps, f"rank {rank}: {steps} steps expected: {stats}")
        _require(stats["bytes_sent"] > 0, f"rank {rank}: no bytes sent: {stats}")
        _require(stats["bytes_dense"] == 4 * numel * steps, f"rank {rank}: {4 * numel * steps} dense bytes: {stats}")
        warmup = (2 if static else 1) if stateful else 0
        _require(stats["warmup_steps"] == warmup, f"rank {rank}: {warmup} warm-up steps expected: {stats}")
        _require(stats["dense_buckets"] >= warmup, f"rank {rank}: fewer dense buckets than warm-up steps: {stats}")
        # the configuration has the bucket count it claims (else the matrix would test less than it says)
        _require((stats["buckets"] > steps) == several,
                 f"rank {rank}: {'several buckets' if several else 'one bucket'} per step expected: {stats}")


def check_lossless_training(ranks: list[dict], several: bool, static: bool) -> None:
    """Contract 4 in DDP: the parameters equal those of plain DDP (no hook), to float32 rounding."""
    for rank, run in enumerate(r[(several, static)] for r in ranks):
        try:
            torch.testing.assert_close(run["params"], run["reference"], rtol=1e-5, atol=1e-7)
        except AssertionError as err:
            raise AssertionError(f"rank {rank}: the parameters differ from plain DDP's: {err}") from None


def resume_skip(flavour: str, layout_dependence: str | None) -> None:
    """Skip a resume from before DDP's bucket rebuild when the method depends on the layout (why, or None)."""
    if flavour not in LAYOUT_KEPT and layout_dependence is not None:
        raise Skip(f"{layout_dependence}, and this checkpoint comes before DDP's bucket rebuild: the other cases "
                   "carry the contract")


def check_resume(ranks: list[dict], method, flavour: str) -> None:
    """Contract 7: a resumed run's parameters and step count are those of a run never stopped, bit for bit."""
    for rank, r in enumerate(ranks):
        run = r[(method, flavour)]
        _require(torch.equal(run["resumed"], run["straight"]),
                 f"rank {rank}: the resumed run left the trajectory (max difference "
                 f"{(run['resumed'] - run['straight']).abs().max().item():.3g})")
        _require(run["resumed_steps"] == run["straight_steps"] == run["steps"],
                 f"rank {rank}: steps counted resumed {run['resumed_steps']}, straight {run['straight_steps']}, "
                 f"taken {run['steps']}")


def check_fsdp(ranks: list[dict], label: str, what: str) -> None:
    """Contract 11: one of ``FSDP_CHECKS`` of ``job_fsdp``'s results for ``label``."""
    for rank, r in enumerate(ranks):
        found = r[label]["checks"][what]
        if isinstance(found, tuple):
            raise Skip(found[1])
        if found is not None:
            raise AssertionError(f"rank {rank}: {found}")


# The ranges of one homomorphism example (the test suite draws from them with hypothesis, check_method with a
# seeded random sample): ranks, entries, seed, log10 of the scale, share of zeros.
WORLDS = (1, 8)
NUMELS = (1, 300)
SEEDS = (0, 2**31 - 1)
LOG_SCALES = (-3.0, 3.0)
ZEROS = (0.0, 0.5, 1.0)
PROBE_STEPS = 5  # of the layout probe: a per-bucket sum of one scale differs in about 4 of 5 draws
NOT_A_METHOD = "is not a gcomp.Method (a composite method): it has no codec of its own to run alone"


def homomorphism_examples(count: int, seed: int = 0) -> list[dict]:
    """``count`` keyword arguments of ``check_homomorphism``, seeded; the corners first (1 and 8 ranks, 1 entry)."""
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
    """Contract 3 on one example, ``world`` ranks' methods, two rounds (per-rank state stays in step): decoding the
    payloads reduced element-wise (each tensor by its op) is the sum of the payloads decoded alone."""
    methods = [make() for _ in range(world)]
    if methods[0].collective != gcomp.ALLREDUCE:
        raise Skip(f"applies to methods whose collective is {gcomp.ALLREDUCE!r}; this one's is "
                   f"{methods[0].collective!r}")
    if not isinstance(methods[0], gcomp.Method):
        raise Skip(f"{type(methods[0]).__name__} {NOT_A_METHOD}")
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
        summed = [torch.stack(parts).amax(0) if payloads[0].op(i) == gcomp.core.MAX
                  else sum(parts[1:], parts[0].clone()) for i, parts in enumerate(zip(*(p.tensors for p in payloads)))]
        decoded = [decode_alone(m, p) for m, p in zip(methods, payloads)]
        total = sum(decoded[1:], decoded[0].clone())
        eps, tiny = precision([dtype, *(t.dtype for t in payloads[0].tensors)])
        bound = sum_bound(world, torch.stack(decoded).double().abs().sum(0), eps, tiny)
        for rank, (m, p) in enumerate(zip(methods, payloads)):  # each rank decodes the sum with its own ctx
            result = m.compressor.decode([t.clone() for t in summed], p.ctx)
            if result.shape != xs[0].shape or result.dtype != dtype:
                raise AssertionError(f"round {round_}, rank {rank}: decoding the sum gave shape {tuple(result.shape)}"
                                     f" and {result.dtype} for a bucket of {tuple(xs[0].shape)} and {dtype}")
            _require(not m.lossless or result.equal(total), f"round {round_}, rank {rank}: lossless, not exact")
            off = mismatch(result, total.double(), bound, f"round {round_}, rank {rank}")
            _require(off is None, str(off))


def layout_dependence(make: Callable[[], Any], label: str) -> str | None:
    """None when the method treats a parameter's entries alike, bit for bit, wherever DDP places them in the bucket,
    else why a resume from before DDP's bucket rebuild cannot follow the run never stopped. Unless it says it
    ``depends_on_layout``, it is run five steps on the MLP's parameters in DDP's first and rebuilt orders (forward,
    backward), on gradients of one scale (a per-bucket sum then differs in its last bits) and of many, and
    compared; a composite depends when a part does."""
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
    if not isinstance(first, gcomp.Method):
        return f"whether {label} depends on the bucket's layout is unknown ({type(first).__name__} {NOT_A_METHOD})"
    named = [(n, p.numel()) for n, p in models.mlp().named_parameters()]
    g = torch.Generator().manual_seed(5)
    grads = [{n: torch.randn(k, generator=g) * (10.0 ** torch.randint(-3, 3, (), generator=g) if step == 1 else 1)
              for n, k in named}
             for step in range(PROBE_STEPS)]  # gradients of many scales at step 1, of one scale at the others

    def run(order):
        method, info, out = make(), gcomp.BucketInfo.from_layout(0, torch.float32, *zip(*order)), []
        for step in range(PROBE_STEPS):
            flat = torch.cat([grads[step][n] for n, _ in order])
            d = decode_alone(method, method._send(flat, info, collections.defaultdict(float)))
            out.append({n: d[o:o + k] for n, o, k in info.segments()})
        return out

    try:
        if not all(torch.equal(a[n], b[n]) for a, b in zip(run(named), run(named[::-1])) for n in a):
            return dependent
    except Exception as err:  # noqa: BLE001 -- a codec that cannot run alone here: the resumes will say
        return f"whether {label} depends on the bucket's layout is unknown ({type(err).__name__}: {err})"
    return None
