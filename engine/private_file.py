"""Atomic writes of files only this user may read (keys, usage profiles): no third-party imports, so any part
of the engine can use it."""

import os
import tempfile
from pathlib import Path


def write_private_text(path: Path, text: str) -> None:
    """Replace `path` atomically with text readable by this user only (0600 where the OS has modes)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
