"""ZeroMQ sockets of the stage link: a ROUTER that listens (the worker), a DEALER that connects (the stage before),
both with CURVE always on and the options the link relies on.

- ZAP allow-list on every listening socket, enforced (`ZAP_ENFORCE_DOMAIN`): a client key not on the list gets no
  connection, and without the authenticator no connection at all (fail closed).
- `MAXMSGSIZE`: a peer that sends a larger message is disconnected by libzmq before it is buffered.
- ZMTP heartbeats (`HEARTBEAT_IVL/TIMEOUT/TTL`): a peer that stops answering (killed, frozen, cut off) is
  disconnected within about a second; `HANDSHAKE_IVL`: one that does not finish the CURVE handshake in 10 s is closed.
- High-water marks bound what a flood can queue; the listener's `LINGER` lets its last replies leave on close.
"""

from __future__ import annotations

import logging
import re
import socket as pysocket
import threading
import time
from dataclasses import dataclass

import zmq
from zmq.utils import z85

from engine.link.keys import ClientKeys, ServerKeys, fingerprint

log = logging.getLogger("strata.link")

ZAP_DOMAIN = "strata-stage"
HEARTBEAT_IVL_MS = 200
HEARTBEAT_TIMEOUT_MS = 1000
HEARTBEAT_TTL_MS = 2000
HANDSHAKE_MS = 10_000
SERVER_LINGER_MS = 2000
CLIENT_LINGER_MS = 200
HWM = 64


class EndpointError(ValueError):
    pass


@dataclass(frozen=True)
class Endpoint:
    host: str
    port: int

    @property
    def ipv6(self) -> bool:
        return ":" in self.host

    def zmq(self) -> str:
        return f"tcp://[{self.host}]:{self.port}" if self.ipv6 else f"tcp://{self.host}:{self.port}"

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if self.ipv6 else f"{self.host}:{self.port}"


def parse_endpoint(text: str, flag: str = "--remote-stage") -> Endpoint:
    """`HOST:PORT`, `[IPv6]:PORT`."""
    t = text.strip()
    m = re.fullmatch(r"\[([0-9A-Fa-f:.%a-zA-Z]+)\]:(\d+)", t) or re.fullmatch(r"([A-Za-z0-9.\-_]+):(\d+)", t)
    if not m:
        raise EndpointError(f"{flag} {text!r}: expected HOST:PORT, e.g. 192.168.1.20:7070 or [fd00::2]:7070")
    port = int(m.group(2))
    if not 1 <= port <= 65535:
        raise EndpointError(f"{flag} {text!r}: the port must be 1..65535")
    return Endpoint(m.group(1), port)


class _AllowList:
    """ZAP handler (RFC 27) on its own thread: admits exactly the listed CURVE client keys, refuses the rest.

    Ours rather than pyzmq's thread authenticator so that it keeps answering until the context is terminated:
    connections still being torn down at close then get their answer (libzmq aborts a session whose ZAP peer
    vanished mid-request)."""

    def __init__(self, ctx: zmq.Context, allowed: frozenset[bytes], domain: str, label: str) -> None:
        self.allowed = allowed
        self.domain = domain
        self.label = label
        self.refused = 0
        self.last_request = 0.0  # time.monotonic() of the last ZAP request: close() waits for them to stop
        self._last_log = 0.0
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind("inproc://zeromq.zap.01")
        self._thread = threading.Thread(target=self._run, name="strata-link-zap", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        sock = self._sock
        try:
            while True:
                try:
                    msg = sock.recv_multipart()
                except zmq.ContextTerminated:
                    return
                self.last_request = time.monotonic()
                sock.send_multipart(self._answer(msg))
        except zmq.ContextTerminated:
            return
        finally:
            sock.close(linger=0)

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        if len(msg) < 6:
            return [b"1.0", msg[1] if len(msg) > 1 else b"", b"400", b"bad request", b"", b""]
        version, request_id, domain, _address, _identity, mechanism = msg[:6]
        creds = msg[6:]
        ok = (
            version == b"1.0"
            and domain.decode("utf-8", "replace") == self.domain
            and mechanism == b"CURVE"
            and len(creds) == 1
            and len(creds[0]) == 32
            and z85.encode(creds[0]) in self.allowed
        )
        if ok:
            return [b"1.0", request_id, b"200", b"OK", b"client", b""]
        self.refused += 1
        now = time.monotonic()
        if now - self._last_log > 5.0:  # a flood of attempts must not flood the log
            self._last_log = now
            key = fingerprint(z85.encode(creds[0])) if len(creds) == 1 and len(creds[0]) == 32 else "none"
            log.warning("%s: refused a client whose key %s is not on the allow-list", self.label, key)
        return [b"1.0", request_id, b"400", b"not allowed", b"", b""]

    def join(self) -> None:
        self._thread.join(timeout=10)


def _common(sock: zmq.Socket, max_msg: int, handshake_ms: int) -> None:
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    sock.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TTL_MS)
    sock.setsockopt(zmq.HANDSHAKE_IVL, handshake_ms)
    sock.setsockopt(zmq.SNDHWM, HWM)
    sock.setsockopt(zmq.RCVHWM, HWM)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)


_SESSION_TEARDOWN_S = 0.05  # at least this long between closing a listener's socket and ending its context
_ZAP_QUIET_S = 0.1  # ... and until no ZAP request came for this long
_ZAP_QUIET_MAX_S = 1.0  # ... but no longer than this (a flood of hostile handshakes)


class Listener:
    """A CURVE ROUTER with its own context and ZAP authenticator (one per listening stage)."""

    def __init__(
        self,
        keys: ServerKeys,
        bind: str,
        port: int,
        max_msg: int,
        label: str,
        handshake_ms: int = HANDSHAKE_MS,
    ) -> None:
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq has no CURVE: reinstall pyzmq from its wheels")
        self.ctx = zmq.Context()
        self.allow = _AllowList(self.ctx, keys.allow, ZAP_DOMAIN, label)
        self.sock = self.ctx.socket(zmq.ROUTER)
        s = self.sock
        s.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        s.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        s.curve_server = True
        s.curve_secretkey = keys.pair.secret
        s.curve_publickey = keys.pair.public
        _common(s, max_msg, handshake_ms)
        s.setsockopt(zmq.LINGER, SERVER_LINGER_MS)
        s.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a peer that left is dropped, not an error
        host = bind.strip("[]")
        if ":" in host:
            s.setsockopt(zmq.IPV6, 1)
        try:
            if port == 0:
                self.port = s.bind_to_random_port(f"tcp://{'[' + host + ']' if ':' in host else host}")
            else:
                s.bind(f"tcp://{'[' + host + ']' if ':' in host else host}:{port}")
                self.port = port
        except zmq.ZMQError as e:
            self.close(0)
            raise OSError(
                f"cannot listen on {bind}:{port}: {e.strerror}; stop the program using that port or pick another "
                "with --stage-worker"
            ) from None

    def close(self, linger_ms: int = SERVER_LINGER_MS) -> None:
        """Close the socket (its last replies leave within the linger), then end the context: the ZAP thread
        answers until then and closes its socket when the context ends."""
        self.sock.close(linger=linger_ms)
        # A connection still in its handshake when the context ends can write its ZAP request to a handler that
        # is already gone, which libzmq treats as an assertion failure (zeromq/libzmq#2476); a test's teardown
        # aborted inside the context's termination once, on a loaded machine. The closed socket accepts nothing
        # new, so wait until the handshakes under way have stopped asking (no ZAP request for a while), bounded.
        start = time.monotonic()
        time.sleep(_SESSION_TEARDOWN_S)
        while (
            time.monotonic() - self.allow.last_request < _ZAP_QUIET_S
            and time.monotonic() - start < _ZAP_QUIET_MAX_S
        ):
            time.sleep(0.01)
        self.ctx.term()
        self.allow.join()


def client_socket(
    ctx: zmq.Context, keys: ClientKeys, endpoint: Endpoint, max_msg: int, handshake_ms: int
) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.curve_serverkey = keys.server
    s.curve_publickey = keys.pair.public
    s.curve_secretkey = keys.pair.secret
    _common(s, max_msg, handshake_ms)
    s.setsockopt(zmq.LINGER, CLIENT_LINGER_MS)
    s.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for a peer that is not connected
    s.setsockopt(zmq.RECONNECT_IVL, 100)
    s.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    if endpoint.ipv6:
        s.setsockopt(zmq.IPV6, 1)
    s.connect(endpoint.zmq())
    return s


def resolve_ok(host: str) -> bool:
    try:
        pysocket.getaddrinfo(host, None)
        return True
    except OSError:
        return False


_counter_lock = threading.Lock()
_counter = [0]


def inproc_name(prefix: str) -> str:
    with _counter_lock:
        _counter[0] += 1
        return f"inproc://{prefix}-{_counter[0]}"
