"""What ``gcomp.bench.netem``'s shaped networks stand on: commands run (``run_command``), the network namespaces
and root-namespace links present, whether shaping is permitted here (``permitted``), a free subnet, and the
cleanup of what killed runs left behind (``cleanup_stale``).

Names: everything one ``ShapedNetwork`` creates starts with its prefix ``gc<pid, 7 digits><3 random hex>``
(``new_prefix``). The pid in the name lets ``cleanup_stale`` find what a killed run left behind; only names
with that exact form are ever touched. Needs root, ``ip`` and ``tc`` (iproute2).
"""
from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shlex
import shutil
import subprocess
from typing import Sequence

PREFIX = "gc"
SUBNET_BASE = "10.213"


def run_command(argv: Sequence[str]) -> str:
    """Run a command; on failure a RuntimeError showing the command and its stderr."""
    try:
        done = subprocess.run(list(argv), check=True, capture_output=True, text=True)
    except subprocess.CalledProcessError as error:
        raise RuntimeError(f"command failed (exit {error.returncode}): {shlex.join(argv)}\n"
                           f"{(error.stderr or '').strip()}") from None
    except OSError as error:
        raise RuntimeError(f"command failed: {shlex.join(argv)}\n{error}") from None
    return done.stdout


def run_quietly(argv: Sequence[str]) -> bool:
    """Run a command whose failure is expected at times (deleting what may be gone already)."""
    try:
        return subprocess.run(list(argv), capture_output=True).returncode == 0
    except OSError:
        return False


def namespace_names() -> list[str]:
    """Every network namespace that ``ip netns`` knows, by name."""
    return [line.split()[0] for line in run_command(["ip", "netns", "list"]).splitlines() if line.strip()]


def link_names() -> list[str]:
    """Every interface in the root namespace, by name (without the ``@peer`` suffix)."""
    names = []
    for line in run_command(["ip", "-o", "link", "show"]).splitlines():
        fields = line.split(": ", 2)
        if len(fields) >= 2:
            names.append(fields[1].split("@")[0])
    return names


def new_prefix() -> str:
    """``gc<pid, 7 digits><3 random hex>``: unique per run, and the pid says whether its owner is still alive."""
    return f"{PREFIX}{os.getpid() % 10**7:07d}{secrets.token_hex(2)[:3]}"


def permitted() -> tuple[bool, str]:
    """Whether namespaces, veth pairs and tbf can be created here: ``(True, "")`` or ``(False, why)``."""
    try:
        if os.geteuid() != 0:
            return False, "bandwidth shaping needs root: running unshaped"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return False, f"bandwidth shaping needs '{tool}' (iproute2) on PATH: running unshaped"
        return _probe()
    except Exception as error:  # never raise: the caller only wants to know whether to shape
        return False, f"bandwidth shaping is unavailable ({error}): running unshaped"


def _probe() -> tuple[bool, str]:
    """Build a bridge, a veth pair and a tbf inside a throwaway namespace (nothing outside it is touched)."""
    namespace = new_prefix() + "probe"
    try:
        run_command(["ip", "netns", "add", namespace])
        run_command(["ip", "-n", namespace, "link", "add", "pbr", "type", "bridge"])
        run_command(["ip", "-n", namespace, "link", "add", "pa", "type", "veth", "peer", "name", "pb"])
        run_command(["tc", "-n", namespace, "qdisc", "add", "dev", "pa", "root", "tbf", "rate", "1mbit", "burst", "16000",
              "latency", "50ms"])
    except RuntimeError as error:
        reason = str(error).splitlines()[-1]
        return False, f"cannot create network namespaces, veth pairs or tbf here ({reason}): running unshaped"
    finally:
        run_quietly(["ip", "netns", "del", namespace])
    return True, ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_names(namespaces: Sequence[str], links: Sequence[str]) -> None:
    """Delete namespaces (which takes their veth ends, and so the pairs) then root-namespace links, quietly."""
    for name in namespaces:
        run_quietly(["ip", "netns", "del", name])
    for name in links:
        run_quietly(["ip", "link", "del", name])


def cleanup_stale(prefix: str = PREFIX) -> list[str]:
    """Remove namespaces and links named ``<prefix><pid, 7 digits><3 hex>...`` whose pid is no longer alive.

    Returns the names removed. Anything whose owner still runs, or whose name has another form, is left alone.
    """
    owner = re.compile(rf"^{re.escape(prefix)}(\d{{7}})[0-9a-f]{{3}}")
    namespaces, links = namespace_names(), link_names()

    def stale(name: str) -> bool:
        match = owner.match(name)
        return match is not None and not _pid_alive(int(match.group(1)))

    doomed_namespaces, doomed_links = [n for n in namespaces if stale(n)], [n for n in links if stale(n)]
    doomed = doomed_namespaces + doomed_links
    delete_names(doomed_namespaces, doomed_links)
    remaining = set(namespace_names()) | set(link_names())
    return [name for name in doomed if name not in remaining]


def free_subnet(seed: int) -> ipaddress.IPv4Network:
    """A ``10.213.S.0/24`` that overlaps no IPv4 address or route of the root namespace, starting from ``seed``.

    The workers' namespaces have routing tables of their own, so an overlap would not break them; avoiding it
    keeps ``ip addr`` and packet captures on the host unambiguous.
    """
    used = []
    for line in (run_command(["ip", "-4", "-o", "addr", "show"]) + run_command(["ip", "-4", "route", "show"])).splitlines():
        for token in line.split():
            try:
                used.append(ipaddress.ip_network(token, strict=False))
            except ValueError:
                continue
    for step in range(256):
        subnet = ipaddress.ip_network(f"{SUBNET_BASE}.{(seed + step) % 256}.0/24")
        if not any(subnet.overlaps(other) for other in used if other.version == 4 and other.prefixlen > 0):
            return subnet
    raise RuntimeError(f"no free /24 left in {SUBNET_BASE}.0.0/16 for the shaped network")
