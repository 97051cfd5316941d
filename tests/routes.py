"""One bucket's route through gcomp, measured: which of the package's files a bucket's reduction passes through,
in call order, and how often the calls cross from one file into another.

    python -m tests.routes          # every route, ready to paste into docs/design.md §2

``trace(fn, *args)`` runs ``fn`` with a profile function (``sys.setprofile`` on the calling thread,
``threading.setprofile`` for threads started during the call) and records every Python call whose code lives in
the ``gcomp`` package, but for ``gcomp/testing/`` and ``gcomp/bench/`` (the checks and the benchmark are no part
of a bucket's route), as ``(file relative to the repository root, qualified function name)``.

The decode of most methods runs in a future's callback on the backend's (gloo's) own threads, which are C++
threads: no profile function set from Python reaches them. So while tracing, every callback handed to a torch
future (``then``, ``add_done_callback``) is wrapped to set the profile function on whichever thread runs it;
``trace`` then waits for the wrapped callbacks of every completed future before returning. A callback's calls
are placed in the sequence where the callback was attached: where they run when the future is already
complete, and an order that does not depend on the threads' timing.

What is counted, in the sequence of recorded calls:

- ``functions``: the distinct ``(file, function)`` pairs, in first-call order (``route``);
- ``files``: the distinct files, in first-call order: the route;
- ``hops``: consecutive calls (along the whole sequence, every call of a loop included) whose files differ;
  returns are not calls, so a call back into the caller's file is a hop only if the last call was elsewhere;
- ``first_call_hops``: the same along ``functions`` (each function at its first call only), which no loop length
  changes.

A generator's resumption is not a call (its first start is). Comprehensions and lambdas are calls in their own
file (Python 3.11 runs a comprehension as a function; 3.12 inlines list comprehensions, which changes ``hops``,
never ``files``). Calls that no file holds (the ``__init__`` and ``__eq__`` that ``dataclasses`` writes, compiled
from a string) are not seen; nor is C++ (DDP's reducer, the collectives).

The rank jobs below trace one bucket in a steady state, on rank 0 of 2 gloo ranks (rank 1 runs the same calls,
untraced), after ``STEPS`` untraced steps (DDP's warm-up and bucket rebuild, each method's first steps on its
layout, pactrain's freeze and its first packed step, which takes two rounds). The traced call is:

- DDP: the backward pass of a model whose gradients fill one bucket: from the hook's entry to the mean gradient
  DDP receives, the decode's callback included, and the settling of the step's collectives that the hook queues
  for the end of the backward pass;
- FSDP2: the backward pass of a model sharded as one FSDP module: its one reduce-scatter, from FSDP's
  ``allocate`` and call of gcomp's reduce-scatter to the reduced shard;
- DiLoCo: ``DiLoCo.step`` at a sync of a model whose outer gradient is one bucket: the launch, the method's
  reduction and decode, the wait for the mean, then its application (the outer optimizer, the bit-identity check
  of the global copy, the merge into the model).

Set-up, the steps before and after, the optimizer step and checkpoints are not traced. Everything is set up
through the public API only (``gcomp.install``, ``gcomp.pruning.prune``, ``gcomp.outer.DiLoCo``), so that the
jobs outlast any change to where the code lives; the limits the suite holds the routes to are in
``tests/test_routes.py``.
"""
from __future__ import annotations

import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

import gcomp

PACKAGE = Path(gcomp.__file__).resolve().parent
ROOT = PACKAGE.parent
EXCLUDED = ("gcomp/testing/", "gcomp/bench/")
_GENERATOR = 0x20 | 0x80 | 0x200  # CO_GENERATOR, CO_COROUTINE, CO_ASYNC_GENERATOR
_RESUME = __import__("dis").opmap.get("RESUME")  # 3.11+: a frame's first instruction on every (re)entry


@dataclass
class Trace:
    """What ``trace`` recorded: every call, in order, and ``fn``'s return value."""

    calls: list[tuple[str, str]]
    in_callback: list[bool] = field(default_factory=list, repr=False)  # per call: made inside a future callback
    callbacks: int = 0  # future callbacks attached during the call and run
    pending: int = 0  # callbacks whose future had not completed when the call returned (not waited for)
    value: object = field(default=None, repr=False)

    @property
    def functions(self) -> list[tuple[str, str]]:
        return list(dict.fromkeys(self.calls))

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(f for f, _ in self.calls))

    @property
    def callback_calls(self) -> int:
        return sum(self.in_callback)

    @property
    def hops(self) -> int:
        return hops(self.calls)

    @property
    def first_call_hops(self) -> int:
        return hops(self.functions)


def hops(calls: list[tuple[str, str]]) -> int:
    """Consecutive calls in different files."""
    return sum(a[0] != b[0] for a, b in zip(calls, calls[1:]))


class _Strand(list):
    """The calls of one thread of control (the traced call, a started thread, one callback): ``(file, function)``
    pairs and, where a callback was attached, its own strand."""

    def __init__(self, callback: bool = False):
        super().__init__()
        self.callback = callback


def _resumed(frame) -> bool:
    """A generator (coroutine) frame taken up again after a ``yield``, not started."""
    code = frame.f_code
    if not code.co_flags & _GENERATOR:
        return False
    if frame.f_lasti < 0:  # 3.10: a fresh frame has run nothing
        return False
    if _RESUME is None:
        return True
    return not (code.co_code[frame.f_lasti] == _RESUME and code.co_code[frame.f_lasti + 1] & 3 == 0)


class _Tracer:
    def __init__(self):
        self.root = _Strand()
        self.local = threading.local()
        self.lock = threading.Lock()
        self.places: dict[str, str | None] = {}
        self.waits: list[tuple[torch.futures.Future, threading.Event]] = []
        self.callbacks = 0
        self.active = True

    def place(self, filename: str) -> str | None:
        if filename not in self.places:
            try:
                rel = Path(filename).resolve().relative_to(ROOT).as_posix()
            except ValueError:
                rel = None
            if rel is not None and (not rel.startswith("gcomp/") or rel.startswith(EXCLUDED)):
                rel = None
            self.places[filename] = rel
        return self.places[filename]

    def strand(self) -> _Strand:
        strand = getattr(self.local, "strand", None)
        if strand is None:  # a thread started during the call: its calls from here
            strand = self.local.strand = _Strand()
            with self.lock:
                self.root.append(strand)
        return strand

    def profile(self, frame, event, arg):
        if event != "call" or not self.active:
            return
        rel = self.place(frame.f_code.co_filename)
        if rel is None or _resumed(frame):
            return
        name = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
        strand = self.strand()
        with self.lock:
            strand.append((rel, name))

    def wrap(self, future, callback):
        """``callback``, run with the profile function on whichever thread runs it, its calls in a strand of its
        own placed where it is attached."""
        child, done = _Strand(callback=True), threading.Event()
        parent = self.strand()
        with self.lock:
            parent.append(child)
            self.waits.append((future, done))
        tracer = self

        def traced(fut):
            before = sys.getprofile(), getattr(tracer.local, "strand", None)
            tracer.local.strand = child
            with tracer.lock:
                tracer.callbacks += 1
            sys.setprofile(tracer.profile)
            try:
                return callback(fut)
            finally:
                sys.setprofile(before[0])
                tracer.local.strand = before[1]
                done.set()

        return traced

    def flat(self, strand: _Strand, in_callback: bool = False) -> list[tuple[tuple[str, str], bool]]:
        """Every call of ``strand``, a callback's where it was attached, with whether a callback made it."""
        out = []
        for item in strand:
            if isinstance(item, _Strand):
                out.extend(self.flat(item, in_callback or item.callback))
            else:
                out.append((item, in_callback))
        return out


def trace(fn, *args, wait_s: float = 60.0, **kwargs) -> Trace:
    """``fn(*args, **kwargs)`` with every call into the package recorded (the module's docstring says which)."""
    tracer = _Tracer()
    tracer.local.strand = tracer.root
    future_type = torch._C.Future
    then, add_done_callback = future_type.then, future_type.add_done_callback
    future_type.then = lambda self, cb: then(self, tracer.wrap(self, cb))
    future_type.add_done_callback = lambda self, cb: add_done_callback(self, tracer.wrap(self, cb))
    before, before_threads = sys.getprofile(), getattr(threading, "getprofile", lambda: None)()
    threading.setprofile(tracer.profile)
    sys.setprofile(tracer.profile)
    try:
        value = fn(*args, **kwargs)
    finally:
        sys.setprofile(before)
        threading.setprofile(before_threads)
        future_type.then, future_type.add_done_callback = then, add_done_callback
    pending = 0
    for future, done in tracer.waits:
        if future.done():
            done.wait(wait_s)
        pending += not done.is_set()
    tracer.active = False
    with tracer.lock:
        calls = tracer.flat(tracer.root)
    return Trace([c for c, _ in calls], [b for _, b in calls], tracer.callbacks, pending, value)


def route(fn, *args, **kwargs) -> list[tuple[str, str]]:
    """The distinct ``(file, function)`` calls into the package that ``fn(*args, **kwargs)`` makes, in first-call
    order (``trace(...).functions``)."""
    return trace(fn, *args, **kwargs).functions


# --- the routes: one bucket each, in a steady state -------------------------------------------------------------

WORLD = 2
ROUTES = ("DDP topk", "DDP pactrain:ternary=true", "FSDP2 randomk", "DiLoCo mx:format=mxfp4")
STEPS = 3  # untraced steps first: DDP's warm-up (step 0) and rebuild, each method's first steps on its layout
KEYS = ("buckets", "warmup_steps", "layouts", "packed_buckets", "one_round_buckets", "outer_steps")


def _traced(fn, *args) -> Trace | None:
    """``fn(*args)`` traced on rank 0, run as it is on the others (which take part in the same collectives)."""
    if torch.distributed.get_rank() == 0:
        return trace(fn, *args)
    fn(*args)
    return None


def _step(model, opt, step: int, traced: bool = False) -> Trace | None:
    """One training step of ``tests.models``'s MLP; with ``traced``, its backward pass traced (on rank 0)."""
    from tests import models

    x, y = models.batch(step, torch.distributed.get_rank())
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    done = _traced(loss.backward) if traced else loss.backward()
    opt.step()
    return done


def _stats(state) -> dict:
    return {k: state.stats[k] for k in KEYS if k in state.stats}


def _train_then_trace(model, state) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for step in range(STEPS):
        _step(model, opt, step)
        history.append(_stats(state))
    traced = _step(model, opt, STEPS, traced=True)
    return {"trace": traced, "history": history, "after": _stats(state)}


def _ddp_route(method: str, pruned: bool = False, **params) -> dict:
    """One DDP bucket (the whole MLP: its gradients fit in one bucket, before DDP's rebuild and after): the
    backward pass of step ``STEPS``. Pruned: half of the weights by magnitude, before DDP (the masks are
    agreed at install, so the bucket packs from its first step after the warm-up, step 1, in two rounds; from
    step 2 in one)."""
    from torch.nn.parallel import DistributedDataParallel

    from tests import models

    model = models.mlp(0)
    if pruned:
        gcomp.pruning.prune(model, 0.5, "magnitude")
    ddp = DistributedDataParallel(model)
    return _train_then_trace(ddp, gcomp.install(ddp, method, **params))


def _fsdp_route(method: str, **params) -> dict:
    """One FSDP module's reduce-scatter (the MLP sharded as one FSDP module): the backward pass of step
    ``STEPS``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests import models

    model = models.mlp(0)
    fully_shard(model, mesh=init_device_mesh("cpu", (torch.distributed.get_world_size(),)))
    return _train_then_trace(model, gcomp.install(model, method, **params))


def _diloco_route(method: str, sync_every: int = 2) -> dict:
    """One outer step of DiLoCo (one bucket: the whole MLP), its ``STEPS``-th: ``DiLoCo.step`` at a sync, which
    launches the bucket's reduction, waits for its mean and applies it (the outer optimizer, the bit-identity
    check of the global copy, the merge into the model)."""
    from tests import models

    model = models.mlp(0)
    outer = gcomp.outer.DiLoCo(model, sync_every=sync_every, method=method)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for step in range(sync_every * STEPS - 1):
        _step(model, opt, step)
        if outer.step():
            history.append(_stats(outer))
    _step(model, opt, sync_every * STEPS - 1)
    traced = _traced(outer.step)
    return {"trace": traced, "history": history, "after": _stats(outer)}


def job_routes(names=ROUTES) -> dict:
    """Each named route on this rank: ``{name: {"trace": its Trace on rank 0 (None elsewhere), "history": the
    state's stats after each untraced step (outer step), "after": after the traced one}}``."""
    jobs = {"DDP topk": lambda: _ddp_route("topk"),
            "DDP pactrain:ternary=true": lambda: _ddp_route("pactrain", pruned=True, ternary=True),
            "FSDP2 randomk": lambda: _fsdp_route("randomk"),
            "DiLoCo mx:format=mxfp4": lambda: _diloco_route("mx:format=mxfp4")}
    return {name: jobs[name]() for name in names}


def measure(names=ROUTES) -> dict:
    """``job_routes`` on ``WORLD`` gloo ranks (``tests.distributed.run_ranks``): rank 0's result."""
    from tests.distributed import run_ranks

    return run_ranks(WORLD, job_routes, names, timeout=300)[0]


def describe(name: str, traced: Trace) -> str:
    """A route as docs/design.md could hold it: the counts, the files in first-call order, then each file with
    the functions first called there."""
    by_file: dict[str, list[str]] = {}
    for file, function in traced.functions:
        by_file.setdefault(file, []).append(function)
    lines = [f"{name}: {len(traced.files)} files, {traced.hops} hops ({len(traced.calls)} calls, "
             f"{traced.first_call_hops} hops between first calls; {traced.callback_calls} of the calls in "
             f"{traced.callbacks} future callbacks)",
             "  " + " → ".join(f.removeprefix("gcomp/") for f in traced.files)]
    for i, (file, functions) in enumerate(by_file.items(), 1):
        lines.append(f"  {i:2}. `{file}`: {', '.join(f'`{f}`' for f in functions)}")
    return "\n".join(lines)


def main() -> None:
    from tests.distributed import close_pools

    print("One bucket's route, file by file in first-call order (tests/routes.py says what is counted)\n")
    try:
        for name, run in measure().items():
            print(describe(name, run["trace"]), end="\n\n")
    finally:
        close_pools()


if __name__ == "__main__":
    from tests import routes  # the jobs go to the ranks by reference: tests.routes, not __main__

    routes.main()
