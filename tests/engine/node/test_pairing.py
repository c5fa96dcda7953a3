"""Pairing and the CURVE control channel with real agents on loopback."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import zmq
import zmq.utils.z85

from engine.node import wire
from engine.node.agent import Agent
from engine.node.client import NodeClient, NodeError, NodeRegistry, identify, pair
from engine.node.keys import KeyFileError, KeyPair, fingerprint, load_or_create_keypair
from tests.engine.node.conftest import Paired, free_port, pair_with

# The commands that need a paired main, with arguments that would be valid after pairing.
PAIRED_ONLY: dict[str, dict] = {
    "unpair": {},
    "info": {},
    "gpu_samples": {},
    "files": {},
    "upload_begin": {"name": "m.gguf", "size": 10, "sha256": "0" * 64},
    "upload_chunk": {"name": "m.gguf", "offset": 0, "data": b"x"},
    "upload_end": {"name": "m.gguf"},
    "delete_file": {"name": "m.gguf"},
    "new_key": {},
    "start_worker": {"model": "m.gguf", "begin": 1},
    "stop_worker": {"id": "w1"},
    "workers": {},
    "logs": {"id": "w1"},
    "lock_clocks": {"gpu": 0},
    "reset_clocks": {"gpu": 0},
}


def test_the_table_covers_every_command() -> None:
    needs = {c for c, (_, paired_only) in wire.COMMANDS.items() if paired_only}
    assert needs == set(PAIRED_ONLY)
    assert {c for c, (_, p) in wire.COMMANDS.items() if not p} == {"hello", "pair"}


def test_fingerprint_is_sha256_of_the_raw_key() -> None:
    kp = KeyPair.generate()
    raw = zmq.utils.z85.decode(kp.public.encode())
    expected = base64.b32encode(hashlib.sha256(raw).digest()[:10]).decode()
    assert fingerprint(kp.public).replace("-", "") == expected
    assert len(fingerprint(kp.public)) == 19


def test_key_file_is_private_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "k" / "key.json"
    a = load_or_create_keypair(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_keypair(path) == a
    assert zmq.curve_public(a.secret.encode()).decode() == a.public
    data = json.loads(path.read_text())
    data["public"] = KeyPair.generate().public
    path.write_text(json.dumps(data))
    with pytest.raises(KeyFileError, match="does not belong to the secret key"):
        load_or_create_keypair(path)


def test_before_pairing_only_identity_is_answered(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent("alpha")
    ident = identify("127.0.0.1", agent.port, id_port=agent.id_port)
    assert ident.name == "alpha" and ident.public_key == agent.keys.public
    assert ident.fingerprint == agent.keys.fingerprint
    stranger = KeyPair.generate()
    with NodeClient("127.0.0.1", agent.port, agent.keys.public, stranger, timeout=5) as c:
        hello = c.hello()
        assert set(hello) == {"name", "fingerprint", "version", "protocol", "paired_to_you"}
        assert hello["paired_to_you"] is False
        for cmd, args in PAIRED_ONLY.items():
            with pytest.raises(NodeError) as err:
                c.call(cmd, args)
            assert err.value.code == "not_paired", cmd
    assert agent.paired is None and not (agent.dir / "paired.json").exists()


def test_wrong_codes_slow_down_and_never_change_the_code(
    make_agent: Callable[..., Agent], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reported case: five wrong codes (0.3 ms each) made the agent replace its code, so the user's correct code
    was refused. Now 20 wrong codes leave the shown code valid; after the first few each waits longer (refused
    unchecked meanwhile), and the right code pairs once the wait is over."""
    from engine.node import agent as agent_mod

    monkeypatch.setattr(agent_mod, "PAIR_BACKOFF_S", 0.02)
    monkeypatch.setattr(agent_mod, "PAIR_BACKOFF_MAX_S", 2.0)  # room for a busy machine's slow round trips
    agent = make_agent()
    ident = identify("127.0.0.1", agent.port, id_port=agent.id_port)
    keys, reg = KeyPair.generate(), NodeRegistry()
    first = agent.code
    codes = []
    for _ in range(20):
        with pytest.raises(NodeError) as err:
            pair("127.0.0.1", agent.port, "ZZZZ-ZZZZ", ident.fingerprint, keys, reg, id_port=agent.id_port)
        codes.append(err.value.code)
    assert agent.code == first and agent.paired is None  # the shown code stays valid
    assert codes[:3] == ["wrong_code"] * 3 and "slow_down" in codes  # then refused unchecked while waiting
    # a wrong code checked just now starts the longest wait, and the right code inside it is refused unchecked too
    # (the loop above may have ended after its last wait on a slow machine)
    while True:
        with pytest.raises(NodeError) as err:
            pair("127.0.0.1", agent.port, "ZZZZ-ZZZZ", ident.fingerprint, keys, reg, id_port=agent.id_port)
        if err.value.code == "wrong_code":
            break
        time.sleep(0.05)
    with pytest.raises(NodeError, match="try again in"):
        pair("127.0.0.1", agent.port, first, ident.fingerprint, keys, reg, id_port=agent.id_port)
    time.sleep(2.1)
    code = first.lower().replace("-", " ")  # case and separators do not matter
    rec = pair(
        "127.0.0.1", agent.port, code, ident.fingerprint.lower(), keys, reg, "main-pc", id_port=agent.id_port
    )
    assert rec.public_key == agent.keys.public and reg.load() == [rec]
    saved = json.loads((agent.dir / "paired.json").read_text())
    assert saved["main_key"] == keys.public and saved["main_name"] == "main-pc"
    assert stat.S_IMODE(os.stat(agent.dir / "paired.json").st_mode) == 0o600
    assert agent.code is None


def test_fingerprint_mismatch_sends_nothing(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    code = agent.code
    other = KeyPair.generate().fingerprint
    with pytest.raises(NodeError, match="not the PC you meant") as err:
        pair("127.0.0.1", agent.port, code, other, KeyPair.generate(), NodeRegistry(), id_port=agent.id_port)
    assert err.value.code == "fingerprint_mismatch"
    assert agent.wrong_codes == 0 and agent.code == code and NodeRegistry().load() == []


def test_after_pairing_only_the_paired_key(paired: Paired) -> None:
    agent = paired.agent
    info = paired.client.info()
    assert info["pc"]["hostname"] and info["fingerprint"] == agent.keys.fingerprint
    assert paired.client.hello()["paired_to_you"] is True
    # A new connection with any other key is refused by the ZAP handler: no handshake at all.
    with NodeClient("127.0.0.1", agent.port, agent.keys.public, KeyPair.generate(), timeout=10) as c:
        t0 = time.monotonic()
        with pytest.raises(NodeError) as err:
            c.hello()
    assert err.value.code == "key_refused" and "refused this main PC's key" in str(err.value)
    assert time.monotonic() - t0 < 2.0  # known at the handshake: not after the 10 s timeout
    # Pairing again by another main cannot even connect; by the paired main it is a no-op.
    assert paired.client.call("pair", {"code": "whatever"})["paired"] is True


def test_connection_made_before_pairing_gets_nothing_after(make_agent: Callable[..., Agent]) -> None:
    agent = make_agent()
    early = NodeClient("127.0.0.1", agent.port, agent.keys.public, KeyPair.generate(), timeout=5)
    assert early.hello()["paired_to_you"] is False  # connected (ZAP let it in while unpaired)
    p = pair_with(agent)
    try:
        with pytest.raises(NodeError) as err:
            early.info()
        assert err.value.code == "not_paired" and "another main PC" in str(err.value)
        with pytest.raises(NodeError) as err:
            early.call("pair", {"code": "AAAA-AAAA"})
        assert err.value.code == "already_paired"
        assert p.client.workers() == []
    finally:
        early.close()
        p.client.close()


def test_impostor_with_another_key_on_the_same_address(
    make_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    real = make_agent("real")
    p = pair_with(real)
    port, id_port = real.port, real.id_port
    real.close()
    p.client.close()
    impostor = make_agent("impostor", port=port)  # same control port, its own key
    assert impostor.keys.public != real.keys.public
    t0 = time.monotonic()
    with pytest.raises(NodeError) as err:
        NodeClient.for_record(p.record, p.keys, timeout=10).hello()
    assert err.value.code == "wrong_key" and f"127.0.0.1:{port}" in str(err.value)
    assert time.monotonic() - t0 < 2.0
    assert NodeRegistry().load() == [p.record]  # nothing changed on the main side
    assert impostor.paired is None
    del id_port


def test_pairing_survives_a_restart_and_local_unpair(
    make_agent: Callable[..., Agent], tmp_path: Path
) -> None:
    # A port below the ephemeral range: with port 0 the OS hands out one there, and between the close and the
    # restart an outgoing connection elsewhere on the PC could take it (or the next one, the agent's second port).
    a = make_agent("pc", data_dir=tmp_path / "agent-pc", port=free_port())
    p = pair_with(a)
    port = a.port
    a.close()
    p.client.close()
    b = make_agent("pc", data_dir=tmp_path / "agent-pc", port=port)
    assert b.keys == a.keys and b.paired is not None and b.code is None
    c = NodeClient.for_record(p.record, p.keys, timeout=5)
    assert c.hello()["paired_to_you"] is True
    (b.dir / "paired.json").unlink()  # `strata-node unpair` on the worker PC
    deadline = time.monotonic() + 5
    while b.code is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert b.code is not None and b.paired is None
    with pytest.raises(NodeError) as err:
        c.info()
    assert err.value.code == "not_paired"
    c.close()


def test_unreachable_names_the_address() -> None:
    c = NodeClient("127.0.0.1", 9, KeyPair.generate().public, KeyPair.generate(), timeout=1)
    with pytest.raises(NodeError) as err:
        c.hello()
    assert err.value.code == "unreachable" and "tcp://127.0.0.1:9" in str(err.value)
    with pytest.raises(NodeError, match=r"tcp://127.0.0.1:10 within"):
        identify("127.0.0.1", 9, timeout=0.5)


def test_garbage_and_oversize_messages_do_not_hurt_the_agent(paired: Paired) -> None:
    agent = paired.agent
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.curve_serverkey = agent.keys.public.encode()
    s.curve_publickey, s.curve_secretkey = paired.keys.public.encode(), paired.keys.secret.encode()
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{agent.port}")
    try:
        for junk in (b"\xc1", wire.pack([1, 2, 3]), wire.pack({"id": 7, "cmd": "info", "args": {"x": 1}})):
            s.send(junk)
            assert s.poll(3000)
            reply = wire.unpack(s.recv(), 1 << 20)
            assert reply["ok"] is False and reply["code"] == "bad_request"
        s.send(b"\x00" * (wire.MAX_REQUEST_BYTES + 1))  # over ZMQ_MAXMSGSIZE: the agent drops the connection
        assert not s.poll(500)
    finally:
        s.close(0)
    assert paired.client.hello()["paired_to_you"] is True  # still serving
