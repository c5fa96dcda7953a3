"""Two emulated PCs: network namespaces joined by a veth pair (root only). Agents in one, the main PC in the other:
mDNS over a real multicast link, pairing, status, and a cut link named by its exact address."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.netns, pytest.mark.slow]

A_ADDR, B_ADDR = "10.213.0.1", "10.213.0.2"


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, timeout=20)


@pytest.fixture
def two_pcs() -> Iterator[tuple[str, str]]:
    tag = f"{os.getpid() % 100000}"
    a, b = f"sn-a-{tag}", f"sn-b-{tag}"
    va, vb = f"sva{tag}", f"svb{tag}"
    try:
        sh("ip", "netns", "add", a)
        sh("ip", "netns", "add", b)
        sh("ip", "link", "add", va, "type", "veth", "peer", "name", vb)
        sh("ip", "link", "set", va, "netns", a)
        sh("ip", "link", "set", vb, "netns", b)
        for ns, dev, addr in ((a, va, A_ADDR), (b, vb, B_ADDR)):
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            sh("ip", "-n", ns, "link", "set", dev, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
            sh("ip", "-n", ns, "route", "add", "224.0.0.0/4", "dev", dev)
        yield a, b
    finally:
        for ns in (a, b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=20)


def in_ns(ns: str, data: Path, *args: str, ok: bool = True) -> dict[str, Any]:
    r = subprocess.run(
        [
            "ip",
            "netns",
            "exec",
            ns,
            "env",
            f"STRATA_DATA_DIR={data}",
            sys.executable,
            "-m",
            "engine.node.cli",
            *args,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parents[3],
    )
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] is ok, (args, r.stdout, r.stderr)
    return out


def start_agent(ns: str, data: Path, port: int, name: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    node_cli = [
        "ip",
        "netns",
        "exec",
        ns,
        "env",
        f"STRATA_DATA_DIR={data}",
        sys.executable,
        "-m",
        "engine.node.cli",
    ]
    proc = subprocess.Popen(
        [*node_cli, "serve", "--host", A_ADDR, "--port", str(port), "--name", name, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
    )
    assert proc.stdout is not None
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        ev = json.loads(line)
        if ev["event"] == "ready":
            return proc, ev
    proc.kill()
    raise AssertionError(f"agent did not start: {proc.stderr.read() if proc.stderr else ''}")


def test_discover_pair_status_and_a_cut_link(two_pcs: tuple[str, str], tmp_path: Path) -> None:
    a, b = two_pcs
    procs = []
    try:
        p1, r1 = start_agent(a, tmp_path / "pc1", 7460, "pc1")
        p2, r2 = start_agent(a, tmp_path / "pc2", 7470, "pc2")
        procs += [p1, p2]
        main = tmp_path / "main"
        found = in_ns(b, main, "discover", "--timeout", "2.5", "--interface", B_ADDR)["agents"]
        by_name = {f["name"]: f for f in found}
        assert set(by_name) == {"pc1", "pc2"}
        for name, ready in (("pc1", r1), ("pc2", r2)):
            f = by_name[name]
            assert f["addresses"] == [A_ADDR] and f["port"] == ready["port"]
            assert (
                f["answers_fingerprint"] == ready["fingerprint"] == f["fingerprint"] and f["advert_matches"]
            )
        paired = in_ns(
            b,
            main,
            "pair",
            f"{A_ADDR}:7460",
            "--code",
            r1["pairing_code"],
            "--fingerprint",
            r1["fingerprint"],
        )
        assert paired["node"]["address"] == f"{A_ADDR}:7460"
        st = in_ns(b, main, "status", "--timeout", "2")["nodes"][0]
        assert st["reachable"] is True

        sh("ip", "-n", a, "link", "set", f"sva{os.getpid() % 100000}", "down")  # the cable is pulled
        down = in_ns(b, main, "status", "--timeout", "1.5")["nodes"][0]
        assert down["reachable"] is False and f"tcp://{A_ADDR}:7460" in down["problem"]
        sh("ip", "-n", a, "link", "set", f"sva{os.getpid() % 100000}", "up")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if in_ns(b, main, "status", "--timeout", "2")["nodes"][0]["reachable"]:
                break
        else:
            raise AssertionError("the agent did not come back after the link came up")
    finally:
        for p in procs:
            p.terminate()
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
