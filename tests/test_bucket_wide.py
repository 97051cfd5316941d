"""Every codec has one path for every device: bucket-wide (its operations do not grow with the bucket's parameters
or entries) and no host synchronisation it does not declare (``traits.host_syncs``). The same code runs on a GPU, so
counting it on the CPU counts what a GPU launches.

The counts come from ``gcomp.testing.ops`` on 2 gloo ranks, one bucket of 4 or 64 parameters and of 64 K or 4 M
fp32 entries (``CONFIGS``) after 4 warm-up steps."""
from __future__ import annotations

import pytest
import torch

import gcomp
from gcomp.bucket import segment_reduce
from gcomp.collectives import launch
from gcomp.testing.ops import CONFIGS, OpCounter, check_bounded, counting, job_device_counts
from tests.distributed import run_ranks_once

METHODS = gcomp.available()


@pytest.mark.parametrize("name", METHODS)
def test_every_codec_is_bucket_wide_and_syncs_only_where_declared(name):
    counts = run_ranks_once(("device-counts",), 2, job_device_counts, METHODS, timeout=1200)
    for rank in counts:
        check_bounded(name, rank, gcomp.create(name).host_syncs)


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


def test_side_streams_are_off_by_default_and_only_for_cuda_tensors(monkeypatch):
    monkeypatch.delenv(launch.STREAM_ENV, raising=False)
    assert launch.side_stream(torch.ones(2)) is None
    with launch.codec_stream():
        assert launch.side_stream(torch.ones(2)) is None  # a CPU tensor's codec stays where it is
    monkeypatch.setenv(launch.STREAM_ENV, "1")
    with launch.codec_stream(False):
        assert launch.side_stream(torch.ones(2)) is None


def test_syncs_inside_an_operation_are_counted_too():
    """``torch.segment_reduce`` checks its lengths on the host unless told not to: two syncs the dispatch mode alone
    does not see; ``gcomp.bucket.segment_reduce`` makes none."""
    x, lengths = torch.randn(100), torch.tensor([50, 50])
    with counting() as checked:
        torch.segment_reduce(x, "max", lengths=lengths)
    with counting() as trusted:
        segment_reduce(x, (50, 50), "max")
    assert checked.syncs["_local_scalar_dense"] == 2 and sum(trusted.syncs.values()) == 0
