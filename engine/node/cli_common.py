"""What the commands of `strata-node` share: their error, their output (text, or one JSON object for the app's
`--json`), the registry of paired PCs and a client for one of them."""

import argparse
import json
from typing import Any

from engine.node.client import NodeClient, NodeRegistry
from engine.node.errors import NodeCliError

PROG = "strata-node"


class CliError(NodeCliError, RuntimeError):
    def __init__(self, message: str, code: str = "failed") -> None:
        super().__init__(message)
        self.code = code


def hostport(text: str, default_port: int) -> tuple[str, int]:
    text = text.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port = rest.lstrip(":")
    elif text.count(":") == 1:
        host, port = text.split(":")
    else:
        host, port = text, ""
    if port and not port.isdigit():
        raise CliError(f"{text!r} is not HOST or HOST:PORT (e.g. 192.168.1.20:7460)", "bad_address")
    p = int(port) if port else default_port
    if not host or not 0 < p < 65536:
        raise CliError(f"{text!r} is not HOST or HOST:PORT (e.g. 192.168.1.20:7460)", "bad_address")
    return host, p


def out(args: argparse.Namespace, data: dict[str, Any], text: str) -> None:
    if getattr(args, "json", False):
        print(json.dumps({"ok": True, **data}, default=str))
    else:
        print(text)


def registry() -> Any:
    return NodeRegistry()


def client(ref: str, timeout: float = 10.0) -> Any:
    return NodeClient.for_record(registry().find(ref), timeout=timeout)
