"""The main PC's side of the node agents: its key, the paired nodes it remembers, and `NodeClient`.

`NodeClient` talks to one agent over a DEALER socket with CURVE, the agent's public key pinned from pairing. Each
request has an id and a deadline; after a timeout or a protocol error the socket is closed and opened again (ZeroMQ
does not retry a request by itself). When an agent does not answer, a socket monitor tells why, with the address:
nothing listening, a handshake with a different key (not the paired agent), this main's key refused, or silence.
"""

import itertools
import platform
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.node import wire
from engine.node.errors import NodeCliError
from engine.node.keys import (
    KeyPair,
    check_key,
    fingerprint,
    load_or_create_keypair,
    normalize_fingerprint,
    read_json,
    write_certificate,
    write_private_json,
)
from installer import paths


class NodeError(NodeCliError, RuntimeError):
    """An agent request that failed; `code` is the agent's refusal code or unreachable / handshake / timeout."""

    def __init__(self, message: str, code: str = "failed") -> None:
        super().__init__(message)
        self.code = code


def main_dir() -> Path:
    return paths.data_dir() / "main"


def main_keys(directory: Path | None = None) -> KeyPair:
    return load_or_create_keypair((directory or main_dir()) / "main-key.json")


def main_key_file(keys: KeyPair | None = None, directory: Path | None = None) -> Path:
    """The main PC's key pair as a ZeroMQ certificate file: what `strata-engine --stage-key FILE` reads, so the main
    process connects to workers with the key the agents were paired with."""
    keys = keys or main_keys(directory)
    return write_certificate((directory or main_dir()) / "main.key_secret", keys, "PolyStrata main PC key")


def _endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _new_socket(ctx: zmq.Context, kind: int, host: str) -> zmq.Socket:
    s = ctx.socket(kind)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REPLY_BYTES)
    s.setsockopt(zmq.RECONNECT_IVL, 200)
    s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    s.setsockopt(zmq.HEARTBEAT_IVL, 2000)
    s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
    if ":" in host:
        s.setsockopt(zmq.IPV6, 1)
    return s


# ---------------------------------------------------------------------------------------------------------------
# Identity (before pairing)


@dataclass(frozen=True)
class Identity:
    host: str
    port: int
    id_port: int
    name: str
    version: str
    public_key: str
    fingerprint: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def identify(
    host: str, port: int = wire.DEFAULT_PORT, timeout: float = 3.0, id_port: int | None = None
) -> Identity:
    """Ask the agent at host:port who it is (its identity socket, port+1). Unverified until the user compares the
    fingerprint; the fingerprint is recomputed here from the key, never taken from the answer."""
    id_port = id_port or port + 1
    where = _endpoint(host, id_port)
    ctx = zmq.Context.instance()
    s = _new_socket(ctx, zmq.DEALER, host)
    try:
        s.connect(where)
        s.send(wire.pack({"cmd": "identify"}))
        if not s.poll(int(timeout * 1000)):
            raise NodeError(
                f"no answer from {where} within {timeout:g} s: is `strata-node serve` running on that PC, with this "
                "address and port, and does its firewall let the port through?",
                "unreachable",
            )
        data = wire.unpack(s.recv(), 4096)
    finally:
        s.close(0)
    if not isinstance(data, dict) or data.get("service") != "strata-node":
        raise NodeError(f"{where} is not a strata-node agent (unexpected answer)", "bad_answer")
    try:
        key = check_key(data.get("public_key"), "the agent's public key")
    except ValueError as exc:
        raise NodeError(f"{where} answered with a bad key ({exc})", "bad_answer") from None
    cport = data.get("port")
    return Identity(
        host=host,
        port=cport if isinstance(cport, int) and 0 < cport < 65536 else port,
        id_port=id_port,
        name=str(data.get("name", ""))[:64],
        version=str(data.get("version", ""))[:32],
        public_key=key,
        fingerprint=fingerprint(key),
    )


# ---------------------------------------------------------------------------------------------------------------
# The paired nodes this main remembers


@dataclass(frozen=True)
class NodeRecord:
    name: str
    host: str
    port: int
    id_port: int
    public_key: str
    fingerprint: str
    included: bool = True
    paired_at: str = ""

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "address": self.address}


class NodeRegistry:
    """`nodes.json` in the main's data folder: the paired agents, their pinned keys, included or not."""

    def __init__(self, directory: Path | None = None) -> None:
        self.path = (directory or main_dir()) / "nodes.json"

    def load(self) -> list[NodeRecord]:
        data = read_json(self.path)
        if data is None:
            return []
        out = []
        for raw in data.get("nodes", []) if isinstance(data, dict) else []:
            try:
                rec = NodeRecord(**{k: raw[k] for k in NodeRecord.__dataclass_fields__ if k in raw})
                check_key(rec.public_key)
            except (TypeError, ValueError):
                continue  # a hand-edited entry that cannot be used is skipped, never trusted half-way
            out.append(replace(rec, fingerprint=fingerprint(rec.public_key)))
        return out

    def save(self, nodes: list[NodeRecord]) -> None:
        write_private_json(self.path, {"nodes": [asdict(n) for n in nodes]})

    def find(self, ref: str) -> NodeRecord:
        """By name, HOST:PORT, host, or fingerprint (any unambiguous one)."""
        nodes = self.load()
        fp = normalize_fingerprint(ref)
        for test in (
            lambda n: n.address == ref,
            lambda n: n.fingerprint == fp,
            lambda n: n.name == ref,
            lambda n: n.host == ref,
        ):
            hits = [n for n in nodes if test(n)]
            if len(hits) == 1:
                return hits[0]
            if len(hits) > 1:
                raise NodeError(f"{ref!r} matches {len(hits)} paired PCs: name one by HOST:PORT", "ambiguous")
        known = ", ".join(f"{n.name} ({n.address})" for n in nodes) or "none"
        raise NodeError(
            f"no paired PC {ref!r}; paired PCs: {known}. Pair it with `strata-node pair`", "unknown"
        )

    def upsert(self, rec: NodeRecord) -> None:
        nodes = [n for n in self.load() if n.public_key != rec.public_key and n.address != rec.address]
        self.save([*nodes, rec])

    def remove(self, rec: NodeRecord) -> None:
        self.save([n for n in self.load() if n.public_key != rec.public_key])

    def set_included(self, rec: NodeRecord, included: bool) -> NodeRecord:
        new = replace(rec, included=included)
        self.save([new if n.public_key == rec.public_key else n for n in self.load()])
        return new


# ---------------------------------------------------------------------------------------------------------------
# The control channel


_EVENT_NAMES = {getattr(zmq, n): n for n in dir(zmq) if n.startswith("EVENT_")}
HANDSHAKE_FAILED = {
    "EVENT_HANDSHAKE_FAILED_AUTH",
    "EVENT_HANDSHAKE_FAILED_NO_DETAIL",
    "EVENT_HANDSHAKE_FAILED_PROTOCOL",
}


class NodeClient:
    """Requests to one paired agent. Not thread-safe: one per thread."""

    def __init__(
        self,
        host: str,
        port: int,
        server_key: str,
        keys: KeyPair | None = None,
        timeout: float = 10.0,
        name: str = "",
    ) -> None:
        self.host = host
        self.port = port
        self.server_key = check_key(server_key, "the agent's key")
        self.keys = keys or main_keys()
        self.timeout = timeout
        self.name = name or f"{host}:{port}"
        self.endpoint = _endpoint(host, port)
        self._ctx = zmq.Context.instance()
        self._ids = itertools.count(1)
        self._sock: zmq.Socket | None = None
        self._mon: zmq.Socket | None = None
        self._events: list[str] = []

    @classmethod
    def for_record(cls, rec: NodeRecord, keys: KeyPair | None = None, timeout: float = 10.0) -> "NodeClient":
        return cls(rec.host, rec.port, rec.public_key, keys, timeout, rec.name)

    def __enter__(self) -> "NodeClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self) -> zmq.Socket:
        if self._sock is None:
            s = _new_socket(self._ctx, zmq.DEALER, self.host)
            s.curve_serverkey = self.server_key.encode()
            s.curve_publickey = self.keys.public.encode()
            s.curve_secretkey = self.keys.secret.encode()
            s.setsockopt(zmq.SNDHWM, 64)
            self._mon = s.get_monitor_socket()
            self._events = []
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._sock.close(0)
            self._sock = None
        if self._mon is not None:
            self._mon.close(0)
            self._mon = None

    def _drain_monitor(self) -> None:
        while self._mon is not None and self._mon.poll(0):
            try:
                ev = recv_monitor_message(self._mon)
            except zmq.ZMQError:
                break
            self._events.append(_EVENT_NAMES.get(int(ev["event"]), str(ev["event"])))

    def _wait(self, s: zmq.Socket, left: float) -> bool:
        """Wait up to `left` s for a reply on `s`; False at once when the handshake failed (a refused or wrong key
        is known in milliseconds: the caller's diagnose names it without waiting out the timeout)."""
        poller = zmq.Poller()
        poller.register(s, zmq.POLLIN)
        if self._mon is not None:
            poller.register(self._mon, zmq.POLLIN)
        deadline = time.monotonic() + left
        while (left := deadline - time.monotonic()) > 0:
            events = dict(poller.poll(int(left * 1000) + 1))
            if s in events:
                return True
            if self._mon is not None and self._mon in events:
                self._drain_monitor()
                if HANDSHAKE_FAILED & set(self._events):
                    return False
        return False

    def diagnose(self, waited: float) -> NodeError:
        """Why nothing came back, from what the socket saw."""
        self._drain_monitor()
        ev = set(self._events)
        where = self.endpoint
        if "EVENT_HANDSHAKE_FAILED_AUTH" in ev:
            return NodeError(
                f"the agent at {where} refused this main PC's key: it was unpaired or paired with another main; "
                "pair it again (strata-node pair)",
                "key_refused",
            )
        if "EVENT_HANDSHAKE_FAILED_NO_DETAIL" in ev or "EVENT_HANDSHAKE_FAILED_PROTOCOL" in ev:
            return NodeError(
                f"the program at {where} does not hold the paired agent's key (its CURVE handshake failed): another "
                "program or a reinstalled agent answers there; check the PC and pair it again if it was reinstalled",
                "wrong_key",
            )
        if "EVENT_HANDSHAKE_SUCCEEDED" in ev:
            return NodeError(
                f"the agent at {where} accepted the connection but did not answer within {waited:g} s: it is busy "
                "or stuck; check its log on that PC",
                "timeout",
            )
        if "EVENT_CLOSED" in ev or "EVENT_CONNECT_RETRIED" in ev:
            return NodeError(
                f"nothing listens at {where} (connection refused): start `strata-node serve` on that PC and check "
                "its --host and --port",
                "unreachable",
            )
        return NodeError(
            f"no answer from {where} within {waited:g} s: the PC is off or unreachable, or a firewall drops the port",
            "unreachable",
        )

    def call(
        self, cmd: str, args: dict[str, Any] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """Send one request and wait for its reply; NodeError on refusal (the agent's words) or silence."""
        limit = self.timeout if timeout is None else timeout
        s = self._open()
        rid = next(self._ids)
        s.send(wire.pack({"id": rid, "cmd": cmd, "args": args or {}}))
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._wait(s, left):
                err = self.diagnose(limit)
                self.close()  # a late reply must not be read as the answer to the next request
                raise err
            reply = self._parse(s.recv())
            if reply.get("id") == rid:
                break
            # a reply to an earlier, timed-out request on this socket: skip it
        if not reply.get("ok"):
            raise NodeError(str(reply.get("error", "refused")), str(reply.get("code", "refused")))
        result = reply.get("result")
        return result if isinstance(result, dict) else {}

    def _parse(self, data: bytes) -> dict[str, Any]:
        try:
            reply = wire.unpack(data, wire.MAX_REPLY_BYTES)
        except wire.WireError as exc:
            self.close()
            raise NodeError(f"bad answer from {self.endpoint}: {exc}", "bad_answer") from None
        if not isinstance(reply, dict):
            self.close()
            raise NodeError(f"bad answer from {self.endpoint}: not a map", "bad_answer")
        return reply

    def pipeline(
        self, requests: Iterable[tuple[str, dict[str, Any]]], window: int = 4, timeout: float | None = None
    ) -> list[dict[str, Any]]:
        """Several requests with up to `window` in flight (upload chunks); results in order; stops at the first
        refusal (NodeError)."""
        limit = self.timeout if timeout is None else timeout
        s = self._open()
        results: list[dict[str, Any]] = []
        pending: dict[int, int] = {}
        it = iter(enumerate(requests))
        done = False
        while not done or pending:
            while not done and len(pending) < window:
                nxt = next(it, None)
                if nxt is None:
                    done = True
                    break
                idx, (cmd, args) = nxt
                rid = next(self._ids)
                pending[rid] = idx
                s.send(wire.pack({"id": rid, "cmd": cmd, "args": args}))
            if not pending:
                break
            if not s.poll(int(limit * 1000)):
                err = self.diagnose(limit)
                self.close()
                raise err
            reply = self._parse(s.recv())
            rid = reply.get("id")
            if rid not in pending:
                continue
            pending.pop(rid)
            if not reply.get("ok"):
                self.close()  # replies still in flight belong to a broken sequence
                raise NodeError(str(reply.get("error", "refused")), str(reply.get("code", "refused")))
            result = reply.get("result")
            results.append(result if isinstance(result, dict) else {})
        return results

    # -- commands ---------------------------------------------------------------------------------------------

    def hello(self) -> dict[str, Any]:
        return self.call("hello")

    def info(self) -> dict[str, Any]:
        return self.call("info", timeout=max(self.timeout, 20.0))

    def files(self) -> dict[str, Any]:
        return self.call("files")

    def workers(self) -> list[dict[str, Any]]:
        return list(self.call("workers").get("workers", []))

    def new_key(self) -> dict[str, Any]:
        """A worker key pair made ahead of its worker (a relay's): {"key_id", "public_key"}."""
        return self.call("new_key")

    def start_worker(self, **args: Any) -> dict[str, Any]:
        return self.call("start_worker", {k: v for k, v in args.items() if v is not None}, timeout=30.0)

    def stop_worker(self, wid: str) -> dict[str, Any]:
        return self.call("stop_worker", {"id": wid}, timeout=30.0)

    def logs(self, wid: str, since: int = 0, wait_ms: int = 0) -> dict[str, Any]:
        return self.call(
            "logs", {"id": wid, "since": since, "wait_ms": wait_ms}, timeout=self.timeout + wait_ms / 1000
        )

    def gpu_samples(self, since: int = 0, wait_ms: int = 0) -> dict[str, Any]:
        return self.call(
            "gpu_samples", {"since": since, "wait_ms": wait_ms}, timeout=self.timeout + wait_ms / 1000
        )

    def lock_clocks(
        self, gpu: int, sm: list[int] | None = None, mem: list[int] | None = None
    ) -> dict[str, Any]:
        args: dict[str, Any] = {"gpu": gpu}
        if sm:
            args["sm"] = sm
        if mem:
            args["mem"] = mem
        return self.call("lock_clocks", args, timeout=30.0)

    def reset_clocks(self, gpu: int) -> dict[str, Any]:
        return self.call("reset_clocks", {"gpu": gpu}, timeout=30.0)

    def unpair(self) -> dict[str, Any]:
        return self.call("unpair")


def pair(
    host: str,
    port: int,
    code: str,
    expected_fingerprint: str,
    keys: KeyPair | None = None,
    registry: NodeRegistry | None = None,
    main_name: str = "",
    timeout: float = 10.0,
    id_port: int | None = None,
) -> NodeRecord:
    """Pair with the agent at host:port: its fingerprint must be the one the user read on that PC, then the code
    goes to it over CURVE to that very key. On success both sides pin each other's key."""
    keys = keys or main_keys()
    registry = registry or NodeRegistry()
    ident = identify(host, port, min(timeout, 5.0), id_port)
    want = normalize_fingerprint(expected_fingerprint)
    if ident.fingerprint != want:
        raise NodeError(
            f"the agent at {host}:{ident.id_port} has fingerprint {ident.fingerprint}, not {want} as confirmed: "
            "this is not the PC you meant (or someone else answers there); nothing was sent",
            "fingerprint_mismatch",
        )
    client = NodeClient(host, ident.port, ident.public_key, keys, timeout, ident.name)
    try:
        res = client.call("pair", {"code": code, "main_name": main_name or platform.node()})
    finally:
        client.close()
    rec = NodeRecord(
        name=str(res.get("name") or ident.name),
        host=host,
        port=ident.port,
        id_port=ident.id_port,
        public_key=ident.public_key,
        fingerprint=ident.fingerprint,
        included=True,
        paired_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    registry.upsert(rec)
    return rec


def node_status(rec: NodeRecord, keys: KeyPair | None = None, timeout: float = 3.0) -> dict[str, Any]:
    """Health of one paired node for the app's list: reachable or the exact address and reason it is not."""
    out: dict[str, Any] = {**rec.to_dict(), "reachable": False, "problem": ""}
    client = NodeClient.for_record(rec, keys, timeout)
    try:
        hello = client.hello()
        if not hello.get("paired_to_you"):
            out["problem"] = (
                f"the agent at {rec.address} is no longer paired with this main PC: pair it again (strata-node pair)"
            )
            return out
        info = client.info()
        out.update(
            reachable=True,
            version=hello.get("version"),
            pc=info.get("pc"),
            gpu=info.get("gpu"),
            free_disk=info.get("free_disk"),
            workers=client.workers(),
        )
    except NodeError as exc:
        out["problem"] = str(exc)
        out["problem_code"] = exc.code
    finally:
        client.close()
    return out
