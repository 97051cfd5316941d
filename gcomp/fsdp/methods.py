"""Which methods serve FSDP2's reduce-scatter: those registered with a row strategy (``gcomp.sharding``)."""
from __future__ import annotations

from gcomp.method import MethodUnit
from gcomp.registry import available, spec


def fsdp_methods() -> tuple[str, ...]:
    """The registered methods that can serve FSDP2's reduce-scatter (``gcomp.available(fsdp=True)``)."""
    return tuple(available(fsdp=True))


def config_label(name: str, params: dict) -> str:
    """``name`` or ``name:key=value,...`` (``gcomp bench``'s method syntax, booleans lower-case)."""
    if not params:
        return name
    return name + ":" + ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in params.items())


def fsdp_configs() -> tuple[tuple[str, str, dict], ...]:
    """(label, method name, parameters) of every FSDP-capable method with its defaults, then each variant its row
    strategy declares (``RowStrategy.variants``: ``pactrain``'s ternary paths)."""
    return tuple((config_label(name, params), name, params) for name in fsdp_methods()
                 for params in ({}, *spec(name).fsdp.variants))


def check_serves_fsdp(method: MethodUnit) -> None:
    """A ValueError naming the methods that serve FSDP2 when ``method`` does not, or when its row strategy cannot
    serve its configuration (``RowStrategy.check``)."""
    strategy = method.row_strategy
    if strategy is None:
        raise ValueError(f"{method.name} cannot serve FSDP2's reduce-scatter (fully_shard); the methods that can: "
                         f"{', '.join(fsdp_methods())}. Under DDP every method works (gcomp.install on a "
                         "DistributedDataParallel model)")
    strategy.check(method)
