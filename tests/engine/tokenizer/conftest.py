"""Tokenizer GGUF files written once per session, their metadata, and the transformers reference tokenizers."""

from pathlib import Path

import pytest

from engine.testing.tokenizer_fixture import tiny_bpe_metadata, tiny_spm_metadata
from tests.engine.tokenizer.gguf_files import TokenizerFile, read_metadata, write_tokenizer_gguf


@pytest.fixture(scope="session")
def bpe_file(tmp_path_factory: pytest.TempPathFactory) -> TokenizerFile:
    path = write_tokenizer_gguf(
        tmp_path_factory.mktemp("bpe") / "tiny-bpe.gguf", tiny_bpe_metadata(), "qwen2"
    )
    return TokenizerFile(path, read_metadata(path))


@pytest.fixture(scope="session")
def spm_file(tmp_path_factory: pytest.TempPathFactory) -> TokenizerFile:
    path = write_tokenizer_gguf(
        tmp_path_factory.mktemp("spm") / "tiny-spm.gguf", tiny_spm_metadata(), "llama"
    )
    return TokenizerFile(path, read_metadata(path))


@pytest.fixture(scope="session")
def gemma_file(gemma_path: Path) -> TokenizerFile:
    return TokenizerFile(gemma_path, read_metadata(gemma_path))
