"""``RunState``: what every gcomp state keeps (the method, statistics, step count, install-time agreement and
checkpoints); ``HookState``, ``FSDPState``, ``ReplicaState`` and ``DiLoCo`` add only how their calls arrive."""
from __future__ import annotations

import warnings
from typing import Union

import torch
import torch.distributed as dist

from gcomp import checkpoint
from gcomp.agreement import agree, collective_device, global_ranks
from gcomp.collectives.launch import COUNTER_KEYS
from gcomp.method import MethodUnit

STAT_KEYS = ("steps", "buckets", "bytes_sent", "bytes_dense", "encode_s", "decode_s",
             "warmup_steps", "dense_buckets", "layouts", *COUNTER_KEYS)


FIXES = {
    "method": "Install the same method with the same parameters on every rank (a spec read from a per-rank "
              "config or environment variable is the usual cause)",
    "state": "Install gcomp the same way on every rank (DDP hook, FSDP2 or HSDP replica)",
    "process group": "Every rank must reduce over the same process group",
    "parameters": "Every rank must bind the same model (same parameter names and shapes)",
    "checkpoint": "Load the same checkpoint on every rank",
    "load": "The checkpoint is refused on every rank, so none goes on from a different state",
    "dense parameters": "Pass the same dense= and dense_below= on every rank (gcomp.install, gcomp.comm_hook)",
}


def method_spec(method: MethodUnit) -> str:
    """A method's canonical spec: its name and every parameter, sorted, and the class that runs it."""
    params = ",".join(f"{k}={v!r}" for k, v in sorted(method.params.items()))
    return f"{method.name}:{params} ({type(method).__qualname__})"


class RunState:
    """The method, its ``stats`` (docs/statistics.md), ``iteration`` (steps taken, a resumed checkpoint's
    included) and checkpoints in ``gcomp.checkpoint``'s format.

    A subclass calls ``join(model)`` once the process group exists and counts steps with ``count_step`` (or
    ``count_step_of_backward``); ``_numels`` maps each parameter name of the per-parameter state to its number of
    entries (checked at load); ``kind`` names the state in its checkpoint format.
    """

    kind = "ddp"

    def __init__(self, method: MethodUnit, group: dist.ProcessGroup | None, extra_keys: tuple[str, ...] = ()):
        self.method = method
        self.group = group
        self.world_size: int | None = None
        self.rank: int | None = None
        self.iteration = 0
        keys = STAT_KEYS + tuple(k for k in extra_keys if k not in STAT_KEYS)
        self._stat_keys = keys + tuple(k for k in method.stat_keys if k not in keys)
        self.stats: dict[str, Union[int, float]] = {k: 0.0 if k.endswith("_s") else 0 for k in self._stat_keys}
        self._numels: dict[str, int] = {}
        self.dense_names: frozenset[str] = frozenset()  # parameters kept uncompressed (gcomp.dense)
        self._backward = None  # the backward pass (autograd graph task) of the step being counted

    # --- joining the process group ----------------------------------------------------------------------------

    def join(self, model: torch.nn.Module | None) -> None:
        """Check that every rank runs the same thing (``gcomp.agreement`` of ``agreement_fields``), bind the method,
        and run its install-time agreement: a MAX all-reduce of ``method.install_flags()`` (a method never calls a
        collective itself)."""
        self.world_size, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        agree(f"gcomp ({type(self).__name__} of {self.method.name})", self.agreement_fields(model), self.group,
              FIXES)
        self.method.bind(model, self.group, self.stats)
        flags = self.method.install_flags()
        if flags is None:
            return
        flags = flags.to(collective_device(self.group))
        dist.all_reduce(flags, dist.ReduceOp.MAX, group=self.group)
        self.method.receive_install_flags(flags.cpu())

    def agreement_fields(self, model: torch.nn.Module | None) -> dict[str, str]:
        """What every rank must hold alike before a gradient moves: the method's spec (defaults included), the kind
        of state, the group's ranks, the model's parameter names and shapes, and the parameters kept dense."""
        fields = {"method": method_spec(self.method), "state": type(self).__name__,
                  "process group": " ".join(map(str, global_ranks(self.group)))}
        if model is not None:
            fields["parameters"] = "\n".join(f"{n} {tuple(p.shape)}" for n, p in model.named_parameters())
        fields["dense parameters"] = "\n".join(sorted(self.dense_names)) or "none (no dense=)"
        return fields

    def _ensure_ready(self) -> None:
        """Join the process group before a checkpoint is taken or loaded (the DDP hook joins lazily)."""

    # --- steps --------------------------------------------------------------------------------------------------

    def count_step(self) -> None:
        self.iteration += 1
        self.stats["steps"] += 1

    def count_step_of_backward(self) -> None:
        """Count a step at the first call of each backward pass (outside one, at every call): FSDP's and HSDP's
        hooks do not say which call is a step's last."""
        task = torch._C._current_graph_task_id()
        if task == -1 or task != self._backward:
            self._backward = task
            self.count_step()

    @property
    def compression_ratio(self) -> float:
        """``bytes_dense / bytes_sent`` so far (1.0 before the first step)."""
        return self.stats["bytes_dense"] / self.stats["bytes_sent"] if self.stats["bytes_sent"] else 1.0

    # --- checkpoints --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        """This rank's state, filed under its rank (``gcomp.checkpoint``); ``weights_only=True`` loads read it."""
        self._ensure_ready()
        part = {"stats": dict(self.stats), "method": self.method.state_dict(), **self._own_extras()}
        return {"format": checkpoint.state_format(self.kind), "method": self.method.name,
                "params": dict(self.method.params), "world_size": self.world_size, "iteration": self.iteration,
                "ranks": {checkpoint.rank_key(self.rank): checkpoint.pack(part)}}

    def gather_state_dict(self, dst: int | None = None) -> dict | None:
        """Every rank's state in one object (a collective): on every rank, or with ``dst`` only on that rank of the
        group (None elsewhere)."""
        state = self.state_dict()
        blob = state["ranks"][checkpoint.rank_key(self.rank)]
        if dst is None:
            parts = [None] * self.world_size
            dist.all_gather_object(parts, blob, group=self.group)
        else:
            parts = [None] * self.world_size if self.rank == dst else None
            dist.gather_object(blob, parts, dst=dist.get_global_rank(self.group, dst) if self.group else dst,
                               group=self.group)
            if self.rank != dst:
                return None
        state["ranks"] = {checkpoint.rank_key(r): b for r, b in enumerate(parts)}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Resume from ``state_dict()`` or ``gather_state_dict()``: this rank's own part, checked before anything is
        loaded; every rank loads, or every rank raises (docs/checkpoints-and-faults.md)."""
        self._ensure_ready()
        error, header = None, "unreadable"
        try:
            state = checkpoint.upgrade(state, self.method, self.rank, self.world_size, self.kind)
            if isinstance(state, dict):
                header = (f"{state.get('method')}({state.get('params')}) saved at world size "
                          f"{state.get('world_size')}, step {state.get('iteration')}")
            checkpoint.check_header(state, self.method, self.kind)
            part = checkpoint.own_part(state, self.method, self.rank, self.world_size,
                                      getattr(self, "shard_sizes", None))
            checkpoint.check_stats(part["stats"])
            self._check_parameters(part)
            self.method.load_state_dict(part["method"])
            self._warn_unused_dense(part)
            self.iteration = state["iteration"]
            self.stats.update({k: part["stats"].get(k, 0) for k in self._stat_keys})  # in place: methods hold it
            if "dense_params" in self.stats:  # this run's rule (gcomp.dense), not the checkpoint's count
                self.stats["dense_params"] = len(self.dense_names)
        except Exception as err:  # noqa: BLE001 -- every rank must hear of it before any raises
            error = err
        try:  # one all-gather: every rank loaded the same checkpoint, and every rank's load went through
            agree("gcomp checkpoint", {"checkpoint": header, "load": "loaded" if error is None else
                                       f"refused: {type(error).__name__}: {error}"}, self.group, FIXES)
        except ValueError as disagreement:
            if error is not None:
                raise error from None
            raise disagreement from None
        if error is not None:
            raise error

    def _own_extras(self) -> dict:
        """What a subclass adds to this rank's part of a checkpoint."""
        return {}

    def _warn_unused_dense(self, part: dict) -> None:
        """Warn once of a checkpoint's per-parameter state for parameters this run keeps dense."""
        if not self.dense_names:
            return
        saved = {name for tensors in self.method.parameter_state(part["method"]).values() for name in tensors}
        unused = sorted(saved & self.dense_names)
        if unused:
            warnings.warn(f"gcomp checkpoint: the state saved for {len(unused)} parameter(s) this run keeps dense "
                          f"({', '.join(unused[:4])}{', ...' if len(unused) > 4 else ''}) is not used: dense= "
                          "all-reduces them as they are, and what their residuals held back is dropped",
                          UserWarning, stacklevel=3)

    def _check_parameters(self, part: dict) -> None:
        """The per-parameter tensors of a loaded part, against ``_numels`` (``HookState`` may defer it)."""
        checkpoint.check_parameter_tensors(self.method, part, self._numels)
