"""Finding and starting the engine executable (the app never imports the engine: it runs it)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

from app.settings import AppSettings, SettingsError, load_settings
from installer.config import default_config


def engine_command() -> list[str]:
    """The command that starts `strata-engine`: beside the app in a frozen bundle, else on PATH or in this venv."""
    if getattr(sys, "frozen", False):
        exe = Path(sys.executable).with_name("strata-engine" + (".exe" if os.name == "nt" else ""))
        if exe.exists():
            return [str(exe)]
    here = Path(sys.executable).parent / ("strata-engine" + (".exe" if os.name == "nt" else ""))
    if here.exists():
        return [str(here)]
    found = shutil.which("strata-engine")
    if found:
        return [found]
    return [sys.executable, "-m", "engine.cli"]


def configured_model(settings_file: Path | None = None) -> tuple[list[str], str] | None:
    """The model this PC serves when a command names none: the app's settings' model or config, else the config
    strata-setup made the configured one (installer.config.default_config) -> (serve arguments, what it is), or
    None (the engine's embedded model)."""
    try:
        settings, _ = load_settings(settings_file)
    except SettingsError:
        settings = AppSettings()
    if settings.model and Path(settings.model).is_file():
        return ["--model", settings.model], f"{settings.model} (the app's settings)"
    if settings.config and Path(settings.config).is_file():
        return ["--config", settings.config], f"{settings.config} (the app's settings)"
    found = default_config()
    if found is not None:
        return ["--config", str(found)], f"{found} (strata-setup)"
    return None


def run_headless(args: list[str]) -> int:
    """Serve the API in the foreground, without a window (start scripts' --headless): the configured model
    (configured_model) unless the arguments name a model or a config."""
    if not any(a.split("=", 1)[0] in ("--model", "-m", "--config") for a in args):
        got = configured_model()
        if got is not None:
            print(f"[polystrata] serving the configured model: {got[1]}", file=sys.stderr)
            args = [*got[0], *args]
    cmd = [*engine_command(), "serve", *args]
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 130
