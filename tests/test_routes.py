"""How many of the package's files one bucket's reduction passes through (``tests/routes.py`` measures it; ``python
-m tests.routes`` prints each route, file by file in call order).

The house's targets (``TARGETS``: ``topk`` under DDP 10 files, ``pactrain:ternary=true`` under DDP 14, ``randomk``
under FSDP2 10) are the limits now; DiLoCo has no target and is kept from growing past its count when the targets
were reached. Measured: 9, 13, 9 and 13 files (docs/design.md §2 lists each route).
"""
from __future__ import annotations

import sys
import threading

import pytest
import torch

import gcomp
from tests import routes
from tests.distributed import run_ranks_once

LIMITS = {
    "DDP topk": 10,
    "DDP pactrain:ternary=true": 14,
    "FSDP2 randomk": 10,
    "DiLoCo mx:format=mxfp4": 13,
}
TARGETS = {"DDP topk": 10, "DDP pactrain:ternary=true": 14, "FSDP2 randomk": 10}


def _routes() -> dict:
    """Every route, traced once per session on rank 0 of two gloo ranks."""
    return run_ranks_once(("routes",), routes.WORLD, routes.job_routes, timeout=300)[0]


def test_every_route_has_a_limit():
    assert set(LIMITS) == set(routes.ROUTES)
    assert set(TARGETS) <= set(LIMITS)
    assert all(LIMITS[name] <= TARGETS[name] for name in TARGETS)  # the house reached its targets


@pytest.mark.slow
@pytest.mark.parametrize("name", routes.ROUTES)
def test_route_crosses_at_most_its_limit_of_files(name):
    traced = _routes()[name]["trace"]
    target = f" (the refactor's target: {TARGETS[name]})" if name in TARGETS else ""
    assert len(traced.files) <= LIMITS[name], \
        f"{name} crosses {len(traced.files)} files, its limit is {LIMITS[name]}{target}:\n" \
        f"{routes.describe(name, traced)}"


@pytest.mark.slow
@pytest.mark.parametrize("name", routes.ROUTES)
def test_the_trace_is_one_bucket_in_a_steady_state(name):
    """The traced call reduced one bucket, on a layout already seen, past the warm-up; pactrain's a packed,
    one-round bucket after a step already packed; the decode's callback was traced where it runs in one."""
    run = _routes()[name]
    before, after, traced = run["history"][-1], run["after"], run["trace"]
    assert after["buckets"] - before["buckets"] == 1
    assert after.get("layouts") == before.get("layouts")
    assert after.get("warmup_steps") == before.get("warmup_steps")
    assert traced.pending == 0
    if "pactrain" in name:
        assert before["packed_buckets"] >= 2 and before["one_round_buckets"] >= 1
        assert after["packed_buckets"] - before["packed_buckets"] == 1
        assert after["one_round_buckets"] - before["one_round_buckets"] == 1
    if not name.startswith("FSDP2"):  # FSDP2's reduce-scatter decodes inline; the others in a future's callback
        assert traced.callbacks >= 1 and traced.callback_calls > 0, routes.describe(name, traced)


# --- the tracer itself --------------------------------------------------------------------------------------

def test_hops_count_consecutive_calls_in_different_files():
    calls = [("a", "f"), ("a", "g"), ("b", "h"), ("a", "f"), ("c", "k"), ("c", "k")]
    assert routes.hops(calls) == 3
    traced = routes.Trace(calls)
    assert traced.files == ["a", "b", "c"]
    assert traced.functions == [("a", "f"), ("a", "g"), ("b", "h"), ("c", "k")]
    assert traced.first_call_hops == 2


def test_a_callback_on_a_thread_no_profile_reaches_is_traced_where_it_was_attached():
    """The thread completing the future was started before the trace (as gloo's are): only the wrapped callback
    sets the profile function there."""
    future, go = torch.futures.Future(), threading.Event()
    completer = threading.Thread(target=lambda: (go.wait(), future.set_result(1)))
    completer.start()
    seen, then, profile = [], torch._C.Future.__dict__["then"], sys.getprofile()

    def body():
        gcomp.spec("topk")
        done = future.then(lambda f: seen.append(threading.get_ident()) or gcomp.available())
        go.set()
        done.wait()
        gcomp.describe("topk")

    traced = routes.trace(body)
    completer.join()
    assert seen and seen[0] != threading.get_ident()
    names = [name for _, name in traced.calls]
    assert "available" in names and "spec" in names and "describe" in names
    assert names.index("spec") < names.index("available") < names.index("describe")
    assert traced.callbacks == 1 and traced.callback_calls > 0
    assert all(b for (_, name), b in zip(traced.calls, traced.in_callback) if name == "available")
    assert sys.getprofile() is profile and torch._C.Future.__dict__["then"] is then  # all put back


def test_the_checks_and_the_benchmark_are_no_part_of_a_route():
    from gcomp.testing.models import mlp

    traced = routes.trace(lambda: (mlp(0), gcomp.available()))
    assert traced.calls and all(f.startswith("gcomp/") for f in traced.files)
    assert not any(f.startswith(routes.EXCLUDED) for f in traced.files)


def test_a_generator_counts_as_called_once():
    def numbers():
        yield 1
        yield 2

    starts = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code is numbers.__code__:
            starts.append(routes._resumed(frame))

    sys.setprofile(profile)
    try:
        list(numbers())
    finally:
        sys.setprofile(None)
    assert starts[0] is False and all(starts[1:]) and len(starts) == 3
