"""Memory-mapped access to GGUF files (single or split into parts) on top of the `gguf` package.

The header, metadata and tensor table are parsed here rather than with `gguf.GGUFReader`, which builds one numpy
view per array element and needs ~16 s for a 150k-token vocabulary. Every length and count read from the file is
checked against the bytes that remain before anything is allocated, so a damaged file fails with a `GGUFError`.
"""

import itertools
import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import gguf
import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, Keys

from engine.gguf.names import block_index

SUPPORTED_VERSIONS = (2, 3)
MAX_DIMS = 4  # GGML_MAX_DIMS
_MAX_NESTING = 8  # arrays of arrays deeper than this are refused
_DAMAGED = "the file is damaged or incomplete; download it again"

_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")

# Scalar value types: struct format and byte size.
_SCALAR_STRUCTS: dict[int, struct.Struct] = {
    GGUFValueType.UINT8: struct.Struct("<B"),
    GGUFValueType.INT8: struct.Struct("<b"),
    GGUFValueType.UINT16: struct.Struct("<H"),
    GGUFValueType.INT16: struct.Struct("<h"),
    GGUFValueType.UINT32: struct.Struct("<I"),
    GGUFValueType.INT32: struct.Struct("<i"),
    GGUFValueType.FLOAT32: struct.Struct("<f"),
    GGUFValueType.BOOL: struct.Struct("<B"),
    GGUFValueType.UINT64: struct.Struct("<Q"),
    GGUFValueType.INT64: struct.Struct("<q"),
    GGUFValueType.FLOAT64: struct.Struct("<d"),
}
# Numeric arrays: numpy dtype (little-endian as stored).
_ARRAY_DTYPES: dict[int, np.dtype[Any]] = {
    GGUFValueType.UINT8: np.dtype("<u1"),
    GGUFValueType.INT8: np.dtype("<i1"),
    GGUFValueType.UINT16: np.dtype("<u2"),
    GGUFValueType.INT16: np.dtype("<i2"),
    GGUFValueType.UINT32: np.dtype("<u4"),
    GGUFValueType.INT32: np.dtype("<i4"),
    GGUFValueType.FLOAT32: np.dtype("<f4"),
    GGUFValueType.BOOL: np.dtype("<u1"),
    GGUFValueType.UINT64: np.dtype("<u8"),
    GGUFValueType.INT64: np.dtype("<i8"),
    GGUFValueType.FLOAT64: np.dtype("<f8"),
}
# Smallest encoded size of one array element of each type (strings: the 8-byte length; arrays: type + count).
_MIN_ELEM_SIZE: dict[int, int] = {
    **{t: s.size for t, s in _SCALAR_STRUCTS.items()},
    GGUFValueType.STRING: 8,
    GGUFValueType.ARRAY: 12,
}
_SPLIT_RE = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")


class GGUFError(Exception):
    """A GGUF file could not be used. The message is one line naming the file."""

    def __init__(self, path: Path | str, problem: str, hint: str = _DAMAGED) -> None:
        self.path = Path(path)
        self.problem = problem
        text = f"{path}: {problem}; {hint}" if hint else f"{path}: {problem}"
        super().__init__(" ".join(text.split()))  # one line whatever the file's strings contain


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lies. `shape` is in torch order (ggml `ne` reversed): [n_out, n_in], [n_expert, n_out, n_in]."""

    name: str
    qtype: GGMLQuantizationType
    shape: tuple[int, ...]
    file_index: int
    offset: int  # absolute byte offset of the data in its file
    nbytes: int

    @property
    def n_elements(self) -> int:
        return math.prod(self.shape)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (the last dimension) in the file's block format."""
        block_elems, block_bytes = GGML_QUANT_SIZES[self.qtype]
        row = self.shape[-1] if self.shape else 1
        return row // block_elems * block_bytes


def _short(text: str, limit: int = 80) -> str:
    return repr(text if len(text) <= limit else text[:limit] + "...")


class _HeaderParser:
    """Reads the header, metadata and tensor table of one file from its memory map."""

    def __init__(self, buf: mmap.mmap, size: int, path: Path) -> None:
        self.buf = buf
        self.size = size
        self.path = path
        self.pos = 0

    def fail(self, problem: str, hint: str = _DAMAGED) -> GGUFError:
        return GGUFError(self.path, problem, hint)

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(
                f"truncated: {what} at byte {self.pos} needs {n} bytes but only {self.size - self.pos} remain"
            )

    def u32(self, what: str) -> int:
        self.need(4, what)
        (v,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return v

    def u64(self, what: str) -> int:
        self.need(8, what)
        (v,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return v

    def raw_str(self, what: str) -> bytes:
        n = self.u64(f"length of {what}")
        self.need(n, what)
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data

    def utf8(self, data: bytes, what: str) -> str:
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{what} is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None

    def count(self, n: int, elem_size: int, what: str) -> None:
        """Refuse a count whose elements cannot fit in the rest of the file, before allocating for them."""
        if n * elem_size > self.size - self.pos:
            raise self.fail(
                f"{what} claims {n} entries of at least {elem_size} bytes at byte {self.pos}, "
                f"but only {self.size - self.pos} bytes remain"
            )

    def value(self, vtype: int, key: str, depth: int = 0) -> Any:
        scalar = _SCALAR_STRUCTS.get(vtype)
        if scalar is not None:
            self.need(scalar.size, f"value of {_short(key)}")
            (v,) = scalar.unpack_from(self.buf, self.pos)
            self.pos += scalar.size
            return bool(v) if vtype == GGUFValueType.BOOL else v
        if vtype == GGUFValueType.STRING:
            # Values keep bytes that are not UTF-8 as surrogates (`s.encode("utf-8", "surrogateescape")` gives them back).
            return self.raw_str(f"value of {_short(key)}").decode("utf-8", "surrogateescape")
        if vtype == GGUFValueType.ARRAY:
            if depth >= _MAX_NESTING:
                raise self.fail(f"metadata {_short(key)} nests arrays deeper than {_MAX_NESTING}")
            sub = self.u32(f"array type of {_short(key)}")
            n = self.u64(f"array length of {_short(key)}")
            return self.array(sub, n, key, depth + 1)
        raise self.fail(f"metadata {_short(key)} has unknown value type {vtype} at byte {self.pos - 4}")

    def array(self, sub: int, n: int, key: str, depth: int) -> Any:
        elem = _MIN_ELEM_SIZE.get(sub)
        if elem is None:
            raise self.fail(f"metadata {_short(key)} is an array of unknown value type {sub}")
        self.count(n, elem, f"array {_short(key)}")
        dtype = _ARRAY_DTYPES.get(sub)
        if dtype is not None:
            arr = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).astype(
                dtype.newbyteorder("=")
            )
            self.pos += n * dtype.itemsize
            return arr != 0 if sub == GGUFValueType.BOOL else arr
        if sub == GGUFValueType.STRING:
            return self.str_array(n, key)
        return [self.value(sub, key, depth) for _ in range(n)]

    def str_array(self, n: int, key: str) -> list[str]:
        # The hot loop for vocabularies and merges: one unpack and one slice per string.
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = [""] * n
        for i in range(n):
            if pos + 8 > size:
                self.pos = pos
                raise self.fail(f"truncated: string {i} of array {_short(key)} at byte {pos}")
            (ln,) = unpack(buf, pos)
            pos += 8
            end = pos + ln
            if end > size:
                self.pos = pos
                raise self.fail(
                    f"truncated: string {i} of array {_short(key)} at byte {pos} needs {ln} bytes "
                    f"but only {size - pos} remain"
                )
            out[i] = buf[pos:end].decode("utf-8", "surrogateescape")
            pos = end
        self.pos = pos
        return out

    def parse(self, file_index: int) -> tuple[int, dict[str, Any], dict[str, TensorInfo]]:
        if self.size < 4 or self.buf[:4] != b"GGUF":
            got = bytes(self.buf[:4]) if self.size >= 4 else b""
            raise self.fail(
                f"not a GGUF file (starts with {got!r}, expected b'GGUF')",
                "choose a .gguf model file",
            )
        self.pos = 4
        version = self.u32("version")
        if version not in SUPPORTED_VERSIONS:
            if version & 0xFFFF == 0 and (version >> 16) in (2, 3):
                raise self.fail("big-endian GGUF files are not supported", "use a little-endian GGUF file")
            raise self.fail(
                f"GGUF version {version} is not supported (expected one of {SUPPORTED_VERSIONS})",
                "convert the model with a current llama.cpp or download a current GGUF file",
            )
        n_tensors = self.u64("tensor count")
        n_kv = self.u64("metadata count")
        # Smallest tensor record: name length (8) + n_dims (4) + type (4) + offset (8); smallest KV record: 13.
        self.count(n_kv, 13, "metadata table")
        self.count(n_tensors, 24, "tensor table")

        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            at = self.pos
            key = self.utf8(self.raw_str("metadata key"), f"metadata key at byte {at}")
            vtype = self.u32(f"value type of {_short(key)}")
            value = self.value(vtype, key)
            if key in metadata:
                raise self.fail(f"metadata key {_short(key)} appears twice")
            metadata[key] = value

        alignment = metadata.get(Keys.General.ALIGNMENT, gguf.GGUF_DEFAULT_ALIGNMENT)
        if (
            not isinstance(alignment, int)
            or isinstance(alignment, bool)
            or alignment <= 0
            or alignment & (alignment - 1)
        ):
            raise self.fail(f"{Keys.General.ALIGNMENT} is {alignment!r} (expected a power of two)")

        records = []
        for _ in range(n_tensors):
            at = self.pos
            name = self.utf8(self.raw_str("tensor name"), f"tensor name at byte {at}")
            n_dims = self.u32(f"dimension count of tensor {_short(name)}")
            if n_dims > MAX_DIMS:
                raise self.fail(f"tensor {_short(name)} has {n_dims} dimensions (at most {MAX_DIMS} allowed)")
            ne = [self.u64(f"dimensions of tensor {_short(name)}") for _ in range(n_dims)]
            type_id = self.u32(f"type of tensor {_short(name)}")
            rel = self.u64(f"data offset of tensor {_short(name)}")
            records.append((name, ne, type_id, rel))

        data_start = -(-self.pos // alignment) * alignment
        tensors: dict[str, TensorInfo] = {}
        for name, ne, type_id, rel in records:
            if name in tensors:
                raise self.fail(f"tensor {_short(name)} appears twice")
            tensors[name] = self._tensor_info(name, ne, type_id, rel, data_start, alignment, file_index)
        spans = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values() if t.nbytes)
        for (_, end_a, name_a), (start_b, _, name_b) in itertools.pairwise(spans):
            if start_b < end_a:
                raise self.fail(f"the data of tensors {_short(name_a)} and {_short(name_b)} overlap")
        return version, metadata, tensors

    def _tensor_info(
        self,
        name: str,
        ne: list[int],
        type_id: int,
        rel: int,
        data_start: int,
        alignment: int,
        file_index: int,
    ) -> TensorInfo:
        try:
            qtype = GGMLQuantizationType(type_id)
            block_elems, block_bytes = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError):
            raise self.fail(
                f"tensor {_short(name)} has unknown block type id {type_id}",
                "this file needs a newer program or is damaged",
            ) from None
        if any(n >= 1 << 63 for n in ne) or math.prod(ne) >= 1 << 63:
            raise self.fail(f"tensor {_short(name)} has dimensions {ne} whose size does not fit in 64 bits")
        row = ne[0] if ne else 1
        if row % block_elems:
            raise self.fail(
                f"tensor {_short(name)} of type {qtype.name} has rows of {row} elements, "
                f"not a multiple of its block size {block_elems}"
            )
        n_elems = math.prod(ne)
        nbytes = n_elems // block_elems * block_bytes
        if rel % alignment:
            raise self.fail(
                f"tensor {_short(name)} data offset {rel} is not a multiple of the alignment {alignment}"
            )
        start = data_start + rel
        if start + nbytes > self.size:
            raise self.fail(
                f"tensor {_short(name)} ({qtype.name}, {nbytes} bytes at byte {start}) lies beyond the end "
                f"of the file ({self.size} bytes)"
            )
        return TensorInfo(name, qtype, tuple(reversed(ne)), file_index, start, nbytes)


def split_paths(path: Path) -> list[Path]:
    """All parts of a split model (`name-00001-of-00003.gguf`) given any part; `[path]` for a single file."""
    m = _SPLIT_RE.match(path.name)
    if not m:
        return [path]
    count = int(m.group("count"))
    no = int(m.group("no"))
    if count == 0 or not 1 <= no <= count:
        raise GGUFError(
            path, f"part number {no} of {count} is not valid", "rename the part files as downloaded"
        )
    stem = m.group("stem")
    return [path.with_name(f"{stem}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]


class GGUFFile:
    """A GGUF model: metadata, tensor table and zero-copy views of the memory-mapped tensor data."""

    def __init__(
        self,
        paths: list[Path],
        maps: list[mmap.mmap],
        metadata: dict[str, Any],
        tensors: dict[str, TensorInfo],
    ) -> None:
        self.paths = paths
        self.path = paths[0]
        self.metadata = metadata
        self.tensors = tensors
        self._maps: list[mmap.mmap | None] = list(maps)

    @classmethod
    def open(cls, path: str | Path) -> "GGUFFile":
        """Open a file, or all parts of a split model given any of its parts."""
        path = Path(path)
        paths = split_paths(path)
        for p in paths:
            if not p.is_file():
                hint = "put all parts in the same folder" if len(paths) > 1 else "check the path"
                problem = (
                    f"part {p.name} of the split model is missing" if len(paths) > 1 else "file not found"
                )
                raise GGUFError(p, problem, hint)
        maps: list[mmap.mmap] = []
        try:
            metadata: dict[str, Any] = {}
            tensors: dict[str, TensorInfo] = {}
            for index, p in enumerate(paths):
                mm = _map(p)
                maps.append(mm)
                _, meta, part_tensors = _HeaderParser(mm, len(mm), p).parse(index)
                _check_part(p, index, len(paths), meta)
                if index == 0:
                    metadata = meta
                for name, info in part_tensors.items():
                    if name in tensors:
                        raise GGUFError(
                            p, f"tensor {_short(name)} is also in {paths[tensors[name].file_index].name}"
                        )
                    tensors[name] = info
            expected = metadata.get(Keys.Split.LLM_KV_SPLIT_TENSORS_COUNT)
            if len(paths) > 1 and isinstance(expected, int) and expected != len(tensors):
                raise GGUFError(
                    paths[0], f"the parts hold {len(tensors)} tensors, the first part says {expected}"
                )
        except BaseException:
            for mm in maps:
                try:
                    mm.close()
                except BufferError:
                    pass  # a view is still referenced; it is unmapped when freed
            raise
        return cls(paths, maps, metadata, tensors)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get(Keys.General.ARCHITECTURE)
        if not isinstance(arch, str):
            raise GGUFError(self.path, f"no {Keys.General.ARCHITECTURE} string in the metadata")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor_info(self, name: str) -> TensorInfo:
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(
                self.path,
                f"no tensor named {_short(name)} among its {len(self.tensors)} tensors",
                "the file does not match its declared architecture; use a complete model file",
            )
        return info

    def tensor_bytes(self, name: str) -> torch.Tensor:
        """The raw blocks of a tensor as uint8 [..., row_bytes], a view of the mapped file (no copy)."""
        info = self.tensor_info(name)
        mm = self._maps[info.file_index]
        if mm is None:
            raise GGUFError(self.path, "the file is closed", "open it again")
        byte_shape = (*info.shape[:-1], info.row_bytes)
        if info.nbytes == 0:
            return torch.empty(byte_shape, dtype=torch.uint8)
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=info.nbytes, offset=info.offset)
        return flat.view(byte_shape)

    def tensor_names_for_layers(self, begin: int, end: int) -> list[str]:
        """Names of the `blk.N.*` tensors with begin <= N < end, in file order."""
        out = []
        for name in self.tensors:
            n = block_index(name)
            if n is not None and begin <= n < end:
                out.append(name)
        return out

    def close(self) -> None:
        """Release the files. Tensors from `tensor_bytes` hold a reference to their mapping, which is unmapped
        when the last of them is freed (never `mmap.close()` here: torch does not pin the buffer export)."""
        self._maps = [None] * len(self._maps)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, parts={len(self.paths)}, tensors={len(self.tensors)})"


def _map(path: Path) -> mmap.mmap:
    try:
        with path.open("rb") as f:
            size = f.seek(0, 2)
            if size == 0:
                raise GGUFError(path, "the file is empty (0 bytes)")
            # Copy-on-write: torch gets a writable buffer without a warning, and the file is never written.
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as exc:
        raise GGUFError(
            path, f"cannot read the file ({exc.strerror or exc})", "check its permissions"
        ) from None


def _check_part(path: Path, index: int, count: int, meta: dict[str, Any]) -> None:
    if count == 1:
        return
    no = meta.get(Keys.Split.LLM_KV_SPLIT_NO)
    total = meta.get(Keys.Split.LLM_KV_SPLIT_COUNT)
    hint = "the parts come from different downloads; download all parts again"
    if no is not None and no != index:
        raise GGUFError(path, f"{Keys.Split.LLM_KV_SPLIT_NO} is {no}, expected {index} from its name", hint)
    if total is not None and total != count:
        raise GGUFError(
            path, f"{Keys.Split.LLM_KV_SPLIT_COUNT} is {total}, expected {count} from its name", hint
        )
