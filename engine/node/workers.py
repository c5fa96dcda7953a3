"""Stage workers started by the agent: whitelisted flags only, a fresh CURVE key each, logs kept for the main PC.

The main PC never sends a command line. It names a model file from the agent's folder, the layer range, the port
and the next stage; extra engine options go through a whitelist (flag -> value check). The worker's secret key is a
ZeroMQ certificate file in the agent's folder, readable by its user only (`--stage-key FILE`; never on the command
line, which other users of the PC can read), deleted when the worker ends; public keys go on the command line.
"""

import ipaddress
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from engine.node.gpu import ClockResult, Nvml, NvmlUnavailable
from engine.node.keys import KeyPair, check_key, write_certificate
from engine.node.store import ModelStore, StoreError
from engine.node.wire import StartWorkerArgs

LOG_LINES = 5000
RESERVED_KEY_S = 600.0
LINE_CHARS = 4000

# Key settings a worker could inherit from the agent's own environment: never passed on (engine/link's names).
_LINK_ENV = ("STRATA_STAGE_SECRET_KEY", "STRATA_STAGE_ALLOW", "STRATA_STAGE_TOKEN", "STRATA_REMOTE_TIMING")


class WorkerError(ValueError):
    """A refused or failed worker request; the message says what and what to do."""


def _enum(*values: str) -> Callable[[str], str]:
    def check(v: str) -> str:
        if v not in values:
            raise ValueError(f"expected one of {', '.join(values)}")
        return v

    return check


def _int_range(lo: int, hi: int, also: tuple[str, ...] = ()) -> Callable[[str], str]:
    def check(v: str) -> str:
        if v in also:
            return v
        if not re.fullmatch(r"[0-9]{1,9}", v) or not lo <= int(v) <= hi:
            extra = f" or {', '.join(also)}" if also else ""
            raise ValueError(f"expected a whole number from {lo} to {hi}{extra}")
        return v

    return check


# Engine options a main PC may pass to a worker, each with the check its value must pass.
# `strata-engine worker` accepts each of them (a test checks against its parser).
FLAG_WHITELIST: dict[str, Callable[[str], str]] = {
    "--kv": _enum("auto", "bf16", "f16", "f32", "int8", "q4_0"),
    "--dtype": _enum("auto", "f32", "bf16", "f16"),
    "--max-context": _int_range(16, 1 << 22),
    "--kv-resident": _int_range(0, 1 << 22, ("auto",)),
    "--prefill": _int_range(1, 1 << 20, ("auto",)),
    "--device": _enum("auto", "cpu", "cuda", *(f"cuda:{i}" for i in range(64))),
    "--activations": _enum("int8", "float"),
}


def check_flags(flags: list[str]) -> list[str]:
    """`["--kv", "int8", ...]` checked pair by pair against the whitelist; WorkerError names the first refusal."""
    out: list[str] = []
    i = 0
    while i < len(flags):
        flag = flags[i]
        name, eq, inline = flag.partition("=")
        check = FLAG_WHITELIST.get(name)
        if check is None:
            allowed = ", ".join(FLAG_WHITELIST)
            raise WorkerError(
                f"flag {flag!r} is not allowed for a worker started by the agent; allowed: {allowed}"
            )
        if eq:
            value = inline
            i += 1
        else:
            if i + 1 >= len(flags):
                raise WorkerError(f"flag {name} needs a value")
            value = flags[i + 1]
            i += 2
        try:
            out += [name, check(value)]
        except ValueError as exc:
            raise WorkerError(f"flag {name} {value!r} is refused: {exc}") from None
    return out


def engine_command() -> list[str]:
    """How to run `strata-engine`: the executable beside a bundled agent, else this Python with the module."""
    if getattr(sys, "frozen", False):
        exe = Path(sys.executable).with_name("strata-engine" + (".exe" if os.name == "nt" else ""))
        return [str(exe)]
    return [sys.executable, "-m", "engine.cli"]


def local_addresses() -> set[str]:
    found = {"127.0.0.1", "::1", "0.0.0.0", "::"}
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                found.add(a.address.split("%")[0])
    return found


def port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        if sys.platform != "win32":
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    if host in ("0.0.0.0", ""):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


@dataclass
class Worker:
    id: str
    argv: list[str]
    proc: subprocess.Popen[bytes]
    model: str
    begin: int
    end: int | None
    bind: str
    port: int
    public_key: str
    gpu: int | None
    started: float
    clocks: ClockResult | None = None
    key_file: Path | None = None
    state: str = "starting"  # starting, listening, exited, stopped
    exit_code: int | None = None
    lines: deque[tuple[int, str]] = field(default_factory=lambda: deque(maxlen=LOG_LINES))
    next_seq: int = 0
    reader: threading.Thread | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "model": self.model,
            "begin": self.begin,
            "end": self.end,
            "bind": self.bind,
            "port": self.port,
            "public_key": self.public_key,
            "gpu": self.gpu,
            "pid": self.proc.pid,
            "state": self.state,
            "exit_code": self.exit_code,
            "clocks": self.clocks.to_dict() if self.clocks else None,
            "uptime_s": round(time.time() - self.started, 1),
            "log_lines": self.next_seq,
        }


class WorkerManager:
    def __init__(
        self,
        store: ModelStore,
        bind_host: str,
        ports: range,
        main_key: Callable[[], str | None],
        nvml: Any = None,
        command: list[str] | None = None,
    ) -> None:
        self.store = store
        self.bind_host = bind_host
        self.ports = ports
        self.main_key = main_key
        self.nvml = nvml
        self.command = command or engine_command()
        self.key_dir = store.root.parent / "worker-keys"
        self.key_dir.mkdir(parents=True, exist_ok=True)
        for stale in self.key_dir.glob("*.key_secret"):  # from workers of an agent that was killed
            stale.unlink(missing_ok=True)
        self.workers: dict[str, Worker] = {}
        self._reserved: dict[str, tuple[KeyPair, float]] = {}
        self._n = 0
        self._k = 0
        self._lock = threading.Lock()
        self.changed = threading.Condition(self._lock)

    # -- start ------------------------------------------------------------------------------------------------

    def new_key(self) -> dict[str, Any]:
        """A worker key made before its worker: a relay's stage after it must admit the relay's key, and the relay
        must know that stage's key, so the main asks for the relay's key first (kept 10 minutes, used once)."""
        now = time.monotonic()
        self._reserved = {k: v for k, v in self._reserved.items() if now - v[1] < RESERVED_KEY_S}
        if len(self._reserved) >= 16:
            raise WorkerError("16 worker keys are waiting for their workers: start those workers first")
        self._k += 1
        kid = f"k{self._k}"
        pair = KeyPair.generate()
        self._reserved[kid] = (pair, now)
        return {"key_id": kid, "public_key": pair.public}

    def _pick_port(self, bind: str, asked: int) -> int:
        used = {w.port for w in self.workers.values() if w.state in ("starting", "listening")}
        if asked:
            if asked not in self.ports:
                raise WorkerError(
                    f"port {asked} is outside the agent's worker ports {self.ports.start}-{self.ports.stop - 1}: "
                    "pick one of them or 0 (the agent picks)"
                )
            if asked in used or not port_free(bind, asked):
                raise WorkerError(f"port {asked} is in use on this PC: pick another or 0 (the agent picks)")
            return asked
        for p in self.ports:
            if p not in used and port_free(bind, p):
                return p
        raise WorkerError(
            f"all worker ports {self.ports.start}-{self.ports.stop - 1} are in use: stop a worker or widen "
            "--worker-ports"
        )

    def _check_bind(self, bind: str | None) -> str:
        if bind is None:
            return self.bind_host
        try:
            ipaddress.ip_address(bind)
        except ValueError:
            raise WorkerError(f"bind address {bind!r} is not an IP address") from None
        if self.bind_host not in ("0.0.0.0", "::", "") and bind != self.bind_host:
            # an agent on one address (loopback, one LAN card) keeps its workers there: no wider exposure
            raise WorkerError(
                f"bind address {bind}: this agent listens on {self.bind_host} only, and its workers bind there too"
            )
        if bind not in local_addresses():
            raise WorkerError(f"bind address {bind} is not an address of this PC")
        return bind

    def start(self, a: StartWorkerArgs) -> dict[str, Any]:
        main_key = self.main_key()
        if main_key is None:
            raise WorkerError("this agent is not paired: pair it before starting workers")
        if a.end is not None and a.end <= a.begin:
            raise WorkerError(f"end {a.end} must be after begin {a.begin}")
        if (a.next is None) != (a.next_key is None):
            raise WorkerError(
                "a relay needs both next (HOST:PORT of the next stage) and next_key (its server key)"
            )
        if a.next is not None and a.end is None:
            raise WorkerError("a relay (next) needs end: the first layer of the next stage")
        allow = [check_key(k, "allow_keys entry") for k in (a.allow_keys or [main_key])]
        if a.next_key is not None:
            check_key(a.next_key, "next_key")
        extra = check_flags(list(a.flags))
        try:
            model = self.store.resolve_model(a.model)
        except StoreError as exc:
            raise WorkerError(str(exc)) from None
        bind = self._check_bind(a.bind)
        if (a.sm is not None or a.mem is not None) and not a.lock_clocks:
            raise WorkerError("sm/mem clock ranges are given but lock_clocks is false")
        with self._lock:
            port = self._pick_port(bind, a.port)
            self._n += 1
            wid = f"w{self._n}"
        if a.key_id is not None:
            reserved = self._reserved.pop(a.key_id, None)
            if reserved is None or time.monotonic() - reserved[1] >= RESERVED_KEY_S:
                raise WorkerError(f"key {a.key_id} is unknown or expired: ask for a new one (new_key)")
            keys = reserved[0]
        else:
            keys = KeyPair.generate()
        key_file = write_certificate(self.key_dir / f"{wid}.key_secret", keys, f"stage worker {wid}")
        argv = [
            *self.command,
            "worker",
            "--model",
            str(model),
            "--stage-worker",
            str(port),
            "--stage-begin",
            str(a.begin),
            "--stage-bind",
            bind,
            "--stage-key",
            str(key_file),
        ]
        # `--flag=KEY`: a Z85 key may start with "-", which argparse would take for a flag.
        for k in allow:
            argv.append(f"--stage-allow={k}")
        if a.end is not None:
            argv += ["--stage-end", str(a.end)]
        if a.next is not None:
            argv += ["--stage-next", a.next, f"--stage-next-key={a.next_key}"]
        if a.gpu is not None:
            argv += ["--gpu", str(a.gpu)]
        argv += extra
        env = {k: v for k, v in os.environ.items() if k not in _LINK_ENV}
        if a.timing:
            env["STRATA_REMOTE_TIMING"] = "1"
        env["PYTHONUNBUFFERED"] = "1"
        clocks = None
        if a.lock_clocks:
            clocks = self._lock_clocks(a.gpu if a.gpu is not None else 0, a.sm, a.mem)
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=str(self.store.root),
            )
        except OSError as exc:
            key_file.unlink(missing_ok=True)
            if clocks is not None and clocks.locked:
                self._reset_clocks(a.gpu if a.gpu is not None else 0)
            raise WorkerError(
                f"cannot start the worker ({exc.strerror or exc}): reinstall PolyStrata"
            ) from None
        w = Worker(
            id=wid,
            argv=argv,
            proc=proc,
            model=a.model,
            begin=a.begin,
            end=a.end,
            bind=bind,
            port=port,
            public_key=keys.public,
            gpu=a.gpu,
            started=time.time(),
            clocks=clocks,
            key_file=key_file,
        )
        w.reader = threading.Thread(target=self._read, args=(w,), name=f"worker-log-{wid}", daemon=True)
        with self._lock:
            self.workers[wid] = w
        w.reader.start()
        return w.to_dict()

    def _read(self, w: Worker) -> None:
        assert w.proc.stdout is not None
        for raw in iter(w.proc.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\r\n")[:LINE_CHARS]
            with self.changed:
                w.lines.append((w.next_seq, line))
                w.next_seq += 1
                self.changed.notify_all()
        w.proc.stdout.close()

    # -- clocks -----------------------------------------------------------------------------------------------

    def _lock_clocks(self, gpu: int, sm: list[int] | None, mem: list[int] | None) -> ClockResult:
        try:
            session = Nvml(self.nvml)
        except NvmlUnavailable as exc:
            return ClockResult(gpu, False, f"NOT locked: {exc}")
        try:
            if not 0 <= gpu < session.count:
                return ClockResult(gpu, False, f"NOT locked: GPU {gpu} does not exist on this PC")
            return session.lock(gpu, tuple(sm) if sm else None, tuple(mem) if mem else None)  # type: ignore[arg-type]
        finally:
            session.close()

    def _reset_clocks(self, gpu: int) -> ClockResult:
        try:
            session = Nvml(self.nvml)
        except NvmlUnavailable as exc:
            return ClockResult(gpu, True, f"NOT reset: {exc}")
        try:
            return session.reset(gpu)
        finally:
            session.close()

    # -- state ------------------------------------------------------------------------------------------------

    def poll(self) -> None:
        """Update states: listening once the port answers, exited when the process ends (clocks reset then)."""
        for w in list(self.workers.values()):
            if w.state in ("exited", "stopped"):
                continue
            code = w.proc.poll()
            if code is not None:
                w.exit_code = code
                w.state = "stopped" if w.state == "stopping" else "exited"
                if w.key_file is not None:
                    w.key_file.unlink(missing_ok=True)  # the key dies with its worker
                if w.clocks is not None and w.clocks.locked:
                    w.clocks = self._reset_clocks(w.gpu if w.gpu is not None else 0)
                with self.changed:
                    self.changed.notify_all()
            elif w.state == "starting" and port_open(w.bind, w.port, 0.05):
                w.state = "listening"

    def get(self, wid: str) -> Worker:
        w = self.workers.get(wid)
        if w is None:
            raise WorkerError(f"no worker {wid} on this agent (see the workers command)")
        return w

    def stop(self, wid: str, timeout: float = 10.0) -> dict[str, Any]:
        w = self.get(wid)
        if w.proc.poll() is None:
            w.state = "stopping"
            w.proc.terminate()
            try:
                w.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait(5)
        self.poll()
        if w.reader is not None:
            w.reader.join(2)
        return w.to_dict()

    def list(self) -> list[dict[str, Any]]:
        self.poll()
        return [w.to_dict() for w in self.workers.values()]

    def logs(self, wid: str, since: int) -> dict[str, Any]:
        w = self.get(wid)
        with self._lock:
            lines = [line for seq, line in w.lines if seq >= since]
            first = w.lines[0][0] if w.lines else w.next_seq
            nxt = w.next_seq
        return {
            "id": wid,
            "lines": lines,
            "next": nxt,
            "dropped": max(0, first - since),
            "state": w.state,
            "exit_code": w.exit_code,
        }

    def has_lines(self, wid: str, since: int) -> bool:
        w = self.workers.get(wid)
        return w is None or w.next_seq > since or w.state in ("exited", "stopped")

    def shutdown(self) -> None:
        for wid, w in list(self.workers.items()):
            if w.proc.poll() is None:
                self.stop(wid, timeout=5)
