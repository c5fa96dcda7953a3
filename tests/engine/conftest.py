"""Fixtures shared by the engine tests."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.testing.tiny_models import write_tiny_model


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Tiny models run in the test process: on a busy 2-core box a second intra-op thread makes them much slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def moe_q4k(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen3-MoE in Q4_K_M's block types (Q4_K, down projections Q6_K): what the fused CUDA kernels and the
    CPU's in-place kernels read."""
    return write_tiny_model(
        tmp_path_factory.mktemp("moe") / "m.gguf",
        "qwen3moe",
        qtype="Q4_K",
        types={"ffn_down": "Q6_K"},
        seed=5,
    )
