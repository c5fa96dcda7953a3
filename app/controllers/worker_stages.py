"""`WorkerStages`: the stage workers on worker PCs that the engine's config names, around the engine's life.

Before the engine starts, `strata-node start-workers --config C --json` starts the config's workers in chain order
through their agents and answers the flags the main engine needs (the first worker's key, this PC's key file). When
the engine stops, each worker it started is stopped (`stop-worker`). While the engine reports a stage down, `check`
asks each worker's agent whether that worker still runs: a worker that ended (its PC restarted, the process was
killed) comes back only through a new start, with a new key, so the engine is restarted with it; a PC that does
not answer is waited for (the engine's own link reconnects to a worker that is still there)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, QProcess

from app.clients.node_client import NodeClient
from installer.config import ConfigError, read_config


def config_workers(config: str) -> bool:
    """Whether the config file names worker PCs (an unreadable one: no; the engine says what is wrong with it)."""
    if not config:
        return False
    try:
        return bool(read_config(Path(config)).workers)
    except ConfigError:
        return False


class WorkerStages(QObject):
    def __init__(self, client: NodeClient, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.client = client
        self.started: list[dict] = []
        """The workers the last start-workers started: node, address, id, port."""
        self.warnings: list[str] = []
        self._checking = 0
        self._gone: list[str] = []
        self._stopping = 0
        self._then: Callable[[], None] | None = None
        """A start that waits for the stops before it (their ports are the ones it will ask for)."""

    def start(
        self, config: str, on_ready: Callable[[list[str]], None], on_failed: Callable[[str], None]
    ) -> None:
        """Start the config's workers; `on_ready(engine flags)` or `on_failed(the agent's message)`."""

        def done(data: dict) -> None:
            self.started = [w for w in data.get("workers") or [] if isinstance(w, dict)]
            self.warnings = [str(w) for w in data.get("warnings") or []]
            on_ready([str(f) for f in data.get("engine_flags") or []])

        self.started, self.warnings = [], []

        def go() -> None:
            self.client.run_json(["start-workers", "--config", config], done, on_failed)

        if self._stopping:
            self._then = go
        else:
            go()

    def lines(self) -> list[str]:
        """For the engine's log: each worker started (its PC, id and port), then the warnings (clocks not locked)."""
        out = [f"{w.get('node')}: stage worker {w.get('id')} on port {w.get('port')}" for w in self.started]
        return out + self.warnings

    def stop(self, wait_ms: int = 0) -> None:
        """Stop the workers started for the engine (in the background; with `wait_ms`, wait that long for each)."""
        started, self.started = self.started, []
        cmd = self.client.command()
        for w in started:
            if not w.get("node") or not w.get("id"):
                continue
            if wait_ms:
                proc = QProcess()
                proc.start(cmd[0], [*cmd[1:], "stop-worker", str(w["node"]), str(w["id"]), "--json"])
                if not proc.waitForFinished(wait_ms):
                    proc.kill()
                    proc.waitForFinished(1000)
            else:
                self._stopping += 1
                args = ["stop-worker", str(w["node"]), str(w["id"])]
                self.client.run_json(args, lambda _d: self._stopped(), lambda _m: self._stopped())

    def _stopped(self) -> None:
        self._stopping -= 1
        if self._stopping == 0 and self._then is not None:
            go, self._then = self._then, None
            go()

    def check(self, on_gone: Callable[[list[str]], None]) -> None:
        """Ask each worker's agent whether the worker still runs; `on_gone(descriptions)` when one has ended and its
        agent answers. Silent while a PC does not answer (nothing to restart yet) or a check is under way."""
        if self._checking or not self.started:
            return
        self._checking = len(self.started)
        self._gone = []
        for w in self.started:
            node, wid = str(w.get("node") or ""), str(w.get("id") or "")

            def done(data: dict, node: str = node, wid: str = wid) -> None:
                runs = {str(x.get("id")): str(x.get("state")) for x in data.get("workers") or []}
                if runs.get(wid) not in ("starting", "listening"):
                    self._gone.append(f"the worker on {node} has {runs.get(wid, 'gone')}")
                self._checked(on_gone)

            self.client.run_json(["workers", node], done, lambda _m: self._checked(on_gone))

    def _checked(self, on_gone: Callable[[list[str]], None]) -> None:
        self._checking -= 1
        if self._checking == 0 and self._gone:
            on_gone(list(self._gone))
