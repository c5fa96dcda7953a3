"""Finding and starting the engine executable (the app never imports the engine: it runs it)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path


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


def run_headless(args: list[str]) -> int:
    """Serve the API in the foreground, without a window (start scripts' --headless)."""
    cmd = [*engine_command(), "serve", *args]
    try:
        return subprocess.call(cmd)
    except KeyboardInterrupt:
        return 130
