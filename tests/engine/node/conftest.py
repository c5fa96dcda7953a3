"""Real agents on loopback: in a thread of the test process (cheap) or as `strata-node serve` processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from engine.node.agent import Agent, AgentOptions
from engine.node.client import NodeClient, NodeRecord, NodeRegistry, identify, pair
from engine.node.keys import KeyPair


@pytest.fixture(autouse=True)
def _data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The main PC's keys and paired nodes live in this test's folder."""
    d = tmp_path / "main-data"
    monkeypatch.setenv("STRATA_DATA_DIR", str(d))
    return d


@pytest.fixture
def make_agent(tmp_path: Path) -> Iterator[Callable[..., Agent]]:
    agents: list[Agent] = []

    def make(name: str = "pc1", **kw: Any) -> Agent:
        opts = AgentOptions(
            data_dir=kw.pop("data_dir", tmp_path / f"agent-{name}"),
            host="127.0.0.1",
            port=kw.pop("port", 0),
            name=name,
            advertise=kw.pop("advertise", False),
            reserve_bytes=kw.pop("reserve_bytes", 0),
            **kw,
        )
        a = Agent(opts).start()
        agents.append(a)
        return a

    yield make
    for a in agents:
        a.close()


@dataclass
class Paired:
    agent: Agent
    keys: KeyPair
    record: NodeRecord
    client: NodeClient


def pair_with(agent: Agent, keys: KeyPair | None = None, timeout: float = 5.0) -> Paired:
    keys = keys or KeyPair.generate()
    ident = identify("127.0.0.1", agent.port, id_port=agent.id_port)
    assert agent.code is not None
    rec = pair(
        "127.0.0.1",
        agent.port,
        agent.code,
        ident.fingerprint,
        keys,
        NodeRegistry(),
        "test-main",
        id_port=agent.id_port,
    )
    return Paired(agent, keys, rec, NodeClient.for_record(rec, keys, timeout))


@pytest.fixture
def paired(make_agent: Callable[..., Agent]) -> Iterator[Paired]:
    p = pair_with(make_agent())
    yield p
    p.client.close()


# -- agents as processes ---------------------------------------------------------------------------------------


def free_port() -> int:
    """A port for an agent whose own ports (this one and the next) and worker ports (10 to 29 above) are free now.
    Chosen below Linux's ephemeral range (32768 and up), where outgoing connections take their ports: one of them
    holding a worker port made a test flaky."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 32700)
        try:
            for p in range(port, port + 30):
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no 30 free neighbouring ports below 32700")


class AgentProc:
    """`strata-node serve --json` in its own process; the ready event gives fingerprint and code."""

    def __init__(self, data_dir: Path, port: int, *extra: str, env: dict[str, str] | None = None) -> None:
        self.data_dir, self.port = data_dir, port
        e = dict(os.environ)
        e["STRATA_DATA_DIR"] = str(data_dir)
        e.update(env or {})
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "engine.node.cli",
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--json",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=e,
        )
        self.ready: dict[str, Any] = {}
        deadline = time.monotonic() + 30
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the agent ended: {self.proc.stderr.read() if self.proc.stderr else ''}")
            ev = json.loads(line)
            if ev.get("event") == "ready":
                self.ready = ev
                return
        raise RuntimeError("the agent did not get ready in 30 s")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
