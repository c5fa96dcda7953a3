"""The listening side of a stage link: a worker running layers [begin, end), and, with a next stage, relaying.

Three threads, each owning its own sockets:
- the socket thread owns the ROUTER: it checks every message (`protocol.decode`, the session, epoch and sequence,
  the positions), answers the handshake's checks, queues work, sends `busy` to a client whose request is running
  and forwards finished replies (they come back over an inproc socket);
- the work thread runs the stage's layers (`StageCompute`), one request after the other;
- the relay thread (with `--stage-next`) sends the work thread's output on to the next stage and returns the
  next stage's answer, so that this stage reads prompt piece c+1 while the next one reads piece c.

No torch here: the compute is injected (engine/link/remote.py has the model's).
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import msgpack
import zmq

from engine.link import protocol as P
from engine.link.client import StageClient, StageError
from engine.link.keys import ClientKeys, ServerKeys
from engine.link.transport import HANDSHAKE_MS, Endpoint, Listener, inproc_name

log = logging.getLogger("strata.link")

BUSY_S = 0.5
POLL_MS = 50


class StageCompute(Protocol):
    """The layers a worker runs. `open` starts a session (the KV of `slots` sequences); `forward` maps a hidden
    state [T, D] to the one after its layers, its rows those of `rows` in order ((slot, start, count): a
    sequence's positions start..start+count); both run on the work thread only."""

    def open(self, max_ctx: int, kv: str, slots: int) -> None: ...

    def forward(
        self,
        payload: memoryview | bytes,
        dtype: str,
        shape: tuple[int, ...],
        rows: Sequence[tuple[int, int, int]],
    ) -> tuple[memoryview | bytes, str, tuple[int, ...]]: ...


@dataclass
class _Session:
    identity: bytes
    session: int
    epoch: int
    max_ctx: int
    slots: int = 1
    last_seq: int = 0
    # per slot: positions accepted so far (requests run in order)
    filled: list[int] = field(default_factory=list)
    broken: str = ""  # set after a failure: every request then gets this error until a new handshake


@dataclass
class _Job:
    kind: str  # "hello" | "fwd"
    identity: bytes
    session: int
    epoch: int
    seq: int = 0
    start: int = 0
    # (slot, start, count) of the payload's rows
    rows: list[tuple[int, int, int]] = field(default_factory=list)
    slots: int = 1  # hello: the sequences the session holds
    dtype: str = ""
    shape: tuple[int, ...] = ()
    payload: memoryview | bytes | None = None
    expect: P.StageInfo | None = None
    received: float = field(default_factory=time.perf_counter)
    timing: dict[str, float] = field(default_factory=dict)


@dataclass
class ServerStats:
    dropped: int = 0  # malformed or stale messages
    refused_hellos: int = 0
    requests: int = 0
    errors: int = 0


class StageServer:
    """Serves `info`'s layers on `bind`:`port`; `next_endpoint` makes it a relay."""

    def __init__(
        self,
        info: P.StageInfo,
        compute: StageCompute,
        keys: ServerKeys,
        bind: str = "0.0.0.0",
        port: int = 0,
        next_endpoint: Endpoint | None = None,
        next_keys: ClientKeys | None = None,
        handshake_ms: int = HANDSHAKE_MS,
        stall_s: float = 3.0,
        timing: Callable[[str], None] | None = None,
    ) -> None:
        self.compute = compute
        self.max_payload = info.max_tokens * info.n_embd * max(P.DTYPES.values())
        self.listener = Listener(
            keys,
            bind,
            port,
            self.max_payload + P.MAX_HEADER_BYTES + 1024,
            f"stage {info.layers_text}",
            handshake_ms,
        )
        self.port = self.listener.port
        self.info = P.StageInfo(**{**info.to_wire(), "address": f"{bind}:{self.port}"})
        self.next_endpoint = next_endpoint
        self.next_keys = next_keys
        self.stall_s = stall_s
        self.timing = timing
        self.stats = ServerStats()
        self._epoch = random.randrange(1 << 30)
        self._nonces: OrderedDict[bytes, None] = OrderedDict()
        self._session: _Session | None = None
        self._pending: dict[bytes, tuple[int, float]] = {}  # identity -> (requests running, last busy sent)
        # requests queued for the work thread: several groups of slots may each have a step's messages in flight
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=32)
        self._relay_jobs: queue.Queue[tuple[_Job, memoryview | bytes, str, tuple[int, ...]] | _Job | None] = (
            queue.Queue(maxsize=8)
        )
        self._out_addr = inproc_name("stage-out")
        self._out = self.listener.ctx.socket(zmq.PULL)
        self._out.bind(self._out_addr)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._socket_loop, name="strata-link-socket", daemon=True),
            threading.Thread(target=self._work_loop, name="strata-link-work", daemon=True),
        ]
        if next_endpoint is not None:
            if next_keys is None:
                raise ValueError("a relay needs the keys for the next stage")
            self._threads.append(
                threading.Thread(target=self._relay_loop, name="strata-link-relay", daemon=True)
            )

    # ---- life ----

    def start(self) -> StageServer:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        for q in (self._jobs, self._relay_jobs):
            try:
                q.put_nowait(None)
            except queue.Full:
                pass
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=30)
        self._out.close(linger=0)
        self.listener.close()

    def request_stop(self) -> None:
        """Ask `serve_forever` to return (a signal handler may call it)."""
        self._stop.set()

    def set_allowed(self, keys: frozenset[bytes]) -> None:
        """Replace the client allow-list (a revoked key gets no new connection; a node agent restarts the worker
        to drop one that is connected)."""
        self.listener.allow.allowed = frozenset(keys)

    def serve_forever(self) -> None:
        self.start()
        try:
            while not self._stop.wait(0.5):
                pass
        finally:
            self.stop()

    # ---- the socket thread ----

    def _pusher(self) -> zmq.Socket:
        s = self.listener.ctx.socket(zmq.PUSH)
        s.setsockopt(zmq.LINGER, 1000)
        s.connect(self._out_addr)
        return s

    def _send(self, identity: bytes, frames: Sequence[bytes | memoryview]) -> None:
        try:
            self.listener.sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning(
                "stage %s: a client does not read its replies; one was dropped", self.info.layers_text
            )

    def _connected(self, s: _Session) -> bool:
        """Whether the session's connection is still there: a `busy` sent to it with ROUTER_MANDATORY fails at once
        for a peer that left (a dead one that heartbeats have not found yet counts as there, for about a second)."""
        sock = self.listener.sock
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            sock.send_multipart([s.identity, *P.pack("busy", {"s": s.session, "e": s.epoch, "q": s.last_seq})],
                                flags=zmq.NOBLOCK)  # fmt: skip
        except zmq.Again:
            return True  # there, not reading
        except zmq.ZMQError:
            return False  # EHOSTUNREACH: gone
        finally:
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        return True

    def _error(self, identity: bytes, session: int, epoch: int, code: str, text: str, seq: int = 0) -> None:
        self._send(identity, P.pack("error", {"s": session, "e": epoch, "q": seq, "code": code, "msg": text}))

    def _socket_loop(self) -> None:
        sock = self.listener.sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._out, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(POLL_MS))
                if sock in events:
                    for _ in range(64):  # a burst, then look at the replies
                        try:
                            frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_message(frames)
                if self._out in events:
                    while True:
                        try:
                            parts = self._out.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        self._on_done(parts)
                self._keepalive()
        except Exception:  # the socket thread must not die silently
            log.exception("stage %s: the socket loop failed", self.info.layers_text)
            self._stop.set()

    def _on_done(self, parts: list[zmq.Frame]) -> None:
        ctl = msgpack.unpackb(parts[0].bytes)  # our own inproc message
        identity = ctl["id"]
        if ctl.get("fail") and self._session is not None and self._session.epoch == ctl.get("e"):
            self._session.broken = ctl["fail"]
        n, last = self._pending.get(identity, (0, 0.0))
        if n <= 1:
            self._pending.pop(identity, None)
        else:
            self._pending[identity] = (n - 1, last)
        self._send(identity, [p.buffer for p in parts[1:]])

    def _keepalive(self) -> None:
        now = time.monotonic()
        s = self._session
        for identity, (n, last) in list(self._pending.items()):
            if now - last >= BUSY_S:
                self._pending[identity] = (n, now)
                if s is not None and s.identity == identity:
                    self._send(identity, P.pack("busy", {"s": s.session, "e": s.epoch, "q": s.last_seq}))

    def _on_message(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            self.stats.dropped += 1
            return
        identity = frames[0].bytes
        limits = P.Limits(self.max_payload, self.info.n_embd, self.info.max_tokens)
        try:
            msg = P.decode([f.buffer for f in frames[1:]], limits)
        except P.FrameError as e:
            self.stats.dropped += 1
            s = self._session
            if s is not None and s.identity == identity:  # our own client sent it: say so
                self._error(identity, s.session, s.epoch, "bad_frame", f"stage {self.info.layers_text}: {e}")
            else:
                log.debug("stage %s: dropped a malformed message: %s", self.info.layers_text, e)
            return
        try:
            if msg.kind == "hello":
                self._on_hello(identity, msg)
            elif msg.kind == "fwd":
                self._on_fwd(identity, msg)
            else:
                self.stats.dropped += 1
        except P.FrameError as e:
            self.stats.dropped += 1
            log.debug("stage %s: dropped a message: %s", self.info.layers_text, e)

    def _on_hello(self, identity: bytes, msg: P.Message) -> None:
        session = P._int(msg.get("s"), "session")
        nonce = msg.get("nonce")
        if nonce in self._nonces:
            self.stats.refused_hellos += 1
            self._error(
                identity, session, 0, "refused", f"stage {self.info.layers_text}: a replayed handshake"
            )
            return
        self._nonces[nonce] = None
        while len(self._nonces) > 4096:
            self._nonces.popitem(last=False)
        try:
            expect = P.StageInfo.from_wire(msg.get("info"), "hello info")
        except P.FrameError as e:
            self.stats.refused_hellos += 1
            self._error(identity, session, 0, "bad_frame", f"stage {self.info.layers_text}: {e}")
            return
        problem = self._mismatch(expect)
        if problem:
            self.stats.refused_hellos += 1
            log.warning("stage %s: refused a handshake: %s", self.info.layers_text, problem)
            self._error(identity, session, 0, "mismatch", problem)
            return
        held = self._session
        if held is not None and held.identity != identity and self._connected(held):
            # One main per worker: a second one would take the session (and its KV) from the first at every turn.
            self.stats.refused_hellos += 1
            log.warning(
                "stage %s: refused a second main process while the first is connected", self.info.layers_text
            )
            self._error(
                identity, session, 0, "busy",
                f"stage {self.info.layers_text} already serves another main process, which is still connected: stop "
                "that one, or start another worker for this main",
            )  # fmt: skip
            return
        self._epoch += 1
        slots = min(expect.slots, self.info.slots)
        self._session = _Session(identity, session, self._epoch, expect.max_ctx, slots, filled=[0] * slots)
        self._queue(_Job("hello", identity, session, self._epoch, expect=expect, slots=slots))

    def _mismatch(self, expect: P.StageInfo) -> str:
        """Both sides' values of the first thing that differs, or ''."""
        mine = self.info
        where = f"the worker at {mine.address} (layers {mine.layers_text})"
        for name in ("arch", "n_layer", "n_embd", "n_head_kv", "head_dim", "n_vocab", "n_expert"):
            a, b = getattr(expect, name), getattr(mine, name)
            if a != b:
                return f"model mismatch: the main process has {name}={a}, {where} has {name}={b}: run the same model file"
        if expect.header != mine.header:
            return (
                f"model mismatch: the main process's file has header fingerprint {expect.header[:16]}, {where} has "
                f"{mine.header[:16]}: copy the same .gguf to both PCs"
            )
        if expect.begin != mine.begin:
            return (
                f"layer mismatch: the main process runs layers 0-{expect.begin - 1} and hands layer {expect.begin} on "
                f"(--layer-split {expect.begin}), {where} starts at layer {mine.begin} (--stage-begin {mine.begin}): "
                "make them equal"
            )
        if self.next_endpoint is None and expect.end != mine.end:
            return (
                f"layer mismatch: the main process needs layers up to {expect.end - 1} from this chain, {where} ends "
                f"at {mine.end - 1} and relays to no one: add --stage-end {mine.end} --stage-next HOST:PORT or drop "
                "--stage-end"
            )
        if expect.max_ctx > mine.max_ctx:
            return (
                f"context mismatch: the main process asks for {expect.max_ctx} positions, {where} allows {mine.max_ctx}: "
                f"start the worker with --max-context {expect.max_ctx} or the main with less"
            )
        if expect.max_tokens > mine.max_tokens:
            return (
                f"chunk mismatch: the main process sends up to {expect.max_tokens} tokens at once, {where} takes "
                f"{mine.max_tokens}: lower the main's --prefill or raise the worker's --prefill"
            )
        if expect.kv not in ("f32", "f16", "bf16", "int8", "q4_0"):
            return f"KV type {expect.kv!r} of the main process is not one {where} knows"
        return ""

    def _on_fwd(self, identity: bytes, msg: P.Message) -> None:
        s = self._session
        sess, epoch, seq = msg.get("s"), msg.get("e"), msg.get("q")
        if s is None or s.identity != identity or s.session != sess or s.epoch != epoch or seq <= s.last_seq:
            self.stats.dropped += 1  # another connection's, an old epoch's, or a replayed request: dropped
            return
        s.last_seq = seq
        if s.broken:
            self._error(identity, s.session, s.epoch, "stale", s.broken, seq)
            return
        rows = P.rows_of(msg)
        for slot, start, t in rows:
            where = f"stage {self.info.layers_text}" + (f", slot {slot}," if s.slots > 1 else "")
            if slot >= s.slots:
                self._error(
                    identity, s.session, s.epoch, "refused",
                    f"stage {self.info.layers_text} holds {s.slots} slot(s) for this session, not slot {slot}", seq,
                )  # fmt: skip
                return
            if start > s.filled[slot]:
                self._error(
                    identity, s.session, s.epoch, "gap",
                    f"{where} holds {_positions(s.filled[slot])} and was asked to go on at {start}: read the "
                    "sequence again from its start", seq,
                )  # fmt: skip
                return
            if start + t > s.max_ctx:
                self._error(
                    identity, s.session, s.epoch, "refused",
                    f"{where} positions up to {start + t} are past the {s.max_ctx} agreed", seq,
                )  # fmt: skip
                return
        for slot, start, t in rows:
            s.filled[slot] = start + t
        self.stats.requests += 1
        job = _Job("fwd", identity, s.session, s.epoch, seq, rows[0][1], rows, dtype=msg.dtype or "",
                   shape=msg.shape, payload=msg.payload)  # fmt: skip
        self._queue(job)

    def _queue(self, job: _Job) -> None:
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            self._error(
                job.identity,
                job.session,
                job.epoch,
                "busy",
                f"stage {self.info.layers_text} is busy",
                job.seq,
            )
            return
        n, _ = self._pending.get(job.identity, (0, 0.0))
        self._pending[job.identity] = (n + 1, time.monotonic())

    # ---- the work thread ----

    def _work_loop(self) -> None:
        push = self._pusher()
        try:
            while True:
                job = self._jobs.get()
                if job is None or self._stop.is_set():
                    return
                self._work(job, push)
        finally:
            push.close()

    def _emit(
        self, push: zmq.Socket, job: _Job, frames: Sequence[bytes | memoryview], fail: str = ""
    ) -> None:
        ctl = msgpack.packb({"id": job.identity, "e": job.epoch, "fail": fail})
        push.send_multipart([ctl, *frames], copy=False)

    def _work(self, job: _Job, push: zmq.Socket) -> None:
        if job.kind == "hello":
            assert job.expect is not None
            try:
                self.compute.open(job.expect.max_ctx, job.expect.kv, job.slots)
            except Exception as e:
                log.exception("stage %s: opening a session failed", self.info.layers_text)
                self._emit(
                    push, job, P.pack("error", {"s": job.session, "e": 0, "code": "internal", "msg": str(e)})
                )
                return
            if self.next_endpoint is not None:
                self._relay_jobs.put(job)
            else:
                info = [self._held(job.slots).to_wire()]
                self._emit(push, job, P.pack("welcome", {"s": job.session, "e": job.epoch, "info": info}))
            return
        t0 = time.perf_counter()
        try:
            out, dtype, shape = self.compute.forward(job.payload or b"", job.dtype, job.shape, job.rows)
        except Exception as e:
            self.stats.errors += 1
            log.exception("stage %s: request %d failed", self.info.layers_text, job.seq)
            text = f"stage {self.info.layers_text} at {self.info.address} failed: {e}"
            fields = {"s": job.session, "e": job.epoch, "q": job.seq, "code": "internal", "msg": text}
            self._emit(push, job, P.pack("error", fields), fail=text)
            return
        t1 = time.perf_counter()
        job.payload = None
        job.timing = {"w": (t0 - job.received) * 1e3, "c": (t1 - t0) * 1e3}
        if self.next_endpoint is not None:
            self._relay_jobs.put((job, out, dtype, shape))
            return
        self._reply(push, job, out, dtype, shape, [])

    def _held(self, slots: int) -> P.StageInfo:
        """This stage's info as a session sees it: the slots it opened for that session."""
        return P.StageInfo(**{**self.info.to_wire(), "slots": slots})

    def _reply(
        self,
        push: zmq.Socket,
        job: _Job,
        out: memoryview | bytes,
        dtype: str,
        shape: tuple[int, ...],
        after: list[dict[str, object]],
    ) -> None:
        total = (time.perf_counter() - job.received) * 1e3
        mine = {"st": self.info.layers_text, "at": self.info.address, **job.timing, "x": total}
        if self.timing is not None:
            self.timing(
                f"stage {self.info.layers_text}: {shape[0]} token(s) at {job.start}: compute {mine['c']:.1f} ms, "
                f"queued {mine['w']:.1f} ms, next stages {mine.get('r', 0.0):.1f} ms, total {total:.1f} ms"
            )
        fields = {
            "s": job.session,
            "e": job.epoch,
            "q": job.seq,
            "t": [mine, *after],
            **P.tensor_fields(dtype, shape),
        }
        self._emit(push, job, P.pack("out", fields, out))

    # ---- the relay thread ----

    def _relay_loop(self) -> None:
        push = self._pusher()
        assert self.next_endpoint is not None and self.next_keys is not None
        nxt = StageClient(
            self.next_endpoint,
            self.next_keys,
            self.max_payload,
            label=f"the next stage at {self.next_endpoint}",
            stall_s=self.stall_s,
        )
        waiting: deque[tuple[int, _Job, float]] = deque()  # next's seq, our job, sent at
        try:
            while not self._stop.is_set():
                try:
                    item = self._relay_jobs.get(timeout=0.01 if waiting else 0.1)
                except queue.Empty:
                    item = False  # type: ignore[assignment]
                if item is None:
                    return
                try:
                    if item is not False:
                        self._relay_item(item, nxt, waiting, push)
                    if waiting:
                        r = nxt.poll(0.02)
                        if r is not None:
                            seq, job, sent = waiting.popleft()
                            if r.seq != seq:
                                raise StageError(
                                    f"the next stage at {self.next_endpoint} answered out of order"
                                )
                            job.timing["r"] = (time.perf_counter() - sent) * 1e3
                            after = _timing_list(r.message.get("t"))
                            shape = r.message.shape
                            self._reply(
                                push, job, r.message.payload or b"", r.message.dtype or "f32", shape, after
                            )
                except StageError as e:
                    text = f"stage {self.info.layers_text} at {self.info.address} could not relay: {e}"
                    for _, job, _ in waiting:
                        fields = {
                            "s": job.session,
                            "e": job.epoch,
                            "q": job.seq,
                            "code": "unreachable",
                            "msg": text,
                        }
                        self._emit(push, job, P.pack("error", fields), fail=text)
                    waiting.clear()
        finally:
            nxt.close()
            push.close()

    def _relay_item(self, item: object, nxt: StageClient, waiting: deque, push: zmq.Socket) -> None:
        if isinstance(item, _Job):  # a handshake: the next stage's handshake first
            job = item
            assert job.expect is not None
            expect = P.StageInfo(**{**job.expect.to_wire(), "begin": self.info.end, "slots": job.slots})
            try:
                chain = nxt.connect(expect)
            except StageError as e:
                text = (
                    f"stage {self.info.layers_text} at {self.info.address} cannot reach the next stage: {e}"
                )
                fields = {
                    "s": job.session,
                    "e": 0,
                    "code": e.code if e.code in P.ERROR_CODES else "unreachable",
                }
                self._emit(push, job, P.pack("error", {**fields, "msg": text}))
                return
            waiting.clear()
            info = [self._held(job.slots).to_wire(), *(c.to_wire() for c in chain)]
            self._emit(push, job, P.pack("welcome", {"s": job.session, "e": job.epoch, "info": info}))
            return
        job, out, dtype, shape = item  # type: ignore[misc]
        try:
            if not nxt.ok:
                raise StageError(f"the next stage at {self.next_endpoint} is not connected: {nxt.last_error}")
            seq = nxt.submit(out, dtype, shape, job.start, job.rows)
        except StageError:
            waiting.append((0, job, time.perf_counter()))  # so that the caller's handler answers it too
            raise
        waiting.append((seq, job, time.perf_counter()))


def _positions(n: int) -> str:
    return f"positions 0-{n - 1}" if n else "no positions"


def _timing_list(raw: object) -> list[dict[str, object]]:
    if not isinstance(raw, list):
        return []
    return [r for r in raw[:16] if isinstance(r, dict)]
