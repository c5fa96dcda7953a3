"""`EngineController`: runs `strata-engine serve` as a QProcess and follows it through /health.

States: stopped -> starting (process up, no answer yet) -> loading (/health: loading) -> ready (/health: ready);
/health: error -> error; the process ending on its own -> crashed (the app stays up, shows the log tail and offers a
restart); stop() -> stopping -> stopped. While ready it polls /stats and keeps the /events stream open.
"""

import os
import re
import signal
import socket
import time
from collections import deque
from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path
from typing import Any

from PySide6.QtCore import QObject, QProcess, QProcessEnvironment, QTimer, Signal

from app.clients.engine_client import EngineClient, EventStream
from app.controllers.worker_stages import WorkerStages, config_workers
from app.engine_process import engine_command
from app.settings import AppSettings
from installer.config import default_config

LOG_LINES = 2000
CRASH_TAIL = 40
STOP_GRACE_MS = 5000
WORKERS_RETRY_MS = 15_000  # a worker PC that was off: its stages are started again this often
DEGRADED_CHECK_S = 5.0  # while a stage is down: how often its agent is asked whether the worker still runs


_ERROR = re.compile(r"\b(error|exception|traceback|failed|fatal|abort(ed)?|out of memory|killed)\b", re.I)


def ended_how(code: int, crashed: bool) -> str:
    """How the process ended, in words: its exit code, or the signal that ended it (Qt gives the signal's number
    as the code of a crash on Unix; Windows gives an NTSTATUS such as 0xC0000005)."""
    if not crashed:
        return f"exited with code {code}"
    if os.name != "nt":
        try:
            return f"was ended by signal {code} ({signal.Signals(code).name})"
        except ValueError:
            return f"crashed (code {code})"
    return f"crashed (code 0x{code & 0xFFFFFFFF:08X})"


def last_error(log: Iterable[str]) -> str:
    """The last line of the engine's log that reports an error (not the app's own lines), or ""."""
    for line in reversed(list(log)):
        if not line.startswith("[app]") and _ERROR.search(line):
            return line.strip()
    return ""


class EngineState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    DEGRADED = "degraded"  # serving, but a stage on another PC is unreachable (/health names it)
    ERROR = "error"
    STOPPING = "stopping"
    CRASHED = "crashed"


RUNNING_STATES = (
    EngineState.STARTING,
    EngineState.LOADING,
    EngineState.READY,
    EngineState.DEGRADED,
    EngineState.ERROR,
)

STATE_TEXT = {
    EngineState.STOPPED: "Stopped",
    EngineState.STARTING: "Starting",
    EngineState.LOADING: "Loading the model",
    EngineState.READY: "Ready",
    EngineState.DEGRADED: "Degraded: a worker PC is unreachable",
    EngineState.ERROR: "Error",
    EngineState.STOPPING: "Stopping",
    EngineState.CRASHED: "Crashed",
}


def port_in_use(host: str, port: int) -> bool:
    """True when something already listens there (its /health would be mistaken for ours)."""
    probe_host = "127.0.0.1" if host in ("0.0.0.0", "") else host
    with socket.socket(socket.AF_INET6 if ":" in probe_host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.3)
        return s.connect_ex((probe_host, port)) == 0


class EngineController(QObject):
    stateChanged = Signal(str)
    """The new EngineState value."""
    logLine = Signal(str)
    crashed = Signal(str)
    """A one-line summary; `log_tail()` has the lines before it."""
    startRefused = Signal(str)
    """The engine was not started: what is wrong with the settings and what to do."""
    healthChanged = Signal(dict)
    statsChanged = Signal(dict)
    engineEvent = Signal(dict)
    """Each event of /events (step, prompt_chunk, request)."""

    def __init__(
        self,
        client: EngineClient,
        settings: AppSettings,
        command: list[str] | None = None,
        poll_ms: int = 500,
        parent: QObject | None = None,
        stages: WorkerStages | None = None,
    ) -> None:
        super().__init__(parent)
        self.client = client
        self.stages = stages
        """Starts and stops the stage workers on worker PCs that the config names (None: no worker PCs)."""
        self.settings = settings
        self._serving: AppSettings | None = None
        self._command = command
        self._poll_ms = poll_ms
        self.state = EngineState.STOPPED
        self.health: dict[str, Any] = {}
        self.stats: dict[str, Any] = {}
        self.message = ""
        """Why the engine is in error/crashed, or what went wrong at start."""
        self.exit_code: int | None = None
        self.started_at: float | None = None
        self._log: deque[str] = deque(maxlen=LOG_LINES)
        self._partial = b""
        self._proc: QProcess | None = None
        self._events: EventStream | None = None
        self._restart_after_stop = False
        self._health_busy = False
        self._stats_busy = False
        self._timer = QTimer(self)
        self._timer.timeout.connect(self._poll)
        self._kill_timer = QTimer(self)
        self._kill_timer.setSingleShot(True)
        self._kill_timer.timeout.connect(self._kill)
        self._events_retry = QTimer(self)
        self._events_retry.setSingleShot(True)
        self._events_retry.timeout.connect(self._open_events)
        self._workers_retry = QTimer(self)
        self._workers_retry.setSingleShot(True)
        self._workers_retry.timeout.connect(self._retry_start)
        self._last_check = 0.0
        self._awaiting_workers = False
        client.configure(settings.base_url, settings.api_key)

    # -- public ------------------------------------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.state in RUNNING_STATES

    @property
    def serving(self) -> AppSettings:
        """The settings the running engine was started with (the saved ones apply at its next start)."""
        return self._serving if self.running and self._serving is not None else self.settings

    @property
    def pending(self) -> bool:
        """Saved launch options the running engine does not have yet (a restart applies them)."""
        return self.running and self.serving.serve_args() != self.settings.serve_args()

    @property
    def api_url(self) -> str:
        return self.serving.api_url

    @property
    def model_name(self) -> str:
        return str(
            self.health.get("model") or self.stats.get("model") or self.serving.model or "default model"
        )

    def command(self) -> list[str]:
        args = self.settings.serve_args()
        if not self.settings.model and not self.settings.config:  # the model strata-setup configured, if any
            found = default_config()
            if found is not None:
                args += ["--config", str(found)]
        return [*(self._command or engine_command()), "serve", *args]

    def log_tail(self, n: int = CRASH_TAIL) -> list[str]:
        return list(self._log)[-n:]

    def apply_settings(self, settings: AppSettings) -> None:
        """New launch options; they take effect at the next start (restart() applies them now)."""
        self.settings = settings
        if not self.running:
            self.client.configure(settings.base_url, settings.api_key)

    def start(self) -> None:
        if self.running or self.state == EngineState.STOPPING:
            return
        problems = self.settings.validate()
        if not problems and port_in_use(self.settings.host, self.settings.port):
            problems = [
                f"port {self.settings.port} on {self.settings.host} is already in use by another program "
                "(another engine?): stop it or choose another port in Settings"
            ]
        self.health, self.stats, self.exit_code = {}, {}, None
        if problems:
            self.message = "; ".join(problems)
            self._append_log(f"[app] cannot start the engine: {self.message}")
            self.startRefused.emit(self.message)
            return
        self.client.configure(self.settings.base_url, self.settings.api_key)
        self._workers_retry.stop()
        self.message = ""
        self._serving = self.settings
        if self.stages is not None and config_workers(self.settings.config):
            self._append_log("[app] starting the stages on the worker PCs (strata-node start-workers)")
            self._set_state(EngineState.STARTING)
            self._awaiting_workers = True
            self.stages.start(self.settings.config, self._workers_ready, self._workers_failed)
            return
        self._launch([])

    def _workers_ready(self, flags: list[str]) -> None:
        if not self._awaiting_workers:  # stopped by the user while the workers started
            if self.stages is not None:
                self.stages.stop()
            return
        self._awaiting_workers = False
        self._launch(flags)

    def _launch(self, flags: list[str]) -> None:
        """Start the engine process (`flags`: what the worker PCs' stages need of it)."""
        if self.stages is not None:
            for line in self.stages.lines():
                self._append_log(f"[app] {line}")
        cmd = [*self.command(), *flags]
        # the program's name, not its folder: the log is for reading and for bug reports
        self._append_log("[app] $ " + " ".join([Path(cmd[0]).name, *cmd[1:]]))
        proc = QProcess(self)
        proc.setProcessChannelMode(QProcess.ProcessChannelMode.MergedChannels)
        env = QProcessEnvironment.systemEnvironment()
        env.remove("STRATA_API_KEY")  # this app's key only (none: the engine requires none)
        for k, v in self.settings.engine_env().items():
            env.insert(k, v)
        proc.setProcessEnvironment(env)
        proc.readyReadStandardOutput.connect(self._read_output)
        proc.finished.connect(self._on_finished)
        proc.errorOccurred.connect(self._on_error)
        self._proc = proc
        self.started_at = time.monotonic()
        self._set_state(EngineState.STARTING)
        proc.start(cmd[0], cmd[1:])
        self._timer.start(self._poll_ms)

    def _workers_failed(self, message: str) -> None:
        if not self._awaiting_workers:
            return
        self._awaiting_workers = False
        self.message = f"the worker PCs' stages did not start: {message}"
        self._append_log(f"[app] {self.message}; trying again in {WORKERS_RETRY_MS // 1000} s")
        self._set_state(EngineState.STOPPED)
        self.startRefused.emit(self.message)
        self._workers_retry.start(WORKERS_RETRY_MS)

    def _retry_start(self) -> None:
        if self.state == EngineState.STOPPED:
            self.start()

    def stop(self) -> None:
        """Ask the engine to end (SIGTERM; killed after 5 s); state goes stopping -> stopped."""
        self._workers_retry.stop()
        if self._awaiting_workers:
            self._awaiting_workers = False
            self._set_state(EngineState.STOPPED)
            return
        if self._proc is None:
            if self.state in (EngineState.CRASHED, EngineState.ERROR):
                self._set_state(EngineState.STOPPED)
            return
        if self.state == EngineState.STOPPING:
            return
        self._close_events()
        self._timer.stop()
        self._set_state(EngineState.STOPPING)
        self._append_log("[app] stopping the engine")
        self._proc.terminate()
        self._kill_timer.start(STOP_GRACE_MS)

    def restart(self) -> None:
        if self._proc is None:
            self.start()
        else:
            self._restart_after_stop = True
            self.stop()

    def shutdown(self, wait_ms: int = STOP_GRACE_MS) -> None:
        """Stop and wait (the app is quitting): the engine never outlives the app."""
        proc = self._proc
        self._workers_retry.stop()
        if proc is None:
            if self.stages is not None:
                self.stages.stop(wait_ms=wait_ms)
            return
        self._restart_after_stop = False
        self.stop()
        if not proc.waitForFinished(wait_ms):
            proc.kill()
            proc.waitForFinished(2000)
        if self.stages is not None:
            self.stages.stop(wait_ms=wait_ms)

    # -- process -----------------------------------------------------------------------------------------------

    def _append_log(self, line: str) -> None:
        self._log.append(line)
        self.logLine.emit(line)

    def _read_output(self) -> None:
        if self._proc is None:
            return
        data = self._partial + bytes(self._proc.readAllStandardOutput().data())
        *lines, self._partial = data.replace(b"\r\n", b"\n").split(b"\n")
        for raw in lines:
            self._append_log(raw.decode("utf-8", "replace"))

    def _on_error(self, error: QProcess.ProcessError) -> None:
        if error == QProcess.ProcessError.FailedToStart and self._proc is not None:
            cmd = " ".join(self.command()[:1])
            self.message = (
                f"the engine could not be started ({cmd}: {self._proc.errorString()}): reinstall PolyStrata "
                "or run ./start.sh --setup-only"
            )
            self._append_log(f"[app] {self.message}")
            self._cleanup_process()
            self._set_state(EngineState.CRASHED)
            self.crashed.emit(self.message)

    def _on_finished(self, code: int, status: QProcess.ExitStatus) -> None:
        if self._proc is None:
            return
        self._read_output()
        if self._partial:
            self._append_log(self._partial.decode("utf-8", "replace"))
            self._partial = b""
        expected = self.state == EngineState.STOPPING
        self.exit_code = code
        self._cleanup_process()
        if self.stages is not None:
            self.stages.stop()  # the workers served this engine only; a new start starts new ones
        if expected:
            self._append_log("[app] the engine stopped")
            self._set_state(EngineState.STOPPED)
            if self._restart_after_stop:
                self._restart_after_stop = False
                self.start()
            return
        how = ended_how(code, status == QProcess.ExitStatus.CrashExit)
        last = last_error(self._log)
        self.message = f"the engine {how}" + (
            f": {last}" if last else " (no error in its log: see its last lines)"
        )
        self._append_log(f"[app] {self.message}")
        self._set_state(EngineState.CRASHED)
        self.crashed.emit(self.message)

    def _kill(self) -> None:
        if self._proc is not None:
            self._append_log("[app] the engine did not stop within 5 s: killing it")
            self._proc.kill()

    def _cleanup_process(self) -> None:
        self._timer.stop()
        self._kill_timer.stop()
        self._close_events()
        if self._proc is not None:
            self._proc.deleteLater()
        self._proc = None
        self._health_busy = self._stats_busy = False

    # -- health, stats, events ---------------------------------------------------------------------------------

    def _set_state(self, state: EngineState) -> None:
        if state == self.state:
            return
        self.state = state
        self._timer.setInterval(self._poll_ms * (4 if state == EngineState.READY else 1))
        if state == EngineState.READY:
            self._open_events()
        self.stateChanged.emit(state.value)

    def _poll(self) -> None:
        if self._proc is None:
            return
        if not self._health_busy:
            self._health_busy = True
            call = self.client.health()
            call.done.connect(self._on_health)
            call.failed.connect(self._on_health_failed)
        if self.state == EngineState.READY and not self._stats_busy:
            self._stats_busy = True
            stats = self.client.stats()
            stats.done.connect(self._on_stats)
            stats.failed.connect(self._on_stats_failed)

    def _on_health(self, data: object) -> None:
        self._health_busy = False
        if self._proc is None or self.state == EngineState.STOPPING or not isinstance(data, dict):
            return
        self.health = data
        self.healthChanged.emit(data)
        status = data.get("status")
        if status == "ready":
            self.message = ""
            self._set_state(EngineState.READY)
        elif status == "loading":
            self._set_state(EngineState.LOADING)
        elif status == "degraded":
            self.message = str(data.get("error") or "a stage on another PC does not answer")
            self._set_state(EngineState.DEGRADED)
            now = time.monotonic()
            if self.stages is not None and now - self._last_check >= DEGRADED_CHECK_S:
                self._last_check = now
                self.stages.check(self._on_workers_gone)
        elif status == "error":
            self.message = str(data.get("error") or "the engine reports an error without a message")
            self._set_state(EngineState.ERROR)

    def _on_workers_gone(self, what: list[str]) -> None:
        if self.state != EngineState.DEGRADED:
            return
        self._append_log(f"[app] {'; '.join(what)}: restarting the engine with new stages")
        self.restart()

    def _on_health_failed(self, _message: str) -> None:
        # Not up yet while starting; once it answered, a failing /health while the process lives means it hangs
        # or is busy: keep the state, the process exit is what decides a crash.
        self._health_busy = False

    def _on_stats(self, data: object) -> None:
        self._stats_busy = False
        if isinstance(data, dict) and self._proc is not None:
            self.stats = data
            self.statsChanged.emit(data)

    def _on_stats_failed(self, _message: str) -> None:
        self._stats_busy = False

    def _open_events(self) -> None:
        if self.state != EngineState.READY or self._events is not None:
            return
        stream = self.client.events()
        stream.event.connect(self.engineEvent)
        stream.closed.connect(self._on_events_closed)
        self._events = stream

    def _on_events_closed(self, _reason: str) -> None:
        self._events = None
        if self.state == EngineState.READY:
            self._events_retry.start(1000)

    def _close_events(self) -> None:
        self._events_retry.stop()
        stream, self._events = self._events, None
        if stream is not None:
            stream.abort()
