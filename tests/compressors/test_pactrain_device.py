"""pactrain and prunex on their device path (``gcomp.kernels.forced``, on CPU tensors): a packed bucket's encode and
decode take a number of operations that does not grow with its parameters or entries, with the one host read
``PacTrainCompressor.host_syncs`` declares; lossless pactrain still equals the dense all-reduce on the support, bit
for bit on 2 ranks; ternary is still unbiased."""
from __future__ import annotations

import contextlib

import pytest
import torch

from gcomp import kernels
from gcomp.compressors import bernoulli
from gcomp.registry import from_spec
from gcomp.testing.ops import check_bounded, counting
from tests.compressors import pactrain_jobs as jobs
from tests.compressors import test_pactrain as host
from tests.compressors.device_count_jobs import SMALL, job_on_device_path, job_packed_counts
from tests.distributed import run_ranks_once


def test_bernoulli_draws_on_the_device_path_read_nothing_on_the_host():
    hit, work = torch.empty(64, dtype=torch.bool), {}
    with kernels.forced(), counting() as counter:
        bernoulli.draw_hits(hit, torch.full((64,), 128.5), torch.Generator(), work)
    assert not counter.syncs and counter.ops.get("nonzero", 0) == 0


def _counts() -> dict:
    specs = ["pactrain", "prunex", "pactrain:ternary=true"]
    return run_ranks_once(("packed-device-counts",), 2, job_packed_counts, specs, SMALL, timeout=600)[0]


@pytest.mark.parametrize("spec", ["pactrain", "prunex", "pactrain:ternary=true"])
def test_a_packed_bucket_is_bucket_wide_with_one_declared_host_read(spec):
    counts = _counts()
    assert counts[(spec, *SMALL[0])]["ops"].get("index_select")  # a packed step was counted, not a tracking one
    check_bounded(spec, counts, from_spec(spec).host_syncs, SMALL)
    assert from_spec(spec).host_syncs == 1


def test_lossless_decodes_the_dense_sum_on_the_support_bit_for_bit():
    """Two simulated ranks: the packed decode is the sum of the gradients on the support and 0 off it, bit for bit,
    and bit for bit what the CPU path decodes."""
    model, info, support = host._tiny_pruned()
    g = torch.Generator().manual_seed(3)
    grads = [torch.randn(info.numel, generator=g) for _ in range(2)]
    decoded = {}
    for path in ("cpu", "device"):
        comps = host._compressors(2, model)
        with kernels.forced() if path == "device" else contextlib.nullcontext():
            host._reach("packed", comps, info, grads)
            _, decoded[path] = host._exchange(comps, info, grads)
    expected = torch.where(support, grads[0] + grads[1], torch.zeros(()))
    for d, c in zip(decoded["device"], decoded["cpu"]):
        assert torch.equal(d.view(torch.int32), expected.view(torch.int32))
        assert torch.equal(d.view(torch.int32), c.view(torch.int32))


@pytest.mark.parametrize("world, rounds", [(2, 1), (4, 2)])
def test_ternary_is_unbiased_on_the_device_path(world, rounds):
    with kernels.forced():
        host.test_ternary_is_unbiased(world, rounds)


def test_lossless_training_equals_plain_ddp_on_the_device_path():
    """Pruned models trained under DDP on 2 ranks, every codec on its device path: parameters and last gradients
    equal plain DDP's bit for bit (the bucket's tracking, packed and unfrozen steps, a rebuild, channels_last)."""
    names = ["basic", "static", "cnn_cl", "rebuild", "reprune"]
    for rank, r in enumerate(run_ranks_once(("pactrain-device",), 2, job_on_device_path, jobs.job_train, names)):
        for name in names:
            got, reference = r[name]["pactrain"], r[name]["reference"]
            assert got["history"][-1]["packed_buckets"] > 0
            host._assert_same(got["params"], reference["params"], True, f"{name}: rank {rank} parameters")
            host._assert_same(got["grads"], reference["grads"], True, f"{name}: rank {rank} last gradients")
