"""`strata-node` as the app runs it: subprocesses with --json, a real agent process on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.engine.node.conftest import AgentProc, free_port


def node(main_dir: Path, *args: str, ok: bool = True) -> dict[str, Any]:
    env = {**os.environ, "STRATA_DATA_DIR": str(main_dir)}
    r = subprocess.run(
        [sys.executable, "-m", "engine.node.cli", *args, "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ok"] is ok and (r.returncode == 0) is ok, (args, r.stdout, r.stderr)
    return out


def test_pair_list_status_include_forget(tmp_path: Path) -> None:
    port = free_port()
    agent = AgentProc(tmp_path / "worker-pc", port, "--no-mdns", "--name", "gpu-box")
    main = tmp_path / "main-pc"
    try:
        code, fp = agent.ready["pairing_code"], agent.ready["fingerprint"]
        local = node(tmp_path / "worker-pc", "local")
        assert (local["running"], local["pairing_code"], local["fingerprint"], local["paired"]) == (
            True,
            code,
            fp,
            False,
        )

        ident = node(main, "identify", f"127.0.0.1:{port}")
        assert (ident["name"], ident["fingerprint"]) == ("gpu-box", fp)
        bad = node(main, "pair", f"127.0.0.1:{port}", "--code", "AAAA-AAAA", "--fingerprint", fp, ok=False)
        assert bad["code"] == "wrong_code"
        needs_fp = node(main, "pair", f"127.0.0.1:{port}", "--code", code, ok=False)
        assert needs_fp["code"] == "fingerprint_needed"
        paired = node(main, "pair", f"127.0.0.1:{port}", "--code", code, "--fingerprint", fp)
        assert paired["node"]["fingerprint"] == fp and paired["node"]["address"] == f"127.0.0.1:{port}"
        assert node(tmp_path / "worker-pc", "local")["paired"] is True

        listed = node(main, "list")["nodes"]
        assert [(n["name"], n["included"]) for n in listed] == [("gpu-box", True)]
        st = node(main, "status")["nodes"][0]
        assert st["reachable"] is True and st["pc"]["hostname"] and st["workers"] == []
        assert node(main, "exclude", "gpu-box")["node"]["included"] is False
        assert node(main, "include", fp)["node"]["included"] is True
        assert node(main, "files", "gpu-box")["files"] == []

        agent.stop()
        down = node(main, "status", "gpu-box", "--timeout", "1")["nodes"][0]
        assert down["reachable"] is False and f"tcp://127.0.0.1:{port}" in down["problem"]
        assert down["problem_code"] == "unreachable"
        agent = AgentProc(tmp_path / "worker-pc", port, "--no-mdns", "--name", "gpu-box")
        gone = node(main, "forget", "gpu-box")
        assert gone["agent_told"] is True and node(main, "list")["nodes"] == []
        assert node(tmp_path / "worker-pc", "local")["paired"] is False
        unknown = node(main, "status", "gpu-box", ok=False)
        assert unknown["code"] == "unknown"
    finally:
        agent.stop()


def test_serve_refuses_a_busy_port_and_says_so(tmp_path: Path) -> None:
    port = free_port()
    agent = AgentProc(tmp_path / "a", port, "--no-mdns")
    try:
        env = {**os.environ, "STRATA_DATA_DIR": str(tmp_path / "b")}
        r = subprocess.run(
            [sys.executable, "-m", "engine.node.cli", "serve", "--port", str(port), "--no-mdns"],
            capture_output=True,
            text=True,
            env=env,
            timeout=30,
        )
        assert r.returncode == 1 and f"cannot listen on 127.0.0.1:{port}" in r.stderr
        assert "other PCs cannot reach this agent" in r.stderr  # the loopback note
    finally:
        agent.stop()
