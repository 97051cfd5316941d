"""``FSDPState``: what gcomp keeps for a ``fully_shard``-ed model, a ``gcomp.run_state.RunState``."""
from __future__ import annotations

import torch
import torch.distributed as dist

from gcomp.collectives.reduce_scatter import KEYS as REDUCE_SCATTER_KEYS
from gcomp.method import Method
from gcomp.run_state import RunState
from gcomp.sharding import ShardLayout


class FSDPState(RunState):
    """The state of gcomp's reduce-scatter on every FSDP module of one ``fully_shard``-ed model (made by
    ``gcomp.install``): the method, statistics and checkpoints.

    What goes on the wire and which collective: the method's row strategy's docstring (``method.row_strategy``).
    ``stats`` has ``HookState``'s keys, read for FSDP: ``buckets`` counts reduce-scatter calls (one per FSDP module
    with gradients per step), ``bytes_dense`` the bytes of FSDP's own reduce-scatter input, ``bytes_sent`` the bytes
    this rank handed to collectives, ``warmup_steps`` and ``dense_buckets`` stay 0 (FSDP's layout is final from the
    first step); plus ``reduce_scatter_calls`` / ``reduce_scatter_bytes`` and the method's own counters.

    ``state_dict()`` is this rank's state filed under its rank (``gcomp.checkpoint``'s format, readable with
    ``torch.load(weights_only=True)``); per-parameter state (residuals) is keyed by ``"<parameter>[<shard>]"``.
    A gathered checkpoint resumes on another number of shards where the method's state is per parameter only
    (re-sharded, ``gcomp.sharding.resize``); elsewhere that is refused on every rank.
    """

    def __init__(self, method: Method, model: torch.nn.Module, group: dist.ProcessGroup, layouts: list[ShardLayout]):
        super().__init__(method, group, REDUCE_SCATTER_KEYS)
        self.model = model
        self._numels = {name: n for layout in layouts for name, n in zip(layout.pieces.names, layout.pieces.numels)}
        method.row_strategy.bind_sizes({n: size for layout in layouts for n, size in zip(layout.names, layout.sizes)})
        self._layouts: set[str] = set()
        self.comms: list = []  # the GcompReduceScatter of each FSDP module, set by install_fsdp
        self.replica = None  # HSDP's ReplicaState, set by gcomp.fsdp.replicate
        self.join(model)

    def divisor(self, op, group: dist.ProcessGroup, param_group) -> float | None:
        """What FSDP's reduce op divides the sum by: None for SUM, the group's size for AVG, FSDP's gradient divide
        factor for PREMUL_SUM (``set_gradient_divide_factor``)."""
        if op == dist.ReduceOp.SUM:
            return None
        if op == dist.ReduceOp.AVG:
            return float(dist.get_world_size(group))
        if op == dist.ReduceOp.PREMUL_SUM and getattr(param_group, "gradient_divide_factor", None):
            return float(param_group.gradient_divide_factor)
        raise ValueError(f"gcomp's FSDP reduce-scatter sums; FSDP asked for {op}, which it cannot serve")

    def reduce_scatter(self, layout: ShardLayout, output: torch.Tensor, input: torch.Tensor,
                       group: dist.ProcessGroup, divisor: float | None) -> None:
        """One FSDP module's reduce-scatter: the method's sum, divided as FSDP asked. A lossy method encodes the
        mean (divided first, as DDP's hook does: 16-bit sums do not overflow, residuals are in the mean's units); a
        lossless one divides after the sum, as FSDP itself does (bit for bit FSDP2's own on two ranks)."""
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
        self.method.reduce_scatter(output, input, layout, group, stats)
        if divisor is not None and not first:
            output.div_(divisor)
