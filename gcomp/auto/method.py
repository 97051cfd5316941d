"""``AutoMethod``: a composite of the allowed methods; each bucket goes through the one its ``AutoChooser`` picked
for the bucket's layout (``gcomp.auto.chooser`` says how), and what one method held back goes to the next at a
switch."""
from __future__ import annotations

import time
import warnings

import torch
import torch.distributed as dist

from gcomp.auto.chooser import AutoChooser
from gcomp.auto.tee import TeeStats
from gcomp.bucket import BucketInfo
from gcomp.collectives.launch import then_on
from gcomp.method import Composite, MethodUnit
from gcomp.pruning.masks import named_masks
from gcomp.registry import from_spec
from gcomp.state_checks import check_state

STAT_KEYS = ("auto_explore_steps", "auto_probes", "auto_switches", "auto_agree_s", "auto_predicted_s",
             "auto_measured_s")


class AutoMethod(Composite):
    """``auto``: each bucket goes through one of the allowed methods, its own ``reduce``: the bytes on the wire and
    the collective are that method's. Beside them, ``auto``'s own collectives (``AutoChooser``): a MAX all-reduce of
    the measurements when it decides, one float every ``probe_every`` steps, and the link probe.

    ``specs`` and ``methods``: the candidates, in tie-breaking order; ``chooser``: what was measured and chosen
    (``choices()`` and ``events`` read it)."""

    stateful = True  # measures on DDP's final buckets

    def __init__(self, specs: list[str], preset_pactrain: bool, probe_every: int, trials: int, margin: float,
                 reprobe_above: float):
        self.specs = specs
        self.methods: list[MethodUnit] = [from_spec(spec) for spec in specs]
        self.preset_pactrain = preset_pactrain  # pactrain came with a preset: kept only on a pruned model
        self.chooser = AutoChooser(specs, probe_every, trials, margin, reprobe_above)
        self.name, self.params = "auto", {}
        self._flag_sizes: list[int] = []
        self.pruned_here = False

    @property
    def parts(self) -> list[MethodUnit]:
        return self.methods

    @property
    def stat_keys(self) -> tuple[str, ...]:
        keys: list[str] = []
        for m in self.methods:
            keys += [k for k in m.stat_keys if k not in keys]
        return tuple(keys) + STAT_KEYS

    # --- binding ---------------------------------------------------------------------------------------------

    def bind(self, model, group, stats) -> None:
        self.chooser.workers = dist.get_world_size(group)
        self.pruned_here = model is not None and bool(named_masks(model))
        for spec, m in zip(self.specs, self.methods):
            with warnings.catch_warnings():
                if spec == "pactrain" and self.preset_pactrain and not self.pruned_here:
                    warnings.simplefilter("ignore")  # the preset holds it for pruned models only: dropped below
                m.bind(model, group, stats)

    def install_flags(self) -> torch.Tensor:
        """Whether the model is pruned here (both signs: the MAX tells whether all ranks agree), then every
        candidate's own flags."""
        pruned = int(self.pruned_here)
        parts = [torch.tensor([pruned, -pruned], dtype=torch.int64)]
        self._flag_sizes = []
        for m in self.methods:
            flags = m.install_flags()
            self._flag_sizes.append(0 if flags is None else flags.numel())
            if flags is not None:
                parts.append(flags.to(torch.int64).cpu())
        return torch.cat(parts)

    def receive_install_flags(self, flags: torch.Tensor) -> None:
        if int(flags[0]) != -int(flags[1]):
            raise RuntimeError("auto: some ranks hold a pruned model and others do not; prune the model alike on "
                               "every rank before gcomp.install")
        start = 2
        for m, size in zip(self.methods, self._flag_sizes):
            if size:
                m.receive_install_flags(flags[start:start + size])
                start += size
        if self.preset_pactrain and not int(flags[0]):
            self.chooser.active = [i for i, spec in enumerate(self.specs) if spec != "pactrain"]

    # --- a bucket ----------------------------------------------------------------------------------------------

    def reduce(self, buffer, bucket, group, stats):
        chooser = self.chooser
        if bucket.index == 0:
            chooser.step_started(group, buffer.device, stats)
        record = chooser.record(bucket)
        index = chooser.candidate_for(record)
        if record.last is not None and record.last != index:
            self.hand_over(record.last, bucket, buffer)
        record.last = index
        own = TeeStats(stats)
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

    def hand_over(self, previous: int, bucket: BucketInfo, buffer: torch.Tensor) -> None:
        """What candidate ``previous`` held back for ``bucket`` (its error feedback) goes into ``buffer``, to be sent
        by the next method: the gradient's total is kept across a switch."""
        held = self.methods[previous].flush(bucket, buffer)
        if held is not None:
            buffer.add_(held.reshape(buffer.shape).to(buffer.dtype))

    def flush(self, bucket, like):
        record = self.chooser.records.get(bucket.key)
        return None if record is None or record.last is None else self.methods[record.last].flush(bucket, like)

    # --- what it chose ---------------------------------------------------------------------------------------

    def choices(self) -> dict[str, str]:
        """The method chosen per bucket layout (``BucketInfo.key``), once decided."""
        return self.chooser.choices()

    @property
    def events(self) -> list[dict]:
        """Each probe, choice and switch, in order (``AutoChooser``)."""
        return self.chooser.events

    # --- checkpoints: every candidate's state, by its spec; a resumed run measures again -----------------------

    def state_dict(self) -> dict:
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
