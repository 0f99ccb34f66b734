"""Emulated hosts on one machine: network namespaces joined by a bridge, each host link capped with tbf.

Used by ``benchmarks/two_hosts.py`` and ``benchmarks/cluster.py``. Every host
is a namespace with one veth into a switch namespace holding a bridge; both
ends of each host's veth carry a token-bucket filter (``tc ... tbf``), so a
host sends and receives at most ``rate`` (full duplex, like a NIC). Ranks in
one namespace talk over loopback, uncapped. Needs root and iproute2. Names
carry this process's id; everything is removed on exit, on failure and on
Ctrl-C (deleting a namespace deletes the links inside it).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from typing import List, Tuple

__all__ = ["EmulatedCluster", "can_emulate", "parse_rate"]

SUBNET = "10.231.{}.{}"


def can_emulate() -> str:
    """Why hosts cannot be emulated here ('' when they can)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc)"
    missing = [tool for tool in ("ip", "tc") if not shutil.which(tool)]
    return f"needs iproute2's {' and '.join(missing)}" if missing else ""


def parse_rate(rate: str) -> float:
    """tc's rate syntax ('100mbit', '1gbit', '10Gbit', '500kbit') in bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmgt]?)bit\s*", rate.lower())
    if not m:
        raise ValueError(f"rate must look like 100mbit / 1gbit, got {rate!r}")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2)]


def _sh(*cmd: str) -> None:
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")


class EmulatedCluster:
    """Context manager owning ``hosts`` namespaces, the switch namespace, the veths and their tbf qdiscs.

    Attributes:
        ns: namespace of each host; ``dev``: its interface (for GLOO_SOCKET_IFNAME);
        ``addr``: its address.
    """

    def __init__(self, hosts: int, rate: str, latency_ms: float = 50):
        if hosts < 2 or hosts > 64:
            raise ValueError(f"hosts must be in [2, 64], got {hosts}")
        tag = f"{os.getpid() % 100000}"
        self.ns = [f"sc_host{tag}h{i}" for i in range(hosts)]
        self.switch = f"sc_host{tag}sw"
        self.dev = [f"sc{tag}h{i}" for i in range(hosts)]
        self.port = [f"sc{tag}p{i}" for i in range(hosts)]
        net = 1 + os.getpid() % 250
        self.addr = [SUBNET.format(net, i + 1) for i in range(hosts)]
        self.rate, self.latency_ms = rate, latency_ms
        parse_rate(rate)

    def _qdisc(self, verb: str, ns: str, dev: str, rate: str) -> None:
        # A burst of ~4 ms at the rate (>= 256 KiB: veth hands tbf 64 KiB GSO packets).
        burst = max(256 * 1024, int(parse_rate(rate) / 8 * 0.004))
        _sh("tc", "-n", ns, "qdisc", verb, "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
            "latency", f"{self.latency_ms}ms")

    def __enter__(self) -> "EmulatedCluster":
        try:
            _sh("ip", "netns", "add", self.switch)
            _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            for ns, dev, port, addr in zip(self.ns, self.dev, self.port, self.addr):
                _sh("ip", "netns", "add", ns)
                _sh("ip", "link", "add", dev, "type", "veth", "peer", "name", port)
                _sh("ip", "link", "set", dev, "netns", ns)
                _sh("ip", "link", "set", port, "netns", self.switch)
                _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                _sh("ip", "-n", self.switch, "link", "set", port, "up")
                _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _sh("ip", "-n", ns, "link", "set", dev, "up")
                _sh("ip", "-n", ns, "link", "set", "lo", "up")
                # Cap both directions of the host's link: its sends here, what the switch sends it there.
                self._qdisc("add", ns, dev, self.rate)
                self._qdisc("add", self.switch, port, self.rate)
        except BaseException:
            self.__exit__()
            raise
        return self

    def set_rate(self, rate: str) -> None:
        """Change every host link's cap (both directions), e.g. between parts of a sweep."""
        for ns, dev, port in zip(self.ns, self.dev, self.port):
            self._qdisc("change", ns, dev, rate)
            self._qdisc("change", self.switch, port, rate)
        self.rate = rate

    def describe(self) -> dict:
        """Names a process inside a host namespace needs to change the rates (:meth:`attach`)."""
        return {"ns": self.ns, "switch": self.switch, "dev": self.dev, "port": self.port, "addr": self.addr,
                "rate": self.rate, "latency_ms": self.latency_ms}

    @classmethod
    def attach(cls, desc: dict) -> "EmulatedCluster":
        """The cluster :meth:`describe` described, without creating or owning anything (for :meth:`set_rate`)."""
        self = cls.__new__(cls)
        for key, value in desc.items():
            setattr(self, key, value)
        return self

    def __exit__(self, *exc) -> None:
        for ns in [*self.ns, self.switch]:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        for dev in [*self.dev, *self.port]:  # only if a failure left one in this namespace
            subprocess.run(["ip", "link", "del", dev], capture_output=True)

    def exists(self) -> bool:
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
        return any(ns in out for ns in [*self.ns, self.switch])

    def names(self) -> List[str]:
        return [*self.ns, self.switch]


def collect(procs: List[subprocess.Popen], deadline: float) -> Tuple[List[Tuple[str, str]], List[int]]:
    """Wait for rank processes until ``deadline`` (``time.monotonic()``); their ``(stdout, stderr)`` and the failed ones.

    A process still running at the deadline counts as failed (its output reads ``"timed out"``).
    """
    outs: List[Tuple[str, str]] = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            outs.append(("", "timed out"))
    return outs, [i for i, p in enumerate(procs) if p.returncode != 0]


def kill_all(procs: List[subprocess.Popen]) -> None:
    """Kill the rank processes still running (after a failure or an interrupt) and reap them."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
