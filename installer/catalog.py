"""The model catalog (`resources/catalog.json`): models, their variants and files, and what a user can name instead
(a file on this PC, or a Hugging Face repo and file).

`geometry()` turns an entry into the `ModelGeometry` of the fit estimate: the expert bytes from the model's
dimensions and the file's bits per weight, the rest of the file split between embeddings, head and layers by their
share of the parameters. It is an estimate; the engine fills the exact geometry from the GGUF later.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from installer.gpus import GpuInfo
from installer.recommend import ModelGeometry, PcFit, pc_fit
from resources import resource_path

CATALOG_FILE = "catalog.json"
ARCHITECTURES = (
    "qwen3moe",
    "qwen2moe",
    "llama",
    "qwen2",
    "qwen3",
    "gemma3",
    "gpt-oss",
    "qwen3next",
    "glm4moe",
    "deepseek2",
)
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_SHA = re.compile(r"^[0-9a-f]{64}$")


class CatalogError(ValueError):
    """The catalog file is malformed, or a model name is not in it."""


@dataclass(frozen=True)
class CatalogFile:
    path: str
    """Path inside the Hugging Face repo (may include a folder, as in multi-part uploads)."""
    size_bytes: int | None
    sha256: str | None

    @property
    def name(self) -> str:
        return self.path.rsplit("/", 1)[-1]


@dataclass(frozen=True)
class CatalogEntry:
    id: str
    display_name: str
    family: str
    quant: str
    hf_repo: str
    files: tuple[CatalogFile, ...]
    size_bytes: int
    size_exact: bool
    architecture: str
    layers: int
    experts: int
    experts_used: int
    context: int
    geometry_facts: dict[str, Any]
    expert_bpw: float | None = None
    package: str | None = None
    """A Python package that ships this file (the embedded test model): installed, not downloaded."""

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def main_file(self) -> CatalogFile:
        """The file to pass as --model (the first part of a multi-part GGUF)."""
        return self.files[0]


def _require(
    d: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str, errors: list[str]
) -> Any:
    if key not in d:
        errors.append(f"{where}: missing key {key!r}")
        return None
    value = d[key]
    bad_bool = isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))
    if not isinstance(value, kind) or bad_bool:
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        errors.append(f"{where}: {key!r} must be {name}, got {value!r}")
        return None
    return value


def validate_catalog(data: Any) -> list[str]:
    """Every problem of a catalog document, one line each; empty when it is valid."""
    errors: list[str] = []
    if not isinstance(data, dict) or not isinstance(data.get("models"), list):
        return ["the catalog must be an object with a list 'models'"]
    seen: set[str] = set()
    for mi, model in enumerate(data["models"]):
        where = f"models[{mi}]"
        if not isinstance(model, dict):
            errors.append(f"{where}: must be an object")
            continue
        family = _require(model, "family", str, where, errors)
        where = f"model {family or mi}"
        _require(model, "display_name", str, where, errors)
        arch = _require(model, "architecture", str, where, errors)
        if arch is not None and arch not in ARCHITECTURES:
            errors.append(f"{where}: architecture {arch!r} is not one of {', '.join(ARCHITECTURES)}")
        layers = _require(model, "layers", int, where, errors)
        experts = _require(model, "experts", int, where, errors)
        used = _require(model, "experts_used", int, where, errors)
        context = _require(model, "context", int, where, errors)
        if isinstance(layers, int) and layers < 1:
            errors.append(f"{where}: layers must be at least 1")
        if (
            isinstance(experts, int)
            and isinstance(used, int)
            and (used < 0 or used > experts or (experts and not used))
        ):
            errors.append(
                f"{where}: experts_used {used} must be between 1 and experts {experts} (0 for dense)"
            )
        if isinstance(context, int) and context < 1:
            errors.append(f"{where}: context must be positive")
        geo = _require(model, "geometry", dict, where, errors)
        if geo is not None:
            for key in ("hidden_size", "expert_ffn", "kv_heads", "head_dim", "vocab", "params_total"):
                v = _require(geo, key, int, f"{where} geometry", errors)
                if isinstance(v, int) and v < 0:
                    errors.append(f"{where} geometry: {key} must not be negative")
            if isinstance(experts, int) and experts and not geo.get("expert_ffn"):
                errors.append(f"{where} geometry: a MoE model needs expert_ffn > 0")
        variants = _require(model, "variants", list, where, errors) or []
        if not variants:
            errors.append(f"{where}: needs at least one variant")
        for vi, var in enumerate(variants):
            vwhere = f"{where} variants[{vi}]"
            if not isinstance(var, dict):
                errors.append(f"{vwhere}: must be an object")
                continue
            vid = _require(var, "id", str, vwhere, errors)
            if vid is not None:
                vwhere = f"variant {vid}"
                if vid in seen:
                    errors.append(f"{vwhere}: id used twice")
                seen.add(vid)
                if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", vid):
                    errors.append(f"{vwhere}: id must be lowercase letters, digits, '.', '_' or '-'")
            _require(var, "quant", str, vwhere, errors)
            repo = _require(var, "hf_repo", str, vwhere, errors)
            if repo is not None and not re.fullmatch(r"[\w.-]+/[\w.-]+", repo):
                errors.append(f"{vwhere}: hf_repo {repo!r} must look like owner/name")
            total = _require(var, "size_bytes", int, vwhere, errors)
            _require(var, "size_exact", bool, vwhere, errors)
            bpw = var.get("expert_bpw")
            if bpw is not None and (
                not isinstance(bpw, int | float) or isinstance(bpw, bool) or not 1 <= bpw <= 32
            ):
                errors.append(f"{vwhere}: expert_bpw must be a number of bits between 1 and 32")
            files = _require(var, "files", list, vwhere, errors) or []
            if not files:
                errors.append(f"{vwhere}: needs at least one file")
            _validate_files(files, total, bool(var.get("size_exact")), vwhere, errors)
    return errors


def _validate_files(files: list[Any], total: Any, exact: bool, where: str, errors: list[str]) -> None:
    sizes: list[int] = []
    for fi, f in enumerate(files):
        fwhere = f"{where} files[{fi}]"
        if not isinstance(f, dict):
            errors.append(f"{fwhere}: must be an object")
            continue
        path = _require(f, "path", str, fwhere, errors)
        if path is not None and (
            not path.endswith(".gguf") or path.startswith("/") or ".." in path.split("/")
        ):
            errors.append(f"{fwhere}: path {path!r} must be a relative .gguf path inside the repo")
        size = f.get("size_bytes", "missing")
        if size == "missing":
            errors.append(f"{fwhere}: missing key 'size_bytes' (null when unknown)")
        elif size is not None and (not isinstance(size, int) or isinstance(size, bool) or size <= 0):
            errors.append(f"{fwhere}: size_bytes must be a positive integer or null")
        elif isinstance(size, int):
            sizes.append(size)
        sha = f.get("sha256", "missing")
        if sha == "missing":
            errors.append(f"{fwhere}: missing key 'sha256' (null when unknown)")
        elif sha is not None and not (isinstance(sha, str) and _SHA.match(sha)):
            errors.append(f"{fwhere}: sha256 must be 64 lowercase hex digits or null")
    paths = [f.get("path", "") for f in files if isinstance(f, dict)]
    shards = [_SHARD.search(p) for p in paths]
    if len(paths) > 1 or any(shards):
        n = len(paths)
        for k, (p, m) in enumerate(zip(paths, shards, strict=True), 1):
            if not m or int(m.group(1)) != k or int(m.group(2)) != n:
                errors.append(f"{where}: multi-part file {p!r} must be named -{k:05d}-of-{n:05d}.gguf")
    if isinstance(total, int) and len(sizes) == len(files) and sizes and exact and sum(sizes) != total:
        errors.append(f"{where}: size_bytes {total} is not the sum of its files ({sum(sizes)})")


class Catalog:
    def __init__(self, entries: Sequence[CatalogEntry], source: str = CATALOG_FILE) -> None:
        self.entries = tuple(entries)
        self.source = source
        self._by_id = {e.id: e for e in self.entries}

    def __iter__(self) -> Iterator[CatalogEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def ids(self) -> list[str]:
        return [e.id for e in self.entries]

    def get(self, model_id: str) -> CatalogEntry:
        key = model_id.strip().lower()
        if key in self._by_id:
            return self._by_id[key]
        near = [i for i in self._by_id if key and key in i]
        hint = f" Did you mean: {', '.join(near[:5])}?" if near else " See `strata-setup --list-models`."
        raise CatalogError(f"model {model_id!r} is not in the catalog ({self.source}).{hint}")


def load_catalog(path: str | Path | None = None) -> Catalog:
    """The bundled catalog, or another file in the same format. CatalogError lists every problem."""
    src = Path(path) if path is not None else resource_path(CATALOG_FILE)
    try:
        data = json.loads(src.read_text(encoding="utf-8"))
    except OSError as exc:
        raise CatalogError(f"cannot read the model catalog {src}: {exc.strerror or exc}") from exc
    except json.JSONDecodeError as exc:
        raise CatalogError(f"the model catalog {src} is not valid JSON: {exc}") from exc
    errors = validate_catalog(data)
    if errors:
        raise CatalogError(f"the model catalog {src} is invalid: " + "; ".join(errors))
    entries = []
    for model in data["models"]:
        for var in model["variants"]:
            entries.append(
                CatalogEntry(
                    id=var["id"],
                    display_name=f"{model['display_name']} {var['quant']}",
                    family=model["family"],
                    quant=var["quant"],
                    hf_repo=var["hf_repo"],
                    files=tuple(CatalogFile(f["path"], f["size_bytes"], f["sha256"]) for f in var["files"]),
                    size_bytes=var["size_bytes"],
                    size_exact=var["size_exact"],
                    architecture=model["architecture"],
                    layers=model["layers"],
                    experts=model["experts"],
                    experts_used=model["experts_used"],
                    context=model["context"],
                    geometry_facts=dict(model["geometry"]),
                    expert_bpw=var.get("expert_bpw"),
                    package=var.get("package"),
                )
            )
    return Catalog(entries, str(src))


def geometry(entry: CatalogEntry) -> ModelGeometry:
    """The fit-estimate geometry of a catalog entry (an estimate from its file size and dimensions)."""
    g = entry.geometry_facts
    hidden, vocab, total_params = g["hidden_size"], g["vocab"], g["params_total"]
    first_dense = g.get("first_dense_layers", 0)
    nextn = g.get("nextn_layers", 0)
    file_bytes = entry.size_bytes
    bpw = entry.expert_bpw if entry.expert_bpw is not None else file_bytes * 8.0 / total_params
    expert_params = 3 * hidden * g["expert_ffn"]
    moe_layers = (
        (entry.layers - first_dense + nextn) if entry.experts else 0
    )  # the NextN layer has experts too
    expert_bytes = round(expert_params * bpw / 8.0) if entry.experts else 0
    experts_file_bytes = expert_bytes * entry.experts * moe_layers
    dense_file_bytes = max(file_bytes - experts_file_bytes, 0)
    dense_params = max(total_params - expert_params * entry.experts * moe_layers, 1)
    table = vocab * hidden
    emb_bytes = round(dense_file_bytes * table / dense_params)
    tied = bool(g.get("tied_embeddings", False))
    head_bytes = emb_bytes if tied else round(dense_file_bytes * table / dense_params)
    stored_tables = emb_bytes if tied else emb_bytes + head_bytes
    per_layer = max(dense_file_bytes - stored_tables, 0) // (entry.layers + nextn)
    # The draft (NextN) layer sits whole on the last card: its dense part and its routed experts.
    draft = (per_layer + expert_bytes * entry.experts) * nextn
    return ModelGeometry(
        layers=entry.layers,
        experts=entry.experts,
        experts_used=entry.experts_used,
        expert_bytes=expert_bytes,
        dense_bytes_per_layer=per_layer,
        kv_bytes_per_token_layer=2 * g["kv_heads"] * g["head_dim"] * 2,
        head_bytes=head_bytes,
        embedding_bytes=0 if tied else emb_bytes,
        first_dense_layers=first_dense,
        full_attention_interval=g.get("full_attention_interval", 1),
        sliding_window=g.get("sliding_window", 0),
        sliding_window_pattern=g.get("sliding_window_pattern", 0),
        recurrent_state_bytes=g.get("recurrent_state_bytes", 0),
        draft_bytes=draft,
    )


# ---------------------------------------------------------------------------------------------------------------
# What a user can name with --model


@dataclass(frozen=True)
class LocalModel:
    path: Path


@dataclass(frozen=True)
class HubModel:
    """`owner/repo:path/file.gguf`; a first part `-00001-of-0000N` brings its other parts."""

    repo: str
    files: tuple[str, ...]


ModelRef = CatalogEntry | LocalModel | HubModel


def resolve_model(text: str, catalog: Catalog) -> ModelRef:
    """A catalog id, an existing .gguf file on this PC, or `owner/repo:file.gguf` on the Hugging Face hub."""
    value = text.strip()
    path = Path(value).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return LocalModel(path.resolve())
    hub = re.fullmatch(r"([\w.-]+/[\w.-]+):(\S+\.gguf)", value)
    if hub:
        repo, file = hub.group(1), hub.group(2)
        m = _SHARD.search(file)
        if m and int(m.group(1)) == 1:
            n = int(m.group(2))
            stem = file[: m.start()]
            return HubModel(repo, tuple(f"{stem}-{k:05d}-of-{n:05d}.gguf" for k in range(1, n + 1)))
        return HubModel(repo, (file,))
    if path.suffix.lower() == ".gguf":
        raise CatalogError(f"model file {path} does not exist: check the path, or give a catalog id")
    return catalog.get(value)


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def install_from_package(entry: CatalogEntry, dest_dir: Path) -> Path:
    """Write a package-shipped model (installer.default_model's embedded ones) into dest_dir, checking its
    sha256."""
    from installer.default_model import EMBEDDED, DefaultModelMissing

    embedded = EMBEDDED.get(entry.package or "")
    if embedded is None:
        raise CatalogError(f"model {entry.id} is not shipped in a Python package; download it instead")
    target = Path(dest_dir) / entry.main_file.name
    if target.is_file() and sha256_file(target) == embedded.sha256:
        return target
    try:
        return embedded.write(target)
    except DefaultModelMissing as exc:
        raise CatalogError(str(exc)) from exc


def fits_here(
    entries: Sequence[CatalogEntry],
    gpus: Sequence[GpuInfo],
    ram_bytes: int,
    context: int,
    kv: str = "bf16",
    disk_free: int | None = None,
    downloaded: Callable[[CatalogEntry], bool] = lambda e: False,
) -> list[tuple[CatalogEntry, PcFit]]:
    """Each entry with its fit on this PC (recommend.pc_fit at min(its context, `context`); the free disk counts
    for those not yet downloaded), those that fit first, each group in the catalog's order: the first one offered
    fits this PC."""
    rows = []
    for e in entries:
        free = None if downloaded(e) else disk_free
        rows.append(
            (e, pc_fit(geometry(e), e.size_bytes, gpus, ram_bytes, min(e.context, context), kv, free))
        )
    return sorted(rows, key=lambda row: not row[1].fits)
