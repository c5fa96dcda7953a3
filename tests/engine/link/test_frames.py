"""The frame decoder: valid frames round-trip; anything else - random bytes, mutated valid frames, lying headers,
pickles - is a FrameError, never a crash or an allocation beyond the agreed size (hypothesis, >= 1,000 cases).
And no way from a socket to pickle: the link's sources never unpickle or evaluate."""

import ast
import pickle
import struct
from pathlib import Path

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.link import protocol as P

LIMITS = P.Limits(max_payload=64 * 16 * 4, width=16, max_tokens=64)
FUZZ = settings(max_examples=1200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _fwd(t: int = 2, dtype: str = "f32", rows: object = None) -> list[bytes]:
    fields = {"s": 1, "e": 2, "q": 3, "p": 0, **P.tensor_fields(dtype, (t, 16))}
    if rows is not None:
        fields["r"] = rows
    return [*P.pack("fwd", fields), b"\x01" * (t * 16 * P.DTYPES[dtype])]


def test_valid_frames_round_trip() -> None:
    m = P.decode(_fwd(3, "bf16"), LIMITS)
    assert (m.kind, m.dtype, m.shape, len(m.payload or b"")) == ("fwd", "bf16", (3, 16), 96)
    hello = P.pack("hello", {"s": 5, "nonce": b"\0" * 16, "info": {"x": 1}})
    assert P.decode(hello, LIMITS).kind == "hello"
    err = P.decode(P.pack("error", {"s": 1, "code": "gap", "msg": "m"}), LIMITS)
    assert err.get("msg") == "m"
    assert P.rows_of(m) == [(0, 0, 3)]  # no rows: the session's first sequence at p
    several = P.decode(_fwd(5, rows=[[2, 40, 1], [0, 7, 3], [5, 0, 1]]), LIMITS)
    assert P.rows_of(several) == [(2, 40, 1), (0, 7, 3), (5, 0, 1)]


@pytest.mark.parametrize(
    ("rows", "msg"),
    [
        ([[0, 0, 1], [1, 0, 2]], "count 3 tokens, the payload has 2"),
        ([[0, 0, 1], [0, 1, 1]], "a slot appears twice"),
        ([[0, 0, 0], [1, 0, 2]], "count must be"),
        ([[64, 0, 2]], "slot must be"),
        ([[0, -1, 2]], "start must be"),
        ([[0, 0]], r"\[slot, start, count\]"),
        ([], "1 to 64"),
        ([[0, 0, 1]] * 65, "not valid msgpack"),  # past msgpack's own limit on arrays
        ("0,0,2", "must be a list"),
    ],
)
def test_bad_rows_say_why(rows: object, msg: str) -> None:
    with pytest.raises(P.FrameError, match=msg):
        P.decode(_fwd(2, rows=rows), LIMITS)


def test_stage_info_slots_are_checked() -> None:
    info = {"arch": "a", "n_layer": 4, "n_embd": 8, "n_head_kv": 1, "head_dim": 8, "n_vocab": 9, "n_expert": 0,
            "begin": 1, "end": 4, "header": "h"}  # fmt: skip
    assert P.StageInfo.from_wire(info).slots == 1
    assert P.StageInfo.from_wire({**info, "slots": 16}).slots == 16
    for bad in (0, P.MAX_SLOTS + 1):
        with pytest.raises(P.FrameError, match="slots is not 1 to 64"):
            P.StageInfo.from_wire({**info, "slots": bad})


@pytest.mark.parametrize(
    ("frames", "msg"),
    [
        ([b"\x93\x01\x02\x03"], "not a map"),
        ([msgpack.packb({"v": 99, "k": "fwd"})], "protocol version 99"),
        ([msgpack.packb({"v": P.VERSION, "k": "exec"})], "unknown message kind"),
        (
            [
                *P.pack("fwd", {"s": 1, "e": 1, "q": 1, "p": 0, "dt": "f64", "sh": [1, 16], "n": 128}),
                b"\0" * 128,
            ],
            "dtype",
        ),
        (
            [
                *P.pack("fwd", {"s": 1, "e": 1, "q": 1, "p": 0, "dt": "f32", "sh": [1, 32], "n": 128}),
                b"\0" * 128,
            ],
            "width 32",
        ),
        (
            [
                *P.pack("fwd", {"s": 1, "e": 1, "q": 1, "p": 0, "dt": "f32", "sh": [1, 16], "n": 99}),
                b"\0" * 64,
            ],
            "header says 99",
        ),
        (
            [
                *P.pack("fwd", {"s": 1, "e": 1, "q": 1, "p": 0, "dt": "f32", "sh": [1, 16], "n": 64}),
                b"\0" * 63,
            ],
            "payload has 63",
        ),
        (
            [*P.pack("fwd", {"s": 1, "e": 1, "q": 1, "p": 0, "dt": "f32", "sh": [10**9, 16], "n": 64}), b""],
            "tokens",
        ),
        (
            [*P.pack("fwd", {"s": 1, "e": 1, "q": 1, "p": 0, "dt": "f32", "sh": [1, 16], "n": 1 << 40}), b""],
            "n must",
        ),
        (
            [
                *P.pack("fwd", {"s": -1, "e": 1, "q": 1, "p": 0, "dt": "f32", "sh": [1, 16], "n": 64}),
                b"\0" * 64,
            ],
            "s must",
        ),
        ([P.pack("busy", {"s": 1})[0], b"extra"], "has no payload"),
        ([b"\xd4\x05\x00"], "not valid msgpack|extension"),
        (
            [msgpack.packb({"v": P.VERSION, "k": "hello", "s": 1, "nonce": b"short", "info": {}})],
            "16-byte nonce",
        ),
        ([b"\x81" + b"\xa1a" * 1 + b"\xc7\x01\x05x"], "extension|not valid"),
        ([b"x" * (P.MAX_HEADER_BYTES + 1)], "over the"),
        ([pickle.dumps({"v": P.VERSION, "k": "hello"})], "not valid msgpack|not a map"),
        ([], "1 or 2 frames"),
    ],
)
def test_bad_frames_say_why(frames: list[bytes], msg: str) -> None:
    with pytest.raises(P.FrameError, match=msg):
        P.decode(frames, LIMITS)


def _check(frames: list[bytes]) -> None:
    try:
        m = P.decode(frames, LIMITS)
    except P.FrameError:
        return
    if m.payload is not None:  # whatever passed is within the agreed bounds
        assert len(m.payload) <= LIMITS.max_payload and m.shape[1] == 16 and m.dtype in P.DTYPES


@FUZZ
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=3))
def test_random_bytes_never_crash(frames: list[bytes]) -> None:
    _check(frames)


@FUZZ
@given(st.data())
def test_mutated_valid_frames_never_crash(data: st.DataObject) -> None:
    frames = _fwd(data.draw(st.integers(1, 4)), data.draw(st.sampled_from(list(P.DTYPES))))
    header = bytearray(frames[0])
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(header) - 1))
        header[i] = data.draw(st.integers(0, 255))
    payload = frames[1][: data.draw(st.integers(0, len(frames[1]) + 8))]
    _check([bytes(header), payload])


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["v", "k", "s", "e", "q", "p", "dt", "sh", "n", "x"]),
        st.one_of(
            st.integers(-(2**63), 2**64 - 1),
            st.text(max_size=8),
            st.binary(max_size=20),
            st.none(),
            st.booleans(),
            st.lists(st.integers(-5, 10**12), max_size=4),
            st.floats(allow_nan=True),
        ),
    ),
    st.binary(max_size=600),
)
def test_lying_headers_never_crash(header: dict, payload: bytes) -> None:  # type: ignore[type-arg]
    header.setdefault("v", 1)
    header.setdefault("k", "fwd")
    _check([msgpack.packb(header), payload])


def test_no_pickle_or_eval_in_the_link() -> None:
    """Nothing in engine/link (nor the stage code it calls) can unpickle or evaluate what it received."""
    banned_calls = {"recv_pyobj", "recv_serialized", "loads", "load", "eval", "exec", "frombuffer_pickle"}
    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "jsonpickle"}
    root = Path(__file__).resolve().parents[3] / "engine" / "link"
    for path in root.glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import | ast.ImportFrom):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not banned_modules & {m.split(".")[0] for m in mods}, f"{path.name} imports {mods}"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                owner = ast.unparse(node.func.value)
                assert name not in banned_calls or owner in ("msgpack",), f"{path.name}: {owner}.{name}"
                assert not (owner == "torch" and name == "load"), f"{path.name}: torch.load"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in ("eval", "exec", "__import__"), f"{path.name}: {node.func.id}"


def test_a_pickle_sent_as_payload_stays_bytes() -> None:
    """A payload is only ever reinterpreted as numbers: a pickle in it is 4-byte floats, never an object."""
    evil = pickle.dumps(struct.pack)  # a global reference: unpickling it would import and look up a callable
    evil = (evil + b"\0" * 64)[:64]
    m = P.decode(
        [*P.pack("fwd", {"s": 1, "e": 1, "q": 1, "p": 0, **P.tensor_fields("f32", (1, 16))}), evil], LIMITS
    )
    assert bytes(m.payload or b"") == evil


@pytest.mark.parametrize("field", ["dt", "k"])
def test_unhashable_header_values_are_refused(field: str) -> None:
    """A list where a name is expected once reached a dict lookup (TypeError); the fuzzer found it."""
    header = msgpack.unpackb(_fwd()[0])
    header[field] = [1, 2]
    with pytest.raises(P.FrameError):
        P.decode([msgpack.packb(header), _fwd()[1]], LIMITS)
    err = {"v": header["v"], "k": "error", "msg": "x", "code": ["bad_frame"]}
    with pytest.raises(P.FrameError, match="known code"):
        P.decode([msgpack.packb(err)], LIMITS)
