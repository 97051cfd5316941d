"""``gcomp bench --fsdp``: the same race under FSDP2 (``fully_shard``) instead of DDP.

Each worker shards its model (every child module that holds parameters, then the root, over one 1-D mesh of all
workers) after pruning it, and installs the method with ``gcomp.install`` (``gcomp.fsdp``). ``torch:allreduce``
stands for plain FSDP2 there: FSDP's own reduce-scatter (``dist.reduce_scatter_single``), only counted. On gloo
that collective moves what an all-reduce does (``gcomp.collectives.reduce.reduce_scatter_sum`` says how it was measured), so
``identity`` (gcomp's all-to-all reduce-scatter) already sends half of plain FSDP2's bytes on the wire while
``bytes_sent`` counts both alike (the input handed to the collective).

Compute, in the breakdown, is forward and backward with gradient sync off (``set_requires_gradient_sync(False)``):
FSDP's parameter all-gathers stay in it.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

import gcomp
from gcomp.bench.methods import BenchMethod, parse_method
from gcomp.fsdp.install import check_serves_fsdp, fsdp_methods

PLAIN = "torch:allreduce"  # plain FSDP2 under --fsdp
DEFAULT_METHODS = (PLAIN, "identity", "fp16", "pactrain", "spardl")


def check_methods(methods: list[str]) -> None:
    """A ValueError for a method that cannot run under FSDP2 (PyTorch's DDP hooks, methods whose codec does not,
    options it refuses), naming those that can."""
    for text in methods:
        method = parse_method(text)
        if getattr(method, "outer", False):
            raise ValueError(f"--fsdp: {text} is an outer loop: each worker trains a whole model between syncs, "
                             "not a shard; race it without --fsdp")
        if method.is_torch:
            if method.name != PLAIN:
                raise ValueError(f"--fsdp: {text} is a DDP hook; under FSDP2 the baseline is {PLAIN} (plain FSDP2's "
                                 "own reduce-scatter)")
            continue
        try:
            check_serves_fsdp(gcomp.create(method.name, **method.params))
        except ValueError as err:
            raise ValueError(f"--fsdp: {err}") from None


def shard(model: torch.nn.Module, device: torch.device) -> FSDPModule:
    """``fully_shard`` on every child module holding parameters, then on the root, over all workers."""
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for child in model.children():
        if any(True for _ in child.parameters()):
            fully_shard(child, mesh=mesh)
    return fully_shard(model, mesh=mesh)


class CountingReduceScatter(DefaultReduceScatter):
    """FSDP2's own reduce-scatter, its input's bytes counted as ``bytes_sent`` and ``bytes_dense``."""

    def __init__(self, stats: dict):
        self.stats = stats

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        nbytes = input_tensor.numel() * input_tensor.element_size()
        self.stats["bytes_sent"] += nbytes
        self.stats["bytes_dense"] += nbytes
        return super().__call__(output_tensor, input_tensor, group, op, async_op)


def install(method: BenchMethod, model: FSDPModule) -> dict:
    """The method on the sharded model; its stats (plain FSDP2's counted by ``CountingReduceScatter``)."""
    if not method.is_torch:
        return gcomp.install(model, method.name, **method.params).stats
    stats = {"bytes_sent": 0, "bytes_dense": 0, "encode_s": 0.0, "decode_s": 0.0}
    for module in model.modules():
        if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_groups:
            module.set_custom_reduce_scatter(CountingReduceScatter(stats))
    return stats


@contextmanager
def no_sync(model: FSDPModule):
    """Forward and backward with no gradient reduction (FSDP2's ``set_requires_gradient_sync``)."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


__all__ = ["DEFAULT_METHODS", "check_methods", "fsdp_methods", "install", "no_sync", "shard"]
