"""The throughput of a shaped link, measured: one TCP stream between two workers of a ``ShapedNetwork``.

    python -m gcomp.bench.throughput --bandwidth 100mbit --mbytes 16     # build 2 shaped workers, measure, tear down

The sender and receiver are small ``python -c`` scripts run inside the workers' namespaces; the clock starts
at the first chunk received, so the connection set-up is not timed.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
from typing import Sequence

from gcomp.bench.netem import RATE_FORMS, ShapedNetwork, cleanup_stale, parse_rate, permitted, run_command

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
