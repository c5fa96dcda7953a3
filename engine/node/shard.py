"""A layer shard of a GGUF model: the bytes a worker PC needs for its layers, as one valid GGUF file.

The shard keeps the source's metadata records byte for byte (minus the `split.*` keys of a multi-part source), every
shared tensor (those outside `blk.N.`: embedding, output norm, head, RoPE factors) and the tensors of blocks
[begin, end). The tensor data is copied unchanged, each tensor aligned as the source's `general.alignment` says.
The shard is described as a list of segments (header bytes, ranges of the source files, zero padding), so it can be
sent without writing it locally first, from any offset (resume).
"""

import hashlib
import json
import mmap
import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
from gguf import GGUFValueType, Keys

from engine.gguf.names import block_index
from engine.gguf.reader import GGUFError, GGUFFile, TensorInfo
from engine.node.chain import shard_name

LAYOUT_VERSION = 1
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_FIXED = {
    GGUFValueType.UINT8: 1,
    GGUFValueType.INT8: 1,
    GGUFValueType.UINT16: 2,
    GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4,
    GGUFValueType.INT32: 4,
    GGUFValueType.FLOAT32: 4,
    GGUFValueType.BOOL: 1,
    GGUFValueType.UINT64: 8,
    GGUFValueType.INT64: 8,
    GGUFValueType.FLOAT64: 8,
}
_SPLIT_PREFIX = "split."


class ShardError(ValueError):
    """A shard that cannot be made; the message names the file and what to do."""


def _skip_value(buf: bytes | memoryview, pos: int, vtype: int, depth: int = 0) -> int:
    if vtype in _FIXED:
        return pos + _FIXED[vtype]
    if vtype == GGUFValueType.STRING:
        (n,) = _U64.unpack_from(buf, pos)
        return pos + 8 + n
    if vtype == GGUFValueType.ARRAY:
        if depth > 8:
            raise ShardError("metadata arrays nest too deep")
        (sub,) = _U32.unpack_from(buf, pos)
        (count,) = _U64.unpack_from(buf, pos + 4)
        pos += 12
        if sub in _FIXED:
            return pos + count * _FIXED[sub]
        for _ in range(count):
            pos = _skip_value(buf, pos, sub, depth + 1)
        return pos
    raise ShardError(f"unknown metadata value type {vtype}")


def metadata_records(path: Path) -> tuple[int, list[tuple[str, bytes]]]:
    """(GGUF version, [(key, the record's raw bytes)]) of a file's metadata, in file order. The reader has already
    checked every length of the file (GGUFFile.open), so this walk only slices."""
    with path.open("rb") as fh:
        head = fh.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ShardError(f"{path} is not a GGUF file")
        version = _U32.unpack_from(head, 4)[0]
        n_kv = _U64.unpack_from(head, 16)[0]
    size = path.stat().st_size
    with path.open("rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        pos = 24
        out = []
        for _ in range(n_kv):
            start = pos
            (klen,) = _U64.unpack_from(mm, pos)
            key = bytes(mm[pos + 8 : pos + 8 + klen]).decode("utf-8")
            pos += 8 + klen
            (vtype,) = _U32.unpack_from(mm, pos)
            pos = _skip_value(mm, pos + 4, vtype)
            if pos > size:
                raise ShardError(f"{path}: metadata runs past the end of the file")
            out.append((key, bytes(mm[start:pos])))
        return version, out
    finally:
        mm.close()


@dataclass(frozen=True)
class Segment:
    """`length` bytes of the shard: literal `data`, a range of source file `part` at `offset`, or zeros."""

    length: int
    data: bytes | None = None
    part: int = -1
    offset: int = 0


def _align(n: int, a: int) -> int:
    return -(-n // a) * a


class ShardLayout:
    """The byte layout of the shard of `source` for blocks [begin, end)."""

    def __init__(self, source: str | Path, begin: int, end: int | None = None) -> None:
        self.source = Path(source)
        with GGUFFile.open(self.source) as gf:
            self.parts = list(gf.paths)
            n_layer = gf.get(Keys.LLM.BLOCK_COUNT.format(arch=gf.architecture))
            if not isinstance(n_layer, int) or n_layer < 1:
                raise ShardError(
                    f"{self.source}: no block count in the metadata; cannot cut it into layer ranges"
                )
            self.n_layer = n_layer
            self.begin = begin
            self.end = n_layer if end is None else end
            if not 0 <= begin < self.end <= n_layer:
                raise ShardError(
                    f"layers {begin} to {self.end} are not a range of {self.source.name}'s {n_layer} layers "
                    f"(0-{n_layer - 1}): give 0 <= begin < end <= {n_layer}"
                )
            alignment = gf.get(Keys.General.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT)
            self.alignment = int(alignment)
            self.tensors: list[TensorInfo] = sorted(
                (t for t in gf.tensors.values() if self._wanted(t.name)),
                key=lambda t: (t.file_index, t.offset),
            )
        version, records = metadata_records(self.parts[0])
        self.version = version
        kept = [raw for key, raw in records if not key.startswith(_SPLIT_PREFIX)]
        header = bytearray(b"GGUF")
        header += _U32.pack(version)
        header += _U64.pack(len(self.tensors))
        header += _U64.pack(len(kept))
        for raw in kept:
            header += raw
        rel = 0
        offsets = []
        for t in self.tensors:
            rel = _align(rel, self.alignment)
            offsets.append(rel)
            rel += t.nbytes
        for t, off in zip(self.tensors, offsets, strict=True):
            name = t.name.encode("utf-8")
            ne = list(reversed(t.shape))
            header += _U64.pack(len(name)) + name
            header += _U32.pack(len(ne))
            for n in ne:
                header += _U64.pack(n)
            header += _U32.pack(int(t.qtype))
            header += _U64.pack(off)
        data_start = _align(len(header), self.alignment)
        segs = [Segment(len(header), data=bytes(header))]
        if data_start > len(header):
            segs.append(Segment(data_start - len(header)))
        pos = 0
        for t, off in zip(self.tensors, offsets, strict=True):
            if off > pos:
                segs.append(Segment(off - pos))
            if t.nbytes:
                segs.append(Segment(t.nbytes, part=t.file_index, offset=t.offset))
            pos = off + t.nbytes
        self.segments = segs
        self.size = data_start + pos

    def _wanted(self, name: str) -> bool:
        n = block_index(name)
        return n is None or self.begin <= n < self.end

    @property
    def tensor_names(self) -> list[str]:
        return [t.name for t in self.tensors]

    def default_name(self) -> str:
        return shard_name(self.source, self.begin, self.end)

    def read(self, offset: int = 0, chunk: int = 4 << 20) -> Iterator[bytes]:
        """The shard's bytes from `offset` to the end, in pieces of at most `chunk` bytes."""
        handles = [p.open("rb") for p in self.parts]
        try:
            buf = bytearray()
            pos = 0
            for seg in self.segments:
                seg_end = pos + seg.length
                if seg_end <= offset:
                    pos = seg_end
                    continue
                skip = max(0, offset - pos)
                left = seg.length - skip
                if seg.data is not None:
                    buf += seg.data[skip:]
                elif seg.part < 0:
                    buf += bytes(left)
                else:
                    fh = handles[seg.part]
                    fh.seek(seg.offset + skip)
                    while left:
                        want = min(left, chunk)
                        piece = fh.read(want)
                        if len(piece) != want:
                            raise ShardError(
                                f"{self.parts[seg.part]} changed while it was read: ship it again"
                            )
                        buf += piece
                        left -= want
                        while len(buf) >= chunk:
                            yield bytes(buf[:chunk])
                            del buf[:chunk]
                    left = 0
                while len(buf) >= chunk:
                    yield bytes(buf[:chunk])
                    del buf[:chunk]
                pos = seg_end
            if buf:
                yield bytes(buf)
        finally:
            for h in handles:
                h.close()

    def cache_key(self) -> str:
        stats = [(str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in self.parts]
        return json.dumps([LAYOUT_VERSION, stats, self.begin, self.end])

    def sha256(self, cache: Path | None = None) -> str:
        """SHA-256 of the whole shard (remembered in `cache`, keyed by the source files' size and mtime)."""
        key = self.cache_key()
        known: dict[str, str] = {}
        if cache is not None:
            try:
                loaded = json.loads(cache.read_text(encoding="utf-8"))
                known = loaded if isinstance(loaded, dict) else {}
            except (OSError, ValueError):
                known = {}
            if isinstance(known.get(key), str):
                return known[key]
        h = hashlib.sha256()
        for piece in self.read(0, 8 << 20):
            h.update(piece)
        digest = h.hexdigest()
        if cache is not None:
            known[key] = digest
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(".tmp")
            tmp.write_text(json.dumps(dict(list(known.items())[-200:])), encoding="utf-8")
            os.replace(tmp, cache)
        return digest

    def write(self, path: Path) -> Path:
        """Write the shard to a local file (tests, or a copy by hand)."""
        with path.open("wb") as fh:
            for piece in self.read(0):
                fh.write(piece)
        return path


def check_shard(path: Path, begin: int, end: int) -> None:
    """Open a shard with the engine's reader and check it holds every tensor of its blocks; GGUFError otherwise."""
    with GGUFFile.open(path) as gf:
        blocks = {block_index(n) for n in gf.tensors} - {None}
        missing = [i for i in range(begin, end) if i not in blocks]
        if missing:
            raise GGUFError(path, f"the shard has no tensors for layers {missing}", "ship the layers again")
