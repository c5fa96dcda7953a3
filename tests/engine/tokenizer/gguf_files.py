"""GGUF files for the tokenizer tests: a tokenizer-only writer, and a small metadata reader that stops at the key/value
section (gguf.GGUFReader also maps every tensor and takes seconds on a 262k vocabulary). Its output is checked
against gguf.GGUFReader in test_tokenizer_gguf_io.py."""

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import gguf
import numpy as np

from engine.testing.tokenizer_fixture import write_tokenizer


@dataclass(frozen=True)
class TokenizerFile:
    path: Path
    meta: dict[str, Any]  # as read back from the file


_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_ARRAYS = {
    0: "<u1",
    1: "<i1",
    2: "<u2",
    3: "<i2",
    4: "<u4",
    5: "<i4",
    6: "<f4",
    7: "<?",
    10: "<u8",
    11: "<i8",
    12: "<f8",
}
_STRING, _ARRAY = 8, 9


def hf_tokenizer(path: Path) -> Any:
    """transformers' own GGUF tokenizer conversion of `path`: the independent reference."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def write_tokenizer_gguf(path: Path, meta: dict[str, Any], arch: str) -> Path:
    """A GGUF holding `general.architecture` and `meta` only (no tensors)."""
    writer = gguf.GGUFWriter(str(path), arch)
    write_tokenizer(writer, meta)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _read(f: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8")


def _value(f: BinaryIO, vtype: int) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        etype, count = _read(f, "<I"), _read(f, "<Q")
        if etype in _ARRAYS:
            dtype = np.dtype(_ARRAYS[etype])
            return np.frombuffer(f.read(dtype.itemsize * count), dtype=dtype).copy()
        return [_value(f, etype) for _ in range(count)]
    raise ValueError(f"unknown GGUF value type {vtype}")


def read_metadata(path: Path, prefixes: tuple[str, ...] = ("tokenizer.", "general.")) -> dict[str, Any]:
    """The key/values of `path` whose keys start with one of `prefixes`: strings as str, scalars as Python values,
    string arrays as list[str], numeric arrays as numpy arrays (the engine reader's conventions)."""
    out: dict[str, Any] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported")
        _read(f, "<Q")  # tensor count
        for _ in range(_read(f, "<Q")):
            key = _string(f)
            value = _value(f, _read(f, "<I"))
            if key.startswith(prefixes):
                out[key] = value
    return out
