"""The agent's model folder: uploads that resume, verified by SHA-256, and never written outside the folder.

A name is a plain file name (`[A-Za-z0-9][A-Za-z0-9._-]*`, no `..`), so a request cannot name a path; the folder is
checked to be a real directory (not a link) and every file is opened with O_NOFOLLOW where the OS has it, refusing
links and hard-linked files. An upload goes to `NAME.part` beside a small `NAME.part.json` (size, sha256); it is
appended strictly in order, hashed as it arrives, and renamed to NAME only when size and hash match. The space is
checked against the free disk (less a reserve) before the first byte is written.
"""

import hashlib
import json
import os
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.node.wire import NAME_RE

PART = ".part"
RESERVE_BYTES = 1 << 30  # keep 1 GiB free for the OS and the worker's logs
STALE_UPLOAD_S = 600.0  # an upload without a chunk for this long no longer holds room on the disk
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_BINARY = getattr(os, "O_BINARY", 0)


class StoreError(ValueError):
    """A refused file operation; the message says what was asked, why it is refused and what to do."""


# Names Windows reserves for devices, whatever the extension ("NUL.gguf" opens the null device there).
_WINDOWS_DEVICES = {
    "CON",
    "PRN",
    "AUX",
    "NUL",
    *(f"COM{i}" for i in range(1, 10)),
    *(f"LPT{i}" for i in range(1, 10)),
}


def check_name(name: str) -> str:
    if (
        not isinstance(name, str)
        or not NAME_RE.match(name)
        or ".." in name
        or name.endswith((PART, ".json"))
        or name.split(".")[0].upper() in _WINDOWS_DEVICES
    ):
        raise StoreError(
            f"file name {name!r} is refused: use a plain file name of letters, digits, '.', '_' and '-' "
            "(no folders, no '..', not ending in .part or .json)"
        )
    return name


@dataclass
class _Upload:
    name: str
    size: int
    sha256: str
    written: int
    hasher: Any  # hashlib sha256 object
    touched: float = 0.0  # time.monotonic() of its last chunk

    @property
    def owed(self) -> int:
        """Bytes still to come, which the disk must keep room for while the upload is alive."""
        return self.size - self.written if time.monotonic() - self.touched < STALE_UPLOAD_S else 0


class ModelStore:
    """Files in one folder; `extra_dirs` are read-only folders the agent's owner named (never the remote side)."""

    def __init__(
        self, root: Path, extra_dirs: tuple[Path, ...] = (), reserve_bytes: int = RESERVE_BYTES
    ) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        st = os.lstat(self.root)
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            raise StoreError(
                f"{self.root} must be a real folder, not a link: point the agent's data dir elsewhere"
            )
        self.root = self.root.resolve()
        self.extra_dirs = tuple(Path(d).resolve() for d in extra_dirs)
        self.reserve = reserve_bytes
        self._uploads: dict[str, _Upload] = {}

    # -- paths ------------------------------------------------------------------------------------------------

    def _path(self, name: str, suffix: str = "") -> Path:
        p = self.root / (check_name(name) + suffix)
        if p.parent != self.root:  # cannot happen after check_name; kept as the last line of defence
            raise StoreError(f"file name {name!r} leaves the model folder")
        return p

    def resolve_model(self, name: str) -> Path:
        """The complete file called `name` in the model folder or an extra folder; StoreError if none."""
        check_name(name)
        for folder in (self.root, *self.extra_dirs):
            p = folder / name
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode) and folder == self.root:
                raise StoreError(
                    f"{name} in the agent's model folder is a link: links are refused; copy the file"
                )
            if stat.S_ISREG(os.stat(p).st_mode):
                return p
        raise StoreError(f"model {name!r} is not on this PC: ship it first (strata-node ship) and try again")

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.root).free

    # -- listing ----------------------------------------------------------------------------------------------

    def files(self) -> list[dict[str, Any]]:
        out = []
        for folder in (self.root, *self.extra_dirs):
            if not folder.is_dir():
                continue
            for p in sorted(folder.iterdir()):
                if p.name.endswith(".json"):
                    continue
                try:
                    st = os.lstat(p)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                partial = p.name.endswith(PART)
                out.append(
                    {
                        "name": p.name[: -len(PART)] if partial else p.name,
                        "size": st.st_size,
                        "complete": not partial,
                        "shipped": folder == self.root,
                    }
                )
        return out

    # -- uploads ----------------------------------------------------------------------------------------------

    def _open(self, path: Path, flags: int) -> int:
        try:
            fd = os.open(path, flags | _NOFOLLOW | _BINARY, 0o600)
        except OSError as exc:
            if os.path.islink(path):
                raise StoreError(f"{path.name} is a link: links are refused in the model folder") from None
            raise StoreError(
                f"cannot open {path.name} ({exc.strerror or exc}): check the model folder"
            ) from None
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
            os.close(fd)
            raise StoreError(
                f"{path.name} is not a plain file of its own (a link or a hard link): remove it from the model folder"
            )
        return fd

    def _check_target_free(self, name: str) -> None:
        for suffix in ("", PART, PART + ".json"):
            p = self._path(name, suffix)
            if os.path.islink(p):
                raise StoreError(f"{p.name} is a link: links are refused in the model folder; remove it")
            if p.exists() and not p.is_file():
                raise StoreError(f"{p.name} exists and is not a file: remove it from the model folder")

    def begin(self, name: str, size: int, sha256: str) -> dict[str, Any]:
        """Start or resume an upload; returns {"offset": bytes already here} (0 for a fresh one)."""
        self._check_target_free(name)
        final, part, meta = self._path(name), self._path(name, PART), self._path(name, PART + ".json")
        if final.exists():
            st = os.stat(final)
            if st.st_size == size and self._done_hash(name) == sha256:
                return {"offset": size, "complete": True}
        offset = 0
        if part.exists():
            try:
                old = json.loads(meta.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                old = None
            if isinstance(old, dict) and old.get("size") == size and old.get("sha256") == sha256:
                offset = min(os.lstat(part).st_size, size)
        need = size - offset
        free = self.free_bytes()
        owed = sum(u.owed for n, u in self._uploads.items() if n != name)  # room promised to other uploads
        if need > free - self.reserve - owed:
            others = f", {_gib(owed)} of it promised to uploads in progress" if owed else ""
            raise StoreError(
                f"{name} needs {_gib(need)} but the disk of the model folder has {_gib(free)} free{others} "
                f"(keeping {_gib(self.reserve)} for the system): free some space or pick a data dir on a bigger disk"
            )
        hasher = hashlib.sha256()
        fd = self._open(part, os.O_RDWR | os.O_CREAT)
        try:
            os.ftruncate(fd, offset)  # drop a tail past the resume point (or all of a stale upload)
            os.lseek(fd, 0, os.SEEK_SET)
            pos = 0
            while pos < offset:  # re-hash what is already here: the hash state did not survive the cut
                block = os.read(fd, min(8 << 20, offset - pos))
                if not block:
                    break
                hasher.update(block)
                pos += len(block)
        finally:
            os.close(fd)
        meta.write_text(json.dumps({"size": size, "sha256": sha256}), encoding="utf-8")
        self._uploads[name] = _Upload(name, size, sha256, offset, hasher, time.monotonic())
        return {"offset": offset, "complete": False}

    def chunk(self, name: str, offset: int, data: bytes) -> dict[str, Any]:
        up = self._uploads.get(check_name(name))
        if up is None:
            raise StoreError(f"no upload of {name} is open: call upload_begin first")
        if offset != up.written:
            raise StoreError(
                f"chunk of {name} at byte {offset}, expected byte {up.written}: resume with upload_begin"
            )
        if offset + len(data) > up.size:
            raise StoreError(
                f"chunk of {name} ends at byte {offset + len(data)}, past its declared size of {up.size} bytes"
            )
        fd = self._open(self._path(name, PART), os.O_WRONLY)
        try:
            if os.fstat(fd).st_size != offset:
                raise StoreError(f"{name}{PART} changed on disk during the upload: start it again")
            os.lseek(fd, offset, os.SEEK_SET)
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
        except OSError as exc:
            os.ftruncate(fd, offset)  # the next upload_begin resumes at the last whole chunk
            raise StoreError(
                f"{name}: writing at byte {offset} failed ({exc.strerror or exc}); the bytes before it are kept: free "
                "some space and ship again to resume"
            ) from None
        finally:
            os.close(fd)
        up.hasher.update(data)
        up.written += len(data)
        up.touched = time.monotonic()
        return {"offset": up.written}

    def end(self, name: str) -> dict[str, Any]:
        up = self._uploads.get(check_name(name))
        if up is None:
            raise StoreError(f"no upload of {name} is open: call upload_begin first")
        if up.written != up.size:
            raise StoreError(f"{name} has {up.written} of {up.size} bytes: send the rest before upload_end")
        digest = up.hasher.hexdigest()
        part, final = self._path(name, PART), self._path(name)
        del self._uploads[name]
        if digest != up.sha256:
            part.unlink(missing_ok=True)
            self._path(name, PART + ".json").unlink(missing_ok=True)
            raise StoreError(
                f"{name} arrived with SHA-256 {digest[:16]}..., expected {up.sha256[:16]}...: the partial file is "
                "deleted; ship it again"
            )
        fd = self._open(part, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(part, final)
        except OSError as exc:
            raise StoreError(
                f"{name} arrived complete but cannot replace the file of that name ({exc.strerror or exc}): stop the "
                "worker that uses it and ship again (the bytes are kept)"
            ) from None
        self._path(name, ".sha256.json").write_text(
            json.dumps({"size": up.size, "sha256": digest}), encoding="utf-8"
        )
        self._path(name, PART + ".json").unlink(missing_ok=True)
        return {"name": name, "size": up.size, "sha256": digest}

    def _done_hash(self, name: str) -> str | None:
        try:
            data = json.loads(self._path(name, ".sha256.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return data.get("sha256") if isinstance(data, dict) else None

    def delete(self, name: str) -> dict[str, Any]:
        self._uploads.pop(check_name(name), None)
        removed = []
        for suffix in ("", PART, PART + ".json", ".sha256.json"):
            p = self._path(name, suffix)
            if os.path.lexists(p):
                p.unlink()
                removed.append(p.name)
        if not removed:
            raise StoreError(f"{name} is not in the agent's model folder")
        return {"removed": removed}


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"
