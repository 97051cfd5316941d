"""``GcompReduceScatter``: the ``ReduceScatter`` gcomp installs on each FSDP module (``set_custom_reduce_scatter``)."""
from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from gcomp.sharding import ShardLayout


class GcompReduceScatter(ReduceScatter):
    """FSDP2's reduce-scatter for one FSDP module, served by the model's ``FSDPState`` (its method's row strategy
    says what goes on the wire and by which collective).

    FSDP calls it with its flat, shard-major reduce-scatter input, the output shard to fill, the shard group and
    its reduce op (AVG, PREMUL_SUM by its divide factor, or SUM), synchronously (``async_op=False``) inside its
    reduce-scatter stream: the output is complete when the call returns. Buffers are plain ``torch.empty``.
    """

    def __init__(self, state, module: torch.nn.Module, index: int, names: dict[int, str]):
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
                    raise ValueError(f"gcomp under FSDP2 needs parameters sharded on dim 0; "
                                     f"{self._names.get(id(p.sharded_param))} is sharded on dim {p.fsdp_placement.dim}")
            layout = self.layout = ShardLayout(self.index, tuple(self._names[id(p.sharded_param)] for p in params),
                                               tuple(p.sharded_param.size() for p in params), world,
                                               dist.get_rank(group), input.dtype)
        if layout.numel != input.numel():
            raise RuntimeError(f"gcomp (FSDP2): the reduce-scatter of FSDP module {self.index} got {input.numel()} "
                               f"entries, its parameters ({', '.join(layout.names)}) pad to {layout.numel}: some "
                               "parameter took no gradient this step. Call model.set_reduce_scatter_unused_params(True) "
                               "so that FSDP reduces a zero gradient for it and the layout stays fixed")
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
