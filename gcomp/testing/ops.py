"""What one bucket's reduction costs, counted on any machine: its aten operations (on an accelerator each a kernel
launch) and those that synchronise the host with a CUDA device. A codec is bucket-wide when its count does not grow
with the bucket's parameters or entries, and synchronises only where it declares it (``Traits.host_syncs``)."""
from __future__ import annotations

import collections
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode

import gcomp
from gcomp.testing.buckets import FakeBucket

# aten operations that wait for a CUDA device: a value read on the host, or an output whose size depends on the
# data (``repeat_interleave`` without an output size reads its total by ``_local_scalar_dense``, counted as such)
SYNCING = frozenset({"_local_scalar_dense", "nonzero", "nonzero_static_sync", "masked_select", "unique", "_unique",
                     "_unique2", "unique_consecutive", "unique_dim", "unique_dim_consecutive", "equal", "is_nonzero"})
HOST_READS = ("tolist", "numpy", "cpu")  # reads of a tensor's values that dispatch nothing on a CPU tensor
# collectives a communicator launches asynchronously: waited for at once while counting
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_single", "all_gather_into_tensor", "all_to_all_single",
               "broadcast", "reduce_scatter_single", "reduce_scatter_tensor")


class OpCounter(TorchDispatchMode):
    """Every aten operation dispatched on this thread (``ops``); the host synchronisations ``counting`` found."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.syncs: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _synchronising(events) -> collections.Counter:
    """The ``SYNCING`` operations among the profiler's ``events``, at any depth, but not inside another one (a
    ``nonzero`` reads its count by a ``_local_scalar_dense`` of its own)."""
    found: collections.Counter = collections.Counter()
    for event in events:
        name = event.name.removeprefix("aten::")
        if not event.name.startswith("aten::") or name not in SYNCING:
            continue
        parent = event.cpu_parent
        while parent is not None and parent.name.removeprefix("aten::") not in SYNCING:
            parent = parent.cpu_parent
        if parent is None:
            found[name] += 1
    return found


@contextmanager
def _patched(owner, names, wrap) -> Iterator[None]:
    """``owner.name`` replaced by ``wrap(name, original)`` for each of ``names`` over the block."""
    saved = {name: getattr(owner, name) for name in names if hasattr(owner, name)}
    for name, fn in saved.items():
        setattr(owner, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(owner, name, fn)


@contextmanager
def counting() -> Iterator[OpCounter]:
    """An ``OpCounter`` over the block: its aten operations, and its host synchronisations as the profiler sees them
    (``_synchronising``) plus ``Tensor.tolist``, ``.numpy`` and ``.cpu`` (nothing dispatched on a CPU tensor)."""
    counter = OpCounter()

    def reading(name, fn):
        def read(self, *args, **kwargs):
            counter.syncs[name] += 1
            return fn(self, *args, **kwargs)
        return read

    with _patched(torch.Tensor, HOST_READS, reading), profile(activities=[ProfilerActivity.CPU]) as prof, counter:
        yield counter
    counter.syncs.update(_synchronising(prof.events()))


def inline_collectives():
    """Every asynchronous collective waited for at launch: the callbacks on its future (decodes) run on this thread."""
    def waited(name, fn):
        def call(*args, **kwargs):
            work = fn(*args, **kwargs)
            if kwargs.get("async_op") and work is not None:
                work.wait()
            return work
        return call

    return _patched(dist, COLLECTIVES, waited)


def holder(params: int, numel: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """``params`` matrices of 16 rows, ``numel`` entries in all (a multiple of 16 ``params``)."""
    module = torch.nn.Module()
    cols = numel // (16 * params)
    if cols < 1 or cols * 16 * params != numel:
        raise ValueError(f"holder: {numel} entries do not make {params} matrices of 16 rows")
    for i in range(params):
        module.register_parameter(f"w{i}", torch.nn.Parameter(torch.zeros(16, cols, dtype=dtype)))
    return module


def count_reduction(make: Callable[[], gcomp.MethodUnit], params: int, numel: int, warm_steps: int = 4,
                    prune: float = 0.5, seed: int = 0) -> dict:
    """``{"ops": Counter, "syncs": Counter}`` of one bucket of ``params`` parameters and ``numel`` fp32 entries
    reduced through a ``HookState`` of ``make()`` after ``warm_steps`` steps (a tracker has frozen its support), the
    model pruned to ``prune`` at random for a method that reads masks; on a one-rank process group."""
    module = holder(params, numel)
    method = make()
    if method.reads_model:  # the same masks on every rank, so that a packing method freezes and packs
        torch.manual_seed(seed)
        for name, _ in list(module.named_parameters()):
            torch.nn.utils.prune.random_unstructured(module, name, amount=prune)
    bucket_params = list(module.parameters())[::-1]
    generator = torch.Generator().manual_seed(seed)
    with inline_collectives(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # one node, no masks: the methods' own notes, not the counts'
        state = gcomp.HookState(method, module, None)
        state.warmup = 0
        for _ in range(warm_steps):
            state.reduce(FakeBucket(torch.randn(numel, generator=generator), 0, True, bucket_params)).wait()
        bucket = torch.randn(numel, generator=generator)
        with counting() as counter:
            state.reduce(FakeBucket(bucket, 0, True, bucket_params)).wait()
    return {"ops": counter.ops, "syncs": counter.syncs}


# the bucket shapes counted: (parameters, entries)
CONFIGS = ((4, 1 << 16), (64, 1 << 16), (4, 1 << 22))


def spec_maker(spec: str) -> Callable[[], gcomp.MethodUnit]:
    """``gcomp.registry.from_spec(spec)`` as a factory."""
    from gcomp.registry import from_spec
    return lambda: from_spec(spec)


def job_device_counts(specs: list[str], configs=CONFIGS) -> dict:
    """``{(spec, parameters, entries): {"ops": {...}, "syncs": {...}}}`` of each spec and bucket."""
    out = {}
    for spec in specs:
        for params, numel in configs:
            counts = count_reduction(spec_maker(spec), params, numel)
            out[(spec, params, numel)] = {"ops": dict(counts["ops"]), "syncs": dict(counts["syncs"])}
    return out


def check_bounded(spec: str, counts: dict, declared: int, configs=CONFIGS) -> None:
    """AssertionError unless the operations do not grow from the first bucket of ``configs`` to the others (more
    parameters, more entries) and no bucket synchronises more than ``declared`` times."""
    base = counts[(spec, *configs[0])]
    base_ops = sum(base["ops"].values())
    problems = []
    for params, numel in configs:
        got = counts[(spec, params, numel)]
        ops, syncs = sum(got["ops"].values()), sum(got["syncs"].values())
        if ops > base_ops:
            grew = {k: v - base["ops"].get(k, 0) for k, v in got["ops"].items() if v > base["ops"].get(k, 0)}
            problems.append(f"{params} parameters, {numel} entries: {ops} operations against {base_ops} for "
                            f"{configs[0][0]} parameters, {configs[0][1]} entries (more of: {grew})")
        if syncs > declared:
            problems.append(f"{params} parameters, {numel} entries: {syncs} host synchronisations {got['syncs']}, "
                            f"{declared} declared")
    if problems:
        raise AssertionError(f"{spec}: " + "; ".join(problems))
