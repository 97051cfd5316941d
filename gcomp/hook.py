"""The one DDP communication hook, and the state it keeps.

No ``from __future__ import annotations`` here: DDP compares the hook's return annotation with
``torch.futures.Future[torch.Tensor]`` itself, and a string would not match.
"""
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from gcomp import checkpoint
from gcomp.bucket import BucketInfo
from gcomp.collectives.launch import settle, then_on
from gcomp.collectives.reduce import all_reduce_all
from gcomp.core import Payload
from gcomp.dense import STAT_KEYS as DENSE_KEYS, DenseRule, reduce_split, split_of
from gcomp.agreement import check_member, check_same_ranks
from gcomp.method import MethodUnit
from gcomp.resume_layouts import SavedLayouts, gather, scatter
from gcomp.run_state import RunState


class HookState(RunState):
    """What the DDP hook keeps between calls: the method, per-bucket layouts, ``stats`` (docs/statistics.md).

    Made by ``gcomp.comm_hook`` or ``gcomp.install``. Bound to a model (``bind``), parameters are known by their
    names: checkpoints are keyed by name, pruning masks are seen (``pactrain``, ``prunex``) and the warm-up follows
    a DDP model's options. Without one, a parameter is known by its place in the first step's buckets
    (``"bucket0.param3"``, the same in every run of the same model and DDP options) and ``pactrain`` sends dense.
    The state joins the process group at its first bucket (or ``state_dict``/``load_state_dict``): it exists by
    then, even where the state was made before it (Lightning's ``DDPStrategy``).
    """

    def __init__(self, method: MethodUnit, model: torch.nn.Module | None = None,
                 process_group: dist.ProcessGroup | None = None, dense: DenseRule | None = None):
        if dense is not None and model is None:
            raise ValueError(f"gcomp: dense= / dense_below= ({dense.describe()}) needs the model, whose parameter "
                             "names it selects: pass model=ddp_model to gcomp.comm_hook (or use gcomp.install)")
        super().__init__(method, process_group, DENSE_KEYS if dense is not None else ())
        self._dense_rule = dense
        self._splits: dict = {}  # layout key -> its gcomp.dense.Split, or None (no dense parameter in it)
        self.model: torch.nn.Module | None = None
        self._names: dict[int, str] = {}
        self._layouts: dict[tuple, BucketInfo] = {}
        self._ready = False  # bound to the process group
        self._stepped = False  # a whole step went through this state in this process
        self._unchecked: dict | None = None  # a loaded part whose parameters are checked once all are known
        self.warmup = 1 if method.stateful else 0  # DDP's default: buckets rebuilt after the first step
        self._settle_task = -1  # the backward pass (autograd graph task) whose end settles the collectives
        self._explicit_group = process_group is not None
        self._ddp_group = False  # the DDP model's own group once bound to one (None: the default group)
        self._resume = SavedLayouts()  # a loaded checkpoint's bucket layouts, for the first steps of a resumed run
        self._this_step: list[BucketInfo] = []  # the layouts reduced so far this step, then the last whole step's
        self._last_step: list[BucketInfo] = []
        self._first_layout = 1  # steps a DDP model takes on its first buckets (1: DDP's default)
        self._steps_here = 0  # steps taken in this process
        if model is not None:
            self.bind(model)
            if dist.is_initialized():
                self._ensure_ready()  # so the method's warnings (no masks, one node...) come at install

    def bind(self, model: torch.nn.Module) -> "HookState":
        """Know the parameters by their names in ``model`` (a DDP model, the module it wraps, or any module holding
        the same parameters, such as a LightningModule; a DDP model also sets the warm-up) before the first step."""
        if self._ready:
            raise RuntimeError("gcomp: bind the hook state to its model before the first step (the state is "
                               "already reducing buckets, known by their place)")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"gcomp: bind takes a torch.nn.Module; got {type(model).__name__}")
        if isinstance(model, DistributedDataParallel):
            self._first_layout = self._warmup_steps(model)
            if self.method.stateful:
                self.warmup = self._first_layout
            self.method.watch(model)
            self._ddp_group = model.process_group
            model = model.module
        self.model = model
        self._names = {id(p): n for n, p in model.named_parameters()}
        self._numels = {n: p.numel() for n, p in model.named_parameters()}
        if self._dense_rule is not None:
            trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]  # DDP's buckets hold these
            self.dense_names = frozenset(self._dense_rule.select(trained))
            self.stats["dense_params"] = len(self.dense_names)
        return self

    def _ensure_ready(self) -> None:
        """Join the process group (it exists by the first bucket): the method binds and agrees there."""
        if self._ready:
            return
        if not dist.is_initialized():
            raise RuntimeError("gcomp: the hook state needs torch.distributed's process group, which is not "
                               "initialized yet (init_process_group first)")
        if self._ddp_group is not False:
            check_same_ranks("gcomp.comm_hook", self.group, self._ddp_group)
        else:
            check_member(self.group, "gcomp.comm_hook")
            if self._explicit_group:
                warnings.warn("gcomp.comm_hook: the hook reduces over the process_group it was given, which it "
                              "cannot check against the DDP model's own group (it knows no DDP model); if they "
                              "differ, replicas drift apart. Pass model=ddp_model (or state.bind(ddp_model)) to have "
                              "it checked", UserWarning, stacklevel=4)
        if self.model is None and self.method.reads_model:
            warnings.warn(f"{self.method.name}: the hook state knows no model, so the method cannot see its "
                          "pruning masks and sends every bucket dense; pass model= to gcomp.comm_hook, or call "
                          "state.bind(model) before the first step", UserWarning, stacklevel=4)
        self.join(self.model)
        self._ready = True

    def _name_by_place(self, bucket) -> None:
        """Without a model, a parameter is named by where it is first seen: bucket and position."""
        fresh = [(i, p) for i, p in enumerate(bucket.parameters()) if id(p) not in self._names]
        if fresh and self._stepped:
            raise RuntimeError(f"gcomp: bucket {bucket.index()} holds {len(fresh)} parameter(s) this hook state "
                               "has not seen in its first step: one state serves one DDP model (make a "
                               "second with gcomp.comm_hook)")
        for i, p in fresh:
            name = f"bucket{bucket.index()}.param{i}"
            self._names[id(p)] = name
            self._numels[name] = p.numel()

    def _check_known(self, bucket) -> None:
        """Refuse a bucket holding parameters the bound model lacks (the state is registered on another model)."""
        unknown = sum(id(p) not in self._names for p in bucket.parameters())
        if unknown:
            raise ValueError(f"gcomp: bucket {bucket.index()} holds {unknown} parameter(s) that the model this hook "
                             f"state is bound to ({type(self.model).__name__}, {len(self._names)} parameters) does "
                             "not have: the state was bound to another model than the DDP model it is registered "
                             "on. One state serves one DDP model: bind it to that model (gcomp.comm_hook(..., "
                             "model=ddp_model), or state.bind(ddp_model) before the first step), or make a state "
                             "per model")

    @staticmethod
    def _warmup_steps(ddp: DistributedDataParallel) -> int:
        if getattr(ddp, "find_unused_parameters", False):
            return 0  # buckets are built by size from the start and never rebuilt
        return 2 if getattr(ddp, "static_graph", False) else 1

    @property
    def inter_node_ratio(self) -> float | None:
        """``inter_bytes_dense / inter_bytes`` on a node leader of ``hierarchical`` or ``prunex`` (1.0 before the first
        step); None for other methods."""
        if "inter_bytes_dense" not in self.stats:
            return None
        sent = self.stats["inter_bytes"]
        return self.stats["inter_bytes_dense"] / sent if sent else 1.0

    def bucket_info(self, bucket) -> BucketInfo:
        buffer = bucket.buffer()
        params = bucket.parameters()
        signature = (bucket.index(), buffer.numel(), buffer.dtype, tuple(map(id, params)))
        info = self._layouts.get(signature)
        if info is None:
            if self.model is None:
                self._name_by_place(bucket)  # after the first step: refuses parameters it never saw
            else:
                self._check_known(bucket)
            names = [self._names[id(p)] for p in params]
            info = BucketInfo.from_layout(bucket.index(), buffer.dtype, names, [p.numel() for p in params])
            self._layouts[signature] = info
            self.stats["layouts"] += 1  # counted on, so a resumed run continues the checkpoint's count
        return info

    def _reduce_as_saved(self, buffer: torch.Tensor, pieces: list, last: bool) -> torch.futures.Future:
        """The bucket cut into the saved run's layouts (``gcomp.resume_layouts``), each reduced on its own."""
        futures = []
        for i, (info, where) in enumerate(pieces):
            self._record(info, last=last and i == len(pieces) - 1)
            futures.append(self._reduce_layout(gather(buffer, where), info))
        self.stats["buckets"] += len(pieces) - 1  # as many reductions as the saved run made

        def assemble(done: torch.futures.Future) -> torch.Tensor:
            out = torch.empty_like(buffer)
            for (_, where), piece in zip(pieces, done.value()):
                scatter(out, piece.wait().reshape(-1), where)  # wait: on CUDA, after the piece's decode
            return out

        return then_on(torch.futures.collect_all(futures), assemble, buffer.device)

    def reduce(self, bucket) -> torch.futures.Future:
        """Average one bucket over the process group; returns a future of the mean gradient."""
        if not self._ready:
            self._ensure_ready()
        if self.model is None and not self._stepped:  # names by place come from the first step's buckets
            self._name_by_place(bucket)
        task = torch._C._current_graph_task_id()  # -1 outside a backward pass (a hook called by hand)
        if task != self._settle_task and task != -1:
            # the main thread goes on only once the backend's threads are done with this step's collectives
            # (gcomp.collectives.launch says why); outside a backward pass, the settling is left to exit
            torch.autograd.Variable._execution_engine.queue_callback(settle)
            self._settle_task = task
        warming_up = self.iteration < self.warmup
        if warming_up and self.model is not None:
            self._check_known(bucket)
        info = None if warming_up else self.bucket_info(bucket)  # may refuse the bucket: before anything changes
        buffer = bucket.buffer()
        buffer.mul_(1.0 / self.world_size)  # the same scaling DDP's own reducer applies
        stats = self.stats
        stats["buckets"] += 1
        stats["bytes_dense"] += buffer.numel() * buffer.element_size()
        last = bucket.is_last()
        pieces = None if warming_up or not self._resume.left else self._resume.pieces(info)
        if last:
            if self._unchecked is not None:  # every parameter has a name now
                part, self._unchecked = self._unchecked, None
                checkpoint.check_parameter_tensors(self.method, part, self._numels)
            self._stepped = True
            self._steps_here += 1
            self._resume.left = max(0, self._resume.left - 1)
            self.count_step()
            stats["warmup_steps"] += int(warming_up)
        if warming_up:
            stats["dense_buckets"] += 1
            stats["bytes_sent"] += buffer.numel() * buffer.element_size()
            return then_on(all_reduce_all(Payload([buffer]), self.group), lambda f: f.value()[0], buffer.device)
        if pieces is not None:
            return self._reduce_as_saved(buffer, pieces, last)
        self._record(info, last)
        return self._reduce_layout(buffer, info)

    def _record(self, info: BucketInfo, last: bool) -> None:
        """A bucket reduced with layout ``info``; ``last``: the step's last bucket (its layouts are saved)."""
        self._this_step.append(info)
        if last:
            self._last_step, self._this_step = self._this_step, []

    def _reduce_layout(self, buffer: torch.Tensor, info: BucketInfo) -> torch.futures.Future:
        """The method on the bucket; with dense parameters in it, on the rest beside their all-reduce."""
        if self._dense_rule is not None:
            if info.key not in self._splits:
                self._splits[info.key] = split_of(info, self.dense_names, buffer.device)
            split = self._splits[info.key]
            if split is not None:
                return reduce_split(buffer, split, lambda flat, sub: self.method.reduce(flat, sub, self.group,
                                                                                         self.stats),
                                    self.group, self.stats)
        return self.method.reduce(buffer, info, self.group, self.stats)

    def _own_extras(self) -> dict:
        """The last step's bucket layouts, so a resumed run reduces its first buckets as they were."""
        layouts = self._resume.state(self._last_step)
        return {"layouts": layouts} if layouts else {}

    def _check_parameters(self, part: dict) -> None:
        """Take up the loaded layouts; check the per-parameter tensors now, or, without a model before the first
        step, at that step's end (when the parameters have names)."""
        layouts = SavedLayouts.check(part["layouts"]) if "layouts" in part else []
        # for the steps this process's DDP model takes on its first buckets (none once it took them)
        self._resume.load(layouts, max(0, self._first_layout - self._steps_here))
        self._this_step, self._last_step = [], []
        if self.model is None and not self._stepped:
            self._unchecked = part
        else:
            checkpoint.check_parameter_tensors(self.method, part, self._numels)


def gcomp_hook(state: HookState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP communication hook every gcomp method runs through."""
    return state.reduce(bucket)
