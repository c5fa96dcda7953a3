"""Errors as the OpenAI API reports them: an HTTP status and `{"error": {"message", "type", "param", "code"}}`."""

from typing import Any

from pydantic import ValidationError

from engine.serve.protocol import FieldError, error_body

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        param: str | None = None,
        type_: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type_ or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out


_ROLES = ("system", "developer", "user", "assistant", "tool")
_PARTS = ("text", "refusal", "image_url", "input_audio", "file")


def _branch(p: int | str) -> str | None:
    """What a union member in pydantic's `loc` stands for, in a client's words; None when p is a field name."""
    if not isinstance(p, str):
        return None
    if p in ("str", "int", "float", "bool"):
        return {"str": "a string", "int": "an integer", "float": "a number", "bool": "a boolean"}[p]
    if p.startswith("list["):
        return "a list" if p != "list[int]" else "a list of token ids"
    if p.startswith(("function-", "tagged-union[", "union[")) or p[:1].isupper() or p.startswith("_"):
        return "an object"
    return None


def _field_path(loc: tuple[int | str, ...]) -> tuple[str, list[str]]:
    """-> (client-facing field path, union alternatives met on the way)"""
    kept: list[int | str] = []
    alts: list[str] = []
    for i, p in enumerate(loc):
        b = _branch(p)
        if b is not None:
            alts.append(b)
            continue
        prev = loc[i - 1] if i else None
        if isinstance(prev, int) and p in (*_ROLES, *_PARTS):  # the tag of a tagged union
            continue
        kept.append(p)
    return _loc(tuple(kept)), alts


def from_validation(e: ValidationError) -> APIError:
    """The first problem of a request body, as a 400 that names the field."""
    errs = e.errors(include_url=False)
    first = errs[0]
    if first["type"] == "json_invalid":
        msg = first.get("ctx", {}).get("error") or first["msg"]
        return APIError(
            400,
            f"the request body is not valid JSON: {msg}; send a JSON object in UTF-8",
            code="invalid_json",
        )
    top = first["loc"][:1]
    same = [x for x in errs if x["loc"][:1] == top]
    # A wrong type inside a union is reported once per member; a specific error (missing, extra, value) says more.
    specific = [x for x in same if not str(x["type"]).endswith("_type")]
    chosen = specific[0] if specific else first
    param, _ = _field_path(chosen["loc"])
    if chosen["type"] in ("union_tag_invalid", "union_tag_not_found"):
        tag = str(chosen.get("ctx", {}).get("discriminator", "")).strip("'")
        param = f"{param}.{tag}" if param and tag else param
    ctx_err = chosen.get("ctx", {}).get("error")
    if isinstance(ctx_err, FieldError):
        param = ctx_err.param
    msg = str(chosen["msg"]).removeprefix("Value error, ")
    if chosen["type"] == "missing":
        msg = "a required field is missing"
    elif chosen["type"] == "extra_forbidden":
        msg = "this field is not part of the API; remove it"
    elif not specific and len(same) > 1:
        alts = []
        for x in same:
            _, a = _field_path(x["loc"])
            if a and a[-1] not in alts:
                alts.append(a[-1])
        if alts:
            msg = "wrong type: expected " + " or ".join(alts)
    elif chosen["type"] == "model_type" and not param:
        msg = "the request body must be a JSON object"
    where = f"{param}: " if param and not msg.startswith(param) else ""
    return APIError(400, f"{where}{msg}", code=str(chosen["type"]), param=param or None)
