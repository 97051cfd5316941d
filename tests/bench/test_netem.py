"""Shaped networks: the burst everywhere; namespaces, shaping and cleanup where root and iproute2 allow it (the
rate parsing is checked in ``tests/link/test_rates.py``)."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

from gcomp.bench import netem
from gcomp.bench.netem import ShapedNetwork, cleanup_stale, permitted
from gcomp.bench.throughput import measure_throughput_bps
from gcomp.link import parse_rate

GCOMP_DIR = os.path.dirname(os.path.dirname(netem.__file__))


def test_default_burst_covers_rate_over_hz_and_one_gso_segment():
    assert netem.default_burst_bytes(100_000_000) == 65536  # 50 000 B of 4 ms, raised to one 64 KiB segment
    assert netem.default_burst_bytes(10_000_000_000) == 5_000_000  # 4 ms at 10 Gbit/s


@pytest.mark.parametrize("kwargs", [dict(workers=0, rate_bps=None), dict(workers=100, rate_bps=None),
                                    dict(workers=2, rate_bps=0), dict(workers=2, rate_bps=None, latency_ms=0)])
def test_shaped_network_rejects_bad_arguments_before_touching_anything(kwargs):
    with pytest.raises(ValueError, match="ShapedNetwork"):
        ShapedNetwork(**kwargs)


def test_permitted_answers_a_bool_and_a_reason():
    ok, why = permitted()
    assert isinstance(ok, bool) and isinstance(why, str)
    assert (why == "") if ok else ("running unshaped" in why)


@pytest.fixture(scope="module")
def shaping():
    ok, why = permitted()
    if not ok:
        pytest.skip(why)


def ours(prefix: str) -> list[str]:
    """Every namespace and root-namespace link whose name starts with ``prefix``."""
    return [name for name in netem.namespace_names() + netem.link_names() if name.startswith(prefix)]


def reaches(network: ShapedNetwork, source: int, target: int) -> bool:
    if shutil.which("ping"):
        argv = network.prefix_command(source, ["ping", "-c1", "-W1", network.addresses[target]])
        return subprocess.run(argv, capture_output=True).returncode == 0
    return measure_throughput_bps(network, source, target, nbytes=100_000, timeout_s=5) > 0  # no ping here


def test_unshaped_network_connects_workers_and_leaves_nothing(shaping):
    with ShapedNetwork(2, None) as network:
        assert len(network.namespaces) == 2 and network.interface == "eth0" and network.rate_bps is None
        assert set(network.namespaces) <= set(netem.namespace_names())
        assert network.bridge in netem.link_names()
        assert network.addresses[1] == network.addresses[0][:-1] + "2"
        assert network.prefix_command(1, ["true"]) == ["ip", "netns", "exec", network.namespaces[1], "true"]
        assert network.env(0) == {"GLOO_SOCKET_IFNAME": "eth0"}
        assert all(len(name) <= 15 for name in netem.link_names() if name.startswith(network.prefix))
        assert reaches(network, 0, 1) and reaches(network, 1, 0)
    assert ours(network.prefix) == []
    network.close()  # idempotent


def test_100mbit_link_carries_about_100_mbit_per_second(shaping):
    with ShapedNetwork(2, parse_rate("100mbit")) as network:
        bps = measure_throughput_bps(network, 0, 1, nbytes=4_000_000)
    assert 50e6 < bps < 120e6, f"{bps / 1e6:.1f} Mbit/s through a 100mbit link"
    assert ours(network.prefix) == []


@pytest.mark.parametrize("interruption", [ValueError, KeyboardInterrupt])
def test_an_exception_inside_the_block_still_deletes_everything(shaping, interruption):
    with pytest.raises(interruption):
        with ShapedNetwork(2, parse_rate("1gbit")) as network:
            assert len(ours(network.prefix)) == 5  # 2 namespaces, 2 host-side veth ends, 1 bridge
            raise interruption()
    assert ours(network.prefix) == []


def test_a_failure_halfway_through_enter_deletes_what_was_created(shaping, monkeypatch):
    seen_at_failure = []

    def failing_tbf(self, device, namespace):
        seen_at_failure.extend(ours(self.prefix))
        raise RuntimeError("tc refused (simulated)")

    monkeypatch.setattr(ShapedNetwork, "_add_tbf", failing_tbf)
    network = ShapedNetwork(3, parse_rate("100mbit"))
    with pytest.raises(RuntimeError, match="simulated"):
        network.__enter__()
    assert network.namespaces[0] in seen_at_failure and network.bridge in seen_at_failure
    assert ours(network.prefix) == []
    assert signal.getsignal(signal.SIGTERM) is not network._on_sigterm  # the handler went with the network


def child_network(tail: str) -> subprocess.Popen:
    """A fresh interpreter that imports netem (and netns) without gcomp/__init__.py, so without torch, enters a
    network, prints its prefix."""
    script = textwrap.dedent(f"""
        import sys, time, types
        package = types.ModuleType("gcomp")
        package.__path__ = [{GCOMP_DIR!r}]  # gcomp's modules, but not its __init__ (torch, every method)
        sys.modules["gcomp"] = package
        from gcomp.bench import netem
        assert "torch" not in sys.modules
        network = netem.ShapedNetwork(2, None).__enter__()
        print(network.prefix, flush=True)
    """) + tail
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def test_sigterm_while_active_cleans_up_and_exits(shaping):
    child = child_network("time.sleep(30)\n")
    prefix = child.stdout.readline().strip()
    assert prefix and len(ours(prefix)) == 5
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=15) == 128 + signal.SIGTERM, child.stderr.read()
    assert ours(prefix) == []


def test_interpreter_exit_without_close_cleans_up(shaping):
    child = child_network("")
    out, err = child.communicate(timeout=15)
    assert child.returncode == 0, err
    prefix = out.strip()
    assert prefix and ours(prefix) == []


def test_cleanup_stale_removes_only_what_dead_owners_left(shaping):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale_namespace = f"gc{dead.pid:07d}fffn0"
    subprocess.run(["ip", "netns", "add", stale_namespace], check=True)
    try:
        with ShapedNetwork(1, None) as network:  # alive: its owner is this process
            assert stale_namespace in cleanup_stale()
            assert stale_namespace not in netem.namespace_names()
            assert len(ours(network.prefix)) == 3  # untouched
    finally:
        subprocess.run(["ip", "netns", "del", stale_namespace], capture_output=True)
