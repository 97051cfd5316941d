"""The checks of the rank jobs' results (``reduce_jobs.job_reduce``, ``train_jobs.job_train``, ``job_resume``): one
configuration each, ``ranks`` the job's per-rank results in rank order. Each raises AssertionError naming the rank,
step and bucket where the method fails (``Skip`` where it does not apply), and returns a note or None."""
from __future__ import annotations

import torch

from gcomp.testing import models
from gcomp.testing.buckets import DTYPES, dtype_name
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
    """Contract 1: every rank's result has the bucket's shape, dtype and device, and is rank 0's. Warm-up path:
    the dense mean. Compressing path: the mean of what each rank sent (its payload decoded alone), for methods
    whose result is that (``decodes_alone``); within the rounding of the wire dtype."""
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


def check_fidelity(ranks: list[dict], layout: str, method) -> None:
    """Contract 9 on the compressing path: each bucket's result (exact, relative) or each rank's input reduced on
    that rank alone (largest, contraction) keeps the compressor's ``traits.fidelity`` (``gcomp.testing.fidelity``);
    an unbiased method's draws are ``check_unbiased``'s."""
    kind = _fidelity(method)
    if kind == "unbiased":
        raise Skip("an unbiased method is held to the mean of its draws (the 'draws' configuration)")
    for where, _, mine in _reports(ranks, "compress", layout):
        for rank, r in enumerate(mine):
            _require(r["fidelity"] is None, f"{where}: rank {rank}: {r['fidelity']}")


def check_unbiased(ranks: list[dict], method) -> None:
    """Contract 9 for an unbiased method: the mean of many draws of one bucket's result is the exact mean."""
    if _fidelity(method) != "unbiased":
        raise Skip(f"applies to unbiased methods; this one's error model is {_fidelity(method)}")
    _require(ranks[0][("unbiased",)] is None, str(ranks[0][("unbiased",)]))


def _fidelity(method) -> str:
    traits = getattr(getattr(method, "compressor", None), "traits", None)
    if traits is None:
        raise Skip(f"{type(method).__name__} is not a gcomp.Method (a composite method): it declares no error model")
    return traits.fidelity.kind


def check_conservation(ranks: list[dict], dtype: torch.dtype, method) -> None:
    """Contract 5 (the job's one-rank runs): after each step, the result plus what is held back is the gradient
    plus what was held, step after step, across a re-layout; no slack but the rounding of what is held."""
    if not method.error_feedback:
        raise Skip("applies to methods with error feedback; this one's error_feedback is False")
    found = ranks[0].get(("conservation", dtype_name(dtype)), Skip)
    if found is Skip:
        raise Skip(f"{method.name} keeps slots besides those it holds back (traits.slots: momentum): what it sends "
                   "is not the gradient's; or it is a composite, whose parts are checked")
    _require(found is None, str(found))


def check_bytes(ranks: list[dict], method, world: int) -> None:
    """Contract 10: each step's ``bytes_sent`` of a one-parameter fp32 bucket of n entries is
    ``traits.wire_bytes(n, world)`` on every rank."""
    wire = getattr(getattr(method, "compressor", None), "traits", None)
    if wire is None or wire.wire_bytes is None:
        raise Skip("the method declares no traits.wire_bytes (the data decides, or a composite)")
    for rank, r in enumerate(ranks):
        for key in [k for k in r if k[0] == "bytes"]:
            expected = wire.wire_bytes(key[1], world)
            _require(all(b == expected for b in r[key]), f"rank {rank}: a one-parameter bucket of {key[1]} fp32 "
                                                         f"entries sent {r[key]} bytes per step; traits.wire_bytes "
                                                         f"says {expected}")


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
    """Contract 2: the statistics count the steps, bytes, warm-up (stateful methods wait for DDP's rebuilt
    buckets: 1 step, 2 with ``static_graph``) and buckets of the run."""
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
    """Skip a resume checkpointed before DDP's bucket rebuild when the method depends on the layout
    (``layout_dependence``: why, from ``codec_checks.layout_dependence``; None when it does not)."""
    if flavour not in LAYOUT_KEPT and layout_dependence is not None:
        raise Skip(f"{layout_dependence}, and this checkpoint comes before DDP's bucket rebuild: the other cases "
                   "carry the contract")


def check_resume(ranks: list[dict], method, flavour: str) -> None:
    """Contract 7: train, checkpoint, resume on a fresh DDP model and hook: the parameters equal those of a run
    that never stopped, bit for bit, and so does the step count."""
    for rank, r in enumerate(ranks):
        run = r[(method, flavour)]
        _require(torch.equal(run["resumed"], run["straight"]),
                 f"rank {rank}: the resumed run left the trajectory (max difference "
                 f"{(run['resumed'] - run['straight']).abs().max().item():.3g})")
        _require(run["resumed_steps"] == run["straight_steps"] == run["steps"],
                 f"rank {rank}: steps counted resumed {run['resumed_steps']}, straight {run['straight_steps']}, "
                 f"taken {run['steps']}")
