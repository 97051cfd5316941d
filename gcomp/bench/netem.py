"""Real bandwidth limits between worker processes on one Linux machine: namespaces, a bridge, veth pairs, tbf.

    python -m gcomp.bench.throughput --bandwidth 100mbit --mbytes 16     # build 2 shaped workers, measure, tear down

Every worker process runs inside its own network namespace, wired to one bridge in the root namespace by a veth
pair; the worker sees a single interface ``eth0`` with address ``10.213.S.(i+1)/24`` (gloo is pointed at it
with ``GLOO_SOCKET_IFNAME=eth0``)::

       namespace <p>n0        namespace <p>n1              namespace <p>n(N-1)
      +----------------+     +----------------+           +----------------+
      | eth0 10.213.S.1|     | eth0 10.213.S.2|    ...    | eth0 10.213.S.N|
      +-------+--------+     +-------+--------+           +-------+--------+
         [tbf]|                 [tbf]|                       [tbf]|      egress of the worker's end
              | veth pair            | veth pair                  | veth pair
         [tbf]|                 [tbf]|                       [tbf]|      egress of the bridge's end
            <p>v0                  <p>v1                       <p>v(N-1)
      +-------+----------------------+----------------------------+--------+
      |            bridge <p>br  (root namespace, no address)              |
      +--------------------------------------------------------------------+

What is shaped: when a rate is given, a ``tbf`` qdisc sits on the egress of BOTH ends of every veth pair, so each
worker's link is limited to the rate in each direction separately (full duplex): what a worker sends is limited
by its ``eth0``, what it receives by its bridge-side end. A packet from worker a to worker b crosses a's ``eth0``
and b's bridge-side end, two token buckets at the same rate, so the path runs at the rate. Without a rate the
links run at memory speed (several Gbit/s, bounded by the CPU). ``ShapedNetwork.set_rate`` changes every tbf
in place (``tc qdisc change``) while the workers run: a bandwidth schedule (``gcomp.bench.rate_control``).

Measured with ``gcomp.bench.throughput`` (one TCP stream of 32 MB, 2-core machine): about 95 Mbit/s per link
at ``100mbit`` (TCP/IP headers take the rest of the line rate), about 0.97 Gbit/s at ``1gbit``, 8-14 Gbit/s
unshaped (CPU-bound). Short transfers read high at high rates: the burst and the queue absorb their first few
hundred KB.

Default burst: ``max(rate_bps / 8 / 250, 64 KiB)`` bytes, i.e. 4 ms of traffic (tc needs burst >= rate / HZ, and
HZ can be as low as 250), and never less than one 64 KiB GSO segment, so that the kernel rarely has to split
the large packets TCP hands to a veth. ``latency`` (default 50 ms) bounds how long a packet may queue in tbf.

Names: everything one ``ShapedNetwork`` creates starts with its prefix ``gc<pid, 7 digits><3 random hex>`` (12
characters, so ``<prefix>v<i>`` stays within Linux's 15-character interface names for up to 99 workers). The
pid in the name lets ``cleanup_stale`` find what a killed run left behind; only names with that exact form are
ever touched. Needs root, ``ip`` and ``tc`` (iproute2): ``permitted()`` says whether they are here and why not.

This module holds ``ShapedNetwork`` and its tbf settings; the commands it runs, the names present, ``permitted``
and ``cleanup_stale`` are ``gcomp.bench.netns`` (importable from here too), and the rate parsing is
``gcomp.link``'s.
"""
from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
from typing import Sequence

# PREFIX, SUBNET_BASE, cleanup_stale and permitted are not used here: imported so that they stay netem's names
from gcomp.bench.netns import (PREFIX, SUBNET_BASE, cleanup_stale, delete_names, free_subnet,  # noqa: F401
                               link_names, namespace_names, new_prefix, permitted, run_command)

INTERFACE = "eth0"
MAX_WORKERS = 99  # two digits after "<prefix>v" keep host-side names within IFNAMSIZ - 1 = 15 characters
MIN_BURST_BYTES = 64 * 1024
HZ_FLOOR = 250  # the lowest common kernel HZ: tbf needs burst >= rate / HZ


def default_burst_bytes(rate_bps: int) -> int:
    """4 ms of traffic at ``rate_bps`` (tbf needs burst >= rate / HZ), at least one 64 KiB GSO segment."""
    return max(rate_bps // 8 // HZ_FLOOR, MIN_BURST_BYTES)


class ShapedNetwork:
    """``workers`` network namespaces on one bridge, each link limited to ``rate_bps`` in both directions.

    A context manager: ``__enter__`` builds the topology (see the module docstring), ``__exit__`` / ``close``
    delete everything it created, also after a failure halfway through ``__enter__``, on Ctrl-C, on SIGTERM
    (while active, SIGTERM means clean up and exit with status 143) and at interpreter exit. ``rate_bps=None``
    builds the same topology unshaped. Worker ``i`` runs as ``prefix_command(i, argv)`` with ``env(i)`` added to
    its environment, and is reached at ``addresses[i]``.
    """

    def __init__(self, workers: int, rate_bps: int | None, *, burst_bytes: int | None = None,
                 latency_ms: float = 50.0):
        if not 1 <= workers <= MAX_WORKERS:
            raise ValueError(f"ShapedNetwork: workers must be within 1..{MAX_WORKERS}; got {workers!r}")
        if rate_bps is not None and rate_bps <= 0:
            raise ValueError(f"ShapedNetwork: rate_bps must be positive or None; got {rate_bps!r}")
        if not latency_ms > 0:
            raise ValueError(f"ShapedNetwork: latency_ms must be positive; got {latency_ms!r}")
        self.workers = workers
        self.rate_bps = rate_bps
        self._burst_given = burst_bytes is not None
        if burst_bytes is None and rate_bps is not None:
            burst_bytes = default_burst_bytes(rate_bps)
        self.burst_bytes = burst_bytes
        self.latency_ms = latency_ms
        self.interface = INTERFACE
        self.prefix = ""
        self.bridge = ""
        self.namespaces: list[str] = []
        self.addresses: list[str] = []
        self._owner_pid = os.getpid()
        self._active = False
        self._previous_sigterm = None
        self._sigterm_installed = False

    # -- building ---------------------------------------------------------------------------------------------

    def __enter__(self) -> ShapedNetwork:
        if self._active:
            raise RuntimeError("ShapedNetwork: already entered")
        self._owner_pid = os.getpid()
        self._active = True
        atexit.register(self._close_at_exit)
        self._install_sigterm()
        try:
            self._build()
        except BaseException:  # KeyboardInterrupt too: delete what was created, then re-raise
            self._close_quietly()
            raise
        return self

    def _build(self) -> None:
        self.prefix = self._unused_prefix()
        self.bridge = f"{self.prefix}br"
        subnet = free_subnet(int(self.prefix[-3:], 16))
        self.namespaces = [f"{self.prefix}n{i}" for i in range(self.workers)]
        self.addresses = [str(subnet.network_address + i + 1) for i in range(self.workers)]
        run_command(["ip", "link", "add", self.bridge, "type", "bridge"])
        run_command(["ip", "link", "set", self.bridge, "up"])
        for i in range(self.workers):
            self._add_worker(i, subnet.prefixlen)

    def _unused_prefix(self) -> str:
        taken = namespace_names() + link_names()
        for _ in range(100):
            prefix = new_prefix()
            if not any(name.startswith(prefix) for name in taken):
                return prefix
        raise RuntimeError("ShapedNetwork: no unused name prefix found")

    def _host_end(self, i: int) -> str:
        return f"{self.prefix}v{i}"

    def _add_worker(self, i: int, prefixlen: int) -> None:
        namespace, host_end = self.namespaces[i], self._host_end(i)
        run_command(["ip", "netns", "add", namespace])
        run_command(["ip", "-n", namespace, "link", "set", "lo", "up"])
        # Created with its peer already inside the namespace as eth0: no temporary name in the root namespace.
        run_command(["ip", "link", "add", host_end, "type", "veth", "peer", "name", self.interface, "netns", namespace])
        run_command(["ip", "link", "set", host_end, "master", self.bridge, "up"])
        run_command(["ip", "-n", namespace, "addr", "add", f"{self.addresses[i]}/{prefixlen}", "dev", self.interface])
        run_command(["ip", "-n", namespace, "link", "set", self.interface, "up"])
        if self.rate_bps is not None:
            self._add_tbf(self.interface, namespace)  # what the worker sends
            self._add_tbf(host_end, None)  # what the worker receives

    def _add_tbf(self, device: str, namespace: str | None) -> None:
        run_command(self._tbf_command("add", device, namespace))

    def _tbf_command(self, verb: str, device: str, namespace: str | None) -> list[str]:
        where = ["-n", namespace] if namespace is not None else []
        return ["tc", *where, "qdisc", verb, "dev", device, "root", "tbf", "rate", f"{self.rate_bps}bit",
                "burst", str(self.burst_bytes), "latency", f"{self.latency_ms:g}ms"]

    def set_rate(self, rate_bps: int) -> None:
        """Every link's rate, both ends, changed in place (``tc qdisc change``) while the workers run; the burst
        follows the rate unless one was given. For a bandwidth schedule (``gcomp.bench.rate_control``)."""
        if self.rate_bps is None or not self._active:
            raise RuntimeError("ShapedNetwork.set_rate: only a shaped network, while entered, has tbf to change")
        if rate_bps is None or rate_bps <= 0:
            raise ValueError(f"ShapedNetwork.set_rate: rate_bps must be positive; got {rate_bps!r}")
        self.rate_bps = rate_bps
        if not self._burst_given:
            self.burst_bytes = default_burst_bytes(rate_bps)
        for i in range(self.workers):
            run_command(self._tbf_command("change", self.interface, self.namespaces[i]))
            run_command(self._tbf_command("change", self._host_end(i), None))

    # -- using --------------------------------------------------------------------------------------------------

    def prefix_command(self, i: int, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside worker ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[i], *argv]

    def env(self, i: int) -> dict[str, str]:
        """Environment worker ``i`` needs on top of its own: gloo must use the shaped interface."""
        return {"GLOO_SOCKET_IFNAME": self.interface}

    # -- tearing down -------------------------------------------------------------------------------------------

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """Delete every namespace and link with this network's prefix; safe to call again, or after a failure."""
        if os.getpid() != self._owner_pid:
            return  # a forked child must not tear down its parent's network
        self._active = False
        atexit.unregister(self._close_at_exit)
        self._restore_sigterm()
        if not self.prefix:
            return
        for _ in range(2):  # a second pass for what a first deletion could not reach yet
            namespaces, links = self._leftovers()
            if not namespaces and not links:
                return
            delete_names(namespaces, links)
        namespaces, links = self._leftovers()
        if namespaces or links:
            raise RuntimeError(f"ShapedNetwork: could not delete {', '.join(namespaces + links)}")

    def _leftovers(self) -> tuple[list[str], list[str]]:
        """Namespaces and links that still carry this network's prefix (unique to this run, so all ours)."""
        return ([name for name in namespace_names() if name.startswith(self.prefix)],
                [name for name in link_names() if name.startswith(self.prefix)])

    def _close_quietly(self) -> None:
        try:
            self.close()
        except Exception as error:
            print(f"gcomp.bench.netem: cleanup failed: {error}", file=sys.stderr)

    def _close_at_exit(self) -> None:
        self._close_quietly()

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread
        self._previous_sigterm = signal.signal(signal.SIGTERM, self._on_sigterm)
        self._sigterm_installed = True

    def _restore_sigterm(self) -> None:
        if not self._sigterm_installed or threading.current_thread() is not threading.main_thread():
            return
        self._sigterm_installed = False
        # Only if still ours: a handler installed after ours (say, a second network) stays in place.
        if signal.getsignal(signal.SIGTERM) == self._on_sigterm:
            signal.signal(signal.SIGTERM, self._previous_sigterm if self._previous_sigterm is not None
                          else signal.SIG_DFL)

    def _on_sigterm(self, signum: int, frame) -> None:
        previous = self._previous_sigterm
        self._close_quietly()
        if callable(previous):
            previous(signum, frame)
        raise SystemExit(128 + signum)
