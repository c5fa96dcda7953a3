"""start_chain when a worker's port is taken: the tuner's chains move to a free port of the agent (and say which),
a chain started from a config does not (the main engine dials the config's port)."""

from typing import Any

import pytest

from engine.node.chain import ChainError, Link, start_chain
from engine.node.client import NodeError, NodeRecord


class _Client:
    def __init__(self, busy: int) -> None:
        self.busy, self.asked = busy, []

    def start_worker(self, **args: Any) -> dict[str, Any]:
        self.asked.append(args["port"])
        if args["port"] == self.busy:
            raise NodeError(
                f"port {self.busy} is in use on this PC: pick another or 0 (the agent picks)", "refused"
            )
        return {"port": args["port"] or self.busy + 1, "public_key": "k" * 40, "clocks": {}}


def _link(client: _Client, port: int) -> Link:
    rec = NodeRecord("pc2", "127.0.0.1", 7000, 7001, "p" * 40, "f")
    return Link(rec, client, "m.gguf", port=port)  # type: ignore[arg-type]


def test_a_tuners_worker_moves_to_a_free_port() -> None:
    client = _Client(busy=7010)
    link = _link(client, 7010)
    start_chain([link], (0,), any_port=True)
    assert client.asked == [7010, 0] and link.port == 7011


def test_a_configs_worker_keeps_its_port_or_fails() -> None:
    link = _link(_Client(busy=7010), 7010)
    with pytest.raises(ChainError, match="in use"):
        start_chain([link], (0,))
