"""fp8 and mx: the two-phase reduction against the same two phases by hand, bytes, error feedback (conserved in
float64 over ranks and a re-layout, handed back once), the stochastic stream's checkpoint, gcomp 0.1's checkpoints,
FSDP2's rows (phase one alone), bad parameters."""
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
            assert r["stats"]["bytes_sent"] == 3 * (world + 1) * r["wire_bytes"] == 3 * r["declared"], spec
            # each phase sends N - 1 messages of one chunk, as a ring all-gather of it: counted as one
            assert r["stats"]["allgather_bytes"] == 3 * 2 * r["wire_bytes"]
            assert r["stats"]["rounds"] == 3 * 2
            if "error_feedback=false" in spec:
                assert r["held"] is None
            else:  # the residual and the owner error (where this rank owns entries), handed back once
                assert r["held"].abs().sum() > 0 and not r["again"].any()


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
    """What a one-rank payload of each step carries (its own decode)."""
    out = []
    for step in range(start, start + steps):
        x = jobs._grad(step, 0, 500)
        payload, _ = method.compressor.encode(x, {"owner_error": torch.zeros_like(x)}, gcomp.BucketInfo.single(x))
        out.append(method.compressor.decode(method._own(payload.tensors), payload.ctx))
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


def test_the_second_phase_fills_the_owner_error_slot():
    """Two ranks' chunks received by the owner of the whole bucket: the slot the encode handed back gets the sum
    less its re-encoding, the sum's own chunk plus the old error; nothing outside the chunk."""
    compressor = gcomp.create("fp8").compressor
    x = jobs._grad(0, 0, 300)
    bucket = gcomp.BucketInfo.single(x)
    old = torch.full_like(x, 1e-3)
    one, state = compressor.encode(x, {"owner_error": old.clone()}, bucket)
    other, _ = compressor.encode(0.37 * x.flip(0), {"owner_error": torch.zeros_like(x)}, bucket)
    received = [torch.cat(pair) for pair in zip(one.tensors, other.tensors)]  # two ranks' chunks, as received
    mine = compressor.second_phase(received, one.ctx)
    fmt, width = compressor.fmt, compressor.width(300, 1)
    total = fmt.decode(received, width).sum(0)[:300] + old
    sent = fmt.decode(mine, width).view(-1)[:300]
    assert torch.equal(state["owner_error"], total - sent) and state["owner_error"].abs().sum() > 0


def test_owner_error_outside_the_chunk_goes_out_with_the_first_phase():
    """After a re-layout this rank's chunk moved: the error held outside it is sent now (the memory's residual keeps
    what rounding loses of it), the slot keeps only its own chunk, and the payload's own decode leaves it out."""
    compressor = gcomp.create("mx", format="mxfp4").compressor
    compressor.world, compressor.rank = 2, 1
    x = jobs._grad(0, 0, 640)
    held = jobs._grad(1, 0, 640) * 0.1
    payload, state = compressor.encode(x, {"owner_error": held.clone()}, gcomp.BucketInfo.single(x))
    kept = state["owner_error"]
    assert not kept[:320].any() and torch.equal(kept[320:], held[320:])
    stray = torch.cat([held[:320], torch.zeros(320)])
    sent = compressor.fmt.decode(payload.tensors, 320).view(-1)
    assert torch.equal(payload.residual, x + stray - sent)
    assert torch.equal(compressor.decode([t.unsqueeze(0) for t in payload.tensors], payload.ctx), sent - stray)


def test_checkpoints_of_gcomp_0_1_load():
    """The owner error under ``"owner"`` (gcomp 0.1) loads into the slot, checks and merges as today's."""
    method = gcomp.create("fp8")
    error = {"w": torch.randn(300)}
    old = {"memory": {"residuals": {"w": torch.randn(300)}},
           "compressor": {"stream": {"seed": 0, "draws": 7}, "owner": {"owner_error": error}}}
    assert method.parameter_state(old)["owner_error"] is error
    merged = method.merge_states([old, old], [old, old], 0)
    assert torch.equal(merged["compressor"]["owner_error"]["w"], 2 * error["w"])
    method.load_state_dict(old)
    state = method.state_dict()["compressor"]
    assert state["stream"]["draws"] == 7 and torch.equal(state["owner_error"]["w"], error["w"])
    x = torch.zeros(300)
    held = method.flush(gcomp.BucketInfo.single(x, "w"), x)  # the residual and the owner error
    assert torch.equal(held, old["memory"]["residuals"]["w"] + error["w"])
    with pytest.raises(ValueError, match="owner_error"):
        method.load_state_dict({"memory": old["memory"], "compressor": {"stream": {"seed": 0, "draws": 0}}})


@pytest.mark.parametrize("spec", ["fp8", "mx:format=mxfp6_e3m2", "mx:format=nvfp4,rounding=stochastic"])
def test_fsdp_rows_are_phase_one_alone(spec):
    """FSDP2's rows (two ranks simulated): each row padded to the block and encoded on its own, rank r's shard the
    sum of the rows it received, decoded; the residual what a rank's rows did not carry; the slot untouched."""
    from gcomp.sharding import ShardLayout
    name, params = gcomp.registry.parse_spec(spec)
    compressor = gcomp.create(name, **params).compressor
    sizes = (torch.Size([10, 7]), torch.Size([5]))
    layouts = [ShardLayout(0, ("a", "b"), sizes, 2, r, torch.float32) for r in range(2)]
    inputs = [jobs._grad(0, r, layouts[0].numel) for r in range(2)]
    payloads = []
    for layout, x in zip(layouts, inputs):
        state = {"owner_error": torch.zeros_like(x)}
        payload, kept = compressor.encode(x, state, layout)
        assert payload.rows and kept is state and all(t.shape[0] == 2 for t in payload.tensors)
        own = compressor.decode([t.unsqueeze(0) for t in payload.tensors], payload.ctx)
        assert torch.equal(payload.residual, x - own)
        payloads.append(payload)
    width = compressor.width(layouts[0].shard_numel, 1)
    assert payloads[0].nbytes == 2 * compressor.fmt.wire_bytes(width)
    for r in range(2):
        received = [torch.stack([p.tensors[i][r] for p in payloads]) for i in range(len(payloads[0].tensors))]
        rows = [compressor.fmt.decode([t[s:s + 1] for t in received], width)[0] for s in range(2)]
        expected = (rows[0] + rows[1])[:layouts[0].shard_numel]
        assert torch.equal(compressor.decode(received, payloads[r].ctx), expected)


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
def test_residual_is_the_payloads_own_decode_subtracted(spec, world, numel):
    """``payload.residual`` (from the encode's own decode) == the bucket less the payload decoded alone, a
    non-finite block's entries included (the memory drops them)."""
    name, params = gcomp.registry.parse_spec(spec)
    method = gcomp.create(name, **params)
    compressor = method.compressor
    compressor.world = world
    x = jobs._grad(0, 0, numel)
    x[7] = float("inf")
    payload, _ = compressor.encode(x, {"owner_error": torch.zeros_like(x)}, gcomp.BucketInfo.single(x))
    expected = x - compressor.decode(method._own(payload.tensors), payload.ctx)
    assert torch.equal(payload.residual.nan_to_num(), expected.nan_to_num()) and payload.residual[7].isnan()
    double = x.double()
    payload, _ = compressor.encode(double, {"owner_error": torch.zeros_like(double)}, gcomp.BucketInfo.single(double))
    assert payload.residual.dtype == torch.float64
    expected = double - compressor.decode(method._own(payload.tensors), payload.ctx)
    assert torch.equal(payload.residual.nan_to_num(), expected.nan_to_num())
