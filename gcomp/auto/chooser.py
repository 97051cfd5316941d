"""``auto``'s measurements, decisions and own collectives (docs/design.md §9). Every decision is taken at the
first bucket of a step (DDP reduces bucket 0 first on every rank) from agreed numbers: every rank decides alike."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.distributed as dist

from gcomp.auto.choice import COUNTS, WIDTH, BucketCost, LayoutRecord, choose, link_network, median_after_first
from gcomp.bucket import BucketInfo
from gcomp.link import PROBE_SMALL_BYTES, Launched, Network, launched_s, link_from_timings, timed_allreduce_s
from gcomp.pruning.masks import comm_device

# the large probe: the largest bucket within these bounds (bytes dominate at 1 Gbit/s; 63 ms at 100 Mbit/s, 4 ranks)
PROBE_LARGE_BYTES = (128 * 1024, 512 * 1024)


def launch_max(values: list[float], group, device: torch.device) -> Callable[[], list[float]]:
    """The element-wise MAX of ``values`` over ``group`` (every rank decides from the slowest's), launched."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    work = dist.all_reduce(tensor, dist.ReduceOp.MAX, group=group, async_op=True)

    def wait() -> list[float]:
        work.wait()
        return tensor.cpu().tolist()

    return wait


def probe_network(group, device: torch.device, bucket_bytes: int = 0) -> Network:
    """The link from timed all-reduces of 1 KiB (the fastest of 2) and of the largest bucket (once), the slowest
    rank's; no warm-up: training already opened the links."""
    large = min(max(int(bucket_bytes), PROBE_LARGE_BYTES[0]), PROBE_LARGE_BYTES[1])
    small_s = timed_allreduce_s(PROBE_SMALL_BYTES, 2, group, device, warmup=False)
    large_s = timed_allreduce_s(large, 1, group, device, warmup=False)
    link = link_from_timings(small_s, large_s, dist.get_world_size(group), PROBE_SMALL_BYTES, large)
    return link_network(*launch_max([link["alpha_s"] or 0.0, link["beta_s"] or 0.0], group, device)())


class AutoChooser:
    """What one ``auto`` measured and chose among ``specs`` (``active``: those it may choose) and its collectives."""

    def __init__(self, specs: list[str], probe_every: int, trials: int, margin: float, reprobe_above: float):
        self.specs, self.active, self.workers, self.clock = specs, list(range(len(specs))), 1, time.perf_counter
        self.probe_every, self.trials, self.margin, self.reprobe_above = probe_every, trials, margin, reprobe_above
        self.events: list[dict] = []  # kept across restarts: what happened when
        self.restart()

    def restart(self) -> None:  # forget every measurement and decision: explore again from the next step
        self.records: dict[str, LayoutRecord] = {}
        self.step, self.explore_from, self.checked_at = -1, 0, 0
        self.decided = self.check_due = self._restart = False
        self.baseline = self.network = self._pending = None  # _pending: the last check's agreement, read a step later
        self.last_index = -1  # the step's last bucket, once decided
        # while measuring, each candidate's whole steps: from one step's first bucket to the next one's
        self.intervals: list[list[float]] = [[] for _ in self.specs]
        self._step_began: tuple[float, int] | None = None  # when this step's first bucket came, and its candidate

    def record(self, bucket: BucketInfo) -> LayoutRecord:
        if bucket.key not in self.records:
            self.records[bucket.key] = LayoutRecord(bucket, len(self.specs))
            self._restart |= self.decided  # a layout never measured (DDP rebuilt its buckets): measure them all again
        return self.records[bucket.key]

    def candidate_for(self, record: LayoutRecord | None) -> int:
        if self.decided and record is not None and record.chosen is not None:
            return record.chosen
        return self.active[min(max(self.step - self.explore_from, 0) // self.trials, len(self.active) - 1)]

    def step_started(self, group, device: torch.device, stats: dict) -> None:
        self.step += 1
        now = self.clock()
        if self._step_began is not None:  # the step that just ended, whole: compute, every bucket, the optimizer
            began, candidate = self._step_began
            self.intervals[candidate].append(now - began)
            self._step_began = None
        if self._restart:
            old, step = self.records, self.step
            self.restart()
            self.step = self.explore_from = step
            for key, r in old.items():  # what each layout's last method holds back is still to hand over
                self.records[key] = LayoutRecord(r.bucket, len(self.specs), last=r.last)
        if not self.decided:
            if self.step - self.explore_from < self.trials * len(self.active) and len(self.active) > 1:
                stats["auto_explore_steps"] += 1
                self._step_began = (now, self.candidate_for(None))
            elif self.records:  # a lone candidate decides once its layouts are known, after the first step
                self._timed(self._decide, group, device, stats)
            return
        if self._pending is not None:
            self._timed(self._read_check, group, device, stats)
        self.check_due = self.step - self.checked_at >= self.probe_every  # launched after the last bucket

    def _timed(self, fn, group, device, stats) -> None:
        begin = time.perf_counter()
        if dist.is_initialized():  # NCCL reduces CUDA tensors only
            device = comm_device(group, device if device.type == "cuda" else torch.device("cuda"))
        fn(group, device, stats)
        stats["auto_agree_s"] += time.perf_counter() - begin

    def _decide(self, group, device: torch.device, stats: dict) -> None:
        keys, n = sorted(self.records), len(self.specs)
        values = [float(len(keys)), -float(len(keys))] + [median_after_first(t) for t in self.intervals]
        for key in keys:
            values += self.records[key].vector()
        agreed = launch_max(values, group, device)() if self.workers > 1 else values
        if agreed[0] != -agreed[1]:
            raise RuntimeError(f"auto: the ranks measured different numbers of bucket layouts ({int(-agreed[1])} to "
                               f"{int(agreed[0])}); every rank must run the same DDP model")
        intervals = agreed[2:2 + n]
        rows = [[agreed[at:at + WIDTH] for at in range(start, start + n * WIDTH, WIDTH)]  # [layout][candidate]
                for start in range(2 + n, len(agreed), n * WIDTH)]
        self._probe(group, device, stats)
        walls = {i: sum(row[i][0] + row[i][1] for row in rows) for i in self.active}
        for key, row in zip(keys, rows):
            costs = self.records[key].costs
            for i in self.active:
                launched = Launched(self.workers, buckets=1, **dict(zip(COUNTS, row[i][2:])))
                # the step beyond this candidate's buckets (what their walls miss: peers late on shared cores, DDP's
                # copies) shared over the layouts, and the wait beyond the price here: priced alike on another link
                rest_s = (intervals[i] - walls[i]) / len(keys) if intervals[i] > 0 else 0.0
                overhead_s = max(row[i][1] - launched_s(launched, self.workers, self.network) + rest_s, 0.0)
                costs[i] = BucketCost(row[i][0], launched, overhead_s)
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
        for record in self.records.values():
            if not record.costs:
                continue
            current = None if record.chosen is None else self.specs[record.chosen]
            choice = choose({self.specs[i]: c for i, c in record.costs.items()}, self.workers, self.network,
                            current, self.margin)
            record.chosen = self.specs.index(choice.method)
            record.predicted = {self.specs.index(s): p for s, p in choice.predicted_s.items()}
            record.waits.clear()
            stats["auto_switches"] += int(choice.switched)
            event = {"step": int(stats["steps"]), "bucket": record.bucket.index}
            self.events.append({**event, "chosen": choice.method,
                                "predicted_s": {spec: round(p, 6) for spec, p in choice.predicted_s.items()}})
            if choice.switched:
                self.events.append({**event, "from": current, "to": choice.method})
        self.checked_at = self.step

    def after_bucket(self, bucket: BucketInfo, group, device: torch.device, stats: dict) -> None:
        """A check due runs after the step's last bucket: beside the optimizer and the next forward."""
        if self.check_due and bucket.index == self.last_index:
            self.check_due = False
            self._timed(self._check, group, device, stats)

    def _check(self, group, device, stats: dict) -> None:
        """Launch the agreement on the chosen methods' waits (medians since the last check) over their price."""
        measured = predicted = 0.0
        for record in self.records.values():
            if record.waits and record.chosen is not None:
                measured += statistics.median(record.waits)
                predicted += launched_s(record.costs[record.chosen].launched, self.workers, self.network)
            record.waits.clear()
        ratio = measured / predicted if predicted > 0 else 0.0
        self._pending = launch_max([ratio], group, device) if self.workers > 1 else lambda: [ratio]
        self.checked_at = self.step

    def _read_check(self, group, device, stats: dict) -> None:
        """The first ratio after a probe is the baseline; one off it by more than ``1 + reprobe_above`` times: probe."""
        ratio, self._pending = self._pending()[0], None
        if self.baseline is None:
            self.baseline = ratio
        elif not self.baseline / (1 + self.reprobe_above) <= ratio <= self.baseline * (1 + self.reprobe_above):
            self._probe(group, device, stats)
            self._choose(stats)

    def choices(self) -> dict[str, str]:
        """The method chosen per bucket layout (``BucketInfo.key``), once decided."""
        return {key: self.specs[r.chosen] for key, r in sorted(self.records.items()) if r.chosen is not None}
