"""``gcomp.install`` on a ``fully_shard``-ed model: one ``FSDPState``, a ``GcompReduceScatter`` on every FSDP module."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from gcomp.fsdp.state import FSDPState, GcompReduceScatter
from gcomp.method import MethodUnit
from gcomp.registry import available, spec
from gcomp.sharding import ShardLayout


def fsdp_methods() -> tuple[str, ...]:
    """The registered methods that serve FSDP2's reduce-scatter (``gcomp.available(fsdp=True)``)."""
    return tuple(available(fsdp=True))


def config_label(name: str, params: dict) -> str:
    """``name`` or ``name:key=value,...`` (``gcomp bench``'s method syntax, booleans lower-case)."""
    if not params:
        return name
    return name + ":" + ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in params.items())


def fsdp_configs() -> tuple[tuple[str, str, dict], ...]:
    """(label, method name, parameters) of every FSDP-capable method with its defaults, then with each variant."""
    return tuple((config_label(name, params), name, params) for name in fsdp_methods()
                 for params in ({}, *spec(name).variants))


def check_serves_fsdp(method: MethodUnit) -> None:
    """A ValueError naming the methods that serve FSDP2 when ``method`` does not; for a method that serves it with its
    defaults, the parameters given otherwise, with their help."""
    if method.serves_fsdp:
        return
    if method.name in fsdp_methods():
        found = spec(method.name).params
        changed = [f"{n}={v!r} ({found[n].help})" for n, v in method.params.items()
                   if n in found and v != found[n].default]
        raise ValueError(f"{method.name} under FSDP2 cannot take {', '.join(changed) or 'these parameters'}: it serves "
                         "FSDP2's reduce-scatter (fully_shard) with its default there; under DDP it takes any")
    raise ValueError(f"{method.name} cannot serve FSDP2's reduce-scatter (fully_shard); the methods that can: "
                     f"{', '.join(fsdp_methods())}. Under DDP every method works (gcomp.install on a "
                     "DistributedDataParallel model)")


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """The FSDP modules of the tree that hold parameters, in ``model.modules()`` order."""
    return [m for m in model.modules() if isinstance(m, FSDPModule) and m._get_fsdp_state()._fsdp_param_groups]


def check_not_served(model: torch.nn.Module, modules: list[FSDPModule]) -> None:
    """A RuntimeError when an FSDP module of ``model`` already reduces through a gcomp state (root, then child)."""
    names = {id(m): n for n, m in model.named_modules()}
    for module in modules:
        comm = getattr(module, "_gcomp_comm", None)
        if comm is None:
            continue
        owner = comm.state.model
        where = f"its FSDP module {names[id(module)]!r}" if names[id(module)] else "it"
        on = (f"on its submodule {names[id(owner)]!r}" if id(owner) in names else "on a module that contains it")
        raise RuntimeError(f"gcomp.install: a gcomp method ({comm.state.method.name}) is already installed on this "
                           f"fully_shard-ed model: {where} reduces through the state installed {on}. One state "
                           "serves one model (a second would take part of its reduce-scatters, statistics and "
                           "checkpoint): install once, on the root fully_shard-ed module, whose state covers every "
                           "FSDP module under it")


def install_fsdp(model: FSDPModule, method: MethodUnit, process_group: dist.ProcessGroup | None = None) -> FSDPState:
    """Put gcomp's reduce-scatter for ``method`` on every FSDP module of ``model`` (the root ``fully_shard``-ed
    module); returns the state. Refuses methods that cannot serve FSDP2, native HSDP, and a second install."""
    if getattr(model, "_gcomp_state", None) is not None:
        raise RuntimeError(f"a gcomp method ({model._gcomp_state.method.name}) is already installed on this "
                           "fully_shard-ed model")
    check_serves_fsdp(method)
    modules = fsdp_modules(model)
    if not modules:
        raise ValueError("gcomp.install: this fully_shard-ed model has no FSDP module holding parameters")
    check_not_served(model, modules)
    groups = []
    for module in modules:
        param_groups = module._get_fsdp_state()._fsdp_param_groups
        if len(param_groups) > 1:
            raise ValueError("gcomp.install: an FSDP module with several parameter groups (shard_placement_fn with "
                             "per-parameter meshes) takes no custom reduce-scatter (FSDP2's own limit)")
        if param_groups[0]._is_hsdp:
            raise ValueError("gcomp.install: native HSDP (fully_shard on a 2-D mesh) all-reduces across replicas "
                             "itself, which a gcomp method cannot replace; shard on mesh['shard'] only, install, then "
                             "gcomp.fsdp.replicate(state, mesh['replicate'].get_group(), name) (gcomp.fsdp.hsdp)")
        groups.append(param_groups[0].mesh_info.shard_process_group)
    group = groups[0]
    ranks = dist.get_process_group_ranks(group)
    if any(dist.get_process_group_ranks(g) != ranks for g in groups):
        raise ValueError("gcomp.install: the FSDP modules of this model shard over different process groups")
    if process_group is not None and sorted(dist.get_process_group_ranks(process_group)) != sorted(ranks):
        raise ValueError(f"gcomp.install: process_group has ranks {dist.get_process_group_ranks(process_group)}, "
                         f"the model's FSDP modules shard over {ranks}; pass process_group=None")
    names = {id(p): n for n, p in model.named_parameters()}
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    layouts = []
    for index, module in enumerate(modules):
        params = [p for p in module._get_fsdp_state()._fsdp_param_group.fsdp_params if p.sharded_param.requires_grad]
        layouts.append(ShardLayout(index, tuple(names[id(p.sharded_param)] for p in params),
                                   tuple(p.sharded_param.size() for p in params), world, rank, torch.float32))
    state = FSDPState(method, model, group, layouts)
    for index, module in enumerate(modules):
        comm = GcompReduceScatter(state, module, index, names)
        comm.static_layout = layouts[index]
        module.set_custom_reduce_scatter(comm)
        module._gcomp_comm = comm
        state.comms.append(comm)
    model._gcomp_state = state
    return state
