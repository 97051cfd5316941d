"""How a bandwidth schedule (``gcomp.bench.rate_schedule``) reaches the links: the parent runs ``tc``, rank 0
says when.

Who runs tc: the parent process, the one that built the ``ShapedNetwork``. Each link has two tbf qdiscs, one on
the worker's ``eth0`` inside its namespace and one on the bridge-side end in the root namespace; a worker
(inside its own namespace) reaches neither the other workers' namespaces nor, by name, the root namespace, so
it could change only half of its own link. The parent reaches every qdisc (``ShapedNetwork.set_rate``: ``tc
qdisc change`` on both ends of every link) and already owns them.

When: at the schedule's steps (and at step 0 of every later method's run, to start again at the first rate),
before the step's clock starts, every rank calls ``RateSwitch.before_step``. On rank 0 it first asks the parent
over a pair of pipes (``RateController``; the pipes' ends are passed to rank 0 alone, named in
``GCOMP_RATE_CHANNEL``) and waits for its answer, i.e. until tc has changed every qdisc; then every rank meets
at a barrier. The previous step is over on every rank by then (DDP waits for its reductions within the step),
so no gradient is in flight while the rate changes, and no rank starts the step before the change. Neither
the request nor the barrier is inside a step's timing.

Unshaped (no root, no tc), nothing is switched: the run keeps its one link and the results say it was not shaped.
"""
from __future__ import annotations

import os
import threading
from typing import Callable

import torch.distributed as dist

CHANNEL_ENV = "GCOMP_RATE_CHANNEL"  # "<fd to write requests to>,<fd to read answers from>", rank 0 only


class RateSwitch:
    """A worker's side of the schedule: the links' rate before every step, the same on every rank.

    ``schedule``: ``Segment.as_dict()`` entries, the first from step 0. ``request(step, rate_bps)`` (rank 0
    only; None elsewhere) returns once every link runs at ``rate_bps``. The links start at the first rate.
    """

    def __init__(self, schedule: list[dict], request: Callable[[int, int], None] | None,
                 barrier: Callable[[], None] = dist.barrier):
        self.rates = {s["from_step"]: (s["rate"], s["rate_bps"]) for s in schedule}
        self.current_bps = schedule[0]["rate_bps"]
        self.request = request
        self.barrier = barrier

    def before_step(self, step: int) -> str | None:
        """Switch the links if ``step`` starts a segment at another rate; returns the new rate's text, or None."""
        rate, rate_bps = self.rates.get(step, (None, self.current_bps))
        if rate_bps == self.current_bps:
            return None
        if self.request is not None:
            self.request(step, rate_bps)
        self.barrier()  # nobody starts the step before rank 0 heard that the links changed
        self.current_bps = rate_bps
        return rate


class NoSwitch:
    """No schedule, or an unshaped run: the links stay as they are."""

    def before_step(self, step: int) -> None:
        return None


def worker_switch(config: dict, rank: int) -> RateSwitch | NoSwitch:
    """The switch a worker's config asks for: a ``RateSwitch`` when its schedule is applied to shaped links."""
    if not config.get("rate_schedule_applied"):
        return NoSwitch()
    return RateSwitch(config["rate_schedule"], channel_client() if rank == 0 else None)


def channel_client(environ=os.environ) -> Callable[[int, int], None]:
    """Rank 0's ``request(step, rate_bps)``: one line to the parent, then its one-line answer."""
    if CHANNEL_ENV not in environ:
        raise RuntimeError(f"gcomp.bench.rate_control: a schedule is applied, but {CHANNEL_ENV} names no channel "
                           "to the parent that runs tc")
    write_fd, read_fd = (int(fd) for fd in environ[CHANNEL_ENV].split(","))
    requests, answers = os.fdopen(write_fd, "w"), os.fdopen(read_fd, "r")

    def request(step: int, rate_bps: int) -> None:
        requests.write(f"{step} {rate_bps}\n")
        requests.flush()
        answer = answers.readline().strip()
        if answer != "ok":
            raise RuntimeError(f"gcomp.bench: changing the links' rate before step {step} failed: "
                               f"{answer or 'the parent closed the channel'}")

    return request


class RateController:
    """The parent's side: serves rank 0's requests on a thread, calling ``change(step, rate_bps)`` for each
    (``ShapedNetwork.set_rate``) and answering ``ok`` or the error. A context manager: enter before starting
    the workers, pass ``child_fds`` and ``env`` to rank 0, call ``launched()`` once it has started."""

    def __init__(self, change: Callable[[int, int], None]):
        self.change = change
        self.changes: list[tuple[int, int]] = []
        self._thread: threading.Thread | None = None

    def __enter__(self) -> RateController:
        self._requests_read, self._requests_write = os.pipe()
        self._answers_read, self._answers_write = os.pipe()
        self.child_fds = (self._requests_write, self._answers_read)
        self.env = {CHANNEL_ENV: f"{self._requests_write},{self._answers_read}"}
        self._thread = threading.Thread(target=self._serve, name="gcomp-rate-controller", daemon=True)
        self._thread.start()
        return self

    def launched(self) -> None:
        """Drop the parent's copies of rank 0's ends, so that the thread sees the end of the channel when rank 0
        exits."""
        for fd in self.child_fds:
            _close(fd)
        self.child_fds = ()

    def _serve(self) -> None:
        with os.fdopen(self._requests_read, "r") as requests, os.fdopen(self._answers_write, "w") as answers:
            for line in requests:
                try:
                    step, rate_bps = (int(field) for field in line.split())
                    self.change(step, rate_bps)
                    self.changes.append((step, rate_bps))
                    answer = "ok"
                except Exception as error:  # rank 0 raises it; the parent goes on waiting for the workers
                    answer = " ".join(f"{type(error).__name__}: {error}".split())
                try:
                    answers.write(answer + "\n")
                    answers.flush()
                except OSError:  # rank 0 is gone: its launcher reports that
                    return

    def __exit__(self, *exc_info) -> None:
        self.launched()  # also when a launch failed halfway
        if self._thread is not None:
            self._thread.join(timeout=10)


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass
