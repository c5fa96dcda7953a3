"""Tiny models of every architecture for the verify-window tests (the shared decoder's and the families with
models of their own), written once per session; one torch thread (a 2-core box shared with other test runs
thrashes with more)."""

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine.testing.tiny_families import FAMILIES, write_tiny_family
from engine.testing.tiny_models import ARCHITECTURES, write_tiny_model

EVERY_ARCHITECTURE = (*ARCHITECTURES, *FAMILIES)


@pytest.fixture(autouse=True)
def _one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Four layers each (gemma3: its six, one global among sliding ones), so that a 2-stage split has two a stage."""
    d = tmp_path_factory.mktemp("spec")
    out = {}
    for arch in ARCHITECTURES:
        extra = {} if arch == "gemma3" else {"n_layer": 4}
        out[arch] = write_tiny_model(d / f"{arch}.gguf", arch, qtype="Q8_0", seed=3, **extra)
    for arch in FAMILIES:
        out[arch] = write_tiny_family(d / f"{arch}.gguf", arch, qtype="Q8_0", seed=3)
    return out
