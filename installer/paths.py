"""Where PolyStrata keeps its files (platformdirs), overridable for tests and portable installs."""

import os
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
