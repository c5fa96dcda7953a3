"""The stage link's messages: a small msgpack header, and for hidden states one frame of raw bytes.

Everything here is checked before anything is allocated: the header frame's size, msgpack's own limits (no ext
types, short strings and arrays), the kind, every field's type and range, and for a payload its dtype (from an
allow-list), shape and exact byte count against the limits the handshake agreed. Nothing received is unpickled or
evaluated. No torch here: a payload stays bytes until the stage turns it into a tensor.

Kinds (client = the stage before, server = the stage after):
  hello   client -> server   protocol version, what the client expects the server to run (`StageInfo`), a nonce
  welcome server -> client   the server's `StageInfo` (and those of the stages it relays to), the epoch
  fwd     client -> server   hidden state [T, D] at positions start..start+T (session, epoch, seq); with several
                             sequences (slots), `r` lists each one's rows in order: [slot, start, count]
  busy    server -> client   keep-alive while a request is computed or relayed
  out     server -> client   the hidden state after the server's layers (and the stages after it), per-stage timing
  error   server -> client   what went wrong, naming the stage and, for a mismatch, both sides' values
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field
from typing import Any

import msgpack

VERSION = 1
MAX_HEADER_BYTES = 16 * 1024
KINDS = ("hello", "welcome", "fwd", "busy", "out", "error")
DTYPES: dict[str, int] = {"f32": 4, "bf16": 2, "f16": 2}  # hidden states only: bytes per value
ERROR_CODES = ("mismatch", "stale", "gap", "bad_frame", "busy", "internal", "unreachable", "refused")
_U64 = (1 << 64) - 1
MAX_SLOTS = 64  # sequences one session may hold (and rows entries one fwd may carry)


class FrameError(ValueError):
    """A message that is not a valid frame of this protocol (it is dropped; the sender gets at most an error)."""


@dataclass(frozen=True)
class Limits:
    """What a receiver accepts: the largest payload and the hidden width it agreed to."""

    max_payload: int
    width: int | None = None  # D, once known
    max_tokens: int | None = None


@dataclass(frozen=True)
class StageInfo:
    """What a stage runs, compared at the handshake. `header` is the digest of the model file's header (metadata and
    tensor table); `data` a digest of samples of this stage's own tensors (empty where not computed)."""

    arch: str
    n_layer: int
    n_embd: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_expert: int
    begin: int
    end: int
    header: str
    data: str = ""
    kv: str = "f32"
    max_ctx: int = 4096
    max_tokens: int = 4096
    address: str = ""  # where the stage listens (filled by the server for the messages)
    slots: int = 1  # sequences whose KV the stage keeps (hello: asked for; welcome: what the session holds)

    def to_wire(self) -> dict[str, Any]:
        d = asdict(self)
        if d["slots"] == 1:  # left out: a stage of a version before slots refuses fields it does not know
            del d["slots"]
        return d

    @classmethod
    def from_wire(cls, raw: Any, what: str = "stage info") -> StageInfo:
        if not isinstance(raw, Mapping):
            raise FrameError(f"{what} is not a map")
        fields_ = cls.__dataclass_fields__
        extra = [k for k in raw if k not in fields_]
        if extra:
            raise FrameError(f"{what} has unknown field {str(extra[0])[:40]!r}")
        out: dict[str, Any] = {}
        for name, f in fields_.items():
            if name not in raw:
                if f.default is MISSING:
                    raise FrameError(f"{what} lacks {name!r}")
                continue
            v = raw[name]
            if f.type == "int":
                _int(v, f"{what}.{name}", 0, 1 << 40)
            elif not isinstance(v, str) or len(v) > 256:
                raise FrameError(f"{what}.{name} must be a short string")
            out[name] = v
        info = cls(**out)
        if not 1 <= info.slots <= MAX_SLOTS:
            raise FrameError(f"{what}: {info.slots} slots is not 1 to {MAX_SLOTS}")
        if not 0 <= info.begin < info.end <= info.n_layer:
            raise FrameError(
                f"{what}: layers {info.begin}-{info.end} are not a range of {info.n_layer} layers"
            )
        return info

    @property
    def layers_text(self) -> str:
        return f"{self.begin}-{self.end - 1}"


@dataclass(frozen=True)
class Message:
    kind: str
    header: dict[str, Any]
    payload: memoryview | bytes | None = None
    dtype: str | None = None
    shape: tuple[int, ...] = field(default=())

    def get(self, key: str, default: Any = None) -> Any:
        return self.header.get(key, default)


def _int(v: Any, what: str, lo: int = 0, hi: int = _U64) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise FrameError(f"{what} must be an integer in {lo}..{hi}")
    return v


def _ext_refused(code: int, data: bytes) -> Any:
    raise FrameError("msgpack extension types are not accepted")


def pack(kind: str, fields: Mapping[str, Any], payload: bytes | memoryview | None = None) -> list[Any]:
    """The frames of one message: [header] or [header, payload]."""
    header = {"v": VERSION, "k": kind, **fields}
    data = msgpack.packb(header, use_bin_type=True)
    if len(data) > MAX_HEADER_BYTES:
        raise FrameError(f"a {kind} header of {len(data)} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    return [data] if payload is None else [data, payload]


def tensor_fields(dtype: str, shape: Sequence[int]) -> dict[str, Any]:
    n = math.prod(shape) * DTYPES[dtype]
    return {"dt": dtype, "sh": list(shape), "n": n}


def _unpack_header(raw: bytes | memoryview) -> dict[str, Any]:
    if len(raw) > MAX_HEADER_BYTES:
        raise FrameError(f"header of {len(raw)} bytes is over the {MAX_HEADER_BYTES}-byte limit")
    try:
        h = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            ext_hook=_ext_refused,
            max_str_len=4096,
            max_bin_len=64,
            max_array_len=64,
            max_map_len=64,
            max_ext_len=0,
        )
    except FrameError:
        raise
    except Exception as e:  # msgpack's own errors: ExtraData, FormatError, StackError, ValueError, ...
        raise FrameError(f"header is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(h, dict):
        raise FrameError("header is not a map")
    if any(not isinstance(k, str) for k in h):
        raise FrameError("header keys must be strings")
    return h


def decode(frames: Sequence[bytes | memoryview], limits: Limits) -> Message:
    """Frames as received (without a ROUTER's identity frame) -> a checked `Message`; FrameError otherwise."""
    if not 1 <= len(frames) <= 2:
        raise FrameError(f"a message has 1 or 2 frames, not {len(frames)}")
    h = _unpack_header(frames[0])
    v = h.get("v")
    if v != VERSION:
        raise FrameError(f"protocol version {str(v)[:20]} (this side speaks {VERSION})")
    kind = h.get("k")
    if (
        not isinstance(kind, str) or kind not in KINDS
    ):  # an unhashable value must not reach the membership test
        raise FrameError(f"unknown message kind {str(kind)[:20]!r}")
    for key in ("s", "e", "q", "p"):
        if key in h:
            _int(h[key], key)
    has_payload = kind in ("fwd", "out")
    if has_payload != (len(frames) == 2):
        raise FrameError(f"a {kind} message {'needs' if has_payload else 'has no'} payload frame")
    if kind in ("hello", "welcome") and "info" not in h:
        raise FrameError(f"a {kind} message needs info")
    if kind == "hello":
        _int(h.get("s"), "session")
        nonce = h.get("nonce")
        if not isinstance(nonce, bytes) or len(nonce) != 16:
            raise FrameError("hello needs a 16-byte nonce")
    if kind == "error":
        code = h.get("code")
        if not isinstance(h.get("msg"), str) or not isinstance(code, str) or code not in ERROR_CODES:
            raise FrameError("an error needs a message and a known code")
    if not has_payload:
        return Message(kind, h)
    for key in ("s", "e", "q"):
        if key not in h:
            raise FrameError(f"a {kind} message needs {key!r}")
    if kind == "fwd" and "p" not in h:
        raise FrameError("a fwd message needs its start position 'p'")
    dtype = h.get("dt")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise FrameError(f"dtype {str(dtype)[:20]!r} is not one of {', '.join(DTYPES)}")
    shape = h.get("sh")
    if not isinstance(shape, list) or len(shape) != 2:
        raise FrameError("shape must be [tokens, width]")
    t = _int(shape[0], "tokens", 1, limits.max_tokens or (1 << 31))
    d = _int(shape[1], "width", 1, 1 << 20)
    if limits.width is not None and d != limits.width:
        raise FrameError(f"width {d}, the handshake agreed {limits.width}")
    n = _int(h.get("n"), "n", 0, limits.max_payload)
    if n != t * d * DTYPES[dtype]:
        raise FrameError(f"header says {n} bytes, shape {t}x{d} {dtype} is {t * d * DTYPES[dtype]}")
    payload = frames[1]
    if len(payload) != n:
        raise FrameError(f"payload has {len(payload)} bytes, the header says {n}")
    if kind == "fwd" and "r" in h:
        _rows(h["r"], t)
    return Message(kind, h, payload, dtype, (t, d))


def _rows(raw: Any, tokens: int) -> list[tuple[int, int, int]]:
    """A fwd's `r`: [[slot, start, count], ...], each slot once, the counts adding up to the payload's rows."""
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_SLOTS:
        raise FrameError(f"rows must be a list of 1 to {MAX_SLOTS} [slot, start, count]")
    out: list[tuple[int, int, int]] = []
    for r in raw:
        if not isinstance(r, list) or len(r) != 3:
            raise FrameError("each row entry must be [slot, start, count]")
        out.append(
            (_int(r[0], "slot", 0, MAX_SLOTS - 1), _int(r[1], "start"), _int(r[2], "count", 1, tokens))
        )
    if len({r[0] for r in out}) != len(out):
        raise FrameError("a slot appears twice in one request's rows")
    if sum(r[2] for r in out) != tokens:
        raise FrameError(f"the rows count {sum(r[2] for r in out)} tokens, the payload has {tokens}")
    return out


def rows_of(msg: Message) -> list[tuple[int, int, int]]:
    """A checked fwd's rows: its `r`, or the one sequence (slot 0) at its `p`."""
    raw = msg.get("r")
    return [(0, int(msg.get("p")), msg.shape[0])] if raw is None else [(a, b, c) for a, b, c in raw]
