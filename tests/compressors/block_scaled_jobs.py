"""Rank jobs for tests/compressors/test_block_scaled.py (module-level, so ``run_ranks`` can send them)."""
from __future__ import annotations

import torch
import torch.distributed as dist

import gcomp

STATS = ("bytes_sent", "encode_s", "decode_s", "round_work_s", "rounds", "allgather_calls", "allgather_bytes",
         "p2p_rounds", "p2p_bytes")


def _stats() -> dict:
    return {k: 0 for k in STATS}


def _grad(step: int, rank: int, numel: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return (torch.randn(numel, generator=g, dtype=torch.float64) * 10.0 ** (step % 3 - 1)).to(dtype)


def _reference(fmt, grads: list[list[torch.Tensor]], world: int, error_feedback: bool) -> list[torch.Tensor]:
    """The two phases computed by hand from the format alone (chunk by chunk), every rank simulated here: per step
    the result. The owner sums the chunks it received in rank order, by one reduction (``sum(0)``)."""
    numel = grads[0][0].numel()
    width = max(1, -(-numel // (world * fmt.block))) * fmt.block
    residuals = [torch.zeros(numel) for _ in range(world)]
    owner = torch.zeros(world * width)
    results = []
    for step_grads in grads:
        sent = []
        for s in range(world):
            x = torch.zeros(world * width)
            x[:numel] = step_grads[s] + residuals[s] if error_feedback else step_grads[s]
            chunks = [fmt.encode(x[r * width:(r + 1) * width].view(1, -1), "nearest")[0] for r in range(world)]
            decoded = torch.cat([fmt.decode(c, width).view(-1) for c in chunks])
            if error_feedback:
                residuals[s] = (x - decoded)[:numel]
            sent.append(chunks)
        y = torch.zeros(world * width)
        for r in range(world):
            total = torch.stack([fmt.decode(sent[s][r], width).view(-1) for s in range(world)]).sum(0)
            if error_feedback:
                total += owner[r * width:(r + 1) * width]
            out = fmt.decode(fmt.encode(total.view(1, -1), "nearest")[0], width).view(-1)
            if error_feedback:
                owner[r * width:(r + 1) * width] = total - out
                owner[numel:] = 0
            y[r * width:(r + 1) * width] = out
        results.append(y[:numel])
    return results


def job_two_phases(specs: list[str], numel: int, steps: int) -> dict:
    return {spec: _two_phases(spec, numel, steps) for spec in specs}


def _two_phases(spec: str, numel: int, steps: int) -> dict:
    """``spec`` reduced on this rank's gradients for ``steps`` steps, beside the hand-computed two phases."""
    rank, world = dist.get_rank(), dist.get_world_size()
    method = gcomp.registry.from_spec(spec)
    stats = _stats()
    method.bind(None, None, stats)
    bucket = gcomp.BucketInfo.from_layout(0, torch.float32, ["a", "b"], [numel // 3, numel - numel // 3])
    results = []
    for step in range(steps):
        results.append(method.reduce(_grad(step, rank, numel), bucket, None, stats).wait())
    grads = [[_grad(step, r, numel) for r in range(world)] for step in range(steps)]
    compressor = method.compressor
    reference = _reference(compressor.fmt, grads, world, compressor.error_feedback)
    width = compressor.width(numel, world)
    held, again = (method.flush(bucket, results[-1]) for _ in range(2))  # the owner error and the residual, once
    return {"results": torch.stack(results), "reference": torch.stack(reference), "stats": stats,
            "wire_bytes": compressor.fmt.wire_bytes(width), "width": width, "held": held, "again": again,
            "declared": compressor.traits.wire_bytes(bucket, world)}


def job_conservation(specs: list[str], steps: int) -> dict:
    return {spec: _conservation(spec, steps) for spec in specs}


def _conservation(spec: str, steps: int) -> dict:
    """fp64 buckets through ``spec``; the layout changes (DDP's rebuild) half way. Per parameter: the sum of this
    rank's inputs, of the results, and what the method holds back at the end (residual and owner error)."""
    rank = dist.get_rank()
    method = gcomp.registry.from_spec(spec)
    stats = _stats()
    method.bind(None, None, stats)
    numels = {"a.weight": 300, "a.bias": 7, "b.weight": 130}
    layouts = [gcomp.BucketInfo.from_layout(0, torch.float64, list(numels), list(numels.values())),
               gcomp.BucketInfo.from_layout(0, torch.float64, list(numels)[::-1], list(numels.values())[::-1])]
    inputs = {n: torch.zeros(k, dtype=torch.float64) for n, k in numels.items()}
    outputs = {n: torch.zeros(k, dtype=torch.float64) for n, k in numels.items()}
    for step in range(steps):
        bucket = layouts[0 if step < steps // 2 else 1]
        grad = _grad(step, rank, bucket.numel, torch.float64)
        result = method.reduce(grad, bucket, None, stats).wait()
        for name, offset, k in bucket.segments():
            inputs[name] += grad[offset:offset + k]
            outputs[name] += result[offset:offset + k]
    state = method.state_dict()
    held = {n: torch.zeros(k, dtype=torch.float64) for n, k in numels.items()}
    for part in (state["memory"].get("residuals", {}), state["compressor"].get("owner_error", {})):
        for name, t in part.items():
            held[name] += t.double()
    return {"inputs": inputs, "outputs": outputs, "held": held, "result_dtype": result.dtype}


def job_scales_all_to_all() -> dict:
    """gloo's all_to_all_single on uint8 and float32 rows: row r reaches rank r."""
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for dtype in (torch.uint8, torch.float32):
        rows = (torch.arange(world * 3).view(world, 3) + 10 * rank).to(dtype)
        got = torch.empty_like(rows)
        dist.all_to_all_single(got, rows)
        out[str(dtype)] = got
    return out

