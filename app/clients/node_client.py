"""`NodeClient`: the app's one way to the node agents. It runs the `strata-node` command (the agent's own client: its
control channel is authenticated and encrypted) as QProcesses and reads their `--json` answers; nothing blocks.

- this PC: `strata-node serve --json` (its JSON lines carry the address, key fingerprint and pairing code);
- worker PCs: `status --json` (paired PCs, their GPUs, or the exact address that fails) and `discover --json`
  (agents advertised on the LAN by mDNS, a hint only), `pair`, `include`, `exclude`;
- GPUs: `samples NODE --follow --json` (a worker PC's clocks, a JSON line per batch the agent samples) and
  `clocks` (lock or reset a card's clocks, a worker PC's or, with `--here`, this PC's).

What the installed agent can do is asked from it (`strata-node serve --help`), never assumed.
"""

import json
import os
import shutil
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QObject, QProcess, Signal

NODE_EXE = "strata-node" + (".exe" if os.name == "nt" else "")


def node_command() -> list[str]:
    """The command that starts `strata-node`: beside the app in a bundle, in this venv, on PATH, else the module."""
    if getattr(sys, "frozen", False):
        exe = Path(sys.executable).with_name(NODE_EXE)
        if exe.exists():
            return [str(exe)]
    here = Path(sys.executable).parent / NODE_EXE
    if here.exists():
        return [str(here)]
    found = shutil.which("strata-node")
    if found:
        return [found]
    return [sys.executable, "-m", "engine.node.cli"]


@dataclass(frozen=True)
class AgentInfo:
    """A worker PC as its agent reports it."""

    name: str
    address: str
    fingerprint: str = ""
    paired: bool = False
    reachable: bool = True
    problem: str = ""
    """Why it is not usable, with the exact address that failed."""
    gpus: tuple[str, ...] = field(default=())
    included: bool = True
    host: str = ""
    port: int = 0
    """The agent's control port (its stage workers listen from port + 10)."""
    cards: tuple[dict, ...] = field(default=())
    """The agent's GPU entries (`status --json`: index, name, vram_total, vram_free, ...), for planning."""
    os: str = ""
    """The worker PC's operating system as its agent reports it ("Windows", "Linux"; "" when unknown)."""


def agents_from(status: dict, discovered: dict) -> list[AgentInfo]:
    """Paired PCs (from `status --json`) first, then agents found on the LAN that are not paired yet."""
    out: list[AgentInfo] = []
    seen: set[str] = set()
    for n in status.get("nodes") or []:
        gpus = tuple(str(g.get("name", "?")) for g in ((n.get("gpu") or {}).get("gpus") or []))
        fp = str(n.get("fingerprint") or "")
        seen.add(fp)
        out.append(
            AgentInfo(
                name=str(n.get("name") or n.get("address") or "?"),
                address=str(n.get("address") or ""),
                fingerprint=fp,
                paired=True,
                reachable=bool(n.get("reachable")),
                problem=str(n.get("problem") or ""),
                gpus=gpus,
                included=bool(n.get("included", True)),
                host=str(n.get("host") or ""),
                port=int(n.get("port") or 0),
                cards=tuple(g for g in ((n.get("gpu") or {}).get("gpus") or []) if isinstance(g, dict)),
                os=str((n.get("pc") or {}).get("os") or ""),
            )
        )
    for a in discovered.get("agents") or []:
        fp = str(a.get("fingerprint") or "")
        if fp in seen or a.get("paired"):
            continue
        addresses = a.get("addresses") or []
        address = str(a.get("address") or (addresses[0] if addresses else "?"))
        answers = a.get("answers_fingerprint")
        problem = ""
        if answers is None:
            problem = f"advertised on the LAN but does not answer at {address}:{a.get('port')}"
        elif not a.get("advert_matches", True):
            problem = f"advertises key {fp} but answers with {answers}: do not pair it"
        out.append(
            AgentInfo(
                name=str(a.get("name") or address),
                address=f"{address}:{a.get('port')}",
                fingerprint=fp,
                paired=False,
                reachable=answers is not None,
                problem=problem,
                gpus=(str(a["gpus"]),) if a.get("gpus") else (),
            )
        )
    return out


@dataclass
class _Stream:
    on_line: Callable[[dict], None]
    on_end: Callable[[str], None]
    failure: str = ""
    buffer: bytearray = field(default_factory=bytearray)


class NodeClient(QObject):
    serveSupport = Signal(bool, str)
    """Whether `strata-node serve` exists in this build, and the one-line reason when it does not."""
    localStateChanged = Signal(str)
    """stopped, starting, running, failed"""
    localOutput = Signal(str)
    localInfoChanged = Signal(dict)
    """The local agent's address, key fingerprint and pairing code (from its JSON lines)."""
    agentsChanged = Signal(list)
    commandFailed = Signal(str)
    """A worker-PC command (pair, include, ...) failed: the agent's message."""

    def __init__(self, command: list[str] | None = None, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self._command = command
        self.serve_supported: bool | None = None
        self.serve_detail = ""
        self.local_state = "stopped"
        self.local_lines: deque[str] = deque(maxlen=500)
        self.agents: list[AgentInfo] = []
        self.local_info: dict = {}
        self._probe: QProcess | None = None
        self._agent: QProcess | None = None
        self._calls: dict[QProcess, tuple[Callable[[dict], None], Callable[[str], None]]] = {}
        self._streams: dict[QProcess, _Stream] = {}
        self._refresh: dict[str, dict] = {}
        self.refreshing = False
        self._again: tuple[float | None] | None = None

    def command(self) -> list[str]:
        return list(self._command or node_command())

    # -- what this build's agent can do ------------------------------------------------------------------------

    def check_serve_support(self) -> None:
        """Ask the agent whether it has a `serve` command (argparse exits 0 on `serve --help` only if it does)."""
        if self._probe is not None:
            return
        cmd = self.command()
        proc = QProcess(self)
        proc.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        # Bound methods, never lambdas that capture the process: PySide crashes when a deleted sender's slot
        # holds the last reference to the sender's own wrapper.
        proc.finished.connect(self._on_probe)
        proc.errorOccurred.connect(self._on_probe_error)
        self._probe = proc
        proc.start(cmd[0], [*cmd[1:], "serve", "--help"])

    def _on_probe(self, code: int, _status: QProcess.ExitStatus) -> None:
        proc = self._probe
        if proc is None:
            return
        self._probe = None
        out = bytes(proc.readAll().data()).decode("utf-8", "replace")
        if code == 0:
            self.serve_supported, self.serve_detail = True, ""
        elif "invalid choice" in out:
            self.serve_supported = False
            self.serve_detail = (
                "the node agent in this build (strata-node) has no `serve` command yet, so this PC cannot be "
                "lent as a worker"
            )
        else:
            last = out.strip().splitlines()[-1] if out.strip() else f"exit code {code}"
            self.serve_supported = False
            self.serve_detail = f"strata-node serve --help failed ({last}): reinstall PolyStrata"
        proc.deleteLater()
        self.serveSupport.emit(bool(self.serve_supported), self.serve_detail)

    def _on_probe_error(self, err: QProcess.ProcessError) -> None:
        proc = self._probe
        if err != QProcess.ProcessError.FailedToStart or proc is None:
            return
        self._probe = None
        self.serve_supported = False
        self.serve_detail = (
            f"the node agent ({' '.join(self.command()[:1])}) cannot be started ({proc.errorString()}): "
            "reinstall PolyStrata"
        )
        proc.deleteLater()
        self.serveSupport.emit(False, self.serve_detail)

    # -- the agent on this PC ----------------------------------------------------------------------------------

    def start_local_agent(self, extra_args: list[str] | None = None) -> bool:
        """Start `strata-node serve --json` here, listening on the LAN (the agent admits only its paired main).
        False (and nothing started) where this build's agent cannot serve."""
        if not self.serve_supported or self._agent is not None:
            return False
        cmd = self.command()
        proc = QProcess(self)
        proc.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        proc.readyReadStandardOutput.connect(self._read_agent)
        proc.started.connect(self._on_agent_started)
        proc.finished.connect(self._on_agent_finished)
        proc.errorOccurred.connect(self._on_agent_error)
        self._agent = proc
        self.local_info = {}
        self._set_local("starting")
        args = extra_args if extra_args is not None else ["--host", "0.0.0.0"]
        proc.start(cmd[0], [*cmd[1:], "serve", "--json", *args])
        return True

    def stop_local_agent(self) -> None:
        if self._agent is not None:
            self._agent.terminate()
            if not self._agent.waitForFinished(3000):
                self._agent.kill()

    def _on_agent_started(self) -> None:
        self._set_local("running")

    def _read_agent(self) -> None:
        proc = self._agent
        if proc is None:
            return
        for raw in bytes(proc.readAllStandardOutput().data()).decode("utf-8", "replace").splitlines():
            event = _json_line(raw)
            if event is not None and event.get("event") in ("code", "ready"):
                self.local_info.update({k: v for k, v in event.items() if k not in ("event", "code")})
                if "code" in event:
                    self.local_info["pairing_code"] = event["code"]
                self.localInfoChanged.emit(dict(self.local_info))
                continue
            self.local_lines.append(raw)
            self.localOutput.emit(raw)

    def _on_agent_finished(self, code: int, _status: QProcess.ExitStatus) -> None:
        proc = self._agent
        if proc is None:
            return
        self._read_agent()
        self._agent = None
        proc.deleteLater()
        line = f"[app] the node agent ended (exit code {code})"
        self.local_lines.append(line)
        self.localOutput.emit(line)
        self._set_local("stopped" if code == 0 else "failed")

    def _on_agent_error(self, err: QProcess.ProcessError) -> None:
        proc = self._agent
        if err == QProcess.ProcessError.FailedToStart and proc is not None:
            self._agent = None
            line = f"[app] the node agent cannot be started: {proc.errorString()}"
            self.local_lines.append(line)
            self.localOutput.emit(line)
            proc.deleteLater()
            self._set_local("failed")

    def _set_local(self, state: str) -> None:
        if state != self.local_state:
            self.local_state = state
            self.localStateChanged.emit(state)

    # -- worker PCs --------------------------------------------------------------------------------------------

    def run_json(
        self, args: list[str], on_done: Callable[[dict], None], on_failed: Callable[[str], None]
    ) -> None:
        """`strata-node ARGS --json` in the background; its JSON answer, or the agent's error message."""
        cmd = self.command()
        proc = QProcess(self)
        proc.finished.connect(self._on_call_finished)
        proc.errorOccurred.connect(self._on_call_error)
        self._calls[proc] = (on_done, on_failed)
        proc.start(cmd[0], [*cmd[1:], *args, "--json"])

    def _on_call_finished(self, code: int, _status: QProcess.ExitStatus) -> None:
        proc = self.sender()
        if not isinstance(proc, QProcess) or proc not in self._calls:
            return
        on_done, on_failed = self._calls.pop(proc)
        out = bytes(proc.readAllStandardOutput().data()).decode("utf-8", "replace")
        err = bytes(proc.readAllStandardError().data()).decode("utf-8", "replace").strip()
        proc.deleteLater()
        data = next((d for d in map(_json_line, reversed(out.splitlines())) if d is not None), None)
        if data is not None and data.get("ok", True) and code == 0:
            on_done(data)
        elif data is not None and data.get("error"):
            on_failed(str(data["error"]))
        else:
            on_failed(err.splitlines()[-1] if err else f"strata-node ended with exit code {code}")

    def _not_started(self, err: QProcess.ProcessError, table: dict) -> QProcess | None:
        """The sender, when it is one of `table`'s processes that could not be started (removed from `table`)."""
        proc = self.sender()
        if err != QProcess.ProcessError.FailedToStart or not isinstance(proc, QProcess) or proc not in table:
            return None
        proc.deleteLater()
        return proc

    def _cannot_start(self, proc: QProcess) -> str:
        return f"the node agent ({' '.join(self.command()[:1])}) cannot be started: {proc.errorString()}"

    def _on_call_error(self, err: QProcess.ProcessError) -> None:
        proc = self._not_started(err, self._calls)
        if proc is not None:
            _, on_failed = self._calls.pop(proc)
            on_failed(self._cannot_start(proc))

    def refresh_agents(self, discover_s: float | None = 2.0) -> None:
        """Paired PCs with their health, and (unless `discover_s` is None) agents advertised on the LAN: an mDNS
        query on the local network; `agentsChanged` when both answered."""
        if self.refreshing:
            # asked again meanwhile (a pairing just ended): once this one ends, with fresh answers
            self._again = (discover_s,)
            return
        self.refreshing = True
        self._refresh = {} if discover_s is not None else {"discover": {}}
        asks = [("status", ["status"])]
        if discover_s is not None:
            asks.append(("discover", ["discover", "--timeout", str(discover_s)]))
        for key, args in asks:
            self.run_json(
                args,
                lambda data, key=key: self._refresh_part(key, data),
                lambda message, key=key: self._refresh_part(key, {"problem": message}),
            )

    def _refresh_part(self, key: str, data: dict) -> None:
        self._refresh[key] = data
        if len(self._refresh) < 2:
            return
        self.refreshing = False
        self.agents = agents_from(self._refresh["status"], self._refresh["discover"])
        for part in self._refresh.values():
            if part.get("problem"):
                self.commandFailed.emit(str(part["problem"]))
        self.agentsChanged.emit(list(self.agents))
        again, self._again = self._again, None
        if again is not None:
            self.refresh_agents(*again)

    def pair(self, address: str, code: str, fingerprint: str) -> None:
        """Pair with the agent at `address` (HOST or HOST:PORT) using the code and fingerprint its PC shows."""
        self.run_json(
            ["pair", address, "--code", code, "--fingerprint", fingerprint],
            lambda _d: self.refresh_agents(),
            self.commandFailed.emit,
        )

    def set_included(self, node: str, included: bool) -> None:
        self.run_json(
            ["include" if included else "exclude", node],
            lambda _d: self.refresh_agents(),
            self.commandFailed.emit,
        )

    # -- long-running commands (a JSON line each time something happens) -------------------------------------

    def stream_json(
        self, args: list[str], on_line: Callable[[dict], None], on_end: Callable[[str], None]
    ) -> QProcess:
        """`strata-node ARGS --json` left running: each JSON line to `on_line`, and once it ends, why to `on_end`
        (the agent's error message, or its exit code). `stop_stream` ends it without calling `on_end`."""
        cmd = self.command()
        proc = QProcess(self)
        proc.readyReadStandardOutput.connect(self._read_stream)
        proc.finished.connect(self._on_stream_finished)
        proc.errorOccurred.connect(self._on_stream_error)
        self._streams[proc] = _Stream(on_line, on_end)
        # --json before a "--" (tune's worker flags after it take every word that follows)
        cut = args.index("--") if "--" in args else len(args)
        proc.start(cmd[0], [*cmd[1:], *args[:cut], "--json", *args[cut:]])
        return proc

    def stop_stream(self, proc: QProcess) -> None:
        if self._streams.pop(proc, None) is None:
            return
        proc.kill()
        proc.waitForFinished(1000)
        proc.deleteLater()

    def _read_stream(self) -> None:
        proc = self.sender()
        st = self._streams.get(proc) if isinstance(proc, QProcess) else None
        if st is None or not isinstance(proc, QProcess):
            return
        st.buffer += bytes(proc.readAllStandardOutput().data())
        *lines, rest = st.buffer.split(b"\n")  # a batch can arrive in several reads: whole lines only
        st.buffer = bytearray(rest)
        for raw in lines:
            data = _json_line(raw.decode("utf-8", "replace"))
            if data is None:
                continue
            if data.get("ok", True):
                st.on_line(data)
            elif data.get("error"):
                st.failure = str(data["error"])

    def _on_stream_finished(self, code: int, _status: QProcess.ExitStatus) -> None:
        proc = self.sender()
        if not isinstance(proc, QProcess) or proc not in self._streams:
            return
        self._read_stream()
        st = self._streams.pop(proc)
        err = bytes(proc.readAllStandardError().data()).decode("utf-8", "replace").strip()
        proc.deleteLater()
        st.on_end(st.failure or (err.splitlines()[-1] if err else f"strata-node ended with exit code {code}"))

    def _on_stream_error(self, err: QProcess.ProcessError) -> None:
        proc = self._not_started(err, self._streams)
        if proc is not None:
            self._streams.pop(proc).on_end(self._cannot_start(proc))

    # -- GPU clocks --------------------------------------------------------------------------------------------

    def set_clocks(
        self,
        node: str | None,
        gpu: int,
        lock: bool,
        on_done: Callable[[dict], None],
        on_failed: Callable[[str], None],
    ) -> None:
        """Lock (or reset) a GPU's clocks: a worker PC's through its agent, or this PC's (`node` None) through NVML
        in a `strata-node clocks --here` process. Without administrator / root rights the failure says what to do."""
        where = ["--here"] if node is None else [node]
        self.run_json(
            ["clocks", *where, "--gpu", str(gpu), "--lock" if lock else "--reset"], on_done, on_failed
        )

    def shutdown(self) -> None:
        for proc in list(self._streams):
            self.stop_stream(proc)
        self.stop_local_agent()
        for proc in list(self._calls):
            proc.kill()
            proc.waitForFinished(1000)
        self._calls.clear()
        if self._probe is not None:
            self._probe.kill()
            self._probe.waitForFinished(1000)


def _json_line(line: str) -> dict | None:
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        data = json.loads(line)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None
