"""Start the stage workers of a split across worker PCs, in the order the keys need, and stop them again.

The last stage starts first. A relay connects to the stage after it with its own worker key, so that stage must
admit the relay's key and the relay must know that stage's key: the main asks the relay's agent for the relay's key
first (`new_key`), starts the next stage admitting it, then the relay with that key. The main process then connects
to the first worker with `--remote-stage-key <its key> --stage-key <the main's certificate>`.
"""

import re
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.node.client import NodeClient, NodeError, NodeRecord, main_key_file
from engine.node.keys import KeyPair


class ChainError(RuntimeError):
    """A worker of the chain could not be started; the message names the PC and why."""


def shard_name(model: str | Path, begin: int, end: int) -> str:
    """`<model>.L<begin>-<end>.gguf`: the file name a shipped range gets on a worker PC."""
    stem = Path(model).name.removesuffix(".gguf")
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", stem)
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", stem).strip("-.") or "model"
    return f"{stem[:96]}.L{begin}-{end}.gguf"


@dataclass
class Link:
    """One stage of the chain: the PC, the model file on it, the port its worker takes."""

    rec: NodeRecord
    client: NodeClient
    model: str
    port: int = 0
    windows: bool = False
    worker: dict[str, Any] | None = None


def start_chain(
    links: list[Link],
    split: tuple[int, ...],
    flags: list[str] | None = None,
    lock_clocks: bool = False,
    any_port: bool = False,
) -> list[str]:
    """Start worker i on links[i] for layers [split[i], split[i+1]) (the last to the model's end). Returns warnings
    (a Windows PC whose clocks are not locked). With `any_port`, a worker whose port is taken gets another of its
    agent's worker ports, and links[i].port says which (the tuner, which writes the config afterwards); without, the
    port is the config's, which the main engine will dial."""
    warnings: list[str] = []
    relay_keys: list[dict[str, Any] | None] = [None] * len(links)
    link = links[0]
    try:
        for i in range(len(links) - 1):
            link = links[i]
            relay_keys[i] = link.client.new_key()
        nxt: tuple[str, str] | None = None
        for i in reversed(range(len(links))):
            link = links[i]
            prev = relay_keys[i - 1] if i > 0 else None
            args: dict[str, Any] = {
                "model": link.model,
                "begin": split[i],
                "port": link.port,
                "lock_clocks": lock_clocks,
                "flags": list(flags or []),
                "allow_keys": [prev["public_key"]] if prev else [],
            }
            if i + 1 < len(split):
                args["end"] = split[i + 1]
            if nxt is not None:
                args["next"], args["next_key"] = nxt
            mine = relay_keys[i]
            if mine is not None:
                args["key_id"] = mine["key_id"]
            try:
                link.worker = link.client.start_worker(**args)
            except NodeError as exc:
                # The port this PC's worker had may be taken meanwhile (by any program's outgoing connection, say):
                # its agent then picks a free one of its worker ports, and the chain and the config use that.
                if not any_port or not args["port"] or "is in use on this PC" not in str(exc):
                    raise
                args["port"] = 0
                link.worker = link.client.start_worker(**args)
            link.port = int(link.worker["port"])
            host = link.rec.host
            port = link.worker["port"]
            nxt = (f"[{host}]:{port}" if ":" in host else f"{host}:{port}", link.worker["public_key"])
            clocks = link.worker.get("clocks") or {}
            if link.windows and not clocks.get("locked"):
                why = clocks.get("detail") or "locking was not asked for (--lock-clocks)"
                warnings.append(
                    f"WARNING: {link.rec.name} runs Windows and its worker's GPU clocks are not locked ({why}): "
                    "Windows lowers an idle worker GPU's clocks between decode steps; run its agent as administrator "
                    "and use --lock-clocks"
                )
    except NodeError as exc:
        stop_chain(links)
        raise ChainError(f"{link.rec.name} ({link.rec.address}) could not start its worker: {exc}") from None
    return warnings


def wait_listening(link: Link, timeout: float = 600.0) -> None:
    """Until the worker listens; ChainError with its last log lines if it ends first."""
    assert link.worker is not None
    wid = link.worker["id"]
    deadline = time.monotonic() + timeout
    since = 0
    tail: deque[str] = deque(maxlen=8)
    while time.monotonic() < deadline:
        res = link.client.logs(wid, since, 500)
        tail.extend(res["lines"])
        since = res["next"]
        w = {x["id"]: x for x in link.client.workers()}.get(wid, {})
        if w.get("state") == "listening":
            return
        if w.get("state") in ("exited", "stopped"):
            raise ChainError(
                f"the worker on {link.rec.name} ended (exit code {w.get('exit_code')}): {' | '.join(tail)}"
            )
    raise ChainError(f"the worker on {link.rec.name} did not start listening within {timeout:g} s")


def stop_chain(links: list[Link]) -> list[str]:
    """Stop every started worker; the problems met (a PC that no longer answers), one line each."""
    problems = []
    for link in links:
        if link.worker is not None:
            try:
                link.client.stop_worker(link.worker["id"])
            except NodeError as exc:
                problems.append(f"stopping the worker on {link.rec.name} failed: {exc}")
            link.worker = None
    return problems


def engine_flags(links: list[Link], keys: KeyPair | None = None) -> list[str]:
    """What the main engine adds to connect to the first worker: its key, and the main PC's own key file."""
    first = links[0].worker
    if first is None:
        raise ChainError("the chain has no running first worker")
    # `--flag=KEY`: a Z85 key may start with "-", which argparse would take for a flag.
    return [f"--remote-stage-key={first['public_key']}", "--stage-key", str(main_key_file(keys))]


_SHARD_RE = re.compile(r"^(?P<stem>.+)\.L(?P<a>\d+)-(?P<b>\d+)\.gguf$")


def pick_model(files: list[dict[str, Any]], model: Path, begin: int, end: int) -> str | None:
    """The file on a worker PC that serves layers [begin, end) of `model`: the whole file (same name and size), or
    a shipped shard of it whose range covers [begin, end) (the smallest such). None when there is none."""
    whole = model.stat().st_size if model.is_file() else -1
    stem = shard_name(model, 0, 1).rsplit(".L", 1)[0]
    best: tuple[int, str] | None = None
    for f in files:
        if not f.get("complete"):
            continue
        if f["name"] == model.name and f["size"] == whole:
            return model.name
        m = _SHARD_RE.match(f["name"])
        if m and m.group("stem") == stem and int(m.group("a")) <= begin and end <= int(m.group("b")):
            if best is None or f["size"] < best[0]:
                best = (f["size"], f["name"])
    return best[1] if best else None


def node_for_worker(nodes: list[NodeRecord], host: str, port: int, keys: KeyPair | None = None) -> NodeRecord:
    """The paired PC a config's worker entry (host, worker port) belongs to. Several agents on one host are told
    apart by their worker port ranges."""
    same = [n for n in nodes if n.host == host]
    if len(same) == 1:
        return same[0]
    for rec in same:
        with NodeClient.for_record(rec, keys, timeout=5.0) as c:
            try:
                lo, hi = c.info().get("worker_ports") or (0, -1)
            except NodeError:
                continue
        if lo <= port <= hi:
            return rec
    known = ", ".join(f"{n.name} ({n.address})" for n in nodes) or "none"
    raise ChainError(
        f"no paired PC runs workers at {host}:{port}; paired PCs: {known}. Pair it (strata-node pair)"
    )
