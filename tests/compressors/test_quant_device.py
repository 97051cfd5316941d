"""The quantisers' device paths (``qsgd``, ``terngrad`` in both forms, ``natural``), codec by codec in one process: a
fixed number of operations and no host read whatever the bucket's parameters and entries, and random streams that
resume bit for bit from ``state_dict``. (``tests/test_device_path.py`` counts the whole reduction on gloo ranks.)"""
from __future__ import annotations

import pytest
import torch

import gcomp
from gcomp.kernels import forced
from gcomp.testing.ops import counting
from tests.compressors.test_terngrad import gradient, layout

SPECS = [("qsgd", {}), ("qsgd", {"levels": 3}), ("terngrad", {}), ("terngrad", {"clip": 0.0}),
         ("terngrad", {"collective": "allreduce"}), ("natural", {})]
IDS = ["qsgd", "qsgd-3", "terngrad", "terngrad-noclip", "terngrad-allreduce", "natural"]
# (parameters, entries each): more parameters, then more entries, than the first
LAYOUTS = [[100] * 4, [25] * 64, [1 << 18] * 4]
WORLD = 2


def _codec(name: str, params: dict):
    comp = gcomp.create(name, **params).compressor
    comp.world_size = WORLD  # the all-reduce form's lane width; the others never read it
    return comp


def _step(comp, x: torch.Tensor, info) -> tuple[list, torch.Tensor]:
    """One bucket on the device path, as ``WORLD`` ranks sending the same payload would: encode, the exchange
    done by hand (outside the counts), decode. Returns the payload's tensors and the decoded sum."""
    with forced("cuda"), counting() as encoding:
        payload = comp.compress(x, info)
        if comp.collective == "allreduce":
            comp.second_round(payload)  # its MAX round of one rank: the scales as they are
    received = [t * WORLD if i else t for i, t in enumerate(payload.tensors)] if comp.collective == "allreduce" \
        else [torch.stack([t] * WORLD) for t in payload.tensors]
    with forced("cuda"), counting() as decoding:
        if comp.collective == "allreduce":
            out = comp.decompress(received, payload.ctx)
        else:
            out = comp.aggregate(received, payload.ctx)
    _step.counts = encoding.ops + decoding.ops, encoding.syncs + decoding.syncs
    return [t.clone() for t in payload.tensors], out.clone()


@pytest.mark.parametrize(("name", "params"), SPECS, ids=IDS)
def test_the_device_path_is_bucket_wide_and_reads_nothing_on_the_host(name, params):
    """The operations of one bucket's encode and decode do not grow from 4 parameters of 100 entries to 64
    parameters, or to 2^18 entries each (past the CPU path's chunks of 64 K bytes), and none synchronises the host
    (a warm-up step first: buffers kept per layout are allocated once)."""
    counts = []
    for sizes in LAYOUTS:
        comp, info, x = _codec(name, params), layout(sizes, torch.float32), gradient(sizes, torch.float32, seed=1)
        _step(comp, x.clone(), info)
        _step(comp, x.clone(), info)
        ops, syncs = _step.counts
        assert not syncs, f"{name}{params} on {len(sizes)} x {sizes[0]}: host reads {dict(syncs)}"
        counts.append(ops)
    first = sum(counts[0].values())
    for sizes, ops in zip(LAYOUTS[1:], counts[1:]):
        grew = {k: v - counts[0].get(k, 0) for k, v in ops.items() if v > counts[0].get(k, 0)}
        assert sum(ops.values()) <= first, f"{len(sizes)} x {sizes[0]}: more of {grew} than for 4 x 100"


@pytest.mark.parametrize(("name", "params"), SPECS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_resumed_codec_draws_what_the_running_one_draws(name, params, dtype):
    """``state_dict`` after two device-path steps, loaded into a fresh codec: the next payload and its decode are
    bit-identical to the running codec's."""
    sizes = [300, 1, 0, 77]
    info, x = layout(sizes, dtype), gradient(sizes, dtype, seed=2, zeros=0.1)
    running = _codec(name, params)
    for _ in range(2):
        _step(running, x.clone(), info)
    resumed = _codec(name, params)
    resumed.load_state_dict(running.state_dict())
    (sent, out), (again, out_again) = _step(running, x.clone(), info), _step(resumed, x.clone(), info)
    assert all(torch.equal(a, b) for a, b in zip(sent, again))
    assert torch.equal(out, out_again) and out.dtype == dtype
