"""Methods made of methods: ``hierarchical`` (dense inside each node, another method between the nodes' leaders,
broadcast back) and ``auto`` (per bucket, the allowed method measured fastest on this link: docs/design.md §9)."""
from __future__ import annotations

import copy
import time
import warnings
from typing import Annotated

import torch
import torch.distributed as dist

from gcomp.auto.choice import PRESETS, SEPARATOR, AllowList, allowed_methods
from gcomp.auto.chooser import AutoChooser
from gcomp.collectives.launch import launched, then_on, when_done
from gcomp.core import HIERARCHICAL
from gcomp.method import Composite, MethodUnit
from gcomp.params import Range
from gcomp.pruning.masks import named_masks
from gcomp.registry import Nested, from_spec, register
from gcomp.state_checks import check_state
from gcomp.topology import Topology

INTER_KEYS = ("inter_bytes", "inter_bytes_dense")
AUTO_KEYS = ("auto_explore_steps", "auto_probes", "auto_switches", "auto_agree_s", "auto_predicted_s",
             "auto_measured_s")


class HierarchicalMethod(Composite):
    """On the wire, per bucket: a SUM all-reduce of the whole bucket on the node's group ``intra``; on its leader, the
    ``inner`` method's own ``reduce`` on the leaders' group ``inter`` (both waited for; ``inter_bytes`` beside a dense
    all-reduce's ``inter_bytes_dense``); then an asynchronous broadcast from the leader on ``intra``."""

    collective = HIERARCHICAL
    decodes_alone = False  # the inner method sees node sums, not each rank's payload

    def __init__(self, inner: MethodUnit, ranks_per_node: int, label: str = "hierarchical"):
        self.inner, self.ranks_per_node, self.label = inner, ranks_per_node, label
        self.name, self.params = label, {}
        self.intra = self.inter = None  # set by bind: this rank's node, the leaders (None on a follower)

    parts = property(lambda self: [self.inner])

    @property
    def stat_keys(self) -> tuple[str, ...]:
        return tuple(k for k in self.inner.stat_keys if k not in INTER_KEYS) + INTER_KEYS

    def bind(self, model, group, stats) -> None:
        world = dist.get_world_size(group)
        topology = Topology.regular(world, self.ranks_per_node) if self.ranks_per_node else Topology.discover(group)
        if len(topology.nodes) == 1:
            warnings.warn(f"{self.label}: all {world} ranks are on one node, so the inner method runs on a "
                          "one-rank group of leaders and compresses nothing; set ranks_per_node to split them, or "
                          f"install the inner method ({self.inner.name}) itself", UserWarning, stacklevel=3)
        self.intra, self.inter = topology.groups(group)
        if self.inter is not None:
            self.inner.bind(model, self.inter, stats)

    def reduce(self, buffer, bucket, group, stats):
        stats["bytes_sent"] += buffer.numel() * buffer.element_size()  # the whole bucket, inside the node
        dist.all_reduce(buffer, group=self.intra)
        if self.inter is not None:
            before = stats["bytes_sent"]
            buffer.copy_(self.inner.reduce(buffer, bucket, self.inter, stats).wait())
            stats["inter_bytes"] += stats["bytes_sent"] - before
            stats["inter_bytes_dense"] += buffer.numel() * buffer.element_size()
        source = dist.get_global_rank(self.intra, 0)
        return when_done(launched(dist.broadcast(buffer, src=source, group=self.intra, async_op=True)), buffer)

    def flush(self, bucket, like):
        return self.inner.flush(bucket, like) if self.inter is not None else None

    def __deepcopy__(self, memo):  # process groups are handles: a copy shares them, and copies the rest
        clone = memo[id(self)] = copy.copy(self)
        clone.__dict__.update({k: copy.deepcopy(v, memo) for k, v in vars(self).items() if k not in ("intra", "inter")})
        return clone

    def state_dict(self) -> dict:  # the inner method's, as it is
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.inner.load_state_dict(state)

    def parameter_state(self, state: dict) -> dict:
        return self.inner.parameter_state(state)

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        if self.keeps_state:
            raise ValueError(f"{self.label}: its inner method's state lives on the node leaders, which another number "
                             "of ranks regroups")
        return {}


class TeeStats(dict):
    """One bucket's counters from zero; every change is added to ``parent``'s too, so the hook's totals still count."""

    def __init__(self, parent: dict):
        super().__init__({key: value * 0 for key, value in parent.items()})
        self.parent = parent

    def __setitem__(self, key, value) -> None:
        delta = value - self.get(key, 0)
        super().__setitem__(key, value)
        if key in self.parent:
            self.parent[key] += delta


class AutoMethod(Composite):
    """Each bucket goes through one candidate's own ``reduce``: the bytes on the wire and the collective are that
    method's. Beside them, ``auto``'s own (``AutoChooser``): a MAX all-reduce of the measurements when it decides,
    of one float every ``probe_every`` steps, and the link probe (timed all-reduces)."""

    stateful = True  # measures on DDP's final buckets

    def __init__(self, specs: list[str], preset_pactrain: bool, probe_every: int, trials: int, margin: float,
                 reprobe_above: float):
        self.specs, self.methods = specs, [from_spec(spec) for spec in specs]
        self.preset_pactrain = preset_pactrain  # pactrain came with a preset: kept only on a pruned model
        self.chooser = AutoChooser(specs, probe_every, trials, margin, reprobe_above)
        self.choices, self.events = self.chooser.choices, self.chooser.events
        self.name, self.params, self.pruned_here, self._flag_sizes = "auto", {}, False, []

    parts = property(lambda self: self.methods)

    @property
    def stat_keys(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(k for m in self.methods for k in m.stat_keys)) + AUTO_KEYS

    def bind(self, model, group, stats) -> None:
        self.chooser.workers = dist.get_world_size(group)
        self.pruned_here = model is not None and bool(named_masks(model))
        for spec, m in zip(self.specs, self.methods):
            with warnings.catch_warnings():
                if spec == "pactrain" and self.preset_pactrain and not self.pruned_here:
                    warnings.simplefilter("ignore")  # the preset holds it for pruned models only: dropped below
                m.bind(model, group, stats)

    def install_flags(self) -> torch.Tensor:
        """Whether the model is pruned here, both signs (the MAX tells if all ranks agree), then each candidate's."""
        flags = [m.install_flags() for m in self.methods]
        self._flag_sizes = [0 if f is None else f.numel() for f in flags]
        pruned = int(self.pruned_here)
        return torch.cat([torch.tensor([pruned, -pruned])] + [f.to(torch.int64).cpu() for f in flags if f is not None])

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        if int(flags[0]) != -int(flags[1]):
            raise RuntimeError("auto: some ranks hold a pruned model and others do not; prune the model alike on "
                               "every rank before gcomp.install")
        for m, own in zip(self.methods, flags[2:].split(self._flag_sizes)):
            if own.numel():
                m.receive_install_flags(own)
        if self.preset_pactrain and not int(flags[0]):
            self.chooser.active = [i for i, spec in enumerate(self.specs) if spec != "pactrain"]

    def reduce(self, buffer, bucket, group, stats):
        chooser = self.chooser
        if bucket.index == 0:
            chooser.step_started(group, buffer.device, stats)
        record = chooser.record(bucket)
        index = chooser.candidate_for(record)
        if record.last not in (None, index):  # what the last method held back goes with this bucket
            held = self.methods[record.last].flush(bucket, buffer)
            if held is not None:
                buffer.add_(held.reshape(buffer.shape).to(buffer.dtype))
        record.last, own = index, TeeStats(stats)
        predicted = record.predicted.get(index) if record.chosen == index else None
        start = time.perf_counter()
        future = self.methods[index].reduce(buffer, bucket, group, own)
        chooser.after_bucket(bucket, group, buffer.device, stats)

        def measured(fut: torch.futures.Future) -> torch.Tensor:
            wall_s = time.perf_counter() - start
            record.observe(index, own, wall_s)
            if predicted is not None:
                stats["auto_predicted_s"] += predicted
                stats["auto_measured_s"] += wall_s
            return fut.value()

        return then_on(future, measured, buffer.device)

    def flush(self, bucket, like):
        record = self.chooser.records.get(bucket.key)
        return None if record is None or record.last is None else self.methods[record.last].flush(bucket, like)

    def state_dict(self) -> dict:  # every candidate's, by its spec; a resumed run measures again
        return {"candidates": {spec: m.state_dict() for spec, m in zip(self.specs, self.methods)}}

    def load_state_dict(self, state: dict) -> None:
        check_state(self.name, state, {"candidates": dict})
        check_state(self.name, state["candidates"], {spec: dict for spec in self.specs})
        for spec, m in zip(self.specs, self.methods):
            m.load_state_dict(state["candidates"][spec])
        self.chooser.restart()

    def parameter_state(self, state: dict) -> dict:
        return {f"{spec}/{slot}": tensors for spec, m in zip(self.specs, self.methods)
                for slot, tensors in m.parameter_state(state["candidates"][spec]).items()}

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        return {"candidates": {spec: m.merge_states([s["candidates"][spec] for s in assigned],
                                                    [s["candidates"][spec] for s in every], rank)
                               for spec, m in zip(self.specs, self.methods)}}


@register("hierarchical", paper="leader-follower reduction as in PruneX (Olama et al., arXiv 2512.14628)")
def hierarchical(
    inner: Annotated[str, Nested(), "method run between the nodes' leaders (not a hierarchical one)"] = "identity",
    ranks_per_node: Annotated[int, Range(0, None), "ranks per node; 0: from torchrun or host names"] = 0,
) -> HierarchicalMethod:
    """Dense SUM inside each node, the ``inner`` method (``"topk:ratio=0.05"``, or a ``Method`` from
    ``gcomp.create``) between node leaders only, then a broadcast inside each node: only leaders cross the
    (slow) network between nodes."""
    try:
        method = from_spec(inner)
    except ValueError as err:
        raise ValueError(f"hierarchical: parameter 'inner': {err}") from None
    if method.collective == HIERARCHICAL:
        raise ValueError(f"hierarchical: parameter 'inner' cannot be a hierarchical method itself; got {inner!r}")
    return HierarchicalMethod(method, ranks_per_node)


@register("auto", paper="gcomp's own: alpha-beta link probe and measured codec times, chosen per bucket")
def auto(
    allow: Annotated[str, AllowList(), "methods it may choose: 'exact' (identity, and pactrain on a pruned model), "
                                       "'half' (adds fp16, bf16), or a list of specs"] = "exact",
    probe_every: Annotated[int, Range(1, None), "steps between checks of the measured waits against the link"] = 10,
    trials: Annotated[int, Range(1, None), "buckets each candidate reduces per layout while measuring"] = 5,
    margin: Annotated[float, Range(0, 1, high_open=True), "how much faster another method must be predicted to "
                                                           "switch to it"] = 0.1,
    reprobe_above: Annotated[float, Range(0, None, low_open=True), "drift of the waits (relative) that triggers a "
                                                                    "new probe of the link"] = 2.0,
) -> AutoMethod:
    """The method chosen per bucket from the link and the codecs it measures, and changed when the link
    changes: every allowed method runs a few steps, timed, the link is probed, and each bucket takes the one
    predicted fastest; the waits are watched and the link probed again when they drift."""
    preset = allow in PRESETS  # a list was checked as the parameter was
    specs = allowed_methods(allow, pruned=True) if preset else allow.split(SEPARATOR)
    return AutoMethod(specs, preset, probe_every, trials, margin, reprobe_above)
