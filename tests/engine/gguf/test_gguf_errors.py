"""Damaged and hostile GGUF files: every problem is one GGUFError line naming the file, found before allocating."""

import struct
import tempfile
import tracemalloc
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.gguf.random_blocks import random_blocks
from engine.gguf.reader import GGUFError, GGUFFile

Q = GGMLQuantizationType
V = GGUFValueType


# A GGUF encoder written from the format description, independent of the reader under test.
def _str(s: str | bytes) -> bytes:
    b = s.encode() if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def _kv(key: str | bytes, vtype: int, payload: bytes) -> bytes:
    return _str(key) + struct.pack("<I", vtype) + payload


def _u32kv(key: str, value: int) -> bytes:
    return _kv(key, V.UINT32, struct.pack("<I", value))


def _tensor(name: str, ne: list[int], qtype: int, offset: int) -> bytes:
    return (
        _str(name)
        + struct.pack("<I", len(ne))
        + struct.pack(f"<{len(ne)}Q", *ne)
        + struct.pack("<IQ", qtype, offset)
    )


def _build(
    kvs: list[bytes] | None = None,
    tensors: list[bytes] | None = None,
    data: bytes = b"",
    *,
    magic: bytes = b"GGUF",
    version: int = 3,
    n_kv: int | None = None,
    n_tensors: int | None = None,
    alignment: int = 32,
) -> bytes:
    kvs = [_kv("general.architecture", V.STRING, _str("llama"))] if kvs is None else kvs
    tensors = tensors or []
    head = magic + struct.pack(
        "<IQQ", version, len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv
    )
    body = head + b"".join(kvs) + b"".join(tensors)
    pad = -len(body) % alignment
    return body + b"\0" * pad + data


def _f32_tensor_file(ne0: int = 8, qtype: int = Q.F32, offset: int = 0, data_len: int = 32) -> bytes:
    return _build(tensors=[_tensor("w.weight", [ne0], qtype, offset)], data=b"\1" * data_len)


@pytest.fixture
def write(tmp_path: Path) -> Iterator:
    def _write(data: bytes, name: str = "bad.gguf") -> Path:
        p = tmp_path / name
        p.write_bytes(data)
        return p

    yield _write


def _expect(path: Path, *fragments: str, named: Path | None = None) -> str:
    with pytest.raises(GGUFError) as err:
        GGUFFile.open(path)
    msg = str(err.value)
    assert msg.startswith(f"{named or path}: ") and "\n" not in msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


def test_hand_built_file_is_valid(write) -> None:
    p = write(
        _build(
            [_kv("general.architecture", V.STRING, _str("llama")), _u32kv("general.alignment", 64)],
            [_tensor("a.weight", [8], Q.F32, 0), _tensor("b.weight", [32, 2], Q.Q8_0, 64)],
            b"\0" * 64 + b"\1" * 68,
            alignment=64,
        )
    )
    with GGUFFile.open(p) as f:
        assert f.tensors["b.weight"].shape == (2, 32) and f.tensors["b.weight"].nbytes == 68
        assert f.tensor_bytes("b.weight").shape == (2, 34)


def test_empty_and_truncated(write) -> None:
    _expect(write(b""), "empty")
    good = _build(
        [
            _kv("general.architecture", V.STRING, _str("llama")),
            _kv("x", V.ARRAY, struct.pack("<IQ", V.STRING, 2) + _str("ab") + _str("cd")),
        ],
        [_tensor("w.weight", [8], Q.F32, 0)],
        b"\1" * 32,
    )
    for cut in (2, 6, 20, 30, 60, 90, 110, len(good) - 40, len(good) - 1):
        msg = _expect(write(good[:cut]))
        assert "truncated" in msg or "not a GGUF file" in msg or "beyond the end" in msg, msg


def test_wrong_magic_and_versions(write) -> None:
    _expect(write(_build(magic=b"GGML")), "not a GGUF file", "b'GGML'")
    _expect(write(_build(version=1)), "version 1 is not supported")
    _expect(write(_build(version=4)), "version 4 is not supported")
    _expect(write(_build(version=3 << 16)), "big-endian")
    assert GGUFFile.open(write(_build(version=2))).architecture == "llama"


def test_tensor_data_past_the_end_or_overlapping(write) -> None:
    _expect(write(_f32_tensor_file(offset=1 << 40)), "beyond the end")
    _expect(write(_f32_tensor_file(data_len=31)), "beyond the end")
    _expect(write(_f32_tensor_file(ne0=(1 << 62))), "beyond the end")
    huge = _build(tensors=[_tensor("w.weight", [0, 1 << 63], Q.F32, 0)])
    _expect(write(huge), "does not fit in 64 bits")
    overlap = _build(
        tensors=[_tensor("a.weight", [16], Q.F32, 0), _tensor("b.weight", [8], Q.F32, 32)], data=b"\0" * 96
    )
    _expect(write(overlap), "overlap", "'a.weight'", "'b.weight'")
    _expect(write(_f32_tensor_file(offset=4)), "not a multiple of the alignment 32")


def test_unknown_block_type_and_inconsistent_shape(write) -> None:
    _expect(write(_f32_tensor_file(qtype=4)), "unknown block type id 4")  # Q4_2 was removed from ggml
    _expect(write(_f32_tensor_file(qtype=9999)), "unknown block type id 9999")
    _expect(
        write(_f32_tensor_file(ne0=33, qtype=Q.Q8_0, data_len=64)), "Q8_0", "33 elements", "block size 32"
    )
    five = _build(tensors=[_tensor("w.weight", [1, 1, 1, 1, 8], Q.F32, 0)], data=b"\0" * 32)
    _expect(write(five), "5 dimensions")


@pytest.mark.parametrize(
    "payload",
    [
        _kv("k", V.STRING, struct.pack("<Q", 1 << 60)),  # string longer than the file
        _kv("k", V.ARRAY, struct.pack("<IQ", V.UINT64, 1 << 61)),  # numeric array longer than the file
        _kv("k", V.ARRAY, struct.pack("<IQ", V.STRING, 1 << 59)),  # string array longer than the file
        _kv("k", V.ARRAY, struct.pack("<IQ", V.ARRAY, 1 << 40)),  # array of arrays longer than the file
        struct.pack("<Q", 1 << 62) + b"k",  # key longer than the file
    ],
)
def test_absurd_lengths_are_refused_before_allocating(write, payload: bytes) -> None:
    p = write(_build([payload]))
    tracemalloc.start()
    try:
        _expect(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_absurd_counts_are_refused(write) -> None:
    _expect(write(_build(n_kv=1 << 62)), "metadata table claims")
    _expect(write(_build(n_tensors=1 << 50)), "tensor table claims")


def test_bad_metadata(write) -> None:
    arch = _kv("general.architecture", V.STRING, _str("llama"))
    _expect(write(_build([arch, _kv("k", 13, b"\0" * 8)])), "unknown value type 13")
    _expect(
        write(_build([arch, _kv("k", V.ARRAY, struct.pack("<IQ", 77, 1) + b"\0" * 8)])),
        "unknown value type 77",
    )
    _expect(write(_build([arch, arch])), "appears twice")
    _expect(write(_build([arch, _kv(b"\xff\xfe", V.UINT8, b"\0")])), "not valid UTF-8")
    _expect(write(_build([arch, _u32kv("general.alignment", 48)])), "power of two")
    _expect(write(_build([arch, _kv("general.alignment", V.STRING, _str("32"))])), "power of two")
    nested = struct.pack("<IQ", V.ARRAY, 1) * 9 + struct.pack("<IQ", V.UINT8, 0)
    _expect(write(_build([arch, _kv("k", V.ARRAY, nested)])), "deeper than 8")
    dup = _build(
        tensors=[_tensor("w.weight", [8], Q.F32, 0), _tensor("w.weight", [8], Q.F32, 32)], data=b"\0" * 64
    )
    _expect(write(dup), "'w.weight' appears twice")


def test_invalid_utf8_values_are_kept_as_surrogates(write) -> None:
    p = write(
        _build([_kv("general.architecture", V.STRING, _str("llama")), _kv("t", V.STRING, _str(b"a\xffb"))])
    )
    with GGUFFile.open(p) as f:
        assert f.metadata["t"].encode("utf-8", "surrogateescape") == b"a\xffb"


def test_split_parts_must_agree(tmp_path: Path) -> None:
    def part(i: int, no: int, count: int) -> None:
        kvs = [
            _kv("split.no", V.UINT16, struct.pack("<H", no)),
            _kv("split.count", V.UINT16, struct.pack("<H", count)),
        ]
        (tmp_path / f"m-{i:05d}-of-00002.gguf").write_bytes(_build(kvs))

    part(1, 0, 2)
    part(2, 0, 2)
    _expect(tmp_path / "m-00002-of-00002.gguf", "split.no is 0, expected 1")
    part(2, 1, 3)
    _expect(tmp_path / "m-00001-of-00002.gguf", "split.count is 3", named=tmp_path / "m-00002-of-00002.gguf")
    (tmp_path / "m-00003-of-00002.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="part number 3 of 2"):
        GGUFFile.open(tmp_path / "m-00003-of-00002.gguf")


# ---------------------------------------------------------------------------------------------------------------
# Fuzzing: mutated headers of a small valid file.


def _fuzz_base() -> tuple[bytes, int]:
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "base.gguf"
        w = GGUFWriter(p, arch="llama")
        w.add_block_count(2)
        w.add_float32("llama.rope.freq_base", 10000.0)
        w.add_bool("t.b", True)
        w.add_int64("t.i", -3)
        w.add_string("t.s", "hello")
        w.add_array("t.strs", ["a", "bc", "", "def"])
        w.add_array("t.ints", [1, 2, 3, 4])
        w.add_array("t.floats", [0.5, 1.5])
        w.add_array("t.nested", [[1, 2], [3]])
        w.add_tensor("blk.0.attn_norm.weight", np.ones(8, np.float32))
        w.add_tensor("blk.0.ffn_up.weight", random_blocks(Q.Q8_0, 2, 32, 0), raw_dtype=Q.Q8_0)
        w.add_tensor("blk.1.ffn_up.weight", random_blocks(Q.Q4_K, 1, 256, 0), raw_dtype=Q.Q4_K)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        data = p.read_bytes()
        with GGUFFile.open(p) as f:
            header_end = min(t.offset for t in f.tensors.values())
    return data, header_end


BASE, HEADER_END = _fuzz_base()
_BIG = [
    0,
    1,
    2**8 - 1,
    2**16,
    2**31 - 1,
    2**32 - 1,
    2**32,
    2**40,
    2**62,
    2**63,
    2**64 - 1,
    len(BASE),
    len(BASE) + 1,
]


@st.composite
def _mutations(draw: st.DrawFn) -> bytes:
    data = bytearray(BASE)
    for _ in range(draw(st.integers(1, 6))):
        pos = draw(st.integers(0, HEADER_END - 1))
        kind = draw(st.sampled_from(["flip", "byte", "u64", "u32"]))
        if kind == "flip":
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte":
            data[pos] = draw(st.integers(0, 255))
        else:
            size = 8 if kind == "u64" else 4
            value = draw(st.sampled_from(_BIG) | st.integers(0, 2**64 - 1)) % (1 << (8 * size))
            data[pos : pos + size] = value.to_bytes(size, "little")[: len(data) - pos]
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "fuzz.gguf"


@settings(
    max_examples=1200,
    deadline=timedelta(milliseconds=500),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(data=_mutations())
def test_fuzzed_headers_raise_only_gguf_error(fuzz_path: Path, data: bytes) -> None:
    assert len(BASE) < 2048
    fuzz_path.write_bytes(data)
    tracemalloc.start()
    try:
        try:
            f = GGUFFile.open(fuzz_path)
        except GGUFError as err:
            msg = str(err)
            assert msg.startswith(f"{fuzz_path}: ") and "\n" not in msg
        else:
            with f:
                for info in f.tensors.values():
                    assert 0 <= info.offset and info.offset + info.nbytes <= len(data)
                    assert f.tensor_bytes(info.name).numel() == info.nbytes
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # parse memory stays in the order of the file size (Python objects for at most ~len(data) entries)
    assert peak < 256 * 1024, peak
