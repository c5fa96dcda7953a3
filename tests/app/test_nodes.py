"""NodeClient and NodesController: what this build's node agent can do, starting it, this PC's cards."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pytestqt.qtbot import QtBot

from app.clients.node_client import NodeClient, agents_from, node_command
from app.controllers.nodes import NodesController, card_lines
from installer.gpus import GIB, GpuInfo, OtherAdapter, ProbeResult

FAKE_NODE = [sys.executable, str(Path(__file__).with_name("fake_node.py"))]


def gpu(index: int, name: str, gb: int, cc: tuple[int, int]) -> GpuInfo:
    return GpuInfo(index, f"GPU-{index}", name, gb * GIB, gb * GIB, cc, "580.65")


SEED_PC = ProbeResult(
    kind="ok",
    gpus=(
        gpu(0, "NVIDIA GeForce RTX 5080", 16, (12, 0)),
        gpu(1, "NVIDIA GeForce GTX 1080 Ti", 11, (6, 1)),
        gpu(2, "NVIDIA GeForce RTX 3090", 24, (8, 6)),
    ),
    driver="580.65",
    others=(OtherAdapter("Intel", "Intel UHD Graphics 770"),),
)


def test_card_lines_are_the_seed_listing() -> None:
    lines, message = card_lines(SEED_PC)
    assert [(c.text, c.usable) for c in lines] == [
        ("GPU 0: NVIDIA GeForce RTX 5080, 16 GB VRAM - can be used", True),
        (
            "GPU 1: NVIDIA GeForce GTX 1080 Ti, 11 GB VRAM - not supported - older than the RTX 20 series "
            "(compute capability 6.1; PolyStrata needs 7.5 or newer)",
            False,
        ),
        ("GPU 2: NVIDIA GeForce RTX 3090, 24 GB VRAM - can be used", True),
        ("Intel UHD Graphics 770 (Intel) - not supported - Intel GPUs are not supported", False),
    ]
    assert message == ""
    none, why = card_lines(ProbeResult(kind="no_nvml", message="No NVIDIA driver found."))
    assert none == [] and why == "No NVIDIA driver found."


def test_agent_without_serve_says_so(qtbot: QtBot, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FAKE_NODE_SERVE", raising=False)
    client = NodeClient(FAKE_NODE)
    with qtbot.waitSignal(client.serveSupport, timeout=5000) as got:
        client.check_serve_support()
    assert got.args == [False, client.serve_detail]
    assert "has no `serve` command yet" in client.serve_detail
    assert not client.start_local_agent()
    assert client.local_state == "stopped"


def test_agent_with_serve_starts_and_shows_its_code(qtbot: QtBot, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_NODE_SERVE", "1")
    client = NodeClient(FAKE_NODE)
    with qtbot.waitSignal(client.serveSupport, timeout=5000) as got:
        client.check_serve_support()
    assert got.args == [True, ""]
    assert client.start_local_agent()
    qtbot.waitUntil(lambda: "port" in client.local_info, timeout=5000)
    assert client.local_state == "running"
    assert client.local_info == {
        "fingerprint": "3F2A-91C0-7B1E-55D0",
        "pairing_code": "482-913",
        "host": "0.0.0.0",  # the app lends this PC on the LAN
        "port": 7460,
    }
    qtbot.waitUntil(lambda: any("mDNS" in ln for ln in client.local_lines), timeout=5000)
    with qtbot.waitSignal(client.localStateChanged, timeout=5000) as state:
        client.stop_local_agent()
    assert state.args[0] == "stopped"


def test_worker_pcs_pair_include_exclude(
    qtbot: QtBot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = tmp_path / "nodes.json"
    found = {
        "name": "pc-b",
        "addresses": ["192.168.1.30"],
        "port": 7460,
        "fingerprint": "AAAA-BBBB",
        "gpus": "RTX 3070 8 GB",
        "answers_fingerprint": "AAAA-BBBB",
        "advert_matches": True,
        "paired": False,
        "address": "192.168.1.30",
    }
    silent = {
        "name": "pc-c",
        "addresses": ["192.168.1.31"],
        "port": 7460,
        "fingerprint": "CCCC-DDDD",
        "gpus": "",
        "answers_fingerprint": None,
    }
    state.write_text(json.dumps({"nodes": [], "agents": [found, silent]}))
    monkeypatch.setenv("FAKE_NODE_STATE", str(state))
    client = NodeClient(FAKE_NODE)
    with qtbot.waitSignal(client.agentsChanged, timeout=10000) as got:
        client.refresh_agents(discover_s=0.1)
    assert [(a.name, a.address, a.paired, a.reachable) for a in got.args[0]] == [
        ("pc-b", "192.168.1.30:7460", False, True),
        ("pc-c", "192.168.1.31:7460", False, False),
    ]
    assert got.args[0][1].problem == "advertised on the LAN but does not answer at 192.168.1.31:7460"
    with qtbot.waitSignal(client.commandFailed, timeout=10000) as bad:
        client.pair("192.168.1.30", "000-000", "AAAA-BBBB")
    assert bad.args[0] == "the agent at 192.168.1.30 refused code 000-000"
    with qtbot.waitSignal(client.agentsChanged, timeout=10000) as got:
        client.pair("192.168.1.30", "482-913", "AAAA-BBBB")
    paired = got.args[0][0]
    assert (paired.name, paired.paired, paired.gpus, paired.included) == (
        "pc-b",
        True,
        ("NVIDIA GeForce RTX 3070",),
        True,
    )
    assert [a.name for a in got.args[0]] == ["pc-b", "pc-c"]
    with qtbot.waitSignal(client.agentsChanged, timeout=10000) as got:
        client.set_included("AAAA-BBBB", False)
    assert got.args[0][0].included is False

    # A refresh asked while one is under way (a pairing that ended meanwhile) runs after it, with fresh answers
    lists: list[list] = []
    client.agentsChanged.connect(lambda agents: lists.append(agents))
    client.refresh_agents(None)
    state.write_text(json.dumps({"nodes": [], "agents": []}))  # the second answer differs from the first
    client.refresh_agents(None)
    qtbot.waitUntil(lambda: len(lists) == 2, timeout=10000)
    assert lists[1] == [] and not client.refreshing


def test_agents_from_reports_the_failing_address() -> None:
    status = {
        "nodes": [
            {
                "name": "pc-d",
                "address": "10.0.0.5:7460",
                "fingerprint": "EEEE",
                "reachable": False,
                "problem": "no answer from 10.0.0.5:7460 within 5 s: is the agent running there?",
            }
        ]
    }
    (a,) = agents_from(status, {"agents": [{"fingerprint": "EEEE", "addresses": ["10.0.0.5"], "port": 7460}]})
    assert (a.paired, a.reachable) == (True, False) and "10.0.0.5:7460" in a.problem


def test_real_node_agent_is_reported_as_it_is(qtbot: QtBot) -> None:
    """Whatever this build's `strata-node` can do, the app says the same as `strata-node serve --help`."""
    cmd = node_command()
    has_serve = subprocess.run([*cmd, "serve", "--help"], capture_output=True, timeout=60).returncode == 0
    client = NodeClient()
    with qtbot.waitSignal(client.serveSupport, timeout=60000) as got:
        client.check_serve_support()
    assert got.args[0] is has_serve


def test_nodes_controller_lists_this_pc(qtbot: QtBot, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FAKE_NODE_SERVE", raising=False)
    nodes = NodesController(NodeClient(FAKE_NODE), probe_fn=lambda: SEED_PC)
    nodes.refresh()
    qtbot.waitUntil(lambda: bool(nodes.cards) and nodes.serve_supported is not None, timeout=5000)
    assert len(nodes.cards) == 4 and nodes.cards[0].usable
    assert nodes.agents == []
    assert nodes.serve_supported is False and not nodes.add_this_pc()


def test_probe_failure_is_shown(qtbot: QtBot) -> None:
    def boom() -> ProbeResult:
        raise RuntimeError("NVML crashed")

    nodes = NodesController(NodeClient(FAKE_NODE), probe_fn=boom)
    with qtbot.waitSignal(
        nodes.changed, check_params_cb=lambda: nodes.cards_message != "Looking for GPUs…", timeout=5000
    ):
        nodes.refresh()
    qtbot.waitUntil(lambda: "NVML crashed" in nodes.cards_message, timeout=5000)
    assert nodes.cards_message == "the GPU probe failed: NVML crashed"
    qtbot.waitUntil(lambda: nodes.serve_supported is not None, timeout=5000)


class ReadOnlyAutostart:
    """A log-in entry whose folder cannot be written."""

    def enabled(self) -> bool:
        return False

    def enable(self, command: list[str]) -> None:
        raise PermissionError(13, "Permission denied")

    def disable(self) -> None:
        pass

    def where(self) -> str:
        return "/home/ann/.config/autostart/polystrata-node.desktop"

    def note(self) -> str:
        return ""


def test_autostart_that_cannot_be_written_says_so(qtbot: QtBot) -> None:
    nodes = NodesController(NodeClient(FAKE_NODE), probe_fn=lambda: SEED_PC, autostart=ReadOnlyAutostart())
    with qtbot.waitSignal(nodes.changed, timeout=1000):
        assert nodes.set_autostart(True) is False
    assert nodes.autostart_problem == (
        "the log-in entry /home/ann/.config/autostart/polystrata-node.desktop could not be written "
        "([Errno 13] Permission denied): check that folder's permissions"
    )
    assert not nodes.autostart_on
