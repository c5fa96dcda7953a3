"""The node agent's control messages: msgpack maps with bounded sizes, checked by pydantic models before use.

A request is `{"id": int, "cmd": str, "args": {...}}`; a reply `{"id": int, "ok": true, "result": {...}}` or
`{"id": int, "ok": false, "error": "one line", "code": "not_paired" | "refused" | ...}`. Nothing is unpickled and no
msgpack extension type is accepted; every field has a type, a range and no extra keys.
"""

import re
from typing import Annotated, Any

import msgpack
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

PROTOCOL = 1
DEFAULT_PORT = 7460  # control (CURVE); the identity answer is on DEFAULT_PORT + 1
CHUNK_BYTES = 4 << 20  # one upload chunk
MAX_REQUEST_BYTES = CHUNK_BYTES + (64 << 10)  # the agent's ZMQ_MAXMSGSIZE
MAX_REPLY_BYTES = 32 << 20  # the client's ZMQ_MAXMSGSIZE (log pages, GPU sample pages)
MAX_IDENTITY_BYTES = 512  # the identity socket's ZMQ_MAXMSGSIZE
MAX_WAIT_MS = 30_000  # longest long-poll
SERVICE_TYPE = "_strata-node._tcp.local."

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
HOSTPORT_RE = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.\-]{0,252}):([0-9]{1,5})$")


class WireError(ValueError):
    """A message that does not follow the protocol; `code` says which kind of refusal it is."""

    def __init__(self, message: str, code: str = "bad_request", req_id: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.req_id = req_id  # known when the envelope was valid, so the refusal reaches the caller


def _no_ext(code: int, data: bytes) -> Any:
    raise WireError(f"msgpack extension type {code} is not accepted")


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes, limit: int) -> Any:
    """Decode one message of at most `limit` bytes; strings and containers are bounded by the same limit."""
    if len(data) > limit:
        raise WireError(f"message of {len(data)} bytes is over the limit of {limit}")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_no_ext,
            max_str_len=1 << 20,
            max_bin_len=limit,
            max_array_len=1 << 16,
            max_map_len=1 << 12,
        )
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several types for malformed input
        raise WireError(f"not a msgpack message ({type(exc).__name__})") from None


# ---------------------------------------------------------------------------------------------------------------
# Requests

Name = Annotated[str, StringConstraints(pattern=NAME_RE.pattern)]
Sha256 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
Z85Key = Annotated[str, StringConstraints(min_length=40, max_length=40)]
Mhz = Annotated[int, Field(ge=1, le=100_000)]
MhzRange = Annotated[list[Mhz], Field(min_length=2, max_length=2)]  # [min, max]
Wait = Annotated[int, Field(ge=0, le=MAX_WAIT_MS)]


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Envelope(_Args):
    id: Annotated[int, Field(ge=0, lt=1 << 62)]
    cmd: Annotated[str, StringConstraints(max_length=32)]
    args: dict[str, Any] = Field(default_factory=dict)


class NoArgs(_Args):
    pass


class PairArgs(_Args):
    code: Annotated[str, StringConstraints(max_length=32)]
    main_name: Annotated[str, StringConstraints(max_length=128)] = ""


class SamplesArgs(_Args):
    since: Annotated[int, Field(ge=0)] = 0
    wait_ms: Wait = 0


class UploadBeginArgs(_Args):
    name: Name
    size: Annotated[int, Field(ge=1, lt=1 << 50)]
    sha256: Sha256


class UploadChunkArgs(_Args):
    name: Name
    offset: Annotated[int, Field(ge=0, lt=1 << 50)]
    data: Annotated[bytes, Field(min_length=1, max_length=CHUNK_BYTES)]


class NameArgs(_Args):
    name: Name


class ClockArgs(_Args):
    gpu: Annotated[int, Field(ge=0, le=63)]
    sm: MhzRange | None = None
    mem: MhzRange | None = None


class GpuArgs(_Args):
    gpu: Annotated[int, Field(ge=0, le=63)]


class StartWorkerArgs(_Args):
    model: Name
    begin: Annotated[int, Field(ge=1, le=100_000)]
    end: Annotated[int, Field(ge=2, le=100_000)] | None = None
    next: Annotated[str, StringConstraints(pattern=HOSTPORT_RE.pattern)] | None = None
    next_key: Z85Key | None = None
    port: Annotated[int, Field(ge=0, le=65535)] = 0
    bind: Annotated[str, StringConstraints(max_length=64)] | None = None
    gpu: Annotated[int, Field(ge=0, le=63)] | None = None
    allow_keys: Annotated[list[Z85Key], Field(max_length=8)] = Field(default_factory=list)
    flags: Annotated[list[Annotated[str, StringConstraints(max_length=64)]], Field(max_length=32)] = Field(
        default_factory=list
    )
    lock_clocks: bool = False
    sm: MhzRange | None = None
    mem: MhzRange | None = None
    timing: bool = False
    key_id: Annotated[str, StringConstraints(pattern=r"^k[0-9]{1,6}$")] | None = None


class WorkerArgs(_Args):
    id: Annotated[str, StringConstraints(pattern=r"^w[0-9]{1,6}$")]


class LogsArgs(WorkerArgs):
    since: Annotated[int, Field(ge=0)] = 0
    wait_ms: Wait = 0


# Which commands exist, their argument models, and whether they need a paired main.
COMMANDS: dict[str, tuple[type[_Args], bool]] = {
    "hello": (NoArgs, False),
    "pair": (PairArgs, False),
    "unpair": (NoArgs, True),
    "info": (NoArgs, True),
    "gpu_samples": (SamplesArgs, True),
    "files": (NoArgs, True),
    "upload_begin": (UploadBeginArgs, True),
    "upload_chunk": (UploadChunkArgs, True),
    "upload_end": (NameArgs, True),
    "delete_file": (NameArgs, True),
    "new_key": (NoArgs, True),
    "start_worker": (StartWorkerArgs, True),
    "stop_worker": (WorkerArgs, True),
    "workers": (NoArgs, True),
    "logs": (LogsArgs, True),
    "lock_clocks": (ClockArgs, True),
    "reset_clocks": (GpuArgs, True),
}


def parse_request(data: bytes) -> tuple[Envelope, _Args]:
    """The envelope and its typed arguments, or WireError (the id is unknown when the envelope itself is bad)."""
    raw = unpack(data, MAX_REQUEST_BYTES)
    try:
        env = Envelope.model_validate(raw)
    except ValidationError as exc:
        raise WireError(f"bad request envelope: {_first(exc)}") from None
    spec = COMMANDS.get(env.cmd)
    if spec is None:
        raise WireError(f"unknown command {env.cmd!r}", "unknown_command", env.id)
    try:
        args = spec[0].model_validate(env.args)
    except ValidationError as exc:
        raise WireError(f"bad arguments for {env.cmd}: {_first(exc)}", req_id=env.id) from None
    return env, args


def _first(exc: ValidationError) -> str:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err.get("loc", ())) or "message"
    return f"{where}: {err.get('msg', 'invalid')}"


def ok(req_id: int, result: dict[str, Any]) -> bytes:
    return pack({"id": req_id, "ok": True, "result": result})


def fail(req_id: int | None, error: str, code: str) -> bytes:
    return pack({"id": req_id if req_id is not None else -1, "ok": False, "error": error, "code": code})
