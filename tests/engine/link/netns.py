"""A second "PC" for the link tests: a network namespace joined to this one by a veth pair (root only). Everything
it creates carries this process's id in its name and is removed on close; nothing else is touched."""

import os
import shutil
import subprocess
from dataclasses import dataclass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=20)


@dataclass
class Peer:
    ns: str
    host_if: str
    peer_if: str
    host_addr: str
    peer_addr: str

    @classmethod
    def create(cls, tag: str = "a") -> "Peer":
        pid = os.getpid()
        ns, host_if, peer_if = f"strata-t{pid}{tag}", f"st{pid % 100000}{tag}h", f"st{pid % 100000}{tag}p"
        octet = 16 + pid % 200
        peer = cls(ns, host_if, peer_if, f"10.{octet}.77.1", f"10.{octet}.77.2")
        try:
            _ip("netns", "add", ns)
            _ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if, "netns", ns)
            _ip("addr", "add", f"{peer.host_addr}/30", "dev", host_if)
            _ip("-n", ns, "addr", "add", f"{peer.peer_addr}/30", "dev", peer_if)
            _ip("link", "set", host_if, "up")
            _ip("-n", ns, "link", "set", peer_if, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired):
            peer.close()
            raise
        return peer

    def shape(self, *netem: str) -> bool:
        """netem on both ends (e.g. "delay", "2ms", "0.5ms"); False where the kernel has no netem or `tc` is not
        on PATH (iproute2 puts it in /usr/sbin, which a user's PATH may lack)."""
        if shutil.which("tc") is None:
            return False
        for args in (["tc", "qdisc", "replace", "dev", self.host_if, "root", "netem", *netem],
                     ["ip", "netns", "exec", self.ns, "tc", "qdisc", "replace", "dev", self.peer_if, "root", "netem",
                      *netem]):  # fmt: skip
            r = subprocess.run(args, capture_output=True, text=True, timeout=20)
            if r.returncode != 0:
                return False
        return True

    def rate(self, rate: str) -> bool:
        """A rate limit on both ends with tbf (e.g. "1gbit")."""
        if shutil.which("tc") is None:
            return False
        for dev, pre in ((self.host_if, []), (self.peer_if, ["ip", "netns", "exec", self.ns])):
            args = [*pre, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", "256kb",
                    "latency", "20ms"]  # fmt: skip
            if subprocess.run(args, capture_output=True, text=True, timeout=20).returncode != 0:
                return False
        return True

    def link(self, up: bool) -> None:
        _ip("link", "set", self.host_if, "up" if up else "down")

    def exec_prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.ns]

    def close(self) -> None:
        _ip("link", "del", self.host_if, check=False)  # removes the peer end too
        _ip("netns", "del", self.ns, check=False)


def netem_available() -> bool:
    p = Peer.create("n")
    try:
        return p.shape("delay", "1ms")
    finally:
        p.close()
