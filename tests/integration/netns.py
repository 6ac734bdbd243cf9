"""Network namespaces joined by a bridge, as stand-ins for hosts: each "node" gets its own
network stack and address (10.77.0.N/24 on eth0), loopback included; a bridge in a
namespace of its own joins them, so nothing on the machine's own network changes. Every
namespace is named with a prefix unique to the caller and removed by that name.

Needs root (CAP_NET_ADMIN) and iproute2; `available()` says why not where they are missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess

SUBNET = "10.77.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=30)


def available() -> str:
    """Empty if namespaces can be made here, else why not."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "iproute2 (ip) and util-linux (unshare) are needed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"fmprobe{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("-n", probe, "link", "add", "br0", "type", "bridge")
    except (subprocess.CalledProcessError, OSError) as exc:
        return f"network namespaces with a bridge cannot be created here: {getattr(exc, 'stderr', exc)}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


class Nodes:
    """`nodes[name]` is the address of the node called `name`; `command(name, argv,
    hostname)` runs argv inside it, with its own hostname (a UTS namespace) if given."""

    def __init__(self, prefix: str, names: list[str]):
        self.prefix, self.names = prefix, list(names)
        self.addresses = {name: f"{SUBNET}.{i + 1}" for i, name in enumerate(names)}
        self.made: list[str] = []

    def ns(self, name: str) -> str:
        return f"{self.prefix}-{name}"

    def __getitem__(self, name: str) -> str:
        return self.addresses[name]

    def __enter__(self) -> "Nodes":
        try:
            bridge = self._add("bridge")
            _ip("-n", bridge, "link", "add", "br0", "type", "bridge")
            _ip("-n", bridge, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                ns = self._add(name)
                port = f"port{i}"  # interface names are per namespace: no clash with other runs
                _ip("-n", bridge, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
                _ip("-n", bridge, "link", "set", port, "master", "br0", "up")
                _ip("-n", ns, "addr", "add", f"{self.addresses[name]}/24", "dev", "eth0")
                _ip("-n", ns, "link", "set", "eth0", "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _add(self, name: str) -> str:
        ns = self.ns(name)
        _ip("netns", "add", ns)
        self.made.append(ns)
        return ns

    def command(self, name: str, argv: list[str], hostname: str = "") -> list[str]:
        inner = ["ip", "netns", "exec", self.ns(name)]
        if hostname:
            return inner + ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', hostname, *argv]
        return inner + argv

    def remove(self) -> None:
        """Deletes the namespaces this object made, by name (their veths go with them)."""
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.made.clear()
