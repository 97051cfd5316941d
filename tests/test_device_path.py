"""Every codec's device path, on a machine without a device (``gcomp.kernels.forced("cuda")``): bucket-wide (its
operations do not grow with the bucket's parameters or entries), no host synchronisation it does not declare, and
correct (the contracts that run a bucket through it).

The counts come from ``gcomp.testing.ops`` on 2 gloo ranks, one bucket of 4 or 64 parameters and of 64 K or 16 M
fp32 entries (``CONFIGS``) after 4 warm-up steps."""
from __future__ import annotations

import pytest
import torch

import gcomp
import gcomp.testing
from gcomp import kernels
from gcomp.testing.ops import CONFIGS, OpCounter, check_bounded, counting, job_device_counts
from tests.distributed import run_ranks_once

METHODS = gcomp.available()


@pytest.mark.parametrize("name", METHODS)
def test_the_device_path_is_bucket_wide_and_syncs_only_where_declared(name):
    counts = run_ranks_once(("device-counts",), 2, job_device_counts, METHODS, timeout=1200)
    for rank in counts:
        check_bounded(name, rank, gcomp.create(name).host_syncs)


def test_forced_makes_every_tensor_take_the_device_path(monkeypatch):
    cpu = torch.ones(3)
    assert not kernels.on_device(cpu)
    with kernels.forced("cuda"):
        assert kernels.on_device(cpu)
        with kernels.forced():
            assert kernels.on_device(cpu)
        assert kernels.on_device(cpu)
    assert not kernels.on_device(cpu)
    monkeypatch.setenv(kernels.ENV, "cuda")
    assert kernels.on_device(cpu)
    monkeypatch.setenv(kernels.ENV, "tpu")
    with pytest.raises(ValueError, match="GCOMP_FORCE_DEVICE_PATH='tpu'"):
        kernels.on_device(cpu)
    with pytest.raises(ValueError, match="device paths are cuda"):
        with kernels.forced("rocm"):
            pass


def test_the_counter_sees_host_reads_and_data_dependent_shapes():
    x = torch.arange(6.0)
    with counting() as counter:
        x.sum().item()
        (x > 2).nonzero()
        x.tolist()
        torch.repeat_interleave(x, torch.full((6,), 2))
        torch.repeat_interleave(x, torch.full((6,), 2), output_size=12)
    # the item, and the two values repeat_interleave reads without an output size (none with one)
    assert counter.syncs == {"_local_scalar_dense": 3, "nonzero": 1, "tolist": 1}
    assert isinstance(counter, OpCounter) and counter.ops["repeat_interleave"] == 2


def test_a_loop_over_parameters_is_caught():
    """The check itself: a count that grows with the parameters, or an undeclared sync, fails it."""
    grows = {("m", *CONFIGS[0]): {"ops": {"add": 4}, "syncs": {}}, ("m", *CONFIGS[1]): {"ops": {"add": 64},
                                                                                         "syncs": {}},
             ("m", *CONFIGS[2]): {"ops": {"add": 4}, "syncs": {"nonzero": 1}}}
    with pytest.raises(AssertionError, match=r"64 operations against 4 .*more of: \{'add': 60\}"):
        check_bounded("m", grows, declared=1)
    with pytest.raises(AssertionError, match="1 host synchronisations"):
        check_bounded("m", {**grows, ("m", *CONFIGS[1]): grows[("m", *CONFIGS[0])]}, declared=0)
    check_bounded("m", {**grows, ("m", *CONFIGS[1]): grows[("m", *CONFIGS[0])]}, declared=1)


@pytest.mark.parametrize("name", METHODS)
def test_the_device_path_keeps_the_contracts(name):
    """The contracts that run buckets through the codec (mean, homomorphism, lossless, conservation, non-finite),
    every codec on its device path, on 2 and 3 ranks."""
    gcomp.testing.check_method(name, world_sizes=(2, 3), contracts=["reduce", "homomorphism", "lossless",
                                                                    "conservation", "nonfinite"],
                               examples=8, device_path=True)


def test_side_streams_are_off_by_default_and_only_for_cuda_tensors(monkeypatch):
    from gcomp.kernels import streams
    monkeypatch.delenv(streams.ENV, raising=False)
    assert not streams.enabled()
    with streams.codec_stream():
        assert streams.enabled() and not streams.applies(torch.ones(2))  # a CPU tensor's codec stays where it is
        with streams.codec_stream(False):
            assert not streams.enabled()
    monkeypatch.setenv(streams.ENV, "1")
    assert streams.enabled()


def test_syncs_inside_an_operation_are_counted_too():
    """``segment_reduce`` checks its lengths on the host unless told not to: two syncs the dispatch mode alone does
    not see; the device path's segment reductions make none."""
    from gcomp.kernels import segments
    x, lengths = torch.randn(100), torch.tensor([50, 50])
    with counting() as checked:
        torch.segment_reduce(x, "max", lengths=lengths)
    with counting() as trusted:
        segments.reduce(x, (50, 50), "max")
    assert checked.syncs["_local_scalar_dense"] == 2 and sum(trusted.syncs.values()) == 0
