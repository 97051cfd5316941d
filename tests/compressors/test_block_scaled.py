"""fp8 and mx: the two-phase reduction against the same two phases by hand, bytes, error feedback (conserved in
float64 over ranks and a re-layout), the stochastic stream's checkpoint, bad parameters."""
from __future__ import annotations

import io

import pytest
import torch

import gcomp
from gcomp.testing import ops
from tests.compressors import block_scaled_jobs as jobs
from tests.distributed import run_ranks

SPECS = ["fp8", "fp8:format=e5m2,block=16,error_feedback=false", "mx:format=nvfp4", "mx:format=mxfp4"]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_result_is_the_two_phases_by_hand_and_bytes_follow_the_formula(world):
    every = run_ranks(world, jobs.job_two_phases, SPECS, 1000, 3)
    for spec in SPECS:
        ranks = [r[spec] for r in every]
        for rank, r in enumerate(ranks):
            assert torch.equal(r["results"], r["reference"]), f"{spec} on {world} ranks: rank {rank} differs"
            assert torch.equal(r["results"], ranks[0]["results"])
            # the pipeline counts the payload (N chunks), the all-gather one more: (N + 1) encoded chunks a step
            assert r["stats"]["bytes_sent"] == 3 * (world + 1) * r["wire_bytes"], spec
            # each phase sends N - 1 messages of one chunk, as a ring all-gather of it: counted as one
            assert r["stats"]["allgather_bytes"] == 3 * 2 * r["wire_bytes"]
            assert r["stats"]["rounds"] == 3 * 2


def test_error_feedback_changes_the_result():
    specs = ["mx:format=mxfp4", "mx:format=mxfp4,error_feedback=false"]
    with_ef, without = (r["results"] for r in run_ranks(2, jobs.job_two_phases, specs, 600, 3)[0].values())
    assert torch.equal(with_ef[0], without[0])  # nothing held back yet at the first step
    assert not torch.equal(with_ef[1:], without[1:])


@pytest.mark.parametrize("world", [3, 4])
def test_conservation_in_float64_over_ranks_and_a_relayout(world):
    """sum over steps of the result + every rank's residual and owner error == sum of every rank's inputs."""
    specs = ["mx:format=mxfp4", "fp8:rounding=stochastic"]
    every = run_ranks(world, jobs.job_conservation, specs, 6)
    for spec, name in [(spec, name) for spec in specs for name in every[0][spec]["inputs"]]:
        ranks = [r[spec] for r in every]
        inputs = sum(r["inputs"][name] for r in ranks)
        kept = ranks[0]["outputs"][name] + sum(r["held"][name] for r in ranks)
        assert ranks[0]["result_dtype"] == torch.float64
        assert torch.allclose(kept, inputs, rtol=0, atol=1e-12 * inputs.abs().max()), (spec, name)
        assert sum(r["held"][name].abs().sum() for r in ranks) > 0


def test_without_error_feedback_nothing_is_held():
    method = gcomp.create("mx", format="mxfp4", error_feedback=False)
    assert not method.error_feedback and not method.stateful
    assert method.state_dict()["compressor"].keys() == {"stream"}


def test_gloo_all_to_all_moves_uint8_and_float32_rows():
    ranks = run_ranks(3, jobs.job_scales_all_to_all)
    for rank, r in enumerate(ranks):
        for got in r.values():
            assert got.tolist() == [[10 * s + 3 * rank + j for j in range(3)] for s in range(3)]


def _steps(method, steps, start=0):
    out = []
    for step in range(start, start + steps):
        x = jobs._grad(step, 0, 500)
        bucket = gcomp.BucketInfo.single(x)
        v = method.memory.compensate(x, bucket)
        payload = method.compressor.compress(v, bucket)
        method.memory.update(v, bucket, method.compressor, payload)
        out.append(method.compressor.decompress(payload.tensors, payload.ctx))
    return out


def test_stochastic_rounding_stream_round_trips_through_state_dict():
    method = gcomp.create("fp8", rounding="stochastic")
    _steps(method, 2)
    buffer = io.BytesIO()
    torch.save(method.state_dict(), buffer)
    buffer.seek(0)
    resumed = gcomp.create("fp8", rounding="stochastic")
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert method.state_dict()["compressor"]["stream"]["draws"] == 2
    assert all(torch.equal(a, b) for a, b in zip(_steps(method, 2, 2), _steps(resumed, 2, 2)))
    fresh = gcomp.create("fp8", rounding="stochastic")
    assert not all(torch.equal(a, b) for a, b in zip(_steps(fresh, 2, 2), _steps(gcomp.create(
        "fp8", rounding="stochastic"), 2, 0)))


def test_owner_error_is_flushed_once():
    method = gcomp.create("fp8")
    x = jobs._grad(0, 0, 300)
    bucket = gcomp.BucketInfo.single(x)
    one, other = (method.compressor.compress(v, bucket) for v in (x, 0.37 * x.flip(0)))
    received = [torch.cat(pair) for pair in zip(one.tensors, other.tensors)]  # two ranks' chunks, as received
    method.compressor.second_phase(received, one.ctx)  # this rank owns the whole bucket
    held = method.compressor.flush(bucket, x)
    assert held is not None and held.abs().sum() > 0
    assert method.compressor.flush(bucket, x).abs().sum() == 0


@pytest.mark.parametrize("name, params, words", [
    ("fp8", {"block": 102}, "multiple of 4"),
    ("fp8", {"block": 2}, "block"),
    ("fp8", {"format": "mxfp4"}, "format"),
    ("mx", {"format": "e4m3"}, "format"),
    ("mx", {"block": 32}, "unknown parameter"),
    ("mx", {"rounding": "down"}, "rounding"),
])
def test_bad_parameters_are_clear_errors(name, params, words):
    with pytest.raises(ValueError, match=words):
        gcomp.create(name, **params)


def test_listed_for_fsdp():
    assert {"fp8", "mx"} <= set(gcomp.available(fsdp=True))


def test_device_path_is_bucket_wide_without_host_syncs():
    specs = ["fp8", "mx:format=mxfp4", "mx:format=nvfp4,rounding=stochastic,error_feedback=false"]
    configs = ((4, 1 << 12), (64, 1 << 12), (4, 1 << 16))
    counts = run_ranks(1, ops.job_device_counts, specs, configs)[0]
    for spec in specs:
        ops.check_bounded(spec, counts, declared=0, configs=configs)


@pytest.mark.parametrize("spec", ["fp8", "mx:format=mxfp6_e3m2", "mx:format=nvfp4,rounding=stochastic"])
@pytest.mark.parametrize("world, numel", [(1, 640), (3, 1000), (4, 4096)])
def test_residual_is_the_fused_decode_of_the_payload(spec, world, numel):
    """``residual_into`` (decode and subtraction fused slab by slab) == the memory's decompress-and-subtract."""
    name, params = gcomp.registry.parse_spec(spec)
    compressor = gcomp.create(name, **params).compressor
    compressor.world = world
    x = jobs._grad(0, 0, numel)
    x[7] = float("inf")
    bucket = gcomp.BucketInfo.single(x)
    payload = compressor.compress(x, bucket)
    out = torch.full_like(x, 123.0)
    assert compressor.residual_into(out, x, payload)
    expected = torch.nan_to_num(x - compressor.decompress(payload.tensors, payload.ctx), nan=0.0, posinf=0.0,
                                neginf=0.0)
    assert torch.equal(out, expected) and out[7] == 0
    assert not compressor.residual_into(out.double(), x.double(), compressor.compress(x.double(), bucket))


def test_codes_are_written_into_a_kept_buffer_unless_a_payload_still_holds_it():
    method = gcomp.create("mx", format="mxfp4")
    x = jobs._grad(0, 0, 640)
    bucket = gcomp.BucketInfo.single(x)
    first = method.compressor.compress(x, bucket)
    held = first.tensors[0].untyped_storage().data_ptr()
    second = method.compressor.compress(x, bucket)  # the first payload is alive: a buffer of its own
    assert second.tensors[0].untyped_storage().data_ptr() != held
    assert all(torch.equal(a, b) for a, b in zip(first.tensors, second.tensors))
    del first, second
    again = method.compressor.compress(x, bucket)
    assert again.tensors[0].untyped_storage().data_ptr() == held  # kept: no fresh pages
