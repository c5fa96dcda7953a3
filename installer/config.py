"""`strata-<model>.json`: the choices setup remembers (seed 002 keys), validated on write and on read.

```json
{"model": "/models/Qwen3-30B-A3B-Instruct-2507-Q4_K_M.gguf", "gpu": [0, 2], "layer_split": "auto",
 "gpu_order": "auto", "args": ["--spec", "4"], "workers": [], "max_context": 32768, "kv": "bf16"}
```

The folder is platformdirs' user config dir for "PolyStrata", or `$STRATA_CONFIG_DIR` where set. Every error
names the file, the key, what was found, what is expected and an example.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from installer import paths

APP_NAME = paths.APP_NAME
CONFIG_DIR_ENV = "STRATA_CONFIG_DIR"
KV_TYPES = ("bf16", "int8", "q4_0")
GPU_ORDERS = ("auto", "as_given")
KEYS = (
    "model",
    "gpu",
    "layer_split",
    "gpu_order",
    "split_skip_if_fits",
    "args",
    "workers",
    "max_context",
    "kv",
)
WORKER_KEYS = ("host", "port", "begin", "end")
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-:\[\]%]*[A-Za-z0-9\]])?$")


class ConfigError(ValueError):
    """A config file or value that cannot be used; the message says what is wrong and how to fix it."""


LayerSplit = Literal["auto"] | tuple[int, ...]


@dataclass(frozen=True)
class Worker:
    """A remote stage: layers [begin, end) on host:port."""

    host: str
    port: int
    begin: int
    end: int

    def to_dict(self) -> dict[str, Any]:
        return {"host": self.host, "port": self.port, "begin": self.begin, "end": self.end}


@dataclass(frozen=True)
class StrataConfig:
    model: str
    gpu: tuple[int, ...] = ()
    layer_split: LayerSplit = "auto"
    gpu_order: Literal["auto", "as_given"] = "auto"
    args: tuple[str, ...] = ()
    workers: tuple[Worker, ...] = field(default=())
    max_context: int | None = None
    kv: Literal["bf16", "int8", "q4_0"] | None = None
    split_skip_if_fits: bool = False
    """With "layer_split": "auto": run on the first card alone when it holds everything (seed 002, opt-in)."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "gpu": list(self.gpu),
            "layer_split": self.layer_split if self.layer_split == "auto" else list(self.layer_split),
            "gpu_order": self.gpu_order,
            "args": list(self.args),
            "workers": [w.to_dict() for w in self.workers],
        }
        if self.max_context is not None:
            out["max_context"] = self.max_context
        if self.kv is not None:
            out["kv"] = self.kv
        if self.split_skip_if_fits:
            out["split_skip_if_fits"] = True
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "the config", layers: int | None = None) -> StrataConfig:
        return parse_config(data, source, layers)

    def validate(self, source: str = "the config", layers: int | None = None) -> StrataConfig:
        """Re-check every rule (a config built in code goes through the same checks as one read from disk)."""
        return parse_config(self.to_dict(), source, layers)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_layer_split(
    value: Any, source: str = "the config", n_gpus: int | None = None, layers: int | None = None
) -> LayerSplit:
    """`"auto"`, `"24,36"` or `[24, 36]`: the first layer of each card after the first, rising."""
    where = f'"layer_split" in {source}'
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == "auto":
            return "auto"
        parts = [p.strip() for p in text.split(",")]
        if not text or not all(re.fullmatch(r"\d+", p) for p in parts):
            raise ConfigError(
                f'{where} is {value!r}: expected "auto" or the first layer of each later card, e.g. "24,36" or [24, 36]'
            )
        nums = [int(p) for p in parts]
    elif isinstance(value, list | tuple) and value and all(_is_int(v) for v in value):
        nums = list(value)
    else:
        raise ConfigError(
            f'{where} is {value!r}: expected "auto" or the first layer of each later card, e.g. "24,36" or [24, 36]'
        )
    if any(n < 1 for n in nums):
        raise ConfigError(
            f"{where} is {value!r}: layer numbers start at 1 (layer 0 is always on the first card)"
        )
    for a, b in itertools.pairwise(nums):
        if b <= a:
            raise ConfigError(
                f"{where} is {value!r}: the numbers must rise, one per card after the first (each is the first "
                f"layer of the next card, not a count of layers), e.g. {sorted(set(nums))}"
            )
    if n_gpus is not None and n_gpus > 0 and len(nums) != n_gpus - 1:
        raise ConfigError(
            f'{where} has {len(nums)} number(s) for {n_gpus} card(s) in "gpu": give {n_gpus - 1} (the first layer '
            'of each card after the first) or use "auto"'
        )
    if layers is not None and nums[-1] >= layers:
        raise ConfigError(
            f"{where} is {value!r}: the model has {layers} layers (0-{layers - 1}); every number must be below {layers}"
        )
    return tuple(nums)


def parse_config(data: Any, source: str = "the config", layers: int | None = None) -> StrataConfig:
    """A `StrataConfig` from parsed JSON; ConfigError with the first problem otherwise. Never raises anything else."""
    if not isinstance(data, Mapping):
        raise ConfigError(
            f'{source} must hold a JSON object like {{"model": "...", "gpu": [0]}}, found {type(data).__name__}'
        )
    unknown = [k for k in data if k not in KEYS]
    if unknown:
        raise ConfigError(f"{source} has unknown key {unknown[0]!r}: the keys are {', '.join(KEYS)}")
    model = data.get("model")
    if not isinstance(model, str) or not model.strip():
        raise ConfigError(
            f'{source} needs "model": the path of the .gguf file (or its first part), e.g. "model": "/models/x.gguf"'
        )
    gpu_raw = data.get("gpu", [])
    if _is_int(gpu_raw):
        gpu_raw = [gpu_raw]
    if not isinstance(gpu_raw, list | tuple) or not all(_is_int(g) for g in gpu_raw):
        raise ConfigError(
            f'"gpu" in {source} is {gpu_raw!r}: expected a list of card numbers as nvidia-smi numbers them, e.g. [0, 2]'
        )
    gpus = tuple(gpu_raw)
    if any(g < 0 for g in gpus):
        raise ConfigError(f'"gpu" in {source} is {list(gpus)}: card numbers start at 0')
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f'"gpu" in {source} is {list(gpus)}: a card is named twice; name each card once')
    split = parse_layer_split(data.get("layer_split", "auto"), source, len(gpus) if gpus else None, layers)
    if split != "auto" and not gpus:
        raise ConfigError(
            f'"layer_split" in {source} is set but "gpu" is empty: name the cards, e.g. "gpu": [0, 1]'
        )
    order = data.get("gpu_order", "auto")
    if order not in GPU_ORDERS:
        raise ConfigError(
            f'"gpu_order" in {source} is {order!r}: expected "auto" (faster card last) or "as_given"'
        )
    args = data.get("args", [])
    if not isinstance(args, list | tuple) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f'"args" in {source} is {args!r}: expected a list of strings, e.g. ["--spec", "4"]')
    workers = _parse_workers(data.get("workers", []), source, layers)
    max_context = data.get("max_context")
    if max_context is not None and (not _is_int(max_context) or max_context < 1):
        raise ConfigError(
            f'"max_context" in {source} is {max_context!r}: expected a positive number of tokens, e.g. 32768'
        )
    kv = data.get("kv")
    if kv is not None and kv not in KV_TYPES:
        raise ConfigError(f'"kv" in {source} is {kv!r}: expected one of {", ".join(KV_TYPES)}')
    skip = data.get("split_skip_if_fits", False)
    if not isinstance(skip, bool):
        raise ConfigError(f'"split_skip_if_fits" in {source} is {skip!r}: expected true or false')
    if skip and split != "auto":
        raise ConfigError(
            f'"split_skip_if_fits" in {source} works with "layer_split": "auto" only (it decides whether to split); '
            'set "layer_split" to "auto" or remove "split_skip_if_fits"'
        )
    return StrataConfig(
        model=model,
        gpu=gpus,
        layer_split=split,
        gpu_order=order,
        args=tuple(args),
        workers=workers,
        max_context=max_context,
        kv=kv,
        split_skip_if_fits=skip,
    )


def _parse_workers(raw: Any, source: str, layers: int | None) -> tuple[Worker, ...]:
    example = '[{"host": "192.168.1.20", "port": 7070, "begin": 24, "end": 48}]'
    if not isinstance(raw, list | tuple):
        raise ConfigError(f'"workers" in {source} is {raw!r}: expected a list like {example}')
    out: list[Worker] = []
    for i, w in enumerate(raw):
        where = f'"workers"[{i}] in {source}'
        if not isinstance(w, Mapping):
            raise ConfigError(f"{where} is {w!r}: expected an object like {example[1:-1]}")
        extra = [k for k in w if k not in WORKER_KEYS]
        missing = [k for k in WORKER_KEYS if k not in w]
        if extra or missing:
            what = f"unknown key {extra[0]!r}" if extra else f"missing key {missing[0]!r}"
            raise ConfigError(f"{where} has {what}: a worker has exactly host, port, begin and end")
        host, port, begin, end = w["host"], w["port"], w["begin"], w["end"]
        if not isinstance(host, str) or not _HOST.match(host):
            raise ConfigError(f"{where}: host {host!r} is not a host name or IP address")
        if not _is_int(port) or not 1 <= port <= 65535:
            raise ConfigError(f"{where}: port {port!r} must be a number between 1 and 65535")
        if not _is_int(begin) or not _is_int(end) or begin < 1 or end <= begin:
            raise ConfigError(
                f"{where}: begin {begin!r} and end {end!r} must be layer numbers with 1 <= begin < end "
                "(the worker runs layers begin to end-1; the main PC always runs layer 0)"
            )
        if layers is not None and end > layers:
            raise ConfigError(f"{where}: end {end} is past the model's {layers} layers")
        if out and begin != out[-1].end:
            raise ConfigError(
                f"{where}: begin {begin} must equal the previous worker's end {out[-1].end} (the stages are contiguous)"
            )
        out.append(Worker(host, port, begin, end))
    return tuple(out)


# ---------------------------------------------------------------------------------------------------------------
# Files


def config_dir() -> Path:
    """platformdirs' user config dir for "PolyStrata", or $STRATA_CONFIG_DIR (see installer.paths)."""
    return paths.config_dir()


def config_name(model: str) -> str:
    """`strata-<model>.json` for a catalog id or a model file path (the stem, without a -00001-of-0000N part)."""
    stem = Path(model).name
    stem = re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", stem)
    slug = re.sub(r"[^a-z0-9._-]+", "-", stem.lower()).strip("-.") or "model"
    return f"strata-{slug}.json"


def config_path(model: str, directory: Path | None = None) -> Path:
    return (directory or config_dir()) / config_name(model)


def list_configs(directory: Path | None = None) -> list[Path]:
    folder = directory or config_dir()
    return sorted(folder.glob("strata-*.json")) if folder.is_dir() else []


def check_writable(cfg: StrataConfig, path: Path) -> StrataConfig:
    """The config as write_config would write it to `path`, checked without writing it: ConfigError for what it
    refuses (its "args" as the engine's option parser reads them), OSError where the folder cannot be made or
    written."""
    from installer.engine_options import OptionsError, check_args

    cfg = cfg.validate(path.name)
    try:
        check_args(cfg.args, "serve", path.name)
    except OptionsError as e:
        raise ConfigError(str(e)) from None
    path.parent.mkdir(parents=True, exist_ok=True)
    if not os.access(path.parent, os.W_OK):
        raise OSError(f"{path.parent} is not writable")
    return cfg


def write_config(cfg: StrataConfig, path: Path | None = None) -> Path:
    """check_writable, then replace the file atomically (a crash never leaves half a config)."""
    target = path or config_path(cfg.model)
    cfg = check_writable(cfg, target)
    fd, tmp = tempfile.mkstemp(prefix=target.name + ".", suffix=".tmp", dir=target.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(cfg.to_dict(), fh, indent=2)
            fh.write("\n")
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return target


DEFAULT_FILE = "default-config.txt"  # names the config of the model this PC serves when nothing else is said


def set_default_config(path: Path, directory: Path | None = None) -> Path:
    """Make `path` the configured model's config (strata-setup, once the model is in place): what `strata
    --headless` and `./start.sh --headless` serve, and the app uses where its own settings name none."""
    folder = directory or config_dir()
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / DEFAULT_FILE
    marker.write_text(str(Path(path).resolve()) + "\n", encoding="utf-8")
    return marker


def default_config(directory: Path | None = None) -> Path | None:
    """The configured model's config (set_default_config), None where none is set or its file is gone."""
    try:
        text = ((directory or config_dir()) / DEFAULT_FILE).read_text(encoding="utf-8").strip()
    except OSError:
        return None
    return Path(text) if text and Path(text).is_file() else None


def read_config(path: Path, layers: int | None = None) -> StrataConfig:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError as exc:
        raise ConfigError(f"config {path} does not exist: run strata-setup to create it") from exc
    except OSError as exc:
        raise ConfigError(f"config {path} cannot be read: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            f"{Path(path).name} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}); fix it or "
            "run strata-setup again"
        ) from exc
    return parse_config(data, Path(path).name, layers)
