"""The quantisers' one implementation (``qsgd``, ``terngrad`` in both forms, ``natural``), codec by codec in one
process: a fixed number of operations and no host read whatever the bucket's parameters and entries, and random
streams that resume bit for bit from ``state_dict``. (``tests/test_bucket_wide.py`` counts the whole reduction on
gloo ranks.)"""
from __future__ import annotations

import pytest
import torch

import gcomp
from gcomp.testing.ops import counting
from tests.compressors.test_terngrad import encode, gradient, layout

SPECS = [("qsgd", {}), ("qsgd", {"levels": 3}), ("qsgd", {"levels": 1}), ("terngrad", {}), ("terngrad", {"clip": 0.0}),
         ("terngrad", {"collective": "allreduce"}), ("natural", {})]
IDS = ["qsgd", "qsgd-3", "qsgd-1", "terngrad", "terngrad-noclip", "terngrad-allreduce", "natural"]
# (parameters, entries each): more parameters, then more entries, than the first
LAYOUTS = [[100] * 4, [25] * 64, [1 << 18] * 4]
WORLD = 2


def _codec(name: str, params: dict):
    comp = gcomp.create(name, **params).compressor
    comp.world = WORLD  # the all-reduce form's lane width; the others never read it
    return comp


def _step(comp, x: torch.Tensor, info) -> tuple[list, torch.Tensor, int, dict]:
    """One bucket as ``WORLD`` ranks sending the same payload would: encode (and the second round), the exchange
    done by hand (outside the counts), decode. The payload's tensors, the decoded sum, the operations counted and
    the host reads."""
    chained = comp.traits.collective == "allreduce"
    with counting() as encoding:
        payload = encode(comp, x, info)
        if chained:
            comp.second_round(payload)  # its MAX round of one rank: the scales as they are
    received = [t * WORLD if i else t for i, t in enumerate(payload.tensors)] if chained \
        else [torch.stack([t] * WORLD) for t in payload.tensors]
    with counting() as decoding:
        out = comp.decode(received, payload.ctx)
    ops = sum(encoding.ops.values()) + sum(decoding.ops.values())
    return [t.clone() for t in payload.tensors], out, ops, {**encoding.syncs, **decoding.syncs}


@pytest.mark.parametrize(("name", "params"), SPECS, ids=IDS)
def test_one_bucket_takes_a_fixed_number_of_operations_and_reads_nothing_on_the_host(name, params):
    """The operations of one bucket's encode and decode do not grow from 4 parameters of 100 entries to 64
    parameters, or to 2^18 entries each, and none synchronises the host."""
    counts = []
    for sizes in LAYOUTS:
        comp, info, x = _codec(name, params), layout(sizes, torch.float32), gradient(sizes, torch.float32, seed=1)
        _step(comp, x, info)
        *_, ops, syncs = _step(comp, x, info)
        assert not syncs, f"{name}{params} on {len(sizes)} x {sizes[0]}: host reads {syncs}"
        counts.append(ops)
    assert max(counts[1:]) <= counts[0], f"{name}{params}: {counts} operations for {[len(s) for s in LAYOUTS]}"


@pytest.mark.parametrize(("name", "params"), SPECS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_a_resumed_codec_draws_what_the_running_one_draws(name, params, dtype):
    """``state_dict`` after two steps, loaded into a fresh codec: the next payload and its decode are bit-identical
    to the running codec's."""
    sizes = [300, 1, 0, 77]
    info, x = layout(sizes, dtype), gradient(sizes, dtype, seed=2, zeros=0.1)
    running = _codec(name, params)
    for _ in range(2):
        _step(running, x, info)
    resumed = _codec(name, params)
    resumed.load_state_dict(running.state_dict())
    (sent, out, *_), (again, out_again, *_) = _step(running, x, info), _step(resumed, x, info)
    assert all(torch.equal(a, b) for a, b in zip(sent, again))
    assert torch.equal(out, out_again) and out.dtype == dtype
