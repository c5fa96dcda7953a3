"""Where PolyStrata keeps its files (platformdirs), overridable for tests and portable installs."""

import os
import shutil
from pathlib import Path

import platformdirs

APP_NAME = "PolyStrata"


def _dir(env: str, default: str) -> Path:
    path = Path(os.environ.get(env) or default)
    path.mkdir(parents=True, exist_ok=True)
    return path


def data_dir() -> Path:
    """Models, usage profiles, chat history. STRATA_DATA_DIR overrides."""
    return _dir("STRATA_DATA_DIR", platformdirs.user_data_dir(APP_NAME, appauthor=False))


def config_dir() -> Path:
    """strata-<model>.json configs and app settings. STRATA_CONFIG_DIR overrides."""
    return _dir("STRATA_CONFIG_DIR", platformdirs.user_config_dir(APP_NAME, appauthor=False))


def models_dir() -> Path:
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def disk_free(folder: Path) -> int:
    """Free bytes where `folder` is (or would be made: its nearest existing parent)."""
    at = folder
    while not at.exists() and at != at.parent:
        at = at.parent
    return shutil.disk_usage(at).free
