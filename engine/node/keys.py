"""CURVE key pairs, their short fingerprints, one-time pairing codes and the files that keep them.

A key pair is kept as z85 text (`zmq.curve_keypair`); the fingerprint a user compares is the first 80 bits of the
SHA-256 of the raw 32-byte public key, in base32 groups (`7KQ2-MX4P-A9RT-WZ3B`). Secret keys are written with mode
0600 and replaced atomically, so a crash never leaves half a key.
"""

import hmac
import json
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.utils.z85

from engine.link.keys import fingerprint as link_fingerprint
from engine.node.errors import NodeCliError
from engine.private_file import write_private_text

# Pairing codes avoid characters that read alike (0/O, 1/I/L).
CODE_ALPHABET = "23456789ABCDEFGHJKMNPQRSTUVWXYZ"
CODE_LENGTH = 8


class KeyFileError(NodeCliError, ValueError):
    """A key file or key text that cannot be used; the message names the file and what to do."""


@dataclass(frozen=True)
class KeyPair:
    public: str  # z85, 40 characters
    secret: str

    @classmethod
    def generate(cls) -> "KeyPair":
        if not zmq.has("curve"):
            raise KeyFileError(
                "this pyzmq build has no CURVE support (zmq.has('curve') is False): reinstall pyzmq from its wheels"
            )
        pub, sec = zmq.curve_keypair()
        return cls(pub.decode("ascii"), sec.decode("ascii"))

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.public)


def check_key(text: Any, what: str = "key") -> str:
    """A z85 CURVE public key (40 characters decoding to 32 bytes), or ValueError naming what is wrong."""
    if not isinstance(text, str) or len(text) != 40:
        raise ValueError(f"{what} must be a 40-character z85 CURVE key")
    try:
        raw = zmq.utils.z85.decode(text.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError):
        raise ValueError(f"{what} is not valid z85 text") from None
    if len(raw) != 32:
        raise ValueError(f"{what} does not decode to 32 bytes")
    return text


def fingerprint(public_key: str) -> str:
    """What a user compares between the two screens when pairing: the link's one fingerprint format
    (engine.link.keys.fingerprint) of a checked key."""
    return link_fingerprint(check_key(public_key))


def normalize_fingerprint(text: str) -> str:
    clean = "".join(ch for ch in text.upper() if ch.isalnum())
    return "-".join(clean[i : i + 4] for i in range(0, len(clean), 4))


def new_pairing_code() -> str:
    raw = "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))
    return f"{raw[:4]}-{raw[4:]}"


def normalize_code(text: str) -> str:
    return "".join(ch for ch in text.upper() if ch.isalnum())


def codes_equal(expected: str, given: str) -> bool:
    """Constant-time comparison of two pairing codes, ignoring case, dashes and spaces."""
    return hmac.compare_digest(normalize_code(expected).encode(), normalize_code(given).encode())


# ---------------------------------------------------------------------------------------------------------------
# Files


def write_certificate(path: Path, keys: KeyPair, note: str = "PolyStrata key") -> Path:
    """The pair as a ZeroMQ certificate file (`zmq.auth.load_certificate` reads it), readable by this user only."""
    write_private_text(
        path,
        f"#   {note} (ZeroMQ CURVE certificate); keep it secret\n"
        "metadata\n"
        "curve\n"
        f'    public-key = "{keys.public}"\n'
        f'    secret-key = "{keys.secret}"\n',
    )
    return path


def write_private_json(path: Path, data: Any) -> None:
    write_private_text(path, json.dumps(data, indent=2) + "\n")


def read_json(path: Path) -> Any:
    """The parsed file, None when it does not exist; KeyFileError naming the file when it cannot be used."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KeyFileError(f"{path} cannot be read ({exc.strerror or exc}): check its permissions") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise KeyFileError(
            f"{path} is not valid JSON (line {exc.lineno}: {exc.msg}): delete it to start over"
        ) from None


def load_or_create_keypair(path: Path) -> KeyPair:
    """The key pair kept in `path`, created on first use."""
    data = read_json(path)
    if data is None:
        pair = KeyPair.generate()
        write_private_json(path, {"public": pair.public, "secret": pair.secret})
        return pair
    try:
        pub = check_key(data.get("public") if isinstance(data, dict) else None, "public key")
        sec = check_key(data.get("secret"), "secret key")
    except ValueError as exc:
        raise KeyFileError(
            f"{path}: {exc}; delete the file to make a new key (pair again afterwards)"
        ) from None
    if zmq.curve_public(sec.encode("ascii")).decode("ascii") != pub:
        raise KeyFileError(
            f"{path}: the public key does not belong to the secret key; delete the file to make a new key"
        )
    return KeyPair(pub, sec)
