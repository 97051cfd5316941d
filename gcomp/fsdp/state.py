"""``FSDPState``: what gcomp keeps for a ``fully_shard``-ed model, its statistics and its checkpoints."""
from __future__ import annotations

from typing import Union

import torch
import torch.distributed as dist

from gcomp import checkpoint
from gcomp.collectives.allreduce import all_reduce_all
from gcomp.collectives.reduce_scatter import KEYS as REDUCE_SCATTER_KEYS
from gcomp.core import MAX, Method, Payload
from gcomp.fsdp.codec import ShardedCodec
from gcomp.fsdp.layout import ShardLayout
from gcomp.hook import _STAT_KEYS


class SavedState:
    """Checkpoints in ``HookState``'s format (``gcomp.checkpoint``) for a state with ``method``, ``rank``,
    ``world_size``, ``group``, ``iteration``, ``stats``, ``_stat_keys`` and ``_numels`` (per-parameter names)."""

    def state_dict(self) -> dict:
        """This rank's state, filed under its rank (``gcomp.checkpoint``); ``gather_state_dict`` holds every rank's."""
        part = {"stats": dict(self.stats), "memory": self.method.memory.state_dict(),
                "compressor": self.method.compressor.state_dict()}
        return {"format": checkpoint.STATE_FORMAT, "method": self.method.name, "params": dict(self.method.params),
                "world_size": self.world_size, "iteration": self.iteration,
                "ranks": {checkpoint.rank_key(self.rank): checkpoint.pack(part)}}

    def gather_state_dict(self) -> dict:
        """Every rank's state in one object (a collective: call it on every rank)."""
        state = self.state_dict()
        parts = [None] * self.world_size
        dist.all_gather_object(parts, state["ranks"][checkpoint.rank_key(self.rank)], group=self.group)
        state["ranks"] = {checkpoint.rank_key(r): b for r, b in enumerate(parts)}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` or ``gather_state_dict()``: this rank's own part, checked before anything is
        loaded (``HookState.load_state_dict``'s rules; a ValueError names the key)."""
        checkpoint.check_header(state, self.method)
        part = checkpoint.own_part(state, self.method, self.rank, self.world_size)
        checkpoint.check_stats(part["stats"])
        checkpoint.check_parameter_tensors(self.method, part, self._numels)
        self.method.memory.load_state_dict(part["memory"])
        self.method.compressor.load_state_dict(part["compressor"])
        self.iteration = state["iteration"]
        self.stats.update({k: part["stats"].get(k, 0) for k in self._stat_keys})


class FSDPState(SavedState):
    """The state of gcomp's reduce-scatter on every FSDP module of one ``fully_shard``-ed model (made by
    ``gcomp.install``): the method, its FSDP codec (``gcomp.fsdp.codec``), statistics and checkpoints.

    What goes on the wire and which collective: the codec's docstring (``state.codec``). ``stats`` has
    ``HookState``'s keys, read for FSDP: ``buckets`` counts reduce-scatter calls (one per FSDP module with
    gradients per step), ``bytes_dense`` the bytes of FSDP's own reduce-scatter input, ``bytes_sent`` the bytes this
    rank handed to collectives, ``warmup_steps`` and ``dense_buckets`` stay 0 (FSDP's layout is final from the first
    step); plus ``reduce_scatter_calls`` / ``reduce_scatter_bytes`` and the method's own counters.

    ``state_dict()`` is this rank's state filed under its rank (``gcomp.checkpoint``'s format, readable with
    ``torch.load(weights_only=True)``); per-parameter state (residuals) is keyed by ``"<parameter>[<shard>]"``.
    """

    def __init__(self, method: Method, codec: ShardedCodec, model: torch.nn.Module, group: dist.ProcessGroup,
                 layouts: list[ShardLayout]):
        self.method, self.codec, self.model, self.group = method, codec, model, group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.iteration = 0
        self._stat_keys = _STAT_KEYS + REDUCE_SCATTER_KEYS + method.stat_keys
        self.stats: dict[str, Union[int, float]] = {k: 0.0 if k.endswith("_s") else 0 for k in self._stat_keys}
        self._numels = {name: n for layout in layouts for name, n in zip(layout.pieces.names, layout.pieces.numels)}
        self._layouts: set[str] = set()
        self._task = None
        codec.bind(model, group, self.stats)
        self._agree_at_install()

    def _agree_at_install(self) -> None:
        """The codec's one collective at install (pactrain's digest of the masks), run here, as ``HookState`` does."""
        flags = self.codec.install_flags()
        if flags is None:
            return
        if dist.get_backend(self.group) == "nccl":
            flags = flags.to(torch.device("cuda", torch.cuda.current_device()))
        all_reduce_all(Payload([flags], ops=(MAX,)), self.group).wait()
        self.codec.receive_install_flags(flags.cpu())

    @property
    def compression_ratio(self) -> float:
        """``bytes_dense / bytes_sent`` so far (1.0 before the first step)."""
        return self.stats["bytes_dense"] / self.stats["bytes_sent"] if self.stats["bytes_sent"] else 1.0

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
        """One FSDP module's reduce-scatter: the codec's sum, divided as FSDP asked."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task != self._task:  # one backward pass is one step (outside one, every call is)
            self._task = task
            self.iteration += 1
            self.stats["steps"] += 1
        stats = self.stats
        stats["buckets"] += 1
        stats["bytes_dense"] += input.numel() * input.element_size()
        if layout.pieces.key not in self._layouts:
            self._layouts.add(layout.pieces.key)
            stats["layouts"] += 1
        if divisor is not None and self.codec.prescale:
            input.div_(divisor)
        self.codec.reduce_scatter(output, input, layout, group, stats)
        if divisor is not None and not self.codec.prescale:
            output.div_(divisor)
