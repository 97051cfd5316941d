"""The throughput and latency of a shaped link, measured.

    python -m gcomp.bench.throughput --bandwidth 100mbit --mbytes 16     # build 2 shaped workers, measure, tear down

``measure_throughput_bps``: one TCP stream between two workers of a ``ShapedNetwork``. The sender and receiver
are small ``python -c`` scripts run inside the workers' namespaces; the clock starts at the first chunk
received, so the connection set-up is not timed.

``probe_link``: the path as the benchmark's collectives see it, measured by the workers themselves at the start
of a run (``gcomp.bench.worker``): timed gloo all-reduces of a tiny and of a large tensor over every worker
(``gcomp.link.probe``: ``timed_allreduce_s``, ``link_from_timings``). A ring all-reduce of ``n`` bytes over
``P`` ranks takes ``2(P-1)`` messages and moves ``2(P-1)/P * n`` bytes per rank, so the tiny one gives the
latency per message ``alpha`` (tc's queueing, veth, the bridge, gloo's TCP and its threads, and the scheduling
of ``P`` processes on this machine's cores, all included) and the difference of the two the seconds per byte
``beta``. ``gcomp simulate`` prices every collective with them.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from typing import Sequence

from gcomp.bench.netem import ShapedNetwork, cleanup_stale, permitted, run_command
from gcomp.link import (PROBE_LARGE_BYTES, PROBE_SMALL_BYTES, RATE_FORMS, link_from_timings, parse_rate,
                        timed_allreduce_s)

_RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], 0))
server.settimeout(float(sys.argv[2]))
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
conn.settimeout(float(sys.argv[2]))
conn.recv(1 << 16)  # the clock starts after the first chunk, so the connection setup is not timed
start, received = time.perf_counter(), 0
while chunk := conn.recv(1 << 20):
    received += len(chunk)
print(received, time.perf_counter() - start, flush=True)
"""

_SENDER = """
import socket, sys
chunk, left = bytes(1 << 20), int(sys.argv[3])
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4])) as conn:
    while left > 0:
        conn.sendall(chunk[:min(left, len(chunk))])
        left -= len(chunk)
    conn.shutdown(socket.SHUT_WR)
    conn.recv(1)
"""


def measure_throughput_bps(network: ShapedNetwork, sender: int, receiver: int, nbytes: int = 4_000_000,
                           timeout_s: float = 30.0) -> float:
    """Bits per second of one TCP stream of ``nbytes`` from worker ``sender`` to worker ``receiver``."""
    receive = subprocess.Popen(network.prefix_command(receiver, [sys.executable, "-c", _RECEIVER,
                                                                 network.addresses[receiver], str(timeout_s)]),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        port = receive.stdout.readline().strip()
        if not port:
            raise RuntimeError(f"throughput receiver did not start: {receive.stderr.read().strip()}")
        run_command(network.prefix_command(sender, [sys.executable, "-c", _SENDER, network.addresses[receiver], port,
                                             str(nbytes), str(timeout_s)]))
        out, err = receive.communicate(timeout=timeout_s)
    finally:
        if receive.poll() is None:
            receive.kill()
            receive.wait()
    if receive.returncode != 0:
        raise RuntimeError(f"throughput receiver failed: {err.strip()}")
    received, elapsed = out.split()
    return int(received) * 8 / float(elapsed)


PROBE_REPEATS = (15, 3)  # small, large: the fastest of this many, after one untimed warm-up of each


def probe_link(group=None, small_bytes: int = PROBE_SMALL_BYTES, large_bytes: int = PROBE_LARGE_BYTES,
               repeats: tuple[int, int] = PROBE_REPEATS, device="cpu") -> dict:
    """Every rank of ``group`` calls this together (it runs collectives): the link's ``alpha_s`` and ``beta_s`` as
    ``link_from_timings`` derives them from this rank's timed all-reduces (of tensors on ``device``), and the
    timings themselves."""
    import torch.distributed as dist

    workers = dist.get_world_size(group)
    small = timed_allreduce_s(small_bytes, repeats[0], group, device)
    large = timed_allreduce_s(large_bytes, repeats[1], group, device)
    return {**link_from_timings(small, large, workers, small_bytes, large_bytes), "probe_small_s": small,
            "probe_large_s": large, "probe_small_bytes": small_bytes, "probe_large_bytes": large_bytes}


def loaded_latency_s(spans_by_rank: list[list[tuple[float, float]]], workers: int) -> float | None:
    """``alpha`` under load from the ranks' ``(ready, done)`` times of the same tiny all-reduces (one list per
    rank, rank 0's first): per all-reduce, rank 0's completion less the last rank's arrival, over the
    ``2(P-1)`` messages of a ring; the median over the all-reduces. None with one worker."""
    if workers < 2 or not spans_by_rank or not spans_by_rank[0]:
        return None
    durations = [max(done - max(spans[i][0] for spans in spans_by_rank), 0.0)
                 for i, (_, done) in enumerate(spans_by_rank[0])]
    return statistics.median(durations) / (2 * (workers - 1))


def probe_loaded_latency(local_step, group=None, repeats: int = PROBE_REPEATS[0], device="cpu") -> float | None:
    """``alpha`` as the run's collectives meet it: every rank runs ``local_step()`` (a training step's local
    work, no communication) and then at once an all-reduce of ``PROBE_SMALL_BYTES``, ``repeats`` times; the
    ranks' ready and done times (one monotonic clock on one machine) give ``loaded_latency_s``. A process
    that has just computed is woken for each message later than an idle one on a busy machine, so this is
    the latency a step's rounds see, where ``probe_link``'s idle one is the path's own. Every rank of
    ``group`` calls this together."""
    import torch
    import torch.distributed as dist

    workers = dist.get_world_size(group)
    tensor = torch.zeros(max(PROBE_SMALL_BYTES // 8, 1), dtype=torch.int64, device=device)
    spans = []
    for _ in range(repeats):
        local_step()
        if tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)
        ready = time.perf_counter()
        dist.all_reduce(tensor, group=group)
        if tensor.device.type == "cuda":
            torch.cuda.synchronize(tensor.device)
        spans.append((ready, time.perf_counter()))
    gathered: list = [None] * workers
    dist.all_gather_object(gathered, spans, group=group)
    return loaded_latency_s(gathered, workers)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m gcomp.bench.throughput", description=__doc__.split("\n")[0])
    parser.add_argument("--bandwidth", default="100mbit", help=RATE_FORMS)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--mbytes", type=float, default=16.0, help="MB sent from worker 0 to worker 1")
    parser.add_argument("--cleanup-stale", action="store_true", help="only remove what dead runs left behind")
    args = parser.parse_args(argv)
    ok, why = permitted()
    if not ok:
        raise SystemExit(why)
    if args.cleanup_stale:
        print("\n".join(cleanup_stale()) or "nothing stale")
        return
    try:
        rate = parse_rate(args.bandwidth)
    except ValueError as error:
        parser.error(str(error))
    with ShapedNetwork(max(args.workers, 2), rate) as network:
        bps = measure_throughput_bps(network, 0, 1, int(args.mbytes * 1e6))
    print(f"{args.bandwidth}: {bps / 1e6:.1f} Mbit/s measured (one TCP stream, worker 0 -> worker 1)")


if __name__ == "__main__":
    main()
