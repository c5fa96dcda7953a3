"""CURVE keys of the stage link.

- A worker started by hand derives its server key pair, and the one client key it admits, from
  `STRATA_STAGE_TOKEN` (scrypt with a label per role, so the token never crosses the wire and a leaked public key
  says nothing about it); the main process derives the same client key pair and the worker's public key.
- A worker started by its node agent gets a fresh key pair and an allow-list instead: `--stage-key FILE` (a ZeroMQ
  certificate file with the secret key) and `--stage-allow KEY` (a client public key, Z85, or a certificate file;
  repeatable), or the same through `STRATA_STAGE_SECRET_KEY` / `STRATA_STAGE_ALLOW` (comma-separated keys). The
  main process takes the worker's public key with `--remote-stage-key KEY` and its own pair with `--stage-key`.
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

TOKEN_ENV = "STRATA_STAGE_TOKEN"
SECRET_ENV = "STRATA_STAGE_SECRET_KEY"
ALLOW_ENV = "STRATA_STAGE_ALLOW"
MIN_TOKEN_CHARS = 12
_SALT = b"polystrata stage link v1 / "


class LinkKeyError(ValueError):
    """A key, key file or token that cannot be used; the message says which and what to do."""


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 characters
    secret: bytes

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)


@dataclass(frozen=True)
class TokenKeys:
    server: KeyPair  # the worker's
    client: KeyPair  # the main process's (and a relay's towards the next worker)


def fingerprint(public: bytes | str) -> str:
    """The one fingerprint of a CURVE public key (Z85) everywhere a user sees one: pairing screens, the node
    agent, the worker's start line, the link's refusals. `7KQ2-MX4P-A9RT-WZ3B`: 80 bits of its SHA-256 in base32
    (letters and digits that read aloud), four groups of four."""
    raw = z85.decode(public.encode("ascii") if isinstance(public, str) else public)
    if len(raw) != 32:
        raise LinkKeyError(f"a CURVE public key decodes to 32 bytes, not {len(raw)}")
    text = base64.b32encode(hashlib.sha256(raw).digest()[:10]).decode("ascii")  # 80 bits, 16 characters
    return "-".join(text[i : i + 4] for i in range(0, 16, 4))


def _pair_from_secret(secret32: bytes) -> KeyPair:
    secret = z85.encode(secret32)
    return KeyPair(zmq.curve_public(secret), secret)


def token_keys(token: str) -> TokenKeys:
    """The worker's and the main's key pairs from the shared token (scrypt: slow to guess, same on every PC)."""
    if len(token) < MIN_TOKEN_CHARS:
        raise LinkKeyError(
            f"{TOKEN_ENV} has {len(token)} characters: use at least {MIN_TOKEN_CHARS} random ones (e.g. the output "
            'of `python -c "import secrets; print(secrets.token_urlsafe(24))"`), the same on every PC'
        )
    raw = token.encode("utf-8")

    def derive(role: bytes) -> KeyPair:
        return _pair_from_secret(hashlib.scrypt(raw, salt=_SALT + role, n=1 << 14, r=8, p=1, dklen=32))

    return TokenKeys(server=derive(b"server"), client=derive(b"client"))


def is_z85_key(text: str | bytes) -> bool:
    t = text.encode() if isinstance(text, str) else text
    if len(t) != 40:
        return False
    try:
        return len(z85.decode(t)) == 32
    except (ValueError, KeyError, IndexError, TypeError):
        return False


def load_keypair(path: str | Path) -> KeyPair:
    """A key pair from a ZeroMQ certificate file holding the secret key (`zmq.auth.create_certificates`)."""
    p = Path(path)
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (OSError, ValueError) as e:
        raise LinkKeyError(f"key file {p} cannot be read as a ZeroMQ certificate: {e}") from None
    if secret is None:
        raise LinkKeyError(
            f"key file {p} holds only a public key; give the file with the secret key (.key_secret)"
        )
    return KeyPair(public, secret)


def parse_public(text: str) -> bytes:
    """A public key given as 40 Z85 characters or as a certificate file."""
    t = text.strip()
    if is_z85_key(t):
        return t.encode()
    p = Path(t)
    if p.is_file():
        try:
            public, _ = zmq.auth.load_certificate(p)
        except (OSError, ValueError) as e:
            raise LinkKeyError(f"key file {p} cannot be read as a ZeroMQ certificate: {e}") from None
        return public
    raise LinkKeyError(f"{t[:60]!r} is neither a 40-character Z85 public key nor a key file")


def write_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """A fresh key pair as ZeroMQ certificate files (`name.key`, `name.key_secret`, the secret readable by its owner only)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(d, name)
    os.chmod(secret_file, 0o600)
    return Path(public_file), Path(secret_file)


@dataclass(frozen=True)
class ServerKeys:
    """What a listening stage needs: its own pair and the client keys it admits."""

    pair: KeyPair
    allow: frozenset[bytes]
    source: str  # "token" or "key files", for the log


@dataclass(frozen=True)
class ClientKeys:
    """What a connecting stage needs: its own pair and the server's public key."""

    pair: KeyPair
    server: bytes
    source: str


def server_keys(
    key_file: str | None, allow: Iterable[str], env: Mapping[str, str] | None = None
) -> ServerKeys:
    """The worker's keys: a key file and an allow-list (the agent's way), else the token (by hand)."""
    env = os.environ if env is None else env
    allowed = [parse_public(a) for a in allow]
    allowed += [parse_public(a) for a in env.get(ALLOW_ENV, "").split(",") if a.strip()]
    key_file = key_file or None
    if key_file is None and env.get(SECRET_ENV):
        secret = env[SECRET_ENV].strip().encode()
        if not is_z85_key(secret):
            raise LinkKeyError(f"{SECRET_ENV} is not a 40-character Z85 secret key")
        pair = KeyPair(zmq.curve_public(secret), secret)
    elif key_file is not None:
        pair = load_keypair(key_file)
    else:
        pair = None  # type: ignore[assignment]
    if pair is not None:
        if not allowed:
            raise LinkKeyError(
                "the worker has its own key but admits no client: give the main process's public key with "
                f"--stage-allow KEY (or {ALLOW_ENV})"
            )
        return ServerKeys(pair, frozenset(allowed), "key files")
    token = env.get(TOKEN_ENV)
    if not token:
        raise LinkKeyError(
            f"no key for the stage link: set {TOKEN_ENV} to the same secret on both PCs (a worker started by hand), "
            "or give --stage-key FILE and --stage-allow KEY (a worker started by its node agent)"
        )
    tk = token_keys(token)
    return ServerKeys(tk.server, frozenset([tk.client.public, *allowed]), "token")


def client_keys(
    key_file: str | None, server_public: str | None, env: Mapping[str, str] | None = None
) -> ClientKeys:
    """The keys of the side that connects (the main process, or a relay towards the next worker)."""
    env = os.environ if env is None else env
    if server_public:
        server = parse_public(server_public)
        if key_file:
            return ClientKeys(load_keypair(key_file), server, "key files")
        token = env.get(TOKEN_ENV)
        if token:
            return ClientKeys(token_keys(token).client, server, "token")
        raise LinkKeyError(
            "--remote-stage-key names the worker's key, but this side has none of its own: give --stage-key FILE "
            f"(its public key must be on the worker's allow-list) or set {TOKEN_ENV}"
        )
    token = env.get(TOKEN_ENV)
    if not token:
        raise LinkKeyError(
            f"no key for the stage link: set {TOKEN_ENV} to the worker's secret, or give the worker's public key "
            "with --remote-stage-key KEY and this side's key with --stage-key FILE"
        )
    tk = token_keys(token)
    pair = load_keypair(key_file) if key_file else tk.client
    return ClientKeys(pair, tk.server.public, "token")
