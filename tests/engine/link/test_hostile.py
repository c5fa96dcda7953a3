"""Hostile peers against a listening stage (the real `StageServer`, an echo compute): each is refused or dropped
within 10 s, and the legitimate client's requests go on working throughout."""

import os
import socket
import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from engine.link import protocol as P
from engine.link.client import StageClient, StageError
from engine.link.keys import ClientKeys, KeyPair, client_keys, server_keys, token_keys
from engine.link.server import StageServer
from engine.link.transport import HANDSHAKE_MS, Endpoint
from tests.engine.link.echo_worker import Echo
from tests.engine.link.harness import ECHO_INFO, TOKEN

ENV = {"STRATA_STAGE_TOKEN": TOKEN}
EXPECT = P.StageInfo(**{**ECHO_INFO.to_wire(), "max_tokens": 32})
HALF_OPEN_MS = 1000  # the tests shorten the 10 s handshake limit; test_defaults checks the real one


@pytest.fixture
def server() -> Iterator[StageServer]:
    s = StageServer(ECHO_INFO, Echo(), server_keys(None, [], ENV), "127.0.0.1", 0, handshake_ms=HALF_OPEN_MS)
    s.start()
    yield s
    s.stop()


def _client(srv: StageServer, keys: ClientKeys | None = None, stall_s: float = 3.0) -> StageClient:
    return StageClient(
        Endpoint("127.0.0.1", srv.port), keys or client_keys(None, None, ENV), 64 * 16 * 4, stall_s=stall_s,
        hello_s=8.0,
    )  # fmt: skip


def _roundtrip(c: StageClient, start: int = 0) -> None:
    payload = os.urandom(2 * 16 * 4)
    seq = c.submit(payload, "f32", (2, 16), start)
    r = c.wait(seq)
    assert bytes(r.message.payload) == payload and r.message.shape == (2, 16)


@pytest.fixture
def legit(server: StageServer) -> Iterator[StageClient]:
    c = _client(server)
    c.connect(EXPECT)
    _roundtrip(c)
    yield c
    c.close()


def _raw_curve(
    srv: StageServer, keys: KeyPair, server_key: bytes | None = None
) -> tuple[zmq.Context, zmq.Socket]:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.curve_serverkey = server_key or token_keys(TOKEN).server.public
    s.curve_publickey, s.curve_secretkey = keys.public, keys.secret
    s.linger = 0
    s.connect(f"tcp://127.0.0.1:{srv.port}")
    return ctx, s


def _random_pair() -> KeyPair:
    pub, sec = zmq.curve_keypair()
    return KeyPair(pub, sec)


def test_defaults() -> None:
    assert HANDSHAKE_MS == 10_000


def test_no_key_gets_no_connection(server: StageServer, legit: StageClient) -> None:
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)  # no CURVE at all
    s.linger = 0
    s.connect(f"tcp://127.0.0.1:{server.port}")
    s.send_multipart(P.pack("hello", {"s": 1, "nonce": os.urandom(16), "info": EXPECT.to_wire()}))
    assert s.poll(1500) == 0
    s.close()
    ctx.term()
    assert server._session is not None and server._session.identity != b""
    _roundtrip(legit, 2)


@pytest.mark.parametrize("how", ["wrong", "revoked"])
def test_a_key_not_on_the_allow_list_is_refused(server: StageServer, legit: StageClient, how: str) -> None:
    keys = client_keys(None, None, ENV)
    if how == "wrong":
        keys = ClientKeys(_random_pair(), keys.server, "test")
    else:
        server.set_allowed(frozenset())  # the token's client key revoked: no new connection gets in
    t0 = time.monotonic()
    with pytest.raises(StageError, match="refused this side's key"):
        _client(server, keys).connect(EXPECT)
    assert time.monotonic() - t0 < 10
    _roundtrip(legit, 2)  # the connection made before is not affected


def test_an_impostor_worker_is_not_trusted() -> None:
    """A server with another key where the worker should be: the main's handshake fails, it sends nothing."""
    fake = server_keys(None, [], {"STRATA_STAGE_TOKEN": "another-token-0123456789"})
    # it even admits the main's key: the server's key alone gives it away
    fake = type(fake)(fake.pair, frozenset([token_keys(TOKEN).client.public]), "test")
    srv = StageServer(ECHO_INFO, Echo(), fake, "127.0.0.1", 0).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(StageError, match=r"encrypted handshake .* failed|did not answer the handshake"):
            _client(srv).connect(EXPECT)
        assert time.monotonic() - t0 < 10
        assert srv.stats.requests == 0 and srv._session is None
    finally:
        srv.stop()


class _Recorder:
    """A TCP proxy that records what the client sends (to replay it later)."""

    def __init__(self, target_port: int) -> None:
        self.lsock = socket.create_server(("127.0.0.1", 0))
        self.port = self.lsock.getsockname()[1]
        self.sent = bytearray()
        self.target = target_port
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        c, _ = self.lsock.accept()
        u = socket.create_connection(("127.0.0.1", self.target))

        def pump(a: socket.socket, b: socket.socket, rec: bool) -> None:
            try:
                while data := a.recv(65536):
                    if rec:
                        self.sent += data
                    b.sendall(data)
            except OSError:
                pass
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

        threading.Thread(target=pump, args=(c, u, True), daemon=True).start()
        pump(u, c, False)


def test_a_replayed_handshake_is_refused(server: StageServer) -> None:
    rec = _Recorder(server.port)
    c = StageClient(Endpoint("127.0.0.1", rec.port), client_keys(None, None, ENV), 64 * 16 * 4)
    c.connect(EXPECT)
    _roundtrip(c)
    c.close()
    time.sleep(0.2)
    epoch, requests = server._epoch, server.stats.requests
    # the captured bytes, sent again on a new connection: CURVE's fresh session keys make them worthless
    raw = socket.create_connection(("127.0.0.1", server.port))
    raw.settimeout(5)
    raw.sendall(bytes(rec.sent))
    t0 = time.monotonic()
    got = b""
    try:
        while chunk := raw.recv(65536):
            got += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    raw.close()
    assert time.monotonic() - t0 < 10
    assert server._epoch == epoch and server.stats.requests == requests  # no session, no request
    # and an application-level replay of a hello (same nonce) from a client holding the key is refused too
    ctx, s = _raw_curve(server, token_keys(TOKEN).client)
    hello = P.pack("hello", {"s": 7, "nonce": b"n" * 16, "info": EXPECT.to_wire()})
    s.send_multipart(hello)
    assert P.decode(s.recv_multipart(), P.Limits(1 << 20)).kind == "welcome"
    s.send_multipart(hello)
    err = P.decode(s.recv_multipart(), P.Limits(1 << 20))
    assert err.kind == "error" and "replayed" in err.get("msg")
    s.close()
    ctx.term()


@pytest.mark.parametrize(
    ("field", "value", "msg"),
    [
        ("n_embd", 32, "n_embd=32, the worker at .* has n_embd=16"),
        ("arch", "llama", "arch=llama"),
        ("begin", 3, "--layer-split 3.*--stage-begin 4"),
        ("header", "x" * 64, "header fingerprint xxxx"),
        ("max_ctx", 1 << 20, "asks for 1048576 positions.*allows 4096"),
    ],
)
def test_another_model_geometry_or_k_is_refused_naming_both_sides(
    server: StageServer, field: str, value: object, msg: str
) -> None:
    bad = P.StageInfo(**{**EXPECT.to_wire(), field: value})
    with pytest.raises(StageError, match=msg):
        _client(server).connect(bad)
    assert server.stats.refused_hellos >= 1


def test_garbage_and_mismatched_frames(server: StageServer, legit: StageClient) -> None:
    ctx, s = _raw_curve(server, token_keys(TOKEN).client)
    rng = os.urandom
    odd_hellos = [
        [msgpack.packb({"v": P.VERSION, "k": "hello", "nonce": b"0" * 16, "info": {}})],  # no session
        [
            msgpack.packb(
                {"v": P.VERSION, "k": "hello", "s": 3, "nonce": b"1" * 16, "info": {"arch": ["x"] * 60}}
            )
        ],
        [msgpack.packb({"v": P.VERSION, "k": "hello", "s": 4, "nonce": b"2" * 16, "info": 5})],
        [
            msgpack.packb({"v": P.VERSION, "k": "welcome", "s": 4, "e": 1, "info": []})
        ],  # a server's message, to a server
    ]
    for frames in ([rng(50)], [b"\x80"], [rng(3), rng(4), rng(5)], [b"\xc1"], [rng(20000)], *odd_hellos):
        s.send_multipart(frames)
    # a forward of the legitimate session whose header and payload disagree: an error, no allocation
    sess = legit.session
    fields = {"s": sess, "e": legit.epoch, "q": 10**6, "p": 0, "dt": "f32", "sh": [2, 16], "n": 128}
    legit.sock.send_multipart([*P.pack("fwd", fields), b"\0" * 100])  # type: ignore[union-attr]
    with pytest.raises(StageError, match="payload has 100 bytes, the header says 128"):
        legit.in_flight[10**6] = time.perf_counter()
        legit.wait(10**6)
    end = time.monotonic() + 10
    while (
        server.stats.dropped + server.stats.refused_hellos < 9 and time.monotonic() < end
    ):  # the raw socket connects on its own time
        time.sleep(0.05)
    assert server.stats.dropped + server.stats.refused_hellos >= 9
    s.close()
    ctx.term()
    c = _client(server)  # the session that sent the bad frame is closed by its client; a new one works
    c.connect(EXPECT)
    _roundtrip(c)
    c.close()


def test_an_oversize_frame_drops_only_its_sender(server: StageServer, legit: StageClient) -> None:
    ctx, s = _raw_curve(server, token_keys(TOKEN).client)
    mon = s.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    s.send_multipart([b"x" * (1 << 20)])  # far over MAXMSGSIZE
    t0 = time.monotonic()
    assert mon.poll(10_000), "the sender was not disconnected"
    assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
    assert time.monotonic() - t0 < 10
    s.disable_monitor()
    mon.close()
    s.close()
    ctx.term()
    _roundtrip(legit, 2)


def test_a_flood_does_not_starve_the_main(server: StageServer, legit: StageClient) -> None:
    ctx, s = _raw_curve(server, token_keys(TOKEN).client)
    s.sndhwm = 100000
    stop = threading.Event()

    def flood() -> None:
        junk = [
            *P.pack("fwd", {"s": 1, "e": 1, "q": 1, "p": 0, "dt": "f32", "sh": [1, 16], "n": 64}),
            b"\x00" * 64,
        ]
        while not stop.is_set():
            try:
                s.send_multipart(junk, flags=zmq.NOBLOCK)
            except zmq.Again:
                time.sleep(0.001)

    th = threading.Thread(target=flood, daemon=True)
    th.start()
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        for i in range(10):
            _roundtrip(legit, 2 + 2 * i)
        assert time.monotonic() - t0 < 10
    finally:
        stop.set()
        th.join()
        s.close()
        ctx.term()
    assert server.stats.dropped > 100


def test_half_open_connections_and_a_slow_drip_are_closed(server: StageServer, legit: StageClient) -> None:
    socks = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(100)]
    drip = socket.create_connection(("127.0.0.1", server.port))
    greeting = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00CURVE" + b"\0" * 15

    def dripping() -> None:
        try:
            for b in greeting * 10:
                drip.send(bytes([b]))
                time.sleep(0.1)
        except OSError:
            pass

    threading.Thread(target=dripping, daemon=True).start()
    _roundtrip(legit, 2)  # the main is served while they hang there
    t0 = time.monotonic()
    for s in [*socks, drip]:
        s.settimeout(10)
        try:
            while s.recv(4096):
                pass
        except (ConnectionResetError, TimeoutError):
            pass
        s.close()
    assert time.monotonic() - t0 < 10  # closed after the handshake limit (shortened here)
    _roundtrip(legit, 4)


def _queue_fails_within(stage: object, match: str, seconds: float) -> None:
    """Five requests, one after another (as a queue drains), each failing with `match`, all within `seconds`."""
    t0 = time.monotonic()
    for _ in range(5):
        with pytest.raises(StageError, match=match):
            stage.ensure()  # type: ignore[attr-defined]
    assert time.monotonic() - t0 < seconds


def _port_with_nothing() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_requests_queued_behind_a_dead_worker_fail_fast() -> None:
    """The reported case: five queued requests behind a worker whose port refused failed at 10, 20, 30, 40 and
    50 s (a full hello each). Now a refused port fails at once, and one failed handshake answers for the requests
    behind it."""
    from engine.link.remote import RemoteStage

    client = StageClient(
        Endpoint("127.0.0.1", _port_with_nothing()), client_keys(None, None, ENV), 64 * 16 * 4
    )
    _queue_fails_within(RemoteStage(client, EXPECT, verify=lambda chain: None), "nothing listens there", 2.0)


def test_a_silent_worker_costs_one_hello_for_the_whole_queue() -> None:
    """A port that accepts and never answers (a frozen worker): the first request waits its hello, the queued ones
    get its reason at once."""
    from engine.link.remote import RemoteStage

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)  # connections complete in the backlog; nothing ever answers
        port = silent.getsockname()[1]
        client = StageClient(
            Endpoint("127.0.0.1", port), client_keys(None, None, ENV), 64 * 16 * 4, hello_s=1.0
        )
        _queue_fails_within(RemoteStage(client, EXPECT, verify=lambda chain: None), "handshake", 2.0)
