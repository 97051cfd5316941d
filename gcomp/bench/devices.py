"""Where the benchmarks run: ``--device cpu`` (the default) or ``cuda``, and ``--backend gloo`` or ``nccl``.

Checked before anything starts, each problem a ValueError naming the flag and what to do; ``synchronize`` is
what a host clock must wait for before it is read around GPU work (kernels run asynchronously).
"""
from __future__ import annotations

import torch

DEVICES = ("cpu", "cuda")
BACKENDS = ("gloo", "nccl")


def no_cuda_reason() -> str | None:
    """Why CUDA cannot be used here, or None when it can."""
    if torch.version.cuda is None:
        return f"this torch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return f"no CUDA GPU is visible (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return None


def check_device(device: str) -> None:
    if device not in DEVICES:
        raise ValueError(f"--device must be one of {', '.join(DEVICES)}; got {device!r}")
    if device == "cuda":
        why = no_cuda_reason()
        if why:
            raise ValueError(f"--device cuda: {why}; leave --device out to run on the CPU")


def check_backend(backend: str, device: str, workers: int) -> None:
    """The process group's backend against the device and the number of workers (one GPU each with NCCL)."""
    if backend not in BACKENDS:
        raise ValueError(f"--backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend != "nccl":
        return
    if device != "cuda":
        raise ValueError("--backend nccl reduces CUDA tensors only: add --device cuda (or use --backend gloo)")
    why = no_cuda_reason()
    if why:
        raise ValueError(f"--backend nccl: {why}")
    gpus = torch.cuda.device_count()
    if workers > gpus:
        raise ValueError(f"--backend nccl runs one worker per GPU: --workers {workers}, but {gpus} GPU(s) are "
                         f"visible (NCCL refuses two ranks on one GPU); use --workers {gpus} or --backend gloo")


def worker_device(device: str, local_rank: int) -> torch.device:
    """The device of the worker with ``local_rank``: ``cuda:local_rank`` (round robin where gloo puts more
    workers than GPUs on one host), or the CPU."""
    if device == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a CUDA device); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
