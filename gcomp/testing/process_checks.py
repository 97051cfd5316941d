"""The checks of contracts 1, 2, 4, 6 and 7 on what the rank jobs returned (``reduce_jobs.job_reduce``,
``train_jobs.job_train``, ``train_jobs.job_resume``): one configuration each, ``ranks`` being the job's
per-rank results in rank order. Each raises AssertionError with a message naming the rank, step and bucket
where the method fails, and returns a note (or None) on what it could not check."""
from __future__ import annotations

import torch

from gcomp.testing import models
from gcomp.testing.buckets import DTYPES, dtype_name
from gcomp.testing.report import Skip
from gcomp.testing.train_jobs import LAYOUT_KEPT, TRAIN_STEPS


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise AssertionError(message)


def check_reduce(ranks: list[dict], layout: str, path: str, decodes_alone: bool) -> str | None:
    """Contract 1 (fake buckets, every dtype, every step): every rank's result has the bucket's shape, dtype and
    device, and is the same on every rank. Warm-up path: a dense all-reduce, so the mean of the buckets.
    Compressing path: the mean over ranks of what each rank sent (its payload decoded locally), for methods
    whose result is that sum (``decodes_alone``). Both within the rounding of the wire dtype."""
    note = None
    for dtype in DTYPES:
        key = (path, layout, dtype_name(dtype))
        for step, buckets in enumerate(ranks[0][key]):
            for index, report in enumerate(buckets):
                where = f"{key} step {step} bucket {index}"
                for rank, r in enumerate(ranks):
                    mine = r[key][step][index]
                    got = (mine["shape"], mine["dtype"], mine["device"])
                    _require(got == mine["bucket"],
                             f"{where}: rank {rank} got shape, dtype, device {got} for a bucket of {mine['bucket']}")
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
    for dtype in DTYPES:
        for buckets in ranks[0][("compress", layout, dtype_name(dtype))]:
            for report in buckets:
                _require(report["dense"] is None, str(report["dense"]))


def check_nonfinite(ranks: list[dict], path: str, kind: str) -> None:
    """Contract 6: the last rank's bucket holds one NaN (or +inf); every rank's result holds a non-finite value."""
    for rank, r in enumerate(ranks):
        _require(not r[("nonfinite", path, kind)],
                 f"rank {rank}: a {kind} in rank {len(ranks) - 1}'s bucket vanished")


def check_replicas(ranks: list[dict], several: bool, static: bool) -> None:
    """Contract 2: after DDP training every rank holds the same, finite parameters, and training moved them."""
    runs = [r[(several, static)] for r in ranks]
    for rank, run in enumerate(runs):
        _require(torch.equal(run["params"], runs[0]["params"]), f"rank {rank}'s parameters differ from rank 0's")
        _require(bool(torch.isfinite(run["params"]).all() and torch.isfinite(run["losses"]).all()),
                 f"rank {rank}: non-finite parameters or losses")
    _require(not torch.equal(runs[0]["params"], runs[0]["init"]), "training did not change the parameters")


def check_stats(ranks: list[dict], several: bool, static: bool, stateful: bool) -> None:
    """Contract 2: the hook's statistics count the steps, bytes, warm-up (stateful methods wait for DDP's
    rebuilt buckets: 1 step, 2 with ``static_graph``) and buckets of the run."""
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
        # The configuration really has the bucket count it claims (else the matrix would test less than it says).
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
    """Skip a resume checkpointed before DDP's bucket rebuild (its first resumed step is on DDP's first bucket)
    when the method may depend on the layout (``layout_dependence``: why, from ``codec_checks.layout_dependence``;
    None when it does not)."""
    if flavour not in LAYOUT_KEPT and layout_dependence is not None:
        raise Skip(f"{layout_dependence}, and this checkpoint comes before DDP's bucket rebuild: the other cases "
                   "carry the contract")


def check_resume(ranks: list[dict], method, flavour: str) -> None:
    """Contract 7: train, checkpoint (torch.save, torch.load(weights_only=True)), resume on a fresh DDP model and
    hook: the parameters equal those of a run that never stopped, bit for bit, and so does the step count."""
    for rank, r in enumerate(ranks):
        run = r[(method, flavour)]
        _require(torch.equal(run["resumed"], run["straight"]),
                 f"rank {rank}: the resumed run left the trajectory (max difference "
                 f"{(run['resumed'] - run['straight']).abs().max().item():.3g})")
        _require(run["resumed_steps"] == run["straight_steps"] == run["steps"],
                 f"rank {rank}: steps counted resumed {run['resumed_steps']}, straight {run['straight_steps']}, "
                 f"taken {run['steps']}")
