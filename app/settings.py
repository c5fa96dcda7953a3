"""The app's own settings (engine launch options, chat defaults), one JSON file in the platformdirs config dir.

Model choice for a split (GPUs, layer split, args) lives in the installer's `strata-<model>.json` configs; this file
only holds what the desktop app needs to start and talk to the engine.
"""

import json
import os
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from installer.engine_options import SAMPLING, OptionsError, check_args
from installer.paths import config_dir

SETTINGS_FILE = "app-settings.json"
DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True)
class Sampling:
    """Chat sampling settings sent with each request (OpenAI names; top_k and min_p as llama.cpp extends them)."""

    temperature: float = SAMPLING.temperature
    top_p: float = SAMPLING.top_p
    top_k: int = SAMPLING.top_k
    min_p: float = SAMPLING.min_p
    max_tokens: int = 1024
    seed: int | None = None

    def request_fields(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "max_tokens": self.max_tokens,
        }
        if self.seed is not None:
            out["seed"] = self.seed
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Sampling":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class AppSettings:
    model: str = ""
    """GGUF file to serve; empty: the config's model, else the engine's embedded default model."""
    config: str = ""
    """A strata-<model>.json written by setup (model, cards, layer split, args); empty: none."""
    device: str = "auto"
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str = ""
    max_context: int = 0
    """Tokens of context; 0: the config's, else the engine's default."""
    extra_args: tuple[str, ...] = ()
    autostart_engine: bool = True
    system_prompt: str = ""
    sampling: Sampling = field(default_factory=Sampling)
    wizard_done: bool = False

    @property
    def api_url(self) -> str:
        """The OpenAI base URL other programs use (`.../v1`)."""
        return f"{self.base_url}/v1"

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    def serve_args(self) -> list[str]:
        """Arguments after `strata-engine serve`."""
        args = ["--host", self.host, "--port", str(self.port)]
        if self.max_context:
            args += ["--max-context", str(self.max_context)]
        if self.config:
            args += ["--config", self.config]
        if self.model:
            args += ["--model", self.model]
        if self.device != "auto":
            args += ["--device", self.device]
        return args + list(self.extra_args)  # the API key goes in the environment (engine_env): not in `ps`

    def engine_env(self) -> dict[str, str]:
        """Environment for the engine process: the API key, which on the command line would show in `ps`."""
        return {"STRATA_API_KEY": self.api_key} if self.api_key else {}

    def validate(self) -> list[str]:
        """What is wrong, one line each, with what to do; empty when the settings can be used."""
        problems = []
        if self.device not in DEVICES:
            problems.append(
                f"device {self.device!r} is not one of {', '.join(DEVICES)}: choose one in Settings"
            )
        if not 1 <= self.port <= 65535:
            problems.append(f"port {self.port} is outside 1-65535: choose another in Settings")
        if self.max_context and self.max_context < 16:
            problems.append(f"context {self.max_context} is too small: give at least 16 tokens in Settings")
        if self.config and not Path(self.config).is_file():
            problems.append(
                f"the config {self.config} does not exist: run the setup wizard again or clear it in Settings"
            )
        if self.model and not Path(self.model).is_file():
            problems.append(
                f"the model file {self.model} does not exist: choose another in Settings or run the setup wizard"
            )
        try:
            check_args(self.extra_args, "serve", "the extra engine arguments")
        except OptionsError as e:
            problems.append(f"{e}; correct them in Settings")
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.api_key:
            problems.append(
                f"the API binds {self.host}, reachable from other PCs, but has no API key: set one in Settings"
            )
        return problems

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["extra_args"] = list(self.extra_args)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "AppSettings":
        known = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in known}
        if isinstance(kwargs.get("sampling"), dict):
            kwargs["sampling"] = Sampling.from_dict(kwargs["sampling"])
        if "extra_args" in kwargs:
            kwargs["extra_args"] = tuple(str(a) for a in kwargs["extra_args"])
        return cls(**kwargs)

    def with_changes(self, **changes: Any) -> "AppSettings":
        return replace(self, **changes)


class SettingsError(ValueError):
    pass


def settings_path() -> Path:
    return config_dir() / SETTINGS_FILE


def load_settings(path: Path | None = None) -> tuple[AppSettings, bool]:
    """The saved settings and whether a file existed (no file: a first run). Raises SettingsError when unreadable."""
    path = path or settings_path()
    if not path.exists():
        return AppSettings(), False
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(data, dict):
            raise TypeError("the top level is not an object")
        return AppSettings.from_dict(data), True
    except (OSError, ValueError, TypeError) as e:
        raise SettingsError(
            f"the settings file {path} cannot be read ({e}): fix it or delete it to start with defaults"
        ) from e


def save_settings(settings: AppSettings, path: Path | None = None) -> Path:
    path = path or settings_path()
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(settings.to_dict(), indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path
