"""gcomp on CUDA tensors: ``pytest -m gpu`` on a machine with a GPU; skipped, with the reason, where none is.

- every registered method through the hook on one rank with NCCL (a subprocess: one NCCL group for all of
  them): a few DDP training steps, parameters finite, and equal to plain DDP's for the lossless methods, and
  bit for bit the same with the codec on its side stream (``gcomp.collectives.launch.codec_stream``); one bucket's reduction
  under ``torch.cuda.set_sync_debug_mode("warn")``, no more synchronisations than the method declares; then
  ``gcomp bench --codec --device cuda``'s table in the same group, and ``gcomp bench --overhead`` on the GPU;
- every method on 2 gloo ranks sharing the GPU, where gloo runs the method's collectives on CUDA tensors
  (broadcast and all_reduce; not send/recv, so the point-to-point schedules are skipped, and a collective that
  gloo refuses on CUDA skips its method with gloo's message): replicas identical, lossless methods equal to
  plain DDP;
- ``dense=`` on 2 gloo ranks on CUDA tensors, for the all-reduce methods: kept parameters equal plain DDP;
- ``gcomp bench --device cuda`` (gloo, 2 workers on the GPUs there are), and with ``--backend nccl`` where
  there are 2 GPUs.

docs/gpu.md lists what a session with a GPU runs and reports.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gcomp
from tests import models
from tests.distributed import free_port, run_ranks_once

ROOT = Path(__file__).resolve().parent.parent
METHODS = gcomp.available()
LOSSLESS = [m for m in METHODS if gcomp.create(m).lossless]
PRUNED = ("pactrain", "prunex")  # methods that need a pruned model to do their own work
STEPS = 6
NO_CUDA = "no CUDA GPU here (torch.cuda.is_available() is False): the GPU tests need one"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)]


# --- the jobs (run in a subprocess or on gloo ranks) ------------------------------------------------------------

def _params(name: str) -> dict:
    return {"stable_steps": 1} if name in PRUNED else {}


def train(name: str | None, device: torch.device, pruned: bool) -> dict:
    """``STEPS`` DDP steps of the tests' MLP on ``device`` with method ``name`` (None: plain DDP); the
    parameters at the end (on the CPU) and whether they are all finite."""
    model = models.mlp(0).to(device)
    if pruned:
        gcomp.pruning.prune(model, 0.5, "magnitude", seed=0)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    if name is not None:
        gcomp.install(ddp, name, **_params(name))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(STEPS):
        x, y = (t.to(device) for t in models.batch(step, dist.get_rank()))
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
    params = models.flat_params(model).cpu()
    return {"params": params, "finite": bool(torch.isfinite(params).all())}


def _train_with_reference(name: str, device: torch.device, streams_too: bool = False) -> dict:
    try:
        out = train(name, device, name in PRUNED)
        if name in LOSSLESS:
            out["reference"] = train(None, device, name in PRUNED)["params"]
        if streams_too:  # the same run with every codec on the side stream (gcomp.collectives.launch.codec_stream)
            from gcomp.collectives.launch import codec_stream
            with codec_stream():
                out["side_stream"] = train(name, device, name in PRUNED)["params"]
        return out
    except Exception:  # noqa: BLE001 -- the test reports it, naming the method
        return {"error": traceback.format_exc()}


def _syncs(name: str, device: torch.device) -> dict:
    """One bucket's reduction of ``name`` (the codec table's, warmed up) under ``set_sync_debug_mode("warn")``: how
    many host synchronisations it made, and how many the method declares."""
    import warnings

    from gcomp.bench import codec_table
    try:
        state, reduce, _ = codec_table.reducer(name, codec_table.bucket_numel(4), torch.Generator().manual_seed(0),
                                               device)
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                reduce()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        made = sum("synchroniz" in str(w.message) for w in caught)
        return {"made": made, "declared": state.method.host_syncs}
    except Exception:  # noqa: BLE001 -- the test reports it, naming the method
        return {"error": traceback.format_exc()}


def nccl_job(out_path: str) -> None:
    """Every method on one NCCL rank, then the codec table on CUDA; the results to ``out_path``."""
    from gcomp.bench import codec_table
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    try:
        results = {name: _train_with_reference(name, device, streams_too=True) for name in METHODS}
        results["syncs"] = {name: _syncs(name, device) for name in METHODS}
        results["codec_table"] = codec_table.run((1,), repeats=1, log=lambda text: None, device="cuda")
    finally:
        dist.destroy_process_group()
    torch.save(results, out_path)


def gloo_job(name: str) -> dict:
    """One method on this gloo rank, on CUDA tensors of the GPU the ranks share."""
    return _train_with_reference(name, torch.device("cuda", dist.get_rank() % torch.cuda.device_count()))


# --- world size 1, NCCL ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def nccl_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("nccl") / "results.pt"
    done = subprocess.run([sys.executable, "-c", "import sys, tests.test_gpu as t; t.nccl_job(sys.argv[1])",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"the NCCL job failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return torch.load(out, weights_only=False)


def _check_training(name: str, result: dict, where: str) -> None:
    assert "error" not in result, f"{name} {where}:\n{result['error']}"
    assert result["finite"], f"{name} {where}: non-finite parameters after {STEPS} steps"
    if name in LOSSLESS:
        torch.testing.assert_close(result["params"], result["reference"], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{name} {where}, lossless, differs from plain DDP: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", METHODS)
def test_every_method_trains_on_one_nccl_rank(nccl_results, name):
    _check_training(name, nccl_results[name], "on one NCCL rank")


@pytest.mark.slow
@pytest.mark.parametrize("name", METHODS)
def test_every_method_gives_the_same_result_with_its_codec_on_the_side_stream(nccl_results, name):
    result = nccl_results[name]
    assert "error" not in result, result["error"]
    assert torch.equal(result["side_stream"], result["params"]), f"{name}: the side stream changed the result"


@pytest.mark.slow
@pytest.mark.parametrize("name", METHODS)
def test_every_method_syncs_the_host_no_more_than_it_declares(nccl_results, name):
    syncs = nccl_results["syncs"][name]
    assert "error" not in syncs, syncs["error"]
    assert syncs["made"] <= syncs["declared"], f"{name}: {syncs['made']} synchronisations, {syncs['declared']} declared"


@pytest.mark.slow
def test_overhead_bench_on_cuda(tmp_path):
    out = tmp_path / "ovh"
    done = subprocess.run([sys.executable, "-m", "gcomp", "bench", "--overhead", "--device", "cuda", "--model",
                           "decoder:256,2", "--steps", "5", "--warmup", "2", "--method", "fp16;topk;torch:powersgd",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    rows = json.loads((out / "overhead.json").read_text())["rows"]
    assert [r["method"] for r in rows] == ["ddp", "fp16", "topk", "torch:powersgd"]
    assert all("error" not in r and r["device"] == "cuda" and r["step_ms"] > 0 and r["device_ms"] >= 0 for r in rows)


@pytest.mark.slow
def test_codec_table_on_cuda_times_every_method(nccl_results):
    rows = nccl_results["codec_table"]
    failed = {r["method"]: r["error"] for r in rows if "error" in r}
    assert not failed, failed
    assert {r["method"] for r in rows} == set(METHODS) | {"pactrain:ternary=true", "torch:powersgd"}
    assert all(r["device"] == "cuda" for r in rows)
    for r in rows:
        assert r["copy_s"] > 0 and r["copy_gbps"] > 0, r
        assert math.isfinite(r["peak_extra_frac"]) and r["peak_extra_frac"] >= 0, r
        assert not math.isnan(r["largest_alloc_frac"]), f"{r['method']}: the profiler saw no CUDA allocation"


# --- 2 gloo ranks on CUDA tensors ------------------------------------------------------------------------------

def _gloo_skip_reason(name: str) -> str | None:
    if gcomp.create(name).collective == "point-to-point":
        return "gloo has no send/recv for CUDA tensors (torch.distributed's backend table)"
    return None


def _refused_by_gloo(error: str) -> bool:
    """gloo's own refusal of an operation on CUDA tensors (not a gcomp failure)."""
    text = error.lower()
    return "gloo" in text and any(s in text for s in ("not supported", "unsupported", "only supports cpu",
                                                      "expects cpu", "device type"))


@pytest.mark.slow
@pytest.mark.parametrize("name", METHODS)
def test_every_method_trains_on_two_gloo_ranks_with_cuda_tensors(name):
    why = _gloo_skip_reason(name)
    if why:
        pytest.skip(why)
    ranks = run_ranks_once(("gpu-gloo", name), 2, gloo_job, name)
    errors = [r["error"] for r in ranks if "error" in r]
    if errors and all(_refused_by_gloo(e) for e in errors):
        pytest.skip(f"gloo refuses a collective of {name} on CUDA tensors: {errors[0].strip().splitlines()[-1]}")
    for rank, result in enumerate(ranks):
        _check_training(name, result, f"rank {rank} of 2 gloo ranks on CUDA")
    assert torch.equal(ranks[0]["params"], ranks[1]["params"]), f"{name}: the two replicas differ"


@pytest.mark.slow
@pytest.mark.parametrize("name", [m for m in METHODS if gcomp.create(m).collective == "allreduce"])
def test_dense_parameters_on_cuda_tensors_get_plain_ddps_gradient(name):
    """``dense=`` on CUDA (its index tensors on the bucket's device, its future one a stream waits for)."""
    from tests import dense_jobs
    ranks = run_ranks_once(("gpu-dense", name), 2, dense_jobs.train_dense, name, device="cuda", dense="*.bias")
    for got in ranks:
        assert got["checked"] >= 3 and got["differ"] == [], (name, got["differ"])
    assert ranks[0]["sum"] == ranks[1]["sum"], f"{name}: the two replicas differ"


# --- the training race on CUDA -----------------------------------------------------------------------------------

def _race(tmp_path, *flags) -> dict:
    out = tmp_path / "race"
    done = subprocess.run([sys.executable, "-m", "gcomp", "bench", "--device", "cuda", "--workers", "2", "--steps",
                           "4", "--eval-every", "2", "--model", "mlp:32", "--pretrain-epochs", "0", "--method",
                           "identity;fp16;topk;pactrain", "--out", str(out), *flags],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_race_on_cuda_with_gloo(tmp_path):
    results = _race(tmp_path, "--bandwidth", "none")
    assert [r["method"] for r in results["runs"]] == ["identity", "fp16", "topk", "pactrain"]
    assert all(r["device"] == "cuda" and r["backend"] == "gloo" and r["step_s"] > 0 for r in results["runs"])


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per worker: 2 workers, 2 GPUs")
def test_race_on_two_gpus_with_nccl(tmp_path):
    results = _race(tmp_path, "--backend", "nccl")
    assert all(r["device"] == "cuda" and r["backend"] == "nccl" and r["step_s"] > 0 for r in results["runs"])
    assert results["meta"]["network"].startswith("unshaped")
