"""Send a worker PC the shard of a model it needs, resuming after a cut and verified by SHA-256.

The agent answers `upload_begin` with how many bytes of this very shard (same size and hash) it already holds; the
rest goes in 4 MiB chunks with a few in flight, and `upload_end` renames the file only when the hash the agent
computed over the bytes it wrote matches the one computed here from the source.
"""

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.node.client import NodeClient, NodeError, main_dir
from engine.node.shard import ShardLayout
from engine.node.wire import CHUNK_BYTES


@dataclass(frozen=True)
class ShipResult:
    name: str
    size: int
    sha256: str
    resumed_from: int
    sent: int
    already_there: bool

    def to_dict(self) -> dict[str, Any]:
        return self.__dict__.copy()


def ship(
    client: NodeClient,
    model: str | Path,
    begin: int,
    end: int | None = None,
    name: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    chunk: int = CHUNK_BYTES,
    window: int = 4,
    layout: ShardLayout | None = None,
) -> ShipResult:
    """Ship layers [begin, end) of `model` (and its shared tensors) to the agent behind `client`."""
    layout = layout or ShardLayout(model, begin, end)
    name = name or layout.default_name()
    digest = layout.sha256(main_dir() / "shard-hashes.json")
    start = client.call("upload_begin", {"name": name, "size": layout.size, "sha256": digest}, timeout=600.0)
    offset = int(start.get("offset", 0))
    if start.get("complete"):
        if progress:
            progress(layout.size, layout.size)
        return ShipResult(name, layout.size, digest, offset, 0, True)
    if not 0 <= offset <= layout.size:
        raise NodeError(
            f"the agent answered a resume offset of {offset} for a {layout.size}-byte file", "bad_answer"
        )
    sent = 0

    def requests() -> Iterator[tuple[str, dict[str, Any]]]:
        nonlocal sent
        pos = offset
        for piece in layout.read(offset, chunk):
            yield "upload_chunk", {"name": name, "offset": pos, "data": piece}
            pos += len(piece)
            sent += len(piece)
            if progress:
                progress(pos, layout.size)

    client.pipeline(requests(), window=window)
    done = client.call("upload_end", {"name": name}, timeout=600.0)
    if done.get("sha256") != digest:
        raise NodeError(f"the agent stored {name} with another hash than the source's", "hash_mismatch")
    return ShipResult(name, layout.size, digest, offset, sent, False)
