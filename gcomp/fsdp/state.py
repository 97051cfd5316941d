"""``FSDPState``, what gcomp keeps for a ``fully_shard``-ed model, and ``GcompReduceScatter``, the reduce-scatter
it puts on each FSDP module (``set_custom_reduce_scatter``)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from gcomp.collectives.reduce import REDUCE_SCATTER_KEYS
from gcomp.method import MethodUnit
from gcomp.run_state import RunState
from gcomp.sharding import ShardLayout


class FSDPState(RunState):
    """The state of gcomp's reduce-scatter on every FSDP module of one ``fully_shard``-ed model: on the wire, the
    method's rows (``Method.reduce`` with a ``ShardLayout``), over the shard group; per-parameter state is keyed
    ``"<parameter>[<shard>]"`` (``gcomp.sharding``)."""

    kind = "fsdp"

    def __init__(self, method: MethodUnit, model: torch.nn.Module, group: dist.ProcessGroup,
                 layouts: list[ShardLayout]):
        super().__init__(method, group, REDUCE_SCATTER_KEYS)
        self.model = model
        self._numels = {name: n for layout in layouts for name, n in zip(layout.pieces.names, layout.pieces.numels)}
        self.shard_sizes = {n: size for layout in layouts for n, size in zip(layout.names, layout.sizes)}
        self._layouts: set[str] = set()
        self.comms: list[GcompReduceScatter] = []  # one per FSDP module, set by install_fsdp
        self.replica = None  # HSDP's ReplicaState, set by gcomp.fsdp.replicate
        self.join(model)

    def divisor(self, op, group: dist.ProcessGroup, param_group) -> float | None:
        """What FSDP's reduce op divides the sum by: None (SUM), the group's size (AVG), or the divide factor
        (PREMUL_SUM, ``set_gradient_divide_factor``)."""
        if op == dist.ReduceOp.SUM:
            return None
        if op == dist.ReduceOp.AVG:
            return float(dist.get_world_size(group))
        if op == dist.ReduceOp.PREMUL_SUM and getattr(param_group, "gradient_divide_factor", None):
            return float(param_group.gradient_divide_factor)
        raise ValueError(f"gcomp's FSDP reduce-scatter sums; FSDP asked for {op}, which it cannot serve")

    def reduce_scatter(self, layout: ShardLayout, output: torch.Tensor, input: torch.Tensor,
                       group: dist.ProcessGroup, divisor: float | None) -> None:
        """One FSDP module's reduce-scatter, divided as FSDP asked: first for a lossy method (it encodes the mean,
        as under DDP), after the sum for a lossless one (as FSDP itself does)."""
        self.count_step_of_backward()
        stats = self.stats
        stats["buckets"] += 1
        stats["bytes_dense"] += input.numel() * input.element_size()
        if layout.pieces.key not in self._layouts:
            self._layouts.add(layout.pieces.key)
            stats["layouts"] += 1
        first = divisor is not None and not self.method.lossless
        if first:
            input.div_(divisor)
        output.copy_(self.method.reduce(input, layout, group, stats).wait().reshape(-1))
        if divisor is not None and not first:
            output.div_(divisor)


class GcompReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter for one FSDP module, served by the model's ``FSDPState``: synchronous (inside FSDP's
    reduce-scatter stream, the output is complete when the call returns)."""

    def __init__(self, state: FSDPState, module: torch.nn.Module, index: int, names: dict[int, str]):
        self.state, self.module, self.index, self._names = state, module, index, names
        self.layout: ShardLayout | None = None

    def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @property
    def param_group(self):
        return self.module._get_fsdp_state()._fsdp_param_group

    def layout_for(self, input: torch.Tensor, group: dist.ProcessGroup) -> ShardLayout:
        """The layout of this call's input: every parameter of the group that takes a gradient."""
        world = dist.get_world_size(group)
        layout = self.layout
        if layout is None or layout.world != world or layout.dtype != input.dtype:
            params = [p for p in self.param_group.fsdp_params if p.sharded_param.requires_grad]
            for p in params:
                if p.fsdp_placement.dim != 0:
                    name = self._names.get(id(p.sharded_param))
                    raise ValueError(f"gcomp under FSDP2 needs parameters sharded on dim 0; {name} is sharded on dim "
                                     f"{p.fsdp_placement.dim}")
            layout = self.layout = ShardLayout(self.index, tuple(self._names[id(p.sharded_param)] for p in params),
                                               tuple(p.sharded_param.size() for p in params), world,
                                               dist.get_rank(group), input.dtype)
        if layout.numel != input.numel():
            raise RuntimeError(f"gcomp (FSDP2): the reduce-scatter of FSDP module {self.index} got {input.numel()} "
                               f"entries, its parameters ({', '.join(layout.names)}) pad to {layout.numel}: some "
                               "parameter took no gradient this step. Call "
                               "model.set_reduce_scatter_unused_params(True) so that FSDP reduces a zero gradient for "
                               "it and the layout stays fixed")
        return layout

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op, async_op: bool = False):
        layout = self.layout_for(input_tensor, group)
        divisor = self.state.divisor(op, group, self.param_group)
        self.state.reduce_scatter(layout, output_tensor.view(-1), input_tensor.view(-1), group, divisor)
        if async_op:  # done already: a completed work
            future = torch.futures.Future()
            future.set_result([output_tensor])
            return torch._C._distributed_c10d._create_work_from_future(future)
        return None
