"""Keys of the link: the token's key pairs (same on every PC, token never sent), the node agent's key files and
allow-list (files or environment), and each refused with a message that says what to do."""

import os
from pathlib import Path

import pytest
import zmq

from engine.link import protocol as P
from engine.link.client import StageClient, StageError
from engine.link.keys import (
    LinkKeyError,
    client_keys,
    fingerprint,
    load_keypair,
    server_keys,
    token_keys,
    write_keypair,
)
from engine.link.server import StageServer
from engine.link.transport import Endpoint
from tests.engine.link.echo_worker import Echo
from tests.engine.link.harness import ECHO_INFO, TOKEN


def test_token_keys_are_deterministic_and_distinct() -> None:
    a, b = token_keys(TOKEN), token_keys(TOKEN)
    assert a == b and a.server.public != a.client.public
    assert zmq.curve_public(a.server.secret) == a.server.public  # a real Curve25519 pair
    assert token_keys(TOKEN + "x").server.public != a.server.public
    assert TOKEN.encode() not in a.server.public + a.server.secret + a.client.public + a.client.secret
    assert len(fingerprint(a.server.public)) == 19
    with pytest.raises(LinkKeyError, match="at least 12 random"):
        token_keys("short")


def test_no_key_at_all_says_how_to_get_one() -> None:
    with pytest.raises(LinkKeyError, match=r"STRATA_STAGE_TOKEN.*--stage-key FILE and --stage-allow"):
        server_keys(None, [], {})
    with pytest.raises(LinkKeyError, match="--remote-stage-key"):
        client_keys(None, None, {})


def _roundtrip(port: int, keys: object) -> None:
    c = StageClient(Endpoint("127.0.0.1", port), keys, 64 * 16 * 4, hello_s=5)  # type: ignore[arg-type]
    try:
        c.connect(ECHO_INFO)
        r = c.wait(c.submit(b"\1" * 64, "f32", (1, 16), 0))
        assert bytes(r.message.payload) == b"\1" * 64
    finally:
        c.close()


@pytest.mark.parametrize("via", ["files", "environment"])
def test_agent_keys_admit_exactly_the_allowed_main(tmp_path: Path, via: str) -> None:
    w_pub, w_sec = write_keypair(tmp_path, "worker")
    m_pub, m_sec = write_keypair(tmp_path, "main")
    assert oct(os.stat(w_sec).st_mode & 0o777) == "0o600"
    main_pair = load_keypair(m_sec)
    if via == "files":
        sk = server_keys(str(w_sec), [str(m_pub)], {})
    else:
        env = {
            "STRATA_STAGE_SECRET_KEY": load_keypair(w_sec).secret.decode(),
            "STRATA_STAGE_ALLOW": main_pair.public.decode(),
        }
        sk = server_keys(None, [], env)
    assert sk.allow == frozenset([main_pair.public]) and sk.source == "key files"
    srv = StageServer(ECHO_INFO, Echo(), sk, "127.0.0.1", 0).start()
    try:
        _roundtrip(srv.port, client_keys(str(m_sec), load_keypair(w_sec).public.decode(), {}))
        with pytest.raises(
            StageError, match="refused this side's key"
        ):  # the token's main is not on this list
            _roundtrip(
                srv.port,
                client_keys(None, load_keypair(w_sec).public.decode(), {"STRATA_STAGE_TOKEN": TOKEN}),
            )
    finally:
        srv.stop()
    with pytest.raises(LinkKeyError, match="admits no client"):
        server_keys(str(w_sec), [], {})
    with pytest.raises(LinkKeyError, match="only a public key"):
        load_keypair(w_pub)
    with pytest.raises(LinkKeyError, match="neither a 40-character"):
        server_keys(str(w_sec), ["not-a-key"], {})


def test_stage_info_round_trips_and_rejects_strangers() -> None:
    assert P.StageInfo.from_wire(ECHO_INFO.to_wire()) == ECHO_INFO
    for bad, msg in (
        ({**ECHO_INFO.to_wire(), "evil": 1}, "unknown field"),
        ({**ECHO_INFO.to_wire(), "begin": 9}, "not a range"),
    ):
        with pytest.raises(P.FrameError, match=msg):
            P.StageInfo.from_wire(bad)


def test_one_fingerprint_format_for_link_and_pairing() -> None:
    """The worker's start line, the link's refusals and the pairing screens show a key the same way."""
    import re

    import zmq

    from engine.node.keys import KeyPair as NodeKeyPair
    from engine.node.keys import fingerprint as node_fingerprint

    pair = NodeKeyPair.generate()
    fp = fingerprint(pair.public.encode("ascii"))
    assert re.fullmatch(r"[A-Z2-7]{4}(-[A-Z2-7]{4}){3}", fp)
    assert fp == node_fingerprint(pair.public) == pair.fingerprint == fingerprint(pair.public)
    pub, _ = zmq.curve_keypair()
    assert fingerprint(pub) == node_fingerprint(pub.decode("ascii"))
