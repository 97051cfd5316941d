"""How a gcomp method serves FSDP2's reduce-scatter: the ``ShardedCodec`` interface and the table of methods that
have one (``codec_for``). Each codec drives the method's own compressor and memory; only the layout (rows that go
to each shard) is FSDP's."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

import torch
import torch.distributed as dist

from gcomp.core import Method
from gcomp.fsdp.layout import ShardLayout


class ShardedCodec(ABC):
    """One method as FSDP2's reduce-scatter: ``reduce_scatter`` writes into ``output`` (this rank's shard) the SUM
    over the shard group of row ``rank`` of every rank's ``input`` (FSDP's flat, shard-major gradient), as the
    method reconstructs it, and adds the bytes it hands to collectives to ``stats["bytes_sent"]``.

    ``prescale``: FSDP's averaging (its reduce op: AVG, or PREMUL_SUM by its divide factor) is applied to the
    input before encoding (True: what DDP's hook does, so that 16-bit sums do not overflow and residuals are in
    the mean's units) or to the output after decoding (False: lossless codecs, which then match FSDP's own
    reduce-scatter, a sum divided afterwards, bit for bit on two ranks).
    """

    prescale: ClassVar[bool] = True
    # parameter sets of the method that put something else on the wire (``fsdp_configs`` lists them, so the
    # FSDP contract suite runs each)
    variants: ClassVar[tuple[dict, ...]] = ()

    def __init__(self, method: Method):
        self.method = method

    def bind(self, model: torch.nn.Module, group: dist.ProcessGroup, stats: dict) -> None:
        """Called once at install, with the FSDP root module, the shard group and the state's stats."""

    def install_flags(self) -> torch.Tensor | None:
        """int64 flags to MAX all-reduce over the shard group once at install (``Compressor.install_flags``)."""
        return None

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        pass

    @abstractmethod
    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, layout: ShardLayout,
                       group: dist.ProcessGroup, stats: dict) -> None:
        """Reduce-scatter ``input`` into ``output`` (both flat, FSDP's reduce dtype); waits for the result."""


def _table() -> dict[str, type[ShardedCodec]]:
    from gcomp.fsdp.dense import DenseCodec
    from gcomp.fsdp.pactrain import PacTrainCodec
    from gcomp.fsdp.randomk import RandomKCodec
    from gcomp.fsdp.spardl import SparDLCodec
    return {"identity": DenseCodec, "fp16": DenseCodec, "bf16": DenseCodec, "pactrain": PacTrainCodec,
            "randomk": RandomKCodec, "spardl": SparDLCodec}


def fsdp_methods() -> tuple[str, ...]:
    """The registered methods that can serve FSDP2's reduce-scatter."""
    return tuple(_table())


def config_label(name: str, params: dict) -> str:
    """``name`` or ``name:key=value,...`` (``gcomp bench``'s method syntax, booleans lower-case)."""
    if not params:
        return name
    return name + ":" + ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in params.items())


def fsdp_configs() -> tuple[tuple[str, str, dict], ...]:
    """(label, method name, parameters) of every FSDP-capable method with its defaults, then each variant its
    codec declares (``ShardedCodec.variants``: ``pactrain``'s ternary paths)."""
    return tuple((config_label(name, params), name, params) for name, cls in _table().items()
                 for params in ({}, *cls.variants))


def codec_for(method: Method) -> ShardedCodec:
    """The FSDP2 codec of a registered method; a ValueError naming the methods that have one otherwise."""
    cls = _table().get(method.name)
    if cls is None:
        raise ValueError(f"{method.name} cannot serve FSDP2's reduce-scatter (fully_shard); the methods that can: "
                         f"{', '.join(fsdp_methods())}. Under DDP every method works (gcomp.install on a "
                         "DistributedDataParallel model)")
    return cls(method)
