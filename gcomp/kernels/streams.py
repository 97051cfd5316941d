"""Codec work off the critical path on CUDA: one side stream per device, on which a bucket's encode and decode run,
ordered by events (as NCCL runs its collectives on its own streams), so that a bucket's codec overlaps the rest
of the backward pass.

Ordering, for one bucket (``gcomp.method.Method.reduce``): the side stream waits for the stream that produced the
bucket (the reader's, DDP's); the encode runs on it and the collectives are launched from it (NCCL waits for it);
the decode, in the collective's callback, runs on it after it waited for the callback's stream, and that stream
then waits for it, so the event the result's future records covers the decode; the decoded tensor is recorded on
the reader's stream, so its memory is not handed out again before the reader is done with it.

Off by default (``enabled()``): ``GCOMP_CODEC_STREAM=1`` or ``with gcomp.kernels.streams.codec_stream():`` turns
it on. It waits for a check of its ordering on a GPU (``tests/test_gpu.py``, ``-m gpu``) before it is on by
default.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch

ENV = "GCOMP_CODEC_STREAM"
_STREAMS: dict[int, "torch.cuda.Stream"] = {}
_forced: list[bool] = []


def enabled() -> bool:
    """Whether codecs run on a side stream (``codec_stream``, else ``GCOMP_CODEC_STREAM``)."""
    if _forced:
        return _forced[-1]
    return os.environ.get(ENV, "").strip().lower() in ("1", "true", "yes")


@contextmanager
def codec_stream(on: bool = True) -> Iterator[None]:
    """Codecs on CUDA tensors run on a side stream inside the block (``on=False``: they do not)."""
    _forced.append(on)
    try:
        yield
    finally:
        _forced.pop()


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The codec stream of ``device``, made once."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = _STREAMS.get(index)
    if stream is None:
        stream = _STREAMS[index] = torch.cuda.Stream(device=index)
    return stream


def applies(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s codec runs on a side stream: a CUDA tensor, with side streams enabled."""
    return tensor.is_cuda and enabled()
