"""Data files: icons, styles, the model catalog and default configs."""

from pathlib import Path

RESOURCES_DIR = Path(__file__).resolve().parent


def resource_path(name: str) -> Path:
    """Absolute path of a bundled resource file."""
    return RESOURCES_DIR / name
