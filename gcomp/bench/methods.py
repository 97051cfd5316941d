"""What a benchmark compares: gcomp methods by name with parameters, and PyTorch's own DDP hooks beside them.

A method spec is ``name`` or ``name:key=value,key=value`` (``pactrain:ternary=true``, ``topk:ratio=0.01``) for
a registered gcomp method, or ``torch:allreduce``, ``torch:fp16``, ``torch:bf16``, ``torch:powersgd`` for
PyTorch's hooks, installed through ``register_comm_hook`` and wrapped so that the bytes they hand to collectives
are counted like gcomp's ``bytes_sent``.

No ``from __future__ import annotations`` here: DDP checks a hook's return annotation against the real
``torch.futures.Future[torch.Tensor]``.
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import gcomp
from gcomp.registry import parse_spec

TORCH_HOOKS = ("torch:allreduce", "torch:fp16", "torch:bf16", "torch:powersgd")
PRUNED = ("pactrain", "prunex")  # methods that fine-tune a pruned model (the PacTrain workflow)
POWERSGD_RANK = 2


@dataclass(frozen=True)
class BenchMethod:
    """One method as a benchmark run compares it (a parsed spec): ``label`` as written, the method ``name`` (a
    registered gcomp method or one of PyTorch's hooks) and its ``params``."""

    label: str
    name: str
    params: dict = field(default_factory=dict)

    @property
    def is_torch(self) -> bool:
        return self.name in TORCH_HOOKS

    @property
    def prunes(self) -> bool:
        if self.name == "auto":  # its presets take pactrain on a pruned model; a list may name a pruning method
            allow = str(self.params.get("allow", "exact"))
            return allow in ("exact", "half") or any(spec.split(":")[0] in PRUNED for spec in allow.split("|"))
        return self.name in PRUNED

    @property
    def one_bucket(self) -> bool:
        """PyTorch's PowerSGD hook hangs on gloo with several buckets: it runs with one."""
        return self.name == "torch:powersgd"

    @property
    def collective(self) -> str:
        if self.is_torch:
            return "allreduce"
        return gcomp.create(self.name, **self.params).collective or self.name  # a composite: its own name


def parse_method(text: str) -> BenchMethod:
    """An outer loop (``diloco:...``, ``gcomp.bench.outer_spec``), one of PyTorch's hooks, or ``name`` or
    ``name:key=value,...`` (``gcomp.registry.parse_spec``: values typed
    by the method's declared parameters), validated by creating the method."""
    text = text.strip()
    from gcomp.bench.outer_spec import is_outer, parse_outer
    if is_outer(text):  # an outer loop (gcomp bench --outer): its own spec, its own run
        return parse_outer(text)
    if text in TORCH_HOOKS:
        return BenchMethod(text, text)
    if text.startswith("torch:"):
        raise ValueError(f"unknown PyTorch hook {text!r}; choose one of {', '.join(TORCH_HOOKS)}")
    name, params = parse_spec(text)  # unknown names (with close names), keys and types
    gcomp.create(name, **params)  # validates the values now, not in a worker
    return BenchMethod(text, name, params)


class TorchHook:
    """One of PyTorch's DDP hooks, registered on ``ddp``, counting the bytes it hands to collectives."""

    def __init__(self, name: str, ddp, group=None, seed: int = 0):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        self.name, self.stats = name, {"bytes_sent": 0, "bytes_dense": 0, "encode_s": 0.0, "decode_s": 0.0}
        if name == "torch:allreduce":
            hook, state, self._bytes = default_hooks.allreduce_hook, group, lambda b: b.buffer().numel() * 4
        elif name == "torch:fp16":
            hook, state, self._bytes = default_hooks.fp16_compress_hook, group, lambda b: b.buffer().numel() * 2
        elif name == "torch:bf16":
            hook, state, self._bytes = default_hooks.bf16_compress_hook, group, lambda b: b.buffer().numel() * 2
        else:
            if torch.cuda.is_available() and next(ddp.parameters()).device.type == "cpu":
                raise ValueError("torch:powersgd: PyTorch's PowerSGD hook calls torch.cuda.synchronize on the "
                                 "bucket's device whenever CUDA is available, which fails for CPU tensors on a host "
                                 "with a GPU; run it with --device cuda, or run gcomp's powersgd")
            state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=POWERSGD_RANK,
                                                start_powerSGD_iter=2, random_seed=seed)
            hook, self._bytes = powerSGD_hook.powerSGD_hook, lambda b: _powersgd_bytes(b, state)
        self._hook, self._state = hook, state
        ddp.register_comm_hook(self, TorchHook._call)

    @staticmethod
    def _call(self: "TorchHook", bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        self.stats["bytes_sent"] += self._bytes(bucket)
        self.stats["bytes_dense"] += bucket.buffer().numel() * 4
        return self._hook(self._state, bucket)


def _powersgd_bytes(bucket, state) -> int:
    """What ``powerSGD_hook`` all-reduces for ``bucket``: plain until ``start_powerSGD_iter``, then the
    uncompressed tensors plus P (n x r) and Q (m x r) of each matrix worth compressing (PyTorch's rule)."""
    if state.iter < state.start_powerSGD_iter:
        return bucket.buffer().numel() * 4
    total = 0
    for grad in bucket.gradients():
        if grad.dim() <= 1:
            total += grad.numel() * 4
            continue
        n, m = grad.shape[0], grad.numel() // grad.shape[0]
        r = min(n, m, state.matrix_approximation_rank)
        compress = (n + m) * r * state.min_compression_rate < n * m
        total += ((n + m) * r if compress else n * m) * 4
    return total
