"""mDNS on loopback (zeroconf bound to 127.0.0.1): two agents found; a spoofed advert changes no trust."""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from zeroconf import IPVersion, ServiceInfo, Zeroconf

from engine.node.agent import Agent
from engine.node.client import NodeClient, NodeError, NodeRegistry, identify, pair
from engine.node.discovery import discover
from engine.node.keys import KeyPair
from engine.node.wire import SERVICE_TYPE
from tests.engine.node.conftest import pair_with

pytestmark = pytest.mark.slow  # zeroconf's probing and goodbyes take a few seconds


def test_two_agents_found_and_a_spoofed_advert_gets_nothing(make_agent: Callable[..., Agent]) -> None:
    a = make_agent("pc-a", advertise=True)
    b = make_agent("pc-b", advertise=True)
    impostor = make_agent("pc-x")  # not advertised by itself: the spoofer points at it
    p = pair_with(a)
    # A spoofed advert: pc-a's name and fingerprint, the impostor's address and ports.
    spoof = ServiceInfo(
        SERVICE_TYPE,
        f"pc-a-spoof.{SERVICE_TYPE}",
        addresses=[socket.inet_aton("127.0.0.1")],
        port=impostor.port,
        properties={
            "name": "pc-a",
            "fp": a.keys.fingerprint,
            "v": "0.1.0",
            "idp": str(impostor.id_port),
            "gpus": "RTX 4090",
        },
        server="pc-a-spoof.local.",
    )
    zc = Zeroconf(interfaces=["127.0.0.1"], ip_version=IPVersion.V4Only)
    try:
        zc.register_service(spoof)
        found = {f.service: f for f in discover(1.5, ["127.0.0.1"])}
    finally:
        zc.unregister_service(spoof)
        zc.close()
    by_port = {f.port: f for f in found.values()}
    assert a.port in by_port and b.port in by_port and impostor.port in by_port
    fa, fb = by_port[a.port], by_port[b.port]
    assert (fa.name, fa.fingerprint, fa.id_port, fa.addresses) == (
        "pc-a",
        a.keys.fingerprint,
        a.id_port,
        ("127.0.0.1",),
    )
    assert (fb.name, fb.fingerprint) == ("pc-b", b.keys.fingerprint)
    assert "no NVIDIA GPU" in fa.gpus or "GB" in fa.gpus

    # The spoof claims pc-a's fingerprint; the address answers with another key.
    fs = by_port[impostor.port]
    assert fs.fingerprint == a.keys.fingerprint
    assert identify("127.0.0.1", fs.port, id_port=fs.id_port).fingerprint == impostor.keys.fingerprint
    # Pairing through the spoof with the fingerprint the user read on pc-a: refused before the code leaves.
    code = impostor.code
    with pytest.raises(NodeError) as err:
        pair(
            "127.0.0.1",
            fs.port,
            "ANY-CODE",
            fs.fingerprint,
            KeyPair.generate(),
            NodeRegistry(),
            id_port=fs.id_port,
        )
    assert err.value.code == "fingerprint_mismatch" and impostor.code == code and impostor.wrong_codes == 0
    # The paired main, pointed at the spoofed address, keeps pc-a's pinned key: the handshake fails.
    with NodeClient("127.0.0.1", fs.port, p.record.public_key, p.keys, timeout=1.5) as c:
        with pytest.raises(NodeError) as err:
            c.hello()
    assert err.value.code == "wrong_key"
    assert NodeRegistry().load() == [p.record]
    assert p.client.hello()["paired_to_you"] is True
    p.client.close()
