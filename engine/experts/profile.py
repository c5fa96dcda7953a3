"""The usage profile of a model file: how often each (layer, expert) pair was selected, saved in the data dir and
read at start to fill the expert caches hottest-first and to weigh the layer split.

One JSON file per model file, `profiles/<digest>.json` under the data dir (`$STRATA_PROFILE_DIR` overrides the
folder), where the digest is the link's header fingerprint (`engine.link.remote.header_digest`): metadata and
tensor table, so another file with the same geometry is told apart. A file that cannot be read, is of another
format version, belongs to another model or holds counts that are not non-negative integers is ignored with one
warning; it is never trusted. Saving adds the new counts to those already in a valid file and replaces the file
atomically (temporary file, then rename)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.gguf.digest import header_digest
from engine.private_file import write_private_text
from installer.paths import data_dir

if TYPE_CHECKING:
    from engine.gguf.model_config import ModelConfig
    from engine.gguf.reader import GGUFFile

log = logging.getLogger("strata.engine")

FORMAT = "polystrata-expert-profile"
VERSION = 1
PROFILE_DIR_ENV = "STRATA_PROFILE_DIR"
MAX_FILE_BYTES = (
    64 << 20
)  # far above any real profile (61 layers x 256 experts is ~200 KB): refuse to read more
_MAX_COUNT = 2**62  # room to add two counts in int64


class ProfileError(ValueError):
    """Why a profile file cannot be used (the loader turns it into a warning)."""


@dataclass(frozen=True)
class ModelIdentity:
    """What a profile belongs to."""

    arch: str
    n_layer: int
    n_expert: int
    digest: str  # engine.link.remote.header_digest of the model file

    @classmethod
    def of(cls, gf: GGUFFile, cfg: ModelConfig) -> ModelIdentity:
        return cls(cfg.arch, cfg.n_layer, cfg.n_expert, header_digest(gf))

    def to_json(self) -> dict[str, Any]:
        return {
            "architecture": self.arch,
            "n_layer": self.n_layer,
            "n_expert": self.n_expert,
            "digest": self.digest,
        }


@dataclass(frozen=True)
class UsageProfile:
    identity: ModelIdentity
    counts: np.ndarray  # int64 [n_layer, n_expert]: selections of each (layer, expert) pair
    tokens: int  # tokens the model read while counting

    def __post_init__(self) -> None:
        want = (self.identity.n_layer, self.identity.n_expert)
        if self.counts.shape != want:
            raise ValueError(f"profile counts have shape {self.counts.shape}, the model {want}")

    @property
    def used(self) -> int:
        """(layer, expert) pairs selected at least once."""
        return int(np.count_nonzero(self.counts))

    @property
    def pairs(self) -> int:
        """(layer, expert) pairs of the layers that were counted (a dense layer, or a remote stage's, has none)."""
        rows = np.count_nonzero(self.counts.sum(1)) or self.identity.n_layer
        return int(rows) * self.identity.n_expert

    def merged(self, other: UsageProfile) -> UsageProfile:
        if other.identity != self.identity:
            raise ValueError("profiles of two different models cannot be merged")
        return UsageProfile(self.identity, self.counts + other.counts, self.tokens + other.tokens)

    def summary(self) -> str:
        return f"{self.tokens} tokens, {self.used} of {self.pairs} experts used"


def profiles_dir() -> Path:
    """The folder of the saved profiles: `$STRATA_PROFILE_DIR`, else `profiles/` in the data dir."""
    env = os.environ.get(PROFILE_DIR_ENV)
    if env:
        return Path(env)

    return data_dir() / "profiles"


def default_profile_path(identity: ModelIdentity) -> Path:
    return profiles_dir() / f"{identity.digest}.json"


def profile_location(
    gf: GGUFFile, cfg: ModelConfig, explicit: str | Path | None = None
) -> tuple[Path, ModelIdentity]:
    """Where the profile of this model file lives (`explicit`, else the data dir's), and the model's identity."""
    ident = ModelIdentity.of(gf, cfg)
    return (Path(explicit) if explicit else default_profile_path(ident)), ident


def startup_profile(
    gf: GGUFFile, cfg: ModelConfig, explicit: str | Path | None = None
) -> UsageProfile | None:
    """The profile to fill the caches and weigh the split with, and the start-up log line that says which."""
    path, ident = profile_location(gf, cfg, explicit)
    prof = load_profile(path, ident)
    if prof is not None:
        log.info("expert profile: %s (%d tokens)", path, prof.tokens)
    elif not path.exists():
        log.info("expert profile: none yet for this file (%s)", path)
    return prof


def model_counts(model: object) -> np.ndarray | None:
    """A model's (or a split's) selection counts since load as int64 [n_layer, n_expert] on the host."""
    c = getattr(model, "expert_counts", None)
    return None if c is None else c.detach().cpu().numpy().astype(np.int64)


def tokens_from_counts(counts: np.ndarray, k: int) -> int:
    """Tokens read by the model, from its selection counts [n_layer, n_expert]: each token adds k to every MoE
    layer it passes (layers that are not counted here, e.g. a remote stage's, stay 0)."""
    if k <= 0 or counts.size == 0:
        return 0
    return int(counts.sum(1).max()) // k


# ---------------------------------------------------------------------------------------------------------------
# Reading


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProfileError(f"{what} is {value!r}, not an integer")
    if not 0 <= value < _MAX_COUNT:
        raise ProfileError(f"{what} is {value}, outside 0..2^62")
    return value


def parse_profile(data: bytes, identity: ModelIdentity) -> UsageProfile:
    """A profile file's bytes checked against the model it is meant for (ProfileError says what is wrong)."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ProfileError("it is not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ProfileError(f"it is not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ProfileError(f'it is not an expert profile (no "format": "{FORMAT}")')
    if doc.get("version") != VERSION:
        raise ProfileError(
            f"it is format version {doc.get('version')!r}, this engine reads version {VERSION}"
        )
    model = doc.get("model")
    if not isinstance(model, dict):
        raise ProfileError('it has no "model" object')
    theirs = {k: model.get(k) for k in ("architecture", "n_layer", "n_expert", "digest")}
    ours = identity.to_json()
    if theirs["digest"] != ours["digest"]:
        shown = str(theirs["digest"])[:16]
        raise ProfileError(
            f"it belongs to another model file (digest {shown}..., this file {identity.digest[:16]}...)"
        )
    if theirs != ours:
        raise ProfileError(f"its model {theirs} differs from this file's {ours}")
    tokens = _int(doc.get("tokens"), '"tokens"')
    rows = doc.get("counts")
    if not isinstance(rows, list) or len(rows) != identity.n_layer:
        n = len(rows) if isinstance(rows, list) else "no"
        raise ProfileError(f'"counts" has {n} rows, the model {identity.n_layer} layers')
    out = np.zeros((identity.n_layer, identity.n_expert), dtype=np.int64)  # [L, E]
    for i, row in enumerate(rows):
        if not isinstance(row, list) or len(row) != identity.n_expert:
            n = len(row) if isinstance(row, list) else "no"
            raise ProfileError(f'"counts" row {i} has {n} entries, the model {identity.n_expert} experts')
        out[i] = [_int(v, f'"counts"[{i}]') for v in row]
    return UsageProfile(identity, out, tokens)


def load_profile(path: str | Path, identity: ModelIdentity) -> UsageProfile | None:
    """The profile at `path` for the model `identity`, or None: silently when there is no file, with one warning
    saying why when the file is there but cannot be used. Never raises on the file's content."""
    path = Path(path)
    try:
        return _read(path, identity)
    except FileNotFoundError:
        return None
    except (OSError, ProfileError) as e:
        log.warning("expert profile %s is ignored: %s", path, _why(e))
        return None


def _read(path: Path, identity: ModelIdentity) -> UsageProfile:
    with path.open("rb") as f:
        data = f.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise ProfileError(f"it is larger than {MAX_FILE_BYTES >> 20} MiB, far more than a profile")
    return parse_profile(data, identity)


def _why(e: Exception) -> str:
    if isinstance(e, ProfileError):
        return str(e)
    return f"it cannot be read ({getattr(e, 'strerror', None) or e})"


# ---------------------------------------------------------------------------------------------------------------
# Writing


def dumps(profile: UsageProfile) -> str:
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "model": profile.identity.to_json(),
        "tokens": profile.tokens,
        "saved": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "counts": profile.counts.tolist(),
    }
    return json.dumps(doc, separators=(",", ":"))


def save_profile(path: str | Path, new: UsageProfile) -> UsageProfile:
    """Add `new` to the valid profile at `path` (if any) and write the sum atomically; -> what was written.
    A file there that cannot be used is kept beside it as `<name>.bad` (with a warning) and replaced."""
    path = Path(path)
    total = new
    try:
        total = _read(path, new.identity).merged(new)
    except FileNotFoundError:
        pass
    except (OSError, ProfileError) as e:
        bad = path.with_name(path.name + ".bad")
        log.warning(
            "expert profile %s cannot be added to: %s; it is kept as %s and a new one written",
            path,
            _why(e),
            bad.name,
        )
        try:
            os.replace(path, bad)
        except OSError as err:
            log.warning("could not move %s aside (%s): it is overwritten", path, err.strerror or err)
    write_private_text(path, dumps(total))  # atomic: temporary file, fsync, rename
    return total


class ProfileRecorder:
    """Saves what a running model adds to its selection counts into its profile file: `tick()` after each request
    (saves once `every_s` seconds have passed since the last save; 0: every time), `save()` at shutdown."""

    def __init__(
        self,
        path: Path,
        identity: ModelIdentity,
        k: int,
        counts: Callable[[], np.ndarray | None],
        every_s: float = 300.0,
    ) -> None:
        self.path, self.identity, self.k, self.every_s = path, identity, k, every_s
        self._counts = counts
        self._lock = threading.Lock()
        now = counts()
        self._base = np.zeros((identity.n_layer, identity.n_expert), np.int64) if now is None else now.copy()
        self._last = time.monotonic()
        self.saves = 0

    def tick(self) -> None:
        if time.monotonic() - self._last >= self.every_s:
            self.save()

    def save(self) -> UsageProfile | None:
        """Merge the counts gathered since the last save into the file; None when there is nothing new."""
        with self._lock:
            self._last = time.monotonic()
            now = self._counts()
            if now is None:
                return None
            delta = now - self._base  # [L, E]
            if not delta.any():
                return None
            try:
                total = save_profile(
                    self.path, UsageProfile(self.identity, delta, tokens_from_counts(delta, self.k))
                )
            except OSError as e:  # a full disk or a read-only folder must not stop the server
                log.warning("could not save the expert profile %s: %s", self.path, e.strerror or e)
                return None
            self._base = now
            self.saves += 1
            log.info("expert profile saved: %s (%s)", self.path, total.summary())
            return total
