"""``auto``'s decisions: what it measured per bucket layout, when it probes the link, which candidate each layout
takes, and when it looks again. Every decision is taken at the first bucket of a step (DDP reduces bucket 0 first
on every rank) from agreed numbers only, so every rank decides alike.

On a layout's first steps every candidate runs in turn (``trials`` buckets each), timed; then the ranks agree on
the slowest rank's codec seconds and collectives per candidate (one MAX all-reduce), probe the link (timed
all-reduces), and each layout takes the candidate ``choose`` predicts fastest. Every ``probe_every`` steps the
ranks agree on how far the chosen methods' measured waits drift from what was seen after the last probe; past
``reprobe_above`` they probe again and may switch.
"""
from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from gcomp.auto.agree import Pending, agree_max, launch_max, probe_network
from gcomp.auto.choice import BucketCost, choose
from gcomp.auto.record import WIDTH, LayoutRecord, median_after_first
from gcomp.bucket import BucketInfo
from gcomp.link import Network, launched_s
from gcomp.pruning.masks import comm_device


class AutoChooser:
    """The measurements and decisions of one ``auto`` method over ``candidates`` (their specs, in tie-breaking
    order); ``active`` lists the indices it may choose (pactrain leaves a preset on an unpruned model),
    ``workers`` the ranks, ``clock`` the time source (a fake one in tests). ``events`` lists each probe (the step,
    by the state's count, and the link it measured), each choice (with every candidate's predicted seconds) and
    each switch (step, bucket, from, to).

    Its own collectives, on the state's group: one MAX all-reduce of the measurements (a few floats per layout and
    candidate) when it decides, one of a single float every ``probe_every`` steps, and the link probe
    (``gcomp.auto.agree``) when it decides and when the waits drift; their seconds are ``auto_agree_s``.
    """

    def __init__(self, specs: list[str], probe_every: int, trials: int, margin: float, reprobe_above: float):
        self.specs = specs
        self.probe_every, self.trials, self.margin, self.reprobe_above = probe_every, trials, margin, reprobe_above
        self.active = list(range(len(specs)))
        self.workers = 1
        self.clock = time.perf_counter
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
        self.intervals: list[list[float]] = [[] for _ in self.specs]
        self._step_began: tuple[float, int] | None = None  # when this step's first bucket came, and its candidate
        self.events: list[dict] = getattr(self, "events", [])  # kept across restarts: what happened when

    def record(self, bucket: BucketInfo) -> LayoutRecord:
        record = self.records.get(bucket.key)
        if record is None:
            record = self.records[bucket.key] = LayoutRecord(bucket, len(self.specs))
            if self.decided:  # a layout never measured (DDP rebuilt its buckets): measure them all again
                self._restart = True
        return record

    def candidate_for(self, record: LayoutRecord | None) -> int:
        if self.decided and record is not None and record.chosen is not None:
            return record.chosen
        explored = max(self.step - self.explore_from, 0) // self.trials
        return self.active[min(explored, len(self.active) - 1)]

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
            self.records[key] = LayoutRecord(record.bucket, len(self.specs), last=record.last)

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
        intervals, rows = agreed[2:2 + len(self.specs)], agreed[2 + len(self.specs):]
        self._probe(group, device, stats)
        per_layout = WIDTH * len(self.specs)
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

