"""The models on this PC: the GGUF files in the models folder (and any other file the settings name), each with its
size, architecture, quantization and catalog entry; deleting one removes all its parts.

A file the catalog knows (by its file name) is described from the catalog. Another is read with gguf's reader,
which parses the whole metadata (a 0.5 GB file's tokenizer took 6.6 s on two cores), so what it finds is kept in
an index (`library-index.json` in the data folder, not among the models: keyed by path, size and modification
time)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from installer.catalog import Catalog, CatalogEntry

_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
INDEX = "library-index.json"


@dataclass(frozen=True)
class ModelFile:
    path: Path
    """The file to serve (a split model's first part)."""
    parts: tuple[Path, ...]
    size: int
    """All parts together, in bytes."""
    name: str
    architecture: str
    quant: str
    catalog_id: str | None = None


def parts_of(path: Path) -> tuple[Path, ...]:
    """A split model's parts that are here (from its first part), or the file alone."""
    m = _SPLIT.match(path.name)
    if not m:
        return (path,)
    count = int(m.group("count"))
    names = [path.with_name(f"{m.group('stem')}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    return tuple(p for p in names if p.exists())


def find(folders: Iterable[Path], extra: Iterable[Path] = ()) -> list[Path]:
    """The GGUF files under `folders` (a split model once, by its first part) and the `extra` files that exist, in
    name order, once each."""
    found: dict[Path, None] = {}
    for folder in folders:
        if not folder.is_dir():
            continue
        for p in sorted(folder.rglob("*.gguf")):
            m = _SPLIT.match(p.name)
            if p.is_file() and (m is None or int(m.group("no")) == 1):
                found[p.resolve()] = None
    for p in extra:
        if p.is_file():
            found[p.resolve()] = None
    return sorted(found, key=lambda p: p.name.lower())


def describe(path: Path, catalog: Catalog, index: dict[str, dict]) -> ModelFile:
    """What `path` holds: from the catalog where it knows the file's name, else from the index, else read (and
    added to `index`)."""
    parts = parts_of(path)
    size = sum(p.stat().st_size for p in parts)
    entry = next((e for e in catalog if e.main_file.name.rsplit("/", 1)[-1] == path.name), None)
    if entry is not None:
        return ModelFile(path, parts, size, entry.display_name, entry.architecture, entry.quant, entry.id)
    key = f"{path}|{size}|{path.stat().st_mtime_ns}"
    got = index.get(key)
    if got is None:
        got = _read(path)
        index[key] = got
    return ModelFile(path, parts, size, got["name"], got["architecture"], got["quant"])


def _read(path: Path) -> dict[str, str]:
    """Name, architecture and quantization from a GGUF's metadata (gguf's reader); "?" where it cannot tell."""
    import gguf

    try:
        reader = gguf.GGUFReader(path, "r")
    except (OSError, ValueError) as e:
        return {"name": path.stem, "architecture": "?", "quant": f"unreadable ({e})"[:60]}

    def value(key: str) -> object:
        field = reader.fields.get(key)
        return field.contents() if field is not None else None

    ft = value("general.file_type")
    try:
        quant = gguf.LlamaFileType(ft).name.removeprefix("MOSTLY_") if isinstance(ft, int) else "?"
    except ValueError:
        quant = "?"
    return {
        "name": str(value("general.name") or path.stem),
        "architecture": str(value("general.architecture") or "?"),
        "quant": quant,
    }


def scan(
    folders: Sequence[Path], catalog: Catalog, extra: Iterable[Path] = (), index_path: Path | None = None
) -> list[ModelFile]:
    """Every model on this PC, described (describe); what files were read gives is kept at `index_path`."""
    try:
        index = json.loads(index_path.read_text()) if index_path is not None and index_path.exists() else {}
    except (OSError, ValueError):
        index = {}
    before = dict(index)
    models = [describe(p, catalog, index) for p in find(folders, extra)]
    if index_path is not None and index != before:
        try:
            index_path.write_text(json.dumps(index, indent=1) + "\n")
        except OSError:
            pass  # the next scan reads those files again
    return models


def delete(model: ModelFile) -> list[Path]:
    """Remove every part of `model` (and its folder, if that leaves it empty) -> the files removed."""
    gone = []
    for p in model.parts:
        p.unlink(missing_ok=True)
        gone.append(p)
    folder = model.path.parent
    try:
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
    except OSError:
        pass
    return gone


def catalog_entry(model: ModelFile, catalog: Catalog) -> CatalogEntry | None:
    return next((e for e in catalog if e.id == model.catalog_id), None) if model.catalog_id else None
