"""The node agent (`strata-node serve`): lends this PC's GPUs to one paired main PC.

Two sockets on the address the user picks:
- control, PORT: a ZeroMQ ROUTER with CURVE (authenticated encryption). A ZAP handler admits any client key while
  the agent is unpaired (so that a main can pair) and only the paired main's key afterwards. Before pairing only
  `hello` and `pair` are answered; every request is checked against the key it arrived with (the User-Id the ZAP
  handler sets), so a connection made before pairing gets nothing after it.
- identity, PORT+1: a plain ROUTER that answers every message with name, version, public key and fingerprint and
  reads nothing else. A main needs the public key to open a CURVE connection; the user compares its fingerprint
  with the one this agent prints before the pairing code is sent.
"""

import ipaddress
import logging
import os
import platform
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import zmq
import zmq.auth.thread

from engine.node import gpu as gpu_mod
from engine.node import wire
from engine.node.discovery import Advert
from engine.node.keys import (
    KeyPair,
    codes_equal,
    fingerprint,
    load_or_create_keypair,
    new_pairing_code,
    read_json,
    write_private_json,
)
from engine.node.store import ModelStore, StoreError
from engine.node.workers import FLAG_WHITELIST, WorkerError, WorkerManager
from installer.version import __version__

log = logging.getLogger("strata.node")
ZAP_DOMAIN = "strata-node"
# Wrong pairing codes: the first FREE_TRIES are answered at once; after them each pair request waits (is refused
# until) twice as long as the one before, from PAIR_BACKOFF_S to PAIR_BACKOFF_MAX_S. The code itself never changes
# (a guessing peer on the LAN would otherwise make the code the user reads useless): 8 base32 characters, ~10^12.
FREE_TRIES = 3
PAIR_BACKOFF_S = 1.0
PAIR_BACKOFF_MAX_S = 60.0
SAMPLE_KEEP = 600  # GPU samples kept per card (60 s at 100 ms)
IDENT_PER_TURN = 8  # identity answers per loop turn: a flood there leaves the control channel its turns


class AgentError(RuntimeError):
    """The agent cannot start; the message says why and what to do."""


@dataclass
class AgentOptions:
    data_dir: Path
    host: str = "127.0.0.1"
    port: int = wire.DEFAULT_PORT
    name: str = ""
    worker_ports: range | None = None
    model_dirs: tuple[Path, ...] = ()
    sample_ms: int = 100
    nvml: Any = None  # an NVML module (tests); None: pynvml
    engine_command: list[str] | None = None
    reserve_bytes: int = 1 << 30
    advertise: bool = True
    on_event: Any = None  # callable(dict): ready, code, paired, unpaired (the CLI prints them)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _Zap:
    """ZAP callback: before pairing any CURVE client may connect (to pair); after it only the paired main."""

    def __init__(self, agent: "Agent") -> None:
        self.agent = agent

    def callback(self, domain: str, key: bytes) -> bool:
        paired = self.agent.paired_key
        return paired is None or key.decode("ascii", "replace") == paired


class Agent:
    def __init__(self, opts: AgentOptions) -> None:
        self.opts = opts
        self.dir = Path(opts.data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.keys: KeyPair = load_or_create_keypair(self.dir / "agent-key.json")
        self.name = (opts.name or platform.node() or "worker")[:64]
        self._paired_path = self.dir / "paired.json"
        self._paired_mtime: float | None = None
        self.paired: dict[str, Any] | None = None
        self.code: str | None = None
        self.wrong_codes = 0
        self.pair_after = 0.0  # monotonic time before which pair requests are refused (wrong codes)
        self.control: zmq.Socket | None = None
        self._load_pairing()
        self.store = ModelStore(self.dir / "models", opts.model_dirs, opts.reserve_bytes)
        port = opts.port
        ports = opts.worker_ports or range(port + 10, port + 30)
        self.workers = WorkerManager(
            self.store, opts.host, ports, lambda: self.paired_key, opts.nvml, opts.engine_command
        )
        self.ctx: zmq.Context | None = None
        self.ident: zmq.Socket | None = None
        self.auth: zmq.auth.thread.ThreadAuthenticator | None = None
        self.port = port
        self.id_port = port + 1 if port else 0
        self._pending: list[tuple[list[bytes], int, str, Any, float]] = []
        self._stop = threading.Event()
        self._samples: deque[dict[str, Any]] = deque(maxlen=SAMPLE_KEEP * 8)
        self._sample_seq = 0
        self._sampler: threading.Thread | None = None
        self._sample_lock = threading.Lock()
        self.advert: Any = None
        self._thread: threading.Thread | None = None

    # -- pairing state ----------------------------------------------------------------------------------------

    @property
    def paired_key(self) -> str | None:
        return self.paired["main_key"] if self.paired else None

    def _load_pairing(self) -> None:
        try:
            self._paired_mtime = self._paired_path.stat().st_mtime
        except FileNotFoundError:
            self._paired_mtime = None
        data = read_json(self._paired_path)
        if isinstance(data, dict) and isinstance(data.get("main_key"), str):
            self.paired, self.code = data, None
        else:
            self.paired = None
            if self.code is None:
                self._new_code()

    def _new_code(self) -> None:
        self.code = new_pairing_code()
        self.wrong_codes, self.pair_after = 0, 0.0
        if self.control is not None:  # the first code is part of the "ready" event
            self._event("code", code=self.code, fingerprint=self.keys.fingerprint)

    def _check_pairing_file(self) -> None:
        """`strata-node unpair` on this PC removes the file while the agent runs: follow it."""
        try:
            mtime: float | None = self._paired_path.stat().st_mtime
        except FileNotFoundError:
            mtime = None
        if mtime != self._paired_mtime:
            was = self.paired
            self._load_pairing()
            if was and not self.paired:
                self._event("unpaired", fingerprint=self.keys.fingerprint)
            self._write_state()

    def _event(self, kind: str, **fields: Any) -> None:
        if self.opts.on_event is not None:
            self.opts.on_event({"event": kind, **fields})

    def _write_state(self) -> None:
        """agent.json: what `strata-node local` (and the app on this PC) shows: fingerprint, code, address."""
        state = {
            "name": self.name,
            "host": self.opts.host,
            "port": self.port,
            "id_port": self.id_port,
            "fingerprint": self.keys.fingerprint,
            "public_key": self.keys.public,
            "version": __version__,
            "pairing_code": self.code,
            "paired_main": fingerprint(self.paired["main_key"]) if self.paired else None,
            "paired_main_name": self.paired.get("main_name") if self.paired else None,
            "pid": os.getpid(),
        }
        write_private_json(self.dir / "agent.json", state)

    # -- sockets ----------------------------------------------------------------------------------------------

    def bind(self) -> None:
        ctx = zmq.Context()
        self.ctx = ctx
        self.auth = zmq.auth.thread.ThreadAuthenticator(ctx, log=logging.getLogger("strata.node.zap"))
        self.auth.start()
        self.auth.configure_curve_callback(ZAP_DOMAIN, _Zap(self))
        c = ctx.socket(zmq.ROUTER)
        c.curve_server = True
        c.curve_secretkey = self.keys.secret.encode()
        c.curve_publickey = self.keys.public.encode()
        c.zap_domain = ZAP_DOMAIN.encode()
        c.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REQUEST_BYTES)
        c.setsockopt(zmq.HANDSHAKE_IVL, 10_000)
        c.setsockopt(zmq.HEARTBEAT_IVL, 2_000)
        c.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10_000)
        c.setsockopt(zmq.RCVHWM, 64)
        c.setsockopt(zmq.SNDHWM, 64)
        c.setsockopt(zmq.LINGER, 1000)
        c.setsockopt(zmq.ROUTER_MANDATORY, 0)
        i = ctx.socket(zmq.ROUTER)
        i.setsockopt(zmq.MAXMSGSIZE, wire.MAX_IDENTITY_BYTES)
        i.setsockopt(zmq.HANDSHAKE_IVL, 5_000)
        i.setsockopt(zmq.RCVHWM, 16)
        i.setsockopt(zmq.LINGER, 0)
        host = self.opts.host
        shown = f"[{host}]" if ":" in host else host
        if ":" in host:
            c.setsockopt(zmq.IPV6, 1)
            i.setsockopt(zmq.IPV6, 1)
        try:
            if self.port == 0:
                self.port = c.bind_to_random_port(f"tcp://{shown}", 20000, 60000)
                self.id_port = i.bind_to_random_port(f"tcp://{shown}", 20000, 60000)
            else:
                c.bind(f"tcp://{shown}:{self.port}")
                i.bind(f"tcp://{shown}:{self.id_port}")
        except zmq.ZMQError as exc:
            for s in (c, i):
                s.close(0)
            self._close_ctx()
            raise AgentError(
                f"cannot listen on {shown}:{self.port} and {self.id_port} ({exc.strerror}): stop the program using "
                "that port or pick another with --port, and check that --host is an address of this PC"
            ) from None
        self.control, self.ident = c, i
        if self.opts.worker_ports is None and self.opts.port == 0:
            self.workers.ports = range(self.port + 10, self.port + 30)
        self._write_state()
        self._start_sampler()
        if self.opts.advertise:
            self._advertise()
        self._event(
            "ready",
            host=host,
            port=self.port,
            id_port=self.id_port,
            fingerprint=self.keys.fingerprint,
            paired=self.paired is not None,
            pairing_code=self.code,
            loopback_only=is_loopback(host),
        )

    def _advertise(self) -> None:
        try:
            report = gpu_mod.gpu_report(self.opts.nvml)
            summary = gpu_mod.gpu_summary(report)
        except Exception:
            summary = "GPUs unknown"
        try:
            self.advert = Advert(
                self.name, self.opts.host, self.port, self.id_port, self.keys.fingerprint, summary
            )
            self.advert.start()
        except Exception as exc:  # discovery is a hint; the agent serves without it
            log.warning("mDNS advertisement is off (%s): add this PC on the main PC by its address", exc)
            self.advert = None

    def _close_ctx(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None

    def start(self) -> "Agent":
        """Bind and serve in a background thread (tests, the CLI); `close()` ends it."""
        self.bind()
        self._thread = threading.Thread(target=self.serve_forever, name="strata-node-agent", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5)
        if self._sampler is not None:
            self._sampler.join(2)
        if self.advert is not None:
            self.advert.stop()
            self.advert = None
        self.workers.shutdown()
        for s in (self.control, self.ident):
            if s is not None:
                s.close(linger=200)
        self.control = self.ident = None
        self._close_ctx()
        try:
            (self.dir / "agent.json").unlink()
        except FileNotFoundError:
            pass

    # -- GPU sampler ------------------------------------------------------------------------------------------

    def _start_sampler(self) -> None:
        try:
            session = gpu_mod.Nvml(self.opts.nvml)
        except gpu_mod.NvmlUnavailable:
            return
        if session.count == 0:
            session.close()
            return

        def run() -> None:
            period = self.opts.sample_ms / 1000.0
            try:
                while not self._stop.wait(period):
                    for s in session.sample_all():
                        with self._sample_lock:
                            self._sample_seq += 1
                            self._samples.append({"seq": self._sample_seq, **s.to_dict()})
            finally:
                session.close()

        self._sampler = threading.Thread(target=run, name="gpu-sampler", daemon=True)
        self._sampler.start()

    def _samples_since(self, since: int) -> dict[str, Any]:
        with self._sample_lock:
            out = [s for s in self._samples if s["seq"] > since]
            return {"samples": out, "next": self._sample_seq}

    # -- serving ----------------------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        assert self.control is not None and self.ident is not None
        poller = zmq.Poller()
        poller.register(self.control, zmq.POLLIN)
        poller.register(self.ident, zmq.POLLIN)
        last_housekeeping = 0.0
        while not self._stop.is_set():
            events = dict(poller.poll(50))
            # The control channel first, and each socket a bounded number of messages per turn: a flood on the
            # open identity port cannot starve the paired main's calls.
            if self.control in events:
                for _ in range(16):  # a burst of upload chunks without a poll between them
                    try:
                        frames = self.control.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._on_control(frames)
            if self.ident in events:
                self._answer_identity(IDENT_PER_TURN)
            now = time.monotonic()
            if now - last_housekeeping > 0.25:
                last_housekeeping = now
                self.workers.poll()
                self._check_pairing_file()
            if self._pending:
                self._flush_pending(now)

    def stop(self) -> None:
        self._stop.set()

    def _answer_identity(self, at_most: int) -> None:
        assert self.ident is not None
        for _ in range(at_most):
            try:
                frames = self.ident.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            reply = wire.pack(
                {
                    "service": "strata-node",
                    "name": self.name,
                    "version": __version__,
                    "protocol": wire.PROTOCOL,
                    "public_key": self.keys.public,
                    "fingerprint": self.keys.fingerprint,
                    "port": self.port,
                }
            )
            self.ident.send_multipart([frames[0], *frames[1:-1], reply])

    def _send(self, route: list[bytes], payload: bytes) -> None:
        assert self.control is not None
        try:
            self.control.send_multipart([*route, payload], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the client is gone or not reading: it will time out and retry

    def _on_control(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            return
        route = [f.bytes for f in frames[:-1]]
        try:
            user = frames[-1].get("User-Id")
        except zmq.ZMQError:
            user = None
        req_id: int | None = None
        try:
            env, args = wire.parse_request(frames[-1].bytes)
            req_id = env.id
            result = self._dispatch(env.cmd, args, user, route, env.id)
        except wire.WireError as exc:
            self._send(route, wire.fail(req_id if req_id is not None else exc.req_id, str(exc), exc.code))
            return
        except (StoreError, WorkerError, ValueError) as exc:
            self._send(route, wire.fail(req_id, str(exc), "refused"))
            return
        except Exception as exc:  # a bug must not take the agent down; the main sees a one-line error
            log.exception("request failed")
            self._send(route, wire.fail(req_id, f"the agent failed: {type(exc).__name__}: {exc}", "failed"))
            return
        if result is not None:
            self._send(route, wire.ok(env.id, result))

    def _dispatch(self, cmd: str, args: Any, user: str | None, route: list[bytes], req_id: int) -> Any:
        needs_pairing = wire.COMMANDS[cmd][1]
        is_main = self.paired is not None and user == self.paired["main_key"]
        if cmd == "hello":
            return {
                "name": self.name,
                "fingerprint": self.keys.fingerprint,
                "version": __version__,
                "protocol": wire.PROTOCOL,
                "paired_to_you": is_main,
            }
        if cmd == "pair":
            return self._pair(args, user)
        if needs_pairing and not is_main:
            if self.paired is None:
                raise wire.WireError(f"{cmd} refused: this agent is not paired; pair it first", "not_paired")
            raise wire.WireError(f"{cmd} refused: this agent is paired with another main PC", "not_paired")
        if cmd == "unpair":
            self._paired_path.unlink(missing_ok=True)
            self._check_pairing_file()
            return {"unpaired": True}
        if cmd == "info":
            return {
                "name": self.name,
                "version": __version__,
                "fingerprint": self.keys.fingerprint,
                "pc": gpu_mod.pc_report(),
                "gpu": gpu_mod.gpu_report(self.opts.nvml),
                "free_disk": self.store.free_bytes(),
                "worker_ports": [self.workers.ports.start, self.workers.ports.stop - 1],
                "flags": sorted(FLAG_WHITELIST),
            }
        if cmd == "gpu_samples":
            res = self._samples_since(args.since)
            if res["samples"] or args.wait_ms == 0 or self._sampler is None:
                return res
            self._pending.append((route, req_id, cmd, args, time.monotonic() + args.wait_ms / 1000))
            return None
        if cmd == "files":
            return {"files": self.store.files(), "free_disk": self.store.free_bytes()}
        if cmd == "upload_begin":
            return self.store.begin(args.name, args.size, args.sha256)
        if cmd == "upload_chunk":
            return self.store.chunk(args.name, args.offset, args.data)
        if cmd == "upload_end":
            return self.store.end(args.name)
        if cmd == "delete_file":
            return self.store.delete(args.name)
        if cmd == "new_key":
            return self.workers.new_key()
        if cmd == "start_worker":
            return self.workers.start(args)
        if cmd == "stop_worker":
            return self.workers.stop(args.id)
        if cmd == "workers":
            return {"workers": self.workers.list()}
        if cmd == "logs":
            self.workers.get(args.id)
            if args.wait_ms == 0 or self.workers.has_lines(args.id, args.since):
                return self.workers.logs(args.id, args.since)
            self._pending.append((route, req_id, cmd, args, time.monotonic() + args.wait_ms / 1000))
            return None
        if cmd == "lock_clocks":
            return self._clocks(args.gpu, True, args.sm, args.mem)
        if cmd == "reset_clocks":
            return self._clocks(args.gpu, False, None, None)
        raise wire.WireError(f"unknown command {cmd!r}", "unknown_command")

    def _clocks(self, index: int, lock: bool, sm: list[int] | None, mem: list[int] | None) -> dict[str, Any]:
        try:
            session = gpu_mod.Nvml(self.opts.nvml)
        except gpu_mod.NvmlUnavailable as exc:
            word = "locked" if lock else "reset"
            return gpu_mod.ClockResult(index, False, f"NOT {word}: {exc}").to_dict()
        try:
            session.handle(index)
            if lock:
                res = session.lock(index, tuple(sm) if sm else None, tuple(mem) if mem else None)  # type: ignore[arg-type]
            else:
                res = session.reset(index)
            return res.to_dict()
        finally:
            session.close()

    def _pair(self, args: wire.PairArgs, user: str | None) -> dict[str, Any]:
        if user is None:
            raise wire.WireError("pair refused: the connection carries no CURVE key", "refused")
        if self.paired is not None:
            if user == self.paired["main_key"]:
                return {"paired": True, "name": self.name, "fingerprint": self.keys.fingerprint}
            raise wire.WireError(
                "pair refused: this agent is already paired with another main PC; on this PC run "
                "`strata-node unpair` to pair it again",
                "already_paired",
            )
        if self.code is None:
            self._new_code()
        assert self.code is not None
        now = time.monotonic()
        if now < self.pair_after:
            # refused unchecked: a guess costs the guesser the wait, not the user the code
            raise wire.WireError(
                f"too many wrong pairing codes: try again in {self.pair_after - now:.0f} s (the code this agent "
                "shows stays valid)",
                "slow_down",
            )
        if not codes_equal(self.code, args.code):
            self.wrong_codes += 1
            extra = self.wrong_codes - FREE_TRIES
            if extra >= 0:
                wait = min(PAIR_BACKOFF_S * 2**extra, PAIR_BACKOFF_MAX_S)
                self.pair_after = now + wait
                raise wire.WireError(
                    f"wrong pairing code: check the code this agent shows (the next try in {wait:.0f} s)",
                    "wrong_code",
                )
            raise wire.WireError("wrong pairing code: check the code this agent shows", "wrong_code")
        self.paired = {
            "main_key": user,
            "main_name": args.main_name[:128],
            "paired_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        write_private_json(self._paired_path, self.paired)
        self._paired_mtime = self._paired_path.stat().st_mtime
        self.code = None
        self._write_state()
        self._event("paired", main_name=args.main_name, main_fingerprint=fingerprint(user))
        return {"paired": True, "name": self.name, "fingerprint": self.keys.fingerprint}

    def _flush_pending(self, now: float) -> None:
        keep = []
        for route, req_id, cmd, args, deadline in self._pending:
            if cmd == "logs":
                ready = self.workers.has_lines(args.id, args.since)
                if ready or now >= deadline:
                    try:
                        self._send(route, wire.ok(req_id, self.workers.logs(args.id, args.since)))
                    except WorkerError as exc:
                        self._send(route, wire.fail(req_id, str(exc), "refused"))
                    continue
            elif cmd == "gpu_samples":
                res = self._samples_since(args.since)
                if res["samples"] or now >= deadline:
                    self._send(route, wire.ok(req_id, res))
                    continue
            keep.append((route, req_id, cmd, args, deadline))
        self._pending = keep
