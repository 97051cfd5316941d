"""``then_on``: a collective's callback result as a future that a CUDA stream can wait for."""
from __future__ import annotations

import pytest
import torch

from gcomp.collectives.launch import then_on

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA GPU here (torch.cuda.is_available() is False)")])]


@pytest.mark.parametrize("device", DEVICES)
def test_hands_on_the_callbacks_value(device):
    source = torch.futures.Future()
    result = then_on(source, lambda f: f.value() * 2, torch.device(device))
    assert not result.done()
    source.set_result(torch.arange(4.0, device=device))
    assert torch.equal(result.wait().cpu(), torch.tensor([0.0, 2, 4, 6]))


@pytest.mark.parametrize("device", DEVICES)
def test_hands_on_the_collectives_error_and_the_callbacks(device):
    failed = torch.futures.Future()
    result = then_on(failed, lambda f: f.value(), torch.device(device))
    failed.set_exception(RuntimeError("peer 3 is gone"))
    with pytest.raises(RuntimeError, match="peer 3 is gone"):
        result.wait()

    def broken(f):
        raise ValueError("bad payload")

    done = torch.futures.Future()
    done.set_result(torch.zeros(1, device=device))
    with pytest.raises(Exception, match="bad payload"):  # then() wraps it in a RuntimeError
        then_on(done, broken, torch.device(device)).wait()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU here (torch.cuda.is_available() is False)")
def test_a_cuda_result_is_a_future_of_that_device():
    source = torch.futures.Future()
    result = then_on(source, lambda f: f.value(), torch.device("cuda"))
    assert [d.type for d in result.devices()] == ["cuda"]
