"""The connecting side of a stage link (the main process, or a relay towards the next worker): handshake, requests
with a deadline on silence, and reconnection after a failure.

A request in flight is kept alive by the worker's `busy` messages; when nothing at all arrives for `stall_s`, or
libzmq reports the connection lost (its heartbeats notice a dead, frozen or cut-off peer within about a second),
the request fails with an error naming the stage and its address. The next `connect` starts a fresh socket and a
fresh handshake (a new epoch): replies of the old one are dropped by their epoch and sequence numbers.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.link import protocol as P
from engine.link.keys import ClientKeys, fingerprint
from engine.link.transport import HANDSHAKE_MS, Endpoint, client_socket

log = logging.getLogger("strata.link")

STALL_S = 3.0  # silence that fails a request (the worker says `busy` every BUSY_S while it works)
HELLO_S = 10.0
BUSY_WAIT_S = 3.0  # a "busy" refusal (the worker still sees our previous connection) is asked again this long


class StageError(RuntimeError):
    """A remote stage failed, refused, or could not be reached; the message names it and its address."""

    def __init__(self, message: str, code: str = "unreachable") -> None:
        super().__init__(message)
        self.code = code


@dataclass
class Reply:
    seq: int
    message: P.Message
    rtt_ms: float


class StageClient:
    def __init__(
        self,
        endpoint: Endpoint,
        keys: ClientKeys,
        max_payload: int,
        label: str = "",
        stall_s: float = STALL_S,
        hello_s: float = HELLO_S,
        handshake_ms: int = HANDSHAKE_MS,
    ) -> None:
        self.endpoint = endpoint
        self.keys = keys
        self.max_payload = max_payload
        self.label = label or f"the stage at {endpoint}"
        self.stall_s = stall_s
        self.hello_s = hello_s
        self.handshake_ms = handshake_ms
        self.ctx: zmq.Context | None = None
        self.sock: zmq.Socket | None = None
        self.monitor: zmq.Socket | None = None
        self.lost = ""
        """Why the connection ended while idle (check_idle), for the link's status."""
        self.session = 0
        self.epoch = 0
        self.seq = 0
        self.chain: list[P.StageInfo] = []
        self.width: int | None = None
        self.in_flight: dict[int, float] = {}  # seq -> send time
        self.ok = False
        self.last_error = ""
        self.heard = 0.0

    # ---- connection ----

    def _open(self) -> None:
        self.close()
        self.ctx = zmq.Context()
        max_msg = self.max_payload + P.MAX_HEADER_BYTES + 1024
        self.sock = client_socket(self.ctx, self.keys, self.endpoint, max_msg, self.handshake_ms)
        self.monitor = self.sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_CONNECT_RETRIED
        )

    def close(self) -> None:
        """Drop the connection now (what is in flight is abandoned)."""
        self.ok = False
        self.in_flight.clear()
        if self.sock is not None:
            try:
                self.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self.sock.close(linger=0)
            self.sock = None
        if self.monitor is not None:
            self.monitor.close(linger=0)
            self.monitor = None
        if self.ctx is not None:
            self.ctx.term()
            self.ctx = None

    def _fail(self, text: str, code: str = "unreachable") -> StageError:
        self.last_error = text
        self.close()
        return StageError(text, code)

    def _monitor_event(self) -> None:
        """Raise for a monitor event that ends the connection; ignore the others."""
        assert self.monitor is not None
        ev = recv_monitor_message(self.monitor)
        what = ev["event"]
        if what == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            raise self._fail(
                f"{self.label} refused this side's key {fingerprint(self.keys.pair.public)} (not on its allow-list): "
                "use the same STRATA_STAGE_TOKEN on both PCs, or add the key with --stage-allow on the worker",
                "refused",
            )
        if what in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
            raise self._fail(
                f"the encrypted handshake with {self.endpoint} failed: the server there does not hold the key of the "
                f"worker this side expects ({fingerprint(self.keys.server)}); check the address, STRATA_STAGE_TOKEN "
                "or --remote-stage-key",
                "refused",
            )
        if what == zmq.EVENT_CONNECT_RETRIED and not self.ok:
            # the port refused (ZeroMQ would retry it quietly until the handshake's deadline: 10 s a request)
            raise self._fail(
                f"{self.label} refused the connection at {self.endpoint}: nothing listens there (is the worker "
                f"running: strata-engine worker --stage-worker {self.endpoint.port}?)"
            )
        if what == zmq.EVENT_DISCONNECTED and (self.in_flight or self.ok):
            raise self._fail(f"{self.label} disconnected (the worker stopped, froze or its link was cut)")

    def connect(self, expect: P.StageInfo) -> list[P.StageInfo]:
        """Handshake: -> the stages behind this link (the worker's own and those it relays to). A worker that
        still sees this process's previous connection (closed a moment ago, or cut and not yet timed out by its
        heartbeats) refuses as busy: asked again for up to BUSY_WAIT_S before that refusal stands."""
        until = time.monotonic() + BUSY_WAIT_S
        while True:
            try:
                return self._connect_once(expect)
            except StageError as e:
                if e.code != "busy" or time.monotonic() >= until:
                    raise
            time.sleep(0.2)

    def _connect_once(self, expect: P.StageInfo) -> list[P.StageInfo]:
        self._open()
        assert self.sock is not None and self.monitor is not None
        self.session = secrets.randbits(63)
        self.seq = 0
        nonce = os.urandom(16)
        frames = P.pack("hello", {"s": self.session, "nonce": nonce, "info": expect.to_wire()})
        deadline = time.monotonic() + self.hello_s
        self._send(frames, deadline, "the handshake")
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(
                    f"{self.label} did not answer the handshake within {self.hello_s:.0f} s: is the worker running "
                    f"(strata-engine worker --stage-worker {self.endpoint.port}) and the port open?"
                )
            events = dict(poller.poll(int(left * 1000) + 1))
            if self.monitor in events:
                self._monitor_event()
            if self.sock in events:
                msg = self._recv()
                if msg is None or msg.get("s") != self.session:
                    continue
                if msg.kind == "error":
                    raise self._fail(f"{self.label} refused the handshake: {msg.get('msg')}", msg.get("code"))
                if msg.kind != "welcome":
                    continue
                try:
                    chain = [P.StageInfo.from_wire(i, "welcome info") for i in _as_list(msg.get("info"))]
                    epoch = P._int(msg.get("e"), "epoch")
                except P.FrameError as e:
                    raise self._fail(f"{self.label} sent a malformed welcome: {e}", "bad_frame") from None
                if not chain:
                    raise self._fail(f"{self.label} sent an empty welcome", "bad_frame")
                self.epoch = epoch
                self.chain = chain
                self.width = chain[0].n_embd
                self.ok = True
                self.last_error = ""
                return chain

    def _send(self, frames: Sequence[bytes | memoryview], deadline: float, what: str) -> None:
        """Send when the connection is up (IMMEDIATE: nothing is queued for a peer that is not there)."""
        assert self.sock is not None and self.monitor is not None
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLOUT)
        poller.register(self.monitor, zmq.POLLIN)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(
                    f"{self.label} is not reachable at {self.endpoint} (no connection for {what})"
                )
            events = dict(poller.poll(int(min(left, 0.5) * 1000) + 1))
            if self.monitor in events:
                self._monitor_event()
            if self.sock in events and events[self.sock] & zmq.POLLOUT:
                try:
                    self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:
                    continue

    def _recv(self) -> P.Message | None:
        assert self.sock is not None
        frames = self.sock.recv_multipart(copy=False)
        limits = P.Limits(max_payload=self.max_payload, width=self.width)
        try:
            return P.decode([f.buffer for f in frames], limits)
        except P.FrameError as e:
            log.warning("%s: dropped a malformed message: %s", self.label, e)
            return None

    # ---- requests ----

    def submit(
        self,
        payload: bytes | memoryview,
        dtype: str,
        shape: Sequence[int],
        start: int,
        rows: Sequence[tuple[int, int, int]] | None = None,
    ) -> int:
        """Send a hidden state [T, D] for positions start..start+T of the session's first sequence, or with `rows`
        ((slot, start, count) in order) for several sequences' rows; -> its sequence number."""
        if not self.ok or self.sock is None:
            raise StageError(
                f"{self.label} is not connected{': ' + self.last_error if self.last_error else ''}"
            )
        self.seq += 1
        fields = {
            "s": self.session,
            "e": self.epoch,
            "q": self.seq,
            "p": start,
            **P.tensor_fields(dtype, shape),
        }
        if rows is not None:
            fields["r"] = [list(r) for r in rows]
        self._send(P.pack("fwd", fields, payload), time.monotonic() + self.stall_s, "a request")
        self.in_flight[self.seq] = time.perf_counter()
        self.heard = time.monotonic()
        return self.seq

    def poll(self, timeout_s: float) -> Reply | None:
        """The next reply to a request in flight, or None after `timeout_s`; StageError when the stage failed:
        an error reply, a lost connection, or `stall_s` of silence while something is in flight."""
        if self.sock is None or self.monitor is None:
            raise StageError(
                f"{self.label} is not connected{': ' + self.last_error if self.last_error else ''}"
            )
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        end = time.monotonic() + timeout_s
        while True:
            now = time.monotonic()
            if self.in_flight and now - self.heard > self.stall_s:
                raise self._fail(
                    f"{self.label} did not answer for {self.stall_s:.0f} s (the worker stopped, froze, or its link "
                    "was cut)"
                )
            if now >= end:
                return None
            wait = end - now
            if self.in_flight:
                wait = min(wait, self.heard + self.stall_s - now + 0.005)
            events = dict(poller.poll(max(1, int(wait * 1000))))
            if self.monitor in events:
                self._monitor_event()
            if self.sock not in events:
                continue
            msg = self._recv()
            if msg is None or msg.get("s") != self.session or msg.get("e") != self.epoch:
                continue  # a reply of an earlier connection: dropped
            self.heard = time.monotonic()
            if msg.kind == "busy":
                continue
            q = msg.get("q")
            if msg.kind == "error":
                raise self._fail(str(msg.get("msg")), str(msg.get("code")))
            if msg.kind != "out" or q not in self.in_flight:
                continue  # a stale or duplicated reply
            t0 = self.in_flight.pop(q)
            return Reply(q, msg, (time.perf_counter() - t0) * 1e3)

    def check_idle(self) -> bool:
        """Read what the connection reported while nobody listened; -> still connected (False: a new handshake is
        needed, e.g. the worker restarted between two requests)."""
        if not self.ok or self.monitor is None:
            return False
        try:
            while self.monitor.poll(0):
                self._monitor_event()
        except StageError as e:
            self.lost = str(e)
            return False
        return self.ok

    def wait(self, seq: int) -> Reply:
        """Block until the reply to `seq` (earlier replies must have been taken)."""
        if seq not in self.in_flight:  # sent on a connection since renewed: its answer will not come
            raise StageError(f"{self.label}: request {seq} was sent on an earlier connection", "stale")
        while True:
            r = self.poll(self.stall_s)
            if r is None:
                continue
            if r.seq != seq:
                raise self._fail(f"{self.label} answered request {r.seq} while {seq} was awaited", "stale")
            return r


def _as_list(v: object) -> list[object]:
    return list(v) if isinstance(v, list) else [v]
