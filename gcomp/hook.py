"""The one DDP communication hook, and the state it keeps.

No ``from __future__ import annotations`` here: DDP compares the hook's return annotation with
``torch.futures.Future[torch.Tensor]`` itself, and a string would not match.
"""
from typing import Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gcomp import checkpoint
from gcomp.bucket import BucketInfo
from gcomp.collectives import futures
from gcomp.collectives.allreduce import all_reduce_all
from gcomp.core import Method, Payload
from gcomp.registry import create

STATE_FORMAT = checkpoint.STATE_FORMAT
_STAT_KEYS = ("steps", "buckets", "bytes_sent", "bytes_dense", "encode_s", "decode_s",
              "warmup_steps", "dense_buckets", "layouts")


class HookState:
    """Everything the hook keeps between calls: the method, per-bucket layouts, statistics.

    ``stats`` (a plain dict, summed over steps and buckets, this rank only):

    - ``steps``: optimizer steps seen (DDP iterations whose last bucket went through the hook);
    - ``buckets``: bucket reductions;
    - ``bytes_sent``: payload bytes this rank handed to collectives, all rounds, all buckets;
    - ``bytes_dense``: bytes a plain fp32 all-reduce of the same buckets would have handed over;
    - ``encode_s`` / ``decode_s``: host seconds spent compressing (with error feedback) and decoding;
    - ``warmup_steps``: steps sent as a plain all-reduce because DDP's buckets were not final yet
      (stateful methods only; DDP rebuilds its buckets after step 0, after step 1 with ``static_graph``);
    - ``dense_buckets``: bucket reductions sent as plain all-reduce for that reason;
    - ``layouts``: distinct bucket layouts seen (a rebuild shows up here).

    A method may add counters of its own (its compressor's and communicator's ``stat_keys``: ``pactrain``
    counts its mask tracker's switches, ``threshold`` its padding).
    """

    def __init__(self, method: Method, ddp: DistributedDataParallel, group: dist.ProcessGroup | None):
        self.method = method
        self.group = group
        self.world_size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self._names = {id(p): n for n, p in ddp.module.named_parameters()}
        self._numels = {n: p.numel() for n, p in ddp.module.named_parameters()}
        self._layouts: dict[tuple, BucketInfo] = {}
        self.iteration = 0  # steps taken, a resumed checkpoint's included
        self.warmup = self._warmup_steps(ddp) if method.stateful else 0
        self._stat_keys = _STAT_KEYS + method.stat_keys
        self.stats: dict[str, Union[int, float]] = {k: 0.0 if k.endswith("_s") else 0 for k in self._stat_keys}
        method.compressor.bind(ddp.module, group, self.stats)
        self._settle_task = -1  # the backward pass (autograd graph task) whose end settles the collectives

    @staticmethod
    def _warmup_steps(ddp: DistributedDataParallel) -> int:
        if getattr(ddp, "find_unused_parameters", False):
            return 0  # buckets are built by size from the start and never rebuilt
        return 2 if getattr(ddp, "static_graph", False) else 1

    @property
    def compression_ratio(self) -> float:
        """``bytes_dense / bytes_sent`` so far (1.0 before the first step)."""
        return self.stats["bytes_dense"] / self.stats["bytes_sent"] if self.stats["bytes_sent"] else 1.0

    def bucket_info(self, bucket) -> BucketInfo:
        buffer = bucket.buffer()
        params = bucket.parameters()
        signature = (bucket.index(), buffer.numel(), buffer.dtype, tuple(map(id, params)))
        info = self._layouts.get(signature)
        if info is None:
            names = [self._names.get(id(p), f"<unnamed {i}>") for i, p in enumerate(params)]
            info = BucketInfo.from_layout(bucket.index(), buffer.dtype, names, [p.numel() for p in params])
            self._layouts[signature] = info
            self.stats["layouts"] += 1  # counted on, so a resumed run continues the checkpoint's count
        return info

    def reduce(self, bucket) -> torch.futures.Future:
        """Average one bucket over the process group; returns a future of the mean gradient."""
        task = torch._C._current_graph_task_id()  # -1 outside a backward pass (a hook called by hand)
        if task != self._settle_task and task != -1:
            # the main thread goes on only once the backend's threads are done with this step's collectives
            # (gcomp.collectives.futures says why); outside a backward pass, the settling is left to exit
            torch.autograd.Variable._execution_engine.queue_callback(futures.settle)
            self._settle_task = task
        buffer = bucket.buffer()
        buffer.mul_(1.0 / self.world_size)  # the same scaling DDP's own reducer applies
        stats = self.stats
        stats["buckets"] += 1
        stats["bytes_dense"] += buffer.numel() * 4
        warming_up = self.iteration < self.warmup
        if bucket.is_last():
            self.iteration += 1
            stats["steps"] += 1
            stats["warmup_steps"] += int(warming_up)
        if warming_up:
            stats["dense_buckets"] += 1
            stats["bytes_sent"] += buffer.numel() * buffer.element_size()
            return all_reduce_all(Payload([buffer]), self.group).then(lambda f: f.value()[0])

        return self.method.reduce(buffer, self.bucket_info(bucket), self.group, stats)

    def state_dict(self) -> dict:
        """This rank's state, filed under its rank (``gcomp.checkpoint``): tensors, bytes and plain values only,
        so ``torch.load(path, weights_only=True)`` reads it back. ``gather_state_dict`` holds every rank's."""
        part = {"stats": dict(self.stats), "memory": self.method.memory.state_dict(),
                "compressor": self.method.compressor.state_dict()}
        return {"format": checkpoint.STATE_FORMAT, "method": self.method.name, "params": dict(self.method.params),
                "world_size": self.world_size, "iteration": self.iteration,
                "ranks": {checkpoint.rank_key(self.rank): checkpoint.pack(part)}}

    def gather_state_dict(self, dst: int | None = None) -> dict | None:
        """Every rank's state in one object (a collective: call it on every rank). With ``dst`` set, only that
        rank (of the hook's group) receives it and the others get None; by default every rank does. Save it on
        one rank; ``load_state_dict`` of it on every rank hands each rank its own part."""
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
        """Resume from ``state_dict()`` or ``gather_state_dict()``: this rank's own part, checked before anything
        is loaded (a bad state is a ValueError naming the key). Another rank's part is refused unless the
        method's state is the same on every rank; a checkpoint of another world size needs every rank's part,
        and a method that can move its state (residuals are summed, so their total is kept)."""
        if isinstance(state, dict) and state.get("format") == checkpoint.LEGACY_FORMAT:
            state = checkpoint.from_legacy(state, self.rank, self.world_size)
        checkpoint.check_header(state, self.method)
        part = checkpoint.own_part(state, self.method, self.rank, self.world_size)
        checkpoint.check_stats(part["stats"])
        checkpoint.check_parameter_tensors(self.method, part, self._numels)
        self.method.memory.load_state_dict(part["memory"])
        self.method.compressor.load_state_dict(part["compressor"])
        # Counting on from the checkpoint's step means a resumed run does not warm up again: residuals are
        # stored per parameter and map onto the new DDP's buckets, whatever their layout.
        self.iteration = state["iteration"]
        self.stats.update({k: part["stats"].get(k, 0) for k in self._stat_keys})  # in place: parts hold it


def gcomp_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook every gcomp method runs through."""
    return state.reduce(bucket)


def install(ddp_model: DistributedDataParallel, name_or_method: Union[str, Method],
            process_group: dist.ProcessGroup | None = None, **params) -> HookState:
    """Register gcomp's communication hook on a DDP model and return its state.

    ``name_or_method`` is a registered name (``params`` go to ``gcomp.create``) or a ``Method`` built by hand.
    Collectives run on ``process_group``, by default the DDP model's own.
    """
    inner = getattr(ddp_model, "_orig_mod", None)  # torch.compile's OptimizedModule wraps the DDP model
    if isinstance(inner, DistributedDataParallel):
        ddp_model = inner  # the hook lives on DDP's reducer, which the compiled module runs as it is
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(f"gcomp.install needs a torch.nn.parallel.DistributedDataParallel model; got "
                        f"{type(ddp_model).__name__}. Wrap it first: DistributedDataParallel(model)")
    if getattr(ddp_model, "_gcomp_state", None) is not None:
        raise RuntimeError(f"a gcomp hook ({ddp_model._gcomp_state.method.name}) is already installed on this "
                           "model; DDP takes one communication hook per model: build a new DDP model to change it")
    if isinstance(name_or_method, str):
        method = create(name_or_method, **params)
    elif isinstance(name_or_method, Method):
        if params:
            raise ValueError(f"parameters {sorted(params)} were given with an already created Method; "
                             "pass them to gcomp.create instead")
        method = name_or_method
    else:
        raise TypeError(f"name_or_method must be a method name or a gcomp.Method; got {type(name_or_method).__name__}")
    if process_group is None:
        process_group = ddp_model.process_group
    else:
        _check_same_ranks(process_group, ddp_model.process_group)
    state = HookState(method, ddp_model, process_group)
    try:
        ddp_model.register_comm_hook(state, gcomp_hook)
    except RuntimeError as err:
        raise RuntimeError("this DDP model already has a communication hook (DDP takes one per model, and its "
                           f"mixed_precision option registers its own): {err}") from err
    ddp_model._gcomp_state = state
    return state


def _check_same_ranks(hook_group, ddp_group) -> None:
    """The hook must reduce over exactly the ranks DDP reduces over: over fewer or others, replicas diverge."""
    ddp_ranks = dist.get_process_group_ranks(ddp_group)
    if hook_group == dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(hook_group) < 0:
        raise ValueError(f"gcomp.install: this rank (global rank {dist.get_rank()}) is not in process_group, "
                         f"while the DDP model's group has {len(ddp_ranks)} ranks; pass process_group=None to "
                         "reduce over the DDP model's own group")
    hook_ranks = dist.get_process_group_ranks(hook_group)
    if sorted(hook_ranks) != sorted(ddp_ranks):
        raise ValueError(f"gcomp.install: process_group has {len(hook_ranks)} ranks {hook_ranks} but the DDP model's "
                         f"group has {len(ddp_ranks)} {ddp_ranks}; the hook must reduce over the same ranks as DDP "
                         "(pass process_group=None, or build DDP with process_group=...)")
