"""One real server (subprocess, uvicorn on 127.0.0.1, a free port) on a tiny qwen3moe model, shared by the tests."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.testing.tiny_models import write_tiny_model
from tests.engine.serve.harness import ServerProc, start_server

MAX_CONTEXT = 2048


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """The tiny model's in-process runs: on a busy 2-core box a second intra-op thread makes them ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(
        tmp_path_factory.mktemp("serve") / "tiny-moe.gguf", arch="qwen3moe", qtype="Q8_0", seed=0
    )


@pytest.fixture(scope="session")
def server(tiny_model: Path) -> Iterator[ServerProc]:
    srv = start_server(
        tiny_model,
        "--device",
        "cpu",
        "--threads",
        "1",  # a tiny model gains nothing from more, and a busy 2-core box loses a lot
        "--max-context",
        str(MAX_CONTEXT),
        "--max-body-mib",
        "1",
        "--prompt-cache-mib",
        "64",
        "--max-queue",
        "256",
        "--alias",
        "gpt-test",
    )
    yield srv
    srv.stop()
