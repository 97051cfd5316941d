"""``auto``'s method: each bucket reduced by the allowed method measured fastest for it on this link.

On a bucket layout's first steps every candidate runs in turn (``trials`` buckets each), timed; then the ranks
agree on the slowest rank's codec seconds and collectives per candidate (one MAX all-reduce), probe the link
(timed all-reduces), and each layout takes the candidate ``choose`` predicts fastest. Every ``probe_every``
steps the ranks agree on how far the chosen methods' measured waits drift from what was seen after the last
probe; past ``reprobe_above`` they probe again and may switch. Decisions are taken at the first bucket of a
step (DDP reduces bucket 0 first on every rank) from agreed numbers only, so every rank decides alike.
"""
from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.distributed as dist

from gcomp.auto.agree import Pending, agree_max, launch_max, probe_network
from gcomp.auto.choice import BucketCost, choose
from gcomp.auto.record import WIDTH, LayoutRecord, median_after_first
from gcomp.auto.tee import TeeStats
from gcomp.bench.collective_costs import Network, launched_s
from gcomp.bucket import BucketInfo
from gcomp.core import Communicator, Compressor, Method, Payload, check_state
from gcomp.device_future import then_on
from gcomp.memory import NoMemory
from gcomp.pruning.masks import comm_device, named_masks
from gcomp.registry import from_spec

AUTO = "auto"  # the collective kind of a method that runs its candidates' collectives
STAT_KEYS = ("auto_explore_steps", "auto_probes", "auto_switches", "auto_agree_s", "auto_predicted_s",
             "auto_measured_s")


class AutoCompressor(Compressor):
    """Holds the candidate methods and what was measured of them; runs no codec of its own (``AutoMethod.reduce``
    hands each bucket to a candidate, whose payload is what goes on the wire, by the candidate's collective).

    ``auto``'s own collectives, on the hook's group: one MAX all-reduce of the measurements (a few floats per
    layout and candidate) when it decides, one of a single float every ``probe_every`` steps, and the link
    probe (``gcomp.auto.agree``) when it decides and when the waits drift; their seconds are ``auto_agree_s``.
    """

    collective = AUTO
    stateful = True  # measures on DDP's final buckets

    def __init__(self, specs: list[str], preset_pactrain: bool, probe_every: int, trials: int, margin: float,
                 reprobe_above: float):
        self.specs = specs
        self.methods = [from_spec(spec) for spec in specs]
        self.preset_pactrain = preset_pactrain  # pactrain came with a preset: kept only on a pruned model
        self.probe_every, self.trials, self.margin, self.reprobe_above = probe_every, trials, margin, reprobe_above
        self.lossless = all(m.compressor.lossless for m in self.methods)
        self.reads_model = any(m.compressor.reads_model for m in self.methods)
        self.decodes_alone = all(m.compressor.decodes_alone for m in self.methods)
        self.depends_on_layout = any(m.compressor.depends_on_layout for m in self.methods)
        keys: list[str] = []
        for m in self.methods:
            keys += [k for k in m.stat_keys if k not in keys]
        self.stat_keys = tuple(keys) + STAT_KEYS
        self.active = list(range(len(specs)))
        self.workers = 1
        self.clock = time.perf_counter
        self._flag_sizes: list[int] = []
        self.restart()

    def restart(self) -> None:
        """Forget every measurement and decision: explore again from the next step."""
        self.records: dict[str, LayoutRecord] = {}
        self.costs: dict[str, dict[int, BucketCost]] = {}
        self.step = -1
        self.explore_from = 0
        self.decided = False
        self.checked_at = 0
        self.baseline: float | None = None
        self.network: Network | None = None
        self._restart = False
        self._pending: Pending | None = None  # the last check's agreement, read at the next step
        self.check_due = False
        self.last_index = -1  # the step's last bucket, once decided
        # while measuring, each candidate's whole steps: from one step's first bucket to the next one's
        self.intervals: list[list[float]] = [[] for _ in self.methods]
        self._step_began: tuple[float, int] | None = None  # when this step's first bucket came, and its candidate
        self.events: list[dict] = getattr(self, "events", [])  # kept across restarts: what happened when

    # --- binding ---------------------------------------------------------------------------------------------

    def watch(self, ddp) -> None:
        for m in self.methods:
            m.compressor.watch(ddp)

    def bind(self, model, group, stats) -> None:
        self.workers = dist.get_world_size(group)
        self.pruned_here = model is not None and bool(named_masks(model))
        for spec, m in zip(self.specs, self.methods):
            with warnings.catch_warnings():
                if spec == "pactrain" and self.preset_pactrain and not self.pruned_here:
                    warnings.simplefilter("ignore")  # the preset holds it for pruned models only: dropped below
                m.compressor.bind(model, group, stats)

    def install_flags(self) -> torch.Tensor:
        """Whether the model is pruned here (both signs: the MAX tells whether all ranks agree), then every
        candidate's own flags."""
        pruned = int(self.pruned_here)
        parts = [torch.tensor([pruned, -pruned], dtype=torch.int64)]
        self._flag_sizes = []
        for m in self.methods:
            flags = m.compressor.install_flags()
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
                m.compressor.receive_install_flags(flags[start:start + size])
                start += size
        if self.preset_pactrain and not int(flags[0]):
            self.active = [i for i, spec in enumerate(self.specs) if spec != "pactrain"]

    # --- a bucket ----------------------------------------------------------------------------------------------

    def compress(self, tensor: torch.Tensor, bucket: BucketInfo) -> Payload:
        return Payload([tensor], bucket)

    def decompress(self, tensors, ctx) -> torch.Tensor:
        return tensors[0]

    def record(self, bucket: BucketInfo) -> LayoutRecord:
        record = self.records.get(bucket.key)
        if record is None:
            record = self.records[bucket.key] = LayoutRecord(bucket, len(self.methods))
            if self.decided:  # a layout never measured (DDP rebuilt its buckets): measure them all again
                self._restart = True
        return record

    def candidate_for(self, record: LayoutRecord | None) -> int:
        if self.decided and record is not None and record.chosen is not None:
            return record.chosen
        explored = max(self.step - self.explore_from, 0) // self.trials
        return self.active[min(explored, len(self.active) - 1)]

    def hand_over(self, previous: int, bucket: BucketInfo, buffer: torch.Tensor) -> None:
        """What ``previous`` held back for ``bucket`` (its error feedback) goes into ``buffer``, to be sent by the
        next method: the gradient's total is kept across a switch."""
        method = self.methods[previous]
        for held in (method.memory.flush(bucket, buffer), method.compressor.flush(bucket, buffer)):
            if held is not None:
                buffer.add_(held.reshape(buffer.shape).to(buffer.dtype))

    # --- decisions, at the first bucket of a step ----------------------------------------------------------------

    def step_started(self, group, device: torch.device, stats: dict) -> None:
        self.step += 1
        now = self.clock()
        if self._step_began is not None:  # the step that just ended, whole: compute, every bucket, the optimizer
            began, candidate = self._step_began
            self.intervals[candidate].append(now - began)
            self._step_began = None
        if self._restart:
            self.restart_from(self.step)
        if not self.decided:
            if self.step - self.explore_from < self.trials * len(self.active) and len(self.active) > 1:
                stats["auto_explore_steps"] += 1
                self._step_began = (now, self.candidate_for(None))
                return
            if self.records:  # a lone candidate decides once its layouts are known, after the first step
                self._timed(self._decide, group, device, stats)
            return
        if self._pending is not None:
            self._timed(self._read_check, group, device, stats)
        self.check_due = self.step - self.checked_at >= self.probe_every  # launched after the last bucket

    def restart_from(self, step: int) -> None:
        old = self.records
        self.restart()
        self.step = self.explore_from = step
        for key, record in old.items():  # what each layout's last method holds back is still to hand over
            self.records[key] = LayoutRecord(record.bucket, len(self.methods), last=record.last)

    def _timed(self, fn, group, device, stats) -> None:
        begin = time.perf_counter()
        if dist.is_initialized():  # NCCL reduces CUDA tensors only
            device = comm_device(group, device if device.type == "cuda" else torch.device("cuda"))
        fn(group, device, stats)
        stats["auto_agree_s"] += time.perf_counter() - begin

    def _decide(self, group, device: torch.device, stats: dict) -> None:
        keys = sorted(self.records)
        values = [float(len(keys)), -float(len(keys))] + [median_after_first(t) for t in self.intervals]
        for key in keys:
            values += self.records[key].vector()
        agreed = agree_max(values, group, device) if self.workers > 1 else values
        if agreed[0] != -agreed[1]:
            raise RuntimeError(f"auto: the ranks measured different numbers of bucket layouts ({int(-agreed[1])} to "
                               f"{int(agreed[0])}); every rank must run the same DDP model")
        intervals, rows = agreed[2:2 + len(self.methods)], agreed[2 + len(self.methods):]
        self._probe(group, device, stats)
        per_layout = WIDTH * len(self.methods)
        walls = {i: sum(rows[n * per_layout + i * WIDTH] + rows[n * per_layout + i * WIDTH + 1]
                        for n in range(len(keys))) for i in self.active}
        for n, key in enumerate(keys):
            row = rows[n * per_layout:]
            costs = {}
            for i in self.active:
                codec_s, wait_s = row[i * WIDTH], row[i * WIDTH + 1]
                launched = LayoutRecord.launched(row[i * WIDTH:], self.workers)
                # What the step took beyond this candidate's buckets (the same compute for every candidate, and
                # what its buckets' walls do not see: peers late on shared cores, DDP's copies), shared out over
                # the layouts; with what the wait held beyond the collectives' price on this link, it is priced
                # alike on the next link.
                rest_s = (intervals[i] - walls[i]) / len(keys) if intervals[i] > 0 else 0.0
                overhead_s = max(wait_s - launched_s(launched, self.workers, self.network) + rest_s, 0.0)
                costs[i] = BucketCost(codec_s, launched, overhead_s)
            self.costs[key] = costs
        self._choose(stats)
        self.decided = True
        self.last_index = max(r.bucket.index for r in self.records.values())  # a new layout measures again

    def _probe(self, group, device, stats) -> None:
        largest = max((r.bucket.numel * r.bucket.dtype.itemsize for r in self.records.values()), default=0)
        self.network = probe_network(group, device, largest) if self.workers > 1 else Network(1e12, 0.0)
        stats["auto_probes"] += 1
        self.baseline = None
        self.events.append({"step": int(stats["steps"]), "probe_bps": self.network.bandwidth_bps,
                            "probe_alpha_s": self.network.alpha_s})

    def _choose(self, stats: dict) -> None:
        for key, record in self.records.items():
            costs = self.costs.get(key)
            if not costs:
                continue
            named = {self.specs[i]: c for i, c in costs.items()}
            current = None if record.chosen is None else self.specs[record.chosen]
            choice = choose(named, self.workers, self.network, current, self.margin)
            record.chosen = self.specs.index(choice.method)
            record.predicted = {self.specs.index(s): p for s, p in choice.predicted_s.items()}
            record.waits.clear()
            stats["auto_switches"] += int(choice.switched)
            self.events.append({"step": int(stats["steps"]), "bucket": record.bucket.index, "chosen": choice.method,
                                "predicted_s": {spec: round(p, 6) for spec, p in choice.predicted_s.items()}})
            if choice.switched:
                self.events.append({"step": int(stats["steps"]), "bucket": record.bucket.index,
                                    "from": current, "to": choice.method})
        self.checked_at = self.step

    def after_bucket(self, bucket: BucketInfo, group, device: torch.device, stats: dict) -> None:
        """A check due this step is launched once the step's last bucket has launched its collectives, so that
        its round trip runs beside the optimizer and the next forward instead of ahead of a bucket."""
        if self.check_due and bucket.index == self.last_index:
            self.check_due = False
            self._timed(self._check, group, device, stats)

    def _check(self, group, device, stats: dict) -> None:
        """Launch the agreement on how far the chosen methods' waits (wall less codec seconds, their median since
        the last check) are from their priced collectives; ``_read_check`` acts on it at the next step."""
        measured = predicted = 0.0
        for key, record in self.records.items():
            if record.waits and record.chosen is not None and key in self.costs:
                measured += statistics.median(record.waits)
                predicted += launched_s(self.costs[key][record.chosen].launched, self.workers, self.network)
            record.waits.clear()
        ratio = measured / predicted if predicted > 0 else 0.0
        self._pending = launch_max([ratio], group, device) if self.workers > 1 else Pending(None, torch.tensor([ratio]))
        self.checked_at = self.step

    def _read_check(self, group, device, stats: dict) -> None:
        """The agreed ratio: the first after a probe is the baseline; one off it by more than a factor
        ``1 + reprobe_above`` probes the link again and re-chooses every layout."""
        ratio = self._pending.values()[0]
        self._pending = None
        if self.baseline is None:
            self.baseline = ratio
        elif not self.baseline / (1 + self.reprobe_above) <= ratio <= self.baseline * (1 + self.reprobe_above):
            self._probe(group, device, stats)
            self._choose(stats)

    # --- what it chose -----------------------------------------------------------------------------------------

    def choices(self) -> dict[str, str]:
        """The method chosen per bucket layout (``BucketInfo.key``), once decided; ``events`` holds each probe
        (the step, by the hook's count, and the link it measured) and each switch (step, bucket, from, to)."""
        return {key: self.specs[r.chosen] for key, r in sorted(self.records.items()) if r.chosen is not None}

    # --- checkpoints --------------------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {"candidates": {spec: {"memory": m.memory.state_dict(), "compressor": m.compressor.state_dict()}
                               for spec, m in zip(self.specs, self.methods)}}

    def load_state_dict(self, state: dict) -> None:
        check_state(self, state, {"candidates": dict})
        check_state("auto", state["candidates"], {spec: dict for spec in self.specs})
        for spec, m in zip(self.specs, self.methods):
            part = state["candidates"][spec]
            check_state(f"auto ({spec})", part, {"memory": dict, "compressor": dict})
            m.memory.load_state_dict(part["memory"])
            m.compressor.load_state_dict(part["compressor"])
        self.restart()  # a resumed run measures its link and codecs again

    @property
    def replicated(self) -> bool:
        return all(m.memory.replicated and m.compressor.replicated for m in self.methods)

    @property
    def keeps_state(self) -> bool:
        return any(m.memory.keeps_state or m.compressor.keeps_state for m in self.methods)

    def parameter_state(self, state: dict) -> dict:
        out = {}
        for spec, m in zip(self.specs, self.methods):
            part = state["candidates"][spec]
            for slot, tensors in {**m.memory.parameter_state(part["memory"]),
                                  **m.compressor.parameter_state(part["compressor"])}.items():
                out[f"{spec}/{slot}"] = tensors
        return out

    def merge_states(self, assigned: list[dict], every: list[dict], rank: int) -> dict:
        out = {}
        for spec, m in zip(self.specs, self.methods):
            out[spec] = {part: getattr(m, part).merge_states([s["candidates"][spec][part] for s in assigned],
                                                             [s["candidates"][spec][part] for s in every], rank)
                         for part in ("memory", "compressor")}
        return {"candidates": out}


class AutoCommunicator(Communicator):
    """None of its own: each candidate's communicator runs its collectives (``AutoMethod.reduce``)."""

    collective = AUTO

    def exchange(self, payload, compressor, group, stats=None):
        raise RuntimeError("auto: buckets are reduced by AutoMethod.reduce, through the chosen method")


class AutoMethod(Method):
    """``auto``: each bucket goes through one of the allowed methods (``AutoCompressor`` says how it is chosen);
    the bytes on the wire and the collective are that method's."""

    def reduce(self, buffer, bucket, group, stats):
        auto: AutoCompressor = self.compressor
        if bucket.index == 0:
            auto.step_started(group, buffer.device, stats)
        record = auto.record(bucket)
        index = auto.candidate_for(record)
        if record.last is not None and record.last != index:
            auto.hand_over(record.last, bucket, buffer)
        record.last = index
        own = TeeStats(stats)
        predicted = record.predicted.get(index) if record.chosen == index else None
        start = time.perf_counter()
        future = auto.methods[index].reduce(buffer, bucket, group, own)
        auto.after_bucket(bucket, group, buffer.device, stats)

        def measured(fut: torch.futures.Future) -> torch.Tensor:
            wall_s = time.perf_counter() - start
            record.observe(index, own, wall_s)
            if predicted is not None:
                stats["auto_predicted_s"] += predicted
                stats["auto_measured_s"] += wall_s
            return fut.value()

        return then_on(future, measured, buffer.device)

    def choices(self) -> dict[str, str]:
        """The method chosen per bucket layout, once decided (``AutoCompressor.choices``)."""
        return self.compressor.choices()


def make_auto(specs: list[str], preset_pactrain: bool, probe_every: int, trials: int, margin: float,
              reprobe_above: float) -> AutoMethod:
    return AutoMethod(AutoCompressor(specs, preset_pactrain, probe_every, trials, margin, reprobe_above),
                      NoMemory(), AutoCommunicator())
