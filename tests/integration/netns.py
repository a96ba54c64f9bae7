"""Hosts for tests that cross a network on one machine: network namespaces, each linked to
this one by a veth pair and routed through it, made and removed by the test (needs root
and iproute2). Two such hosts reach each other only over IP, as two machines would."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass


def available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@dataclass(frozen=True)
class Host:
    name: str  # the namespace
    address: str  # its address, reachable from here and from the other hosts
    link: str  # this side's end of its veth pair

    def cut(self) -> None:
        """Unplug the host's only link."""
        _ip("link", "set", self.link, "down")


class Hosts:
    def __init__(self, count: int, tag: str = f"{os.getpid() % 10000}"):
        self.hosts = [Host(f"pdc{tag}h{i}", f"10.{200 + i}.{int(tag) % 250}.2", f"pdc{tag}v{i}") for i in range(count)]
        self._forwarding = ""

    def __enter__(self) -> list[Host]:
        with open("/proc/sys/net/ipv4/ip_forward") as flag:
            self._forwarding = flag.read().strip()
        try:
            for host in self.hosts:
                gateway = host.address.rsplit(".", 1)[0] + ".1"
                _ip("netns", "add", host.name)
                _ip("link", "add", host.link, "type", "veth", "peer", "name", "eth0", "netns", host.name)
                _ip("addr", "add", f"{gateway}/24", "dev", host.link)
                _ip("link", "set", host.link, "up")
                _ip("-n", host.name, "addr", "add", f"{host.address}/24", "dev", "eth0")
                _ip("-n", host.name, "link", "set", "eth0", "up")
                _ip("-n", host.name, "link", "set", "lo", "up")
                _ip("-n", host.name, "route", "add", "default", "via", gateway)
            with open("/proc/sys/net/ipv4/ip_forward", "w") as flag:
                flag.write("1")
        except BaseException:
            self.__exit__()
            raise
        return self.hosts

    def __exit__(self, *exc_info) -> None:
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)  # takes its veth pair along
            subprocess.run(["ip", "link", "del", host.link], capture_output=True)
        if self._forwarding:
            with open("/proc/sys/net/ipv4/ip_forward", "w") as flag:
                flag.write(self._forwarding)
